// Helpers shared by the CUDA launchers of the scoring and post-processing stages: bounded grids for
// grid-stride loops, alignment checks of device pointers, and the device-side guard of per-row lengths
// stored in device memory (which the host cannot read without a synchronisation).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/status.hpp>
#include <kvevict/weight.hpp>

#include <cstdint>

namespace kvevict::detail {

/// CTAs for a grid-stride loop over `items` work items: min(items, 2^20) (never 0). Every kernel
/// loops `for (item = blockIdx.x; item < items; item += gridDim.x)` with 64-bit items, so any size
/// fits and the results do not depend on the grid.
inline unsigned grid_for(index_t items) {
  constexpr index_t cap = index_t(1) << 20;
  return static_cast<unsigned>(items < 1 ? 1 : items < cap ? items : cap);
}

/// errc::invalid_argument unless p (a device pointer, never dereferenced) is aligned for T.
template <class T>
status check_device_alignment(const char* fn, const char* name, const T* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0)
    return status::error(errc::invalid_argument, "%s: %s is not aligned to %zu bytes", fn, name, alignof(T));
  return {};
}

}  // namespace kvevict::detail
