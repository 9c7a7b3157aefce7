// The block abstraction: device algorithms in detail/block/ are written once against one of two
// small execution contracts and run unchanged on the GPU (include/kvevict/cuda/) and on the host
// (the SIMT executor of detail/block/simt.hpp, or host_block.hpp's emulated block). Not API.
//
// Block (selection, compaction: detail/block/select_block.hpp, compact_block.hpp), one object per
// thread block, thread-indexed:
//   int  size() const                         threads in the block
//   void each(F f)                            f(tid) for every thread (device: for this thread)
//   void sync()                               barrier (host: nothing)
//   void exclusive_sum(V v, Then then)        own = v(tid) (ucount); block-wide exclusive prefix sum
//                                             in tid order; then(tid, own, prefix, total) on every
//                                             thread; ends with a barrier
//   void atomic_add(std::uint32_t*, std::uint32_t), atomic_add(ucount*, ucount)
//   void plain_read(const void* p, size_t n), plain_write(void* p, size_t n)
//                                             announce the plain C++ access of n bytes at p the calling
//                                             thread makes next (shared memory: race-checked by the
//                                             SIMT executor like the context's ld / st; no-ops on the
//                                             GPU and in host_block)
// Code outside each() runs on every thread of a CUDA block and once on the host; it only computes
// values that are the same on every thread (uniform) and reads memory written before a barrier. All
// writes happen inside each(). GPU and host SIMT executor: detail::simt_block (select_ops.hpp, one
// object per thread); host emulation: host_block.
//
// Ctx (pooling, post-processing: detail/block/pool_block.hpp, postprocess_device.hpp), loop-shared:
//   void each(index_t n, F f)                 f(i) for i in [0, n), the block's threads sharing the loop
//   void sync()                               barrier
//   void plain_read(p, n), plain_write(p, n)  as for Block
//   void l1_norms(base, rs, es, n, d, norms)  norms[t] = ||row t||_1 (rows staged through shared
//                                             memory, simt_staged_row_reduce)
// GPU and host SIMT executor: detail::simt_loop_ctx (postprocess_ops.hpp).
#pragma once

namespace kvevict::detail {

using ucount = unsigned long long;  ///< 64-bit counters (CUDA's atomicAdd has no std::uint64_t overload)
static_assert(sizeof(ucount) == 8, "ucount must be 64-bit");

}  // namespace kvevict::detail
