// runner/model.hpp: a LLaMA-architecture model read from a llama2.c checkpoint.
//
// Checkpoint format (llama2.c, native little-endian):
//   7 x int32   dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
//               (vocab_size < 0: the classifier is not shared with the token embedding)
//   float32     token embedding [vocab][dim]
//               attention RMSNorm [layer][dim]
//               wq [layer][dim][dim], wk [layer][kv_dim][dim], wv [layer][kv_dim][dim],
//               wo [layer][dim][dim]                     (each matrix [out][in], row-major)
//               FFN RMSNorm [layer][dim]
//               w1 [layer][hidden][dim], w2 [layer][dim][hidden], w3 [layer][hidden][dim]
//               final RMSNorm [dim]
//               two RoPE tables [seq_len][head_size / 2] (ignored, as run.c ignores them)
//               classifier [vocab][dim]                  (only when vocab_size < 0)
//
// The header is validated and the exact file size it implies is compared with the real size
// before anything is allocated, so a lying header is an error, never a huge allocation.
#pragma once

#include "io.hpp"

#include <runner/ops.hpp>

#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvrun {

using kvevict::errc;
using kvevict::index_t;
using kvevict::pos_t;
using kvevict::status;

/// Model hyper-parameters, as in the checkpoint header.
struct config {
  int dim = 0;         ///< residual stream width
  int hidden_dim = 0;  ///< FFN width
  int n_layers = 0;
  int n_heads = 0;     ///< query heads
  int n_kv_heads = 0;  ///< key/value heads (GQA: n_heads is a multiple)
  int vocab_size = 0;  ///< always positive here; `shared_classifier` keeps the header's sign
  int seq_len = 0;     ///< context length: positions are in [0, seq_len)
  bool shared_classifier = true;

  int head_size() const { return dim / n_heads; }
  int kv_dim() const { return head_size() * n_kv_heads; }
  /// Query heads per KV head: query head q reads KV head q / group_size().
  int group_size() const { return n_heads / n_kv_heads; }
};

/// Bytes in a checkpoint header.
inline constexpr std::size_t checkpoint_header_bytes = 7 * sizeof(std::int32_t);

namespace detail {

inline status check_positive(const char* name, std::int32_t v) {
  if (v <= 0) return status::error(errc::format_error, "checkpoint: %s must be positive (got %d)", name, v);
  return {};
}

/// Decodes and validates a header (everything but the file size).
inline status parse_header(const unsigned char* bytes, config& c) {
  std::int32_t h[7];
  std::memcpy(h, bytes, sizeof h);
  KVEVICT_TRY(check_positive("dim", h[0]));
  KVEVICT_TRY(check_positive("hidden_dim", h[1]));
  KVEVICT_TRY(check_positive("n_layers", h[2]));
  KVEVICT_TRY(check_positive("n_heads", h[3]));
  KVEVICT_TRY(check_positive("n_kv_heads", h[4]));
  if (h[5] == 0 || h[5] == INT32_MIN)
    return status::error(errc::format_error, "checkpoint: vocab_size %d is invalid (nonzero, negative = unshared classifier)",
                         h[5]);
  KVEVICT_TRY(check_positive("seq_len", h[6]));
  if (h[0] % h[3] != 0)
    return status::error(errc::format_error, "checkpoint: dim (%d) is not divisible by n_heads (%d)", h[0], h[3]);
  if (h[3] % h[4] != 0)
    return status::error(errc::format_error, "checkpoint: n_heads (%d) is not a multiple of n_kv_heads (%d)", h[3],
                         h[4]);
  if ((h[0] / h[3]) % 2 != 0)
    return status::error(errc::format_error, "checkpoint: head size %d (dim %d / n_heads %d) is odd; RoPE rotates pairs",
                         h[0] / h[3], h[0], h[3]);
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.vocab_size = h[5] > 0 ? h[5] : -h[5];
  c.shared_classifier = h[5] > 0;
  c.seq_len = h[6];
  return {};
}

/// Number of floats after the header that a valid checkpoint with config `c` holds; false if it
/// does not fit in 63 bits.
inline bool checkpoint_floats(const config& c, index_t& total) {
  const index_t L = c.n_layers, d = c.dim, h = c.hidden_dim, v = c.vocab_size, kv = c.kv_dim();
  index_t t = 0, a = 0;
  auto add = [&](index_t x) { return checked_add(t, x, t); };
  auto mul3 = [&](index_t x, index_t y, index_t z) { return checked_mul(x, y, a) && checked_mul(a, z, a); };
  bool ok = checked_mul(v, d, a) && add(a);                                   // embedding
  ok = ok && checked_mul(L, d, a) && add(a) && add(a);                         // both RMSNorms
  ok = ok && mul3(L, d, d) && add(a) && add(a);                                // wq, wo
  ok = ok && mul3(L, d, kv) && add(a) && add(a);                               // wk, wv
  ok = ok && mul3(L, d, h) && add(a) && add(a) && add(a);                      // w1, w2, w3
  ok = ok && add(d);                                                           // final RMSNorm
  ok = ok && checked_mul(c.seq_len, c.head_size(), a) && add(a);               // 2 RoPE tables
  if (!c.shared_classifier) ok = ok && checked_mul(v, d, a) && add(a);         // classifier
  total = t;
  return ok;
}

inline status size_mismatch(const config& c, index_t needed, index_t have) {
  return status::error(errc::format_error,
                       "checkpoint: header (dim %d, hidden %d, %d layers, %d/%d heads, vocab %d, seq_len %d) needs "
                       "%lld bytes but the input has %lld (%s %lld bytes)",
                       c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len,
                       static_cast<long long>(needed), static_cast<long long>(have),
                       have < needed ? "truncated by" : "trailing", static_cast<long long>(have < needed ? needed - have : have - needed));
}

/// Header + size checks shared by both entry points: on success `c` is valid and `size` is exact.
inline status check_checkpoint(const unsigned char* header, index_t size, config& c) {
  if (size < static_cast<index_t>(checkpoint_header_bytes))
    return status::error(errc::format_error, "checkpoint: %lld bytes is shorter than the %zu-byte header",
                         static_cast<long long>(size), checkpoint_header_bytes);
  KVEVICT_TRY(parse_header(header, c));
  index_t floats = 0, bytes = 0;
  if (!checkpoint_floats(c, floats) || !detail::checked_mul(floats, index_t(sizeof(float)), bytes) ||
      !detail::checked_add(bytes, index_t(checkpoint_header_bytes), bytes))
    return status::error(errc::format_error, "checkpoint: header sizes overflow 64 bits (dim %d, hidden %d, %d layers, vocab %d, seq_len %d)",
                         c.dim, c.hidden_dim, c.n_layers, c.vocab_size, c.seq_len);
  if (bytes != size) return size_mismatch(c, bytes, size);
  return {};
}

}  // namespace detail

/// A loaded model: the configuration and its weights, stored for the runner's kernels (every
/// matrix transposed to [in][out]; wq|wk|wv fused into one [dim][dim + 2 kv_dim] matrix and
/// w1|w3 into one [dim][2 hidden] matrix), plus RoPE cos/sin tables. Copyable, immutable once
/// loaded; one model may serve any number of runners.
class model {
 public:
  const config& cfg() const { return cfg_; }

  /// Token embedding row of `token` (dim floats).
  const float* embedding(int token) const { return store_.data() + static_cast<index_t>(token) * cfg_.dim; }
  const float* final_norm() const { return store_.data() + final_norm_off(); }
  /// Classifier, transposed: [dim][vocab].
  const float* classifier() const { return store_.data() + classifier_off(); }

  const float* attn_norm(int l) const { return layer(l); }
  /// [dim][qkv_width()]: columns [0, dim) are wq, then wk, then wv (kv_dim each).
  const float* wqkv(int l) const { return layer(l) + cfg_.dim; }
  index_t qkv_width() const { return index_t(cfg_.dim) + 2 * index_t(cfg_.kv_dim()); }
  /// [dim][dim]
  const float* wo(int l) const { return wqkv(l) + index_t(cfg_.dim) * qkv_width(); }
  const float* ffn_norm(int l) const { return wo(l) + index_t(cfg_.dim) * cfg_.dim; }
  /// [dim][2 hidden]: columns [0, hidden) are w1 (gate), then w3 (up).
  const float* w13(int l) const { return ffn_norm(l) + cfg_.dim; }
  /// [hidden][dim]
  const float* w2(int l) const { return w13(l) + index_t(cfg_.dim) * 2 * cfg_.hidden_dim; }

  /// RoPE for position p, pair i (dimensions 2i, 2i+1 of every head), i < head_size / 2.
  float rope_cos(pos_t p, int i) const { return rope_cos_[static_cast<std::size_t>(index_t(p) * (cfg_.head_size() / 2) + i)]; }
  float rope_sin(pos_t p, int i) const { return rope_sin_[static_cast<std::size_t>(index_t(p) * (cfg_.head_size() / 2) + i)]; }

  /// The model made of this one's first `layers` layers, its final RMSNorm and its classifier
  /// (SpecKV's draft model, speckv.hpp: the layers are stored last, so this is a prefix copy).
  /// Error: layers outside [1, n_layers].
  status first_layers(int layers, model& out) const {
    if (layers < 1 || layers > cfg_.n_layers)
      return status::error(errc::invalid_argument, "model: %d first layers of a %d-layer model", layers, cfg_.n_layers);
    model m = *this;
    m.cfg_.n_layers = layers;
    m.store_.resize(static_cast<std::size_t>(m.layers_off() + index_t(layers) * m.layer_floats()));
    out = std::move(m);
    return {};
  }

  /// Loads a checkpoint held in memory (`size` bytes at `data`). On failure `out` is unchanged.
  /// Errors (format_error): input shorter than the header; non-positive dim, hidden_dim,
  /// n_layers, n_heads, n_kv_heads or seq_len; vocab_size 0 or INT32_MIN; dim not divisible by
  /// n_heads; n_heads not a multiple of n_kv_heads; odd head size; sizes overflowing 64 bits;
  /// size different from what the header implies (truncated or trailing bytes).
  static status load(const void* data, std::size_t size, model& out) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    if (size > static_cast<std::size_t>(INT64_MAX))
      return status::error(errc::size_overflow, "checkpoint: input of %zu bytes is too large", size);
    config c;
    KVEVICT_TRY(detail::check_checkpoint(bytes, static_cast<index_t>(size), c));
    model m;
    m.read_weights(c, bytes + checkpoint_header_bytes);
    out = std::move(m);
    return {};
  }

  /// Loads a checkpoint file: the whole file read (programs/io.hpp: a regular file of at most
  /// io::limit::model_bytes; FIFOs and devices are refused, never read), then load().
  /// Errors: io_error (cannot open or read) and every error of load().
  static status load_file(const std::string& path, model& out) {
    std::vector<unsigned char> bytes;
    KVEVICT_TRY(kvevict::io::read_file(path, "checkpoint", kvevict::io::limit::model_bytes, bytes));
    return load(bytes.data(), bytes.size(), out);
  }

 private:
  config cfg_;
  std::vector<float> store_;  // embedding, final norm, classifier^T, then one block per layer
  std::vector<float> rope_cos_, rope_sin_;

  index_t layer_floats() const {
    const index_t d = cfg_.dim, h = cfg_.hidden_dim;
    return d + d * qkv_width() + d * d + d + d * 2 * h + h * d;
  }
  index_t final_norm_off() const { return index_t(cfg_.vocab_size) * cfg_.dim; }
  index_t classifier_off() const { return final_norm_off() + cfg_.dim; }
  index_t layers_off() const { return classifier_off() + index_t(cfg_.dim) * cfg_.vocab_size; }
  const float* layer(int l) const { return store_.data() + layers_off() + index_t(l) * layer_floats(); }
  float* mut(const float* p) { return store_.data() + (p - store_.data()); }

  // Copies the weights at `src` out of llama2.c's order into this model's layout. The input size has
  // been checked against the header, so every read is in bounds.
  void read_weights(const config& c, const unsigned char* src) {
    cfg_ = c;
    const index_t d = c.dim, h = c.hidden_dim, v = c.vocab_size, kv = c.kv_dim(), L = c.n_layers;
    store_.assign(static_cast<std::size_t>(layers_off() + L * layer_floats()), 0.0f);
    std::vector<float> tmp(static_cast<std::size_t>(std::max({d * d, d * h, v * d})));
    auto read = [&](float* dst, index_t n) {
      std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
      src += n * static_cast<index_t>(sizeof(float));
    };

    // [out][in] from the file -> column block [col0, col0 + out) of a [in][width] matrix
    auto transpose_into = [&](float* dst, index_t width, index_t col0, index_t out, index_t in) {
      read(tmp.data(), out * in);
      for (index_t o = 0; o < out; ++o)
        for (index_t i = 0; i < in; ++i) dst[i * width + col0 + o] = tmp[static_cast<std::size_t>(o * in + i)];
    };
    read(store_.data(), v * d);  // embedding
    for (int l = 0; l < L; ++l) read(mut(attn_norm(l)), d);
    for (int l = 0; l < L; ++l) transpose_into(mut(wqkv(l)), qkv_width(), 0, d, d);
    for (int l = 0; l < L; ++l) transpose_into(mut(wqkv(l)), qkv_width(), d, kv, d);
    for (int l = 0; l < L; ++l) transpose_into(mut(wqkv(l)), qkv_width(), d + kv, kv, d);
    for (int l = 0; l < L; ++l) transpose_into(mut(wo(l)), d, 0, d, d);
    for (int l = 0; l < L; ++l) read(mut(ffn_norm(l)), d);
    for (int l = 0; l < L; ++l) transpose_into(mut(w13(l)), 2 * h, 0, h, d);
    for (int l = 0; l < L; ++l) transpose_into(mut(w2(l)), d, 0, d, h);
    for (int l = 0; l < L; ++l) transpose_into(mut(w13(l)), 2 * h, h, h, d);
    read(mut(final_norm()), d);
    src += index_t(c.seq_len) * c.head_size() * static_cast<index_t>(sizeof(float));  // the two legacy RoPE tables
    float* cls = mut(classifier());
    if (c.shared_classifier) {
      for (index_t o = 0; o < v; ++o)
        for (index_t i = 0; i < d; ++i) cls[i * v + o] = store_[static_cast<std::size_t>(o * d + i)];
    } else {
      transpose_into(cls, v, 0, v, d);
    }

    // RoPE exactly as run.c computes it: freq = 1 / 10000^(2i / head_size), angle = pos * freq
    const int half = c.head_size() / 2;
    rope_cos_.assign(static_cast<std::size_t>(index_t(c.seq_len) * half), 0.0f);
    rope_sin_.assign(rope_cos_.size(), 0.0f);
    for (index_t p = 0; p < c.seq_len; ++p)
      for (int i = 0; i < half; ++i) {
        const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(c.head_size()));
        const float angle = static_cast<float>(p) * freq;
        rope_cos_[static_cast<std::size_t>(p * half + i)] = std::cos(angle);
        rope_sin_[static_cast<std::size_t>(p * half + i)] = std::sin(angle);
      }
  }
};

}  // namespace kvrun
