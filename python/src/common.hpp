// python/src/common.hpp: what every binding file shares: running a library call with the GIL
// released (two-phase workspaces included), KV element-type checks, ragged outputs.
#pragma once

#include "tensor.hpp"
#if KVEVICT_PYTHON_CUDA
#  include "cuda_bridge.hpp"
#endif

#include <kvevict/kvevict.hpp>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <utility>

namespace kvevict::python {

/// Runs f() -> status without the GIL; a failed status becomes kvevict.Error.
template <class F>
void run(F&& f) {
  py::gil_scoped_release nogil;
  throw_if(f());
}

/// Runs a two-phase call f(workspace&) -> status without the GIL: the size query, then the call
/// on this thread's scratch buffer `slot`.
template <class F>
void run_ws(F&& f, int slot = 0) {
  py::gil_scoped_release nogil;
  workspace q{};
  throw_if(f(q));
  workspace ws = scratch(q.bytes, slot);
  throw_if(f(ws));
}

/// Every given (non-empty) tensor holds KV elements of one type.
inline void require_kv_type(std::initializer_list<const tensor*> ts) {
  const tensor* first = nullptr;
  for (const tensor* t : ts) {
    if (t->data == nullptr && t->ndim == 0) continue;
    require_dtype(*t, {dtype::f32, dtype::f16, dtype::bf16});
    if (first == nullptr) first = t;
    else if (t->type != first->type)
      raise(errc::invalid_argument, t->name + " is " + dtype_name(t->type) + " but " + first->name + " is " +
                                        dtype_name(first->type) + " (one element type per call)");
  }
}

/// Every given (non-empty) tensor holds KV elements of one type, on the host.
inline void require_kv(std::initializer_list<const tensor*> ts) {
  require_kv_type(ts);
  for (const tensor* t : ts) require_host(*t);
}

/// A host float32 matrix argument.
inline tensor float_matrix(py::handle obj, const char* name, bool writable = false) {
  tensor t = as_tensor(obj, name, 2, writable);
  require_dtype(t, {dtype::f32});
  require_host(t);
  return t;
}

/// An optional 3-D KV view (empty when the tensor is).
template <class T>
kv_view<const T> optional_kv(const tensor& t) {
  return t.data == nullptr && t.ndim == 0 ? kv_view<const T>{} : kv<const T>(t);
}

/// int32 offsets cu[R+1] of per-row counts (prefix sums), checked non-negative.
std::vector<index_t> offsets_of(const tensor& counts, index_t rows);

/// A new 1-D int32 tensor of n entries like `like` (PyTorch or NumPy), filled from `values`.
tensor int32_vector(const tensor& like, const char* name, const std::vector<index_t>& values);

#if KVEVICT_PYTHON_CUDA
/// The CUDA path (cuda_bridge.hpp): PyTorch CUDA tensors, one device, on the device's current stream.
gpu::raw raw_of(const tensor& t);
CUstream_st* cuda_stream_of(std::initializer_list<const tensor*> ts);
#endif

void bind_enums(py::module_& m);
void bind_stages(py::module_& m);
void bind_recipes(py::module_& m);
void bind_budget(py::module_& m);
void bind_extras(py::module_& m);
void bind_drivers(py::module_& m);

}  // namespace kvevict::python
