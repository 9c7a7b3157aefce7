// The CUDA attention scores and paged window scores (<kvevict/cuda/score.cuh>) on the host: the kernels' own bodies
// (detail/block/score_ops.hpp) and launch sequence, run by the SIMT executor (detail/block/simt.hpp:
// fibers, real barriers and warp shuffles, shared-memory race and barrier-divergence checks), with
// the CUDA overload's checks, plan and workspace. Used by the host test test_score_device_logic
// (against attention_scores on seq and a naive reference) and by the GPU test (the device must match
// it bit for bit). Host only (owns std::vectors and the executor); nothing in the library's call
// paths includes it.
#pragma once

#include <kvevict/detail/block/score_ops.hpp>
#include <kvevict/detail/block/simt.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>

#include <cstdint>
#include <vector>

namespace kvevict::detail {

/// Runs launch(l, ws) twice on a simt_launcher over an executor seeded with `seed`: a size query,
/// then with a workspace of that size. Returns the checks' status, or errc::invalid_argument with the
/// executor's report (a race, barrier divergence, a bad warp operation) if a run failed.
template <class Launch>
status simt_two_phase(const char* fn, std::uint64_t seed, const Launch& launch) {
  simt_executor ex(seed);
  simt_launcher<simt_executor> l{ex};
  workspace ws;
  KVEVICT_TRY(launch(l, ws));
  std::vector<unsigned char> mem(ws.bytes + 1);
  ws.data = mem.data();
  KVEVICT_TRY(launch(l, ws));
  if (!l.ok) return status::error(errc::invalid_argument, "%s: the SIMT executor reports: %s", fn, ex.error().c_str());
  return {};
}

inline constexpr auto simt_host_aligned = [](const char*, const auto*) { return status{}; };

/// attention_scores (out_kv with 0 rows) or attention_scores_gqa (out_kv with rows; out_h with 0 rows:
/// no per-head output) of the CUDA backend on the host executor, every grid capped at grid_cap blocks.
template <class QE, class KE>
status emulate_cuda_attention_scores(kv_view<const QE> q, kv_view<const KE> prefix, kv_view<const KE> block,
                                     matrix_view<float> out_h, matrix_view<float> out_kv, gqa_op op,
                                     const score_options& opt, std::uint64_t seed = 1,
                                     index_t grid_cap = index_t(1) << 20) {
  constexpr const char* fn = "emulated attention_scores";
  const bool kv = out_kv.extent(0) > 0;
  return simt_two_phase(fn, seed, [&](simt_launcher<simt_executor>& l, workspace& ws) {
    return attention_scores_launch<QE, KE>(fn, l, ws, q, prefix, block, out_h, kv, out_kv, op, opt, simt_host_aligned,
                                           grid_cap);
  });
}

/// paged_window_scores of the CUDA backend on the host executor; rows it skips are counted into *bad.
template <class QE, class T>
status emulate_cuda_paged_window_scores(kv_view<const QE> q, paged_layer<T> layer, matrix_view<float> out,
                                        bool include_window, const score_options& opt, int* bad,
                                        std::uint64_t seed = 1, index_t grid_cap = index_t(1) << 20) {
  constexpr const char* fn = "emulated paged_window_scores";
  return simt_two_phase(fn, seed, [&](simt_launcher<simt_executor>& l, workspace& ws) {
    return paged_window_scores_launch<QE>(fn, l, ws, q, layer, out, include_window, opt, simt_host_aligned,
                                          simt_bad{bad, nullptr}, grid_cap);
  });
}

}  // namespace kvevict::detail
