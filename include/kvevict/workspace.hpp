// kvevict/workspace.hpp: caller-provided scratch memory, the CUB two-phase way.
//
//   kvevict::workspace ws;                      // ws.data == nullptr: a size query
//   st = kvevict::select_topk(be, ws, ...);     // sets ws.bytes, does no work
//   ws.data = my_arena.allocate(ws.bytes);      // the engine owns the memory
//   st = kvevict::select_topk(be, ws, ...);     // does the work, allocates nothing
//
// The size depends only on shapes and backend (for `par`, on the thread count), never on the
// data, so one query per shape is enough and the buffer may be reused across calls. Stages that
// need no scratch ignore the workspace. A buffer smaller than the query's answer gives
// errc::workspace_too_small.
#pragma once

#include <kvevict/status.hpp>

#include <cstddef>
#include <cstdint>

namespace kvevict {

struct workspace {
  void* data = nullptr;   ///< nullptr: the call only reports the bytes it needs in `bytes`
  std::size_t bytes = 0;  ///< size of `data` (in), or the size needed (out, on a query)

  bool is_query() const noexcept { return data == nullptr; }
};

namespace detail {

/// The `bytes` of scratch at `scratch` (a workspace's carved part; null or 0: none) must not share
/// memory with any of `ranges` (each with `begin`/`end` addresses; empty ranges never overlap).
/// Error: "fn: the workspace and <names[i]> overlap in memory".
template <class Range, std::size_t N>
status check_scratch_disjoint(const char* fn, const void* scratch, std::size_t bytes, const Range (&ranges)[N],
                              const char* const (&names)[N]) noexcept {
  if (scratch == nullptr || bytes == 0) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(scratch), e = b + bytes;
  for (std::size_t i = 0; i < N; ++i)
    if (ranges[i].begin < ranges[i].end && ranges[i].begin < e && b < ranges[i].end)
      return status::error(errc::overlap, "%s: the workspace and %s overlap in memory", fn, names[i]);
  return {};
}

/// Hands out aligned sub-buffers of a workspace, computing the same layout in both phases.
///   workspace_carver c(ws);
///   float* a = c.take<float>(n);  int* b = c.take<int>(m);
///   if (auto st = c.finish("fn"); !st.ok() || ws.is_query()) return st;
class workspace_carver {
 public:
  explicit workspace_carver(workspace& ws) noexcept : ws_(ws) {}

  template <class T>
  T* take(std::size_t count, std::size_t align = 64) noexcept {
    offset_ = (offset_ + align - 1) / align * align;
    T* p = ws_.is_query() || offset_ + count * sizeof(T) > ws_.bytes
               ? nullptr
               : reinterpret_cast<T*>(static_cast<unsigned char*>(ws_.data) + offset_);
    offset_ += count * sizeof(T);
    return p;
  }

  std::size_t used() const noexcept { return offset_; }

  /// After finish() on a real buffer: the bytes carved so far must not share memory with anything
  /// else the call reads or writes (`ranges[i]` has `begin`/`end` addresses, e.g. detail::byte_range;
  /// empty ranges never overlap). Error: "fn: the workspace and <names[i]> overlap in memory".
  template <class Range, std::size_t N>
  status check_disjoint(const char* fn, const Range (&ranges)[N], const char* const (&names)[N]) const noexcept {
    return check_scratch_disjoint(fn, ws_.is_query() ? nullptr : ws_.data, offset_, ranges, names);
  }

  /// On a query, stores the size needed; otherwise checks the buffer was big enough.
  status finish(const char* fn) noexcept {
    if (ws_.is_query()) {
      ws_.bytes = offset_;
      return {};
    }
    if (ws_.bytes < offset_)
      return status::error(errc::workspace_too_small, "%s: workspace has %zu bytes, %zu needed (query the size first)",
                           fn, ws_.bytes, offset_);
    return {};
  }

 private:
  workspace& ws_;
  std::size_t offset_ = 0;
};

}  // namespace detail
}  // namespace kvevict
