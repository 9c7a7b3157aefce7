// headgates/train.hpp: PruLong and DuoAttention head-gate training on the shipped model, through
// the gated model of gated.hpp (exact gradients through the whole frozen model).
//
//   PruLong (Cache Me If You Can, §4 and appendix B): gate z_g = hard_concrete(log_alpha_g, u),
//     loss = mean next-token cross-entropy of the gated model + lambda1 (s - t) + lambda2 (s - t)^2
//     (s: expected sparsity, t warmed up from 0), descent on log_alpha, ascent on lambda1, lambda2;
//     at the end the k = heads (1 - t) largest log_alpha are retrieval heads.
//   DuoAttention (Xiao et al. 2025, duo_attn/train.py): gate alpha_g in [0, 1] (clamped before each
//     step, initialised to 1), loss = mean squared difference of the final hidden states of the
//     gated and the full model (on the labelled rows) + reg * mean alpha (L1: alpha >= 0);
//     head types by thresholding alpha (or its top k for a sparsity).
// Data: model-generated texts of the training seeds (lookaheadkv/data.hpp), disjoint from the
// report's test prompts, or given prompts with the model's greedy responses. Per-sample gradients
// are summed in sample order, so a seed gives the same gates whatever the thread count.
#pragma once

#include <headgates/gated.hpp>
#include <lookaheadkv/data.hpp>
#include <lookaheadkv/module.hpp>
#include <lookaheadkv/train.hpp>
#include <runner/workers.hpp>

#include <kvevict/train/prulong.hpp>

#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

namespace kvrun {

/// One training text: its tokens and the first row of the distillation loss (the response).
struct gate_sample {
  std::vector<int> tokens;
  index_t response_from = 0;
  std::vector<float> full_hidden;  ///< DuoAttention: the full model's final hidden states [n][dim]
};

/// Training texts from pairs: prompt then response, the response the distillation's labelled rows.
inline void gate_samples_of(const std::vector<text_pair>& pairs, std::vector<gate_sample>& out) {
  out.clear();
  for (const text_pair& p : pairs) {
    gate_sample s;
    s.tokens = p.prompt;
    s.tokens.insert(s.tokens.end(), p.response.begin(), p.response.end());
    s.response_from = static_cast<index_t>(p.prompt.size());
    out.push_back(std::move(s));
  }
}

/// The training texts: pairs of seeds [train_seed_base, + count), prompt then greedy response.
inline status make_gate_samples(const model& m, index_t count, int threads, std::vector<gate_sample>& out) {
  std::vector<text_pair> pairs;
  KVEVICT_TRY(make_pairs(m, pair_options{}, train_seed_base, train_seed_base + static_cast<std::uint64_t>(count), pairs,
                         threads));
  gate_samples_of(pairs, out);
  return {};
}

/// The training texts from given prompts (`kvevict-headgates --prompts`: the testbed's retrieval
/// questions, DuoAttention's passkey setting): each prompt then its greedy `response` tokens.
inline status gate_samples_from_prompts(const model& m, const std::vector<std::vector<int>>& prompts, index_t response,
                                        int threads, std::vector<gate_sample>& out) {
  std::vector<text_pair> pairs;
  KVEVICT_TRY(pairs_from_prompts(m, prompts, response, pairs, threads));
  gate_samples_of(pairs, out);
  return {};
}

// ---------------------------------------------------------------------------------------------
// One sample's objectives (the trainers' and the finite-difference tests' building blocks)

/// PruLong's language-model term for one sample with uniforms u [L Hkv]: z = hard_concrete(log_alpha,
/// u), loss = the gated model's mean next-token cross-entropy; dlog_alpha += dloss/dz * dz/dlog_alpha.
/// z, dz, dz_loss: scratch of L Hkv values.
template <class T>
status prulong_sample_loss(gated_backprop<T>& bp, const gated_lm<T>& lm, const std::vector<int>& tokens, const T* log_alpha,
                           const T* u, double* loss, T* dlog_alpha, std::vector<T>& z, std::vector<T>& dz,
                           std::vector<T>& dz_loss) {
  const index_t L = lm.cfg().n_layers, H = lm.cfg().n_kv_heads;
  const auto LH = static_cast<std::size_t>(L * H);
  z.assign(LH, T(0));
  dz.assign(LH, T(0));
  dz_loss.assign(LH, T(0));
  KVEVICT_TRY(kvevict::prulong_sample_gates(lkv::mat<const T>(log_alpha, L, H, H), lkv::mat<const T>(u, L, H, H),
                                            lkv::mat<T>(z.data(), L, H, H), lkv::mat<T>(dz.data(), L, H, H)));
  KVEVICT_TRY(bp.forward(lm, tokens.data(), static_cast<index_t>(tokens.size()), z.data()));
  KVEVICT_TRY(bp.next_token_loss(lm, tokens.data(), loss, dlog_alpha != nullptr));
  if (dlog_alpha == nullptr) return {};
  KVEVICT_TRY(bp.backward(lm, dz_loss.data()));
  for (std::size_t g = 0; g < LH; ++g) dlog_alpha[g] += dz_loss[g] * dz[g];
  return {};
}

/// PruLong's code's constraint (`--constrain sampled`): s = 1 - mean z over the gates sampled for a
/// batch, z[b] and dz[b] = dz/dlog_alpha the LH gates of sample b (prulong_sample_loss's scratch);
/// returns the penalty lambda1 (s - t) + lambda2 (s - t)^2 with its partial derivatives and writes
/// grad [LH] = dpenalty/dlog_alpha = dpenalty/ds * ds/dlog_alpha, ds/dlog_alpha_g = -sum_b dz[b][g] / (B LH).
template <class T>
kvevict::prulong_penalty prulong_sampled_penalty(const std::vector<const std::vector<T>*>& z,
                                                 const std::vector<const std::vector<T>*>& dz, std::size_t LH, double t,
                                                 double lambda1, double lambda2, double* grad) {
  const double n = static_cast<double>(z.size() * LH);
  double zsum = 0;
  std::fill(grad, grad + LH, 0.0);
  for (std::size_t b = 0; b < z.size(); ++b)
    for (std::size_t i = 0; i < LH; ++i) {
      zsum += static_cast<double>((*z[b])[i]);
      grad[i] -= static_cast<double>((*dz[b])[i]) / n;
    }
  const kvevict::prulong_penalty pen = kvevict::prulong_penalty_at(1.0 - zsum / n, t, lambda1, lambda2);
  for (std::size_t i = 0; i < LH; ++i) grad[i] *= pen.grad_sparsity;
  return pen;
}

/// DuoAttention's distillation term for one sample: the gated model with gates alpha against
/// target [n][dim] (the full model's final hidden states) on rows [from, n); dalpha += dloss/dalpha.
template <class T>
status duo_sample_loss(gated_backprop<T>& bp, const gated_lm<T>& lm, const std::vector<int>& tokens, const T* target,
                       index_t from, const T* alpha, double* loss, T* dalpha) {
  KVEVICT_TRY(bp.forward(lm, tokens.data(), static_cast<index_t>(tokens.size()), alpha));
  KVEVICT_TRY(bp.distill_loss(target, from, loss, dalpha != nullptr));
  if (dalpha != nullptr) KVEVICT_TRY(bp.backward(lm, dalpha));
  return {};
}

// ---------------------------------------------------------------------------------------------
// The shared loop

/// Adam over a few parameters; `ascent` flips the step (the Lagrange multipliers').
struct adam_state {
  std::vector<double> m, v;
  index_t t = 0;
  void step(double* p, const double* g, std::size_t n, double lr, double b1, double b2, double eps, bool ascent = false) {
    if (m.size() != n) m.assign(n, 0.0), v.assign(n, 0.0);
    ++t;
    const double c1 = 1.0 - std::pow(b1, static_cast<double>(t)), c2 = 1.0 - std::pow(b2, static_cast<double>(t));
    for (std::size_t i = 0; i < n; ++i) {
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      const double d = lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
      p[i] += ascent ? d : -d;
    }
  }
};

/// Settings shared by both trainers.
struct gate_train_options {
  index_t steps = 100;
  index_t batch = 4;
  std::uint64_t seed = 1;
  int threads = 0;
  index_t log_every = 5;
  streaming_window window;
};

/// Progress of a run, reported every log_every steps and at the end.
struct gate_progress {
  index_t step = 0, steps = 0;
  double loss = 0;      ///< mean data loss of the steps since the last report
  double sparsity = 0;  ///< PruLong: expected sparsity s; Duo: fraction of alpha < 0.5
  double achieved = 0;  ///< PruLong: fraction of closed heads, P(z > 0) < 1/2 (prulong_closed_sparsity); Duo: as sparsity
  double below_half = 0;  ///< PruLong: fraction of heads whose deterministic gate is < 0.5 (log_alpha < 0)
  double constrained = 0;  ///< PruLong: the sparsity the Lagrangian saw this step (sampled or expected L0)
  double target = 0;    ///< PruLong: the warmed-up target t; Duo: mean alpha
  double lambda1 = 0, lambda2 = 0;
  double seconds = 0;
};

/// A progress callback (may be empty).
using gate_logger = std::function<void(const gate_progress&)>;

namespace detail {

/// The trainers' progress: the running mean of the data loss since the last report, a report every
/// log_every steps and at the last step (fill sets the trainer's own fields).
struct progress_meter {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double loss_sum = 0;
  index_t loss_n = 0;

  template <class Fill>
  void add(const gate_train_options& o, index_t step, double loss, const gate_logger& log, Fill&& fill) {
    loss_sum += loss;
    ++loss_n;
    if (!log || ((step + 1) % o.log_every != 0 && step + 1 != o.steps)) return;
    gate_progress pr;
    pr.step = step + 1;
    pr.steps = o.steps;
    pr.loss = loss_sum / static_cast<double>(loss_n);
    fill(pr);
    pr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log(pr);
    loss_sum = 0;
    loss_n = 0;
  }
};

/// Runs `steps` steps: each takes the next `batch` samples of a seeded permutation, computes
/// per_sample(worker, sample, step, slot, grad, loss) for each into its own gradient buffer (n
/// values) on the workers, sums them in slot order and calls update(step, mean grad, mean loss).
template <class PerSample, class Update>
status gate_loop(const gated_lm<float>& lm, const std::vector<gate_sample>& samples, const gate_train_options& o,
                 std::size_t n, PerSample&& per_sample, Update&& update) {
  if (samples.empty()) return status::error(errc::invalid_argument, "gate training: no training texts");
  if (o.steps < 1 || o.batch < 1 || o.log_every < 1)
    return status::error(errc::invalid_argument, "gate training: steps (%lld), batch (%lld) and log_every (%lld) must be >= 1",
                         static_cast<long long>(o.steps), static_cast<long long>(o.batch),
                         static_cast<long long>(o.log_every));
  index_t longest = 1;
  for (const gate_sample& s : samples) longest = std::max<index_t>(longest, static_cast<index_t>(s.tokens.size()));
  std::vector<gated_backprop<float>> workers(static_cast<std::size_t>(thread_count(o.threads)));
  for (auto& w : workers) KVEVICT_TRY(w.init(lm, longest, o.window));
  const auto B = static_cast<std::size_t>(o.batch);
  std::vector<float> grads(B * n);
  std::vector<double> losses(B), g(n);
  std::vector<std::size_t> order(samples.size()), batch(B);
  splitmix64 rng{derive_seed(o.seed, 0x6a7e)};
  std::size_t cursor = order.size();
  for (index_t step = 0; step < o.steps; ++step) {
    for (auto& b : batch) {
      if (cursor == order.size()) {  // a new Fisher-Yates permutation per epoch
        for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
        for (std::size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[static_cast<std::size_t>(rng.next() % (i + 1))]);
        cursor = 0;
      }
      b = order[cursor++];
    }
    KVEVICT_TRY(for_each_item(workers, static_cast<index_t>(B), [&](gated_backprop<float>& w, index_t i) {
      const auto slot = static_cast<std::size_t>(i);
      float* gb = grads.data() + slot * n;
      std::fill(gb, gb + n, 0.0f);
      return per_sample(w, samples[batch[slot]], step, slot, gb, &losses[slot]);
    }));
    double loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double acc = 0;
      for (std::size_t b = 0; b < B; ++b) acc += grads[b * n + i];
      g[i] = acc / static_cast<double>(B);
    }
    for (std::size_t b = 0; b < B; ++b) loss += losses[b] / static_cast<double>(B);
    KVEVICT_TRY(update(step, g.data(), loss));
  }
  return {};
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// PruLong

/// How the Lagrange multipliers ascend (the min-max's max step).
enum class lambda_update {
  ascent,  ///< plain gradient ascent: lambda1 += lr_lambda (s - t), lambda2 += lr_lambda2 (s - t)^2, constant rates
  adam,    ///< Adam ascent on the same gradients with the log_alpha schedule (PruLong's code; winds up in 100 steps)
};

/// Which sparsity the Lagrangian constrains.
enum class sparsity_measure {
  sampled,      ///< 1 - mean z of the step's sampled gates (PruLong's code), gradients through dz/dlog_alpha
  expected_l0,  ///< 1 - mean P(z > 0) in closed form (the paper's appendix B)
};

/// PruLong's settings (appendix B, Table 5, scaled to minutes on this model: see docs/prulong.md).
struct prulong_train_options {
  double target = 0.5;          ///< final target sparsity t (fraction of streaming heads)
  double target_warmup = 0.5;   ///< t rises linearly from 0 over this fraction of the steps (paper: 800 of 1000)
  double lr = 0.2;              ///< Adam on log_alpha (Table 5: 1 over 1000 steps; see docs/prulong.md)
  sparsity_measure constrain = sparsity_measure::expected_l0;
  lambda_update lambda_rule = lambda_update::ascent;
  double lr_lambda = 0.5;       ///< the multipliers' rate (ascent: lambda1's, per unit of violation; adam: both, Table 5's 1)
  double lr_lambda2 = 10;       ///< ascent: lambda2's rate (the quadratic term's, which damps the min-max: docs/prulong.md)
  double warmup = 0.1;          ///< linear warmup of the log_alpha rate, then linear decay
  double final_lr = 0.01;       ///< ... to this fraction of the peak
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double init_log_alpha = 4.5;  ///< log_alpha ~ N(4.5, 0.01): every gate open
};

/// One step of a PruLong run (after its update).
struct prulong_step {
  double loss = 0;      ///< the batch's mean next-token loss (before the update)
  double constrained = 0;  ///< the sparsity the Lagrangian saw (sampled or expected L0)
  double expected = 0;  ///< expected sparsity 1 - mean P(z > 0)
  double achieved = 0;  ///< fraction of closed heads: P(z > 0) < 1/2 (prulong_closed_sparsity)
  double below_half = 0;  ///< fraction of heads whose deterministic gate is < 0.5 (log_alpha < 0)
  double target = 0;    ///< the warmed-up target
  double lambda1 = 0, lambda2 = 0;
};

struct prulong_result {
  std::vector<double> log_alpha;  ///< [L][Hkv]
  double lambda1 = 0, lambda2 = 0, sparsity = 0;
  double achieved = 0;            ///< closed heads at the end (prulong_step::achieved)
  double below_half = 0;          ///< deterministic gate < 0.5 at the end (prulong_step::below_half)
  std::vector<float> mask;        ///< [L][Hkv]: the top-k discretisation at the target
  std::vector<prulong_step> history;  ///< every step
};

/// The learning-rate factor of step t: linear warmup, then linear decay to final_lr.
inline double prulong_lr_factor(const prulong_train_options& p, index_t t, index_t steps) {
  const double warm = std::max(1.0, std::ceil(p.warmup * static_cast<double>(steps)));
  const double x = static_cast<double>(t);
  if (x < warm) return (x + 1) / warm;
  const double span = std::max(1.0, static_cast<double>(steps) - warm);
  return 1.0 - (1.0 - p.final_lr) * (x - warm) / span;
}

/// The fraction of heads whose Louizos deterministic gate min(1, max(0, sigmoid(log_alpha) (r - l)
/// + l)) is below 0.5, i.e. log_alpha < 0.
inline double prulong_achieved_sparsity(const std::vector<double>& log_alpha) {
  const kvevict::hard_concrete_params<double> hp;
  index_t below = 0;
  for (const double a : log_alpha) below += kvevict::hard_concrete_deterministic(a, hp) < 0.5 ? 1 : 0;
  return log_alpha.empty() ? 0.0 : static_cast<double>(below) / static_cast<double>(log_alpha.size());
}

/// The thresholded counterpart of the expected sparsity: the fraction of closed heads, whose gate
/// is more likely exactly 0 than not, P(z > 0) < 1/2 -- equivalently the median gate (u = 1/2) is
/// 0, i.e. log_alpha < beta log(-l / r) (-1.599 at PruLong's parameters).
inline double prulong_closed_sparsity(const std::vector<double>& log_alpha) {
  const kvevict::hard_concrete_params<double> hp;
  index_t closed = 0;
  for (const double a : log_alpha) closed += kvevict::hard_concrete_expected_l0(a, hp) < 0.5 ? 1 : 0;
  return log_alpha.empty() ? 0.0 : static_cast<double>(closed) / static_cast<double>(log_alpha.size());
}

/// Trains PruLong's gates. Uniforms: one per gate per sample, derived from (seed, step, slot),
/// truncated to (1e-6, 1 - 1e-6) as in the paper. Errors: invalid options, the model's.
inline status train_prulong(const gated_lm<float>& lm, const std::vector<gate_sample>& samples, const gate_train_options& o,
                            const prulong_train_options& p, prulong_result& out, const gate_logger& log = {}) {
  if (!(p.target >= 0 && p.target <= 1) || !(p.target_warmup > 0 && p.target_warmup <= 1) || !(p.lr > 0) ||
      !(p.lr_lambda >= 0) || !(p.lr_lambda2 >= 0) || !(p.warmup >= 0 && p.warmup <= 1) || !(p.final_lr >= 0 && p.final_lr <= 1) ||
      (p.lambda_rule != lambda_update::ascent && p.lambda_rule != lambda_update::adam) ||
      (p.constrain != sparsity_measure::sampled && p.constrain != sparsity_measure::expected_l0))
    return status::error(errc::invalid_argument, "prulong: invalid options (target %g, target warmup %g, lr %g / %g)",
                         p.target, p.target_warmup, p.lr, p.lr_lambda);
  const index_t L = lm.cfg().n_layers, H = lm.cfg().n_kv_heads;
  const auto LH = static_cast<std::size_t>(L * H);
  std::vector<double> la(LH);
  detail::splitmix64 init{detail::derive_seed(o.seed, 0x1a)};
  for (double& v : la) v = p.init_log_alpha + 0.01 * init.normal();
  std::vector<float> laf(LH);
  double lambda[2] = {0, 0};
  adam_state opt_la, opt_lambda;
  struct scratch { std::vector<float> u, z, dz, dzl; };
  std::vector<scratch> scr(static_cast<std::size_t>(o.batch));
  out.history.clear();
  detail::progress_meter meter;
  auto per_sample = [&](gated_backprop<float>& w, const gate_sample& s, index_t step, std::size_t slot, float* grad, double* loss) {
    scratch& sc = scr[slot];
    sc.u.resize(LH);
    detail::splitmix64 g{detail::derive_seed(detail::derive_seed(o.seed, static_cast<std::uint64_t>(step) + 1), slot + 1)};
    for (float& u : sc.u) u = static_cast<float>(1e-6 + (1 - 2e-6) * g.uniform());
    return prulong_sample_loss(w, lm, s.tokens, laf.data(), sc.u.data(), loss, grad, sc.z, sc.dz, sc.dzl);
  };
  auto update = [&](index_t step, const double* g, double loss) -> status {
    const double t = p.target * std::min(1.0, static_cast<double>(step + 1) / (p.target_warmup * static_cast<double>(o.steps)));
    std::vector<double> grad(g, g + LH), gl(LH);
    kvevict::prulong_penalty pen;
    if (p.constrain == sparsity_measure::expected_l0) {
      kvevict::prulong_lagrangian_result r;
      KVEVICT_TRY(kvevict::prulong_lagrangian(lkv::mat<const double>(la.data(), L, H, H), t, lambda[0], lambda[1], &r,
                                              lkv::mat<double>(gl.data(), L, H, H)));
      pen = r.penalty;
    } else {  // s = 1 - mean z over the batch's sampled gates, through dz/dlog_alpha
      std::vector<const std::vector<float>*> zs, dzs;
      for (const scratch& sc : scr) zs.push_back(&sc.z), dzs.push_back(&sc.dz);
      pen = prulong_sampled_penalty(zs, dzs, LH, t, lambda[0], lambda[1], gl.data());
    }
    for (std::size_t i = 0; i < LH; ++i) grad[i] += gl[i];
    const double f = prulong_lr_factor(p, step, o.steps);
    opt_la.step(la.data(), grad.data(), LH, p.lr * f, p.beta1, p.beta2, p.eps);
    const double glam[2] = {pen.grad_lambda1, pen.grad_lambda2};
    if (p.lambda_rule == lambda_update::adam) {
      opt_lambda.step(lambda, glam, 2, p.lr_lambda * f, p.beta1, p.beta2, p.eps, true);
    } else {  // the max step of the min-max: the multipliers rise with the violation itself
      lambda[0] += p.lr_lambda * glam[0];
      lambda[1] += p.lr_lambda2 * glam[1];
    }
    for (std::size_t i = 0; i < LH; ++i) laf[i] = static_cast<float>(la[i]);
    prulong_step h;
    h.loss = loss;
    h.constrained = pen.grad_lambda1 + t;
    KVEVICT_TRY(kvevict::prulong_expected_sparsity(lkv::mat<const double>(la.data(), L, H, H), &h.expected));
    h.achieved = prulong_closed_sparsity(la);
    h.below_half = prulong_achieved_sparsity(la);
    h.target = t;
    h.lambda1 = lambda[0];
    h.lambda2 = lambda[1];
    out.history.push_back(h);
    meter.add(o, step, loss, log, [&](gate_progress& pr) {
      pr.sparsity = h.expected;
      pr.achieved = h.achieved;
      pr.below_half = h.below_half;
      pr.constrained = h.constrained;
      pr.target = t;
      pr.lambda1 = lambda[0];
      pr.lambda2 = lambda[1];
    });
    return {};
  };
  for (std::size_t i = 0; i < LH; ++i) laf[i] = static_cast<float>(la[i]);
  KVEVICT_TRY(detail::gate_loop(lm, samples, o, LH, per_sample, update));
  out.log_alpha = la;
  out.lambda1 = lambda[0];
  out.lambda2 = lambda[1];
  KVEVICT_TRY(kvevict::prulong_expected_sparsity(lkv::mat<const double>(la.data(), L, H, H), &out.sparsity));
  out.achieved = prulong_closed_sparsity(la);
  out.below_half = prulong_achieved_sparsity(la);
  const auto k = kvevict::prulong_retrieval_heads(static_cast<index_t>(LH), p.target);
  if (!k) return k.error();
  out.mask.assign(LH, 0.0f);
  return kvevict::prulong_topk_mask(lkv::mat<const double>(la.data(), L, H, H), *k, lkv::mat<float>(out.mask.data(), L, H, H));
}

// ---------------------------------------------------------------------------------------------
// DuoAttention

/// DuoAttention's settings (duo_attn/train.py defaults where they apply: AdamW without weight
/// decay = Adam, lr 0.02, alpha initialised to 1 and clamped to [0, 1]; the schedule: linear
/// warmup over steps/5, constant, linear decay over the last steps/5, never below 0.1 of the peak).
struct duo_train_options {
  double lr = 0.02;
  double reg = 0.05;  ///< weight of the L1 penalty, mean alpha over the heads
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double init_alpha = 1.0;
};

struct duo_result {
  std::vector<double> alpha;  ///< [L][Hkv], in [0, 1]
};

inline double duo_lr_factor(index_t t, index_t steps) {
  const double fifth = std::max<double>(1.0, static_cast<double>(steps / 5));
  return std::min({1.0, std::max((static_cast<double>(t) + 1) / fifth, 0.1), std::max(static_cast<double>(steps - t) / fifth, 0.1)});
}

/// The full model's final hidden states of every sample (the distillation targets).
inline status duo_targets(const gated_lm<float>& lm, std::vector<gate_sample>& samples, int threads) {
  index_t longest = 1;
  for (const gate_sample& s : samples) longest = std::max<index_t>(longest, static_cast<index_t>(s.tokens.size()));
  std::vector<gated_backprop<float>> workers(static_cast<std::size_t>(thread_count(threads)));
  for (auto& w : workers) KVEVICT_TRY(w.init(lm, longest, {}));
  const std::vector<float> ones(static_cast<std::size_t>(lm.cfg().n_layers * lm.cfg().n_kv_heads), 1.0f);
  return for_each_item(workers, static_cast<index_t>(samples.size()), [&](gated_backprop<float>& w, index_t i) {
    gate_sample& s = samples[static_cast<std::size_t>(i)];
    KVEVICT_TRY(w.forward(lm, s.tokens.data(), static_cast<index_t>(s.tokens.size()), ones.data()));
    s.full_hidden.assign(w.hidden(), w.hidden() + w.tokens() * lm.cfg().dim);
    return status{};
  });
}

/// Trains DuoAttention's gates on samples whose full_hidden is set (duo_targets).
inline status train_duo(const gated_lm<float>& lm, const std::vector<gate_sample>& samples, const gate_train_options& o,
                        const duo_train_options& p, duo_result& out, const gate_logger& log = {}) {
  if (!(p.lr > 0) || !(p.reg >= 0) || !(p.init_alpha >= 0 && p.init_alpha <= 1))
    return status::error(errc::invalid_argument, "duo: invalid options (lr %g, reg %g, initial alpha %g)", p.lr, p.reg,
                         p.init_alpha);
  for (const gate_sample& s : samples)
    if (s.full_hidden.size() != s.tokens.size() * static_cast<std::size_t>(lm.cfg().dim))
      return status::error(errc::invalid_argument, "duo: a sample has no distillation target (call duo_targets)");
  const auto LH = static_cast<std::size_t>(lm.cfg().n_layers * lm.cfg().n_kv_heads);
  std::vector<double> alpha(LH, p.init_alpha);
  std::vector<float> af(alpha.begin(), alpha.end());
  adam_state opt;
  detail::progress_meter meter;
  auto per_sample = [&](gated_backprop<float>& w, const gate_sample& s, index_t, std::size_t, float* grad, double* loss) {
    return duo_sample_loss(w, lm, s.tokens, s.full_hidden.data(), s.response_from, af.data(), loss, grad);
  };
  auto update = [&](index_t step, const double* g, double loss) -> status {
    std::vector<double> grad(g, g + LH);
    for (std::size_t i = 0; i < LH; ++i) grad[i] += p.reg / static_cast<double>(LH);  // d(mean |alpha|), alpha >= 0
    opt.step(alpha.data(), grad.data(), LH, p.lr * duo_lr_factor(step, o.steps), p.beta1, p.beta2, p.eps);
    for (std::size_t i = 0; i < LH; ++i) af[i] = static_cast<float>(alpha[i] = std::min(1.0, std::max(0.0, alpha[i])));
    meter.add(o, step, loss, log, [&](gate_progress& pr) {
      double mean = 0, below = 0;
      for (double a : alpha) mean += a / static_cast<double>(LH), below += a < 0.5 ? 1.0 / static_cast<double>(LH) : 0.0;
      pr.sparsity = pr.achieved = below;
      pr.target = mean;
    });
    return {};
  };
  KVEVICT_TRY(detail::gate_loop(lm, samples, o, LH, per_sample, update));
  out.alpha = alpha;
  return {};
}

}  // namespace kvrun
