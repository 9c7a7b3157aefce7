// lookaheadkv/train.hpp: LookaheadKV training on the runner's model (Algorithm 1), with exact
// gradients through the lookahead rows.
//
//   frozen_model<float> fm;  fm.from(model);                    // the model's weights, [out][in]
//   lookahead_sample s;  prepare_sample(run, cache, pair, s, ws); // prompt KV + ground truth, once
//   lookahead_backprop<float> bp;  bp.init(fm, module, max_prompt);
//   bp.loss_and_grad(fm, module, s, &loss, grad);               // one sample (grad += ...)
//   train_module(fm, train, validation, options, module, log);  // Adam, batches, OpenMP
//
// Why only the lookahead rows: the adapters act on the lookahead rows only, and the lookahead
// tokens come after the prompt, so the prompt's keys and values do not depend on any trainable
// parameter. They are computed once per sample (one prefill of X) and held fixed; the ground
// truth (Eq. 1, mean attention of Y's queries over X's keys) is fixed too. One training step of a
// sample is then a forward of the n lookahead rows alone, layer by layer, attending over the fixed
// prompt KV and causally over their own KV, and its backward:
//
//   x = E (the lookahead embeddings)                                for each layer l:
//   h = RMSNorm(x) g_att; q|k|v = LoRA_{q,k,v}(h); RoPE(q, k) at positions P .. P + n - 1
//   est_l,h = mean over rows of softmax(q_h [K_prompt ; k_block (causal)] / sqrt(d_h))[prompt cols]
//   a = softmax(...) [V_prompt ; v_block];  x += LoRA_o(a)
//   h2 = RMSNorm(x) g_ffn;  x += LoRA_w2(silu(LoRA_w1(h2)) * LoRA_w3(h2))
//   loss = mean over layers and query heads of KL(norm(GT_l,h) || norm(est_l,h))   (Eq. 5)
//
// Every layer's estimate contributes, and gradients reach earlier layers through both the score
// path (est -> q, k_block) and the attention-output path (a = P V -> q, k_block, v_block). The
// library supplies LoRA forward/backward (kvevict::lora_linear_*) and the loss with its gradient
// (kvevict::lookahead_kl_loss); this file adds RMSNorm, RoPE, SwiGLU and the block attention with
// both outputs (estimate and P V) from one softmax, whose estimate part is exactly the library's
// kvevict::lookahead_window_scores and its backward (the tests compare them; calling those too
// would recompute the softmax twice more). Every piece is checked against central differences in
// tests/test_lookaheadkv.cpp.
//
// Every function is templated on T (float for training, double for the finite-difference tests).
// The float forward repeats the runner's arithmetic operation for operation (same summation
// orders, run.c's RMSNorm, RoPE, attention and SwiGLU), so the lookahead rows' queries and keys are
// bit-identical to those the runner computes at inference (tested).
#pragma once

#include <lookaheadkv/data.hpp>
#include <lookaheadkv/module.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/workers.hpp>

#include <kvevict/train/lookahead.hpp>
#include <kvevict/score.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>


namespace kvrun {

// ---------------------------------------------------------------------------------------------
// The frozen model in T

/// A model's dimensions under the short names the backprop classes (lookahead_backprop,
/// headgates' gated_backprop) use, set from its config.
class model_dims {
 protected:
  int L_ = 0;
  index_t D_ = 0, H_ = 0, Hkv_ = 0, hs_ = 0, kvd_ = 0, hid_ = 0;
  void set_dims(const config& c) {
    L_ = c.n_layers;
    D_ = c.dim;
    H_ = c.n_heads;
    Hkv_ = c.n_kv_heads;
    hs_ = c.head_size();
    kvd_ = c.kv_dim();
    hid_ = c.hidden_dim;
  }
};

/// The runner model's weights converted to T, each linear layer stored [out][in] row-major (the
/// library's LoRA layout), plus the RMSNorm gains and the RoPE tables (the runner's fp32 tables,
/// converted, so the double model computes the same function).
template <class T>
struct frozen_model {
  config cfg;
  std::vector<T> attn_norm, ffn_norm;           // [L][dim]
  std::vector<T> weights[lora_targets];         // per projection: [L][out][in]
  std::vector<T> weights_t[lora_targets];       // the same transposed, [L][in][out] (for dx = dy W)
  std::vector<T> rope_cos, rope_sin;            // [seq_len][head_size / 2]

  void from(const model& m) {
    cfg = m.cfg();
    const lookahead_dims d = lookahead_dims::of(cfg);
    const index_t D = cfg.dim, L = cfg.n_layers, kvd = cfg.kv_dim(), hid = cfg.hidden_dim, qs = m.qkv_width();
    attn_norm.assign(static_cast<std::size_t>(L * D), T(0));
    ffn_norm.assign(attn_norm.size(), T(0));
    for (projection p : lora_order) {
      weights[static_cast<int>(p)].assign(static_cast<std::size_t>(L * d.in(p) * d.out(p)), T(0));
      weights_t[static_cast<int>(p)].assign(weights[static_cast<int>(p)].size(), T(0));
    }
    for (int l = 0; l < L; ++l) {
      for (index_t j = 0; j < D; ++j) {
        attn_norm[static_cast<std::size_t>(l * D + j)] = static_cast<T>(m.attn_norm(l)[j]);
        ffn_norm[static_cast<std::size_t>(l * D + j)] = static_cast<T>(m.ffn_norm(l)[j]);
      }
      // source: [in][width] with the projection's columns starting at col0
      auto take = [&](projection p, const float* src, index_t width, index_t col0) {
        const index_t in = d.in(p), out = d.out(p);
        T* dst = weights[static_cast<int>(p)].data() + static_cast<index_t>(l) * in * out;
        T* dst_t = weights_t[static_cast<int>(p)].data() + static_cast<index_t>(l) * in * out;
        for (index_t o = 0; o < out; ++o)
          for (index_t i = 0; i < in; ++i) {
            dst[o * in + i] = static_cast<T>(src[i * width + col0 + o]);
            dst_t[i * out + o] = dst[o * in + i];
          }
      };
      take(projection::q, m.wqkv(l), qs, 0);
      take(projection::k, m.wqkv(l), qs, D);
      take(projection::v, m.wqkv(l), qs, D + kvd);
      take(projection::o, m.wo(l), D, 0);
      take(projection::w1, m.w13(l), 2 * hid, 0);
      take(projection::w3, m.w13(l), 2 * hid, hid);
      take(projection::w2, m.w2(l), D, 0);
    }
    const int half = cfg.head_size() / 2;
    rope_cos.assign(static_cast<std::size_t>(index_t(cfg.seq_len) * half), T(0));
    rope_sin.assign(rope_cos.size(), T(0));
    for (pos_t p = 0; p < cfg.seq_len; ++p)
      for (int i = 0; i < half; ++i) {
        rope_cos[static_cast<std::size_t>(index_t(p) * half + i)] = static_cast<T>(m.rope_cos(p, i));
        rope_sin[static_cast<std::size_t>(index_t(p) * half + i)] = static_cast<T>(m.rope_sin(p, i));
      }
  }

  /// Layer l's weight of projection p as [out][in].
  kvevict::matrix_view<const T> weight(int l, projection p) const {
    const lookahead_dims d = lookahead_dims::of(cfg);
    const index_t in = d.in(p), out = d.out(p);
    return *kvevict::make_matrix_view<const T>(weights[static_cast<int>(p)].data() + static_cast<index_t>(l) * in * out,
                                               out, in);
  }
  /// The same weight as [out][in] over the transposed storage (strides {1, out}): the backward's
  /// dx = dy W then reads contiguous memory.
  kvevict::matrix_view<const T> weight_t(int l, projection p) const {
    const lookahead_dims d = lookahead_dims::of(cfg);
    const index_t in = d.in(p), out = d.out(p);
    using exts = cuda::std::dextents<index_t, 2>;
    return kvevict::matrix_view<const T>(
        weights_t[static_cast<int>(p)].data() + static_cast<index_t>(l) * in * out,
        cuda::std::layout_stride::mapping<exts>(exts(out, in), cuda::std::array<index_t, 2>{1, out}));
  }
  const T* attn_gain(int l) const { return attn_norm.data() + static_cast<index_t>(l) * cfg.dim; }
  const T* ffn_gain(int l) const { return ffn_norm.data() + static_cast<index_t>(l) * cfg.dim; }
  const T* cos_row(index_t pos) const { return rope_cos.data() + pos * (cfg.head_size() / 2); }
  const T* sin_row(index_t pos) const { return rope_sin.data() + pos * (cfg.head_size() / 2); }
};

// ---------------------------------------------------------------------------------------------
// Backward pieces (one row or one block; plain loops written for clarity)

namespace lkv {

/// RMSNorm of one row as run.c computes it: r = 1 / sqrt(sum(x^2) / d + 1e-5), y = g * (r * x).
/// Returns r (saved for the backward).
template <class T>
T rmsnorm_forward(const T* x, const T* g, index_t d, T* y) {
  T ss = T(0);
  for (index_t j = 0; j < d; ++j) ss += x[j] * x[j];
  ss /= static_cast<T>(d);
  ss += static_cast<T>(1e-5f);
  const T r = T(1) / std::sqrt(ss);
  for (index_t j = 0; j < d; ++j) y[j] = g[j] * (r * x[j]);
  return r;
}

/// Backward of rmsnorm_forward: dx_j = r g_j dy_j - x_j (r^3 / d) sum_k g_k dy_k x_k.
/// dx is overwritten, or added to when `accumulate`.
template <class T>
void rmsnorm_backward(const T* x, const T* g, T r, const T* dy, index_t d, T* dx, bool accumulate) {
  T dot = T(0);
  for (index_t k = 0; k < d; ++k) dot += g[k] * dy[k] * x[k];
  const T c = r * r * r * dot / static_cast<T>(d);
  for (index_t j = 0; j < d; ++j) {
    const T v = r * g[j] * dy[j] - x[j] * c;
    dx[j] = accumulate ? dx[j] + v : v;
  }
}

/// RoPE of one row of `width` values (whole heads of `hs`), in place, as the runner: each pair
/// (2i, 2i+1) of a head rotated by the angle of pair i: y0 = v0 cos - v1 sin, y1 = v0 sin + v1 cos.
template <class T>
void rope_forward(T* v, index_t width, index_t hs, const T* cos, const T* sin) {
  for (index_t j = 0; j < width; j += 2) {
    const index_t pair = (j % hs) / 2;
    const T v0 = v[j], v1 = v[j + 1];
    v[j] = v0 * cos[pair] - v1 * sin[pair];
    v[j + 1] = v0 * sin[pair] + v1 * cos[pair];
  }
}

/// Backward of rope_forward (the transposed rotation), in place on the gradient row.
template <class T>
void rope_backward(T* dv, index_t width, index_t hs, const T* cos, const T* sin) {
  for (index_t j = 0; j < width; j += 2) {
    const index_t pair = (j % hs) / 2;
    const T d0 = dv[j], d1 = dv[j + 1];
    dv[j] = d0 * cos[pair] + d1 * sin[pair];
    dv[j + 1] = -d0 * sin[pair] + d1 * cos[pair];
  }
}

/// SwiGLU as run.c: out_i = u1_i * (1 / (1 + exp(-u1_i))) * u3_i.
template <class T>
void swiglu_forward(const T* u1, const T* u3, index_t n, T* out) {
  for (index_t i = 0; i < n; ++i) {
    const T g = u1[i] * (T(1) / (T(1) + std::exp(-u1[i])));
    out[i] = g * u3[i];
  }
}

/// Backward of swiglu_forward: du3 = dout silu(u1), du1 = dout u3 s (1 + u1 (1 - s)), s = sigmoid(u1).
template <class T>
void swiglu_backward(const T* u1, const T* u3, const T* dout, index_t n, T* du1, T* du3) {
  for (index_t i = 0; i < n; ++i) {
    const T s = T(1) / (T(1) + std::exp(-u1[i]));
    du3[i] = dout[i] * u1[i] * s;
    du1[i] = dout[i] * u3[i] * s * (T(1) + u1[i] * (T(1) - s));
  }
}

/// dx (=|+=) dy W for a frozen linear layer W [out][in] (no adapter): dx[t][i] = sum_o dy[t][o] W[o][i].
template <class T>
void linear_backward_input(kvevict::matrix_view<const T> w, const T* dy, index_t rows, T* dx, bool accumulate) {
  const index_t out = w.extent(0), in = w.extent(1);
  for (index_t t = 0; t < rows; ++t)
    for (index_t i = 0; i < in; ++i) {
      T acc = T(0);
      for (index_t o = 0; o < out; ++o) acc += dy[t * out + o] * w(o, i);
      dx[t * in + i] = accumulate ? dx[t * in + i] + acc : acc;
    }
}

/// Shapes of the lookahead block's attention: n block rows, P prompt rows, H query heads over
/// Hkv KV heads of size hs. Query head h reads KV head h / (H / Hkv).
struct attention_shape {
  index_t n = 0, P = 0, H = 0, Hkv = 0, hs = 0;
  index_t width() const { return P + n; }
};

/// Attention of the lookahead block, as the runner computes it for each (row, query head): logits
/// (q_i . k_j) / sqrt(hs) over the P prompt keys and the block keys 0..i, run.c's softmax, then
/// out = sum_j A_ij v_j. q [n][H hs], kb / vb [n][Hkv hs] (the block's post-RoPE keys and its
/// values), kp / vp [Hkv][P][hs] (the prompt's), probs [H][n][P + n] (saved; columns past the
/// causal limit are 0), out [n][H hs] (null: not computed, e.g. the last layer, whose output
/// reaches no loss). est [H][P] (null: skipped) receives the window score of every query head:
/// est[h][j] = (1/n) sum_i A[h][i][j] over the prompt columns, rows summed in ascending order and
/// then divided by n, as kvevict::lookahead_window_scores (which the tests compare it with).
template <class T>
void block_attention_forward(const attention_shape& s, const T* q, const T* kb, const T* vb, const T* kp, const T* vp,
                             T* probs, T* out, T* est = nullptr) {
  const index_t group = s.H / s.Hkv, W = s.width(), qd = s.H * s.hs, kd = s.Hkv * s.hs;
  const T scale = std::sqrt(static_cast<T>(s.hs));
  for (index_t h = 0; h < s.H; ++h) {
    const index_t g = h / group;
    for (index_t i = 0; i < s.n; ++i) {
      const T* qi = q + i * qd + h * s.hs;
      T* a = probs + (h * s.n + i) * W;
      const index_t visible = s.P + i + 1;
      for (index_t j = 0; j < visible; ++j) {
        const T* k = j < s.P ? kp + (g * s.P + j) * s.hs : kb + (j - s.P) * kd + g * s.hs;
        T score = T(0);
        for (index_t e = 0; e < s.hs; ++e) score += qi[e] * k[e];
        a[j] = score / scale;
      }
      T mx = a[0];
      for (index_t j = 1; j < visible; ++j)
        if (a[j] > mx) mx = a[j];
      T sum = T(0);
      for (index_t j = 0; j < visible; ++j) {
        a[j] = std::exp(a[j] - mx);
        sum += a[j];
      }
      for (index_t j = 0; j < visible; ++j) a[j] /= sum;
      for (index_t j = visible; j < W; ++j) a[j] = T(0);
      if (out == nullptr) continue;
      T* o = out + i * qd + h * s.hs;
      for (index_t e = 0; e < s.hs; ++e) o[e] = T(0);
      for (index_t j = 0; j < visible; ++j) {
        const T* v = j < s.P ? vp + (g * s.P + j) * s.hs : vb + (j - s.P) * kd + g * s.hs;
        for (index_t e = 0; e < s.hs; ++e) o[e] += a[j] * v[e];
      }
    }
    if (est == nullptr) continue;
    for (index_t j = 0; j < s.P; ++j) {
      T acc = T(0);
      for (index_t i = 0; i < s.n; ++i) acc += probs[(h * s.n + i) * W + j];
      est[h * s.P + j] = acc / static_cast<T>(s.n);
    }
  }
}

/// Backward of block_attention_forward through both of its outputs (the prompt's keys and values
/// are constants): dout [n][H hs] = dL/dout (null: 0) and dest [H][P] = dL/dest (null: 0). With
///   dA_ij = dout_i . v_j + [j < P] dest_j / n,  mu_i = sum_j A_ij dA_ij,  dz_ij = A_ij (dA_ij - mu_i):
///   dq_i  = sum_j dz_ij k_j / sqrt(hs),  dkb_l = sum_{i>=l} dz_il q_i / sqrt(hs),
///   dvb_l = sum_{i>=l} A_il dout_i     (summed over the query heads of each KV head's group).
/// The estimate's part alone is kvevict::lookahead_window_scores_backward (the tests compare them).
/// dq [n][H hs], dkb / dvb [n][Hkv hs] are overwritten; row [P + n] is scratch.
template <class T>
void block_attention_backward(const attention_shape& s, const T* q, const T* kb, const T* vb, const T* kp, const T* vp,
                              const T* probs, const T* dout, const T* dest, T* dq, T* dkb, T* dvb, T* row) {
  const index_t group = s.H / s.Hkv, W = s.width(), qd = s.H * s.hs, kd = s.Hkv * s.hs;
  const T scale = std::sqrt(static_cast<T>(s.hs));
  const T inv_n = T(1) / static_cast<T>(s.n);
  std::fill(dq, dq + s.n * qd, T(0));
  std::fill(dkb, dkb + s.n * kd, T(0));
  std::fill(dvb, dvb + s.n * kd, T(0));
  for (index_t h = 0; h < s.H; ++h) {
    const index_t g = h / group;
    for (index_t i = 0; i < s.n; ++i) {
      const T* a = probs + (h * s.n + i) * W;
      const T* di = dout != nullptr ? dout + i * qd + h * s.hs : nullptr;
      const T* qi = q + i * qd + h * s.hs;
      const index_t visible = s.P + i + 1;
      T mu = T(0);
      for (index_t j = 0; j < visible; ++j) {
        T da = T(0);
        if (di != nullptr) {
          const T* v = j < s.P ? vp + (g * s.P + j) * s.hs : vb + (j - s.P) * kd + g * s.hs;
          for (index_t e = 0; e < s.hs; ++e) da += di[e] * v[e];
        }
        if (dest != nullptr && j < s.P) da += dest[h * s.P + j] * inv_n;
        row[j] = da;
        mu += a[j] * da;
      }
      T* dqi = dq + i * qd + h * s.hs;
      for (index_t j = 0; j < visible; ++j) {
        const T dz = a[j] * (row[j] - mu) / scale;
        const T* k = j < s.P ? kp + (g * s.P + j) * s.hs : kb + (j - s.P) * kd + g * s.hs;
        for (index_t e = 0; e < s.hs; ++e) dqi[e] += dz * k[e];
        if (j >= s.P) {
          T* dk = dkb + (j - s.P) * kd + g * s.hs;
          for (index_t e = 0; e < s.hs; ++e) dk[e] += dz * qi[e];
          if (di != nullptr) {
            T* dv = dvb + (j - s.P) * kd + g * s.hs;
            for (index_t e = 0; e < s.hs; ++e) dv[e] += a[j] * di[e];
          }
        }
      }
    }
  }
}

template <class T>
kvevict::matrix_view<T> mat(T* p, index_t rows, index_t cols, index_t row_stride) {
  return *kvevict::make_matrix_view<T>(p, rows, cols, row_stride);
}
template <class T>
kvevict::vector_view<T> vec(T* p, index_t n) {
  using exts = cuda::std::dextents<index_t, 1>;
  return kvevict::vector_view<T>(p, cuda::std::layout_stride::mapping<exts>(exts(n), cuda::std::array<index_t, 1>{1}));
}

}  // namespace lkv

// ---------------------------------------------------------------------------------------------
// Samples: the fixed part of a training example

/// A prepared pair: the prompt's KV per layer (post-RoPE keys, as the runner caches them) and the
/// ground truth of Eq. 1 per layer and query head.
template <class T>
struct basic_lookahead_sample {
  index_t P = 0;
  std::vector<T> keys, values;  ///< [L][Hkv][P][hs]
  std::vector<T> gt;            ///< [L][H][P]: mean attention of Y's queries over X's keys

  template <class U>
  basic_lookahead_sample<U> cast() const {
    basic_lookahead_sample<U> r;
    r.P = P;
    r.keys.assign(keys.begin(), keys.end());
    r.values.assign(values.begin(), values.end());
    r.gt.assign(gt.begin(), gt.end());
    return r;
  }
};
using lookahead_sample = basic_lookahead_sample<float>;

/// Ground truth of Eq. 1 for a cache holding the prefilled prompt (every head of every layer with
/// the same T rows): runs Y as an extra block (its KV rolled back afterwards) and, per layer, the
/// library's attention_scores of Y's post-RoPE queries over the T prompt keys and Y's own keys
/// (causal), mean over Y's rows, prompt columns: gt [L][H][T]. Errors: a ragged cache, then the
/// runner's and the score stage's.
inline status ground_truth(runner& run, kv_cache& cache, const std::vector<int>& response, std::vector<float>& gt,
                           std::vector<unsigned char>& ws_buf) {
  const config& c = run.get_model().cfg();
  const index_t T = cache.length(0, 0), H = c.n_heads;
  for (int l = 0; l < c.n_layers; ++l)
    for (index_t h = 0; h < c.n_kv_heads; ++h)
      if (cache.length(l, h) != T)
        return status::error(errc::invalid_argument, "ground_truth: layer %d head %lld holds %lld rows, layer 0 head 0 %lld",
                             l, static_cast<long long>(h), static_cast<long long>(cache.length(l, h)),
                             static_cast<long long>(T));
  gt.assign(static_cast<std::size_t>(index_t(c.n_layers) * H * T), 0.0f);
  forward_hooks hooks;
  hooks.after_layer = [&](const layer_event& ev) -> status {
    const auto prefix = cache.dense_keys(ev.layer, T);
    if (!prefix) return prefix.error();
    const auto out = *kvevict::make_matrix_view(gt.data() + index_t(ev.layer) * H * T, H, T);
    return with_workspace(ws_buf, [&](kvevict::workspace& ws) {
      return kvevict::attention_scores(kvevict::seq, ws, ev.queries, *prefix, ev.keys, out);
    });
  };
  return run.forward_extra(cache, tokens(response), logits_mode::none, hooks);
}

/// The sample of a cache holding exactly the prompt X (P rows per head): its KV, and Eq. 1's
/// ground truth with `response`. Errors: the runner's and the score stage's.
inline status sample_from_cache(runner& run, kv_cache& cache, const std::vector<int>& response, lookahead_sample& out,
                                std::vector<unsigned char>& ws_buf) {
  const config& c = run.get_model().cfg();
  const index_t P = cache.length(0, 0), hs = c.head_size(), Hkv = c.n_kv_heads;
  out.P = P;
  out.keys.assign(static_cast<std::size_t>(index_t(c.n_layers) * Hkv * P * hs), 0.0f);
  out.values.assign(out.keys.size(), 0.0f);
  for (int l = 0; l < c.n_layers; ++l)
    for (index_t h = 0; h < Hkv; ++h) {
      if (cache.length(l, h) != P)
        return status::error(errc::invalid_argument, "sample: layer %d head %lld holds %lld rows, layer 0 head 0 %lld", l,
                             static_cast<long long>(h), static_cast<long long>(cache.length(l, h)),
                             static_cast<long long>(P));
      float* kd = out.keys.data() + ((index_t(l) * Hkv + h) * P) * hs;
      float* vd = out.values.data() + ((index_t(l) * Hkv + h) * P) * hs;
      for (index_t j = 0; j < P; ++j) {  // row by row: a head's pages need not be consecutive
        std::copy_n(cache.key_row(l, h, j), hs, kd + j * hs);
        std::copy_n(cache.value_row(l, h, j), hs, vd + j * hs);
      }
    }
  return ground_truth(run, cache, response, out.gt, ws_buf);
}

/// Prefills X into `cache` (cleared first) and computes the sample: the prompt KV and Eq. 1's
/// ground truth with Y. Errors: the runner's (X + Y must fit in the context).
inline status prepare_sample(runner& run, kv_cache& cache, const text_pair& p, lookahead_sample& out,
                             std::vector<unsigned char>& ws_buf) {
  cache.clear();
  KVEVICT_TRY(run.forward(cache, tokens(p.prompt), logits_mode::none));
  return sample_from_cache(run, cache, p.response, out, ws_buf);
}

namespace detail {

/// n (pair, sample) items on `threads` OpenMP threads (0: all), one runner each: make(w, i, pair,
/// checkpoint) fills pair i and leaves the worker's cache holding its prompt with `checkpoint` taken
/// right after it (and possibly more); the sample comes from the cache rolled back there.
template <class Make>
status samples_of(const model& m, index_t n, int threads, const std::function<void(index_t, index_t)>& progress,
                  Make make, std::vector<text_pair>& pairs_out, std::vector<lookahead_sample>& samples_out) {
  std::vector<text_pair> pairs(static_cast<std::size_t>(n));
  std::vector<lookahead_sample> samples(static_cast<std::size_t>(n));
  std::vector<runner_worker> workers(static_cast<std::size_t>(thread_count(threads)));
  for (runner_worker& w : workers) KVEVICT_TRY(w.init(m));
  const status st = for_each_item(
      workers, n,
      [&](runner_worker& w, index_t i) {
        const auto k = static_cast<std::size_t>(i);
        cache_checkpoint cp;
        KVEVICT_TRY(make(w, i, pairs[k], cp));
        KVEVICT_TRY(w.cache.rollback(cp));
        return sample_from_cache(w.run, w.cache, pairs[k].response, samples[k], w.scratch);
      },
      [&](index_t d, int t) {
        if (t == 0 && progress) progress(d, n);
      });
  KVEVICT_TRY(st);
  if (progress) progress(n, n);
  pairs_out = std::move(pairs);
  samples_out = std::move(samples);
  return {};
}

}  // namespace detail

/// make_pairs and prepare_sample in one pass: each pair's prompt KV is the generation's own cache
/// rolled back to the end of X (decoding one token at a time gives the bits of a block prefill,
/// tested), so no second prefill is needed. Same pairs as make_pairs; samples equal to
/// prepare_sample's. Errors: those of make_pairs and prepare_sample.
inline status make_training_samples(const model& m, pair_options o, std::uint64_t seed_begin, std::uint64_t seed_end,
                                    std::vector<text_pair>& pairs_out, std::vector<lookahead_sample>& samples_out,
                                    int threads = 0, const std::function<void(index_t, index_t)>& progress = {}) {
  KVEVICT_TRY(detail::resolve_pair_options(m.cfg(), o));
  const index_t n = seed_end > seed_begin ? static_cast<index_t>(seed_end - seed_begin) : 0;
  return detail::samples_of(
      m, n, threads, progress,
      [&](runner_worker& w, index_t i, text_pair& p, cache_checkpoint& cp) {
        return detail::make_pair(w.run, w.cache, o, seed_begin + static_cast<std::uint64_t>(i), p, &cp);
      },
      pairs_out, samples_out);
}

/// The checks of samples_from_prompts: at least one prompt, `response` >= 1, every prompt at least 2
/// tokens, BOS first, every token inside the vocabulary, prompt + response within the context.
inline status check_prompts(const config& c, const std::vector<std::vector<int>>& prompts, index_t response) {
  if (prompts.empty()) return status::error(errc::invalid_argument, "prompts: none given");
  if (response < 1) return status::error(errc::invalid_argument, "prompts: response length %lld is not >= 1",
                                         static_cast<long long>(response));
  for (std::size_t k = 0; k < prompts.size(); ++k) {
    const std::vector<int>& x = prompts[k];
    if (x.size() < 2 || x.front() != bos_token)
      return status::error(errc::invalid_argument, "prompt %zu: %zu tokens; a prompt is BOS (%d) and at least one more token",
                           k + 1, x.size(), bos_token);
    for (const int t : x)
      if (t < 0 || t >= c.vocab_size)
        return status::error(errc::invalid_argument, "prompt %zu: token %d is outside the vocabulary [0, %d)", k + 1, t,
                             c.vocab_size);
    if (static_cast<index_t>(x.size()) + response > c.seq_len)
      return status::error(errc::invalid_argument, "prompt %zu: %zu tokens + a response of %lld exceed the context of %d",
                           k + 1, x.size(), static_cast<long long>(response), c.seq_len);
  }
  return {};
}

namespace detail {
/// Pair `seed`: the prompt and the next `response` tokens decoded greedily with the full cache after a
/// block prefill of it; cp (when given) is the cache at the end of the prompt.
inline status pair_from_prompt(runner_worker& w, const config& c, const std::vector<int>& prompt, std::uint64_t seed,
                               index_t response, text_pair& p, cache_checkpoint* cp) {
  p.seed = seed;
  p.prompt = prompt;
  p.response.clear();
  w.cache.clear();
  KVEVICT_TRY(w.run.forward(w.cache, tokens(p.prompt), logits_mode::last));
  if (cp != nullptr) *cp = w.cache.save();
  while (static_cast<index_t>(p.response.size()) < response) {
    const int t = sampler::argmax(w.run.logits(0), c.vocab_size);
    p.response.push_back(t);
    if (static_cast<index_t>(p.response.size()) < response) KVEVICT_TRY(w.run.decode(w.cache, t));
  }
  return {};
}
}  // namespace detail

/// Samples from given prompts instead of model-generated ones (the testbed's retrieval prompts,
/// docs/testbed.md): pair k is prompt k as X (seed k), Y = the next `response` tokens decoded greedily
/// with the full cache after a block prefill of X, and its sample (the prompt KV rolled back to the
/// end of X, Eq. 1's ground truth with Y). Errors, before any work: check_prompts'; then the runner's.
inline status samples_from_prompts(const model& m, const std::vector<std::vector<int>>& prompts, index_t response,
                                   std::vector<text_pair>& pairs_out, std::vector<lookahead_sample>& samples_out,
                                   int threads = 0, const std::function<void(index_t, index_t)>& progress = {}) {
  KVEVICT_TRY(check_prompts(m.cfg(), prompts, response));
  return detail::samples_of(
      m, static_cast<index_t>(prompts.size()), threads, progress,
      [&](runner_worker& w, index_t i, text_pair& p, cache_checkpoint& cp) {
        return detail::pair_from_prompt(w, m.cfg(), prompts[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i),
                                        response, p, &cp);
      },
      pairs_out, samples_out);
}

/// The pairs of samples_from_prompts without LookaheadKV's samples (kvevict-headgates --prompts):
/// pair k is prompt k (seed k) and its greedy response. Errors: check_prompts', then the runner's.
inline status pairs_from_prompts(const model& m, const std::vector<std::vector<int>>& prompts, index_t response,
                                 std::vector<text_pair>& out, int threads = 0) {
  KVEVICT_TRY(check_prompts(m.cfg(), prompts, response));
  std::vector<text_pair> pairs(prompts.size());
  std::vector<runner_worker> workers(static_cast<std::size_t>(thread_count(threads)));
  for (runner_worker& w : workers) KVEVICT_TRY(w.init(m));
  KVEVICT_TRY(for_each_item(workers, static_cast<index_t>(prompts.size()), [&](runner_worker& w, index_t i) {
    const auto k = static_cast<std::size_t>(i);
    return detail::pair_from_prompt(w, m.cfg(), prompts[k], static_cast<std::uint64_t>(i), response, pairs[k], nullptr);
  }));
  out = std::move(pairs);
  return {};
}

/// prepare_sample for many pairs on `threads` OpenMP threads (0: all), one runner each.
inline status prepare_samples(const model& m, const std::vector<text_pair>& pairs, std::vector<lookahead_sample>& out,
                              int threads = 0) {
  std::vector<lookahead_sample> samples(pairs.size());
  std::vector<runner_worker> workers(static_cast<std::size_t>(thread_count(threads)));
  for (runner_worker& w : workers) KVEVICT_TRY(w.init(m));
  KVEVICT_TRY(for_each_item(workers, static_cast<index_t>(pairs.size()), [&](runner_worker& w, index_t i) {
    const auto k = static_cast<std::size_t>(i);
    return prepare_sample(w.run, w.cache, pairs[k], samples[k], w.scratch);
  }));
  out = std::move(samples);
  return {};
}

// ---------------------------------------------------------------------------------------------
// One sample's forward and backward

/// Forward and backward of the lookahead block for one sample, with its own activations and
/// scratch (one per thread). Library calls run on kvevict::seq: parallelism is over samples.
template <class T>
class lookahead_backprop : private model_dims {
 public:
  /// Sizes the activations for prompts of up to max_prompt tokens (larger ones grow them).
  /// Errors: the module was made for another model; n_lookahead + max_prompt beyond the context.
  status init(const frozen_model<T>& fm, const basic_lookahead_module<T>& mod, index_t max_prompt) {
    KVEVICT_TRY(mod.check_model(fm.cfg));
    if (max_prompt < 1 || max_prompt + mod.n_lookahead() > fm.cfg.seq_len)
      return status::error(errc::invalid_argument,
                           "lookahead: a prompt of %lld tokens and %lld lookahead tokens do not fit the context of %d",
                           static_cast<long long>(max_prompt), static_cast<long long>(mod.n_lookahead()), fm.cfg.seq_len);
    const config& c = fm.cfg;
    n_ = mod.n_lookahead();
    r_ = mod.rank();
    set_dims(c);
    const auto LN = static_cast<std::size_t>(L_ * n_);
    x_.assign(static_cast<std::size_t>((L_ + 1) * n_ * D_), T(0));
    xmid_.assign(LN * D_, T(0));
    h1_.assign(LN * D_, T(0));
    h2_.assign(LN * D_, T(0));
    att_.assign(LN * D_, T(0));
    q_.assign(LN * D_, T(0));
    k_.assign(LN * kvd_, T(0));
    v_.assign(LN * kvd_, T(0));
    u1_.assign(LN * hid_, T(0));
    u3_.assign(LN * hid_, T(0));
    gate_.assign(LN * hid_, T(0));
    r1_.assign(LN, T(0));
    r2_.assign(LN, T(0));
    xa_.assign(LN * lora_targets * r_, T(0));
    tmp_.assign(static_cast<std::size_t>(n_ * std::max<index_t>(D_, hid_)), T(0));
    dx_.assign(static_cast<std::size_t>(n_ * D_), T(0));
    dxm_ = dh_ = datt_ = dq_ = dx_;
    dk_.assign(static_cast<std::size_t>(n_ * kvd_), T(0));
    dv_ = dk_;
    dgate_.assign(static_cast<std::size_t>(n_ * hid_), T(0));
    du1_ = du3_ = dgate_;
    reserve(max_prompt);
    return {};
  }

  /// Forward of the lookahead block over sample s: fills the activations and the estimates
  /// est [L][H][P] (the paper's s_LKV per layer and query head). Errors: not initialised, a module
  /// of another shape than init's, a sample whose prompt plus the block exceeds the context or
  /// whose tensors do not match its P, then the library's.
  status forward(const frozen_model<T>& fm, const basic_lookahead_module<T>& mod, const basic_lookahead_sample<T>& s) {
    if (L_ == 0) return status::error(errc::invalid_argument, "lookahead_backprop: not initialised (call init)");
    if (mod.n_lookahead() != n_ || mod.rank() != r_ || mod.dims().n_layers != L_ || mod.dims().dim != D_)
      return status::error(errc::shape_mismatch, "lookahead_backprop: the module's shape differs from the one init() saw");
    if (s.P < 1 || s.P + n_ > fm.cfg.seq_len)
      return status::error(errc::out_of_range,
                           "lookahead_backprop: a prompt of %lld tokens and %lld lookahead tokens do not fit the context of %d",
                           static_cast<long long>(s.P), static_cast<long long>(n_), fm.cfg.seq_len);
    const auto kv = static_cast<std::size_t>(L_ * Hkv_ * s.P * hs_), gt = static_cast<std::size_t>(L_ * H_ * s.P);
    if (s.keys.size() != kv || s.values.size() != kv || s.gt.size() != gt)
      return status::error(errc::shape_mismatch,
                           "lookahead_backprop: the sample holds %zu keys, %zu values, %zu ground-truth scores; P = %lld "
                           "needs %zu, %zu, %zu",
                           s.keys.size(), s.values.size(), s.gt.size(), static_cast<long long>(s.P), kv, kv, gt);
    reserve(s.P);
    P_ = s.P;
    const index_t n = n_, D = D_;
    std::copy(mod.embeddings(), mod.embeddings() + n * D, x_.begin());
    for (int l = 0; l < L_; ++l) {
      const T* x = xl(l);
      T* h1 = at(h1_, l, D);
      for (index_t i = 0; i < n; ++i) at(r1_, l, 1)[i] = lkv::rmsnorm_forward(x + i * D, fm.attn_gain(l), D, h1 + i * D);
      KVEVICT_TRY(project(fm, mod, l, projection::q, h1, at(q_, l, D)));
      KVEVICT_TRY(project(fm, mod, l, projection::k, h1, at(k_, l, kvd_)));
      KVEVICT_TRY(project(fm, mod, l, projection::v, h1, at(v_, l, kvd_)));
      for (index_t i = 0; i < n; ++i) {
        lkv::rope_forward(at(q_, l, D) + i * D, D, hs_, fm.cos_row(P_ + i), fm.sin_row(P_ + i));
        lkv::rope_forward(at(k_, l, kvd_) + i * kvd_, kvd_, hs_, fm.cos_row(P_ + i), fm.sin_row(P_ + i));
      }
      // the attention of the block: the estimate of every query head (score path) and, except in
      // the last layer (whose output reaches no loss), the attention output
      const bool last = l == L_ - 1;
      lkv::block_attention_forward(shape(), at(q_, l, D), at(k_, l, kvd_), at(v_, l, kvd_), layer_kv(s.keys, l),
                                   layer_kv(s.values, l), probs(l), last ? nullptr : at(att_, l, D),
                                   est_.data() + l * H_ * P_);
      if (last) break;
      KVEVICT_TRY(project(fm, mod, l, projection::o, at(att_, l, D), tmp_.data()));
      T* xm = at(xmid_, l, D);
      for (index_t e = 0; e < n * D; ++e) xm[e] = x[e] + tmp_[static_cast<std::size_t>(e)];
      // FFN
      T* h2 = at(h2_, l, D);
      for (index_t i = 0; i < n; ++i) at(r2_, l, 1)[i] = lkv::rmsnorm_forward(xm + i * D, fm.ffn_gain(l), D, h2 + i * D);
      KVEVICT_TRY(project(fm, mod, l, projection::w1, h2, at(u1_, l, hid_)));
      KVEVICT_TRY(project(fm, mod, l, projection::w3, h2, at(u3_, l, hid_)));
      for (index_t i = 0; i < n; ++i)
        lkv::swiglu_forward(at(u1_, l, hid_) + i * hid_, at(u3_, l, hid_) + i * hid_, hid_, at(gate_, l, hid_) + i * hid_);
      KVEVICT_TRY(project(fm, mod, l, projection::w2, at(gate_, l, hid_), tmp_.data()));
      T* xn = xl(l + 1);
      for (index_t e = 0; e < n * D; ++e) xn[e] = xm[e] + tmp_[static_cast<std::size_t>(e)];
    }
    return {};
  }

  /// The estimates of the last forward, [L][H][P] row-major.
  const T* estimates() const { return est_.data(); }
  index_t prompt_length() const { return P_; }

  /// Eq. 5 over the last forward's estimates and s.gt ([L H] rows of P), and, if `want_grad`,
  /// its gradient w.r.t. the estimates (kept for backward()). Errors: lookahead_kl_loss's.
  status loss(const basic_lookahead_sample<T>& s, double* value, bool want_grad) {
    const index_t R = L_ * H_;
    auto gt = lkv::mat<const T>(s.gt.data(), R, P_, P_);
    auto est = lkv::mat<const T>(est_.data(), R, P_, P_);
    auto dest = want_grad ? lkv::mat<T>(dest_.data(), R, P_, P_) : kvevict::matrix_view<T>{};
    return with_workspace(ws_, [&](kvevict::workspace& ws) {
      return kvevict::lookahead_kl_loss(kvevict::seq, ws, gt, est, value, dest);
    });
  }

  /// Backward of the last forward given the loss gradient from loss(..., true): adds the
  /// gradient of every parameter into `grad` (param_count() values, the module's layout).
  status backward(const frozen_model<T>& fm, const basic_lookahead_module<T>& mod, const basic_lookahead_sample<T>& s,
                  T* grad) {
    const index_t n = n_, D = D_;
    std::fill(dx_.begin(), dx_.end(), T(0));  // dLoss / d(output of the last layer) = 0
    for (int l = L_ - 1; l >= 0; --l) {
      if (l < L_ - 1) {
        // FFN: x_out = x_mid + w2(swiglu(w1 h2, w3 h2)), h2 = RMSNorm(x_mid)
        KVEVICT_TRY(project_back(fm, mod, l, projection::w2, at(gate_, l, hid_), dx_.data(), dgate_.data(), false, grad));
        for (index_t i = 0; i < n; ++i)
          lkv::swiglu_backward(at(u1_, l, hid_) + i * hid_, at(u3_, l, hid_) + i * hid_, dgate_.data() + i * hid_, hid_,
                               du1_.data() + i * hid_, du3_.data() + i * hid_);
        KVEVICT_TRY(project_back(fm, mod, l, projection::w1, at(h2_, l, D), du1_.data(), dh_.data(), false, grad));
        KVEVICT_TRY(project_back(fm, mod, l, projection::w3, at(h2_, l, D), du3_.data(), dh_.data(), true, grad));
        dxm_ = dx_;
        for (index_t i = 0; i < n; ++i)
          lkv::rmsnorm_backward(at(xmid_, l, D) + i * D, fm.ffn_gain(l), at(r2_, l, 1)[i], dh_.data() + i * D, D,
                                dxm_.data() + i * D, true);
        // attention: x_mid = x + o(att), att = softmax(...) V
        KVEVICT_TRY(project_back(fm, mod, l, projection::o, at(att_, l, D), dxm_.data(), datt_.data(), false, grad));
      } else {
        std::fill(dxm_.begin(), dxm_.end(), T(0));
      }
      // the block's attention: the attention-output path (except in the last layer) and the
      // score path of this layer's estimates
      lkv::block_attention_backward(shape(), at(q_, l, D), at(k_, l, kvd_), at(v_, l, kvd_), layer_kv(s.keys, l),
                                    layer_kv(s.values, l), probs(l), l < L_ - 1 ? datt_.data() : nullptr,
                                    dest_.data() + l * H_ * P_, dq_.data(), dk_.data(), dv_.data(), row_.data());
      for (index_t i = 0; i < n; ++i) {
        lkv::rope_backward(dq_.data() + i * D, D, hs_, fm.cos_row(P_ + i), fm.sin_row(P_ + i));
        lkv::rope_backward(dk_.data() + i * kvd_, kvd_, hs_, fm.cos_row(P_ + i), fm.sin_row(P_ + i));
      }
      T* h1 = at(h1_, l, D);
      KVEVICT_TRY(project_back(fm, mod, l, projection::q, h1, dq_.data(), dh_.data(), false, grad));
      KVEVICT_TRY(project_back(fm, mod, l, projection::k, h1, dk_.data(), dh_.data(), true, grad));
      if (l < L_ - 1) KVEVICT_TRY(project_back(fm, mod, l, projection::v, h1, dv_.data(), dh_.data(), true, grad));
      dx_ = dxm_;
      for (index_t i = 0; i < n; ++i)
        lkv::rmsnorm_backward(xl(l) + i * D, fm.attn_gain(l), at(r1_, l, 1)[i], dh_.data() + i * D, D,
                              dx_.data() + i * D, true);
    }
    for (index_t e = 0; e < n * D; ++e) grad[e] += dx_[static_cast<std::size_t>(e)];
    return {};
  }

  /// forward + loss (+ backward when grad is not null, adding into grad).
  status loss_and_grad(const frozen_model<T>& fm, const basic_lookahead_module<T>& mod,
                       const basic_lookahead_sample<T>& s, double* value, T* grad) {
    KVEVICT_TRY(forward(fm, mod, s));
    KVEVICT_TRY(loss(s, value, grad != nullptr));
    if (grad != nullptr) KVEVICT_TRY(backward(fm, mod, s, grad));
    return {};
  }

  /// Post-RoPE queries [n][dim] and keys [n][kv_dim] of layer l (last forward).
  const T* queries(int l) const { return q_.data() + l * n_ * D_; }
  const T* keys(int l) const { return k_.data() + l * n_ * kvd_; }

 private:
  index_t n_ = 0, r_ = 0, P_ = 0, cap_ = -1;
  std::vector<T> x_, xmid_, h1_, h2_, att_, q_, k_, v_, u1_, u3_, gate_, r1_, r2_, xa_, tmp_, probs_, est_, dest_;
  std::vector<T> dx_, dxm_, dh_, datt_, dq_, dk_, dv_, dgate_, du1_, du3_, row_;
  std::vector<unsigned char> ws_;

  void reserve(index_t P) {
    if (P <= cap_) return;
    cap_ = P;
    probs_.assign(static_cast<std::size_t>(L_ * H_ * n_ * (P + n_)), T(0));
    row_.assign(static_cast<std::size_t>(P + n_), T(0));
    est_.assign(static_cast<std::size_t>(L_ * H_ * P), T(0));
    dest_.assign(est_.size(), T(0));
  }
  lkv::attention_shape shape() const { return {n_, P_, H_, Hkv_, hs_}; }
  T* xl(int l) { return x_.data() + l * n_ * D_; }
  T* at(std::vector<T>& v, int l, index_t width) { return v.data() + l * n_ * width; }
  T* probs(int l) { return probs_.data() + l * H_ * n_ * (P_ + n_); }
  T* xa(int l, projection p) { return xa_.data() + ((l * lora_targets + static_cast<int>(p)) * n_) * r_; }
  const T* layer_kv(const std::vector<T>& kv, int l) const { return kv.data() + l * Hkv_ * P_ * hs_; }

  // y [n][out] = LoRA_p(x [n][in]) (the plain layer when p is not adapted)
  status project(const frozen_model<T>& fm, const basic_lookahead_module<T>& mod, int l, projection p, const T* x, T* y) {
    const lookahead_dims& d = mod.dims();
    const index_t in = d.in(p), out = d.out(p);
    auto xv = lkv::mat<const T>(x, n_, in, in);
    auto yv = lkv::mat<T>(y, n_, out, out);
    if (!mod.adapted(p)) return kvevict::linear_forward(kvevict::seq, xv, fm.weight(l, p), yv);
    return kvevict::lora_linear_forward(kvevict::seq, xv, fm.weight(l, p), mod.adapter(l, p), kvevict::row_range{0, n_},
                                        lkv::mat<T>(xa(l, p), n_, r_, r_), yv);
  }

  // dx (=|+=) dL/dx of y = LoRA_p(x) given dy; the adapter's dA, dB are added into grad
  status project_back(const frozen_model<T>& fm, const basic_lookahead_module<T>& mod, int l, projection p, const T* x,
                      const T* dy, T* dx, bool accumulate, T* grad) {
    const lookahead_dims& d = mod.dims();
    const index_t in = d.in(p), out = d.out(p);
    if (!mod.adapted(p)) {
      lkv::linear_backward_input(fm.weight_t(l, p), dy, n_, dx, accumulate);
      return {};
    }
    auto xv = lkv::mat<const T>(x, n_, in, in);
    auto dyv = lkv::mat<const T>(dy, n_, out, out);
    auto xav = lkv::mat<const T>(xa(l, p), n_, r_, r_);
    auto dxv = lkv::mat<T>(dx, n_, in, in);
    kvevict::lora_backward_options o;
    o.accumulate_dx = accumulate;
    return with_workspace(ws_, [&](kvevict::workspace& ws) {
      return kvevict::lora_linear_backward(kvevict::seq, ws, xv, fm.weight_t(l, p), mod.adapter(l, p),
                                           kvevict::row_range{0, n_}, xav, dyv, mod.grad_views(l, p, grad), dxv, o);
    });
  }
};

// ---------------------------------------------------------------------------------------------
// Training (Adam, cosine schedule, gradient clipping, batches over OpenMP threads)

/// Optimisation settings. Defaults: LookaheadKV's Table 16 where it applies at this scale (Adam,
/// cosine schedule to 0, 2 % warmup, global-norm clipping 1.0) with a batch of 16 (the paper: 32),
/// 800 steps (the paper: 7600) and lr 1e-2 (the paper's Llama rate is 1e-3; on stories260K the
/// validation loss improves up to 2e-2 and training diverges at 4e-2: docs/lookaheadkv.md has the
/// sweep). beta2 = 0.999 (PyTorch's default, as asked; Table 16 uses 0.95).
struct train_options {
  index_t steps = 800;
  index_t batch = 16;
  double lr = 1e-2;
  double warmup = 0.02;  ///< fraction of the steps with a linear warmup
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double clip = 1.0;     ///< global gradient-norm clipping (0: off)
  std::uint64_t seed = 1;  ///< module initialisation and the order of the samples
  int threads = 0;       ///< OpenMP threads over the samples of a batch (0: all)
  index_t log_every = 50;
  index_t validate_every = 200;  ///< validation loss every N steps and at the end (0: only at the end)
};

/// What the trainer reports.
struct train_progress {
  index_t step = 0, steps = 0;
  double lr = 0;
  double train_loss = 0;  ///< mean loss of the samples since the last report
  double val_loss = std::numeric_limits<double>::quiet_NaN();  ///< NaN when not computed at this step
  double seconds = 0;
};

/// Learning rate of step t (0-based): linear warmup over ceil(warmup * steps) steps, then cosine
/// decay to 0 at the last step.
inline double lr_at(const train_options& o, index_t t) {
  const auto warm = static_cast<index_t>(std::ceil(o.warmup * static_cast<double>(o.steps)));
  if (t < warm) return o.lr * static_cast<double>(t + 1) / static_cast<double>(warm);
  const double span = static_cast<double>(std::max<index_t>(1, o.steps - warm));
  return o.lr * 0.5 * (1.0 + std::cos(3.141592653589793 * static_cast<double>(t - warm) / span));
}

/// Mean loss over samples (forward only), on `threads` threads. Errors: the backprop's.
inline status mean_loss(const frozen_model<float>& fm, const lookahead_module& mod,
                        const std::vector<lookahead_sample>& samples, int threads, double& mean) {
  if (samples.empty()) return mean = std::numeric_limits<double>::quiet_NaN(), status{};
  index_t maxP = 1;
  for (const auto& s : samples) maxP = std::max(maxP, s.P);
  std::vector<double> losses(samples.size(), 0.0);
  std::vector<status> errors(samples.size());
  std::vector<lookahead_backprop<float>> workers(static_cast<std::size_t>(thread_count(threads)));
  for (auto& w : workers) KVEVICT_TRY(w.init(fm, mod, maxP));
  KVEVICT_TRY(for_each_item(workers, static_cast<index_t>(samples.size()), [&](lookahead_backprop<float>& w, index_t i) {
    const auto k = static_cast<std::size_t>(i);
    errors[k] = w.loss_and_grad(fm, mod, samples[k], &losses[k], nullptr);
    return status{};  // every sample runs; the first failure in sample order is returned below
  }));
  double sum = 0;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    KVEVICT_TRY(errors[i]);
    sum += losses[i];
  }
  mean = sum / static_cast<double>(samples.size());
  return {};
}

/// Trains `mod` (already initialised, e.g. by basic_lookahead_module::init) on `train` with Adam.
/// Each step takes the next `batch` samples of a seeded permutation of the training set (a new
/// permutation per epoch), computes every sample's loss and gradient in parallel into its own
/// buffer, sums the buffers in sample order (so the result does not depend on the thread count:
/// the same seed gives the same module bits), clips the global norm and takes an Adam step.
/// `log` is called every log_every steps and after validations. Errors: invalid options, empty
/// training set, the backprop's.
inline status train_module(const frozen_model<float>& fm, const std::vector<lookahead_sample>& train,
                           const std::vector<lookahead_sample>& validation, const train_options& o,
                           lookahead_module& mod, const std::function<void(const train_progress&)>& log = {}) {
  if (train.empty()) return status::error(errc::invalid_argument, "train: no training samples");
  if (o.steps < 0 || o.batch < 1 || !(o.lr >= 0) || !(o.warmup >= 0 && o.warmup <= 1) || !(o.beta1 >= 0 && o.beta1 < 1) ||
      !(o.beta2 >= 0 && o.beta2 < 1) || !(o.eps > 0) || !(o.clip >= 0) || o.log_every < 1 || o.validate_every < 0)
    return status::error(errc::invalid_argument,
                         "train: invalid options (steps %lld, batch %lld, lr %g, warmup %g, betas %g %g, eps %g, clip %g)",
                         static_cast<long long>(o.steps), static_cast<long long>(o.batch), o.lr, o.warmup, o.beta1,
                         o.beta2, o.eps, o.clip);
  KVEVICT_TRY(mod.check_model(fm.cfg));
  index_t maxP = 1;
  for (const auto& s : train) maxP = std::max(maxP, s.P);
  const int nt = thread_count(o.threads);
  const auto np = static_cast<std::size_t>(mod.param_count());
  const auto B = static_cast<std::size_t>(o.batch);
  std::vector<float> grads(B * np, 0.0f), m1(np, 0.0f), m2(np, 0.0f);
  std::vector<double> g(np, 0.0), losses(B, 0.0);
  std::vector<status> errors(B);
  std::vector<lookahead_backprop<float>> workers(static_cast<std::size_t>(nt));
  for (auto& w : workers) KVEVICT_TRY(w.init(fm, mod, maxP));

  // sample order: a Fisher-Yates permutation per epoch from the seed (portable, unlike std::shuffle)
  detail::splitmix64 order_rng{detail::derive_seed(o.seed, 0x0bde)};
  std::vector<std::size_t> order(train.size());
  std::size_t cursor = order.size();
  auto next_sample = [&]() {
    if (cursor == order.size()) {
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      for (std::size_t i = order.size() - 1; i > 0; --i)
        std::swap(order[i], order[static_cast<std::size_t>(order_rng.next() % (i + 1))]);
      cursor = 0;
    }
    return order[cursor++];
  };

  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  double loss_sum = 0;
  index_t loss_count = 0;
  std::vector<std::size_t> batch(B);
  for (index_t step = 0; step < o.steps; ++step) {
    for (auto& b : batch) b = next_sample();
    KVEVICT_TRY(for_each_item(workers, static_cast<index_t>(B), [&](lookahead_backprop<float>& w, index_t i) {
      const auto b = static_cast<std::size_t>(i);
      float* gb = grads.data() + b * np;
      std::fill(gb, gb + np, 0.0f);
      errors[b] = w.loss_and_grad(fm, mod, train[batch[b]], &losses[b], gb);
      return status{};  // every sample runs; failures are reported below, in sample order
    }));
    for (std::size_t b = 0; b < B; ++b) {
      if (!errors[b].ok() && step > 0)  // non-finite activations after an update: the run diverged
        return status::error(errors[b].code(), "train: step %lld failed (training diverged? lower the learning rate %g): %s",
                             static_cast<long long>(step + 1), o.lr, errors[b].message());
      KVEVICT_TRY(errors[b]);
      loss_sum += losses[b];
      ++loss_count;
    }
    // mean gradient over the batch, in sample order, then the global norm
    double norm2 = 0;
    for (std::size_t i = 0; i < np; ++i) {
      double acc = 0;
      for (std::size_t b = 0; b < B; ++b) acc += grads[b * np + i];
      g[i] = acc / static_cast<double>(B);
      norm2 += g[i] * g[i];
    }
    const double norm = std::sqrt(norm2);
    if (!std::isfinite(norm))
      return status::error(errc::invalid_argument,
                           "train: the gradient at step %lld is not finite (training diverged; lower the learning rate %g)",
                           static_cast<long long>(step + 1), o.lr);
    const double clip_scale = o.clip > 0 && norm > o.clip ? o.clip / norm : 1.0;
    const double lr = lr_at(o, step);
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step + 1));
    const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step + 1));
    std::vector<float>& p = mod.params();
    for (std::size_t i = 0; i < np; ++i) {
      const double gi = g[i] * clip_scale;
      const double a = o.beta1 * m1[i] + (1 - o.beta1) * gi;
      const double v = o.beta2 * m2[i] + (1 - o.beta2) * gi * gi;
      m1[i] = static_cast<float>(a);
      m2[i] = static_cast<float>(v);
      p[i] = static_cast<float>(p[i] - lr * (a / bc1) / (std::sqrt(v / bc2) + o.eps));
    }
    const bool report = (step + 1) % o.log_every == 0 || step + 1 == o.steps;
    const bool validate =
        !validation.empty() && ((o.validate_every > 0 && (step + 1) % o.validate_every == 0) || step + 1 == o.steps);
    if (report || validate) {
      train_progress pr;
      pr.step = step + 1;
      pr.steps = o.steps;
      pr.lr = lr;
      pr.train_loss = loss_count > 0 ? loss_sum / static_cast<double>(loss_count) : 0.0;
      if (validate) KVEVICT_TRY(mean_loss(fm, mod, validation, nt, pr.val_loss));
      pr.seconds = seconds();
      loss_sum = 0;
      loss_count = 0;
      if (log) log(pr);
    }
  }
  return {};
}

}  // namespace kvrun
