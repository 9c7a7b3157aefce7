// Sharded flattened selection (kvevict/distributed.hpp) against gathering every score to rank 0,
// selecting there and scattering the kept positions back (docs/distributed.md). An MPI program:
//   mpirun -np 4 bench/bench_distributed [--heads-per-rank R] [--tokens T] [--reps N] [--smoke]
// Every rank holds R heads of T scores (exp(N(0, 2)), attention-like); the layer keeps 1/8 of its
// entries. Rank 0 prints the median wall time of each variant (the slowest rank's time per
// repetition) and the payload bytes each rank sends. Both variants' kept positions are compared
// on every rank (a mismatch exits 1). --smoke: one tiny shape, 2 repetitions (the CTest check).
#include <kvevict/comm.hpp>
#include <kvevict/distributed.hpp>
#include <kvevict/mpi.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using kvevict::index_t;
using kvevict::pos_t;

double slowest(double t) {
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

[[noreturn]] void fail(const char* what, const kvevict::status& st) {
  std::fprintf(stderr, "bench_distributed: %s: %s\n", what, st.message());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  index_t R = 2, T = 16384;
  int reps = 15;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      R = 1;
      T = 512;
      reps = 2;
    } else if (a == "--heads-per-rank" && i + 1 < argc) {
      R = std::atoll(argv[++i]);
    } else if (a == "--tokens" && i + 1 < argc) {
      T = std::atoll(argv[++i]);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "bench_distributed: unknown argument %s\n", a.c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  kvevict::mpi_comm world(MPI_COMM_WORLD);
  kvevict::counting_comm<kvevict::mpi_comm> comm(world);
  const int P = world.size(), rank = world.rank();
  const index_t H = R * P, total = H * T / 8;

  std::mt19937_64 g(static_cast<std::uint64_t>(1234 + rank));
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> mine(static_cast<std::size_t>(R * T));
  for (auto& x : mine) x = std::exp(nd(g));
  const auto view = kvevict::make_matrix_view<const float>(mine.data(), R, T).value();

  // sharded: every rank selects its rows with summed bucket counts
  std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1));
  std::vector<pos_t> pos(static_cast<std::size_t>(std::min(total, R * T)));
  kvevict::workspace q;
  (void)kvevict::select_topk_flat(kvevict::seq, q, comm, view, nullptr, total, nullptr, cu.data(), pos.data());
  std::vector<unsigned char> wsm(q.bytes);
  kvevict::workspace ws{wsm.data(), wsm.size()};
  std::vector<double> t_sharded;
  for (int r = 0; r < reps; ++r) {
    comm.reset();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    const auto st = kvevict::select_topk_flat(kvevict::seq, ws, comm, view, nullptr, total, nullptr, cu.data(), pos.data());
    if (!st.ok()) fail("sharded select_topk_flat", st);
    t_sharded.push_back(slowest(MPI_Wtime() - t0));
  }
  const unsigned long long sharded_bytes = comm.bytes();

  // gathered: scores to rank 0, one select_topk_flat over [H][T], offsets and positions back
  std::vector<float> all(rank == 0 ? static_cast<std::size_t>(H * T) : 0);
  std::vector<std::int32_t> all_cu(static_cast<std::size_t>(H + 1)), counts(static_cast<std::size_t>(P)),
      displs(static_cast<std::size_t>(P));
  std::vector<pos_t> all_pos(rank == 0 ? static_cast<std::size_t>(total) : 0);
  std::vector<pos_t> got(pos.size());
  std::vector<unsigned char> root_ws;
  if (rank == 0) root_ws.resize(kvevict::select_topk_flat_workspace_bytes(kvevict::seq, H, T));
  std::vector<double> t_gather;
  unsigned long long gather_bytes = 0;
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    MPI_Gather(mine.data(), static_cast<int>(R * T), MPI_FLOAT, all.data(), static_cast<int>(R * T), MPI_FLOAT, 0,
               MPI_COMM_WORLD);
    if (rank == 0) {
      kvevict::workspace rws{root_ws.data(), root_ws.size()};
      const auto st = kvevict::select_topk_flat(kvevict::seq, rws,
                                                kvevict::make_matrix_view<const float>(all.data(), H, T).value(), nullptr,
                                                total, nullptr, all_cu.data(), all_pos.data());
      if (!st.ok()) fail("gathered select_topk_flat", st);
      for (int p = 0; p < P; ++p) {
        displs[static_cast<std::size_t>(p)] = all_cu[static_cast<std::size_t>(p * R)];
        counts[static_cast<std::size_t>(p)] = all_cu[static_cast<std::size_t>((p + 1) * R)] - displs[static_cast<std::size_t>(p)];
      }
    }
    MPI_Bcast(all_cu.data(), static_cast<int>(H + 1), MPI_INT32_T, 0, MPI_COMM_WORLD);
    const int n = all_cu[static_cast<std::size_t>((rank + 1) * R)] - all_cu[static_cast<std::size_t>(rank * R)];
    MPI_Scatterv(all_pos.data(), counts.data(), displs.data(), MPI_INT32_T, got.data(), n, MPI_INT32_T, 0,
                 MPI_COMM_WORLD);
    t_gather.push_back(slowest(MPI_Wtime() - t0));
    // payload sent: non-roots their scores; the root the offsets to everyone and the positions
    gather_bytes = rank == 0 ? static_cast<unsigned long long>((H + 1) * 4 + (total - n) * 4)
                             : static_cast<unsigned long long>(R * T * 4);
  }

  // both must give this rank the same rows
  int bad = 0;
  for (index_t r = 0; r <= R; ++r)
    bad |= cu[static_cast<std::size_t>(r)] != all_cu[static_cast<std::size_t>(rank * R + r)] - all_cu[static_cast<std::size_t>(rank * R)];
  bad |= std::memcmp(pos.data(), got.data(), static_cast<std::size_t>(cu[static_cast<std::size_t>(R)]) * sizeof(pos_t)) != 0;
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  const unsigned long long other_bytes = static_cast<unsigned long long>(R * T * 4);  // a non-root's scores
  if (rank == 0) {
    std::printf("bench_distributed: %d ranks x %lld heads x %lld tokens, layer keeps %lld\n", P,
                static_cast<long long>(R), static_cast<long long>(T), static_cast<long long>(total));
    std::printf("  sharded select_topk_flat : median %9.1f us, %llu B sent per rank\n", 1e6 * median(t_sharded),
                sharded_bytes);
    std::printf("  gather + select + scatter: median %9.1f us, %llu B sent per non-root rank, %llu B by the root\n",
                1e6 * median(t_gather), P > 1 ? other_bytes : 0ull, gather_bytes);
    std::printf("  kept rows %s\n", bad ? "DIFFER" : "identical");
  }
  MPI_Finalize();
  return bad ? 1 : 0;
}
