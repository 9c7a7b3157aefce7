// python/src/tensor.hpp: how the binding sees Python tensors without copying them.
//
// A `tensor` is a borrowed view of a PyTorch tensor (read through its data_ptr / shape / stride /
// dtype / device attributes, so the extension does not link libtorch), of any object with the
// buffer protocol (NumPy) or of any DLPack producer (__dlpack__). Strides are in elements. The
// library's own view factories then check the layout (positive, non-aliasing strides), so a layout
// it cannot view is refused with its message before any work.
//
// Errors go to Python as kvevict.Error (a ValueError) carrying the library's errc name in `.code`.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvevict::python {
namespace py = pybind11;

enum class dtype { f32, f16, bf16, i32, u8, boolean, f64, i64, other };
const char* dtype_name(dtype t);
std::size_t dtype_size(dtype t);

/// A failed library status (or a binding check), thrown while the GIL may be released and
/// translated to kvevict.Error with the same message and errc name.
struct status_error {
  errc code;
  std::string message;
};
[[noreturn]] void raise(errc code, std::string message);
/// Throws a failed status as kvevict.Error.
inline void throw_if(const status& st) {
  if (!st.ok()) raise(st.code(), st.message());
}
template <class T>
T value_or_raise(const result<T>& r) {
  throw_if(r.error());
  return r.value();
}

/// Where the tensor came from: new outputs are made by the same library on the same device.
enum class origin { torch, numpy, dlpack };

struct tensor {
  void* data = nullptr;
  int ndim = 0;
  std::array<index_t, 4> shape{};
  std::array<index_t, 4> strides{};  // in elements
  dtype type = dtype::other;
  bool cuda = false;
  int device = 0;
  origin from = origin::numpy;
  std::string name;
  py::object object;                 // the Python object (returned as out=)
  std::shared_ptr<void> keep_alive;  // a buffer view or a DLPack capsule's managed tensor

  index_t numel() const;
  std::string shape_string() const;
};

/// Reads `obj` as a tensor of rank `rank` (or any rank for rank < 0). `writable` asks the buffer
/// protocol for write access. Refuses unsupported objects, ranks above 4, strides that are not a
/// whole number of elements.
tensor as_tensor(py::handle obj, const char* name, int rank, bool writable = false);
/// As as_tensor, None gives an empty optional tensor (data null, ndim 0).
tensor as_optional(py::handle obj, const char* name, int rank, bool writable = false);

/// Checks the element type against `allowed` (message names the argument and the types allowed).
void require_dtype(const tensor& t, std::initializer_list<dtype> allowed);
/// Host tensors only (this build has no CUDA path for the call).
void require_host(const tensor& t);
/// Every tensor on the device of the first.
void require_same_device(std::initializer_list<const tensor*> ts);

/// A new tensor of `shape` and `type` made by the library `like` came from (PyTorch on its
/// device, NumPy otherwise), or `out` checked against shape and type when it is not None.
tensor output(py::handle out, const char* name, const tensor& like, std::vector<index_t> shape, dtype type);

/// Views of a tensor (rank and element type checked by the caller through require_dtype).
template <class T>
kv_view<T> kv(const tensor& t) {
  const index_t ext[3] = {t.shape[0], t.shape[1], t.shape[2]};
  const index_t str[3] = {t.strides[0], t.strides[1], t.strides[2]};
  return value_or_raise(detail::make_strided<T, 3>(t.name.c_str(), static_cast<T*>(t.data), ext, str));
}
template <class T>
matrix_view<T> mat(const tensor& t) {
  const index_t ext[2] = {t.shape[0], t.shape[1]};
  const index_t str[2] = {t.strides[0], t.strides[1]};
  return value_or_raise(detail::make_strided<T, 2>(t.name.c_str(), static_cast<T*>(t.data), ext, str));
}
/// An optional 1-D int32 array of `n` entries, contiguous (row lengths, offsets); null for None.
/// int32_array: on the host (read by the binding or a host-only call); int32_data: on either device
/// (passed through to a call that on_device may run on the GPU).
const std::int32_t* int32_array(const tensor& t, index_t n);
const std::int32_t* int32_data(const tensor& t, index_t n);

/// Calls f(T{}) with T the KV element type of `t` (float, float16, bfloat16).
template <class F>
decltype(auto) dispatch_kv(const tensor& t, F&& f) {
  switch (t.type) {
    case dtype::f32: return f(float{});
    case dtype::f16: return f(float16{});
    case dtype::bf16: return f(bfloat16{});
    default:
      raise(errc::invalid_argument,
            t.name + ": element type " + dtype_name(t.type) + " is not a KV type (float32, float16, bfloat16)");
  }
}
template <class T>
constexpr dtype dtype_of() {
  if constexpr (std::is_same_v<T, float>) return dtype::f32;
  else if constexpr (std::is_same_v<T, float16>) return dtype::f16;
  else if constexpr (std::is_same_v<T, bfloat16>) return dtype::bf16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return dtype::i32;
  else return dtype::other;
}

/// The backend every binding runs on: par with the thread count set by kvevict.set_num_threads
/// (0 = OpenMP's default). seq and par give identical bits, so no choice of backend is exposed.
par_t backend();
void set_num_threads(int n);
int num_threads();

/// A per-thread scratch buffer of at least `bytes` (reused across calls: no allocation once warm);
/// `slot` tells apart the workspaces one call needs at the same time.
workspace scratch(std::size_t bytes, int slot = 0);

void register_errors(py::module_& m);

}  // namespace kvevict::python
