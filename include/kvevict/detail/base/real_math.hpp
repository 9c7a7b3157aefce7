// float / double overloads of the <cmath> functions the training math (train/prulong.hpp,
// train/lookahead.hpp) calls from host and device code: one spelling for both element types,
// the C functions (expf, exp, ...) so that nvcc's device versions are chosen. Not API.
#pragma once

#include <kvevict/config.hpp>

#include <cmath>

namespace kvevict::detail {

KVEVICT_HOST_DEVICE inline float exp_t(float x) { return ::expf(x); }
KVEVICT_HOST_DEVICE inline double exp_t(double x) { return ::exp(x); }
KVEVICT_HOST_DEVICE inline float log_t(float x) { return ::logf(x); }
KVEVICT_HOST_DEVICE inline double log_t(double x) { return ::log(x); }
KVEVICT_HOST_DEVICE inline float sqrt_t(float x) { return ::sqrtf(x); }
KVEVICT_HOST_DEVICE inline double sqrt_t(double x) { return ::sqrt(x); }

}  // namespace kvevict::detail
