// python/src/ragged.cpp: ragged caches with capacity (kvevict::ragged_cache, docs/compact.md):
// one [rows][d] buffer in which head h owns rows cu_capacity[h] .. cu_capacity[h+1] and holds
// lens[h] of them; decode-time `append`, in-place compaction, and compaction of a dense cache into
// one. The caller's tensors are read and written in place (lens included).
#include "common.hpp"

namespace kvevict::python {

namespace {

/// The caller's ragged cache: buffer [rows][d] (KV type, rows of contiguous elements),
/// cu_capacity [H+1] and lens [H] (int32, contiguous; lens written by the calls), on one device.
struct cache_args {
  tensor buffer, cu, lens;
  index_t heads = 0;

  cache_args(py::handle b, py::handle c, py::handle l) {
    buffer = as_tensor(b, "buffer", 2, true);
    require_kv_type({&buffer});
    cu = as_tensor(c, "cu_capacity", 1);
    lens = as_tensor(l, "lens", 1, true);
    for (const tensor* t : {&cu, &lens}) require_dtype(*t, {dtype::i32});
    heads = lens.shape[0];
    if (cu.shape[0] != heads + 1)
      raise(errc::shape_mismatch, "cu_capacity has " + std::to_string(cu.shape[0]) + " entries but lens " +
                                      std::to_string(heads) + " (it needs heads + 1)");
    if (buffer.shape[1] > 1 && buffer.strides[1] != 1)
      raise(errc::invalid_argument, "buffer: the head dim must be contiguous (stride 1), got stride " +
                                        std::to_string(buffer.strides[1]));
  }

  /// The cache; on the host cu_capacity is checked against the buffer's rows here (on a GPU the
  /// bridge reads it back and checks it).
  template <class T>
  ragged_cache<T> view(bool gpu) const {
    ragged_cache<T> c;
    c.data = static_cast<T*>(buffer.data);
    c.cu_capacity = int32_data(cu, heads + 1);
    c.lens = const_cast<std::int32_t*>(int32_data(lens, heads));
    c.heads = heads;
    c.dim = buffer.shape[1];
    c.row_stride = buffer.strides[0];
    const index_t rows = heads > 0 && !gpu ? c.cu_capacity[heads] : 0;
    if (rows > buffer.shape[0])
      raise(errc::shape_mismatch, "cu_capacity lists " + std::to_string(rows) + " rows but buffer has " +
                                      std::to_string(buffer.shape[0]));
    return c;
  }
};

/// kept (positions, cu) int32 of `heads` heads, on either device.
ragged_positions kept_of(py::handle positions_, py::handle cu_, index_t heads, tensor& pos, tensor& cu) {
  pos = as_tensor(positions_, "positions", 1);
  cu = as_tensor(cu_, "cu", 1);
  for (const tensor* t : {&pos, &cu}) require_dtype(*t, {dtype::i32});
  return ragged_positions{int32_data(pos, pos.shape[0]), int32_data(cu, heads + 1), heads};
}

void append_py(py::handle b, py::handle c, py::handle l, py::handle rows_) {
  const cache_args a(b, c, l);
  const tensor rows = as_tensor(rows_, "rows", 3);
  require_kv_type({&a.buffer, &rows});
  const bool gpu = runs_on_gpu("append", {&a.buffer, &a.cu, &a.lens, &rows});
  dispatch_kv(a.buffer, [&](auto e) {
    using T = decltype(e);
    const auto cache = a.view<T>(gpu);
    on_device(
        "append", {&a.buffer, &a.cu, &a.lens, &rows},
        [&] {
          const auto rv = kv<const T>(rows);
          run([&] { return append(backend(), cache, rv); });
        },
        [&](gpu::stream_t st) { return gpu::append<T>(cache, a.buffer.shape[0], raw_of(rows), st); });
  });
}

void compact_inplace_py(py::handle b, py::handle c, py::handle l, py::handle positions_, py::handle cu_) {
  const cache_args a(b, c, l);
  tensor pos, cu;
  const ragged_positions kept = kept_of(positions_, cu_, a.heads, pos, cu);
  const bool gpu = runs_on_gpu("compact_ragged_inplace", {&a.buffer, &a.cu, &a.lens, &pos, &cu});
  dispatch_kv(a.buffer, [&](auto e) {
    using T = decltype(e);
    const auto cache = a.view<T>(gpu);
    on_device(
        "compact_ragged_inplace", {&a.buffer, &a.cu, &a.lens, &pos, &cu},
        [&] { run([&] { return compact_inplace(backend(), cache, kept); }); },
        [&](gpu::stream_t st) { return gpu::compact_ragged_inplace<T>(cache, a.buffer.shape[0], kept, st); });
  });
}

void compact_into_py(py::handle src_, py::handle positions_, py::handle cu_, py::handle b, py::handle c, py::handle l) {
  const cache_args a(b, c, l);
  const tensor src = as_tensor(src_, "src", 3);
  require_kv_type({&a.buffer, &src});
  tensor pos, cu;
  const ragged_positions kept = kept_of(positions_, cu_, src.shape[0], pos, cu);
  const bool gpu = runs_on_gpu("compact_into_ragged_cache", {&src, &pos, &cu, &a.buffer, &a.cu, &a.lens});
  dispatch_kv(a.buffer, [&](auto e) {
    using T = decltype(e);
    const auto cache = a.view<T>(gpu);
    on_device(
        "compact_into_ragged_cache", {&src, &pos, &cu, &a.buffer, &a.cu, &a.lens},
        [&] {
          const auto sv = kv<const T>(src);
          run([&] { return compact(backend(), sv, kept, cache); });
        },
        [&](gpu::stream_t st) {
          return gpu::compact_into_ragged_cache<T>(raw_of(src), kept, cache, a.buffer.shape[0], st);
        });
  });
}

// compact_layer: keys and values buffers [rows][d] and positions [rows] (int32: each row's original
// position) sharing one cu_capacity and one lens
void compact_layer_py(py::handle kb, py::handle vb, py::handle pb, py::handle c, py::handle l, py::handle positions_,
                      py::handle cu_) {
  const cache_args keys(kb, c, l), values(vb, c, l);
  require_kv_type({&keys.buffer, &values.buffer});
  const tensor rows = as_tensor(pb, "positions_buffer", 1, true);
  require_dtype(rows, {dtype::i32});
  tensor pos, cu;
  const ragged_positions kept = kept_of(positions_, cu_, keys.heads, pos, cu);
  // no cuda_t path in the library (compact_layer runs on the host backends)
  for (const tensor* t : std::initializer_list<const tensor*>{&keys.buffer, &values.buffer, &keys.cu, &keys.lens, &rows, &pos, &cu})
    require_host(*t);
  dispatch_kv(keys.buffer, [&](auto e) {
    using T = decltype(e);
    const auto kc = keys.view<T>(false), vc = values.view<T>(false);
    ragged_cache<pos_t> pc;
    pc.data = static_cast<pos_t*>(rows.data);
    pc.cu_capacity = kc.cu_capacity;
    pc.lens = kc.lens;
    pc.heads = kc.heads;
    pc.dim = 1;
    pc.row_stride = rows.strides[0];
    const index_t needed = kc.heads > 0 ? kc.cu_capacity[kc.heads] : 0;
    if (rows.shape[0] < needed)
      raise(errc::shape_mismatch, "positions_buffer has " + std::to_string(rows.shape[0]) + " rows but cu_capacity lists " +
                                      std::to_string(needed));
    run([&] { return compact_layer(backend(), kc, vc, pc, kept); });
  });
}

}  // namespace

void bind_ragged(py::module_& m) {
  using namespace pybind11::literals;
  m.def("append", &append_py, "buffer"_a, "cu_capacity"_a, "lens"_a, "rows"_a,
        "Decode-time append to a ragged cache: rows [H][n][d] become rows lens[h] .. of head h's region "
        "(buffer rows cu_capacity[h] ..), lens += n, in place; all heads checked before anything is written.");
  m.def("compact_ragged_inplace", &compact_inplace_py, "buffer"_a, "cu_capacity"_a, "lens"_a, "positions"_a, "cu"_a,
        "In place on a ragged cache: head h keeps its rows positions[cu[h]:cu[h+1]] (ascending, < lens[h]), packed to "
        "the front of its region; lens[h] becomes their count.");
  m.def("compact_into_ragged_cache", &compact_into_py, "src"_a, "positions"_a, "cu"_a, "buffer"_a, "cu_capacity"_a,
        "lens"_a, "Gathers src [H][T][d]'s kept rows (positions, cu) into a ragged cache with capacity; lens = counts.");
  m.def("compact_layer", &compact_layer_py, "key_buffer"_a, "value_buffer"_a, "positions_buffer"_a, "cu_capacity"_a,
        "lens"_a, "positions"_a, "cu"_a,
        "A driver's answer applied to a layer's ragged caches, in place: head h of the keys, values [rows][d] and "
        "original positions [rows] int32 (one cu_capacity, one lens) keeps its rows positions[cu[h]:cu[h+1]] "
        "(ascending, < lens[h]) packed to the front; lens[h] becomes their count. All checked before any row moves.");
}

}  // namespace kvevict::python
