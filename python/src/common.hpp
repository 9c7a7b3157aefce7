// python/src/common.hpp: what every binding file shares: running a library call with the GIL
// released (two-phase workspaces included), KV element-type checks, ragged outputs.
#pragma once

#include "cuda_bridge.hpp"
#include "tensor.hpp"

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

/// A float32 matrix argument on either device (a call through on_device); float_matrix: on the host.
inline tensor score_matrix(py::handle obj, const char* name, bool writable = false) {
  tensor t = as_tensor(obj, name, 2, writable);
  require_dtype(t, {dtype::f32});
  return t;
}
inline tensor float_matrix(py::handle obj, const char* name, bool writable = false) {
  tensor t = score_matrix(obj, name, writable);
  require_host(t);
  return t;
}

/// An optional 3-D KV view (empty when the tensor is).
template <class T>
kv_view<const T> optional_kv(const tensor& t) {
  return t.data == nullptr && t.ndim == 0 ? kv_view<const T>{} : kv<const T>(t);
}

/// The offsets cu [R+1] of per-row counts (int32 [R], a CPU tensor: they size a ragged output, also
/// of a CUDA call), checked non-negative and the total <= INT32_MAX.
std::vector<std::int32_t> host_offsets(py::handle counts, index_t rows);

/// out=(a, b) of a call with two outputs (each None when out is None); `what` names them.
std::pair<py::handle, py::handle> out_pair(py::handle out, const char* what);
/// A contiguous int32 [n] output: new like `like`, or out checked.
tensor int32_output(py::handle out, const char* name, const tensor& like, index_t n);

/// The outputs of a ragged call with offsets host_cu (host_offsets): positions [total] and cu [R+1]
/// int32 made like `like` or taken from out=(positions, cu) (contiguous, `like`'s device). On the
/// host cu is filled here; a CUDA call copies host_cu to the device (cuda_bridge.hpp).
struct ragged_outputs {
  std::vector<std::int32_t> host_cu;
  tensor positions, cu;

  ragged_outputs(py::handle out, const tensor& like, std::vector<std::int32_t> offsets, bool gpu);
};

/// The CUDA path (cuda_bridge.hpp). raw_of: a tensor as the bridge reads it (absent: data null).
gpu::raw raw_of(const tensor& t);
/// The stream of a call whose tensors (the non-empty ones) are all CUDA tensors of one device and
/// one kind: a PyTorch tensor's current stream, or the legacy default stream (null) for DLPack.
gpu::stream_t cuda_stream_of(std::initializer_list<const tensor*> ts);
/// Refuses the CUDA tensor `t` of a call to `fn`: fn is not in cuda_functions (the message names
/// them), or this build has no CUDA.
[[noreturn]] void refuse_cuda(const char* fn, const tensor& t);
/// Whether `fn` is in cuda_functions (kvevict.cuda_functions).
bool runs_on_cuda(const char* fn);

/// Where a call runs, decided before any work: false when no tensor of `ts` is a CUDA tensor (the
/// host path); true in a CUDA build for `fn` listed in cuda_functions; otherwise the call is refused
/// naming the functions that take CUDA tensors. Calls that prepare host-side metadata (offsets,
/// tables) ask first, then run through on_device.
inline bool runs_on_gpu(const char* fn, std::initializer_list<const tensor*> ts) {
  for (const tensor* t : ts)
    if (t->cuda) {
      if (!KVEVICT_PYTHON_CUDA || !runs_on_cuda(fn)) refuse_cuda(fn, *t);
      return true;
    }
  return false;
}

/// The one place where a call chooses its backend. No CUDA tensor among `ts`: host() runs the host
/// path (par_t; it releases the GIL itself). Otherwise, in a CUDA build and for `fn` listed in
/// cuda_functions, every non-empty tensor of `ts` must be on one GPU (one kind: PyTorch or DLPack)
/// and cuda(stream) -> status runs the bridge without the GIL; else the call is refused naming the
/// functions that take CUDA tensors. `ts` lists every device tensor of the call, outputs included
/// (host-side metadata that the bridge copies to the device is not among them).
template <class Host, class Cuda>
void on_device(const char* fn, std::initializer_list<const tensor*> ts, Host&& host, Cuda&& cuda) {
  if (!runs_on_gpu(fn, ts)) {
    host();
    return;
  }
  if constexpr (KVEVICT_PYTHON_CUDA) {
    const gpu::stream_t stream = cuda_stream_of(ts);
    run([&] { return cuda(stream); });
  } else {
    (void)cuda;
  }
}

/// cake_window_preference's arguments (single-process and sharded): float32 host tensors.
struct cake_window_args {
  tensor q, k;
  cake_options opt;

  cake_window_args(py::handle q_, py::handle k_, double tau1, double tau2)
      : q(as_tensor(q_, "window_queries", 3)), k(as_tensor(k_, "keys", 3)) {
    for (const tensor* t : {&q, &k}) {
      require_dtype(*t, {dtype::f32});
      require_host(*t);
    }
    opt.tau1 = tau1;
    opt.tau2 = tau2;
  }
  kv_view<const float> queries() const { return kv<const float>(q); }
  kv_view<const float> keys() const { return kv<const float>(k); }
};

void bind_enums(py::module_& m);
void bind_stages(py::module_& m);
void bind_recipes(py::module_& m);
void bind_budget(py::module_& m);
void bind_extras(py::module_& m);
void bind_drivers(py::module_& m);

}  // namespace kvevict::python
