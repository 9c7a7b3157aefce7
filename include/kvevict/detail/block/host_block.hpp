// A CUDA thread block emulated on the host, for the tests of the block-generic kernel logic
// (detail/block/select_block.hpp, detail/block/compact_block.hpp): every phase runs each thread's part in turn,
// in a random order (a race-free block program gives the same result for every order, as it must
// on the GPU), and the block-wide exclusive sum is computed serially.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/block.hpp>
#include <kvevict/detail/base/stage_math.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace kvevict::detail {

struct host_block {
  int n;
  std::mt19937_64* g;
  std::vector<int> order;

  host_block(int threads, std::mt19937_64& gen) : n(threads), g(&gen), order(static_cast<std::size_t>(threads)) {
    std::iota(order.begin(), order.end(), 0);
  }
  int size() const { return n; }
  void shuffle() { std::shuffle(order.begin(), order.end(), *g); }
  template <class F>
  void each(F&& f) {
    shuffle();
    for (int t : order) f(t);
  }
  void sync() {}
  template <class V, class Then>
  void exclusive_sum(const V& v, const Then& then) {
    std::vector<ucount> own(static_cast<std::size_t>(n)), prefix(own.size());
    shuffle();
    for (int t : order) own[t] = v(t);
    ucount run = 0;
    for (int t = 0; t < n; ++t) {
      prefix[t] = run;
      run += own[t];
    }
    shuffle();
    for (int t : order) then(t, own[t], prefix[t], run);
  }
  void atomic_add(std::uint32_t* p, std::uint32_t v) { *p += v; }
  void atomic_add(ucount* p, ucount v) { *p += v; }
  void plain_read(const void*, std::size_t) const {}  // no race check in this emulation
  void plain_write(void*, std::size_t) const {}
};


}  // namespace kvevict::detail
