// The `kvevict` command-line tool's work, as a function tests can call: apply a recipe to
// tensors stored as NumPy .npy files and write the final scores and kept positions, so kvevict
// can be checked against Python implementations (see docs/tool.md).
//
//   q.npy  [H_q][T_q][d]  post-RoPE queries (float32 or float16); which rows depends on the
//                         recipe's query source: the last w prompt tokens (window recipes, w =
//                         T_q unless --window), every prompt token (h2o), the last one (tova: the
//                         last row of q is used), an external block (--source external)
//   k.npy, v.npy [H_kv][T][d]   the prompt's keys and values (float32 or float16)
//   bk.npy [H_kv][T_q][d] optional: the external block's own keys
//   -> scores.npy float32 [H_kv][T]: the final scores selection ranked (protected = +inf)
//   -> kept.npy   int32 [H_kv][max_kept]: each head's kept positions ascending, -1 padded
#pragma once

#include "npy.hpp"

#include <kvevict/numeric.hpp>
#include <kvevict/recipes.hpp>

#include <string>
#include <vector>

namespace kvevict::tool {

struct options {
  std::string q_path, k_path, v_path, block_keys_path;
  std::string scores_path = "scores.npy", kept_path = "kept.npy";
  recipe r = recipe::snapkv();
  index_t window = 0;  ///< 0: the number of query rows in q.npy; otherwise >= 1
  index_t budget = -1; ///< tokens kept per KV head (protected ones included); required, >= 0
  index_t sinks = -1;  ///< first tokens always kept; -1: the recipe's default
  index_t recent = -1; ///< last tokens always kept; -1: the recipe's default (window recipes: w)
  bool parallel = false;
};

namespace detail {

/// float32 copy of a float32 or float16 array (the tool computes in fp32 either way).
inline status to_f32(const npy::array& a, const char* name, std::vector<float>& out) {
  std::size_t n = 1;
  for (auto e : a.shape) n *= static_cast<std::size_t>(e);
  out.resize(n);
  if (a.type == npy::dtype::float32) {
    if (n) std::memcpy(out.data(), a.bytes.data(), n * sizeof(float));
  } else if (a.type == npy::dtype::float16) {
    for (std::size_t i = 0; i < n; ++i) {
      float16 h;
      std::memcpy(&h.bits, a.bytes.data() + 2 * i, 2);
      out[i] = to_float(h);
    }
  } else {
    return status::error(errc::format_error, "%s: dtype int32 is not a tensor of scores or activations (expected float32 or float16)", name);
  }
  return {};
}

/// Reads a rank-3 tensor with no zero-sized axis: every size the tool derives (scores, kept
/// lists, workspaces) is then bounded by the elements the files really hold.
inline status load_rank3(const std::string& path, const char* what, npy::array& a, std::vector<float>& data) {
  KVEVICT_TRY(npy::read(path, a));
  if (a.shape.size() != 3)
    return status::error(errc::shape_mismatch, "%s: %s must have 3 dimensions [heads][tokens][dim], got %zu",
                         path.c_str(), what, a.shape.size());
  for (std::size_t i = 0; i < 3; ++i)
    if (a.shape[i] == 0)
      return status::error(errc::shape_mismatch, "%s: %s are [%lld][%lld][%lld]: an empty axis leaves nothing to score",
                           path.c_str(), what, static_cast<long long>(a.shape[0]), static_cast<long long>(a.shape[1]),
                           static_cast<long long>(a.shape[2]));
  return to_f32(a, path.c_str(), data);
}

/// The options' own ranges and the paths, before any file is read (docs/conventions.md).
inline status check_options(const options& opt) {
  if (opt.budget < 0) return status::error(errc::invalid_argument, "give the number of tokens to keep per head with --budget (>= 0)");
  if (opt.window < 0)
    return status::error(errc::invalid_argument, "--window must be >= 1, got %lld", static_cast<long long>(opt.window));
  if (opt.sinks < -1 || opt.recent < -1) return status::error(errc::invalid_argument, "--sinks and --recent must be >= 0");
  if (opt.k_path.empty()) return status::error(errc::invalid_argument, "give the keys with --k");
  if (opt.scores_path.empty() || opt.kept_path.empty())
    return status::error(errc::invalid_argument, "--scores and --kept must name files");
  return io::check_paths({{"--q", opt.q_path}, {"--k", opt.k_path}, {"--v", opt.v_path}, {"--block-keys", opt.block_keys_path}},
                         {{"--scores", opt.scores_path}, {"--kept", opt.kept_path}});
}

}  // namespace detail

/// Runs the tool; on success writes the two output files and fills `summary` with one line.
/// Every input given is read and checked, used or not (a missing --q is an error even for a recipe
/// that reads no queries); both outputs are written all or nothing, after all the work.
inline status run(const options& opt, std::string& summary) {
  KVEVICT_TRY(detail::check_options(opt));
  recipe r = opt.r;
  if (!opt.block_keys_path.empty() && r.source != query_source::external_block)
    return status::error(errc::invalid_argument, "--block-keys is only read with --source external");
  npy::array qa, ka, va, ba;
  std::vector<float> q, k, v, bk;
  KVEVICT_TRY(detail::load_rank3(opt.k_path, "keys", ka, k));
  const index_t hkv = ka.shape[0], T = ka.shape[1], d = ka.shape[2];
  if (!opt.q_path.empty()) KVEVICT_TRY(detail::load_rank3(opt.q_path, "queries", qa, q));
  const bool reads_values = r.weight_values;
  if (reads_values || !opt.v_path.empty()) {
    if (opt.v_path.empty())
      return status::error(errc::invalid_argument, "recipe %s weights by values: give --v", recipe_name(r.kind));
    KVEVICT_TRY(detail::load_rank3(opt.v_path, "values", va, v));
    if (va.shape != ka.shape)
      return status::error(errc::shape_mismatch, "%s: values are [%lld][%lld][%lld] but keys [%lld][%lld][%lld]",
                           opt.v_path.c_str(), static_cast<long long>(va.shape[0]), static_cast<long long>(va.shape[1]),
                           static_cast<long long>(va.shape[2]), static_cast<long long>(hkv), static_cast<long long>(T),
                           static_cast<long long>(d));
  }
  index_t hq = 0, rows = 0;
  const float* qdata = nullptr;
  if (uses_attention(r.kind)) {
    if (opt.q_path.empty()) return status::error(errc::invalid_argument, "recipe %s needs queries: give --q", recipe_name(r.kind));
    hq = qa.shape[0];
    rows = qa.shape[1];
    if (qa.shape[2] != d)
      return status::error(errc::shape_mismatch, "%s: queries have dim %lld but keys %lld", opt.q_path.c_str(),
                           static_cast<long long>(qa.shape[2]), static_cast<long long>(d));
    if (hq == 0 || hkv == 0 || hq % hkv != 0)
      return status::error(errc::shape_mismatch, "%s: %lld query heads are not a multiple of %lld KV heads",
                           opt.q_path.c_str(), static_cast<long long>(hq), static_cast<long long>(hkv));
    qdata = q.data();
    if (r.kind == recipe_kind::tova && rows > 1) {  // the last query row is the last prompt token
      for (index_t h = 0; h < hq; ++h)
        std::memmove(q.data() + h * d, q.data() + (h * rows + rows - 1) * d, static_cast<std::size_t>(d) * sizeof(float));
      rows = 1;
    }
    if (r.source == query_source::prompt_window && r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova) {
      r.window = opt.window > 0 ? opt.window : rows;
      r.n_recent = r.window;  // the window recipes keep their observation window
    }
  }
  if (opt.sinks >= 0) r.n_sink = opt.sinks;
  if (opt.recent >= 0) r.n_recent = opt.recent;
  if (!opt.block_keys_path.empty()) KVEVICT_TRY(detail::load_rank3(opt.block_keys_path, "block keys", ba, bk));
  if (opt.budget > T)
    return status::error(errc::invalid_argument, "budget %lld is larger than the prompt (%lld tokens)",
                         static_cast<long long>(opt.budget), static_cast<long long>(T));

  const auto qv = make_kv_view<const float>(qdata, hq, rows, d);
  const auto kv = make_kv_view<const float>(k.data(), hkv, T, d);
  const auto vv = make_kv_view<const float>(v.empty() ? nullptr : v.data(), v.empty() ? 0 : hkv, v.empty() ? 0 : T, d);
  kv_view<const float> bv{};
  if (!bk.empty()) {
    const auto b = make_kv_view<const float>(bk.data(), ba.shape[0], ba.shape[1], ba.shape[2]);
    if (!b) return b.error();
    bv = *b;
  }
  if (!qv) return qv.error();
  if (!kv) return kv.error();
  if (!vv) return vv.error();
  std::vector<float> scores(static_cast<std::size_t>(hkv * T));
  const auto sv = *make_matrix_view(scores.data(), hkv, T);
  std::vector<pos_t> kept(static_cast<std::size_t>(hkv * opt.budget));
  const auto keptv = *make_matrix_view(kept.data(), hkv, opt.budget);

  auto work = [&](auto be) -> status {
    workspace ws;
    KVEVICT_TRY(recipe_scores(be, ws, r, *qv, *kv, *vv, sv, bv));
    std::vector<float> buf((ws.bytes + sizeof(float) - 1) / sizeof(float) + 16);
    ws.data = buf.data();
    KVEVICT_TRY(recipe_scores(be, ws, r, *qv, *kv, *vv, sv, bv));
    workspace sel;
    KVEVICT_TRY(recipe_select(be, sel, r, matrix_view<const float>(sv), keptv));
    std::vector<float> sbuf((sel.bytes + sizeof(float) - 1) / sizeof(float) + 16);
    sel.data = sbuf.data();
    return recipe_select(be, sel, r, matrix_view<const float>(sv), keptv);
  };
  KVEVICT_TRY(opt.parallel ? work(par) : work(seq));

  npy::array scores_a, kept_a;
  std::vector<unsigned char> scores_file, kept_file;
  KVEVICT_TRY(npy::make_array(npy::dtype::float32, {hkv, T}, scores.data(), scores_a));
  KVEVICT_TRY(npy::make_array(npy::dtype::int32, {hkv, opt.budget}, kept.data(), kept_a));
  KVEVICT_TRY(npy::serialize(scores_a, scores_file));
  KVEVICT_TRY(npy::serialize(kept_a, kept_file));
  io::output_transaction out;
  KVEVICT_TRY(out.stage(opt.scores_path, scores_file));
  KVEVICT_TRY(out.stage(opt.kept_path, kept_file));
  KVEVICT_TRY(out.commit());
  char line[256];
  std::snprintf(line, sizeof line, "%s: kept %lld of %lld tokens in each of %lld KV heads -> %s, %s", recipe_name(r.kind),
                static_cast<long long>(opt.budget), static_cast<long long>(T), static_cast<long long>(hkv),
                opt.scores_path.c_str(), opt.kept_path.c_str());
  summary = line;
  return {};
}

}  // namespace kvevict::tool
