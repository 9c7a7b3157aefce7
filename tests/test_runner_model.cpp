// The reference runner's model: checkpoint loading (layout and every error), the forward pass
// against a naive transformer written for clarity, block vs token-at-a-time vs chunked prefill,
// threads, extra blocks and rollback, ragged (evicted) caches against a dense masked reference,
// the layer and projection hooks, decode-time eviction, and every documented error.
#include "support.hpp"
#include "support/shipped.hpp"

#include <runner/generate.hpp>
#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/runner.hpp>
#include <runner/tokenizer.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <numeric>
#include <string>
#include <vector>

using namespace kvrun;
using kvtest::require_error;

namespace {

// ---------------------------------------------------------------------------------------------
// Checkpoints built in memory, in llama2.c's layout

struct spec {
  int dim, hidden, layers, heads, kv_heads, vocab, seq_len;
  bool shared;
};

// Offsets (in floats after the header) of every tensor of a llama2.c checkpoint.
struct raw_layout {
  spec s;
  index_t d, h, hs, kvd, V;
  index_t emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, rope, cls, total;
  explicit raw_layout(const spec& sp) : s(sp) {
    d = s.dim, h = s.hidden, hs = s.dim / s.heads, kvd = hs * s.kv_heads, V = s.vocab;
    const index_t L = s.layers;
    emb = 0;
    rms_att = emb + V * d;
    wq = rms_att + L * d;
    wk = wq + L * d * d;
    wv = wk + L * kvd * d;
    wo = wv + L * kvd * d;
    rms_ffn = wo + L * d * d;
    w1 = rms_ffn + L * d;
    w2 = w1 + L * h * d;
    w3 = w2 + L * d * h;
    rms_final = w3 + L * h * d;
    rope = rms_final + d;
    cls = rope + index_t(s.seq_len) * hs;
    total = cls + (s.shared ? 0 : V * d);
  }
};

std::vector<float> random_weights(const raw_layout& L, std::mt19937_64& g) {
  auto w = kvtest::random_floats(g, static_cast<std::size_t>(L.total), -0.4f, 0.4f);
  std::uniform_real_distribution<float> norm(0.6f, 1.4f);
  for (index_t i = 0; i < L.s.layers * L.d; ++i) {
    w[static_cast<std::size_t>(L.rms_att + i)] = norm(g);
    w[static_cast<std::size_t>(L.rms_ffn + i)] = norm(g);
  }
  for (index_t i = 0; i < L.d; ++i) w[static_cast<std::size_t>(L.rms_final + i)] = norm(g);
  return w;
}

std::vector<unsigned char> header_bytes(const std::array<std::int32_t, 7>& h) {
  std::vector<unsigned char> b(sizeof h);
  std::memcpy(b.data(), h.data(), sizeof h);
  return b;
}

std::vector<unsigned char> checkpoint_bytes(const spec& s, const std::vector<float>& w) {
  auto b = header_bytes({s.dim, s.hidden, s.layers, s.heads, s.kv_heads, s.shared ? s.vocab : -s.vocab, s.seq_len});
  const std::size_t off = b.size();
  b.resize(off + w.size() * sizeof(float));
  std::memcpy(b.data() + off, w.data(), w.size() * sizeof(float));
  return b;
}

struct random_model {
  spec s;
  std::vector<float> w;
  model m;
};
random_model make_random_model(const spec& s, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  random_model r{s, random_weights(raw_layout(s), g), {}};
  const auto bytes = checkpoint_bytes(s, r.w);
  const status st = model::load(bytes.data(), bytes.size(), r.m);
  REQUIRE_MESSAGE(st.ok(), st.message());
  return r;
}

std::vector<unsigned char> read_file_bytes(const char* path) {
  std::vector<unsigned char> b;
  std::FILE* f = std::fopen(path, "rb");
  REQUIRE(f != nullptr);
  unsigned char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) b.insert(b.end(), buf, buf + n);
  std::fclose(f);
  return b;
}

// The raw floats of stories260K.bin, for the naive reference.
const std::vector<float>& stories_raw() {
  static const std::vector<float> w = [] {
    const auto bytes = read_file_bytes(KVEVICT_SOURCE_DIR "/models/stories260K.bin");
    std::vector<float> f((bytes.size() - checkpoint_header_bytes) / sizeof(float));
    std::memcpy(f.data(), bytes.data() + checkpoint_header_bytes, f.size() * sizeof(float));
    return f;
  }();
  return w;
}
const spec stories_spec{64, 172, 5, 8, 4, 512, 512, true};

// A long token sequence of the real model (a story, encoded with tok512).
const std::vector<int>& story_tokens() {
  static const std::vector<int> ids = [] {
    tokenizer t;
    REQUIRE(tokenizer::load_file(KVEVICT_SOURCE_DIR "/models/tok512.bin", 512, t).ok());
    std::vector<int> out;
    REQUIRE(t.encode("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
                     "One day, she saw a big, red ball. She wanted to play with it, but it was too high. Lily's mom "
                     "said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. She said, \"I "
                     "want to play with your ball, but I can't find it.\" Tim and Sue went to the shop to buy a cake "
                     "for their friend, and the sun was warm and bright all day long.",
                     true, false, out)
                .ok());
    return out;
  }();
  return ids;
}

// ---------------------------------------------------------------------------------------------
// A transformer written for clarity: one token at a time, double accumulation, weights read in
// llama2.c's own layout, and per (layer, KV head) the set of present positions: a query attends
// to exactly the present positions. Eviction clears positions from that set.

struct naive_transformer {
  raw_layout L;
  const float* w;
  std::vector<std::vector<double>> K, V;           // [layer][pos * kvd + i]
  std::vector<std::vector<std::vector<char>>> present;  // [layer][kv_head][pos]
  std::vector<std::vector<double>> q, k, v;        // last token's post-RoPE q (dim), k, v (kvd) per layer

  naive_transformer(const spec& s, const float* weights) : L(s), w(weights) {
    K.assign(static_cast<std::size_t>(s.layers), std::vector<double>(static_cast<std::size_t>(s.seq_len * L.kvd)));
    V = K;
    present.assign(static_cast<std::size_t>(s.layers),
                   std::vector<std::vector<char>>(static_cast<std::size_t>(s.kv_heads),
                                                  std::vector<char>(static_cast<std::size_t>(s.seq_len), 0)));
    q.resize(static_cast<std::size_t>(s.layers));
    k = v = q;
  }

  float at(index_t off) const { return w[off]; }
  // out[o] = sum_i W[o][i] x[i], W row-major [out][in] at offset `off`
  std::vector<double> matvec(index_t off, const std::vector<double>& x, index_t out) const {
    const auto in = static_cast<index_t>(x.size());
    std::vector<double> y(static_cast<std::size_t>(out), 0.0);
    for (index_t o = 0; o < out; ++o)
      for (index_t i = 0; i < in; ++i) y[static_cast<std::size_t>(o)] += double(at(off + o * in + i)) * x[static_cast<std::size_t>(i)];
    return y;
  }
  std::vector<double> rmsnorm(const std::vector<double>& x, index_t off) const {
    double ss = 0;
    for (const double e : x) ss += e * e;
    const double scale = 1.0 / std::sqrt(ss / double(x.size()) + 1e-5);
    std::vector<double> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = double(at(off + index_t(i))) * x[i] * scale;
    return y;
  }
  void rope(std::vector<double>& x, int pos) const {
    for (std::size_t j = 0; j < x.size(); j += 2) {
      const auto i = static_cast<int>((j % static_cast<std::size_t>(L.hs)) / 2);
      // the angle in float, as llama2.c computes it
      const float freq = 1.0f / std::pow(10000.0f, float(2 * i) / float(L.hs));
      const double angle = double(float(pos) * freq);
      const double c = std::cos(angle), s = std::sin(angle), a = x[j], b = x[j + 1];
      x[j] = a * c - b * s;
      x[j + 1] = a * s + b * c;
    }
  }

  std::vector<double> step(const float* embedding, int pos) {
    const index_t d = L.d, hs = L.hs, kvd = L.kvd, group = L.s.heads / L.s.kv_heads;
    std::vector<double> x(embedding, embedding + d);
    for (int l = 0; l < L.s.layers; ++l) {
      const auto ls = static_cast<std::size_t>(l);
      auto xb = rmsnorm(x, L.rms_att + l * d);
      q[ls] = matvec(L.wq + l * d * d, xb, d);
      k[ls] = matvec(L.wk + l * kvd * d, xb, kvd);
      v[ls] = matvec(L.wv + l * kvd * d, xb, kvd);
      rope(q[ls], pos);
      rope(k[ls], pos);
      for (index_t i = 0; i < kvd; ++i) {
        K[ls][static_cast<std::size_t>(pos * kvd + i)] = k[ls][static_cast<std::size_t>(i)];
        V[ls][static_cast<std::size_t>(pos * kvd + i)] = v[ls][static_cast<std::size_t>(i)];
      }
      for (index_t g = 0; g < L.s.kv_heads; ++g) present[ls][static_cast<std::size_t>(g)][static_cast<std::size_t>(pos)] = 1;
      std::vector<double> att_out(static_cast<std::size_t>(d), 0.0);
      for (index_t hq = 0; hq < L.s.heads; ++hq) {
        const index_t g = hq / group;
        std::vector<int> visible;
        for (int t = 0; t < L.s.seq_len; ++t)
          if (present[ls][static_cast<std::size_t>(g)][static_cast<std::size_t>(t)]) visible.push_back(t);
        std::vector<double> score;
        for (const int t : visible) {
          double s = 0;
          for (index_t e = 0; e < hs; ++e) s += q[ls][static_cast<std::size_t>(hq * hs + e)] * K[ls][static_cast<std::size_t>(t * kvd + g * hs + e)];
          score.push_back(s / std::sqrt(double(hs)));
        }
        const double mx = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (double& s : score) sum += (s = std::exp(s - mx));
        for (std::size_t j = 0; j < visible.size(); ++j)
          for (index_t e = 0; e < hs; ++e)
            att_out[static_cast<std::size_t>(hq * hs + e)] += score[j] / sum * V[ls][static_cast<std::size_t>(visible[j] * kvd + g * hs + e)];
      }
      const auto o = matvec(L.wo + l * d * d, att_out, d);
      for (index_t i = 0; i < d; ++i) x[static_cast<std::size_t>(i)] += o[static_cast<std::size_t>(i)];
      xb = rmsnorm(x, L.rms_ffn + l * d);
      auto h1 = matvec(L.w1 + l * L.h * d, xb, L.h);
      const auto h3 = matvec(L.w3 + l * L.h * d, xb, L.h);
      for (std::size_t i = 0; i < h1.size(); ++i) h1[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
      const auto f = matvec(L.w2 + l * d * L.h, h1, d);
      for (index_t i = 0; i < d; ++i) x[static_cast<std::size_t>(i)] += f[static_cast<std::size_t>(i)];
    }
    x = rmsnorm(x, L.rms_final);
    return matvec(L.s.shared ? L.emb : L.cls, x, L.V);
  }
  std::vector<double> step_token(int token, int pos) { return step(w + L.emb + index_t(token) * L.d, pos); }
};

// max |a - b| / (1 + |b|)
double rel_diff(const float* a, const double* b, index_t n) {
  double m = 0;
  for (index_t i = 0; i < n; ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]) / (1.0 + std::fabs(b[i])));
  return m;
}
double rel_diff(const float* a, const float* b, index_t n) {
  double m = 0;
  for (index_t i = 0; i < n; ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])) / (1.0 + std::fabs(double(b[i]))));
  return m;
}

// Tolerances (relative to 1 + |reference|). fp32 runner vs the double reference:
constexpr double naive_tolerance = 2e-4;
// fp32 vs fp32 with a possibly different split of the block into rows or chunks:
constexpr double split_tolerance = 1e-5;

// Largest relative difference between the rows two caches hold; requires equal lengths and positions.
double compare_caches(const kv_cache& a, const kv_cache& b) {
  REQUIRE(a.layers() == b.layers());
  REQUIRE(a.next_position() == b.next_position());
  double worst = 0;
  for (int l = 0; l < a.layers(); ++l)
    for (index_t h = 0; h < a.kv_heads(); ++h) {
      REQUIRE(a.length(l, h) == b.length(l, h));
      for (index_t j = 0; j < a.length(l, h); ++j) {
        REQUIRE(a.position(l, h, j) == b.position(l, h, j));
        worst = std::max(worst, rel_diff(a.key_row(l, h, j), b.key_row(l, h, j), a.head_size()));
        worst = std::max(worst, rel_diff(a.value_row(l, h, j), b.value_row(l, h, j), a.head_size()));
      }
    }
  return worst;
}

struct session {
  runner r;
  kv_cache cache;
  explicit session(const model& m, int threads = 0, index_t capacity = 0) {
    REQUIRE(r.init(m, {0, 0, threads}).ok());
    REQUIRE(cache.init(m.cfg(), capacity).ok());
  }
  void forward(const std::vector<int>& ids, logits_mode mode = logits_mode::last) {
    const status st = r.forward(cache, tokens(ids), mode);
    REQUIRE_MESSAGE(st.ok(), st.message());
  }
  std::vector<float> logits_rows() const {
    const index_t V = r.get_model().cfg().vocab_size;
    return std::vector<float>(r.logits(0), r.logits(0) + r.logits_rows() * V);
  }
};

std::vector<int> slice(const std::vector<int>& v, std::size_t b, std::size_t e) { return {v.begin() + long(b), v.begin() + long(e)}; }

// Random strictly ascending subset of [0, n) of size k.
std::vector<pos_t> random_subset(std::mt19937_64& g, index_t n, index_t k) {
  std::vector<pos_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), g);
  all.resize(static_cast<std::size_t>(k));
  std::sort(all.begin(), all.end());
  return all;
}

// Per-head kept row lists for one layer, as a ragged_positions with its storage.
struct kept_rows {
  std::vector<pos_t> pos;
  std::vector<std::int32_t> cu{0};
  void add_head(const std::vector<pos_t>& rows) {
    pos.insert(pos.end(), rows.begin(), rows.end());
    cu.push_back(static_cast<std::int32_t>(pos.size()));
  }
  kvevict::ragged_positions view() const { return {pos.data(), cu.data(), static_cast<index_t>(cu.size()) - 1}; }
};

}  // namespace

// =============================================================================================

TEST_CASE("checkpoint loader: every weight lands where the kernels expect it") {
  for (const bool shared : {true, false}) {
    CAPTURE(shared);
    const spec s{16, 24, 2, 4, 2, 11, 16, shared};
    const auto r = make_random_model(s, shared ? 1 : 2);
    const raw_layout L(s);
    const model& m = r.m;
    const auto W = [&](index_t off) { return r.w[static_cast<std::size_t>(off)]; };
    const index_t d = L.d, h = L.h, kvd = L.kvd, V = L.V, qs = m.qkv_width();
    CHECK(m.cfg().shared_classifier == shared);
    CHECK(m.cfg().vocab_size == 11);
    CHECK(qs == d + 2 * kvd);
    for (index_t t = 0; t < V; ++t)
      for (index_t i = 0; i < d; ++i) {
        REQUIRE(m.embedding(static_cast<int>(t))[i] == W(L.emb + t * d + i));
        REQUIRE(m.classifier()[i * V + t] == W((shared ? L.emb : L.cls) + t * d + i));
      }
    for (index_t i = 0; i < d; ++i) REQUIRE(m.final_norm()[i] == W(L.rms_final + i));
    for (int l = 0; l < s.layers; ++l)
      for (index_t i = 0; i < d; ++i) {
        REQUIRE(m.attn_norm(l)[i] == W(L.rms_att + l * d + i));
        REQUIRE(m.ffn_norm(l)[i] == W(L.rms_ffn + l * d + i));
        for (index_t o = 0; o < d; ++o) {
          REQUIRE(m.wqkv(l)[i * qs + o] == W(L.wq + (l * d + o) * d + i));
          REQUIRE(m.wo(l)[i * d + o] == W(L.wo + (l * d + o) * d + i));
        }
        for (index_t o = 0; o < kvd; ++o) {
          REQUIRE(m.wqkv(l)[i * qs + d + o] == W(L.wk + (l * kvd + o) * d + i));
          REQUIRE(m.wqkv(l)[i * qs + d + kvd + o] == W(L.wv + (l * kvd + o) * d + i));
        }
        for (index_t o = 0; o < h; ++o) {
          REQUIRE(m.w13(l)[i * 2 * h + o] == W(L.w1 + (l * h + o) * d + i));
          REQUIRE(m.w13(l)[i * 2 * h + h + o] == W(L.w3 + (l * h + o) * d + i));
        }
        for (index_t j = 0; j < h; ++j) REQUIRE(m.w2(l)[j * d + i] == W(L.w2 + (l * d + i) * h + j));
      }
  }
}

TEST_CASE("checkpoint loader: each malformed input gets its specific error") {
  model m;
  const auto load = [&](const std::vector<unsigned char>& b) { return model::load(b.data(), b.size(), m); };
  const auto hdr = [](std::int32_t d, std::int32_t h, std::int32_t L, std::int32_t H, std::int32_t kv, std::int32_t V,
                      std::int32_t S) { return header_bytes({d, h, L, H, kv, V, S}); };
  require_error(model::load(nullptr, 0, m), errc::format_error, "0 bytes is shorter than the 28-byte header");
  require_error(load(std::vector<unsigned char>(27, 0)), errc::format_error, "27 bytes is shorter than the 28-byte header");
  require_error(load(hdr(0, 8, 1, 2, 1, 4, 8)), errc::format_error, "dim must be positive (got 0)");
  require_error(load(hdr(8, -3, 1, 2, 1, 4, 8)), errc::format_error, "hidden_dim must be positive (got -3)");
  require_error(load(hdr(8, 8, 0, 2, 1, 4, 8)), errc::format_error, "n_layers must be positive (got 0)");
  require_error(load(hdr(8, 8, 1, 0, 1, 4, 8)), errc::format_error, "n_heads must be positive (got 0)");
  require_error(load(hdr(8, 8, 1, 2, -1, 4, 8)), errc::format_error, "n_kv_heads must be positive (got -1)");
  require_error(load(hdr(8, 8, 1, 2, 1, 0, 8)), errc::format_error, "vocab_size 0 is invalid");
  require_error(load(hdr(8, 8, 1, 2, 1, INT32_MIN, 8)), errc::format_error, "vocab_size -2147483648 is invalid");
  require_error(load(hdr(8, 8, 1, 2, 1, 4, 0)), errc::format_error, "seq_len must be positive (got 0)");
  require_error(load(hdr(10, 8, 1, 4, 1, 4, 8)), errc::format_error, "dim (10) is not divisible by n_heads (4)");
  require_error(load(hdr(8, 8, 1, 4, 3, 4, 8)), errc::format_error, "n_heads (4) is not a multiple of n_kv_heads (3)");
  require_error(load(hdr(8, 8, 1, 8, 1, 4, 8)), errc::format_error, "head size 1 (dim 8 / n_heads 8) is odd");
  require_error(load(hdr(12, 8, 1, 4, 2, 4, 8)), errc::format_error, "head size 3 (dim 12 / n_heads 4) is odd");
  // sizes beyond 64 bits, and a header that would need petabytes: rejected before any allocation
  require_error(load(hdr(1 << 30, 1 << 30, 1 << 30, 2, 1, 4, 8)), errc::format_error, "header sizes overflow 64 bits");
  const raw_layout huge({1 << 20, 1 << 20, 1 << 10, 2, 1, 1 << 20, 1 << 20, true});
  require_error(load(hdr(1 << 20, 1 << 20, 1 << 10, 2, 1, 1 << 20, 1 << 20)), errc::format_error,
                "needs " + std::to_string(28 + 4 * huge.total) + " bytes but the input has 28 (truncated by");

  const spec s{8, 12, 2, 2, 1, 5, 6, false};
  auto g = kvtest::rng(3);
  const auto w = random_weights(raw_layout(s), g);
  auto good = checkpoint_bytes(s, w);
  REQUIRE(load(good).ok());
  const auto n = static_cast<long long>(good.size());
  auto cut = good;
  cut.resize(good.size() - 4);
  require_error(load(cut), errc::format_error,
                "header (dim 8, hidden 12, 2 layers, 2/1 heads, vocab 5, seq_len 6) needs " + std::to_string(n) +
                    " bytes but the input has " + std::to_string(n - 4) + " (truncated by 4 bytes)");
  auto longer = good;
  longer.resize(good.size() + 8, 0);
  require_error(load(longer), errc::format_error, "(trailing 8 bytes)");
  // the same bytes read as a shared-classifier checkpoint: the classifier becomes trailing bytes
  auto flipped = good;
  const std::int32_t positive_vocab = 5;
  std::memcpy(flipped.data() + 5 * sizeof(std::int32_t), &positive_vocab, sizeof positive_vocab);
  require_error(load(flipped), errc::format_error, "(trailing " + std::to_string(5 * 8 * 4) + " bytes)");
  // header only
  require_error(load(hdr(8, 12, 2, 2, 1, 5, 6)), errc::format_error, "but the input has 28 (truncated by");

  // a failed load leaves the output untouched
  model kept;
  REQUIRE(model::load(good.data(), good.size(), kept).ok());
  require_error(model::load(cut.data(), cut.size(), kept), errc::format_error, "truncated");
  CHECK(kept.cfg().dim == 8);

  // files: missing, and the same checks as in memory
  require_error(model::load_file("/nonexistent/dir/model.bin", m), errc::io_error,
                "checkpoint: cannot open '/nonexistent/dir/model.bin': No such file or directory");
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kvrun_checkpoint_" + std::to_string(std::random_device{}()) + ".bin")).string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) MESSAGE("cannot write " << path << "; skipping the file checks");
  if (f != nullptr) {
    REQUIRE(std::fwrite(cut.data(), 1, cut.size(), f) == cut.size());
    std::fclose(f);
    require_error(model::load_file(path, m), errc::format_error, "(truncated by 4 bytes)");
    f = std::fopen(path.c_str(), "wb");
    REQUIRE(std::fwrite(good.data(), 1, good.size(), f) == good.size());
    std::fclose(f);
    model from_file;
    REQUIRE(model::load_file(path, from_file).ok());
    CHECK(std::memcmp(from_file.classifier(), kept.classifier(), 8 * 5 * sizeof(float)) == 0);
    std::remove(path.c_str());
  }
}

TEST_CASE("forward matches a naive transformer (full cache, block prefill and decode)") {
  struct shape_case {
    spec s;
    std::uint64_t seed;
  };
  const shape_case cases[] = {
      {{16, 24, 2, 4, 4, 23, 40, true}, 11},   // multi-head attention
      {{16, 20, 3, 4, 2, 19, 40, false}, 12},  // GQA, unshared classifier
      {{24, 32, 2, 6, 1, 17, 40, true}, 13},   // multi-query
      {{8, 8, 1, 1, 1, 5, 40, false}, 14},     // one head
  };
  for (const auto& sc : cases) {
    CAPTURE(sc.seed);
    const auto rm = make_random_model(sc.s, sc.seed);
    auto g = kvtest::rng(sc.seed);
    std::vector<int> ids(30);
    for (int& t : ids) t = static_cast<int>(kvtest::uniform_int(g, 0, sc.s.vocab - 1));
    naive_transformer ref(sc.s, rm.w.data());
    session run(rm.m);
    int layer_calls = 0;
    forward_hooks hooks;
    hooks.after_layer = [&](const layer_event&) {
      ++layer_calls;
      return status{};
    };
    // prefill 25 tokens as one block with every row's logits, then 5 decode steps
    const auto prompt = slice(ids, 0, 25);
    REQUIRE(run.r.forward(run.cache, tokens(prompt), logits_mode::all, hooks).ok());
    CHECK(layer_calls == sc.s.layers);
    double worst = 0;
    for (int i = 0; i < 25; ++i) {
      const auto expect = ref.step_token(ids[static_cast<std::size_t>(i)], i);
      worst = std::max(worst, rel_diff(run.r.logits(i), expect.data(), sc.s.vocab));
    }
    for (int i = 25; i < 30; ++i) {
      REQUIRE(run.r.decode(run.cache, ids[static_cast<std::size_t>(i)]).ok());
      const auto expect = ref.step_token(ids[static_cast<std::size_t>(i)], i);
      worst = std::max(worst, rel_diff(run.r.logits(0), expect.data(), sc.s.vocab));
    }
    MESSAGE("random model (seed " << sc.seed << "): max relative logit difference to the naive reference " << worst);
    CHECK(worst < naive_tolerance);
  }
}

TEST_CASE("forward on stories260K matches the naive transformer, and the hook sees its q, k, v") {
  const auto& ids = story_tokens();
  naive_transformer ref(stories_spec, stories_raw().data());
  session run(kvtest::shipped_model());
  const auto prompt = slice(ids, 0, 20);
  REQUIRE(run.r.forward(run.cache, tokens(prompt), logits_mode::all).ok());
  double worst = 0;
  for (int i = 0; i < 20; ++i) {
    const auto expect = ref.step_token(ids[static_cast<std::size_t>(i)], i);
    worst = std::max(worst, rel_diff(run.r.logits(i), expect.data(), 512));
  }
  // one more token through the hook: its queries/keys/values against the naive ones
  double worst_qkv = 0;
  int calls = 0;
  forward_hooks hooks;
  hooks.after_layer = [&](const layer_event& ev) {
    ++calls;
    REQUIRE(ev.rows == 1);
    REQUIRE(ev.positions[0] == 20);
    REQUIRE(ev.queries.extent(0) == 8);
    REQUIRE(ev.keys.extent(0) == 4);
    REQUIRE(ev.queries.extent(2) == 8);
    CHECK_FALSE(ev.rolled_back);
    // the block's keys/values are the cache's newest rows
    for (index_t h = 0; h < 4; ++h) {
      REQUIRE(run.cache.length(ev.layer, h) == 21);
      REQUIRE(run.cache.position(ev.layer, h, 20) == 20);
      for (index_t e = 0; e < 8; ++e) {
        REQUIRE(run.cache.key_row(ev.layer, h, 20)[e] == ev.keys(h, 0, e));
        REQUIRE(run.cache.value_row(ev.layer, h, 20)[e] == ev.values(h, 0, e));
      }
    }
    return status{};
  };
  REQUIRE(run.r.decode(run.cache, ids[20], hooks).ok());
  CHECK(calls == 5);
  const auto expect = ref.step_token(ids[20], 20);
  worst = std::max(worst, rel_diff(run.r.logits(0), expect.data(), 512));
  // a second pass with the hook comparing against the naive per-layer vectors of token 21
  const auto expect21 = ref.step_token(ids[21], 21);
  hooks.after_layer = [&](const layer_event& ev) {
    const auto l = static_cast<std::size_t>(ev.layer);
    for (index_t h = 0; h < 8; ++h)
      for (index_t e = 0; e < 8; ++e)
        worst_qkv = std::max(worst_qkv, std::fabs(ev.queries(h, 0, e) - ref.q[l][static_cast<std::size_t>(h * 8 + e)]) /
                                            (1 + std::fabs(ref.q[l][static_cast<std::size_t>(h * 8 + e)])));
    for (index_t h = 0; h < 4; ++h)
      for (index_t e = 0; e < 8; ++e) {
        worst_qkv = std::max(worst_qkv, std::fabs(ev.keys(h, 0, e) - ref.k[l][static_cast<std::size_t>(h * 8 + e)]) /
                                            (1 + std::fabs(ref.k[l][static_cast<std::size_t>(h * 8 + e)])));
        worst_qkv = std::max(worst_qkv, std::fabs(ev.values(h, 0, e) - ref.v[l][static_cast<std::size_t>(h * 8 + e)]) /
                                            (1 + std::fabs(ref.v[l][static_cast<std::size_t>(h * 8 + e)])));
      }
    return status{};
  };
  REQUIRE(run.r.decode(run.cache, ids[21], hooks).ok());
  worst = std::max(worst, rel_diff(run.r.logits(0), expect21.data(), 512));
  MESSAGE("stories260K: max relative difference to the naive reference: logits " << worst << ", q/k/v " << worst_qkv);
  CHECK(worst < naive_tolerance);
  CHECK(worst_qkv < naive_tolerance);
}

TEST_CASE("a prefill block gives the logits of one token at a time") {
  const auto& ids = story_tokens();
  REQUIRE(ids.size() > 100);
  session block(kvtest::shipped_model()), one(kvtest::shipped_model());
  block.forward(ids, logits_mode::all);
  const auto n = static_cast<index_t>(ids.size());
  double worst = 0;
  int argmax_mismatches = 0;
  for (index_t i = 0; i < n; ++i) {
    REQUIRE(one.r.decode(one.cache, ids[static_cast<std::size_t>(i)]).ok());
    worst = std::max(worst, rel_diff(block.r.logits(i), one.r.logits(0), 512));
    argmax_mismatches += sampler::argmax(block.r.logits(i), 512) != sampler::argmax(one.r.logits(0), 512);
  }
  MESSAGE(n << " tokens: max relative difference block vs one-at-a-time " << worst);
  CHECK(worst <= split_tolerance);
  CHECK(argmax_mismatches == 0);
  CHECK(compare_caches(block.cache, one.cache) <= split_tolerance);
}

TEST_CASE("chunked prefill (chunks of 1, 7, 64) equals one block, and greedy continues alike") {
  const auto& ids = story_tokens();
  const auto n = ids.size();
  session full(kvtest::shipped_model());
  full.forward(ids);
  const auto full_logits = full.logits_rows();
  sampler greedy;
  REQUIRE(greedy.init(512, 0.0f, 0.9f, 1).ok());
  std::vector<int> full_out;
  REQUIRE(continue_generation(full.r, full.cache, greedy, static_cast<index_t>(n) + 40, full_out).ok());
  for (const std::size_t chunk : {std::size_t(1), std::size_t(7), std::size_t(64)}) {
    CAPTURE(chunk);
    session chunked(kvtest::shipped_model());
    for (std::size_t b = 0; b < n; b += chunk) chunked.forward(slice(ids, b, std::min(n, b + chunk)));
    CHECK(chunked.cache.next_position() == static_cast<pos_t>(n));
    const double d = rel_diff(chunked.r.logits(0), full_logits.data(), 512);
    MESSAGE("chunk " << chunk << ": max relative difference of the last logits " << d);
    CHECK(d <= split_tolerance);
    std::vector<int> out;
    REQUIRE(continue_generation(chunked.r, chunked.cache, greedy, static_cast<index_t>(n) + 40, out).ok());
    CHECK(out == full_out);
    CHECK(compare_caches(chunked.cache, full.cache) <= split_tolerance);
  }
}

TEST_CASE("the thread count does not change a single bit") {
  std::vector<int> ids;
  while (ids.size() < 400) ids.insert(ids.end(), story_tokens().begin(), story_tokens().end());
  ids.resize(400);
  session one(kvtest::shipped_model(), 1), two(kvtest::shipped_model(), 2);
  one.forward(ids, logits_mode::all);
  two.forward(ids, logits_mode::all);
  const auto a = one.logits_rows(), b = two.logits_rows();
  REQUIRE(a.size() == b.size());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  CHECK(compare_caches(one.cache, two.cache) == 0.0);
}

TEST_CASE("extra blocks run like any block, then the cache is exactly as before") {
  const auto& ids = story_tokens();
  session s(kvtest::shipped_model());
  s.forward(slice(ids, 0, 40));
  const kv_cache before = s.cache;
  const auto extra = slice(ids, 40, 48);

  // reference: the same block as an ordinary forward on a copy
  kv_cache copy = before;
  REQUIRE(s.r.forward(copy, tokens(extra), logits_mode::all).ok());
  const auto kept_logits = s.logits_rows();

  int calls = 0;
  forward_hooks hooks;
  hooks.after_layer = [&](const layer_event& ev) {
    ++calls;
    CHECK(ev.rolled_back);
    CHECK(ev.rows == 8);
    CHECK(ev.positions[0] == 40);
    // compaction is refused inside a block that will be rolled back
    kept_rows keep;
    for (index_t h = 0; h < 4; ++h) keep.add_head({0});
    require_error(s.cache.compact(ev.layer, keep.view()), errc::invalid_argument, "inside a block that will be rolled back");
    return status{};
  };
  REQUIRE(s.r.forward_extra(s.cache, tokens(extra), logits_mode::all, hooks).ok());
  CHECK(calls == 5);
  const auto extra_logits = s.logits_rows();
  CHECK(std::memcmp(extra_logits.data(), kept_logits.data(), kept_logits.size() * sizeof(float)) == 0);
  CHECK(compare_caches(s.cache, before) == 0.0);

  // explicit positions (the patched-chunking window: the prompt's last tokens at their own positions)
  const std::vector<pos_t> window_pos = {34, 35, 36, 37, 38, 39};
  REQUIRE(s.r.forward_extra(s.cache, tokens(slice(ids, 34, 40), window_pos.data()), logits_mode::last).ok());
  CHECK(compare_caches(s.cache, before) == 0.0);
  CHECK(s.cache.next_position() == 40);

  // save / rollback around several decode steps (LAQ-style pseudo decoding)
  const cache_checkpoint cp = s.cache.save();
  std::vector<std::vector<float>> first;
  for (int i = 40; i < 45; ++i) {
    REQUIRE(s.r.decode(s.cache, ids[static_cast<std::size_t>(i)]).ok());
    first.push_back(s.logits_rows());
  }
  CHECK(s.cache.next_position() == 45);
  REQUIRE(s.cache.rollback(cp).ok());
  CHECK(compare_caches(s.cache, before) == 0.0);
  for (int i = 40; i < 45; ++i) {
    REQUIRE(s.r.decode(s.cache, ids[static_cast<std::size_t>(i)]).ok());
    CHECK(s.logits_rows() == first[static_cast<std::size_t>(i - 40)]);
  }
  // rollback is refused once the cache was compacted
  const cache_checkpoint cp2 = s.cache.save();
  kept_rows keep;
  for (index_t h = 0; h < 4; ++h) keep.add_head({0, 1, 2});
  REQUIRE(s.cache.compact(0, keep.view()).ok());
  require_error(s.cache.rollback(cp2), errc::invalid_argument, "compacted or cleared since the checkpoint");
  cache_checkpoint future = s.cache.save();
  future.appended += 3;
  require_error(s.cache.rollback(future), errc::invalid_argument, "newer than the cache");
}

TEST_CASE("a ragged (evicted) cache gives the logits of dense attention masked to the kept tokens") {
  struct model_case {
    const char* name;
    spec s;
    const float* raw;
    const model* m;
  };
  const auto rm = make_random_model({16, 24, 3, 4, 2, 29, 80, false}, 21);
  const model_case cases[] = {{"stories260K", stories_spec, stories_raw().data(), &kvtest::shipped_model()},
                              {"random GQA", rm.s, rm.w.data(), &rm.m}};
  for (const auto& mc : cases) {
    const std::string case_name = mc.name;
    CAPTURE(case_name);
    auto g = kvtest::rng(77);
    const auto& story = story_tokens();
    std::vector<int> ids(story.begin(), story.begin() + 70);
    for (int& t : ids) t %= mc.s.vocab;
    naive_transformer ref(mc.s, mc.raw);
    session s(*mc.m);
    double worst = 0;
    const index_t V = mc.s.vocab;

    // prefill 40 tokens
    s.forward(slice(ids, 0, 40));
    for (int i = 0; i < 40; ++i) ref.step_token(ids[static_cast<std::size_t>(i)], i);

    // evict: every (layer, head) keeps its own number of tokens; the naive reference drops the rest
    auto evict = [&](int round) {
      for (int l = 0; l < mc.s.layers; ++l) {
        kept_rows keep;
        for (index_t h = 0; h < mc.s.kv_heads; ++h) {
          const index_t len = s.cache.length(l, h);
          const index_t k = kvtest::uniform_int(g, 1, len);
          const auto rows = random_subset(g, len, k);
          keep.add_head(rows);
          std::vector<char> still(static_cast<std::size_t>(mc.s.seq_len), 0);
          for (const pos_t j : rows) still[static_cast<std::size_t>(s.cache.position(l, h, j))] = 1;
          auto& present = ref.present[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
          for (std::size_t p = 0; p < present.size(); ++p) present[p] = present[p] && still[p];
        }
        const status st = s.cache.compact(l, keep.view());
        REQUIRE_MESSAGE(st.ok(), st.message());
      }
      // heads now hold different numbers of rows
      bool ragged = false;
      for (index_t h = 1; h < mc.s.kv_heads; ++h) ragged |= s.cache.length(0, h) != s.cache.length(0, 0);
      MESSAGE(std::string(mc.name) << ", eviction round " << round << ": layer 0 heads hold " << s.cache.length(0, 0)
                                   << std::string(", ") << s.cache.length(0, 1) << std::string(ragged ? " (ragged)" : "")
                                   << std::string(" rows"));
    };
    evict(1);
    CHECK(s.cache.next_position() == 40);

    // a block of 12 new tokens at positions 40..51 over the evicted cache
    REQUIRE(s.r.forward(s.cache, tokens(slice(ids, 40, 52)), logits_mode::all).ok());
    for (int i = 40; i < 52; ++i) {
      const auto expect = ref.step_token(ids[static_cast<std::size_t>(i)], i);
      worst = std::max(worst, rel_diff(s.r.logits(i - 40), expect.data(), V));
    }
    // the new rows carry their original positions, not the compacted length
    for (int l = 0; l < mc.s.layers; ++l)
      for (index_t h = 0; h < mc.s.kv_heads; ++h) {
        const index_t len = s.cache.length(l, h);
        REQUIRE(s.cache.position(l, h, len - 1) == 51);
        REQUIRE(s.cache.position(l, h, len - 12) == 40);
      }

    // a second eviction (row indices are no longer positions), then decode one token at a time
    evict(2);
    for (int i = 52; i < 60; ++i) {
      REQUIRE(s.r.decode(s.cache, ids[static_cast<std::size_t>(i)]).ok());
      const auto expect = ref.step_token(ids[static_cast<std::size_t>(i)], i);
      worst = std::max(worst, rel_diff(s.r.logits(0), expect.data(), V));
    }
    MESSAGE(std::string(mc.name) << ": max relative logit difference to the masked dense reference " << worst);
    CHECK(worst < naive_tolerance);

    // dense views over the rows every head holds
    const index_t common = *std::min_element(s.cache.lengths(1), s.cache.lengths(1) + mc.s.kv_heads);
    const auto dk = s.cache.dense_keys(1, common);
    REQUIRE(dk.ok());
    for (index_t h = 0; h < mc.s.kv_heads; ++h)
      for (index_t j = 0; j < common; ++j) REQUIRE((*dk)(h, j, 0) == s.cache.key_row(1, h, j)[0]);
    const auto dv = s.cache.dense_values(1, common);
    REQUIRE(dv.ok());
    CHECK((*dv)(mc.s.kv_heads - 1, common - 1, 1) == s.cache.value_row(1, mc.s.kv_heads - 1, common - 1)[1]);
    const auto paged = s.cache.paged(1);  // the drivers' view: the same rows through the block table
    REQUIRE(paged.ok());
    for (index_t h = 0; h < mc.s.kv_heads; ++h) {
      REQUIRE(paged->layer.length(h) == s.cache.length(1, h));
      for (index_t j = 0; j < s.cache.length(1, h); ++j) {
        REQUIRE(paged->layer.key(h, j) == s.cache.key_row(1, h, j));
        REQUIRE(paged->layer.value(h, j) == s.cache.value_row(1, h, j));
      }
    }
  }
}

TEST_CASE("layer hooks: compacting during prefill (cascading) equals compacting after it") {
  const auto& ids = story_tokens();
  const auto prompt = slice(ids, 0, 60);
  auto g = kvtest::rng(5);
  // per layer: the rows each head keeps right after the layer, and a second cut of the previous
  // layer made at the next layer's hook (LAVa/CAKE-style cascading recompression)
  std::vector<kept_rows> first(5), second(5);
  for (int l = 0; l < 5; ++l)
    for (index_t h = 0; h < 4; ++h) {
      const index_t k1 = kvtest::uniform_int(g, 10, 50), k2 = kvtest::uniform_int(g, 5, k1);
      first[static_cast<std::size_t>(l)].add_head(random_subset(g, 60, k1));
      second[static_cast<std::size_t>(l)].add_head(random_subset(g, k1, k2));
    }
  session during(kvtest::shipped_model()), after(kvtest::shipped_model());
  forward_hooks hooks;
  std::vector<pos_t> seen_positions;
  hooks.after_layer = [&](const layer_event& ev) {
    const auto l = static_cast<std::size_t>(ev.layer);
    if (ev.layer == 0) seen_positions.assign(ev.positions, ev.positions + ev.rows);
    KVEVICT_TRY(during.cache.compact(ev.layer, first[l].view()));
    if (ev.layer > 0) KVEVICT_TRY(during.cache.compact(ev.layer - 1, second[l - 1].view()));
    return status{};
  };
  REQUIRE(during.r.forward(during.cache, tokens(prompt), logits_mode::last, hooks).ok());
  const auto during_logits = during.logits_rows();
  CHECK(seen_positions.size() == 60);
  CHECK(seen_positions.back() == 59);

  after.forward(prompt);
  CHECK(after.logits_rows() == during_logits);  // eviction after a layer ran cannot change this block
  for (int l = 0; l < 5; ++l) REQUIRE(after.cache.compact(l, first[static_cast<std::size_t>(l)].view()).ok());
  for (int l = 0; l < 4; ++l) REQUIRE(after.cache.compact(l, second[static_cast<std::size_t>(l)].view()).ok());
  CHECK(compare_caches(during.cache, after.cache) == 0.0);
  for (int i = 60; i < 70; ++i) {
    REQUIRE(during.r.decode(during.cache, ids[static_cast<std::size_t>(i)]).ok());
    REQUIRE(after.r.decode(after.cache, ids[static_cast<std::size_t>(i)]).ok());
    CHECK(during.logits_rows() == after.logits_rows());
  }
}

TEST_CASE("projection hooks change only the rows they touch (LookaheadKV-style adapters)") {
  const auto& ids = story_tokens();
  const auto blk = slice(ids, 0, 12);
  const index_t first_lookahead = 8;
  session plain(kvtest::shipped_model()), adapted(kvtest::shipped_model());
  plain.forward(blk, logits_mode::all);
  int calls[7] = {};
  forward_hooks hooks;
  hooks.after_projection = [&](const projection_event& ev) {
    const int w = static_cast<int>(ev.which);
    ++calls[w];
    const index_t d = 64, hidden = 172;
    const index_t expect_in = ev.which == projection::w2 ? hidden : d;
    const index_t expect_out = ev.which == projection::k || ev.which == projection::v ? 32
                               : ev.which == projection::w1 || ev.which == projection::w3 ? hidden
                                                                                           : d;
    REQUIRE(ev.in == expect_in);
    REQUIRE(ev.out == expect_out);
    REQUIRE(ev.rows == 12);
    for (index_t r = first_lookahead; r < ev.rows; ++r)
      for (index_t o = 0; o < ev.out; ++o)
        ev.output[r * ev.output_stride + o] += 0.05f * std::sin(float(r + o + w)) * (1.0f + ev.input[r * ev.input_stride]);
    return status{};
  };
  REQUIRE(adapted.r.forward(adapted.cache, tokens(blk), logits_mode::all, hooks).ok());
  for (const int c : calls) CHECK(c == 5);
  const auto a = plain.logits_rows(), b = adapted.logits_rows();
  for (index_t r = 0; r < 12; ++r) {
    const bool same = std::memcmp(a.data() + r * 512, b.data() + r * 512, 512 * sizeof(float)) == 0;
    CHECK(same == (r < first_lookahead));
  }
  // the prompt rows' keys and values are untouched in every layer
  for (int l = 0; l < 5; ++l)
    for (index_t h = 0; h < 4; ++h)
      for (index_t j = 0; j < 12; ++j) {
        const bool same = std::memcmp(plain.cache.key_row(l, h, j), adapted.cache.key_row(l, h, j), 8 * sizeof(float)) == 0 &&
                          std::memcmp(plain.cache.value_row(l, h, j), adapted.cache.value_row(l, h, j), 8 * sizeof(float)) == 0;
        CHECK(same == (j < first_lookahead));
      }
}

TEST_CASE("an embeddings block equals the token block") {
  const auto& ids = story_tokens();
  const auto blk = slice(ids, 0, 16);
  std::vector<float> rows;
  for (const int t : blk) rows.insert(rows.end(), kvtest::shipped_model().embedding(t), kvtest::shipped_model().embedding(t) + 64);
  session a(kvtest::shipped_model()), b(kvtest::shipped_model());
  a.forward(blk, logits_mode::all);
  REQUIRE(b.r.forward(b.cache, embeddings(rows.data(), 16), logits_mode::all).ok());
  CHECK(a.logits_rows() == b.logits_rows());
  CHECK(compare_caches(a.cache, b.cache) == 0.0);
}

TEST_CASE("decode-time eviction through continue_generation keeps original positions") {
  // StreamingLLM-style: whenever a head holds more than 40 rows, keep 4 sinks + the 28 most recent
  const auto prompt = slice(story_tokens(), 0, 20);
  session s(kvtest::shipped_model());
  s.forward(prompt);
  sampler greedy;
  REQUIRE(greedy.init(512, 0.0f, 0.9f, 1).ok());
  int steps_seen = 0, evictions = 0;
  const decode_step evict = [&](kv_cache& c, int token) {
    KVEVICT_TRY(s.r.decode(c, token));
    ++steps_seen;
    if (c.length(0, 0) <= 40) return status{};
    ++evictions;
    for (int l = 0; l < c.layers(); ++l) {
      kept_rows keep;
      for (index_t h = 0; h < c.kv_heads(); ++h) {
        std::vector<pos_t> rows = {0, 1, 2, 3};
        for (index_t j = c.length(l, h) - 28; j < c.length(l, h); ++j) rows.push_back(static_cast<pos_t>(j));
        keep.add_head(rows);
      }
      KVEVICT_TRY(c.compact(l, keep.view()));
    }
    return status{};
  };
  std::vector<int> out;
  REQUIRE(continue_generation(s.r, s.cache, greedy, 200, out, nullptr, evict).ok());
  CHECK(s.cache.next_position() == static_cast<pos_t>(20 + steps_seen));
  CHECK(evictions > 5);
  CHECK(s.cache.total_rows() <= 5 * 4 * 40);
  const index_t len = s.cache.length(3, 2);
  for (index_t j = 0; j < 4; ++j) CHECK(s.cache.position(3, 2, j) == j);
  CHECK(s.cache.position(3, 2, len - 1) == s.cache.next_position() - 1);
  for (index_t j = 5; j < len; ++j) CHECK(s.cache.position(3, 2, j) == s.cache.position(3, 2, j - 1) + 1);
  MESSAGE("streaming eviction: " << out.size() << " tokens generated, " << evictions << " evictions, " << len
                                 << " rows per head at the end");
}

TEST_CASE("runner errors") {
  const model& m = kvtest::shipped_model();
  const auto& ids = story_tokens();
  kv_cache cache;
  REQUIRE(cache.init(m.cfg(), 64).ok());
  runner uninit;
  require_error(uninit.forward(cache, tokens(ids)), errc::invalid_argument, "runner: not initialised");
  runner r;
  require_error(r.init(m, {-1, 0, 0}), errc::invalid_argument, "negative option");
  REQUIRE(r.init(m, {32, 64, 0}).ok());
  require_error(r.forward(cache, tokens(ids.data(), 0)), errc::invalid_argument, "empty block (n = 0)");
  require_error(r.forward(cache, tokens(ids.data(), 33)), errc::invalid_argument, "block of 33 tokens exceeds max_block 32");
  require_error(r.forward(cache, {nullptr, nullptr, nullptr, 3}), errc::invalid_argument, "exactly one of tokens and embeddings");
  std::vector<float> rows(64 * 2);
  require_error(r.forward(cache, {ids.data(), rows.data(), nullptr, 2}), errc::invalid_argument, "exactly one");
  const std::vector<int> bad = {1, 512};
  require_error(r.forward(cache, tokens(bad)), errc::out_of_range, "token 512 (block row 1) is outside the vocabulary [0, 512)");
  const std::vector<int> negative = {-1};
  require_error(r.forward(cache, tokens(negative)), errc::out_of_range, "token -1 (block row 0)");
  const std::vector<pos_t> far = {511, 512};
  require_error(r.forward(cache, tokens(ids.data(), 2, far.data())), errc::out_of_range,
                "position 512 (block row 1) is outside the context [0, 512)");
  const std::vector<pos_t> neg = {-3};
  require_error(r.forward(cache, tokens(ids.data(), 1, neg.data())), errc::out_of_range, "position -3");
  // capacity: 64 rows per head
  REQUIRE(r.forward(cache, tokens(ids.data(), 32)).ok());
  REQUIRE(r.forward(cache, tokens(ids.data() + 32, 30)).ok());
  require_error(r.forward(cache, tokens(ids.data(), 3)), errc::capacity_exceeded,
                "layer 0 head 0 holds 62 of 64 rows; a block of 3 does not fit");
  // next_position past the context
  kv_cache full;
  REQUIRE(full.init(m.cfg()).ok());
  runner big;
  REQUIRE(big.init(m).ok());
  const std::vector<pos_t> last = {510};
  REQUIRE(big.forward(full, tokens(ids.data(), 1, last.data())).ok());
  CHECK(full.next_position() == 511);
  require_error(big.forward(full, tokens(ids.data(), 2)), errc::out_of_range, "position 512 (block row 1)");
  // a cache of another model, and a cache larger than the runner's attention scratch
  const auto rm = make_random_model({16, 24, 2, 4, 2, 11, 16, true}, 9);
  kv_cache other;
  REQUIRE(other.init(rm.m.cfg()).ok());
  require_error(r.forward(other, tokens(ids.data(), 1)), errc::shape_mismatch, "the cache has 2 layers x 2 KV heads");
  require_error(r.forward(full, tokens(ids.data(), 1)), errc::capacity_exceeded,
                "cache capacity 512 exceeds the runner's max_rows 64");
  // a forward from inside a hook
  forward_hooks nested;
  kv_cache scratch;
  REQUIRE(scratch.init(m.cfg(), 64).ok());
  nested.after_layer = [&](const layer_event&) { return r.forward(scratch, tokens(ids.data(), 1)); };
  kv_cache c2;
  REQUIRE(c2.init(m.cfg(), 64).ok());
  require_error(r.forward(c2, tokens(ids.data(), 4), logits_mode::last, nested), errc::invalid_argument,
                "forward called from inside a hook");
  CHECK(c2.total_rows() == 0);
  CHECK(c2.next_position() == 0);

  // a failing hook: the block's rows are removed again; a layer the hook compacted stays compacted
  REQUIRE(r.forward(c2, tokens(ids.data(), 10)).ok());
  const kv_cache before = c2;
  forward_hooks failing;
  failing.after_layer = [&](const layer_event& ev) {
    if (ev.layer == 2) return status::error(errc::invalid_argument, "budget: test failure at layer %d", ev.layer);
    return status{};
  };
  require_error(r.forward(c2, tokens(ids.data() + 10, 5), logits_mode::last, failing), errc::invalid_argument,
                "budget: test failure at layer 2");
  CHECK(compare_caches(c2, before) == 0.0);
  forward_hooks failing_projection;
  failing_projection.after_projection = [&](const projection_event& ev) {
    if (ev.layer == 1 && ev.which == projection::k) return status::error(errc::invalid_argument, "lora: no adapter");
    return status{};
  };
  require_error(r.forward(c2, tokens(ids.data() + 10, 5), logits_mode::last, failing_projection), errc::invalid_argument,
                "lora: no adapter");
  CHECK(compare_caches(c2, before) == 0.0);
  require_error(r.forward_extra(c2, tokens(ids.data() + 10, 5), logits_mode::last, failing), errc::invalid_argument,
                "test failure");
  CHECK(compare_caches(c2, before) == 0.0);
  forward_hooks compacting_then_failing;
  compacting_then_failing.after_layer = [&](const layer_event& ev) {
    if (ev.layer == 0) {
      kept_rows keep;
      for (index_t h = 0; h < 4; ++h) keep.add_head({0, 1});
      KVEVICT_TRY(c2.compact(0, keep.view()));
    }
    if (ev.layer == 1) return status::error(errc::invalid_argument, "stop");
    return status{};
  };
  require_error(r.forward(c2, tokens(ids.data() + 10, 5), logits_mode::last, compacting_then_failing),
                errc::invalid_argument, "stop");
  CHECK(c2.length(0, 0) == 2);
  for (int l = 1; l < 5; ++l) CHECK(c2.length(l, 0) == 10);
  CHECK(c2.next_position() == 10);
}

TEST_CASE("kv_cache errors") {
  const model& m = kvtest::shipped_model();
  kv_cache c;
  require_error(c.init(m.cfg(), -1), errc::invalid_argument, "capacity -1 is outside [0, seq_len 512]");
  require_error(c.init(m.cfg(), 513), errc::invalid_argument, "capacity 513 is outside");
  REQUIRE(c.init(m.cfg(), 16).ok());
  CHECK(c.capacity() == 16);
  runner r;
  REQUIRE(r.init(m).ok());
  REQUIRE(r.forward(c, tokens(story_tokens().data(), 6)).ok());
  kept_rows three;
  for (index_t h = 0; h < 3; ++h) three.add_head({0});
  require_error(c.compact(0, three.view()), errc::shape_mismatch, "kept lists 3 heads, the cache has 4");
  kept_rows ok_rows;
  for (index_t h = 0; h < 4; ++h) ok_rows.add_head({0, 2});
  require_error(c.compact(5, ok_rows.view()), errc::out_of_range, "layer 5 is outside [0, 5)");
  require_error(c.compact(-1, ok_rows.view()), errc::out_of_range, "layer -1");
  kept_rows beyond;
  for (index_t h = 0; h < 4; ++h) beyond.add_head({0, h == 2 ? 6 : 1});
  require_error(c.compact(1, beyond.view()), errc::out_of_range, "kept position 6 of head 2 is outside [0, 6)");
  kept_rows unsorted;
  for (index_t h = 0; h < 4; ++h) unsorted.add_head({3, 1});
  require_error(c.compact(1, unsorted.view()), errc::not_sorted, "strictly ascending");
  // kept lists stored inside the cache's own memory (here: its positions) are refused up front
  kept_rows inside;
  for (index_t h = 0; h < 4; ++h) inside.add_head({0});
  const pos_t* own = c.paged(2)->positions.data;
  require_error(c.compact(1, {own, inside.cu.data(), 4}), errc::overlap, "kept lists lie inside the cache's own memory");
  kept_rows bad_offsets = ok_rows;
  bad_offsets.cu[0] = 1;
  require_error(c.compact(1, bad_offsets.view()), errc::invalid_argument, "kept.cu[0] must be 0");
  // nothing changed by the failures
  for (index_t h = 0; h < 4; ++h) CHECK(c.length(1, h) == 6);
  require_error(c.dense_keys(0, 7).error(), errc::out_of_range, "7 rows requested but head 0 of layer 0 holds 6");
  require_error(c.dense_values(9, 1).error(), errc::out_of_range, "layer 9 is outside");
  REQUIRE(c.compact(1, ok_rows.view()).ok());
  CHECK(c.position(1, 3, 1) == 2);
  c.clear();
  CHECK(c.total_rows() == 0);
  CHECK(c.next_position() == 0);
}

TEST_CASE("caches sharing one page pool give the private caches' logits, bit for bit, and reuse freed pages") {
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const auto& ids = story_tokens();
  runner r;
  REQUIRE(r.init(m).ok());
  kv_pool pool;
  require_error(pool.init(c, 0, 5), errc::invalid_argument, "0 pages of 5 tokens");
  REQUIRE(pool.init(c, 96, 5).ok());
  kv_cache a, b, ra, rb;  // a, b on the pool (pages of 5); ra, rb private (pages of 16)
  require_error(a.init(c, 0, 7, &pool), errc::invalid_argument, "pages of 5 tokens; the cache needs 5, 8, 7");
  REQUIRE(a.init(c, 0, 5, &pool).ok());
  REQUIRE(b.init(c, 0, 5, &pool).ok());
  REQUIRE(ra.init(c).ok());
  REQUIRE(rb.init(c).ok());
  const index_t V = c.vocab_size;
  std::vector<float> want;
  const auto same = [&](kv_cache& shared, kv_cache& own, const block& blk) {
    REQUIRE(r.forward(own, blk).ok());
    want.assign(r.logits(0), r.logits(0) + V);
    REQUIRE(r.forward(shared, blk).ok());
    CHECK(std::memcmp(want.data(), r.logits(0), static_cast<std::size_t>(V) * sizeof(float)) == 0);
  };
  same(a, ra, tokens(ids.data(), 23));
  same(b, rb, tokens(ids.data() + 30, 17));
  for (int i = 0; i < 12; ++i) {  // one token each in turn: the heads' and the sequences' pages interleave
    same(a, ra, tokens(ids.data() + 23 + i, 1));
    same(b, rb, tokens(ids.data() + 47 + i, 1));
  }
  CHECK(pool.in_use() == a.pages_in_use() + b.pages_in_use());
  const auto view = a.paged(0);
  REQUIRE(view.ok());
  bool scattered = false;
  for (index_t i = 0; i + 1 < view->layer.table.pages(0); ++i) scattered = scattered || view->layer.table.indices[i + 1] != view->layer.table.indices[i] + 1;
  CHECK(scattered);
  CHECK(compare_caches(a, ra) == 0.0);
  // eviction: a's freed pages go back to the pool, and b's next pages come from them
  kept_rows keep;
  for (index_t h = 0; h < c.n_kv_heads; ++h) keep.add_head({0, 1, 2, static_cast<pos_t>(20 + h), 30, 34});
  const index_t free_before = pool.free_pages(0);
  std::vector<std::int32_t> a_pages(view->layer.table.indices, view->layer.table.indices + view->layer.table.indptr[c.n_kv_heads]);
  REQUIRE(a.compact(0, keep.view()).ok());
  REQUIRE(ra.compact(0, keep.view()).ok());
  CHECK(pool.free_pages(0) == free_before + a.pages_freed());
  CHECK(a.pages_freed() == 4 * 7 - 4 * 2);
  CHECK(compare_caches(a, ra) == 0.0);
  for (int i = 0; i < 12; ++i) same(b, rb, tokens(ids.data() + 59 + i, 1));
  const auto bview = b.paged(0);
  bool reused = false;
  for (index_t i = 0; i < bview->layer.table.indptr[c.n_kv_heads]; ++i)
    reused = reused || std::find(a_pages.begin(), a_pages.end(), bview->layer.table.indices[i]) != a_pages.end();
  CHECK(reused);
  same(a, ra, tokens(ids.data() + 35, 1));
  CHECK(compare_caches(b, rb) == 0.0);
  // an extra block's pages go back with its rows; a copy holds the same rows in a private pool
  const index_t used = pool.in_use();
  REQUIRE(r.forward_extra(a, tokens(ids.data(), 11)).ok());
  CHECK(pool.in_use() == used);
  kv_cache copy = a;
  CHECK(compare_caches(copy, a) == 0.0);
  CHECK(pool.in_use() == used);
  CHECK(copy.total_pages() == c.n_layers * c.n_kv_heads * ((c.seq_len + 4) / 5));
  {
    // a copy into a cache drawing from the shared pool keeps taking pages from it (the report's
    // batches); into one whose shared pool lacks the free pages: a private pool, the shared one untouched
    kv_pool roomy;
    REQUIRE(roomy.init(c, c.n_kv_heads * ((c.seq_len + 4) / 5), 5).ok());
    kv_cache onto;
    REQUIRE(onto.init(c, 0, 5, &roomy).ok());
    onto = a;
    CHECK(compare_caches(onto, a) == 0.0);
    CHECK(roomy.in_use() == a.pages_in_use());
    CHECK(onto.pool_pages() == roomy.pages());
    CHECK(pool.in_use() == used);
    kv_pool small;
    REQUIRE(small.init(c, 1, 5).ok());
    kv_cache cramped;
    REQUIRE(cramped.init(c, 0, 5, &small).ok());
    cramped = a;
    CHECK(compare_caches(cramped, a) == 0.0);
    CHECK(small.in_use() == 0);
    CHECK(cramped.total_pages() == c.n_layers * c.n_kv_heads * ((c.seq_len + 4) / 5));
  }
  CHECK(pool.in_use() == used);
  {
    kv_cache d;  // a cache's pages come back when it is destroyed
    REQUIRE(d.init(c, 0, 5, &pool).ok());
    REQUIRE(r.forward(d, tokens(ids.data(), 9)).ok());
    CHECK(pool.in_use() == used + c.n_layers * c.n_kv_heads * 2);
  }
  CHECK(pool.in_use() == used);
  // a pool without room for a block: refused before anything changes
  const index_t need = (pool.free_pages(1) / c.n_kv_heads + 2) * 5;
  require_error(r.forward(b, tokens(ids.data(), need)), errc::capacity_exceeded, "page pool has");
  CHECK(compare_caches(b, rb) == 0.0);
  a.clear();
  CHECK(pool.in_use() == b.pages_in_use());
  CHECK(pool.peak() >= pool.in_use());
}

TEST_CASE("forward_batch: sequences at different stages in one forward get their own forward's logits and cache, bit for bit") {
  const model& m = kvtest::shipped_model();
  const config& c = m.cfg();
  const auto& ids = story_tokens();
  const index_t V = c.vocab_size;
  runner one, eng;  // one: each sequence alone on private caches; eng: the batch on one pool of 5-token pages
  REQUIRE(one.init(m).ok());
  require_error(eng.init(m, {0, 0, 0, 0}), errc::invalid_argument, "max_sequences 0 < 1");
  REQUIRE(eng.init(m, {0, 0, 0, 4}).ok());
  kv_pool pool;
  REQUIRE(pool.init(c, 160, 5).ok());
  kv_cache a[4], r[4];
  for (int i = 0; i < 4; ++i) {
    REQUIRE(a[i].init(c, 0, 5, &pool).ok());
    REQUIRE(r[i].init(c).ok());
  }
  // hooks, the same for a sequence's batched and single forwards: a capture of every layer's queries,
  // a LoRA-like change of the last rows' projections, a compaction of each layer (layer-wise eviction)
  std::vector<float> seen[2];
  int capture_into = 0;
  forward_hooks capture, adapter, evicting, failing;
  capture.after_layer = [&](const layer_event& ev) {
    for (index_t h = 0; h < ev.queries.extent(0); ++h)
      for (index_t t = 0; t < ev.rows; ++t)
        for (index_t e = 0; e < ev.queries.extent(2); ++e) seen[capture_into].push_back(ev.queries(h, t, e));
    return status{};
  };
  adapter.after_projection = [](const projection_event& ev) {
    for (index_t row = ev.rows / 2; row < ev.rows; ++row)
      for (index_t o = 0; o < ev.out; ++o) ev.output[row * ev.output_stride + o] += 0.03f * std::cos(float(row * 7 + o));
    return status{};
  };
  kv_cache* evicted = nullptr;  // the cache the evicting hook compacts (set before each forward)
  evicting.after_layer = [&](const layer_event& ev) {
    kept_rows keep;  // every other row of each head
    for (index_t h = 0; h < c.n_kv_heads; ++h) {
      std::vector<pos_t> rows;
      for (index_t j = 0; j < evicted->length(ev.layer, h); j += 2) rows.push_back(static_cast<pos_t>(j));
      keep.add_head(rows);
    }
    return evicted->compact(ev.layer, keep.view());
  };
  failing.after_layer = [](const layer_event& ev) {
    return ev.layer == 2 ? status::error(errc::invalid_argument, "hook stops at layer 2") : status{};
  };
  const auto rows_of = [](const forward_segment& g) {
    return g.mode == logits_mode::none ? 0 : g.mode == logits_mode::last ? 1 : g.b.n;
  };
  // runs `segs` as one forward_batch, then each alone on its reference cache, and compares
  int mixed = 0;
  const auto step = [&](std::vector<forward_segment> segs, const std::vector<int>& which) {
    for (std::size_t k = 0; k < segs.size(); ++k) segs[k].cache = &a[which[k]];
    for (forward_segment& g : segs)
      if (g.hooks == &evicting) evicted = g.cache;
    seen[0].clear();
    capture_into = 0;
    REQUIRE(eng.forward_batch(segs.data(), static_cast<index_t>(segs.size())).ok());
    mixed += segs.size() > 1 && std::any_of(segs.begin(), segs.end(), [](const forward_segment& g) { return g.b.n == 1; }) &&
             std::any_of(segs.begin(), segs.end(), [](const forward_segment& g) { return g.b.n > 1; });
    for (std::size_t k = 0; k < segs.size(); ++k) {
      const forward_segment& g = segs[k];
      REQUIRE_MESSAGE(g.st.ok(), g.st.message());
      kv_cache& ref = r[which[k]];
      if (g.hooks == &evicting) evicted = &ref;
      seen[1].clear();
      capture_into = 1;
      REQUIRE(one.forward(ref, g.b, g.mode, g.hooks != nullptr ? *g.hooks : forward_hooks{}).ok());
      REQUIRE(one.logits_rows() == rows_of(g));
      for (index_t i = 0; i < rows_of(g); ++i)
        CHECK(std::memcmp(eng.logits(g.logits_row + i), one.logits(i), static_cast<std::size_t>(V) * sizeof(float)) == 0);
      CHECK(compare_caches(*g.cache, ref) == 0.0);
      if (g.hooks == &capture) CHECK(seen[0] == seen[1]);
    }
  };
  const auto seg = [&](const int* t, index_t n, logits_mode mode, const forward_hooks* hooks = nullptr) {
    forward_segment g;
    g.b = tokens(t, n);
    g.mode = mode;
    g.hooks = hooks;
    return g;
  };
  const int* s = ids.data();
  step({seg(s, 20, logits_mode::last), seg(s + 40, 9, logits_mode::all, &capture)}, {0, 1});
  // a decode, a prefill's next chunk (captured), a new prompt with adapters (every row's logits), an
  // evicting prompt
  step({seg(s + 20, 1, logits_mode::last), seg(s + 49, 7, logits_mode::all, &capture),
        seg(s + 60, 13, logits_mode::all, &adapter), seg(s + 80, 11, logits_mode::last, &evicting)},
       {0, 1, 2, 3});
  for (int i = 0; i < 6; ++i)  // decodes beside a chunked prefill (chunks of 3) and the evicting sequence's tokens
    step({seg(s + 21 + i, 1, logits_mode::last), seg(s + 100 + 3 * i, 3, logits_mode::last, &capture),
          seg(s + 73 + i, 1, logits_mode::last, &adapter), seg(s + 91 + i, 1, logits_mode::last, &evicting)},
         {0, 1, 2, 3});
  CHECK(mixed == 7);
  // an embeddings block at chosen positions (a lookahead-style extra block) beside a decode
  std::vector<float> emb(static_cast<std::size_t>(4 * c.dim));
  for (std::size_t i = 0; i < emb.size(); ++i) emb[i] = 0.1f * std::sin(float(i));
  const pos_t at[4] = {200, 201, 202, 203};
  forward_segment e;
  e.b = embeddings(emb.data(), 4, at);
  e.mode = logits_mode::all;
  step({e, seg(s + 27, 1, logits_mode::last)}, {2, 0});
  CHECK(pool.in_use() == a[0].pages_in_use() + a[1].pages_in_use() + a[2].pages_in_use() + a[3].pages_in_use());

  // a hook's error stops its own segment only: its cache as before, the others run on
  {
    const index_t len = a[1].length(0, 0);
    const pos_t next = a[1].next_position();
    const index_t in_use = pool.in_use();
    std::vector<forward_segment> segs{seg(s + 28, 1, logits_mode::last), seg(s + 130, 5, logits_mode::last, &failing)};
    segs[0].cache = &a[0];
    segs[1].cache = &a[1];
    REQUIRE(eng.forward_batch(segs.data(), 2).ok());
    CHECK(segs[0].st.ok());
    require_error(segs[1].st, errc::invalid_argument, "hook stops at layer 2");
    for (int l = 0; l < c.n_layers; ++l) CHECK(a[1].length(l, 0) == len);
    CHECK(a[1].next_position() == next);
    REQUIRE(one.forward(r[0], tokens(s + 28, 1)).ok());
    CHECK(std::memcmp(eng.logits(segs[0].logits_row), one.logits(0), static_cast<std::size_t>(V) * sizeof(float)) == 0);
    CHECK(compare_caches(a[0], r[0]) == 0.0);
    CHECK(pool.in_use() >= in_use);  // a[0]'s token may have opened a page, a[1] holds what it held
    CHECK(pool.in_use() == a[0].pages_in_use() + a[1].pages_in_use() + a[2].pages_in_use() + a[3].pages_in_use());
  }
  // segments on one pool must fit together: the later one gets capacity_exceeded, nothing of it changes
  {
    kv_pool small;
    REQUIRE(small.init(c, 10, 8).ok());  // 10 pages of 8 per layer: 2 pages per head for one 9-token block
    kv_cache x, y;
    REQUIRE(x.init(c, 0, 8, &small).ok());
    REQUIRE(y.init(c, 0, 8, &small).ok());
    std::vector<forward_segment> segs{seg(s, 9, logits_mode::last), seg(s + 9, 9, logits_mode::last)};
    segs[0].cache = &x;
    segs[1].cache = &y;
    REQUIRE(eng.forward_batch(segs.data(), 2).ok());
    CHECK(segs[0].st.ok());
    require_error(segs[1].st, errc::capacity_exceeded, "the batch's blocks up to segment 1 need 16");
    CHECK(y.total_rows() == 0);
    CHECK(small.in_use() == index_t(c.n_layers) * 8);
  }
  // the call's errors
  std::vector<forward_segment> five(5, seg(s, 1, logits_mode::last));
  for (int i = 0; i < 4; ++i) five[static_cast<std::size_t>(i)].cache = &a[i];
  five[4].cache = &a[1];
  require_error(eng.forward_batch(five.data(), 5), errc::invalid_argument, "5 segments, max_sequences is 4");
  require_error(eng.forward_batch(five.data() + 1, 4), errc::invalid_argument, "segments 0 and 3 share a cache");
  std::vector<forward_segment> big{seg(s, 300, logits_mode::none), seg(s, 300, logits_mode::none)};
  big[0].cache = &a[0];
  big[1].cache = &a[1];
  require_error(eng.forward_batch(big.data(), 2), errc::invalid_argument, "a batch of 600 rows exceeds max_block 512");
  runner none;
  require_error(none.forward_batch(big.data(), 2), errc::invalid_argument, "needs an initialised, ungated runner");
}

TEST_CASE("generate errors") {
  const model& m = kvtest::shipped_model();
  runner r;
  REQUIRE(r.init(m).ok());
  kv_cache c;
  REQUIRE(c.init(m.cfg()).ok());
  sampler s;
  REQUIRE(s.init(512, 0.0f, 0.9f, 1).ok());
  std::vector<int> out;
  require_error(generate(r, c, s, {}, 10, out), errc::invalid_argument, "the prompt has no tokens");
  const std::vector<int> p = {1, 403, 407};
  require_error(generate(r, c, s, p, 2, out), errc::invalid_argument, "the prompt has 3 tokens, more than steps 2");
  require_error(generate(r, c, s, p, 513, out), errc::invalid_argument, "steps 513 is above the context (seq_len 512)");
  CHECK(c.next_position() == 0);  // nothing ran
  REQUIRE(r.forward(c, tokens(p), logits_mode::none).ok());
  require_error(generate(r, c, s, p, 10, out), errc::invalid_argument, "the cache is not empty (next position 3)");
  require_error(continue_generation(r, c, s, 20, out), errc::invalid_argument, "computed no logits");
  require_error(continue_generation(r, c, s, 2, out), errc::invalid_argument, "steps 2 is outside [3 tokens processed, seq_len 512]");
  require_error(continue_generation(r, c, s, 600, out), errc::invalid_argument, "steps 600 is outside");
}
