// CUDA runtime errors as kvevict::status, for the launchers in <kvevict/cuda/*.cuh>.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/status.hpp>

#include <cuda_runtime_api.h>

namespace kvevict::detail {

inline status cuda_status(cudaError_t err, const char* fn) {
  if (err == cudaSuccess) return {};
  return status::error(errc::cuda_error, "%s: CUDA error %s: %s", fn, cudaGetErrorName(err), cudaGetErrorString(err));
}

inline cudaStream_t stream_of(cuda_t be) { return static_cast<cudaStream_t>(be.stream); }

}  // namespace kvevict::detail
