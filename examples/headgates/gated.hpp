// headgates/gated.hpp: the shipped model with a gate per KV head mixing full and streaming
// attention, and its exact backward to the gates (PruLong's and DuoAttention's training model).
//
//   gated_lm<float> lm;  lm.from(model);                          // frozen weights in T
//   gated_backprop<float> bp;  bp.init(lm, max_tokens, window);
//   bp.forward(lm, tokens, n, gates);                             // gates [L][Hkv] in [0, 1]
//   bp.next_token_loss(lm, tokens, n, &loss, true);               // PruLong's objective
//   bp.distill_loss(target_hidden, from, n, &loss, true);         // DuoAttention's objective
//   bp.backward(lm, dgates);                                      // dgates [L][Hkv] += dLoss/dgate
//
// Both papers write each head's attention as a superposition (PruLong §4 Eq. 1, DuoAttention Eq. 1):
//
//   att_ih = m_lg * full_ih + (1 - m_lg) * streaming_ih         (g = the KV head of query head h)
//   full_ih      = softmax over keys j <= i of q_ih . k_jg / sqrt(hs), applied to v
//   streaming_ih = the same softmax restricted to the sinks j < sink and the recent keys
//                  i - recent < j <= i (row i itself included), renormalised
//
// Every other weight is frozen, so the model is a function of the L x Hkv mixing weights only; the
// backward runs the whole sequence through every layer (unlike LookaheadKV's, where the prompt's
// keys are constants), reusing LookaheadKV's frozen weights (frozen_model) and its per-row RMSNorm,
// RoPE and SwiGLU pieces with their backward passes (lookaheadkv/train.hpp).
//   dm_lg = sum over rows i and the query heads h of group g of d att_ih . (full_ih - streaming_ih)
// Templated on T: float to train, double for the finite-difference tests (tests/test_headgates.cpp).
#pragma once

#include <lookaheadkv/train.hpp>

#include <kvevict/status.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvrun {

/// The streaming heads' keys: the first `sink` tokens and the last `recent` (the current row
/// included). Defaults: the runner's duo defaults (4 + 12), see docs/prulong.md for the scaling.
struct streaming_window {
  index_t sink = 4;
  index_t recent = 12;
};

namespace gates {

/// The keys row i reads: columns c < count map to key positions col(c) (ascending).
struct row_columns {
  index_t n1 = 0, start2 = 0, count = 0;
  index_t col(index_t c) const { return c < n1 ? c : start2 + (c - n1); }
};
inline row_columns full_columns(index_t i) { return {i + 1, i + 1, i + 1}; }
inline row_columns streaming_columns(index_t i, const streaming_window& w) {
  row_columns r;
  r.n1 = std::min(w.sink, i + 1);
  r.start2 = std::max(r.n1, i - w.recent + 1);
  r.count = r.n1 + (i + 1 - r.start2);
  return r;
}

/// Causal attention of n rows over one branch's columns (cols(i) -> row_columns), per query head:
/// probs [H][n][stride] (row i's first count entries), out [n][H hs]. q [n][H hs], k / v [n][Hkv hs].
template <class T, class Cols>
void branch_forward(index_t n, index_t H, index_t Hkv, index_t hs, const T* q, const T* k, const T* v, Cols cols,
                    index_t stride, T* probs, T* out) {
  const index_t group = H / Hkv, qd = H * hs, kd = Hkv * hs;
  const T scale = std::sqrt(static_cast<T>(hs));
  for (index_t h = 0; h < H; ++h) {
    const index_t g = h / group;
    for (index_t i = 0; i < n; ++i) {
      const row_columns rc = cols(i);
      const T* qi = q + i * qd + h * hs;
      T* a = probs + (h * n + i) * stride;
      T mx = -INFINITY;
      for (index_t c = 0; c < rc.count; ++c) {
        const T* kj = k + rc.col(c) * kd + g * hs;
        T s = T(0);
        for (index_t e = 0; e < hs; ++e) s += qi[e] * kj[e];
        a[c] = s / scale;
        mx = std::max(mx, a[c]);
      }
      T sum = T(0);
      for (index_t c = 0; c < rc.count; ++c) sum += (a[c] = std::exp(a[c] - mx));
      T* o = out + i * qd + h * hs;
      std::fill(o, o + hs, T(0));
      for (index_t c = 0; c < rc.count; ++c) {
        a[c] /= sum;
        const T* vj = v + rc.col(c) * kd + g * hs;
        for (index_t e = 0; e < hs; ++e) o[e] += a[c] * vj[e];
      }
    }
  }
}

/// Backward of branch_forward given dout [n][H hs] scaled per KV head by weight[g] (the branch's
/// mixing weight): dq, dk, dv are added to. row: scratch of n values.
template <class T, class Cols>
void branch_backward(index_t n, index_t H, index_t Hkv, index_t hs, const T* q, const T* k, const T* v, Cols cols,
                     index_t stride, const T* probs, const T* dout, const T* weight, T* dq, T* dk, T* dv, T* row) {
  const index_t group = H / Hkv, qd = H * hs, kd = Hkv * hs;
  const T scale = std::sqrt(static_cast<T>(hs));
  for (index_t h = 0; h < H; ++h) {
    const index_t g = h / group;
    const T wg = weight[g];
    if (wg == T(0)) continue;
    for (index_t i = 0; i < n; ++i) {
      const row_columns rc = cols(i);
      const T* a = probs + (h * n + i) * stride;
      const T* di = dout + i * qd + h * hs;
      const T* qi = q + i * qd + h * hs;
      T mu = T(0);
      for (index_t c = 0; c < rc.count; ++c) {
        const T* vj = v + rc.col(c) * kd + g * hs;
        T da = T(0);
        for (index_t e = 0; e < hs; ++e) da += di[e] * vj[e];
        row[c] = wg * da;
        mu += a[c] * row[c];
      }
      T* dqi = dq + i * qd + h * hs;
      for (index_t c = 0; c < rc.count; ++c) {
        const index_t j = rc.col(c);
        const T dz = a[c] * (row[c] - mu) / scale;
        const T* kj = k + j * kd + g * hs;
        T* dkj = dk + j * kd + g * hs;
        T* dvj = dv + j * kd + g * hs;
        for (index_t e = 0; e < hs; ++e) {
          dqi[e] += dz * kj[e];
          dkj[e] += dz * qi[e];
          dvj[e] += wg * a[c] * di[e];
        }
      }
    }
  }
}

}  // namespace gates

/// The frozen model in T for whole-sequence training: LookaheadKV's frozen_model (layers, RoPE)
/// plus the token embedding, the final RMSNorm and the classifier ([dim][vocab], the runner's).
template <class T>
struct gated_lm {
  frozen_model<T> fm;
  std::vector<T> embedding, final_norm, classifier;

  void from(const model& m) {
    fm.from(m);
    const config& c = m.cfg();
    const index_t D = c.dim, V = c.vocab_size;
    embedding.assign(m.embedding(0), m.embedding(0) + V * D);
    final_norm.assign(m.final_norm(), m.final_norm() + D);
    classifier.assign(m.classifier(), m.classifier() + D * V);
  }
  const config& cfg() const { return fm.cfg; }
};

/// Forward and backward of the gated model over one token sequence, with its own activations (one
/// per thread).
template <class T>
class gated_backprop : private model_dims {
 public:
  /// Sizes the activations for sequences of up to max_tokens. Errors: max_tokens outside
  /// [1, seq_len], a window with recent < 1 or sink < 0.
  status init(const gated_lm<T>& lm, index_t max_tokens, const streaming_window& w) {
    const config& c = lm.cfg();
    if (max_tokens < 1 || max_tokens > c.seq_len)
      return status::error(errc::invalid_argument, "gated model: %lld tokens is outside [1, %d]",
                           static_cast<long long>(max_tokens), c.seq_len);
    if (w.sink < 0 || w.recent < 1)
      return status::error(errc::invalid_argument, "gated model: streaming window needs sink >= 0 and recent >= 1 (got %lld, %lld)",
                           static_cast<long long>(w.sink), static_cast<long long>(w.recent));
    w_ = w;
    cap_ = max_tokens;
    set_dims(c);
    V_ = c.vocab_size;
    ws_ = std::min(cap_, w.sink + w.recent);
    const auto N = static_cast<std::size_t>(cap_), LN = static_cast<std::size_t>(L_) * N;
    x_.assign((static_cast<std::size_t>(L_) + 1) * N * D_, T(0));
    xmid_.assign(LN * D_, T(0));
    h1_ = h2_ = q_ = of_ = os_ = att_ = xmid_;
    k_.assign(LN * kvd_, T(0));
    v_ = k_;
    u1_.assign(LN * hid_, T(0));
    u3_ = sw_ = u1_;
    r1_.assign(LN, T(0));
    r2_ = r1_;
    pf_.assign(LN * H_ * N, T(0));
    ps_.assign(LN * H_ * ws_, T(0));
    rf_.assign(N, T(0));
    hf_.assign(N * D_, T(0));
    dhf_ = hf_;
    gates_.assign(static_cast<std::size_t>(L_ * Hkv_), T(1));
    tmp_.assign(N * std::max<index_t>(D_, hid_), T(0));
    dx_.assign(N * D_, T(0));
    dxm_ = dh_ = datt_ = dq_ = dx_;
    dk_.assign(N * kvd_, T(0));
    dv_ = dk_;
    dsw_.assign(N * hid_, T(0));
    du1_ = du3_ = dsw_;
    logits_.assign(static_cast<std::size_t>(V_), T(0));
    row_.assign(N, T(0));
    return {};
  }

  /// Forward over tokens[0, n) at positions 0..n-1 with mixing weights gates [L][Hkv] (1: full
  /// attention, 0: streaming). Errors: not initialised, n outside [1, max_tokens], a token outside
  /// the vocabulary, a gate outside [0, 1] or NaN.
  status forward(const gated_lm<T>& lm, const int* tokens, index_t n, const T* gates) {
    if (L_ == 0) return status::error(errc::invalid_argument, "gated model: not initialised (call init)");
    if (n < 1 || n > cap_)
      return status::error(errc::out_of_range, "gated model: %lld tokens is outside [1, %lld]", static_cast<long long>(n),
                           static_cast<long long>(cap_));
    for (index_t i = 0; i < n; ++i)
      if (tokens[i] < 0 || tokens[i] >= V_)
        return status::error(errc::out_of_range, "gated model: token %d at %lld is outside the vocabulary of %lld",
                             tokens[i], static_cast<long long>(i), static_cast<long long>(V_));
    for (index_t g = 0; g < L_ * Hkv_; ++g)
      if (!(gates[g] >= T(0) && gates[g] <= T(1)))
        return status::error(errc::invalid_argument, "gated model: gate %lld is %g, outside [0, 1]", static_cast<long long>(g),
                             static_cast<double>(gates[g]));
    n_ = n;
    std::copy(gates, gates + L_ * Hkv_, gates_.begin());
    const index_t D = D_;
    for (index_t i = 0; i < n; ++i)
      std::copy(lm.embedding.data() + index_t(tokens[i]) * D, lm.embedding.data() + index_t(tokens[i] + 1) * D, xl(0) + i * D);
    const frozen_model<T>& fm = lm.fm;
    for (int l = 0; l < L_; ++l) {
      const T* x = xl(l);
      T* h1 = at(h1_, l, D);
      for (index_t i = 0; i < n; ++i) at(r1_, l, 1)[i] = lkv::rmsnorm_forward(x + i * D, fm.attn_gain(l), D, h1 + i * D);
      KVEVICT_TRY(linear(fm, l, projection::q, h1, at(q_, l, D)));
      KVEVICT_TRY(linear(fm, l, projection::k, h1, at(k_, l, kvd_)));
      KVEVICT_TRY(linear(fm, l, projection::v, h1, at(v_, l, kvd_)));
      for (index_t i = 0; i < n; ++i) {
        lkv::rope_forward(at(q_, l, D) + i * D, D, hs_, fm.cos_row(i), fm.sin_row(i));
        lkv::rope_forward(at(k_, l, kvd_) + i * kvd_, kvd_, hs_, fm.cos_row(i), fm.sin_row(i));
      }
      gates::branch_forward(n, H_, Hkv_, hs_, at(q_, l, D), at(k_, l, kvd_), at(v_, l, kvd_), gates::full_columns, n,
                            pf(l), at(of_, l, D));
      gates::branch_forward(n, H_, Hkv_, hs_, at(q_, l, D), at(k_, l, kvd_), at(v_, l, kvd_), stream_cols(), ws_, ps(l),
                            at(os_, l, D));
      T* att = at(att_, l, D);
      const T* of = at(of_, l, D);
      const T* os = at(os_, l, D);
      const index_t group = H_ / Hkv_;
      for (index_t i = 0; i < n; ++i)
        for (index_t h = 0; h < H_; ++h) {
          const T m = gates_[static_cast<std::size_t>(l * Hkv_ + h / group)];
          for (index_t e = 0; e < hs_; ++e) {
            const index_t o = i * D + h * hs_ + e;
            att[o] = m * of[o] + (T(1) - m) * os[o];
          }
        }
      KVEVICT_TRY(linear(fm, l, projection::o, att, tmp_.data()));
      T* xm = at(xmid_, l, D);
      for (index_t e = 0; e < n * D; ++e) xm[e] = x[e] + tmp_[static_cast<std::size_t>(e)];
      T* h2 = at(h2_, l, D);
      for (index_t i = 0; i < n; ++i) at(r2_, l, 1)[i] = lkv::rmsnorm_forward(xm + i * D, fm.ffn_gain(l), D, h2 + i * D);
      KVEVICT_TRY(linear(fm, l, projection::w1, h2, at(u1_, l, hid_)));
      KVEVICT_TRY(linear(fm, l, projection::w3, h2, at(u3_, l, hid_)));
      for (index_t i = 0; i < n; ++i)
        lkv::swiglu_forward(at(u1_, l, hid_) + i * hid_, at(u3_, l, hid_) + i * hid_, hid_, at(sw_, l, hid_) + i * hid_);
      KVEVICT_TRY(linear(fm, l, projection::w2, at(sw_, l, hid_), tmp_.data()));
      T* xn = xl(l + 1);
      for (index_t e = 0; e < n * D; ++e) xn[e] = xm[e] + tmp_[static_cast<std::size_t>(e)];
    }
    for (index_t i = 0; i < n; ++i)
      rf_[static_cast<std::size_t>(i)] = lkv::rmsnorm_forward(xl(L_) + i * D, lm.final_norm.data(), D, hf_.data() + i * D);
    return {};
  }

  /// The final hidden states of the last forward (after the final RMSNorm), [n][dim].
  const T* hidden() const { return hf_.data(); }
  index_t tokens() const { return n_; }

  /// Mean next-token cross-entropy of the last forward over rows 0..n-2 (row i predicts
  /// tokens[i + 1]); with want_grad, keeps its gradient for backward(). Errors: fewer than 2 tokens.
  status next_token_loss(const gated_lm<T>& lm, const int* tokens, double* value, bool want_grad) {
    if (n_ < 2) return status::error(errc::invalid_argument, "next-token loss: needs at least 2 tokens, got %lld", static_cast<long long>(n_));
    const index_t D = D_, V = V_, rows = n_ - 1;
    std::fill(dhf_.begin(), dhf_.end(), T(0));
    double total = 0;
    for (index_t i = 0; i < rows; ++i) {
      const T* h = hf_.data() + i * D;
      for (index_t v = 0; v < V; ++v) logits_[static_cast<std::size_t>(v)] = T(0);
      for (index_t d = 0; d < D; ++d) {
        const T* w = lm.classifier.data() + d * V;
        for (index_t v = 0; v < V; ++v) logits_[static_cast<std::size_t>(v)] += h[d] * w[v];
      }
      T mx = logits_[0];
      for (index_t v = 1; v < V; ++v) mx = std::max(mx, logits_[static_cast<std::size_t>(v)]);
      T sum = T(0);
      for (index_t v = 0; v < V; ++v) sum += std::exp(logits_[static_cast<std::size_t>(v)] - mx);
      const int y = tokens[i + 1];
      total += static_cast<double>(std::log(sum) + mx - logits_[static_cast<std::size_t>(y)]);
      if (!want_grad) continue;
      T* dh = dhf_.data() + i * D;
      const T inv = T(1) / static_cast<T>(rows);
      for (index_t v = 0; v < V; ++v) {
        T p = std::exp(logits_[static_cast<std::size_t>(v)] - mx) / sum;
        if (v == y) p -= T(1);
        logits_[static_cast<std::size_t>(v)] = p * inv;  // dL/dlogit
      }
      for (index_t d = 0; d < D; ++d) {
        const T* w = lm.classifier.data() + d * V;
        T acc = T(0);
        for (index_t v = 0; v < V; ++v) acc += logits_[static_cast<std::size_t>(v)] * w[v];
        dh[d] = acc;
      }
    }
    *value = total / static_cast<double>(rows);
    return {};
  }

  /// DuoAttention's distillation loss: sum over rows i in [from, n) of mean_d (hidden_id -
  /// target_id)^2, divided by the row count (target [n][dim]: the full model's final hidden
  /// states). Errors: from outside [0, n).
  status distill_loss(const T* target, index_t from, double* value, bool want_grad) {
    if (from < 0 || from >= n_)
      return status::error(errc::invalid_argument, "distill loss: first row %lld is outside [0, %lld)",
                           static_cast<long long>(from), static_cast<long long>(n_));
    const index_t D = D_, rows = n_ - from;
    std::fill(dhf_.begin(), dhf_.end(), T(0));
    double total = 0;
    const T scale = T(1) / static_cast<T>(rows * D);
    for (index_t i = from; i < n_; ++i)
      for (index_t d = 0; d < D; ++d) {
        const T diff = hf_[static_cast<std::size_t>(i * D + d)] - target[i * D + d];
        total += static_cast<double>(diff * diff);
        if (want_grad) dhf_[static_cast<std::size_t>(i * D + d)] = T(2) * diff * scale;
      }
    *value = total / static_cast<double>(rows * D);
    return {};
  }

  /// Backward of the last forward and loss: dgates [L][Hkv] += dLoss/dgate.
  status backward(const gated_lm<T>& lm, T* dgates) {
    const index_t n = n_, D = D_, group = H_ / Hkv_;
    const frozen_model<T>& fm = lm.fm;
    for (index_t i = 0; i < n; ++i)
      lkv::rmsnorm_backward(xl(L_) + i * D, lm.final_norm.data(), rf_[static_cast<std::size_t>(i)], dhf_.data() + i * D, D,
                            dx_.data() + i * D, false);
    std::vector<T>& wf = wfull_;
    std::vector<T>& wsb = wstream_;
    wf.resize(static_cast<std::size_t>(Hkv_));
    wsb.resize(static_cast<std::size_t>(Hkv_));
    for (int l = L_ - 1; l >= 0; --l) {
      // FFN: x_out = x_mid + w2(swiglu(w1 h2, w3 h2)), h2 = RMSNorm(x_mid)
      lkv::linear_backward_input(fm.weight_t(l, projection::w2), dx_.data(), n, dsw_.data(), false);
      for (index_t i = 0; i < n; ++i)
        lkv::swiglu_backward(at(u1_, l, hid_) + i * hid_, at(u3_, l, hid_) + i * hid_, dsw_.data() + i * hid_, hid_,
                             du1_.data() + i * hid_, du3_.data() + i * hid_);
      lkv::linear_backward_input(fm.weight_t(l, projection::w1), du1_.data(), n, dh_.data(), false);
      lkv::linear_backward_input(fm.weight_t(l, projection::w3), du3_.data(), n, dh_.data(), true);
      std::copy(dx_.begin(), dx_.begin() + n * D, dxm_.begin());
      for (index_t i = 0; i < n; ++i)
        lkv::rmsnorm_backward(at(xmid_, l, D) + i * D, fm.ffn_gain(l), at(r2_, l, 1)[i], dh_.data() + i * D, D,
                              dxm_.data() + i * D, true);
      // attention: x_mid = x + wo(att), att = m full + (1 - m) streaming
      lkv::linear_backward_input(fm.weight_t(l, projection::o), dxm_.data(), n, datt_.data(), false);
      const T* of = at(of_, l, D);
      const T* os = at(os_, l, D);
      for (index_t i = 0; i < n; ++i)
        for (index_t h = 0; h < H_; ++h) {
          T acc = T(0);
          for (index_t e = 0; e < hs_; ++e) {
            const index_t o = i * D + h * hs_ + e;
            acc += datt_[static_cast<std::size_t>(o)] * (of[o] - os[o]);
          }
          dgates[l * Hkv_ + h / group] += acc;
        }
      for (index_t g = 0; g < Hkv_; ++g) {
        wf[static_cast<std::size_t>(g)] = gates_[static_cast<std::size_t>(l * Hkv_ + g)];
        wsb[static_cast<std::size_t>(g)] = T(1) - wf[static_cast<std::size_t>(g)];
      }
      std::fill(dq_.begin(), dq_.begin() + n * D, T(0));
      std::fill(dk_.begin(), dk_.begin() + n * kvd_, T(0));
      std::fill(dv_.begin(), dv_.begin() + n * kvd_, T(0));
      gates::branch_backward(n, H_, Hkv_, hs_, at(q_, l, D), at(k_, l, kvd_), at(v_, l, kvd_), gates::full_columns, n, pf(l),
                             datt_.data(), wf.data(), dq_.data(), dk_.data(), dv_.data(), row_.data());
      gates::branch_backward(n, H_, Hkv_, hs_, at(q_, l, D), at(k_, l, kvd_), at(v_, l, kvd_), stream_cols(), ws_, ps(l),
                             datt_.data(), wsb.data(), dq_.data(), dk_.data(), dv_.data(), row_.data());
      for (index_t i = 0; i < n; ++i) {
        lkv::rope_backward(dq_.data() + i * D, D, hs_, fm.cos_row(i), fm.sin_row(i));
        lkv::rope_backward(dk_.data() + i * kvd_, kvd_, hs_, fm.cos_row(i), fm.sin_row(i));
      }
      lkv::linear_backward_input(fm.weight_t(l, projection::q), dq_.data(), n, dh_.data(), false);
      lkv::linear_backward_input(fm.weight_t(l, projection::k), dk_.data(), n, dh_.data(), true);
      lkv::linear_backward_input(fm.weight_t(l, projection::v), dv_.data(), n, dh_.data(), true);
      std::copy(dxm_.begin(), dxm_.begin() + n * D, dx_.begin());
      for (index_t i = 0; i < n; ++i)
        lkv::rmsnorm_backward(xl(l) + i * D, fm.attn_gain(l), at(r1_, l, 1)[i], dh_.data() + i * D, D, dx_.data() + i * D,
                              true);
    }
    return {};
  }

 private:
  streaming_window w_;
  index_t cap_ = 0, n_ = 0, ws_ = 0, V_ = 0;
  std::vector<T> x_, xmid_, h1_, h2_, q_, k_, v_, of_, os_, att_, u1_, u3_, sw_, r1_, r2_, pf_, ps_, rf_, hf_, dhf_, gates_;
  std::vector<T> tmp_, dx_, dxm_, dh_, datt_, dq_, dk_, dv_, dsw_, du1_, du3_, logits_, row_, wfull_, wstream_;

  auto stream_cols() const {
    const streaming_window w = w_;
    return [w](index_t i) { return gates::streaming_columns(i, w); };
  }
  T* xl(int l) { return x_.data() + static_cast<index_t>(l) * cap_ * D_; }
  T* at(std::vector<T>& v, int l, index_t width) { return v.data() + static_cast<index_t>(l) * cap_ * width; }
  T* pf(int l) { return pf_.data() + static_cast<index_t>(l) * H_ * cap_ * cap_; }
  T* ps(int l) { return ps_.data() + static_cast<index_t>(l) * H_ * cap_ * ws_; }

  status linear(const frozen_model<T>& fm, int l, projection p, const T* x, T* y) {
    const auto w = fm.weight(l, p);
    const index_t in = w.extent(1), out = w.extent(0);
    return kvevict::linear_forward(kvevict::seq, lkv::mat<const T>(x, n_, in, in), w, lkv::mat<T>(y, n_, out, out));
  }
};

}  // namespace kvrun
