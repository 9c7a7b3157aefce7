// kvevict/thread_comm.hpp: a communicator whose ranks are threads of one process (the
// kvevict/comm.hpp contract), for running and testing the sharded calls without MPI
// (docs/distributed.md, "Ranks as threads").
//
//   kvevict::thread_group g(P);                    // what P thread ranks share
//   kvevict::thread_comm c(g, rank);               // rank `rank` of g, on its own thread
//   kvevict::run_thread_ranks(P, [&](kvevict::thread_comm& c) { ... });   // P threads, joined
//
// Every collective deposits this rank's bytes in its slot, waits for all ranks, combines the slots
// in rank order (so every rank computes the same bits: sums start from 0 and add rank 0, 1, ..),
// and waits again before the slots are reused. A rank that waits longer than the group's timeout
// (default 60 s) gets an error instead of hanging; ranks contributing different byte counts get
// shape_mismatch. The slots keep their capacity, so a warm collective allocates nothing.
#pragma once

#include <kvevict/comm.hpp>
#include <kvevict/config.hpp>
#include <kvevict/status.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace kvevict {

/// What `size` thread ranks share: one byte slot per rank and a reusable barrier.
class thread_group {
 public:
  explicit thread_group(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : size_(size > 0 ? size : 1), timeout_(timeout), slots_(static_cast<std::size_t>(size_)) {}
  thread_group(const thread_group&) = delete;
  thread_group& operator=(const thread_group&) = delete;

  int size() const noexcept { return size_; }

  /// One collective of rank `rank`: deposits `bytes` bytes of `data`, waits for every rank, calls
  /// combine(slots) (the ranks' deposits, in rank order), waits again.
  template <class Combine>
  status exchange(int rank, const void* data, std::size_t bytes, Combine&& combine) {
    auto& slot = slots_[static_cast<std::size_t>(rank)];
    const auto* p = static_cast<const unsigned char*>(data);
    slot.assign(p, p + bytes);
    KVEVICT_TRY(barrier(rank));
    for (int r = 0; r < size_; ++r)
      if (slots_[static_cast<std::size_t>(r)].size() != bytes) {
        const std::size_t theirs = slots_[static_cast<std::size_t>(r)].size();
        // every rank must still pass the second barrier, or the others would time out
        KVEVICT_TRY(barrier(rank));
        return status::error(errc::shape_mismatch, "thread_comm: rank %d sent %zu bytes, rank %d %zu", rank, bytes, r,
                             theirs);
      }
    combine(static_cast<const std::vector<std::vector<unsigned char>>&>(slots_));
    return barrier(rank);
  }

 private:
  status barrier(int rank) {
    std::unique_lock<std::mutex> lock(mu_);
    const unsigned gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return {};
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen; }))
      return status::error(errc::invalid_argument,
                           "thread_comm: rank %d waited %lld ms for the other ranks (every rank must make the same "
                           "calls, each on its own thread)",
                           rank, static_cast<long long>(timeout_.count()));
    return {};
  }

  int size_;
  std::chrono::milliseconds timeout_;
  std::vector<std::vector<unsigned char>> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  unsigned generation_ = 0;
};

/// Rank `rank` of a thread_group (the comm.hpp contract). Copyable; the group must outlive it.
class thread_comm {
 public:
  thread_comm(thread_group& group, int rank) noexcept : group_(&group), rank_(rank) {}
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return group_->size(); }

  status allreduce_sum(std::int64_t* data, index_t n) { return sum(data, data, n, size()); }
  status allreduce_sum(double* data, index_t n) { return sum(data, data, n, size()); }
  status exscan_sum(const std::int64_t* in, std::int64_t* out, index_t n) { return sum(in, out, n, rank_); }
  status allgather(const void* send, std::size_t bytes, void* recv) {
    return group_->exchange(rank_, send, bytes, [&](const auto& slots) {
      for (std::size_t r = 0; r < slots.size(); ++r)
        if (bytes > 0) std::memcpy(static_cast<unsigned char*>(recv) + r * bytes, slots[r].data(), bytes);
    });
  }

 private:
  /// out[i] = sum over ranks [0, upto) of in[i], in rank order (in and out may be one array).
  template <class V>
  status sum(const V* in, V* out, index_t n, int upto) {
    const std::size_t bytes = static_cast<std::size_t>(n > 0 ? n : 0) * sizeof(V);
    return group_->exchange(rank_, in, bytes, [&](const auto& slots) {
      for (index_t i = 0; i < n; ++i) {
        V acc = 0;
        for (int r = 0; r < upto; ++r) {
          V part;
          std::memcpy(&part, slots[static_cast<std::size_t>(r)].data() + static_cast<std::size_t>(i) * sizeof(V),
                      sizeof(V));
          acc += part;
        }
        out[i] = acc;
      }
    });
  }

  thread_group* group_;
  int rank_;
};

/// Runs body(thread_comm&) for ranks 0 .. ranks-1, each on its own thread, and joins them.
template <class Body>
void run_thread_ranks(int ranks, Body&& body, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  thread_group group(ranks, timeout);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(group.size()));
  for (int r = 0; r < group.size(); ++r)
    threads.emplace_back([&group, &body, r] {
      thread_comm c(group, r);
      body(c);
    });
  for (auto& t : threads) t.join();
}

}  // namespace kvevict
