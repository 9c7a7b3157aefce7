// lookaheadkv/module.hpp: the trainable part of LookaheadKV for a runner model, and its file.
//
//   lookahead_module m;
//   m.init(model, {.n_lookahead = 16, .rank = 8, .alpha = 32, .placement = lora_all}, seed);
//   save_module(m, "stories260K-n16.bin");  load_module("stories260K-n16.bin", m);
//   m.check_model(model.cfg());     // "lookahead module was trained for dim 288 but the model has dim 64"
//
// A module holds `n_lookahead` soft token embeddings (appended after the prompt) and, for every
// layer and every linear layer named in `placement`, a Lookahead LoRA adapter A [in][r], B [r][out]
// (kvevict/train/lookahead.hpp's convention: delta(x) = (alpha / r) (x A) B, active on the lookahead rows
// only). All parameters live in one flat vector (embeddings first, then layer by layer, target by
// target in the order q, k, v, o, w1, w2, w3, A then B), which is what the optimizer updates and
// what the file stores. `basic_lookahead_module<double>` exists for the finite-difference tests.
//
// File format (little-endian, docs/lookaheadkv.md):
//   0   8 bytes  magic "KVLOOKAH"
//   8   uint32   version (1)
//   12  6 int32  dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size of the model it was trained for
//   36  int32    n_lookahead
//   40  int32    rank
//   44  float32  alpha
//   48  uint32   placement bits (1 q, 2 k, 4 v, 8 o, 16 w1, 32 w2, 64 w3)
//   52  float32  the flat parameter vector (embeddings [n][dim]; per layer and adapted target A, B)
// The size must be exactly 52 + 4 x (parameter count); every value must be finite.
#pragma once

#include "io.hpp"

#include <runner/model.hpp>
#include <runner/runner.hpp>

#include <kvevict/train/lookahead.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace kvrun {

/// Bits of `lookahead_config::placement`: which linear layers get a Lookahead LoRA adapter.
inline constexpr unsigned lora_bit(projection p) { return 1u << static_cast<unsigned>(p); }
inline constexpr unsigned lora_none = 0;                                                  ///< embeddings only
inline constexpr unsigned lora_qv = lora_bit(projection::q) | lora_bit(projection::v);    ///< q and v
inline constexpr unsigned lora_all = 0x7Fu;                                               ///< q, k, v, o, w1, w2, w3
inline constexpr int lora_targets = 7;
inline constexpr projection lora_order[lora_targets] = {projection::q,  projection::k,  projection::v, projection::o,
                                                        projection::w1, projection::w2, projection::w3};

inline const char* projection_name(projection p) {
  switch (p) {
    case projection::q: return "q";
    case projection::k: return "k";
    case projection::v: return "v";
    case projection::o: return "o";
    case projection::w1: return "w1";
    case projection::w2: return "w2";
    case projection::w3: return "w3";
  }
  return "?";
}

/// "all", "qv", "emb" or a '+'-separated list such as "q+k+v".
inline std::string placement_name(unsigned bits) {
  if (bits == lora_all) return "all";
  if (bits == lora_qv) return "qv";
  if (bits == lora_none) return "emb";
  std::string s;
  for (projection p : lora_order)
    if (bits & lora_bit(p)) s += (s.empty() ? "" : "+") + std::string(projection_name(p));
  return s;
}

/// Parses placement_name's output. Errors: invalid_argument naming the bad part.
inline status parse_placement(const std::string& text, unsigned& bits) {
  if (text == "all") return bits = lora_all, status{};
  if (text == "qv") return bits = lora_qv, status{};
  if (text == "emb" || text == "none") return bits = lora_none, status{};
  unsigned b = 0;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find('+', start), text.size());
    const std::string part = text.substr(start, end - start);
    bool found = false;
    for (projection p : lora_order)
      if (part == projection_name(p)) b |= lora_bit(p), found = true;
    if (!found)
      return status::error(errc::invalid_argument,
                           "placement '%s': '%s' is not one of all, qv, emb or a '+' list of q, k, v, o, w1, w2, w3",
                           text.c_str(), part.c_str());
    start = end + 1;
  }
  bits = b;
  return {};
}

/// The model dimensions a module is made for (the six the file records).
struct lookahead_dims {
  int dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, hidden_dim = 0, vocab_size = 0;
  static lookahead_dims of(const config& c) {
    return {c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim, c.vocab_size};
  }
  int head_size() const { return dim / n_heads; }
  int kv_dim() const { return head_size() * n_kv_heads; }
  /// In and out features of linear layer p.
  index_t in(projection p) const { return p == projection::w2 ? hidden_dim : dim; }
  index_t out(projection p) const {
    switch (p) {
      case projection::k:
      case projection::v: return kv_dim();
      case projection::w1:
      case projection::w3: return hidden_dim;
      default: return dim;
    }
  }
};

/// Hyper-parameters of a module. Defaults: LookaheadKV's recipe (§4.1 / Table 16: rank 8,
/// alpha 32, every linear layer) with 16 lookahead tokens (the paper uses 32 for contexts up to
/// 16K tokens; see docs/lookaheadkv.md for the ablation on this model).
struct lookahead_config {
  index_t n_lookahead = 16;
  index_t rank = kvevict::lora_default_rank;
  float alpha = static_cast<float>(kvevict::lora_default_alpha);
  unsigned placement = lora_all;
};

namespace detail {

/// SplitMix64 (Steele, Lea, Flood 2014): the portable generator behind every seeded choice here.
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1) with 53 bits.
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  /// Uniform integer in [lo, hi] (hi - lo < 2^32; the modulo bias is below 2^-32).
  std::int64_t between(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  /// Standard normal (Box-Muller, the cosine branch).
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

/// A seed for item `i` of a family derived from `seed` (independent streams per item).
inline std::uint64_t derive_seed(std::uint64_t seed, std::uint64_t i) {
  splitmix64 g{seed ^ (0xD1B54A32D192ED03ull * (i + 1))};
  return g.next();
}

inline void put_u32(std::vector<unsigned char>& b, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<unsigned char>(v >> (8 * i)));
}
inline std::uint32_t get_u32(const unsigned char* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24;
}
inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace detail

inline constexpr char lookahead_magic[8] = {'K', 'V', 'L', 'O', 'O', 'K', 'A', 'H'};
inline constexpr std::uint32_t lookahead_version = 1;
inline constexpr std::size_t lookahead_header_bytes = 52;

/// Lookahead embeddings + Lookahead LoRA adapters, parameters in one flat vector of T.
template <class T>
class basic_lookahead_module {
 public:
  static constexpr int max_layers = 1 << 16;

  /// Shapes only, every parameter 0. Errors (invalid_argument): n_lookahead or rank < 1,
  /// non-finite alpha, unknown placement bits, dims that are not a valid model, more than
  /// max_layers layers.
  status shape(const lookahead_dims& d, const lookahead_config& c) {
    KVEVICT_TRY(check_shape(d, c));
    index_t count = 0;  // before allocating: dims from a file may be absurd
    if (!count_params(d, c, count))
      return status::error(errc::invalid_argument, "lookahead module: dims (dim %d, %d layers, hidden %d, vocab %d) "
                           "give more parameters than fit in 64 bits", d.dim, d.n_layers, d.hidden_dim, d.vocab_size);
    dims_ = d;
    cfg_ = c;
    index_t off = c.n_lookahead * d.dim;
    offsets_.assign(static_cast<std::size_t>(d.n_layers) * lora_targets, -1);
    for (int l = 0; l < d.n_layers; ++l)
      for (projection p : lora_order) {
        if (!adapted(p)) continue;
        offsets_[slot(l, p)] = off;
        off += c.rank * (d.in(p) + d.out(p));
      }
    params_.assign(static_cast<std::size_t>(off), T(0));
    return {};
  }

  /// shape()'s checks of the dims and the config, allocating nothing.
  static status check_shape(const lookahead_dims& d, const lookahead_config& c) {
    if (d.dim < 1 || d.n_layers < 1 || d.n_heads < 1 || d.n_kv_heads < 1 || d.hidden_dim < 1 || d.vocab_size < 1 ||
        d.dim % d.n_heads != 0 || d.n_heads % d.n_kv_heads != 0)
      return status::error(errc::invalid_argument,
                           "lookahead module: invalid model dims (dim %d, %d layers, %d/%d heads, hidden %d, vocab %d)",
                           d.dim, d.n_layers, d.n_heads, d.n_kv_heads, d.hidden_dim, d.vocab_size);
    // shape() keeps a per-layer offset table whatever the placement: with no adapted projection a
    // tiny file could otherwise declare 2^31 layers and cost gigabytes of table
    if (d.n_layers > max_layers)
      return status::error(errc::invalid_argument, "lookahead module: %d layers is more than the %d supported", d.n_layers,
                           max_layers);
    if (c.n_lookahead < 1 || c.n_lookahead > (1 << 20))
      return status::error(errc::invalid_argument, "lookahead module: n_lookahead %lld is outside [1, 2^20]",
                           static_cast<long long>(c.n_lookahead));
    if (c.rank < 1 || c.rank > (1 << 16))
      return status::error(errc::invalid_argument, "lookahead module: rank %lld is outside [1, 2^16]",
                           static_cast<long long>(c.rank));
    if (!std::isfinite(c.alpha))
      return status::error(errc::invalid_argument, "lookahead module: alpha is not finite (%g)", static_cast<double>(c.alpha));
    if ((c.placement & ~lora_all) != 0)
      return status::error(errc::invalid_argument, "lookahead module: unknown placement bits 0x%x", c.placement);
    return {};
  }

  /// The number of parameters shape(d, c) allocates, computed without allocating and without
  /// overflow (false if it does not fit in 64 bits). shape()'s other checks are not repeated.
  static bool count_params(const lookahead_dims& d, const lookahead_config& c, index_t& count) {
    const auto checked_mul = [](index_t a, index_t b, index_t& r) { return !__builtin_mul_overflow(a, b, &r); };
    index_t per_layer = 0, t = 0;
    for (projection p : lora_order)
      if ((c.placement & lora_bit(p)) != 0) {
        if (!checked_mul(index_t(c.rank), d.in(p) + d.out(p), t) || t > INT64_MAX - per_layer) return false;
        per_layer += t;
      }
    index_t layers = 0, head = 0;
    if (!checked_mul(index_t(d.n_layers), per_layer, layers) || !checked_mul(index_t(c.n_lookahead), index_t(d.dim), head) ||
        layers > INT64_MAX - head)
      return false;
    count = head + layers;
    return true;
  }

  /// Shapes for model config `mc` and the paper's initialisation, deterministic in `seed`:
  /// embeddings drawn per coordinate from N(mean, std) of the model's token embeddings (new
  /// vocabulary rows initialised like the existing ones, as Hugging Face's mean-resizing does);
  /// A uniform in +-1/sqrt(in) from kvevict::lora_layer::init (PEFT / nn.Linear init) and B = 0,
  /// so the adapters start as the identity. Errors: those of shape().
  status init(const model& m, const lookahead_config& c, std::uint64_t seed) {
    KVEVICT_TRY(shape(lookahead_dims::of(m.cfg()), c));
    const index_t d = dims_.dim, V = dims_.vocab_size;
    std::vector<double> mean(static_cast<std::size_t>(d), 0.0), var(static_cast<std::size_t>(d), 0.0);
    for (index_t t = 0; t < V; ++t)
      for (index_t j = 0; j < d; ++j) mean[static_cast<std::size_t>(j)] += m.embedding(static_cast<int>(t))[j];
    for (double& x : mean) x /= static_cast<double>(V);
    for (index_t t = 0; t < V; ++t)
      for (index_t j = 0; j < d; ++j) {
        const double e = m.embedding(static_cast<int>(t))[j] - mean[static_cast<std::size_t>(j)];
        var[static_cast<std::size_t>(j)] += e * e;
      }
    detail::splitmix64 g{detail::derive_seed(seed, 0)};
    for (index_t i = 0; i < c.n_lookahead; ++i)
      for (index_t j = 0; j < d; ++j)
        params_[static_cast<std::size_t>(i * d + j)] =
            static_cast<T>(mean[static_cast<std::size_t>(j)] +
                           std::sqrt(var[static_cast<std::size_t>(j)] / static_cast<double>(V)) * g.normal());
    for (int l = 0; l < dims_.n_layers; ++l)
      for (projection p : lora_order) {
        if (!adapted(p)) continue;
        kvevict::lora_layer<T> init_layer;
        KVEVICT_TRY(init_layer.init(dims_.in(p), dims_.out(p), c.rank, static_cast<T>(c.alpha), 0,
                                    detail::derive_seed(seed, 1 + static_cast<std::uint64_t>(slot(l, p)))));
        const auto a = init_layer.a();
        T* dst = params_.data() + offsets_[slot(l, p)];
        for (index_t i = 0; i < a.extent(0); ++i)
          for (index_t k = 0; k < a.extent(1); ++k) dst[i * c.rank + k] = a(i, k);
      }
    return {};
  }

  const lookahead_dims& dims() const { return dims_; }
  const lookahead_config& hparams() const { return cfg_; }
  index_t n_lookahead() const { return cfg_.n_lookahead; }
  index_t rank() const { return cfg_.rank; }
  float alpha() const { return cfg_.alpha; }
  unsigned placement() const { return cfg_.placement; }
  bool adapted(projection p) const { return (cfg_.placement & lora_bit(p)) != 0; }
  index_t param_count() const { return static_cast<index_t>(params_.size()); }

  /// The flat parameters (the optimizer updates them in place).
  std::vector<T>& params() { return params_; }
  const std::vector<T>& params() const { return params_; }
  /// Lookahead embeddings, [n_lookahead][dim] row-major.
  const T* embeddings() const { return params_.data(); }
  /// Offset of layer l's adapter of p in the flat vector (A [in][r] then B [r][out]); -1 if p is
  /// not adapted.
  index_t offset(int l, projection p) const { return offsets_[slot(l, p)]; }

  /// kvevict's adapter view of layer l, target p (which must be adapted) over `base` (the
  /// parameters, or a gradient vector with the same layout).
  kvevict::lora_adapter<T> adapter(int l, projection p) const {
    const T* a = params_.data() + offset(l, p);
    return {*kvevict::make_matrix_view<const T>(a, dims_.in(p), cfg_.rank),
            *kvevict::make_matrix_view<const T>(a + dims_.in(p) * cfg_.rank, cfg_.rank, dims_.out(p)),
            static_cast<T>(cfg_.alpha)};
  }
  /// Gradient views of layer l, target p inside `grad` (a vector of param_count() values).
  kvevict::lora_adapter_grad<T> grad_views(int l, projection p, T* grad) const {
    T* a = grad + offset(l, p);
    return {*kvevict::make_matrix_view<T>(a, dims_.in(p), cfg_.rank),
            *kvevict::make_matrix_view<T>(a + dims_.in(p) * cfg_.rank, cfg_.rank, dims_.out(p))};
  }

  /// Errors unless the module was made for a model with config `c`, e.g. "lookahead module was
  /// trained for dim 288 but the model has dim 64".
  status check_model(const config& c) const {
    const lookahead_dims m = lookahead_dims::of(c);
    const int mine[6] = {dims_.dim, dims_.n_layers, dims_.n_heads, dims_.n_kv_heads, dims_.hidden_dim, dims_.vocab_size};
    const int theirs[6] = {m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.hidden_dim, m.vocab_size};
    const char* names[6] = {"dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size"};
    for (int i = 0; i < 6; ++i)
      if (mine[i] != theirs[i])
        return status::error(errc::shape_mismatch, "lookahead module was trained for %s %d but the model has %s %d",
                             names[i], mine[i], names[i], theirs[i]);
    return {};
  }

  /// The same module with parameters converted to U.
  template <class U>
  basic_lookahead_module<U> cast() const {
    basic_lookahead_module<U> r;
    (void)r.shape(dims_, cfg_);
    for (std::size_t i = 0; i < params_.size(); ++i) r.params()[i] = static_cast<U>(params_[i]);
    return r;
  }

 private:
  lookahead_dims dims_;
  lookahead_config cfg_;
  std::vector<index_t> offsets_;  // [layer][target]
  std::vector<T> params_;

  std::size_t slot(int l, projection p) const {
    return static_cast<std::size_t>(l) * lora_targets + static_cast<std::size_t>(p);
  }
};

using lookahead_module = basic_lookahead_module<float>;

/// The module's file image (format above).
inline std::vector<unsigned char> serialize(const lookahead_module& m) {
  std::vector<unsigned char> b(lookahead_magic, lookahead_magic + 8);
  detail::put_u32(b, lookahead_version);
  const lookahead_dims& d = m.dims();
  for (int v : {d.dim, d.n_layers, d.n_heads, d.n_kv_heads, d.hidden_dim, d.vocab_size})
    detail::put_u32(b, static_cast<std::uint32_t>(v));
  detail::put_u32(b, static_cast<std::uint32_t>(m.n_lookahead()));
  detail::put_u32(b, static_cast<std::uint32_t>(m.rank()));
  detail::put_u32(b, detail::float_bits(m.alpha()));
  detail::put_u32(b, m.placement());
  b.reserve(b.size() + m.params().size() * 4);
  for (float v : m.params()) detail::put_u32(b, detail::float_bits(v));
  return b;
}

/// Reads a module image. On failure `out` is unchanged. Errors (format_error): shorter than the
/// header, wrong magic, unknown version, invalid dims / n_lookahead / rank / alpha / placement,
/// size not matching the header (truncated or trailing bytes), a non-finite parameter.
inline status deserialize(const unsigned char* data, std::size_t size, lookahead_module& out) {
  if (size < lookahead_header_bytes)
    return status::error(errc::format_error, "lookahead module: %zu bytes is shorter than the %zu-byte header", size,
                         lookahead_header_bytes);
  if (std::memcmp(data, lookahead_magic, 8) != 0)
    return status::error(errc::format_error, "lookahead module: bad magic (not a kvevict lookahead module file)");
  const std::uint32_t version = detail::get_u32(data + 8);
  if (version != lookahead_version)
    return status::error(errc::format_error, "lookahead module: version %u is not supported (this build reads version %u)",
                         version, lookahead_version);
  int v[6];
  for (int i = 0; i < 6; ++i) v[i] = static_cast<std::int32_t>(detail::get_u32(data + 12 + 4 * i));
  lookahead_config c;
  c.n_lookahead = static_cast<std::int32_t>(detail::get_u32(data + 36));
  c.rank = static_cast<std::int32_t>(detail::get_u32(data + 40));
  c.alpha = detail::bits_float(detail::get_u32(data + 44));
  c.placement = detail::get_u32(data + 48);
  // the size the header implies is checked against the input before shape() allocates anything
  const lookahead_dims dims{v[0], v[1], v[2], v[3], v[4], v[5]};
  if (const status st = lookahead_module::check_shape(dims, c); !st.ok())
    return status::error(errc::format_error, "%s", st.message());
  index_t count = 0;
  if (!lookahead_module::count_params(dims, c, count) || count > static_cast<index_t>((SIZE_MAX - lookahead_header_bytes) / 4))
    return status::error(errc::format_error, "lookahead module: the header (dim %d, %d layers, hidden %d, vocab %d, "
                         "rank %lld, n_lookahead %lld) declares more parameters than any file holds", v[0], v[1], v[4],
                         v[5], static_cast<long long>(c.rank), static_cast<long long>(c.n_lookahead));
  const std::size_t want = lookahead_header_bytes + static_cast<std::size_t>(count) * 4;
  lookahead_module m;
  if (size == want)
    if (const status st = m.shape(dims, c); !st.ok()) return status::error(errc::format_error, "%s", st.message());
  if (size != want)
    return status::error(errc::format_error,
                         "lookahead module: the header (n_lookahead %lld, rank %lld, placement %s, dim %d, %d layers) "
                         "needs %zu bytes but the input has %zu (%s %zu bytes)",
                         static_cast<long long>(c.n_lookahead), static_cast<long long>(c.rank),
                         placement_name(c.placement).c_str(), v[0], v[1], want, size,
                         size < want ? "truncated by" : "trailing", size < want ? want - size : size - want);
  for (index_t i = 0; i < m.param_count(); ++i) {
    const float f = detail::bits_float(detail::get_u32(data + lookahead_header_bytes + 4 * static_cast<std::size_t>(i)));
    if (!std::isfinite(f))
      return status::error(errc::format_error, "lookahead module: parameter %lld is not finite (%g)",
                           static_cast<long long>(i), static_cast<double>(f));
    m.params()[static_cast<std::size_t>(i)] = f;
  }
  out = std::move(m);
  return {};
}

/// Writes the module to `path` atomically (programs/io.hpp: a temporary file renamed into place
/// when complete; on failure the previous file is untouched). Errors: io_error.
inline status save_module(const lookahead_module& m, const std::string& path) {
  kvevict::io::output_transaction out;
  KVEVICT_TRY(out.stage(path, serialize(m)));
  return out.commit();
}

/// Reads a module file: a regular file of at most io::limit::module_bytes. Errors: io_error
/// (cannot open / read, not a regular file, too large), then those of deserialize().
inline status load_module(const std::string& path, lookahead_module& out) {
  std::vector<unsigned char> bytes;
  KVEVICT_TRY(kvevict::io::read_file(path, "lookahead module", kvevict::io::limit::module_bytes, bytes));
  return deserialize(bytes.data(), bytes.size(), out);
}

}  // namespace kvrun
