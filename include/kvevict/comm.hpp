// kvevict/comm.hpp: the communicator contract of sharded eviction (docs/distributed.md).
//
// A model served on several ranks shards the KV heads of every layer (tensor parallelism) or the
// layers (pipeline parallelism). The global decisions of the allocators (AdaKV / LAVa flattened
// selection, LAVa / CAKE layer statistics and budgets) then need a few collectives, which the
// engine already runs; kvevict never starts processes or owns a communication library. A
// communicator is any type with these members (every rank calls each collective in the same order):
//
//   int rank() const;                 this rank, in [0, size())
//   int size() const;                 number of ranks
//   status allreduce_sum(std::int64_t* data, index_t n);     in place: data[i] = sum over the ranks
//   status allreduce_sum(double* data, index_t n);           in place (kvevict only sums arrays in
//                                                            which at most one rank has a non-zero
//                                                            entry, so the order of the sum is moot)
//   status exscan_sum(const std::int64_t* in, std::int64_t* out, index_t n);
//                                     out[i] = sum of in[i] over the ranks below this one (0 on rank 0)
//   status allgather(const void* send, std::size_t bytes, void* recv);
//                                     recv = every rank's `bytes` bytes, in rank order (size() x bytes);
//                                     send may be this rank's own slot of recv (in place)
//
// single_process is the identity (one rank); <kvevict/mpi.hpp> adapts an MPI communicator;
// counting_comm wraps any communicator and counts what this rank sends; comm_ref holds any of them
// behind one type (for configurations).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/status.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvevict {

/// The communicator of one process holding every head and layer: collectives are the identity.
struct single_process {
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
  status allreduce_sum(std::int64_t*, index_t) noexcept { return {}; }
  status allreduce_sum(double*, index_t) noexcept { return {}; }
  status exscan_sum(const std::int64_t*, std::int64_t* out, index_t n) noexcept {
    for (index_t i = 0; i < n; ++i) out[i] = 0;
    return {};
  }
  status allgather(const void* send, std::size_t bytes, void* recv) noexcept {
    if (bytes > 0 && send != recv) std::memmove(recv, send, bytes);
    return {};
  }
};

/// Wraps a communicator and counts the payload this rank contributes to each collective
/// (allreduce / exscan: the array; allgather: its own bytes). The wire traffic of an algorithm
/// (a ring allreduce sends 2 (P - 1) / P times the array) is derived from it in docs/distributed.md.
template <class Comm>
class counting_comm {
 public:
  explicit counting_comm(Comm& inner) noexcept : inner_(&inner) {}
  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  status allreduce_sum(std::int64_t* data, index_t n) {
    count(n * index_t(sizeof(std::int64_t)));
    return inner_->allreduce_sum(data, n);
  }
  status allreduce_sum(double* data, index_t n) {
    count(n * index_t(sizeof(double)));
    return inner_->allreduce_sum(data, n);
  }
  status exscan_sum(const std::int64_t* in, std::int64_t* out, index_t n) {
    count(n * index_t(sizeof(std::int64_t)));
    return inner_->exscan_sum(in, out, n);
  }
  status allgather(const void* send, std::size_t bytes, void* recv) {
    count(static_cast<index_t>(bytes));
    return inner_->allgather(send, bytes, recv);
  }
  std::uint64_t bytes() const noexcept { return bytes_; }  ///< payload sent so far
  std::uint64_t calls() const noexcept { return calls_; }  ///< collectives so far
  void reset() noexcept { bytes_ = calls_ = 0; }

 private:
  void count(index_t b) noexcept {
    bytes_ += static_cast<std::uint64_t>(b);
    ++calls_;
  }
  Comm* inner_;
  std::uint64_t bytes_ = 0, calls_ = 0;
};

/// Any communicator behind one plain type, for configurations that hold one (post_fill_config::tp):
/// a reference (the communicator must outlive it) that itself satisfies the contract.
/// Default-constructed: no communicator (one rank; its collectives are the identity).
class comm_ref {
 public:
  comm_ref() = default;
  template <class Comm, class = std::enable_if_t<!std::is_same_v<std::decay_t<Comm>, comm_ref>>>
  explicit comm_ref(Comm& c) noexcept
      : obj_(&c),
        rank_(c.rank()),
        size_(c.size()),
        sum_i_([](void* o, std::int64_t* d, index_t n) { return static_cast<Comm*>(o)->allreduce_sum(d, n); }),
        sum_d_([](void* o, double* d, index_t n) { return static_cast<Comm*>(o)->allreduce_sum(d, n); }),
        scan_([](void* o, const std::int64_t* in, std::int64_t* out, index_t n) {
          return static_cast<Comm*>(o)->exscan_sum(in, out, n);
        }),
        gather_([](void* o, const void* send, std::size_t bytes, void* recv) {
          return static_cast<Comm*>(o)->allgather(send, bytes, recv);
        }) {}
  bool active() const noexcept { return obj_ != nullptr; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  status allreduce_sum(std::int64_t* data, index_t n) const {
    return obj_ ? sum_i_(obj_, data, n) : single_process{}.allreduce_sum(data, n);
  }
  status allreduce_sum(double* data, index_t n) const {
    return obj_ ? sum_d_(obj_, data, n) : single_process{}.allreduce_sum(data, n);
  }
  status exscan_sum(const std::int64_t* in, std::int64_t* out, index_t n) const {
    return obj_ ? scan_(obj_, in, out, n) : single_process{}.exscan_sum(in, out, n);
  }
  status allgather(const void* send, std::size_t bytes, void* recv) const {
    return obj_ ? gather_(obj_, send, bytes, recv) : single_process{}.allgather(send, bytes, recv);
  }

 private:
  void* obj_ = nullptr;
  int rank_ = 0, size_ = 1;
  status (*sum_i_)(void*, std::int64_t*, index_t) = nullptr;
  status (*sum_d_)(void*, double*, index_t) = nullptr;
  status (*scan_)(void*, const std::int64_t*, std::int64_t*, index_t) = nullptr;
  status (*gather_)(void*, const void*, std::size_t, void*) = nullptr;
};

/// A rank's contiguous slice of `total` items (heads of a layer, or layers of a model).
struct shard_range {
  index_t first = 0;
  index_t count = 0;
};

/// Where a driver sits in a sharded model (docs/distributed.md): the base of the drivers' configs
/// that take part in global decisions. Empty communicators: one process.
struct model_sharding {
  /// Tensor parallelism: the ranks holding this stage's other KV heads (head_shard); the driver
  /// holds model.kv_heads of the layer's model.kv_heads x tp.size() KV heads.
  comm_ref tp;
  /// Pipeline parallelism: the ranks holding the same heads in the other stages (layer_shard); the
  /// driver holds the model's layers [first_layer, first_layer + model.layers) of model_layers.
  comm_ref pp;
  index_t first_layer = 0;   ///< this stage's first layer in the model (0 without pp)
  index_t model_layers = 0;  ///< the model's layers (0: model.layers, one stage)
};

/// Tensor parallelism: rank r of P holds KV heads [r H / P, (r + 1) H / P). Errors: H < 1, P < 1,
/// rank outside [0, P), H not divisible by P (invalid_argument: every rank must hold as many heads,
/// as in vLLM, SGLang and TensorRT-LLM).
inline result<shard_range> head_shard(index_t heads, int ranks, int rank) {
  constexpr const char* fn = "head_shard";
  if (heads < 1 || ranks < 1 || rank < 0 || rank >= ranks)
    return status::error(errc::invalid_argument, "%s: %lld heads, rank %d of %d (need heads >= 1, 0 <= rank < ranks)",
                         fn, static_cast<long long>(heads), rank, ranks);
  if (heads % ranks != 0)
    return status::error(errc::invalid_argument,
                         "%s: %lld KV heads are not divisible by %d ranks (tensor parallelism gives every rank the "
                         "same number of heads)",
                         fn, static_cast<long long>(heads), ranks);
  const index_t per = heads / ranks;
  return shard_range{per * rank, per};
}

/// Pipeline parallelism: rank r of P holds layers [r L / P, (r + 1) L / P) (counts differ by at
/// most one when P does not divide L). Errors: L < 1, P < 1, P > L, rank outside [0, P).
inline result<shard_range> layer_shard(index_t layers, int ranks, int rank) {
  if (layers < 1 || ranks < 1 || rank < 0 || rank >= ranks || ranks > layers)
    return status::error(errc::invalid_argument,
                         "layer_shard: %lld layers, rank %d of %d (need 1 <= ranks <= layers, 0 <= rank < ranks)",
                         static_cast<long long>(layers), rank, ranks);
  const index_t b = layers * rank / ranks, e = layers * (rank + 1) / ranks;
  return shard_range{b, e - b};
}

/// Tensor and pipeline parallelism together: a rank's place in a grid of `pp` pipeline stages x
/// `tp` head shards, ranks numbered stage-major (rank = stage tp + shard, as Megatron-style
/// launchers lay out a TP group on consecutive ranks). The engine passes two communicators: its
/// stage's `tp` ranks (rank `shard` of them; post_fill_config::tp ...) and the `pp` ranks holding
/// the same heads, one per stage (rank `stage`; post_fill_config::pp); with MPI,
/// `mpi_grid` (kvevict/mpi.hpp) splits them from the job's communicator. Errors: tp < 1, pp < 1,
/// rank outside [0, tp pp).
struct grid_place {
  int stage = 0;  ///< pipeline stage: this rank's rank in its pp communicator
  int shard = 0;  ///< head shard: this rank's rank in its tp communicator
};
inline result<grid_place> grid_place_of(int tp, int pp, int rank) {
  if (tp < 1 || pp < 1 || rank < 0 || static_cast<long long>(rank) >= static_cast<long long>(tp) * pp)
    return status::error(errc::invalid_argument, "grid_place_of: rank %d of a %d x %d grid (tp x pp; need tp, pp >= 1, "
                         "0 <= rank < tp pp)", rank, tp, pp);
  return grid_place{rank / tp, rank % tp};
}

}  // namespace kvevict
