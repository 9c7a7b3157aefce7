// kvevict/drivers/detail/stages.hpp: what the drivers' lava / cake decide() does across pipeline
// stages (post_fill_config::pp, chunked_config::pp; docs/distributed.md): the stages agree on the
// configuration, then gather every stage's per-layer values (gather_layer_values) so each computes
// the model's budgets as one process does.
#pragma once

#include <kvevict/comm.hpp>
#include <kvevict/distributed.hpp>
#include <kvevict/drivers/detail/driver_skeleton.hpp>

namespace kvevict::detail {

/// A stage of the model: its layers [first, first + layers) of model_layers, over `pp`.
struct stage_span {
  comm_ref pp;
  index_t first = 0, layers = 0, model_layers = 0;

  /// decide()'s scratch inside the selection's workspace, used before any selection:
  /// gather_layer_values' workspace, the model's weights, a stage's values and the model's, the
  /// model's per-head budgets [model_layers][heads] (cake).
  struct scratch {
    workspace gather;
    double *weights = nullptr, *local = nullptr, *all = nullptr;
    std::int32_t* budgets = nullptr;
  };
  status carve(const char* name, workspace& ws, index_t heads, scratch& g) const {
    workspace q;  // gather_layer_values' size (a query never communicates nor writes)
    double unused = 0.0;
    comm_ref c = pp;
    KVEVICT_TRY(gather_layer_values(q, c, shard_range{0, 0}, nullptr, model_layers, &unused));
    workspace_carver w(ws);
    g.gather = workspace{w.take<unsigned char>(q.bytes), q.bytes};
    g.weights = w.take<double>(static_cast<std::size_t>(model_layers));
    g.local = w.take<double>(static_cast<std::size_t>(layers));
    g.all = w.take<double>(static_cast<std::size_t>(model_layers));
    g.budgets = w.take<std::int32_t>(static_cast<std::size_t>(model_layers * heads));
    return w.finish(name);
  }
  /// The workspace bytes of the scratch (a query of carve).
  result<std::size_t> workspace_bytes(const char* name, index_t heads) const {
    workspace q;
    scratch g;
    KVEVICT_TRY(carve(name, q, heads, g));
    return q.bytes;
  }
  /// This stage's per-layer values (`layers` of them) -> all model_layers' on every stage.
  status gather(const double* local, double* all, scratch& g) const {
    comm_ref c = pp;
    return gather_layer_values(g.gather, c, shard_range{first, layers}, local, model_layers, all);
  }
  /// The stages agree on `config` (allocator, total, shape...), or every stage fails (a stage
  /// whose add_layer failed fails them all).
  status agree(const char* fn, const status& local, const config_line& config) const {
    comm_ref c = pp;
    return detail::agree(c, fn, local, config, nullptr, 0);
  }
  /// lava: the model's protected (caps) and evictable (totals) rows per layer from every stage's
  /// (this stage's at [first, first + layers); exact as doubles: < 2^53).
  status gather_rows(index_t* caps, index_t* totals, scratch& g) const {
    for (index_t* v : {caps, totals}) {
      for (index_t l = 0; l < layers; ++l) g.local[l] = static_cast<double>(v[first + l]);
      KVEVICT_TRY(gather(g.local, g.all, g));
      for (index_t l = 0; l < model_layers; ++l) v[l] = static_cast<index_t>(g.all[l]);
    }
    return {};
  }
  /// init's check: the stage's layers inside the model (a stage needs a pp communicator; one
  /// process holds every layer).
  static status check(const char* fn, const comm_ref& pp, index_t first, index_t layers, index_t model_layers) {
    if (first < 0 || model_layers < 0 || first + layers > model_layers || (pp.size() <= 1 && model_layers != layers))
      return status::error(errc::invalid_argument,
                           "%s: layers [%lld, %lld) of a model of %lld layers (a stage needs a pp communicator; "
                           "one process holds every layer)",
                           fn, static_cast<long long>(first), static_cast<long long>(first + layers),
                           static_cast<long long>(model_layers));
    return {};
  }
};

}  // namespace kvevict::detail
