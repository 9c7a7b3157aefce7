// python/src/distributed.cpp: the sharded calls (kvevict/distributed.hpp) with a communicator
// made in Python: `kvevict.Comm()` (one process: the library's single_process) or
// `kvevict.thread_comms(P)` (P ranks that are threads of this process, exchanging through shared
// memory), so exactness across ranks is testable without MPI (docs/python.md, docs/distributed.md).
#include "common.hpp"

#include <kvevict/distributed.hpp>
#include <kvevict/thread_comm.hpp>
#ifndef KVEVICT_PYTHON_MPI
#  define KVEVICT_PYTHON_MPI 0
#endif
#if KVEVICT_PYTHON_MPI
#  include <kvevict/mpi.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <memory>
#include <type_traits>

namespace kvevict::python {

namespace {

/// A communicator (the comm.hpp contract) made in Python: one process (the default: comm_ref's
/// identity), a rank of a thread group (kvevict/thread_comm.hpp; the ranks of one thread_comms()
/// call share the group) or an MPI communicator (kvevict/mpi.hpp, from mpi4py). comm_ref is the
/// one dispatch; owner_ keeps the communicator it refers to alive.
class comm {
 public:
  comm() = default;
  template <class C>
  static comm owning(std::shared_ptr<C> c) {
    comm out;
    out.ref_ = comm_ref(*c);
    out.owner_ = std::move(c);
    return out;
  }
  int rank() const { return ref_.rank(); }
  int size() const { return ref_.size(); }
  status allreduce_sum(std::int64_t* data, index_t n) { return ref_.allreduce_sum(data, n); }
  status allreduce_sum(double* data, index_t n) { return ref_.allreduce_sum(data, n); }
  status exscan_sum(const std::int64_t* in, std::int64_t* out, index_t n) { return ref_.exscan_sum(in, out, n); }
  status allgather(const void* send, std::size_t bytes, void* recv) { return ref_.allgather(send, bytes, recv); }

 private:
  comm_ref ref_;
  std::shared_ptr<void> owner_;
};

/// A thread rank and the group it belongs to (kept alive by every rank's communicator).
struct thread_rank {
  std::shared_ptr<thread_group> group;
  thread_comm c;
  thread_rank(std::shared_ptr<thread_group> g, int r) : group(std::move(g)), c(*group, r) {}
};

std::vector<comm> thread_comms(int size, double timeout) {
  if (size < 1) raise(errc::invalid_argument, "thread_comms: size must be >= 1 (got " + std::to_string(size) + ")");
  if (!(timeout > 0.0 && timeout <= 86400.0))
    raise(errc::invalid_argument, "thread_comms: timeout must be in (0, 86400] seconds");
  auto g = std::make_shared<thread_group>(size, std::chrono::milliseconds(std::max(1LL, static_cast<long long>(timeout * 1000.0 + 0.5))));
  std::vector<comm> out;
  for (int r = 0; r < size; ++r) {
    auto tr = std::make_shared<thread_rank>(g, r);
    out.push_back(comm::owning(std::shared_ptr<thread_comm>(tr, &tr->c)));
  }
  return out;
}

/// mpi4py's integer handle as the MPI library's MPI_Comm: a pointer (Open MPI) or an int (MPICH).
template <class H>
H native_handle(const py::object& handle) {
  if constexpr (std::is_pointer_v<H>)
    return reinterpret_cast<H>(handle.cast<std::uintptr_t>());
  else
    return static_cast<H>(handle.cast<long long>());
}

/// An mpi4py communicator (mpi4py.MPI.Comm) as a kvevict communicator over the same MPI_Comm
/// (kvevict/mpi.hpp); the mpi4py object must outlive it. Builds without MPI refuse.
comm mpi_comm_of(py::handle mpi4py_comm) {
#if KVEVICT_PYTHON_MPI
  const py::object handle = py::module_::import("mpi4py.MPI").attr("_handleof")(mpi4py_comm);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) raise(errc::invalid_argument, "mpi_comm: MPI is not initialised (import mpi4py.MPI first)");
  const auto native = native_handle<MPI_Comm>(handle);
  if (native == MPI_COMM_NULL) raise(errc::invalid_argument, "mpi_comm: the communicator is MPI.COMM_NULL");
  return comm::owning(std::make_shared<kvevict::mpi_comm>(native));
#else
  (void)mpi4py_comm;
  raise(errc::unsupported, "mpi_comm: this build has no MPI (kvevict.has_mpi is False; build with MPI found by CMake)");
#endif
}

const std::int32_t* optional_int32(const tensor& t, index_t n) {
  if (t.data == nullptr) return nullptr;
  require_dtype(t, {dtype::i32});
  require_host(t);
  return int32_array(t, n);
}

/// A sharded flat selection's output: cu [R + 1] and room for min(total, this rank's tokens)
/// positions; select(cu, positions) runs the call, the result is (positions[:cu[R]], cu).
template <class Select>
py::tuple sharded_selection(const tensor& s, const std::int32_t* len, index_t total, Select&& select) {
  const index_t R = s.shape[0];
  index_t mine = 0;  // this rank's rows hold at most this many tokens
  for (index_t r = 0; r < R; ++r) mine += len != nullptr ? std::max<index_t>(len[r], 0) : s.shape[1];
  const tensor cu = output(py::none(), "cu", s, {R + 1}, dtype::i32);
  const tensor pos = output(py::none(), "positions", s, {std::min(total, mine)}, dtype::i32);
  select(static_cast<std::int32_t*>(cu.data), static_cast<pos_t*>(pos.data));
  const std::int32_t kept = static_cast<const std::int32_t*>(cu.data)[R];
  return py::make_tuple(py::object(pos.object[py::slice(py::int_(0), py::int_(kept), py::none())]), cu.object);
}

py::tuple select_flat_sharded(comm& c, py::handle scores_, index_t total, py::handle lengths_, py::handle floors_) {
  const tensor s = float_matrix(scores_, "scores");
  const tensor lt = as_optional(lengths_, "row_lengths", 1), ft = as_optional(floors_, "floors", 1);
  const std::int32_t* len = optional_int32(lt, s.shape[0]);
  const std::int32_t* fl = optional_int32(ft, s.shape[0]);
  if (total < 0 || total > INT32_MAX)
    raise(errc::invalid_argument, "select_topk_flat_sharded: total = " + std::to_string(total) + " is outside [0, INT32_MAX]");
  const auto sv = mat<const float>(s);
  return sharded_selection(s, len, total, [&](std::int32_t* cu, pos_t* pos) {
    run_ws([&](workspace& ws) { return select_topk_flat(backend(), ws, c, sv, len, total, fl, cu, pos); });
  });
}

py::tuple adakv_sharded(comm& c, py::handle scores_, index_t budget, py::handle lengths_, double alpha,
                        adakv_floor floor, index_t n_sink, index_t n_recent) {
  const tensor s = float_matrix(scores_, "scores");
  const tensor lt = as_optional(lengths_, "lengths", 1);
  const std::int32_t* len = optional_int32(lt, s.shape[0]);
  const index_t heads = s.shape[0] * c.size();
  if (budget < 0 || budget > INT32_MAX / (heads > 0 ? heads : 1))
    raise(errc::invalid_argument, "adakv_budgets_sharded: budget " + std::to_string(budget) + " is out of range");
  adakv_options opt;
  opt.alpha = alpha;
  opt.floor = floor;
  opt.prot = protection{n_sink, n_recent};
  const auto sv = mat<const float>(s);
  return sharded_selection(s, len, budget * heads, [&](std::int32_t* cu, pos_t* pos) {
    run_ws([&](workspace& ws) { return adakv_budgets(backend(), ws, c, sv, len, budget, opt, cu, pos); });
  });
}

double lava_entropy_sharded(comm& c, py::handle scores_, py::handle lengths_, entropy_norm norm, index_t n_sink,
                            index_t n_recent) {
  const tensor s = float_matrix(scores_, "scores");
  const tensor lt = as_optional(lengths_, "lengths", 1);
  const std::int32_t* len = optional_int32(lt, s.shape[0]);
  lava_entropy_options opt;
  opt.prot = protection{n_sink, n_recent};
  opt.norm = norm;
  const auto sv = mat<const float>(s);
  double e = 0.0;
  run_ws([&](workspace& ws) { return lava_layer_entropy(backend(), ws, c, sv, len, opt, &e); });
  return e;
}

py::tuple cake_stats_sharded(comm& c, py::handle a_, variance_estimator var) {
  const tensor a = as_tensor(a_, "attention", 3);
  require_dtype(a, {dtype::f32});
  require_host(a);
  const auto av = kv<const float>(a);
  cake_stats st;
  run_ws([&](workspace& ws) { return cake_layer_stats(backend(), ws, c, av, &st, var); });
  return py::make_tuple(st.entropy, st.variance);
}

py::tuple shard_tuple(const result<shard_range>& r) {
  const shard_range s = value_or_raise(r);
  return py::make_tuple(s.first, s.count);
}

double cake_window_sharded(comm& c, py::handle q_, py::handle k_, double tau1, double tau2) {
  const cake_window_args a(q_, k_, tau1, tau2);
  double p = 0.0;
  run_ws([&](workspace& ws) { return cake_window_preference(backend(), ws, c, a.queries(), a.keys(), a.opt, &p); });
  return p;
}

std::vector<double> gather_layers(comm& c, index_t first, py::handle local_, index_t layers) {
  const std::vector<double> local = local_.cast<std::vector<double>>();
  std::vector<double> all(static_cast<std::size_t>(layers > 0 ? layers : 0));
  const shard_range mine{first, static_cast<index_t>(local.size())};
  run_ws([&](workspace& ws) { return gather_layer_values(ws, c, mine, local.data(), layers, all.data()); });
  return all;
}

}  // namespace

void bind_distributed(py::module_& m) {
  using namespace pybind11::literals;
  py::class_<comm>(m, "Comm",
                   "A communicator for the sharded calls: Comm() is one process holding every head and layer "
                   "(collectives are the identity); thread_comms(P) gives P ranks that are threads of this process; "
                   "mpi_comm(mpi4py_comm) the ranks of an MPI communicator.")
      .def(py::init<>())
      .def_property_readonly("rank", &comm::rank)
      .def_property_readonly("size", &comm::size);
  m.attr("has_mpi") = static_cast<bool>(KVEVICT_PYTHON_MPI);
  m.def("mpi_comm", &mpi_comm_of, "comm"_a,
        "An mpi4py communicator (e.g. mpi4py.MPI.COMM_WORLD) as a kvevict Comm over the same MPI_Comm "
        "(kvevict/mpi.hpp); the mpi4py object must outlive it. Builds without MPI raise Error (kvevict.has_mpi).");
  m.def("thread_comms", &thread_comms, "size"_a, "timeout"_a = 60.0,
        "P communicators over shared memory (kvevict/thread_comm.hpp), rank r for the thread that plays rank r (each "
        "rank on its own thread; the calls release the GIL); a rank waiting longer than `timeout` seconds for the "
        "others gets an Error instead of hanging.");
  m.def("head_shard", [](index_t heads, int ranks, int rank) { return shard_tuple(head_shard(heads, ranks, rank)); },
        "heads"_a, "ranks"_a, "rank"_a,
        "Tensor parallelism: rank r of P holds KV heads [first, first + count) = [r H / P, (r + 1) H / P) (H "
        "divisible by P): (first, count).");
  m.def("layer_shard", [](index_t layers, int ranks, int rank) { return shard_tuple(layer_shard(layers, ranks, rank)); },
        "layers"_a, "ranks"_a, "rank"_a,
        "Pipeline parallelism: rank r of P holds layers [r L / P, (r + 1) L / P): (first, count), the `first` and "
        "len(local) of gather_layer_values.");
  m.def("select_topk_flat_sharded", &select_flat_sharded, "comm"_a, "scores"_a, "total"_a, "row_lengths"_a = py::none(),
        "floors"_a = py::none(),
        "Head-sharded select_topk_flat: this rank's rows [R][T] of the layer's P*R (rank order = row order); "
        "(positions, cu) of this rank's rows, exactly the single-process call's.");
  m.def("adakv_budgets_sharded", &adakv_sharded, "comm"_a, "scores"_a, "budget"_a, "lengths"_a = py::none(),
        "alpha"_a = 0.2, "floor"_a = adakv_floor::budget, "n_sink"_a = 0, "n_recent"_a = 0,
        "Head-sharded AdaKV: this rank's heads [R][T] of the layer's P*R, per-head budget B; (positions, cu) of this "
        "rank's heads, exactly their part of adakv_budgets over all heads.");
  m.def("lava_layer_entropy_sharded", &lava_entropy_sharded, "comm"_a, "scores"_a, "lengths"_a = py::none(),
        "norm"_a = entropy_norm::log_count, "n_sink"_a = 0, "n_recent"_a = 0,
        "Head-sharded LAVa entropy: every rank gets the layer's entropy over all heads, bit for bit.");
  m.def("cake_layer_stats_sharded", &cake_stats_sharded, "comm"_a, "attention"_a,
        "variance"_a = variance_estimator::unbiased,
        "Head-sharded CAKE statistics: this rank's query heads' window attention [R][w][C] of the layer's P*R; every "
        "rank gets cake_layer_stats over all heads, bit for bit: (entropy, variance).");
  m.def("cake_window_preference_sharded", &cake_window_sharded, "comm"_a, "window_queries"_a, "keys"_a,
        "tau1"_a = 1.0, "tau2"_a = 1.0,
        "Head-sharded CAKE window preference: this rank's query heads [R_q][w][d] and its KV heads' keys [R_kv][P][d] "
        "of the layer's P*R_q (rank order = head order); every rank gets cake_window_preference over all heads, bit "
        "for bit.");
  m.def("gather_layer_values", &gather_layers, "comm"_a, "first"_a, "local"_a, "layers"_a,
        "Layer-sharded: this stage's values of layers [first, first + len(local)) -> every layer's value on every "
        "stage.");
}

}  // namespace kvevict::python
