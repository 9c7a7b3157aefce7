// kvevict/budget.hpp: budget allocation across heads and layers (docs/budget.md).
//
// How many tokens each KV head of each layer keeps. A budget counts every kept token of a head,
// protected ones (sinks, recent window) included; "budget B per head" means B x H_kv per layer and
// B x H_kv x L per model. Every allocator is exact: the kept totals equal the requested totals.
//
//   <kvevict/budget/apportion.hpp>  protection, budget_offsets (budgets -> select_topk's ragged cu),
//                                 apportion (exact capped proportional shares, largest remainder)
//   <kvevict/budget/uniform.hpp>  uniform_budgets                 every head the same
//   <kvevict/budget/pyramid.hpp>  pyramid_budgets                 PyramidKV (exact, or KVCache-Factory's)
//   <kvevict/budget/adakv.hpp>    adakv_budgets                   AdaKV: flattened top-k with a floor
//   <kvevict/budget/lava.hpp>     lava_layer_entropy, lava_layer_budgets   LAVa's entropy layer budgets
//   <kvevict/budget/cake.hpp>     cake_layer_stats, cake_preference, cake_budgets   CAKE
//   <kvevict/budget/layer_cascade.hpp>  layer_cascade                   layer-by-layer prefill, cascading
//   <kvevict/budget/duo.hpp>      duo_budgets, streaming_positions, duo_retrieval_heads   DuoAttention / PruLong
#pragma once

#include <kvevict/budget/adakv.hpp>
#include <kvevict/budget/allocation.hpp>
#include <kvevict/budget/apportion.hpp>
#include <kvevict/budget/cake.hpp>
#include <kvevict/budget/duo.hpp>
#include <kvevict/budget/layer_cascade.hpp>
#include <kvevict/budget/lava.hpp>
#include <kvevict/budget/pyramid.hpp>
#include <kvevict/budget/uniform.hpp>
