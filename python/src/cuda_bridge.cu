// python/src/cuda_bridge.cu: recipe_scores, dense recipe_select and dense compact on cuda_t for
// the bindings (cuda_bridge.hpp). Compiled for the build's CUDA architectures; not run on this
// machine (no GPU).
#include "cuda_bridge.hpp"

#include <kvevict/cuda/compact.cuh>
#include <kvevict/cuda/recipes.cuh>

#include <cuda_runtime.h>

namespace kvevict::python::gpu {

namespace {

template <class T, std::size_t Rank>
result<strided_view<T, Rank>> view(const char* name, const raw& t) {
  if (t.ndim != static_cast<int>(Rank))
    return status::error(errc::shape_mismatch, "%s must have rank %zu, got %d", name, Rank, t.ndim);
  index_t ext[Rank], str[Rank];
  for (std::size_t i = 0; i < Rank; ++i) {
    ext[i] = t.shape[i];
    str[i] = t.strides[i];
  }
  return detail::make_strided<T, Rank>(name, static_cast<T*>(t.data), ext, str);
}

status cuda_status(const char* fn, cudaError_t e) {
  if (e == cudaSuccess) return {};
  return status::error(errc::cuda_error, "%s: %s", fn, cudaGetErrorString(e));
}

/// f(workspace&) -> status twice: the size query, then the call on device scratch from the stream.
template <class F>
status with_device_workspace(const char* fn, cudaStream_t stream, F&& f) {
  workspace q{};
  KVEVICT_TRY(f(q));
  void* p = nullptr;
  const std::size_t bytes = q.bytes > 0 ? q.bytes : 64;  // null data would be another size query
  KVEVICT_TRY(cuda_status(fn, cudaMallocAsync(&p, bytes, stream)));
  workspace ws{p, bytes};
  const status st = f(ws);
  const status freed = cuda_status(fn, cudaFreeAsync(p, stream));
  return st.ok() ? freed : st;
}

template <class F>
status dispatch(const char* fn, int elem, F&& f) {
  switch (elem) {
    case 0: return f(float{});
    case 1: return f(float16{});
    case 2: return f(bfloat16{});
    default: return status::error(errc::invalid_argument, "%s: not a KV element type", fn);
  }
}

}  // namespace

status recipe_scores(const recipe& r, const raw& queries, const raw& keys, const raw& values, const raw& scores,
                     CUstream_st* stream) {
  constexpr const char* fn = "recipe_scores(cuda)";
  return dispatch(fn, keys.elem, [&](auto e) -> status {
    using T = decltype(e);
    const auto k = view<const T, 3>("keys", keys);
    if (!k) return k.error();
    kv_view<const T> q{}, v{};
    if (queries.data != nullptr) {
      const auto qv = view<const T, 3>("queries", queries);
      if (!qv) return qv.error();
      q = *qv;
    }
    if (values.data != nullptr) {
      const auto vv = view<const T, 3>("values", values);
      if (!vv) return vv.error();
      v = *vv;
    }
    const auto s = view<float, 2>("scores", scores);
    if (!s) return s.error();
    const cuda_t be{stream};
    return with_device_workspace(fn, stream, [&](workspace& ws) { return kvevict::recipe_scores(be, ws, r, q, *k, v, *s); });
  });
}

status recipe_select(const recipe& r, const raw& scores, const raw& kept, CUstream_st* stream) {
  constexpr const char* fn = "recipe_select(cuda)";
  const auto s = view<const float, 2>("scores", scores);
  if (!s) return s.error();
  const auto k = view<pos_t, 2>("kept", kept);
  if (!k) return k.error();
  const cuda_t be{stream};
  return with_device_workspace(fn, stream, [&](workspace& ws) { return kvevict::recipe_select(be, ws, r, *s, *k); });
}

status compact(const raw& src, const raw& kept, const raw& dst, CUstream_st* stream) {
  constexpr const char* fn = "compact(cuda)";
  const auto k = view<const pos_t, 2>("kept", kept);
  if (!k) return k.error();
  return dispatch(fn, src.elem, [&](auto e) -> status {
    using T = decltype(e);
    const auto s = view<const T, 3>("src", src);
    if (!s) return s.error();
    const auto d = view<T, 3>("dst", dst);
    if (!d) return d.error();
    return kvevict::compact(cuda_t{stream}, *s, *k, *d);
  });
}

}  // namespace kvevict::python::gpu
