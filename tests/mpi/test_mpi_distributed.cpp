// The sharded-eviction checks of tests/distributed_cases.hpp with ranks as MPI processes
// (kvevict/mpi.hpp), run by CTest as `mpirun -np 2` and `-np 4`. Every rank compares its part with
// the single-process call; the failure count is summed so every rank exits with the same code.
// Ends with rank 0 printing "N passed, M failed".
#include "../distributed_cases.hpp"

#include <kvevict/mpi.hpp>

#include <cstdio>
#include <string>

namespace {

int failures = 0, passes = 0;

void expect(int rank, const char* what, std::uint64_t seed, const std::string& err) {
  if (err.empty()) {
    ++passes;
    return;
  }
  ++failures;
  std::fprintf(stderr, "rank %d: %s (seed %llu): %s\n", rank, what, static_cast<unsigned long long>(seed), err.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    kvevict::mpi_comm comm(MPI_COMM_WORLD);
    kvevict::detail::par_min_elements() = 1;  // par runs its threads even on these small layers
    const int rank = comm.rank();
    namespace d = kvtest::dist;
    for (std::uint64_t seed = 0; seed < 40; ++seed) {
      expect(rank, "select_topk_flat", seed, d::check_flat(comm, seed));
      expect(rank, "adakv_budgets", seed, d::check_adakv(comm, seed));
      expect(rank, "lava_layer_entropy", seed, d::check_lava_entropy(comm, seed));
      expect(rank, "cake_layer_stats", seed, d::check_cake_stats(comm, seed));
      expect(rank, "cake_window_preference", seed, d::check_cake_window(comm, seed));
      expect(rank, "post_fill_driver lava", seed, d::check_post_fill_all_layer(comm, seed, false));
      expect(rank, "post_fill_driver cake", seed, d::check_post_fill_all_layer(comm, seed, true));
      if (seed < 4) {  // the drivers: many small collectives per case (threads cover 20-30 seeds)
        expect(rank, "post_fill_driver lava, pipeline", seed, d::check_post_fill_all_layer(comm, seed, false, true));
        expect(rank, "post_fill_driver cake, pipeline", seed, d::check_post_fill_all_layer(comm, seed, true, true));
      }
      if (seed < 2) {  // a collective at every due step: the threads run 30 seeds
        expect(rank, "decode_driver flattened", seed, d::check_decode_sharded(comm, seed, false));
        expect(rank, "decode_driver adakv", seed, d::check_decode_sharded(comm, seed, true));
      }
      expect(rank, "layer budgets", seed, d::check_layer_budgets(comm, seed));
      expect(rank, "pipeline cascade", seed, d::check_pipeline_cascade(comm, seed));
      if (seed < 4) {  // a collective per step and per shrinking layer: the threads run 40 seeds
        expect(rank, "tensor-parallel cascade", seed, d::check_tp_cascade(comm, seed));
        expect(rank, "tensor-parallel cascade, a bad call on one rank", seed,
               d::check_tp_cascade_error(comm, seed, static_cast<int>(seed) % comm.size(), static_cast<int>(seed % 3)));
      }
    }
    if (comm.size() == 4) {  // tensor and pipeline parallelism together: a 2 x 2 grid split by mpi_grid
      kvevict::mpi_grid grid;
      const kvevict::status st = grid.init(MPI_COMM_WORLD, 2, 2);
      expect(rank, "mpi_grid", 0, st.ok() ? "" : st.message());
      if (st.ok()) {
        const kvevict::grid_place at = kvevict::grid_place_of(2, 2, rank).value();
        expect(rank, "mpi_grid ranks", 0,
               grid.tp().rank() == at.shard && grid.pp().rank() == at.stage && grid.tp().size() == 2 &&
                       grid.pp().size() == 2
                   ? ""
                   : "the groups' ranks are not grid_place_of's");
        for (std::uint64_t seed = 0; seed < 4; ++seed)
          for (bool cake : {false, true})
            expect(rank, cake ? "post_fill_driver cake, 2 x 2 grid" : "post_fill_driver lava, 2 x 2 grid", seed,
                   d::check_post_fill_grid(&grid.tp(), &grid.pp(), seed, cake));
      }
      kvevict::mpi_grid wrong;  // the job's size is not 3 x 2: the same error on every rank
      const kvevict::status bad = wrong.init(MPI_COMM_WORLD, 3, 2);
      expect(rank, "mpi_grid of the wrong size", 0,
             !bad.ok() && std::string(bad.message()).find("needs 6 ranks, the job has 4") != std::string::npos
                 ? ""
                 : "no error for a 3 x 2 grid on 4 ranks");
    }
    // inconsistent configuration / invalid arguments on one rank: every rank fails, none hangs
    for (int odd = 0; odd < comm.size(); ++odd)
      for (bool bad_lengths : {false, true})
        expect(rank, bad_lengths ? "invalid lengths on one rank" : "different total on one rank",
               static_cast<std::uint64_t>(odd), d::check_disagreement(comm, odd, bad_lengths));
    expect(rank, "heads not divisible by the ranks", 0, d::check_uneven_heads(comm));
    long long counts[2] = {passes, failures};
    MPI_Allreduce(MPI_IN_PLACE, counts, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
      std::printf("test_mpi_distributed on %d ranks: %lld passed, %lld failed\n", comm.size(), counts[0], counts[1]);
    failures = static_cast<int>(counts[1]);
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
