// The SIMT execution context of kernel bodies written once for the GPU and the host, and its host
// executor. Not API.
//
// A kernel body is a KVEVICT_HOST_DEVICE function template over a context `c` (one object per
// thread) with:
//   index_t thread(), block(), block_dim(), grid_dim()   threadIdx.x, blockIdx.x, blockDim.x, gridDim.x
//   int lane(), warp()                                   thread() % 32, thread() / 32
//   void sync()                                          __syncthreads
//   T shfl(T v, int src), shfl_xor(T v, int m), shfl_down(T v, int d)   full-warp shuffles
//   bool any(bool), all(bool); std::uint32_t ballot(bool)                full-warp votes
//   T ld(const T* p); void st(T* p, T v)                 shared-memory accesses (race-checked on the host)
//   T atomic_add(T* p, T v)                              atomicAdd (returns the old value)
//   void fence()                                         __threadfence
// On the GPU (cuda_simt_ctx, cuda/simt.cuh) every member is the intrinsic. On the host,
// simt_executor runs every thread of a block as a fiber (ucontext) with its own stack:
//   - a block barrier releases only when every thread of the block waits at one; a thread that
//     finishes while others wait at a barrier, or a deadlock, is reported (barrier divergence);
//   - warps of 32: a shuffle or vote completes when all 32 lanes have reached one (the same kind),
//     and a lane that leaves the warp (finishes, or waits at a barrier) meanwhile is reported;
//   - between synchronisation points the runnable threads run in a random order (seeded), and a
//     thread may also be preempted at any shared-memory access;
//   - races: shadow state per shared-memory word per barrier epoch (last writer, readers); two
//     different threads touching one word in one epoch, one of them writing (atomics excepted), are
//     reported with both thread ids;
//   - blocks run one after the other, in a random order.
// Errors are collected (first one kept, with the thread, block and what happened) and the run stops
// at the first. Global memory is accessed directly: the bodies' global accesses are plain C++.
#pragma once

#include <kvevict/config.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <ucontext.h>

// Under AddressSanitizer every fiber switch is announced (start / finish_switch_fiber), so that ASan
// knows which stack is live (no false reports, exceptions unwinding a fiber's stack included).
#if defined(__SANITIZE_ADDRESS__)
#  define KVEVICT_SIMT_ASAN 1
#elif defined(__has_feature)
#  if __has_feature(address_sanitizer)
#    define KVEVICT_SIMT_ASAN 1
#  endif
#endif
#ifndef KVEVICT_SIMT_ASAN
#  define KVEVICT_SIMT_ASAN 0
#endif
#if KVEVICT_SIMT_ASAN
#  include <sanitizer/common_interface_defs.h>
#endif

namespace kvevict::detail {

class simt_executor;

/// One host thread of a block: the context a kernel body sees.
class simt_thread {
 public:
  index_t thread() const noexcept { return tid_; }
  index_t block() const noexcept;
  index_t block_dim() const noexcept;
  index_t grid_dim() const noexcept;
  int lane() const noexcept { return static_cast<int>(tid_ % 32); }
  int warp() const noexcept { return static_cast<int>(tid_ / 32); }

  void sync();
  template <class T>
  T shfl(T v, int src);
  template <class T>
  T shfl_xor(T v, int mask) {
    return shfl(v, lane() ^ mask);
  }
  template <class T>
  T shfl_down(T v, int delta) {
    const int s = lane() + delta;
    return exchange_value(v, s < 32 ? s : lane(), 'd');
  }
  bool any(bool p) { return vote(p) != 0; }
  bool all(bool p) { return vote(p) == 0xffffffffu; }
  std::uint32_t ballot(bool p) { return vote(p); }
  template <class T>
  T ld(const T* p);
  template <class T>
  void st(T* p, T v);
  template <class T>
  T atomic_add(T* p, T v);
  void fence() {}

 private:
  friend class simt_executor;
  enum class state { ready, barrier, warp_op, done };
  simt_executor* ex_ = nullptr;
  index_t tid_ = 0;
  state st_ = state::ready;
  ucontext_t uc_{};
  std::vector<char> stack_;
  void* fake_stack_ = nullptr;  ///< ASan's fake stack of this fiber while it is switched out
  // warp exchange: the value deposited (up to 8 bytes), the source lane, the kind of operation
  std::uint64_t xval_ = 0, xres_ = 0;
  int xsrc_ = 0;
  char xkind_ = 0;

  template <class T>
  T exchange_value(T v, int src, char kind);
  std::uint32_t vote(bool p);
  void block_on(state s);
  void access(const void* p, std::size_t bytes, bool write, bool atomic);
};

class simt_executor {
 public:
  /// `shared_bytes` of shared memory per block, reachable through shared() (zeroed per block).
  explicit simt_executor(std::uint64_t seed, std::size_t shared_bytes = 0, std::size_t stack_bytes = 1 << 17)
      : gen_(seed), stack_bytes_(stack_bytes), shared_(shared_bytes) {}

  /// Runs body(ctx) on every thread of `grid` blocks of `block` threads. Returns false (and keeps
  /// error()) on a race, barrier divergence, bad warp operation, deadlock or an exception.
  template <class Body>
  bool run(index_t grid, index_t block, Body&& body) {
    body_ = [&body](simt_thread& t) { body(t); };
    grid_ = grid;
    block_dim_ = block;
    std::vector<index_t> order(static_cast<std::size_t>(grid));
    for (index_t b = 0; b < grid; ++b) order[static_cast<std::size_t>(b)] = b;
    std::shuffle(order.begin(), order.end(), gen_);
    for (index_t b : order)
      if (!run_block(b)) break;
    body_ = nullptr;
    return error_.empty();
  }
  const std::string& error() const noexcept { return error_; }
  /// Shared memory per block from now on.
  void resize_shared(std::size_t bytes) { shared_.assign(bytes, 0); }
  /// This block's shared memory (valid inside run()).
  unsigned char* shared() noexcept { return shared_.data(); }
  template <class T>
  T* shared_as(std::size_t byte_offset = 0) noexcept {
    return reinterpret_cast<T*>(shared_.data() + byte_offset);
  }
  /// Preempt a thread at a shared-memory access with probability 1 / n (0: never).
  void preempt_one_in(unsigned n) noexcept { preempt_ = n; }
  /// Barriers every thread passed, over the whole run (for tests).
  index_t barriers() const noexcept { return barriers_; }

 private:
  friend class simt_thread;
  struct aborted {};
  struct shadow {
    index_t epoch = -1;
    index_t writer = -1;   ///< last writing thread in this epoch
    index_t reader = -1;   ///< a reading thread in this epoch
    bool many_readers = false;
    bool atomic_only = true;
  };

  std::mt19937_64 gen_;
  std::size_t stack_bytes_;
  std::vector<unsigned char> shared_;
  std::vector<shadow> shadow_;
  std::vector<simt_thread> threads_;
  std::function<void(simt_thread&)> body_;
  index_t grid_ = 0, block_dim_ = 0, block_ = 0, epoch_ = 0, barriers_ = 0;
  unsigned preempt_ = 8;
  ucontext_t sched_{};
  simt_thread* current_ = nullptr;
  std::string error_;

  // ASan fiber annotations (no-ops without ASan)
  void* sched_fake_ = nullptr;
  const void* sched_bottom_ = nullptr;
  std::size_t sched_size_ = 0;
  static void asan_start(void** fake, const void* bottom, std::size_t size) {
#if KVEVICT_SIMT_ASAN
    __sanitizer_start_switch_fiber(fake, bottom, size);
#else
    (void)fake, (void)bottom, (void)size;
#endif
  }
  static void asan_finish(void* fake, const void** bottom, std::size_t* size) {
#if KVEVICT_SIMT_ASAN
    __sanitizer_finish_switch_fiber(fake, bottom, size);
#else
    (void)fake, (void)bottom, (void)size;
#endif
  }
  /// Scheduler -> thread t until it blocks or finishes.
  void enter(simt_thread& t) {
    current_ = &t;
    asan_start(&sched_fake_, t.stack_.data(), t.stack_.size());
    swapcontext(&sched_, &t.uc_);
    asan_finish(sched_fake_, nullptr, nullptr);
    current_ = nullptr;
  }

  static void trampoline(unsigned lo, unsigned hi) {
    const std::uintptr_t p = (static_cast<std::uintptr_t>(hi) << 32) | lo;
    simt_thread* t = reinterpret_cast<simt_thread*>(p);
    asan_finish(nullptr, &t->ex_->sched_bottom_, &t->ex_->sched_size_);
    try {
      if (t->ex_->error_.empty()) t->ex_->body_(*t);
    } catch (const aborted&) {
      // the run failed elsewhere: this fiber unwound its stack
    } catch (const std::exception& e) {
      t->ex_->fail(*t, std::string("exception: ") + e.what());
    }
    t->st_ = simt_thread::state::done;
    asan_start(nullptr, t->ex_->sched_bottom_, t->ex_->sched_size_);  // this fiber's stack is done
    // returning resumes uc_link (the scheduler)
  }

  void fail(const simt_thread& t, const std::string& what) {
    if (!error_.empty()) return;
    error_ = "block " + std::to_string(block_) + " thread " + std::to_string(t.tid_) + ": " + what;
  }

  bool run_block(index_t b) {
    block_ = b;
    ++epoch_;
    std::fill(shared_.begin(), shared_.end(), 0);
    shadow_.assign((shared_.size() + 3) / 4, shadow{});
    threads_.resize(static_cast<std::size_t>(block_dim_));
    for (index_t i = 0; i < block_dim_; ++i) {
      simt_thread& t = threads_[static_cast<std::size_t>(i)];
      t.ex_ = this;
      t.tid_ = i;
      t.st_ = simt_thread::state::ready;
      t.stack_.resize(stack_bytes_);
      getcontext(&t.uc_);
      t.uc_.uc_stack.ss_sp = t.stack_.data();
      t.uc_.uc_stack.ss_size = t.stack_.size();
      t.uc_.uc_link = &sched_;
      const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(&t);
      makecontext(&t.uc_, reinterpret_cast<void (*)()>(&simt_executor::trampoline), 2,
                  static_cast<unsigned>(p & 0xffffffffu), static_cast<unsigned>(p >> 32));
    }
    std::vector<simt_thread*> ready;
    for (;;) {
      ready.clear();
      for (auto& t : threads_)
        if (t.st_ == simt_thread::state::ready) ready.push_back(&t);
      if (!error_.empty()) {
        unwind();
        return false;
      }
      if (ready.empty()) {
        if (!settle()) {
          unwind();
          return false;
        }
        bool all_done = true;
        for (auto& t : threads_) all_done = all_done && t.st_ == simt_thread::state::done;
        if (all_done) return true;
        continue;
      }
      enter(*ready[std::uniform_int_distribution<std::size_t>(0, ready.size() - 1)(gen_)]);
    }
  }

  // After an error: resume every unfinished fiber once; it throws `aborted` from its suspension point
  // (or skips the body if it never started) and unwinds its stack.
  void unwind() {
    for (auto& t : threads_)
      if (t.st_ != simt_thread::state::done) enter(t);
  }

  // Nothing is runnable: complete warp operations or the barrier, or report why nobody can move.
  bool settle() {
    bool progressed = false;
    // warp operations: a warp whose 32 lanes all wait at one
    const index_t warps = (block_dim_ + 31) / 32;
    for (index_t w = 0; w < warps; ++w) {
      const index_t lo = w * 32, hi = lo + 32 < block_dim_ ? lo + 32 : block_dim_;
      int waiting = 0;
      char kind = 0;
      for (index_t i = lo; i < hi; ++i) {
        const simt_thread& t = threads_[static_cast<std::size_t>(i)];
        if (t.st_ == simt_thread::state::warp_op) {
          if (waiting > 0 && t.xkind_ != kind) {
            fail(t, std::string("warp ") + std::to_string(w) + ": lanes at different warp operations");
            return false;
          }
          kind = t.xkind_;
          ++waiting;
        }
      }
      if (waiting == 0) continue;
      if (hi - lo != 32) {
        fail(threads_[static_cast<std::size_t>(lo)], "a full-warp operation in a partial warp");
        return false;
      }
      if (waiting != 32) {
        for (index_t i = lo; i < hi; ++i)
          if (threads_[static_cast<std::size_t>(i)].st_ != simt_thread::state::warp_op) {
            fail(threads_[static_cast<std::size_t>(i)],
                 std::string("did not reach the warp operation its warp waits at (") +
                     (threads_[static_cast<std::size_t>(i)].st_ == simt_thread::state::done ? "finished"
                                                                                            : "at a barrier") +
                     ")");
            return false;
          }
      }
      std::uint32_t ballot = 0;
      for (index_t i = lo; i < hi; ++i) {
        const simt_thread& t = threads_[static_cast<std::size_t>(i)];
        if (t.xval_ != 0) ballot |= 1u << (i - lo);
      }
      for (index_t i = lo; i < hi; ++i) {
        simt_thread& t = threads_[static_cast<std::size_t>(i)];
        t.xres_ = kind == 'v' ? ballot : threads_[static_cast<std::size_t>(lo + t.xsrc_)].xval_;
      }
      for (index_t i = lo; i < hi; ++i) threads_[static_cast<std::size_t>(i)].st_ = simt_thread::state::ready;
      progressed = true;
    }
    if (progressed) return true;
    int at_barrier = 0, done = 0;
    for (const auto& t : threads_) {
      at_barrier += t.st_ == simt_thread::state::barrier;
      done += t.st_ == simt_thread::state::done;
    }
    if (at_barrier == 0) return true;  // every thread finished
    if (done > 0) {
      for (const auto& t : threads_)
        if (t.st_ == simt_thread::state::done) {
          fail(t, "finished without reaching the barrier " + std::to_string(at_barrier) +
                      " other threads wait at (barrier divergence)");
          return false;
        }
    }
    ++epoch_;  // every thread waits at the barrier: release it; a new shared-memory epoch
    ++barriers_;
    for (auto& t : threads_) t.st_ = simt_thread::state::ready;
    return true;
  }

  void check_access(simt_thread& t, const void* p, std::size_t bytes, bool write, bool atomic) {
    const auto* b = static_cast<const unsigned char*>(p);
    if (b < shared_.data() || b >= shared_.data() + shared_.size()) return;  // global memory
    const std::size_t off = static_cast<std::size_t>(b - shared_.data());
    if (off + bytes > shared_.size()) {
      fail(t, "shared-memory access out of bounds at byte " + std::to_string(off));
      return;
    }
    for (std::size_t w = off / 4; w <= (off + bytes - 1) / 4; ++w) {
      shadow& s = shadow_[w];
      if (s.epoch != epoch_) s = shadow{epoch_, -1, -1, false, true};
      const index_t me = t.tid_;
      const bool other_writer = s.writer >= 0 && s.writer != me;
      const bool other_reader = s.many_readers || (s.reader >= 0 && s.reader != me);
      const bool both_atomic = atomic && s.atomic_only;
      if (!both_atomic && (other_writer || (write && other_reader))) {
        const index_t other = other_writer ? s.writer : s.reader;
        fail(t, std::string("shared-memory race on word ") + std::to_string(w) + ": " + (write ? "write" : "read") +
                    " after a " + (other_writer ? "write" : "read") + " by thread " + std::to_string(other) +
                    " with no barrier between");
        return;
      }
      s.atomic_only = s.atomic_only && atomic;
      if (write) {
        s.writer = me;
      } else if (s.reader < 0 || s.reader == me) {
        s.reader = me;
      } else {
        s.many_readers = true;
      }
    }
    if (preempt_ != 0 && std::uniform_int_distribution<unsigned>(0, preempt_ - 1)(gen_) == 0) t.block_on(simt_thread::state::ready);
  }
};

inline index_t simt_thread::block() const noexcept { return ex_->block_; }
inline index_t simt_thread::block_dim() const noexcept { return ex_->block_dim_; }
inline index_t simt_thread::grid_dim() const noexcept { return ex_->grid_; }

inline void simt_thread::block_on(state s) {
  st_ = s;
  simt_executor::asan_start(&fake_stack_, ex_->sched_bottom_, ex_->sched_size_);
  swapcontext(&uc_, &ex_->sched_);
  simt_executor::asan_finish(fake_stack_, &ex_->sched_bottom_, &ex_->sched_size_);
  if (!ex_->error_.empty()) throw simt_executor::aborted{};  // the run failed: unwind this fiber
}
inline void simt_thread::sync() { block_on(state::barrier); }

template <class T>
T simt_thread::exchange_value(T v, int src, char kind) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "simt: shuffles move values of up to 8 bytes");
  xval_ = 0;
  std::memcpy(&xval_, &v, sizeof(T));
  xsrc_ = src;
  xkind_ = kind;
  block_on(state::warp_op);
  T r;
  std::memcpy(&r, &xres_, sizeof(T));
  return r;
}
template <class T>
T simt_thread::shfl(T v, int src) {
  return exchange_value(v, src & 31, 's');
}
inline std::uint32_t simt_thread::vote(bool p) {
  xval_ = p ? 1 : 0;
  xsrc_ = lane();
  xkind_ = 'v';
  block_on(state::warp_op);
  return static_cast<std::uint32_t>(xres_);
}

inline void simt_thread::access(const void* p, std::size_t bytes, bool write, bool atomic) {
  ex_->check_access(*this, p, bytes, write, atomic);
  if (!ex_->error_.empty()) throw simt_executor::aborted{};
}
template <class T>
T simt_thread::ld(const T* p) {
  access(p, sizeof(T), false, false);
  return *p;
}
template <class T>
void simt_thread::st(T* p, T v) {
  access(p, sizeof(T), true, false);
  *p = v;
}
template <class T>
T simt_thread::atomic_add(T* p, T v) {
  access(p, sizeof(T), true, true);
  const T old = *p;
  *p = old + v;
  return old;
}

}  // namespace kvevict::detail
