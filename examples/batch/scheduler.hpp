// batch/scheduler.hpp: continuous batching on the runner's batched forward (docs/runner.md,
// "Batches").
//
// batch_scheduler runs `sequences` bodies (one sequence each: prefill with any driver, decoding,
// decode-time eviction: the same code as a single run) on at most `slots` sequences at a time.
// Every body runs in its slot's thread and gets a gated runner (runner::init_gated): its forwards
// (forward, forward_extra, decode) wait for the batch's next step instead of running. The
// scheduler runs the bodies one at a time, in slot order, each up to its next forward (or its
// end), then runs every waiting forward of the step as one runner::forward_batch (the weights read
// once for all rows; each sequence's attention over its own cache, its hooks -- the drivers' --
// with its rows) and hands each body its logits. So in one step some sequences prefill a chunk
// (or a whole prompt, a patched chunk's window, LAQ's pseudo tokens, LookaheadKV's block) while
// others decode one token, and each body's tokens are those of its sequence run alone, bit for bit
// (forward_batch: every row's arithmetic is the single forward's). A sequence joins when a slot is
// free (at most one per step: arrivals are staggered) and leaves when its body returns. The
// threads are coroutines: exactly one of them (or the scheduler) runs at any time, so the bodies
// share the page pool and any other state without locks, in a deterministic order.
//
// batched = false runs the same steps with each waiting forward alone, one after another (the
// baseline of bench's comparison: the same schedule, the same pages, the same tokens).
#pragma once

#include <runner/runner.hpp>

#include <kvevict/status.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvrun {

/// What a batch_scheduler::run did.
struct schedule_stats {
  index_t steps = 0;        ///< batch steps
  index_t forwards = 0;     ///< runner forwards they took (batched: one per step unless its rows exceed the buffers)
  index_t mixed_steps = 0;  ///< steps in which a sequence still prefilling and a decoding one both ran a forward
  index_t rows = 0;         ///< rows forwarded, all steps
  index_t segments = 0;     ///< sequences' forwards, all steps
  double forward_seconds = 0.0;  ///< time in the steps' forwards (hooks included)
};

class batch_scheduler final : public forward_gate {
 public:
  /// body(sequence, slot, run): runs sequence `sequence` to its end on the gated runner `run` of slot
  /// `slot` (in [0, slots)); its status stops the batch when not ok.
  using body = std::function<status(index_t sequence, index_t slot, runner& run)>;

  batch_scheduler() = default;
  batch_scheduler(const batch_scheduler&) = delete;
  batch_scheduler& operator=(const batch_scheduler&) = delete;
  ~batch_scheduler() { stop(); }

  /// `slots` sequences at most at a time on model `m` (which must outlive the scheduler), the
  /// step's forward on `threads` threads; batched = false: the baseline (one forward at a time).
  /// Buffers for steps of up to min(slots, 4) x seq_len rows (a step with more runs as several
  /// forward_batch calls). Errors: slots outside [1, 1024]; the runner's.
  status init(const model& m, index_t slots, int threads = 0, bool batched = true) {
    if (slots < 1 || slots > 1024)
      return status::error(errc::invalid_argument, "batch: %lld slots (1 to 1024)", static_cast<long long>(slots));
    stop();
    const index_t L = m.cfg().seq_len;
    KVEVICT_TRY(engine_.init(m, {std::min<index_t>(slots, 4) * L, 0, threads, slots}));
    slots_.clear();
    for (index_t i = 0; i < slots; ++i) {
      slots_.push_back(std::make_unique<slot>());
      KVEVICT_TRY(slots_.back()->run.init_gated(m, *this, L));
    }
    segs_.assign(static_cast<std::size_t>(slots), {});
    waiting_.assign(static_cast<std::size_t>(slots), 0);
    batched_ = batched;
    return {};
  }

  index_t slots() const { return static_cast<index_t>(slots_.size()); }
  /// Marks slot `s`'s sequence as decoding (its prefill is over) for the mixed-step count; a body
  /// calls it. A new sequence starts as prefilling.
  void decoding(index_t s) { slots_[static_cast<std::size_t>(s)]->decoding = true; }
  const schedule_stats& stats() const { return stats_; }

  /// Runs bodies 0 .. sequences-1 (see the file comment); returns the first error of a body
  /// (the other bodies' forwards then fail with "batch stopped" and they end).
  status run(index_t sequences, const body& b) {
    if (slots_.empty()) return status::error(errc::invalid_argument, "batch: the scheduler is not initialised");
    body_ = &b;
    stats_ = {};
    first_error_ = {};
    stopping_ = quit_ = false;
    for (std::unique_ptr<slot>& s : slots_) {
      s->state = slot::idle;
      slot* p = s.get();
      const index_t index = static_cast<index_t>(&s - slots_.data());
      s->th = std::thread([this, p, index] { work(*p, index); });
    }
    index_t next = 0;
    for (;;) {
      if (next < sequences && first_error_.ok()) {  // one arrival per step, in the lowest free slot
        for (std::unique_ptr<slot>& s : slots_)
          if (s->state == slot::idle) {
            s->sequence = next++;
            s->decoding = false;
            resume(*s);
            break;
          }
      }
      if (!first_error_.ok()) break;
      index_t count = 0;
      for (std::size_t i = 0; i < slots_.size(); ++i)
        if (slots_[i]->state == slot::waiting) waiting_[static_cast<std::size_t>(count++)] = i;
      if (count == 0) {
        if (next >= sequences) break;
        continue;
      }
      step(count);
      for (index_t k = 0; k < count; ++k) resume(*slots_[waiting_[static_cast<std::size_t>(k)]]);
      if (!first_error_.ok()) break;
    }
    stop();
    body_ = nullptr;
    return first_error_;
  }

  // the gated runners' forwards (a body's thread): wait for the step
  status forward(runner& caller, kv_cache& cache, const block& b, logits_mode mode, const forward_hooks& hooks,
                 bool rolled_back) override {
    slot* s = nullptr;
    for (std::unique_ptr<slot>& p : slots_)
      if (&p->run == &caller) s = p.get();
    if (s == nullptr) return status::error(errc::invalid_argument, "batch: a forward from a runner of no slot");
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) return stopped();
    s->seg = {&cache, b, mode, &hooks, rolled_back, {}, 0};
    s->state = slot::waiting;
    main_cv_.notify_one();
    s->cv.wait(lock, [&] { return s->state == slot::running; });
    return s->seg.st;
  }

 private:
  struct slot {
    enum state_t { idle, running, waiting, done };
    runner run;  // gated
    std::thread th;
    std::condition_variable cv;
    state_t state = idle;
    index_t sequence = -1;
    bool decoding = false;
    forward_segment seg;  // the waiting forward
    status result;        // the body's
  };
  runner engine_;
  std::vector<std::unique_ptr<slot>> slots_;
  std::vector<forward_segment> segs_;
  std::vector<std::size_t> waiting_;  // the step's slots, in order
  const body* body_ = nullptr;
  bool batched_ = true, stopping_ = false, quit_ = false;
  status first_error_;
  schedule_stats stats_;
  std::mutex mu_;
  std::condition_variable main_cv_;

  static status stopped() { return status::error(errc::invalid_argument, "batch stopped: another sequence failed"); }

  // slot thread: run a body whenever resumed idle, until quit
  void work(slot& s, index_t index) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      s.cv.wait(lock, [&] { return s.state == slot::running || quit_; });
      if (quit_) return;
      lock.unlock();
      const status st = (*body_)(s.sequence, index, s.run);
      lock.lock();
      s.result = st;
      s.state = slot::done;
      main_cv_.notify_one();
    }
  }

  // hands the baton to slot s until it waits for a forward or ends; an ended body frees its slot
  void resume(slot& s) {
    std::unique_lock<std::mutex> lock(mu_);
    s.state = slot::running;
    s.cv.notify_one();
    main_cv_.wait(lock, [&] { return s.state != slot::running; });
    if (s.state == slot::done) {
      if (!s.result.ok() && first_error_.ok()) first_error_ = s.result;
      s.state = slot::idle;
    }
  }

  // the step: the waiting forwards as forward_batch calls of at most the engine's rows
  void step(index_t count) {
    const auto t0 = std::chrono::steady_clock::now();
    bool prefill = false, decode = false;
    for (index_t k = 0; k < count; ++k) {
      slot& s = *slots_[waiting_[static_cast<std::size_t>(k)]];
      segs_[static_cast<std::size_t>(k)] = s.seg;
      (s.decoding ? decode : prefill) = true;
      stats_.rows += s.seg.b.n;
    }
    for (index_t k0 = 0; k0 < count;) {
      index_t k1 = k0 + 1, rows = std::max<index_t>(segs_[static_cast<std::size_t>(k0)].b.n, 0);
      while (batched_ && k1 < count && rows + std::max<index_t>(segs_[static_cast<std::size_t>(k1)].b.n, 0) <= engine_.max_block())
        rows += std::max<index_t>(segs_[static_cast<std::size_t>(k1++)].b.n, 0);
      const status st = engine_.forward_batch(segs_.data() + k0, k1 - k0);
      ++stats_.forwards;
      for (index_t k = k0; k < k1; ++k) {
        forward_segment& g = segs_[static_cast<std::size_t>(k)];
        slot& s = *slots_[waiting_[static_cast<std::size_t>(k)]];
        if (!st.ok()) g.st = st;
        if (g.st.ok()) {
          const index_t rows_out = g.mode == logits_mode::none ? 0 : g.mode == logits_mode::last ? 1 : g.b.n;
          deliver(s.run, engine_.logits(g.logits_row), rows_out);
        }
        s.seg.st = g.st;
      }
      k0 = k1;
    }
    ++stats_.steps;
    stats_.segments += count;
    stats_.mixed_steps += prefill && decode;
    stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // ends the run: waiting bodies get "batch stopped" (they end), then the threads quit
  void stop() {
    bool any = false;
    for (std::unique_ptr<slot>& s : slots_) any = any || s->th.joinable();
    if (!any) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    for (std::unique_ptr<slot>& s : slots_)
      if (s->state == slot::waiting) {
        s->seg.st = stopped();
        resume(*s);
      }
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    for (std::unique_ptr<slot>& s : slots_) {
      s->cv.notify_one();
      if (s->th.joinable()) s->th.join();
    }
  }
};

}  // namespace kvrun
