// kvevict/config.hpp: version, portability macros and the index types used everywhere.
#pragma once

#include <cstdint>

#define KVEVICT_VERSION_MAJOR 0
#define KVEVICT_VERSION_MINOR 1
#define KVEVICT_VERSION_PATCH 0

// Functions that run on the host and, under nvcc, on the device too. Per-element math lives in
// such functions so that host tests exercise exactly the code the GPU runs.
#if defined(__CUDACC__) || defined(__HIPCC__)
#  define KVEVICT_HOST_DEVICE __host__ __device__
#  define KVEVICT_DEVICE __device__
#else
#  define KVEVICT_HOST_DEVICE
#  define KVEVICT_DEVICE
#endif

#if defined(__CUDA_ARCH__)
#  define KVEVICT_DEVICE_COMPILATION 1
#else
#  define KVEVICT_DEVICE_COMPILATION 0
#endif

namespace kvevict {

/// Extents, strides and offsets: signed 64-bit, so a 1M-token x 128-head cache never overflows.
using index_t = std::int64_t;
/// Token positions in kept lists: 32-bit (a context of 2^31 tokens is out of scope).
using pos_t = std::int32_t;

}  // namespace kvevict
