// CUDA overload set of <kvevict/recipes.hpp>: recipe_scores and recipe_select are backend templates,
// so with this header they run on cuda_t (views and workspace in device memory). It only brings in
// the CUDA stages they call: attention and key-norm / position scores (score.cuh), the fused
// post-processing (postprocess.cuh), protection (protect.cuh) and selection (select.cuh).
#pragma once

#include <kvevict/cuda/postprocess.cuh>
#include <kvevict/cuda/protect.cuh>
#include <kvevict/cuda/score.cuh>
#include <kvevict/cuda/select.cuh>
#include <kvevict/recipes.hpp>
