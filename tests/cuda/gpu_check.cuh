// Minimal harness for the GPU tests: skip (exit 77, CTest's SKIP_RETURN_CODE) when no device is
// usable, count failures otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

namespace kvgpu {

inline void skip_without_gpu() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    std::printf("no usable CUDA device (%s): skipping\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    std::exit(77);
  }
}

inline int failures = 0;

#define KVGPU_CHECK(cond)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::printf("%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);     \
      ++::kvgpu::failures;                                                     \
    }                                                                          \
  } while (0)

#define KVGPU_CUDA(call) KVGPU_CHECK((call) == cudaSuccess)

}  // namespace kvgpu
