// kvevict/workspace.hpp: caller-provided scratch memory, the CUB two-phase way.
//
//   kvevict::workspace ws;                      // ws.data == nullptr: a size query
//   st = kvevict::select_topk(be, ws, ...);     // sets ws.bytes, does no work
//   ws.data = my_arena.allocate(ws.bytes);      // the engine owns the memory
//   st = kvevict::select_topk(be, ws, ...);     // does the work, allocates nothing
//
// The size depends only on shapes and backend (for `par`, on the thread count), never on the
// data, so one query per shape is enough and the buffer may be reused across calls. Stages that
// need no scratch ignore the workspace. `ws.data` may have any alignment: the stage aligns its
// sub-buffers itself and the query's answer includes the worst-case padding for that. A buffer
// smaller than the query's answer gives errc::workspace_too_small (on any base).
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

/// The largest alignment a carved sub-buffer gets, and so the worst-case padding (this minus one)
/// every size query includes: the caller's `ws.data` may have any alignment (an arena pointer + 4).
inline constexpr std::size_t workspace_max_align = 64;

/// Test hook: when set, called with every pointer a carver hands out, alignof(T) and the requested
/// alignment (tests check them; one load and branch per sub-buffer, nothing per element).
inline void (*workspace_take_hook)(const void* p, std::size_t type_align, std::size_t align) = nullptr;

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
/// The layout starts at `ws.data` rounded up to workspace_max_align (the absolute address, so a
/// 64-bit counter is aligned whatever the caller's pointer); a query adds the worst-case padding,
/// so its answer is enough for any base alignment. Offsets (`used()`) count from `ws.data`.
class workspace_carver {
 public:
  explicit workspace_carver(workspace& ws) noexcept : ws_(ws) {}

  template <class T>
  T* take(std::size_t count, std::size_t align = workspace_max_align) noexcept {
    static_assert(alignof(T) <= workspace_max_align, "workspace_carver: type over-aligned for a workspace");
    // align divides workspace_max_align, so an aligned base keeps every offset's alignment absolute
    if (align < alignof(T)) align = alignof(T);
    if (align > workspace_max_align || (align & (align - 1)) != 0) align = workspace_max_align;
    if (!started_) {
      started_ = true;
      pad_ = ws_.is_query() ? workspace_max_align - 1
                            : (workspace_max_align - reinterpret_cast<std::uintptr_t>(ws_.data) % workspace_max_align) %
                                  workspace_max_align;
    }
    offset_ = (offset_ + align - 1) / align * align;
    const std::size_t at = offset_;
    offset_ += count * sizeof(T);
    T* p = ws_.is_query() || needed() > ws_.bytes
               ? nullptr
               : reinterpret_cast<T*>(static_cast<unsigned char*>(ws_.data) + pad_ + at);
    if (p != nullptr && workspace_take_hook != nullptr) workspace_take_hook(p, alignof(T), align);
    return p;
  }

  /// Bytes from `ws.data` to the end of the last sub-buffer (on a query: with the worst-case padding).
  std::size_t used() const noexcept { return pad_ + offset_; }

  /// The query's answer: the layout plus the worst-case padding, whatever this call's base (so a
  /// buffer smaller than its query fails on every base, not only on unlucky ones).
  /// A layout of 0 bytes needs nothing (its pointers are never dereferenced).
  std::size_t needed() const noexcept { return offset_ > 0 ? workspace_max_align - 1 + offset_ : 0; }

  /// After finish() on a real buffer: the bytes carved so far must not share memory with anything
  /// else the call reads or writes (`ranges[i]` has `begin`/`end` addresses, e.g. detail::byte_range;
  /// empty ranges never overlap). Error: "fn: the workspace and <names[i]> overlap in memory".
  template <class Range, std::size_t N>
  status check_disjoint(const char* fn, const Range (&ranges)[N], const char* const (&names)[N]) const noexcept {
    return check_scratch_disjoint(fn, ws_.is_query() ? nullptr : ws_.data, used(), ranges, names);
  }

  /// On a query, stores the size needed; otherwise checks the buffer was big enough.
  status finish(const char* fn) noexcept {
    if (ws_.is_query()) {
      ws_.bytes = needed();
      return {};
    }
    if (ws_.bytes < needed())
      return status::error(errc::workspace_too_small, "%s: workspace has %zu bytes, %zu needed (query the size first)",
                           fn, ws_.bytes, needed());
    return {};
  }

 private:
  workspace& ws_;
  bool started_ = false;
  std::size_t pad_ = 0;     ///< bytes from ws.data to the aligned base (query: the worst case)
  std::size_t offset_ = 0;  ///< from the aligned base
};

}  // namespace detail
}  // namespace kvevict
