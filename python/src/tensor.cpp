// python/src/tensor.cpp: reading PyTorch / NumPy / DLPack tensors as borrowed views (tensor.hpp).
#include "common.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <iterator>

namespace kvevict::python {

const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::f32: return "float32";
    case dtype::f16: return "float16";
    case dtype::bf16: return "bfloat16";
    case dtype::i32: return "int32";
    case dtype::u8: return "uint8";
    case dtype::boolean: return "bool";
    case dtype::f64: return "float64";
    case dtype::i64: return "int64";
    default: return "unsupported";
  }
}

std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::f32: case dtype::i32: return 4;
    case dtype::f16: case dtype::bf16: return 2;
    case dtype::u8: case dtype::boolean: return 1;
    case dtype::f64: case dtype::i64: return 8;
    default: return 1;
  }
}

void raise(errc code, std::string message) { throw status_error{code, std::move(message)}; }

index_t tensor::numel() const {
  index_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[static_cast<std::size_t>(i)];
  return n;
}

std::string tensor::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[static_cast<std::size_t>(i)]);
  return s + "]";
}

namespace {

// The DLPack ABI (dlpack.h, v0.x, which PyTorch 1.13 exports): declared here because Debian has
// no dlpack header package; these are the fields the exchange defines, nothing more.
struct dl_device {
  std::int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA host
  std::int32_t device_id;
};
struct dl_dtype {
  std::uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct dl_tensor {
  void* data;
  dl_device device;
  std::int32_t ndim;
  dl_dtype dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // elements; null = compact row-major
  std::uint64_t byte_offset;
};
struct dl_managed_tensor {
  dl_tensor dl;
  void* manager_ctx;
  void (*deleter)(dl_managed_tensor*);
};

dtype dtype_from_torch(const std::string& s) {
  if (s == "torch.float32") return dtype::f32;
  if (s == "torch.float16") return dtype::f16;
  if (s == "torch.bfloat16") return dtype::bf16;
  if (s == "torch.int32") return dtype::i32;
  if (s == "torch.uint8") return dtype::u8;
  if (s == "torch.bool") return dtype::boolean;
  if (s == "torch.float64") return dtype::f64;
  if (s == "torch.int64") return dtype::i64;
  return dtype::other;
}

dtype dtype_from_format(std::string f, std::size_t itemsize) {
  if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@' || f[0] == '!' || f[0] == '>')) f = f.substr(1);
  if (f == "f") return dtype::f32;
  if (f == "e") return dtype::f16;
  if (f == "d") return dtype::f64;
  if (f == "B") return dtype::u8;
  if (f == "?") return dtype::boolean;
  if ((f == "i" || f == "l") && itemsize == 4) return dtype::i32;
  if ((f == "l" || f == "q") && itemsize == 8) return dtype::i64;
  return dtype::other;
}

dtype dtype_from_dlpack(const dl_dtype& t) {
  if (t.lanes != 1) return dtype::other;
  if (t.code == 2 && t.bits == 32) return dtype::f32;
  if (t.code == 2 && t.bits == 16) return dtype::f16;
  if (t.code == 2 && t.bits == 64) return dtype::f64;
  if (t.code == 4 && t.bits == 16) return dtype::bf16;
  if (t.code == 0 && t.bits == 32) return dtype::i32;
  if (t.code == 0 && t.bits == 64) return dtype::i64;
  if (t.code == 1 && t.bits == 8) return dtype::u8;
  if (t.code == 6 && t.bits == 8) return dtype::boolean;
  return dtype::other;
}

bool is_torch_tensor(py::handle obj) {
  const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (!py::hasattr(type, "__module__")) return false;
  const std::string mod = py::str(type.attr("__module__"));
  return mod.rfind("torch", 0) == 0 && py::hasattr(obj, "data_ptr") && py::hasattr(obj, "stride");
}

void set_rank(tensor& t, int ndim, int rank) {
  if (ndim > 4) raise(errc::invalid_argument, t.name + ": rank " + std::to_string(ndim) + " is above 4");
  if (rank >= 0 && ndim != rank)
    raise(errc::shape_mismatch,
          t.name + " must have rank " + std::to_string(rank) + ", got rank " + std::to_string(ndim));
  t.ndim = ndim;
}

void read_torch(tensor& t, py::handle obj, int rank) {
  t.from = origin::torch;
  t.type = dtype_from_torch(py::str(obj.attr("dtype")));
  const py::tuple shape = obj.attr("shape");
  const py::tuple strides = obj.attr("stride")();
  set_rank(t, static_cast<int>(shape.size()), rank);
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[static_cast<std::size_t>(i)] = shape[static_cast<std::size_t>(i)].cast<index_t>();
    t.strides[static_cast<std::size_t>(i)] = strides[static_cast<std::size_t>(i)].cast<index_t>();
  }
  const py::object dev = obj.attr("device");
  const std::string kind = py::str(dev.attr("type"));
  if (kind == "cuda") {
    t.cuda = true;
    t.device = dev.attr("index").is_none() ? 0 : dev.attr("index").cast<int>();
  } else if (kind != "cpu") {
    raise(errc::invalid_argument, t.name + ": tensors on device '" + kind + "' are not supported (cpu, cuda)");
  }
  if (py::bool_(obj.attr("is_conj")()) || py::bool_(obj.attr("is_neg")()))
    raise(errc::invalid_argument, t.name + ": a lazily conjugated or negated tensor cannot be viewed; call resolve_conj()/resolve_neg()");
  t.data = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<std::uintptr_t>());
}

void read_buffer(tensor& t, py::handle obj, int rank, bool writable) {
  t.from = origin::numpy;
  auto view = std::make_shared<Py_buffer>();
  const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), view.get(), flags) != 0) {
    PyErr_Clear();
    raise(errc::invalid_argument, t.name + (writable ? ": the buffer is not writable" : ": the buffer cannot be read"));
  }
  t.keep_alive = std::shared_ptr<void>(view.get(), [view](void*) { PyBuffer_Release(view.get()); });
  t.type = dtype_from_format(view->format ? view->format : "B", static_cast<std::size_t>(view->itemsize));
  set_rank(t, view->ndim, rank);
  for (int i = 0; i < t.ndim; ++i) {
    const auto bytes = static_cast<index_t>(view->strides[i]);
    if (bytes % view->itemsize != 0)
      raise(errc::invalid_argument, t.name + ": a stride of " + std::to_string(bytes) +
                                        " bytes is not a whole number of elements");
    t.shape[static_cast<std::size_t>(i)] = static_cast<index_t>(view->shape[i]);
    t.strides[static_cast<std::size_t>(i)] = bytes / view->itemsize;
  }
  t.data = view->buf;
}

void read_dlpack(tensor& t, py::handle obj, int rank) {
  t.from = origin::dlpack;
  // A CUDA producer is asked to make its work visible on the legacy default stream (DLPack's
  // stream=1), the stream the CUDA path then runs DLPack tensors on (cuda_stream_of).
  bool on_cuda = false;
  if (py::hasattr(obj, "__dlpack_device__"))
    on_cuda = obj.attr("__dlpack_device__")().cast<py::tuple>()[0].cast<int>() == 2;
  py::object capsule = on_cuda ? obj.attr("__dlpack__")(py::arg("stream") = 1) : obj.attr("__dlpack__")();
  auto* managed = static_cast<dl_managed_tensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    raise(errc::invalid_argument, t.name + ": __dlpack__ did not return a DLPack capsule");
  }
  // consumed: the capsule must not delete it again; we call the deleter when the view ends
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  t.keep_alive = std::shared_ptr<void>(managed, [](void* p) {
    auto* m = static_cast<dl_managed_tensor*>(p);
    if (m->deleter) m->deleter(m);
  });
  const dl_tensor& d = managed->dl;
  t.type = dtype_from_dlpack(d.dtype);
  set_rank(t, d.ndim, rank);
  index_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[static_cast<std::size_t>(i)] = d.shape[i];
    t.strides[static_cast<std::size_t>(i)] = d.strides ? d.strides[i] : stride;
    stride *= d.shape[i];
  }
  if (d.device.device_type == 2) {
    t.cuda = true;
    t.device = d.device.device_id;
  } else if (d.device.device_type != 1 && d.device.device_type != 3) {
    raise(errc::invalid_argument, t.name + ": DLPack device type " + std::to_string(d.device.device_type) +
                                      " is not supported (CPU, CUDA)");
  }
  t.data = static_cast<char*>(d.data) + d.byte_offset;
}

}  // namespace

tensor as_tensor(py::handle obj, const char* name, int rank, bool writable) {
  tensor t;
  t.name = name;
  t.object = py::reinterpret_borrow<py::object>(obj);
  if (obj.is_none()) raise(errc::null_pointer, std::string(name) + " is None");
  if (is_torch_tensor(obj))
    read_torch(t, obj, rank);
  else if (PyObject_CheckBuffer(obj.ptr()))
    read_buffer(t, obj, rank, writable);
  else if (py::hasattr(obj, "__dlpack__"))
    read_dlpack(t, obj, rank);
  else
    raise(errc::invalid_argument, std::string(name) + ": expected a torch.Tensor, a NumPy array or a DLPack tensor, got " +
                                      std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  return t;
}

tensor as_optional(py::handle obj, const char* name, int rank, bool writable) {
  if (obj.is_none()) {
    tensor t;
    t.name = name;
    return t;
  }
  return as_tensor(obj, name, rank, writable);
}

void require_dtype(const tensor& t, std::initializer_list<dtype> allowed) {
  for (dtype d : allowed)
    if (t.type == d) return;
  std::string names;
  for (dtype d : allowed) names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
  raise(errc::invalid_argument, t.name + " has element type " + dtype_name(t.type) + "; expected " + names);
}

/// The bindings that run CUDA tensors on cuda_t in a CUDA build: the functions whose call goes
/// through on_device (common.hpp), which refuses any other name (so this list is the truth); registered
/// as kvevict.cuda_functions by register_errors.
const char* const cuda_functions[] = {
    "attention_scores",   "window_scores",       "h2o_scores",           "tova_scores",
    "key_norm_scores",    "position_scores",     "gqa_reduce",           "pool1d",
    "weight_by_value_norm", "protect",           "postprocess_scores",   "select_topk",
    "select_topk_flat",   "select_topk_ragged",  "select_topk_batch",    "compact",
    "compact_ragged",     "compact_inplace",     "recipe_scores",        "recipe_select",
    "append",             "compact_ragged_inplace", "compact_into_ragged_cache", "paged_key_norm_scores",
    "paged_weight_by_value_norm", "paged_window_scores", "compact_paged"};

namespace {
std::string cuda_function_list() {
  std::string which;
  for (const char* f : cuda_functions) which += (which.empty() ? "" : ", ") + std::string(f);
  return which;
}
}  // namespace

bool runs_on_cuda(const char* fn) {
  for (const char* f : cuda_functions)
    if (std::strcmp(f, fn) == 0) return true;
  return false;
}

void refuse_cuda(const char* fn, const tensor& t) {
  if (runs_on_cuda(fn) && !KVEVICT_PYTHON_CUDA)
    raise(errc::unsupported, std::string(fn) + ": " + t.name + " is a CUDA tensor; " + fn +
                                 " runs CUDA tensors in builds with CUDA, this build has none (kvevict.has_cuda is False)");
  raise(errc::unsupported, std::string(fn) + ": " + t.name + " is a CUDA tensor, and this call runs on the host only " +
                               "(CUDA tensors run in " + cuda_function_list() +
                               (KVEVICT_PYTHON_CUDA ? "" : ", in builds with CUDA; this build has none") +
                               "; kvevict.cuda_functions lists them)");
}

void require_host(const tensor& t) {
  if (!t.cuda) return;
  raise(errc::unsupported, t.name + " is a CUDA tensor, and this call runs on the host only (CUDA tensors run in " +
                               cuda_function_list() +
                               (KVEVICT_PYTHON_CUDA ? "" : ", in builds with CUDA; this build has none") +
                               "; kvevict.cuda_functions lists them)");
}

void require_same_device(std::initializer_list<const tensor*> ts) {
  const tensor* first = nullptr;
  for (const tensor* t : ts) {
    if (t->data == nullptr && t->ndim == 0) continue;
    if (first == nullptr) {
      first = t;
      continue;
    }
    if (t->cuda != first->cuda || (t->cuda && t->device != first->device))
      raise(errc::invalid_argument, t->name + " is on another device than " + first->name);
  }
}

tensor output(py::handle out, const char* name, const tensor& like, std::vector<index_t> shape, dtype type) {
  if (like.cuda && !KVEVICT_PYTHON_CUDA) require_host(like);  // refused before anything is allocated
  if (!out.is_none()) {
    tensor t = as_tensor(out, name, static_cast<int>(shape.size()), true);
    require_dtype(t, {type});
    for (std::size_t i = 0; i < shape.size(); ++i)
      if (t.shape[i] != shape[i]) {
        std::string want = "[";
        for (std::size_t j = 0; j < shape.size(); ++j) want += (j ? ", " : "") + std::to_string(shape[j]);
        raise(errc::shape_mismatch, std::string(name) + " is " + t.shape_string() + " but must be " + want + "]");
      }
    if (t.cuda != like.cuda) raise(errc::invalid_argument, std::string(name) + " is on another device than " + like.name);
    return t;
  }
  py::object made;
  if (like.from == origin::torch) {
    py::module_ torch = py::module_::import("torch");
    made = torch.attr("empty")(py::cast(shape), py::arg("dtype") = torch.attr(dtype_name(type)),
                               py::arg("device") = like.object.attr("device"));
  } else {
    if (like.cuda) raise(errc::unsupported, std::string(name) + ": pass out= for a CUDA DLPack input");
    if (type == dtype::bf16) raise(errc::invalid_argument, std::string(name) + ": NumPy has no bfloat16; pass out=");
    made = py::module_::import("numpy").attr("empty")(py::cast(shape), py::arg("dtype") = dtype_name(type));
  }
  return as_tensor(made, name, static_cast<int>(shape.size()), true);
}

const std::int32_t* int32_data(const tensor& t, index_t n) {
  if (t.data == nullptr && t.ndim == 0) return nullptr;
  require_dtype(t, {dtype::i32});
  if (t.ndim != 1 || t.shape[0] != n)
    raise(errc::shape_mismatch, t.name + " must hold " + std::to_string(n) + " int32 entries, got shape " + t.shape_string());
  if (n > 1 && t.strides[0] != 1) raise(errc::invalid_argument, t.name + " must be contiguous");
  return static_cast<const std::int32_t*>(t.data);
}

const std::int32_t* int32_array(const tensor& t, index_t n) {
  const std::int32_t* p = int32_data(t, n);
  if (p != nullptr) require_host(t);
  return p;
}

namespace {
std::atomic<int> g_threads{0};
}
par_t backend() { return par_t{g_threads.load(std::memory_order_relaxed)}; }
void set_num_threads(int n) {
  if (n < 0) raise(errc::invalid_argument, "set_num_threads: n must be >= 0 (0 = OpenMP's default)");
  g_threads.store(n, std::memory_order_relaxed);
}
int num_threads() { return g_threads.load(std::memory_order_relaxed); }

workspace scratch(std::size_t bytes, int slot) {
  thread_local std::vector<unsigned char> buffers[3];
  auto& b = buffers[slot];
  // never null: a workspace with null data is the library's size query, not a run
  if (b.size() < bytes || b.empty()) b.resize(bytes > 64 ? bytes : 64);
  return workspace{b.data(), b.size()};
}

gpu::raw raw_of(const tensor& t) {
  gpu::raw r;
  r.data = t.data;
  r.ndim = t.ndim;
  for (std::size_t i = 0; i < 4; ++i) {
    r.shape[i] = t.shape[i];
    r.strides[i] = t.strides[i];
  }
  r.elem = t.type == dtype::f32 ? 0 : t.type == dtype::f16 ? 1 : t.type == dtype::bf16 ? 2 : 3;
  return r;
}

gpu::stream_t cuda_stream_of(std::initializer_list<const tensor*> ts) {
  const tensor* first = nullptr;
  for (const tensor* t : ts) {
    if (t->data == nullptr && t->ndim == 0) continue;
    if (!t->cuda) raise(errc::invalid_argument, t->name + " is on the host but another tensor of the call is on a GPU");
    if (first == nullptr) first = t;
    else if (t->device != first->device) raise(errc::invalid_argument, t->name + " is on another GPU than " + first->name);
    else if ((t->from == origin::dlpack) != (first->from == origin::dlpack))
      raise(errc::unsupported, t->name + " and " + first->name +
                                   ": PyTorch CUDA tensors run on their current stream and DLPack ones on the legacy "
                                   "default stream; pass one kind per call");
  }
  if (first == nullptr) raise(errc::invalid_argument, "no CUDA tensor given");
  if (first->from == origin::dlpack) return nullptr;  // the legacy default stream (read_dlpack's stream=1)
  const py::object stream =
      py::module_::import("torch").attr("cuda").attr("current_stream")(first->object.attr("device"));
  return reinterpret_cast<CUstream_st*>(stream.attr("cuda_stream").cast<std::uintptr_t>());
}

void register_errors(py::module_& m) {
  static py::handle error_type;
  error_type = PyErr_NewExceptionWithDoc("kvevict.Error",
                                        "A kvevict call refused its input (or failed). str(e) is the library's "
                                        "message; e.code is the error code's name (e.g. 'shape_mismatch').",
                                        PyExc_ValueError, nullptr);
  m.attr("Error") = error_type;
  py::tuple cuda(std::size(cuda_functions));
  for (std::size_t i = 0; i < std::size(cuda_functions); ++i) cuda[i] = cuda_functions[i];
  m.attr("cuda_functions") = cuda;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const status_error& e) {
      py::object exc = py::reinterpret_borrow<py::object>(error_type)(e.message);
      exc.attr("code") = errc_name(e.code);
      PyErr_SetObject(error_type.ptr(), exc.ptr());
    }
  });
}

}  // namespace kvevict::python
