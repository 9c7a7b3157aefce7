// Sharded eviction (kvevict/distributed.hpp) with ranks as threads (tests/thread_comm.hpp): every
// rank's part equals the single-process call's, errors reach every rank, and the bytes sent per
// layer are the documented ones. The same checks run under mpirun in tests/mpi/.
#include "distributed_cases.hpp"
#include "support.hpp"
#include "thread_comm.hpp"

#include <kvevict/comm.hpp>
#include <kvevict/distributed.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

using namespace kvevict;
using kvtest::thread_comm;
using kvtest::thread_world;

namespace {

/// Runs check(comm, seed) on `ranks` threads; every rank's answer must be "". par runs its threads
/// even on these small layers (par_min_elements lowered while the ranks run).
template <class Check>
void on_ranks(int ranks, std::uint64_t seed, Check check) {
  const index_t saved = detail::par_min_elements();
  detail::par_min_elements() = 1;
  std::vector<std::string> out(static_cast<std::size_t>(ranks));
  thread_world::run(ranks, [&](thread_comm& c) { out[static_cast<std::size_t>(c.rank())] = check(c, seed); });
  detail::par_min_elements() = saved;
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(seed);
    CAPTURE(ranks);
    CAPTURE(r);
    CHECK_MESSAGE(out[static_cast<std::size_t>(r)].empty(), out[static_cast<std::size_t>(r)]);
  }
}

}  // namespace

TEST_CASE("sharded select_topk_flat: every rank keeps exactly the single-process rows (ties, NaN, floors)") {
  for (int ranks : {1, 2, 3, 4})
    for (std::uint64_t seed = 0; seed < 60; ++seed)
      on_ranks(ranks, 1000 * ranks + seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_flat(c, s); });
  // the single-process communicator is the identity
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    single_process one;
    CHECK(kvtest::dist::check_flat(one, seed) == "");
  }
}

TEST_CASE("sharded adakv_budgets, lava_layer_entropy, cake_layer_stats, cake_window_preference and post_fill_driver (lava, cake) equal the single-process calls") {
  for (int ranks : {1, 2, 4})
    for (std::uint64_t seed = 0; seed < 30; ++seed) {
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_adakv(c, s); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_lava_entropy(c, s); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_cake_stats(c, s); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_cake_window(c, s); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_post_fill_all_layer(c, s, false); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_post_fill_all_layer(c, s, true); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_decode_sharded(c, s, false); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_decode_sharded(c, s, true); });
    }
}

TEST_CASE("layer-sharded LAVa / CAKE budgets: gathered layer values give the single-process budgets") {
  for (int ranks : {1, 2, 3, 4})
    for (std::uint64_t seed = 0; seed < 30; ++seed)
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_layer_budgets(c, s); });
  for (int ranks : {1, 2, 3, 4})
    for (std::uint64_t seed = 0; seed < 20; ++seed) {
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_post_fill_all_layer(c, s, false, true); });
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_post_fill_all_layer(c, s, true, true); });
    }
}

TEST_CASE("tensor and pipeline parallelism together: post_fill_driver (lava, cake) on a grid keeps the single-process rows") {
  // ranks as threads numbered stage-major (grid_place_of): each stage's tp ranks share one
  // thread_group, the ranks holding the same heads (one per stage) another
  for (const auto& [tp, pp] : {std::pair{2, 2}, std::pair{2, 3}, std::pair{3, 2}, std::pair{1, 2}, std::pair{2, 1}})
    for (std::uint64_t seed = 0; seed < 12; ++seed)
      for (bool cake : {false, true}) {
        std::vector<std::unique_ptr<kvevict::thread_group>> stages, shards;
        for (int s = 0; s < pp; ++s) stages.push_back(std::make_unique<kvevict::thread_group>(tp));
        for (int h = 0; h < tp; ++h) shards.push_back(std::make_unique<kvevict::thread_group>(pp));
        std::vector<std::string> out(static_cast<std::size_t>(tp * pp));
        thread_world::run(tp * pp, [&](thread_comm& world) {
          const grid_place at = grid_place_of(tp, pp, world.rank()).value();
          thread_comm t(*stages[static_cast<std::size_t>(at.stage)], at.shard);
          thread_comm p(*shards[static_cast<std::size_t>(at.shard)], at.stage);
          out[static_cast<std::size_t>(world.rank())] = kvtest::dist::check_post_fill_grid(&t, &p, 100 * seed + tp, cake);
        });
        for (int r = 0; r < tp * pp; ++r) {
          CAPTURE(tp);
          CAPTURE(pp);
          CAPTURE(seed);
          CAPTURE(cake);
          CAPTURE(r);
          CHECK_MESSAGE(out[static_cast<std::size_t>(r)].empty(), out[static_cast<std::size_t>(r)]);
        }
      }
}

TEST_CASE("grid_place_of: stage-major ranks; errors") {
  CHECK(grid_place_of(2, 3, 0).value().stage == 0);
  CHECK(grid_place_of(2, 3, 3).value().stage == 1);
  CHECK(grid_place_of(2, 3, 3).value().shard == 1);
  CHECK(grid_place_of(2, 3, 5).value().stage == 2);
  CHECK(grid_place_of(1, 4, 2).value().stage == 2);
  CHECK(grid_place_of(4, 1, 2).value().shard == 2);
  kvtest::require_error(grid_place_of(2, 2, 4).error(), errc::invalid_argument, "rank 4 of a 2 x 2 grid");
  kvtest::require_error(grid_place_of(0, 2, 0).error(), errc::invalid_argument, "need tp, pp >= 1");
}

TEST_CASE("pipeline-parallel cascade: each stage's layers hold what the single-process cascade holds") {
  for (int ranks : {1, 2, 3, 4})
    for (std::uint64_t seed = 0; seed < 25; ++seed)
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_pipeline_cascade(c, s); });
}

TEST_CASE("tensor-parallel cascade: each rank's layers hold its heads' rows of the single-process cascade, every step") {
  for (int ranks : {1, 2, 3})
    for (std::uint64_t seed = 0; seed < 40; ++seed)
      on_ranks(ranks, seed, [](thread_comm& c, std::uint64_t s) { return kvtest::dist::check_tp_cascade(c, s); });
  // a bad call (NaN scores, a layer out of order) or a disagreement (CAKE weight, total) on one rank
  // fails every rank at that layer with the same error
  for (int ranks : {2, 3})
    for (int fault = 0; fault < 3; ++fault)
      for (std::uint64_t seed = 0; seed < 6; ++seed) {
        const int odd = static_cast<int>(seed % static_cast<std::uint64_t>(ranks));
        on_ranks(ranks, seed, [odd, fault](thread_comm& c, std::uint64_t s) {
          return kvtest::dist::check_tp_cascade_error(c, s, odd, fault);
        });
      }
}

TEST_CASE("sharded calls: an inconsistent or invalid rank fails every rank with the same error") {
  for (int ranks : {2, 3, 4})
    for (int odd = 0; odd < ranks; ++odd)
      for (bool bad_lengths : {false, true})
        on_ranks(ranks, 0, [odd, bad_lengths](thread_comm& c, std::uint64_t) {
          return kvtest::dist::check_disagreement(c, odd, bad_lengths);
        });
  // heads not divisible by the ranks: head_shard refuses; an uneven split anyway disagrees
  for (int ranks : {1, 2, 3, 4})
    on_ranks(ranks, 0, [](thread_comm& c, std::uint64_t) { return kvtest::dist::check_uneven_heads(c); });
  // a layer gather whose ranges leave a layer out
  std::vector<status> gathered(2);
  thread_world::run(2, [&](thread_comm& c) {
    const double v[2] = {1.0, 2.0};
    double all[4] = {};
    const shard_range mine{c.rank() == 0 ? 0 : 2, 2};
    workspace q;
    (void)gather_layer_values(q, c, mine, v, 5, all);
    std::vector<unsigned char> mem(q.bytes);
    workspace ws{mem.data(), mem.size()};
    double all5[5] = {};
    gathered[static_cast<std::size_t>(c.rank())] = gather_layer_values(ws, c, mine, v, 5, all5);
  });
  for (const status& st : gathered) kvtest::require_error(st, errc::invalid_argument, "layer 4 is held by 0 stages");
}

TEST_CASE("head_shard and layer_shard: contiguous slices; heads not divisible by the ranks are an error") {
  CHECK(kvtest::value_of(head_shard(8, 4, 3)).first == 6);
  CHECK(head_shard(8, 4, 3).value().count == 2);
  kvtest::require_error(head_shard(4, 3, 0).error(), errc::invalid_argument, "4 KV heads are not divisible by 3 ranks");
  kvtest::require_error(head_shard(4, 2, 2).error(), errc::invalid_argument, "rank 2 of 2");
  index_t next = 0;
  for (int r = 0; r < 3; ++r) {
    const shard_range s = layer_shard(7, 3, r).value();
    CHECK(s.first == next);
    next += s.count;
  }
  CHECK(next == 7);
  kvtest::require_error(layer_shard(2, 3, 0).error(), errc::invalid_argument, "layers");
}

TEST_CASE("counting_comm: bytes sent per rank per flattened layer selection") {
  // agreement 11 int64 (88 B) + three passes 2048 + 2048 + 1024 int64 (40960 B) + the tied share
  // (8 B allreduce, 8 B exclusive scan) = 41064 B in 6 collectives
  for (int ranks : {1, 2, 4}) {
    std::vector<std::uint64_t> bytes(static_cast<std::size_t>(ranks)), calls(bytes.size());
    std::vector<std::string> errors(bytes.size());
    thread_world::run(ranks, [&](thread_comm& c) {
      counting_comm<thread_comm> counted(c);
      const index_t n = 2, T = 64;
      std::vector<float> s(static_cast<std::size_t>(n * T));
      for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>((i * 37 + c.rank()) % 11);
      std::vector<std::int32_t> cu(static_cast<std::size_t>(n + 1));
      std::vector<pos_t> pos(static_cast<std::size_t>(n * T));
      const status st = kvtest::dist::with_workspace([&](workspace& ws) {
        return select_topk_flat(seq, ws, counted, make_matrix_view<const float>(s.data(), n, T).value(), nullptr,
                                40 * ranks, nullptr, cu.data(), pos.data());
      });
      errors[static_cast<std::size_t>(c.rank())] = st.ok() ? "" : st.message();
      bytes[static_cast<std::size_t>(c.rank())] = counted.bytes();
      calls[static_cast<std::size_t>(c.rank())] = counted.calls();
    });
    for (int r = 0; r < ranks; ++r) {
      CHECK(errors[static_cast<std::size_t>(r)] == "");
      CHECK(bytes[static_cast<std::size_t>(r)] == 41064);
      CHECK(calls[static_cast<std::size_t>(r)] == 6);
    }
  }
}

TEST_CASE("counting_comm: bytes sent per rank by the LAVa entropy, the CAKE statistics and the layer gather") {
  // each: an agreement of 9 int64 (72 B), then allgathers of the rank's per-head records
  // (LAVa: two of R lava_head, CAKE: one of R cake_row) or one allreduce of 2 L doubles (gather)
  const index_t R = 3, T = 40, w = 4, L = 7;
  std::vector<std::string> errors(4);
  std::vector<std::uint64_t> lava(4), cake(4), gather(4);
  thread_world::run(4, [&](thread_comm& c) {
    const auto me = static_cast<std::size_t>(c.rank());
    counting_comm<thread_comm> counted(c);
    std::vector<float> s(static_cast<std::size_t>(R * T), 0.5f), a(static_cast<std::size_t>(R * w * T), 0.25f);
    double e = 0.0;
    status st = kvtest::dist::with_workspace([&](workspace& ws) {
      return lava_layer_entropy(seq, ws, counted, make_matrix_view<const float>(s.data(), R, T).value(), nullptr,
                                lava_entropy_options{}, &e);
    });
    lava[me] = counted.bytes();
    counted.reset();
    cake_stats cs;
    if (st.ok())
      st = kvtest::dist::with_workspace([&](workspace& ws) {
        return cake_layer_stats(seq, ws, counted, make_kv_view<const float>(a.data(), R, w, T).value(), &cs);
      });
    cake[me] = counted.bytes();
    counted.reset();
    const double v[2] = {1.0, 2.0};
    double all[L] = {};
    const shard_range mine = layer_shard(L, 4, c.rank()).value();
    if (st.ok())
      st = kvtest::dist::with_workspace(
          [&](workspace& ws) { return gather_layer_values(ws, counted, mine, v, L, all); });
    gather[me] = counted.bytes();
    errors[me] = st.ok() ? "" : st.message();
  });
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(errors[r] == "");
    CHECK(lava[r] == 72 + 2 * R * sizeof(detail::lava_head));
    CHECK(cake[r] == 72 + R * sizeof(detail::cake_row));
    CHECK(gather[r] == 72 + 2 * L * sizeof(double));
  }
  CHECK(sizeof(detail::lava_head) == 32);
  CHECK(sizeof(detail::cake_row) == 40);
}
