// kvevict/metrics.hpp: evaluation metrics (host-only, not hot-path stages).
//
//   <kvevict/metrics/footprint.hpp>  eviction schedules and their recorder, KV footprint, peak KV,
//                                    critical footprint ("Cache Me If You Can" §2.1, appendix A)
//   <kvevict/metrics/ranking.hpp>    recall@k of an estimate or of kept sets, Kendall's τ-b
//   <kvevict/metrics/lava_loss.hpp>  LAVa layer attention output loss (Lemma 1) and bound (Theorem 1)
//
// See docs/metrics.md for the definitions, closed forms and conventions.
#pragma once

#include <kvevict/metrics/footprint.hpp>
#include <kvevict/metrics/lava_loss.hpp>
#include <kvevict/metrics/ranking.hpp>
