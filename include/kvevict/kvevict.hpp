// kvevict/kvevict.hpp: every host-side public header of the eviction pipeline. CUDA launchers are in
// <kvevict/cuda/*.cuh>; the training math (LookaheadKV, PruLong: host code that owns memory) is in
// <kvevict/train/*.hpp>, included on purpose only.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/batch.hpp>
#include <kvevict/budget.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/config.hpp>
#include <kvevict/driver.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/host_isa.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight.hpp>
#include <kvevict/workspace.hpp>
