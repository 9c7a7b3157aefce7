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
//   void plain_read(const void* p, size_t bytes)         announces a plain C++ read / write of the bytes
//   void plain_write(void* p, size_t bytes)              at p made next by this thread (code shared with
//                                                        host-only callers: memcpy, Op::stash): race-
//                                                        checked on the host like ld / st; nothing on the GPU
//   T atomic_add(T* p, T v), atomic_max(T* p, T v)       atomicAdd / atomicMax (return the old value)
//   void fence()                                         __threadfence
//   T ld_acquire(const T* p); void st_release(T* p, T v) device-scope acquire load / release store
//                                                        (global flags another block waits on)
//   T ld_cg(const T* p)                                  __ldcg (a global load past L1: data other
//                                                        blocks wrote before a ticket)
//   void pause()                                         __nanosleep in a wait loop (on the host: yield)
// On the GPU (cuda_simt_ctx, cuda/simt.cuh) every member is the intrinsic. On the host,
// simt_executor runs every thread of a block as a fiber with its own stack (switched by a few
// instructions on x86-64, by ucontext elsewhere):
//   - a block barrier releases only when every thread of the block waits at one; a thread that
//     finishes while others wait at a barrier, or a deadlock, is reported (barrier divergence);
//   - warps of 32: a shuffle or vote completes when all 32 lanes have reached one (the same kind),
//     and a lane that leaves the warp (finishes, or waits at a barrier) meanwhile is reported;
//   - between synchronisation points the runnable threads run in a random order (seeded), and a
//     thread may also be preempted at any shared-memory access;
//   - races: shadow state per shared-memory word per barrier epoch (last writer, readers); two
//     different threads touching one word in one epoch, one of them writing (atomics excepted), are
//     reported with both thread ids;
//   - blocks interleave: up to `resident` blocks (resident(n), default 4; like the blocks resident on
//     the SMs) run at once, their threads scheduled together in the random order; a block that
//     finishes frees its slot for the next block of a random permutation of the grid. So a block may
//     wait on another block (a decoupled look-back, a ticket) as on a GPU: it makes progress as long
//     as the block it waits for is resident or done, which ticket-ordered algorithms guarantee;
//     a wait loop must call pause() so that others run, and a thread that keeps pausing while every
//     live thread waits (at a barrier, a warp operation or in a wait loop) is reported as a deadlock
//     (a wait on a block that can never run); fences, atomics, acquires, releases and pauses are
//     preemption points too, so interleavings between blocks through global memory are exercised;
//   - shared memory is not zeroed for a block (as on a GPU): it starts as shared_fill() bytes.
// Errors are collected (first one kept, with the thread, block and what happened) and the run stops
// at the first. Global memory is accessed directly: the bodies' global accesses are plain C++.
#pragma once

#include <kvevict/config.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
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

// Fiber switches: on x86-64 with GCC or Clang a few instructions (the callee-saved registers and the
// stack pointer; glibc's swapcontext also saves the signal mask with a system call on every switch,
// which made it most of the executor's time); elsewhere, or with KVEVICT_SIMT_UCONTEXT defined,
// ucontext.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVEVICT_SIMT_UCONTEXT)
#  define KVEVICT_SIMT_ASM_SWITCH 1
#else
#  define KVEVICT_SIMT_ASM_SWITCH 0
#endif

namespace kvevict::detail {

#if KVEVICT_SIMT_ASM_SWITCH
/// Saves this context (callee-saved registers, resume address) on the current stack and its stack
/// pointer in *save, then resumes the context whose stack pointer is `load` (saved the same way, or
/// a fresh fiber's initial frame). The red zone below the stack pointer is skipped first.
inline void simt_switch(void** save, void* load) {
  asm volatile(
      "subq $128, %%rsp\n\t"
      "leaq 1f(%%rip), %%rax\n\t"
      "pushq %%rax\n\t"
      "pushq %%rbp\n\t"
      "pushq %%rbx\n\t"
      "pushq %%r12\n\t"
      "pushq %%r13\n\t"
      "pushq %%r14\n\t"
      "pushq %%r15\n\t"
      "movq %%rsp, (%[save])\n\t"
      "movq %[load], %%rsp\n\t"
      "popq %%r15\n\t"
      "popq %%r14\n\t"
      "popq %%r13\n\t"
      "popq %%r12\n\t"
      "popq %%rbx\n\t"
      "popq %%rbp\n\t"
      "ret\n\t"
      "1:\n\t"
      "addq $128, %%rsp\n\t"
      :
      : [save] "r"(save), [load] "r"(load)
      : "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3",
        "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
#  if defined(__AVX512F__)
        ,
        "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27",
        "xmm28", "xmm29", "xmm30", "xmm31"
#  endif
  );
}
#endif

class simt_executor;
struct simt_slot;

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
  void plain_read(const void* p, std::size_t bytes) { access(p, bytes, false, false, true); }
  void plain_write(void* p, std::size_t bytes) {
    access(p, bytes, true, false, true);
    progress();
  }
  template <class T>
  T atomic_add(T* p, T v);
  template <class T>
  T atomic_max(T* p, T v);
  void fence();
  template <class T>
  T ld_acquire(const T* p);
  template <class T>
  void st_release(T* p, T v);
  template <class T>
  T ld_cg(const T* p) {
    return ld_acquire(p);
  }
  void pause();

 private:
  friend class simt_executor;
  enum class state { ready, barrier, warp_op, done };
  simt_executor* ex_ = nullptr;
  simt_slot* slot_ = nullptr;
  index_t tid_ = 0;
  state st_ = state::ready;
  bool spinning_ = false;  ///< paused since its last store, atomic or barrier (a wait loop)
#if KVEVICT_SIMT_ASM_SWITCH
  void* sp_ = nullptr;  ///< saved stack pointer while switched out
#else
  ucontext_t uc_{};
#endif
  std::unique_ptr<char[]> stack_;  ///< not zeroed: pages are committed only as the fiber uses them
  std::size_t stack_size_ = 0;
  void* fake_stack_ = nullptr;  ///< ASan's fake stack of this fiber while it is switched out
  // warp exchange: the value deposited (up to 8 bytes), the source lane, the kind of operation
  std::uint64_t xval_ = 0, xres_ = 0;
  int xsrc_ = 0;
  char xkind_ = 0;

  template <class T>
  T exchange_value(T v, int src, char kind);
  std::uint32_t vote(bool p);
  void block_on(state s);
  void access(const void* p, std::size_t bytes, bool write, bool atomic, bool plain = false);
  void progress() noexcept { spinning_ = false; }
  index_t syncs_ = 0;  ///< barriers this thread reached in its block (drop_barrier)
};

/// Shadow state of one 4-byte shared-memory word in one barrier epoch.
struct simt_shadow {
  index_t epoch = -1;
  index_t writer = -1;  ///< last writing thread in this epoch
  index_t reader = -1;  ///< a reading thread in this epoch
  bool many_readers = false;
  bool atomic_only = true;
  bool plain_writer = false, plain_reader = false;  ///< the writer's / reader's access was announced (plain_*)
};

/// A resident block: its threads, shared memory and shadow state.
struct simt_slot {
  index_t block = -1;  ///< -1: free
  index_t epoch = 0;   ///< this block's barrier epoch (unique across the executor's runs)
  index_t at_barrier = 0, done = 0;  ///< threads waiting at the barrier, finished
  std::vector<simt_thread> threads;
  std::vector<unsigned char> shared;
  std::vector<simt_shadow> shadow;
};

class simt_executor {
 public:
  /// `shared_bytes` of shared memory per block, reachable through shared(). As on a GPU it is not
  /// zeroed for a block: every block starts with every byte set to shared_fill() (0xa5 by default).
  explicit simt_executor(std::uint64_t seed, std::size_t shared_bytes = 0, std::size_t stack_bytes = 1 << 17)
      : gen_(seed), stack_bytes_(stack_bytes), shared_bytes_(shared_bytes) {}
  simt_executor(const simt_executor&) = delete;
  simt_executor& operator=(const simt_executor&) = delete;

  /// Runs body(ctx) on every thread of `grid` blocks of `block` threads, up to resident() blocks at
  /// once. Returns false (and keeps error()) on a race, barrier divergence, bad warp operation,
  /// deadlock or an exception.
  template <class Body>
  bool run(index_t grid, index_t block, Body&& body) {
    if (grid <= 0 || block <= 0) return error_.empty();
    body_ = [&body](simt_thread& t) { body(t); };
    grid_ = grid;
    block_dim_ = block;
    std::vector<index_t> order(static_cast<std::size_t>(grid));
    for (index_t b = 0; b < grid; ++b) order[static_cast<std::size_t>(b)] = b;
    std::shuffle(order.begin(), order.end(), gen_);
    slots_.resize(static_cast<std::size_t>(std::min<index_t>(grid, resident_)));
    std::size_t next = 0;
    for (auto& s : slots_) start_block(s, order[next++]);
    schedule(order, next);
    body_ = nullptr;
    return error_.empty();
  }
  const std::string& error() const noexcept { return error_; }
  /// Shared memory per block from now on.
  void resize_shared(std::size_t bytes) { shared_bytes_ = bytes; }
  /// The calling thread's block's shared memory (valid inside run(), from a body).
  unsigned char* shared() noexcept { return current_ != nullptr ? current_->slot_->shared.data() : nullptr; }
  template <class T>
  T* shared_as(std::size_t byte_offset = 0) noexcept {
    return reinterpret_cast<T*>(shared() + byte_offset);
  }
  /// Preempt a thread at a shared-memory access, fence, atomic, acquire or release with
  /// probability 1 / n (0: never).
  void preempt_one_in(unsigned n) noexcept { preempt_ = n; }
  /// The byte every block's shared memory starts with.
  void shared_fill(unsigned char b) noexcept { fill_ = b; }
  /// Blocks that run at once (at least 1; 1 runs the blocks one after another).
  void resident(index_t n) noexcept { resident_ = n < 1 ? 1 : n; }
  index_t resident() const noexcept { return resident_; }
  /// Barriers every thread of a block passed, over the whole run (for tests).
  index_t barriers() const noexcept { return barriers_; }
  /// The largest number of blocks that had started and not finished at one time (for tests).
  index_t most_in_flight() const noexcept { return most_in_flight_; }
  /// Test hook: every thread's k-th barrier in each block (counted from 1; 0: none) returns at once
  /// without waiting or starting a new epoch, as if the barrier were missing from the code.
  void drop_barrier(index_t k) noexcept { drop_ = k; }

 private:
  friend class simt_thread;
  struct aborted {};

  std::mt19937_64 gen_;
  std::size_t stack_bytes_;
  std::size_t shared_bytes_;
  std::vector<simt_slot> slots_;
  std::vector<simt_thread*> ready_;  ///< runnable threads of every resident block
  std::function<void(simt_thread&)> body_;
  index_t grid_ = 0, block_dim_ = 0, epochs_ = 0, barriers_ = 0, resident_ = 4, most_in_flight_ = 0;
  index_t calm_ = 0;  ///< pauses in a row while every live thread waits or spins
  index_t drop_ = 0;  ///< drop_barrier
  unsigned preempt_ = 8;
  unsigned char fill_ = 0xa5;
#if KVEVICT_SIMT_ASM_SWITCH
  void* sched_sp_ = nullptr;
  static inline thread_local simt_thread* entering_ = nullptr;  ///< the fiber being started
#else
  ucontext_t sched_{};
#endif
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
  /// Scheduler -> thread t until it blocks, yields or finishes.
  void enter(simt_thread& t) {
    current_ = &t;
    asan_start(&sched_fake_, t.stack_.get(), t.stack_size_);
#if KVEVICT_SIMT_ASM_SWITCH
    entering_ = &t;
    simt_switch(&sched_sp_, t.sp_);
#else
    swapcontext(&sched_, &t.uc_);
#endif
    asan_finish(sched_fake_, nullptr, nullptr);
    current_ = nullptr;
  }

  static void fiber_main(simt_thread* t) {
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
  }
#if KVEVICT_SIMT_ASM_SWITCH
  // A fresh fiber's first instruction (reached by simt_switch's ret); it never returns.
  static void fiber_entry() {
    simt_thread* t = entering_;
    fiber_main(t);
    simt_switch(&t->sp_, t->ex_->sched_sp_);  // back to the scheduler, for good
    std::abort();
  }
  // The initial frame of a fiber on its stack: six zero registers for simt_switch to pop, then
  // fiber_entry as the return address, then a null return address (the stack pointer at
  // fiber_entry is 8 mod 16, as after a call).
  static void* initial_frame(char* stack, std::size_t size) {
    auto top = reinterpret_cast<std::uintptr_t>(stack + size) & ~std::uintptr_t(15);
    auto* slot = reinterpret_cast<void**>(top);
    *--slot = nullptr;
    *--slot = reinterpret_cast<void*>(&simt_executor::fiber_entry);
    for (int i = 0; i < 6; ++i) *--slot = nullptr;
    return slot;
  }
#else
  static void trampoline(unsigned lo, unsigned hi) {
    const std::uintptr_t p = (static_cast<std::uintptr_t>(hi) << 32) | lo;
    fiber_main(reinterpret_cast<simt_thread*>(p));
    // returning resumes uc_link (the scheduler)
  }
#endif

  void fail(const simt_thread& t, const std::string& what) {
    if (!error_.empty()) return;
    error_ = "block " + std::to_string(t.slot_->block) + " thread " + std::to_string(t.tid_) + ": " + what;
  }

  void start_block(simt_slot& s, index_t b) {
    s.block = b;
    s.epoch = ++epochs_;  // unique: the shadow state of earlier blocks is stale without clearing it
    s.at_barrier = s.done = 0;
    s.shared.resize(shared_bytes_);
    if (!s.shared.empty()) std::memset(s.shared.data(), fill_, s.shared.size());
    s.shadow.resize((shared_bytes_ + 3) / 4);
    s.threads.resize(static_cast<std::size_t>(block_dim_));
    for (index_t i = 0; i < block_dim_; ++i) {
      simt_thread& t = s.threads[static_cast<std::size_t>(i)];
      t.ex_ = this;
      t.slot_ = &s;
      t.tid_ = i;
      t.st_ = simt_thread::state::ready;
      t.spinning_ = false;
      t.syncs_ = 0;
      if (t.stack_size_ != stack_bytes_) {
        t.stack_.reset(new char[stack_bytes_]);
        t.stack_size_ = stack_bytes_;
#if !KVEVICT_SIMT_ASM_SWITCH
        getcontext(&t.uc_);  // once per fiber (a system call): makecontext re-arms a finished context
#endif
      }
#if KVEVICT_SIMT_ASM_SWITCH
      t.sp_ = initial_frame(t.stack_.get(), t.stack_size_);
#else
      t.uc_.uc_stack.ss_sp = t.stack_.get();
      t.uc_.uc_stack.ss_size = t.stack_size_;
      t.uc_.uc_link = &sched_;
      const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(&t);
      makecontext(&t.uc_, reinterpret_cast<void (*)()>(&simt_executor::trampoline), 2,
                  static_cast<unsigned>(p & 0xffffffffu), static_cast<unsigned>(p >> 32));
#endif
      ready_.push_back(&t);
    }
    index_t in_flight = 0;
    for (const auto& o : slots_) in_flight += o.block >= 0;
    most_in_flight_ = std::max(most_in_flight_, in_flight);
  }

  void schedule(const std::vector<index_t>& order, std::size_t next) {
    for (;;) {
      if (!error_.empty()) {
        unwind();
        return;
      }
      if (ready_.empty()) {
        bool live = false;
        for (const auto& s : slots_) live = live || s.block >= 0;
        if (!live) return;
        for (auto& s : slots_)
          for (auto& t : s.threads)
            if (s.block >= 0 && t.st_ != simt_thread::state::done) {
              fail(t, "deadlock: no thread of the resident blocks can run");
              break;
            }
        continue;
      }
      const std::size_t i = std::uniform_int_distribution<std::size_t>(0, ready_.size() - 1)(gen_);
      simt_thread& t = *ready_[i];
      ready_[i] = ready_.back();
      ready_.pop_back();
      enter(t);
      if (!error_.empty()) continue;
      if (t.st_ == simt_thread::state::ready) {  // preempted or paused
        ready_.push_back(&t);
        continue;
      }
      simt_slot& s = *t.slot_;
      if (!settle(s, t)) continue;
      if (s.done == block_dim_) {
        s.block = -1;
        if (next < order.size()) start_block(s, order[next++]);
      }
    }
  }

  // After an error: resume every unfinished fiber once; it throws `aborted` from its suspension point
  // (or skips the body if it never started) and unwinds its stack.
  void unwind() {
    ready_.clear();
    for (auto& s : slots_) {
      for (auto& t : s.threads)
        if (s.block >= 0 && t.st_ != simt_thread::state::done) enter(t);
      s.block = -1;
    }
  }

  // Thread t of block s blocked or finished: complete its warp's operation or its block's barrier,
  // or report why they cannot complete. Returns false after a failure.
  bool settle(simt_slot& s, const simt_thread& t) {
    auto& th = s.threads;
    const auto at = [&](index_t i) -> simt_thread& { return th[static_cast<std::size_t>(i)]; };
    if (t.st_ == simt_thread::state::barrier) ++s.at_barrier;
    if (t.st_ == simt_thread::state::done) ++s.done;
    const index_t w = t.tid_ / 32, lo = w * 32, hi = lo + 32 < block_dim_ ? lo + 32 : block_dim_;
    int waiting = 0, running = 0;
    char kind = 0;
    for (index_t i = lo; i < hi; ++i) {
      const simt_thread& u = at(i);
      if (u.st_ == simt_thread::state::warp_op) {
        if (waiting > 0 && u.xkind_ != kind) {
          fail(u, std::string("warp ") + std::to_string(w) + ": lanes at different warp operations");
          return false;
        }
        kind = u.xkind_;
        ++waiting;
      }
      running += u.st_ == simt_thread::state::ready;
    }
    if (waiting > 0) {
      if (hi - lo != 32) {
        fail(at(lo), "a full-warp operation in a partial warp");
        return false;
      }
      if (waiting == 32) {
        std::uint32_t ballot = 0;
        for (index_t i = lo; i < hi; ++i)
          if (at(i).xval_ != 0) ballot |= 1u << (i - lo);
        for (index_t i = lo; i < hi; ++i) at(i).xres_ = kind == 'v' ? ballot : at(lo + at(i).xsrc_).xval_;
        for (index_t i = lo; i < hi; ++i) {
          at(i).st_ = simt_thread::state::ready;
          ready_.push_back(&at(i));
        }
      } else if (running == 0) {  // the other lanes can no longer get there
        for (index_t i = lo; i < hi; ++i)
          if (at(i).st_ != simt_thread::state::warp_op) {
            fail(at(i), std::string("did not reach the warp operation its warp waits at (") +
                            (at(i).st_ == simt_thread::state::done ? "finished" : "at a barrier") + ")");
            return false;
          }
      }
    }
    if (s.at_barrier == 0 || s.at_barrier + s.done != block_dim_) return true;  // no barrier, or not yet
    if (s.done > 0) {
      for (const auto& u : th)
        if (u.st_ == simt_thread::state::done) {
          fail(u, "finished without reaching the barrier " + std::to_string(s.at_barrier) +
                      " other threads wait at (barrier divergence)");
          return false;
        }
    }
    s.epoch = ++epochs_;  // every thread waits at the barrier: release it; a new shared-memory epoch
    s.at_barrier = 0;
    ++barriers_;
    for (auto& u : th) {
      u.st_ = simt_thread::state::ready;
      ready_.push_back(&u);
    }
    return true;
  }

  void maybe_preempt(simt_thread& t) {
    if (preempt_ != 0 && std::uniform_int_distribution<unsigned>(0, preempt_ - 1)(gen_) == 0)
      t.block_on(simt_thread::state::ready);
  }

  // t paused in a wait loop: after a bound of pauses in a row during which every live thread of the
  // resident blocks waits (at a barrier, a warp operation, or in a wait loop), nothing can change:
  // report it.
  void on_pause(simt_thread& t) {
    t.spinning_ = true;
    index_t live = 0;
    for (const auto& s : slots_) {
      if (s.block < 0) continue;
      for (const auto& u : s.threads) {
        if (u.st_ == simt_thread::state::done) continue;
        ++live;
        if (&u != &t && u.st_ == simt_thread::state::ready && !u.spinning_) {
          calm_ = 0;
          return;
        }
      }
    }
    if (++calm_ > 4096 + 64 * live)
      fail(t, "waits (pause) for something no resident thread will do: a wait on a block that is not resident, "
              "or a flag never set (deadlock)");
  }

  void check_access(simt_thread& t, const void* p, std::size_t bytes, bool write, bool atomic, bool plain) {
    simt_slot& sl = *t.slot_;
    const auto* b = static_cast<const unsigned char*>(p);
    if (sl.shared.empty() || b < sl.shared.data() || b >= sl.shared.data() + sl.shared.size()) return;  // global
    const std::size_t off = static_cast<std::size_t>(b - sl.shared.data());
    if (off + bytes > sl.shared.size()) {
      fail(t, "shared-memory access out of bounds at byte " + std::to_string(off));
      return;
    }
    for (std::size_t w = off / 4; w <= (off + bytes - 1) / 4; ++w) {
      simt_shadow& s = sl.shadow[w];
      if (s.epoch != sl.epoch) s = simt_shadow{sl.epoch, -1, -1, false, true, false, false};
      const index_t me = t.tid_;
      const bool other_writer = s.writer >= 0 && s.writer != me;
      const bool other_reader = s.many_readers || (s.reader >= 0 && s.reader != me);
      const bool both_atomic = atomic && s.atomic_only;
      if (!both_atomic && (other_writer || (write && other_reader))) {
        const index_t other = other_writer ? s.writer : s.reader;
        const bool other_plain = other_writer ? s.plain_writer : s.plain_reader;
        fail(t, std::string("shared-memory race on word ") + std::to_string(w) + ": " + (plain ? "plain " : "") +
                    (write ? "write" : "read") + " after a " + (other_plain ? "plain " : "") +
                    (other_writer ? "write" : "read") + " by thread " + std::to_string(other) +
                    " with no barrier between");
        return;
      }
      s.atomic_only = s.atomic_only && atomic;
      if (write) {
        s.writer = me;
        s.plain_writer = plain;
      } else if (s.reader < 0 || s.reader == me) {
        s.reader = me;
        s.plain_reader = plain;
      } else {
        s.many_readers = true;
      }
    }
  }
};

inline index_t simt_thread::block() const noexcept { return slot_->block; }
inline index_t simt_thread::block_dim() const noexcept { return ex_->block_dim_; }
inline index_t simt_thread::grid_dim() const noexcept { return ex_->grid_; }

inline void simt_thread::block_on(state s) {
  st_ = s;
  simt_executor::asan_start(&fake_stack_, ex_->sched_bottom_, ex_->sched_size_);
#if KVEVICT_SIMT_ASM_SWITCH
  simt_switch(&sp_, ex_->sched_sp_);
#else
  swapcontext(&uc_, &ex_->sched_);
#endif
  simt_executor::asan_finish(fake_stack_, &ex_->sched_bottom_, &ex_->sched_size_);
  if (!ex_->error_.empty()) throw simt_executor::aborted{};  // the run failed: unwind this fiber
}
inline void simt_thread::sync() {
  progress();
  if (++syncs_ == ex_->drop_) return;  // a deliberately missing barrier (drop_barrier)
  block_on(state::barrier);
}

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

inline void simt_thread::access(const void* p, std::size_t bytes, bool write, bool atomic, bool plain) {
  if (plain) {  // an announced plain access of global memory: nothing to check, no preemption point
    const auto* b = static_cast<const unsigned char*>(p);
    const auto& sh = slot_->shared;
    if (bytes == 0 || sh.empty() || b < sh.data() || b >= sh.data() + sh.size()) return;
  }
  ex_->check_access(*this, p, bytes, write, atomic, plain);
  if (!ex_->error_.empty()) throw simt_executor::aborted{};
  ex_->maybe_preempt(*this);
}
template <class T>
T simt_thread::ld(const T* p) {
  access(p, sizeof(T), false, false);
  return *p;
}
template <class T>
void simt_thread::st(T* p, T v) {
  access(p, sizeof(T), true, false);
  progress();
  *p = v;
}
template <class T>
T simt_thread::atomic_add(T* p, T v) {
  access(p, sizeof(T), true, true);
  progress();
  const T old = *p;
  *p = static_cast<T>(old + v);
  return old;
}
template <class T>
T simt_thread::atomic_max(T* p, T v) {
  access(p, sizeof(T), true, true);
  progress();
  const T old = *p;
  if (old < v) *p = v;
  return old;
}
inline void simt_thread::fence() { ex_->maybe_preempt(*this); }
// One OS thread runs every fiber, so plain loads and stores are coherent; volatile keeps a wait
// loop re-reading memory that another fiber writes.
template <class T>
T simt_thread::ld_acquire(const T* p) {
  access(p, sizeof(T), false, true);
  return *static_cast<const volatile T*>(p);
}
template <class T>
void simt_thread::st_release(T* p, T v) {
  access(p, sizeof(T), true, true);
  progress();
  *static_cast<volatile T*>(p) = v;
}
inline void simt_thread::pause() {
  ex_->on_pause(*this);
  block_on(state::ready);
}

}  // namespace kvevict::detail
