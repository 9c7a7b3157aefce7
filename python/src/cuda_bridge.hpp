// python/src/cuda_bridge.hpp: the CUDA path of the bindings, compiled by nvcc (cuda_bridge.cu) only
// when the build has CUDA (KVEVICT_PYTHON_CUDA). Plain C++ on both sides: the pybind11 files never
// see CUDA headers, and cuda_bridge.cu never sees pybind11.
#pragma once

#include <kvevict/recipes.hpp>

struct CUstream_st;

namespace kvevict::python::gpu {

/// A device tensor's data, shape and strides (elements); elem: 0 float32, 1 float16, 2 bfloat16,
/// 3 int32.
struct raw {
  void* data = nullptr;
  int ndim = 0;
  index_t shape[4] = {};
  index_t strides[4] = {};
  int elem = 0;
};

/// recipe_scores on cuda_t: queries / values may be empty (data null); scores [H_kv][T] float32.
/// The workspace is allocated on the stream (cudaMallocAsync) and freed after the call is queued.
status recipe_scores(const recipe& r, const raw& queries, const raw& keys, const raw& values, const raw& scores,
                     CUstream_st* stream);
/// Dense recipe_select on cuda_t: kept [H_kv][budget] int32.
status recipe_select(const recipe& r, const raw& scores, const raw& kept, CUstream_st* stream);
/// Dense compact on cuda_t: dst [H][k][d] = src [H][T][d] gathered at kept [H][k].
status compact(const raw& src, const raw& kept, const raw& dst, CUstream_st* stream);

}  // namespace kvevict::python::gpu
