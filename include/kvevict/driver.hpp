// kvevict/driver.hpp: the eviction drivers (docs/drivers.md). A driver is an engine-facing loop:
// it tells the engine WHAT to keep and WHEN, without owning the model or the cache.
//
//   <kvevict/drivers/layer_kv.hpp>   layer_kv (ragged keys / values + original positions),
//                                    make_layer_kv, ragged_from_dense, model_shape
//   <kvevict/budget/allocation.hpp>  allocator, allocation (the budget rule a driver consumes)
//   <kvevict/drivers/compact_layer.hpp> compact_layer: a driver's answer applied to a layer's keys,
//                                    values and positions at once
//   <kvevict/drivers/post_fill.hpp>  post_fill_driver   one shot after the prefill; per-layer
//                                                       (uniform, PyramidKV, AdaKV) and all-layer
//                                                       (LAVa entropy, CAKE preference) budgets
//   <kvevict/drivers/cascade_driver.hpp> cascade_driver    layer-by-layer prefill with cascading
//                                                       budgets (LAVa Algorithm 2, CAKE)
//   <kvevict/drivers/chunked.hpp>    chunked_driver     chunked prefill, naive or patched, down
//                                                       to a budget or p% per chunk
//   <kvevict/drivers/decode.hpp>     decode_driver      back to a budget every N decode steps
//                                                       (H2O accumulation, TOVA, windows, ...)
//   <kvevict/drivers/streaming_heads.hpp> streaming_heads_driver  DuoAttention / PruLong head types
//                                                       at every step (chunks, layers, decoding)
//
// Every driver answers with the rows of the engine's current cache each KV head keeps (ascending
// row indices, for compact_layer / compact_inplace) and records its schedule into an
// optional eviction_recorder (metrics/footprint.hpp), with original positions and steps.
#pragma once

#include <kvevict/budget/allocation.hpp>
#include <kvevict/drivers/cascade_driver.hpp>
#include <kvevict/drivers/chunked.hpp>
#include <kvevict/drivers/compact_layer.hpp>
#include <kvevict/drivers/decode.hpp>
#include <kvevict/drivers/layer_kv.hpp>
#include <kvevict/drivers/post_fill.hpp>
#include <kvevict/drivers/streaming_heads.hpp>
