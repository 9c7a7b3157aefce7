// The quality report (examples/report/report.hpp, svg.hpp) on a tiny configuration: the JSON it
// writes is parsed back here and its numbers checked for consistency (the full cache and every
// budget of at least the prompt: KL exactly 0 and full agreement; the oracle: recall 1 at every
// budget; means equal to the per-prompt numbers; footprints and recalls in range), the quality
// numbers do not depend on the thread count, and the table and the plot hold every row.
#include "support.hpp"
#include "support/shipped.hpp"

#include <report/footprint.hpp>
#include <report/report.hpp>
#include <report/svg.hpp>
#include <report/tables.hpp>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace kvrun;

namespace {

// A small JSON reader (objects, arrays, strings, numbers, true / false / null), enough to read the
// report back.
struct json {
  enum kind_t { null_v, bool_v, number_v, string_v, array_v, object_v } kind = null_v;
  bool b = false;
  double num = 0.0;
  std::string str;
  std::vector<json> items;
  std::map<std::string, json> fields;

  const json& operator[](const std::string& k) const {
    const auto it = fields.find(k);
    REQUIRE_MESSAGE(it != fields.end(), "missing key " << k);
    return it->second;
  }
  const json& operator[](std::size_t i) const {
    REQUIRE(i < items.size());
    return items[i];
  }
  bool has(const std::string& k) const { return fields.count(k) > 0; }
};

class json_reader {
 public:
  explicit json_reader(const std::string& s) : s_(s) {}
  json parse() {
    json v = value();
    ws();
    REQUIRE_MESSAGE(i_ == s_.size(), "trailing characters at " << i_);
    return v;
  }

 private:
  const std::string& s_;
  std::size_t i_ = 0;
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  void expect(char ch) {
    ws();
    REQUIRE_MESSAGE((i_ < s_.size() && s_[i_] == ch), "expected '" << ch << "' at " << i_);
    ++i_;
  }
  std::string string_lit() {
    expect('"');
    std::string out;
    while (true) {
      REQUIRE(i_ < s_.size());
      const char ch = s_[i_++];
      if (ch == '"') break;
      if (ch != '\\') {
        out += ch;
        continue;
      }
      const char e = s_[i_++];
      if (e == 'u') {
        out += static_cast<char>(std::strtol(s_.substr(i_, 4).c_str(), nullptr, 16));
        i_ += 4;
      } else {
        out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      }
    }
    return out;
  }
  json value() {
    ws();
    REQUIRE(i_ < s_.size());
    json v;
    const char ch = s_[i_];
    if (ch == '{') {
      v.kind = json::object_v;
      ++i_;
      ws();
      if (s_[i_] == '}') {
        ++i_;
        return v;
      }
      while (true) {
        const std::string k = string_lit();
        expect(':');
        v.fields[k] = value();
        ws();
        if (s_[i_] == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (ch == '[') {
      v.kind = json::array_v;
      ++i_;
      ws();
      if (s_[i_] == ']') {
        ++i_;
        return v;
      }
      while (true) {
        v.items.push_back(value());
        ws();
        if (s_[i_] == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (ch == '"') {
      v.kind = json::string_v;
      v.str = string_lit();
      return v;
    }
    for (const char* word : {"true", "false", "null"})
      if (s_.compare(i_, std::string(word).size(), word) == 0) {
        i_ += std::string(word).size();
        v.kind = word[0] == 'n' ? json::null_v : json::bool_v;
        v.b = word[0] == 't';
        return v;
      }
    char* end = nullptr;
    v.kind = json::number_v;
    v.num = std::strtod(s_.c_str() + i_, &end);
    REQUIRE_MESSAGE(end != s_.c_str() + i_, "bad value at " << i_);
    i_ = static_cast<std::size_t>(end - s_.c_str());
    return v;
  }
};

report_options tiny(int threads) {
  report_options o;
  o.lookahead = &kvtest::shipped_module();
  o.lookahead_path = "stories260K-n16.bin";
  o.prompts = 2;
  o.budgets = {24, 512};
  o.pairs.response = 16;
  o.pairs.max_prompt = 160;
  o.calibration = 2;
  o.head_sparsities = {0.5};  // 12 head-type rows: duo-heuristic, duo, prulong x 4 drivers
  o.threads = threads;
  return o;
}

}  // namespace

TEST_CASE("the report on a tiny configuration: a JSON of consistent numbers, a table and a plot") {
  report_result r;
  const status st = run_report(kvtest::shipped_model(), tiny(2), r);
  REQUIRE_MESSAGE(st.ok(), st.message());
  const std::string text = report_json(r, "stories260K", "test");
  const json j = json_reader(text).parse();
  const index_t m = 16;
  CHECK(j["prompts"]["response"].num == m);
  REQUIRE(j["prompts"]["seeds"].items.size() == 2);
  CHECK(j["prompts"]["seeds"][0].num == static_cast<double>(test_seed_base));
  CHECK(j["options"]["budgets"].items.size() == 2);
  CHECK(j["duo_global"].items.size() == 20);
  const json& rows = j["rows"];
  REQUIRE(rows.items.size() == r.rows.size());
  // full, then per budget: 16 post-fill methods, 2 layer-wise cascades, 4 chunked, 4 decode; then
  // the head-type rows at s = 0.5 (3 methods x 4 drivers)
  CHECK(rows.items.size() == 1 + 2 * 26 + 12);
  CHECK(j["lookahead_module"]["n_lookahead"].num == 16);
  int oracle_rows = 0, full_budget_rows = 0, lookahead_rows = 0, head_rows = 0;
  for (const json& row : rows.items) {
    const std::string name = row["recipe"].str + " / " + row["driver"].str;
    CAPTURE(name);
    const json& mean = row["mean"];
    const json& per = row["per_prompt"];
    for (const char* f : {"recall", "kl", "agreement", "top1", "footprint", "peak", "kept", "evict_ms", "prefill_ms", "overhead"}) {
      REQUIRE(per[f].items.size() == 2);
      if (std::string(f) != "evict_ms" && std::string(f) != "prefill_ms" && std::string(f) != "overhead")
        CHECK(mean[f].num == doctest::Approx((per[f][0].num + per[f][1].num) / 2).epsilon(1e-8));
    }
    // the overhead: (prefill + eviction) / prefill of each prompt, its median
    for (std::size_t p = 0; p < 2; ++p)
      CHECK(per["overhead"][p].num == doctest::Approx((per["prefill_ms"][p].num + per["evict_ms"][p].num) / per["prefill_ms"][p].num));
    CHECK(row["median"]["overhead"].num == doctest::Approx((per["overhead"][0].num + per["overhead"][1].num) / 2));
    CHECK(row["median"]["overhead"].num >= 1.0);
    if (row["recipe"].str == "lookaheadkv") ++lookahead_rows;
    CHECK(row["sem"]["kl"].num >= 0.0);
    CHECK(row["sem"]["agreement"].num >= 0.0);
    CHECK(mean["recall"].num >= 0.0);
    CHECK(mean["recall"].num <= 1.0);
    CHECK(mean["footprint"].num > 0.0);
    CHECK(mean["footprint"].num <= 1.0);
    CHECK(mean["peak"].num <= 1.0);
    CHECK(mean["agreement"].num <= m);
    CHECK(mean["kl"].num >= 0.0);
    const bool full = row["recipe"].str == "full" || (row["budget"].kind == json::number_v && row["budget"].num == 512);
    CHECK(mean["top1"].num >= 0.0);
    CHECK(mean["top1"].num <= 1.0);
    // the paired difference to SnapKV post-fill at the same budget: the mean of the per-prompt
    // differences (0 for SnapKV itself), none for the full row; head-type rows: to duo-heuristic at
    // the same head sparsity and driver
    if (row.has("head_sparsity")) {
      ++head_rows;
      CHECK(row["head_sparsity"].num == 0.5);
      CHECK(row["retrieval_heads"].num == 10);
      CHECK(row["budget"].kind == json::null_v);
      const json* ref = nullptr;
      for (const json& other : rows.items)
        if (other["recipe"].str == "duo-heuristic" && other["driver"].str == row["driver"].str && other.has("head_sparsity"))
          ref = &other;
      REQUIRE(ref != nullptr);
      if (row["recipe"].str == "duo-heuristic") {
        CHECK(row["vs_duo_heuristic"].kind == json::null_v);
      } else {
        for (const char* f : {"kl", "top1"}) {
          const double d0 = per[f][0].num - (*ref)["per_prompt"][f][0].num, d1 = per[f][1].num - (*ref)["per_prompt"][f][1].num;
          CHECK(row["vs_duo_heuristic"][f]["mean"].num == doctest::Approx((d0 + d1) / 2).epsilon(1e-8));
        }
      }
      // streaming heads stream in the chunked driver: less KV held than after a post-fill eviction
      if (row["driver"].str == "chunked-naive") {
        for (const json& other : rows.items)
          if (other["recipe"].str == row["recipe"].str && other["driver"].str == "postfill" && other.has("head_sparsity"))
            CHECK(mean["footprint"].num < other["mean"]["footprint"].num);
      }
    } else if (row["recipe"].str == "full") {
      CHECK(row["vs_snapkv"].kind == json::null_v);
    } else {
      const json* snap = nullptr;
      for (const json& other : rows.items)
        if (other["recipe"].str == "snapkv" && other["driver"].str == "postfill" && other["budget"].num == row["budget"].num)
          snap = &other;
      REQUIRE(snap != nullptr);
      for (const char* f : {"kl", "recall", "agreement", "top1"}) {
        CAPTURE(f);
        const double d0 = per[f][0].num - (*snap)["per_prompt"][f][0].num, d1 = per[f][1].num - (*snap)["per_prompt"][f][1].num;
        CHECK(row["vs_snapkv"][f]["mean"].num == doctest::Approx((d0 + d1) / 2).epsilon(1e-8));
        CHECK(row["vs_snapkv"][f]["sem"].num == doctest::Approx(std::fabs(d0 - d1) / 2).epsilon(1e-6));
        const double p = row["vs_snapkv"][f]["p"].num;
        CHECK((p >= 0.0 && p <= 1.0));
        if (row["recipe"].str == "snapkv" && row["driver"].str == "postfill") {
          CHECK(row["vs_snapkv"][f]["mean"].num == 0.0);
          CHECK(p == 1.0);
        }
      }
    }
    if (full) {  // nothing evicted: the full cache's numbers exactly
      ++full_budget_rows;
      CHECK(mean["top1"].num == 1.0);
      CHECK(mean["kl"].num == 0.0);
      CHECK(mean["agreement"].num == m);
      CHECK(mean["recall"].num == 1.0);
      CHECK(mean["footprint"].num == 1.0);
      CHECK(mean["peak"].num == 1.0);
    } else {
      CHECK(mean["footprint"].num < 1.0);
      CHECK(mean["kl"].num > 0.0);
    }
    if (row["recipe"].str == "oracle") {
      ++oracle_rows;
      CHECK(per["recall"][0].num == 1.0);
      CHECK(per["recall"][1].num == 1.0);
    }
  }
  CHECK(oracle_rows == 2);
  CHECK(head_rows == 12);
  CHECK(j["head_masks"]["sparsities"].items.size() == 1);
  CHECK(lookahead_rows == 2);
  CHECK(full_budget_rows == 1 + 26);
  REQUIRE(j["speckv_draft_match"].items.size() == 2);
  for (const json& x : j["speckv_draft_match"].items) CHECK((x.num >= 0.0 && x.num <= 1.0));

  // the numbers do not depend on the thread count nor on the batch (only the times do): one thread
  // running both prompts as one batch on one pool of 5-token pages against two unbatched threads
  report_result r1;
  report_options batched = tiny(1);
  batched.batch = 2;
  batched.page_size = 5;
  REQUIRE(run_report(kvtest::shipped_model(), batched, r1).ok());
  REQUIRE(r1.rows.size() == r.rows.size());
  for (std::size_t i = 0; i < r.rows.size(); ++i)
    for (std::size_t p = 0; p < 2; ++p) {
      const prompt_result &a = r.rows[i].prompts[p], &b = r1.rows[i].prompts[p];
      CHECK(a.recall == b.recall);
      CHECK(a.kl == b.kl);
      CHECK(a.agreement == b.agreement);
      CHECK(a.top1 == b.top1);
      CHECK(a.footprint == b.footprint);
      CHECK(a.peak == b.peak);
      CHECK(a.kept == b.kept);
    }

  const std::string table = report_table(r);
  CHECK(table.find("budget  recipe") != std::string::npos);
  CHECK(table.find("laq++") != std::string::npos);
  CHECK(table.find("lookaheadkv") != std::string::npos);
  CHECK(table.find("overhead") != std::string::npos);
  const std::string svg = report_svg(r, "stories260K");
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("</svg>") != std::string::npos);
  std::size_t lines = 0;
  for (std::size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++lines;
  CHECK(lines == 2 * 26);  // two panels, one line per (recipe, driver)
  // the Markdown tables: every row, the counts, the reference and the significance legend
  const std::string md = report_markdown(r, "t");
  CHECK(md.find("LAQ / LAQ++ pseudo tokens: 16; SpecKV draft tokens: 16 (draft: the first 2 layers + output head); "
                "LookaheadKV lookahead tokens: 16") != std::string::npos);
  CHECK(md.find("| snapkv | ") != std::string::npos);
  CHECK(md.find("(reference)") != std::string::npos);
  CHECK(md.find("| speckv | ") != std::string::npos);
  CHECK(md.find("| lava / chunked-patched | ") != std::string::npos);
  CHECK(md.find("Bonferroni") != std::string::npos);
  CHECK(md.find("| prulong / chunked-naive | 0.50 | 10 | ") != std::string::npos);
  CHECK(md.find("| duo-heuristic | 0.50 | 10 | ") != std::string::npos);
  CHECK(svg.find(">lookaheadkv</text>") != std::string::npos);
  CHECK(svg.find(">snapkv / chunked-patched</text>") != std::string::npos);
}

TEST_CASE("report options errors") {
  report_options o = tiny(1);
  std::vector<report_config> cfgs;
  o.budgets = {4};
  kvtest::require_error(report_configs(kvtest::shipped_model().cfg(), o, cfgs), errc::invalid_argument,
                        "report: h2o / postfill / budget 4: --budget 4 is below the 8 tokens h2o protects");
  o.budgets = {};
  kvtest::require_error(report_configs(kvtest::shipped_model().cfg(), o, cfgs), errc::invalid_argument, "--budgets: no budget given");
  o = tiny(1);
  o.recipes = {method::h2o};
  o.drivers = {driver_kind::chunked_naive};
  kvtest::require_error(report_configs(kvtest::shipped_model().cfg(), o, cfgs), errc::invalid_argument, "no configuration matches");
  o = tiny(1);
  o.prompts = 0;
  report_result r;
  kvtest::require_error(run_report(kvtest::shipped_model(), o, r), errc::invalid_argument, "--prompts must be >= 1, got 0");
  o.prompts = 1;
  o.batch = 0;
  kvtest::require_error(run_report(kvtest::shipped_model(), o, r), errc::invalid_argument, "report: batch 0 and page size 16 must be >= 1");
  o = tiny(1);
  o.all_drivers = true;
  o.budgets = {24};
  REQUIRE(report_configs(kvtest::shipped_model().cfg(), o, cfgs).ok());
  CHECK(cfgs.size() == 1 + 52 + 12);  // every supported pair but full's (duo-heuristic: every driver since streaming heads)
  // without a module, lookaheadkv is left out of every method and refused when named
  o.lookahead = nullptr;
  REQUIRE(report_configs(kvtest::shipped_model().cfg(), o, cfgs).ok());
  CHECK(cfgs.size() == 1 + 51 + 12);
  o.recipes = {method::snapkv, method::lookaheadkv};
  kvtest::require_error(report_configs(kvtest::shipped_model().cfg(), o, cfgs), errc::invalid_argument,
                        "report: lookaheadkv needs a trained lookahead module (--lookahead-module)");
}

TEST_CASE("the footprint protocol: budget and per-chunk fraction sweeps, critical footprints from the measured curves") {
  footprint_options f;
  f.report = tiny(2);
  f.recipes = {method::snapkv};
  f.drivers = {driver_kind::postfill, driver_kind::chunked_naive, driver_kind::chunked_patched};
  f.budgets = {16, 48};
  f.fractions = {0.2, 0.6};
  f.bootstrap = 20;
  footprint_result r;
  const status st = run_footprint(kvtest::shipped_model(), f, r);
  REQUIRE_MESSAGE(st.ok(), st.message());
  REQUIRE(r.curves.size() == 3);
  CHECK(!r.curves[0].curve.by_fraction);
  CHECK(r.curves[1].curve.by_fraction);
  CHECK(r.curves[2].curve.driver == driver_kind::chunked_patched);
  for (const curve_result& c : r.curves) {
    REQUIRE(c.rows.size() == 2);
    // the critical footprint is the library's on the curve's mean points, full performance 1
    std::vector<kvevict::curve_point> pts;
    for (const std::size_t i : c.rows) pts.push_back({r.report.rows[i].footprint, r.report.rows[i].top1});
    kvevict::critical_footprint_result want;
    REQUIRE(kvevict::critical_footprint(pts.data(), 2, 1.0, want).ok());
    CHECK(c.top1.at.footprint == want.footprint);
    CHECK(c.top1.at.kind == want.kind);
    CHECK(c.top1.se >= 0.0);
  }
  // evicting more per chunk holds less: the footprint falls with p
  for (const std::size_t k : {std::size_t(1), std::size_t(2)}) {
    const config_result &lo = r.report.rows[r.curves[k].rows[0]], &hi = r.report.rows[r.curves[k].rows[1]];
    CHECK(lo.cfg.fraction == 0.2);
    CHECK(hi.cfg.fraction == 0.6);
    CHECK(hi.footprint < lo.footprint);
  }
  // a larger budget holds more after a post-fill eviction
  CHECK(r.report.rows[r.curves[0].rows[1]].footprint > r.report.rows[r.curves[0].rows[0]].footprint);
  const json j = json_reader(footprint_json(r, "stories260K", "test")).parse();
  REQUIRE(j["curves"].items.size() == 3);
  CHECK(j["curves"][1]["sweep"].str == "chunk_fraction");
  CHECK(j["curves"][0]["critical"]["top1"]["footprint"].num == doctest::Approx(r.curves[0].top1.at.footprint).epsilon(1e-8));
  CHECK(j["curves"][2]["points"][1]["per_prompt"]["top1"].items.size() == 2);
  const std::string md = footprint_markdown(r);
  CHECK(md.find("| snapkv / chunked-patched | p per chunk |") != std::string::npos);
  CHECK(md.find("Patched − naive chunking") != std::string::npos);
  const std::string svg = footprint_svg(r, "stories260K");
  std::size_t lines = 0;
  for (std::size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++lines;
  CHECK(lines == 3);

  // PruLong vs DuoAttention by fraction of streaming heads: one point per sparsity, fewer retrieval
  // heads hold less KV
  footprint_options hf;
  hf.report = tiny(2);
  hf.recipes = {method::duo, method::prulong};
  hf.drivers = {driver_kind::postfill};
  hf.bootstrap = 5;
  footprint_result hr;
  const status hst = run_footprint(kvtest::shipped_model(), hf, hr);
  REQUIRE_MESSAGE(hst.ok(), hst.message());
  REQUIRE(hr.curves.size() == 2);
  for (const curve_result& c : hr.curves) {
    CHECK(c.curve.by_head_sparsity);
    REQUIRE(c.rows.size() == 3);
    CHECK(hr.report.rows[c.rows[0]].cfg.head_sparsity == 0.25);
    CHECK(hr.report.rows[c.rows[0]].footprint > hr.report.rows[c.rows[2]].footprint);
  }
  CHECK(json_reader(footprint_json(hr, "stories260K", "test")).parse()["curves"][1]["sweep"].str == "head_sparsity");
  CHECK(footprint_markdown(hr).find("| prulong | streaming heads s |") != std::string::npos);

  // errors: a fraction outside (0, 1); no supported pair
  footprint_options bad = f;
  bad.fractions = {1.5};
  kvtest::require_error(run_footprint(kvtest::shipped_model(), bad, r), errc::invalid_argument, "footprint: fraction 1.5 is outside (0, 1)");
  bad = f;
  bad.recipes = {method::h2o};
  bad.drivers = {driver_kind::chunked_naive};
  kvtest::require_error(run_footprint(kvtest::shipped_model(), bad, r), errc::invalid_argument, "footprint: no supported (recipe, driver) pair");
}

TEST_CASE("speckv's draft model: the first layers and the output head; all layers reproduce the model's greedy text") {
  const model& m = kvtest::shipped_model();
  model two;
  REQUIRE(m.first_layers(2, two).ok());
  CHECK(two.cfg().n_layers == 2);
  CHECK(two.cfg().dim == m.cfg().dim);
  CHECK(std::equal(m.classifier(), m.classifier() + m.cfg().dim * m.cfg().vocab_size, two.classifier()));
  kvtest::require_error(m.first_layers(0, two), errc::invalid_argument, "model: 0 first layers of a 5-layer model");
  speckv_drafter d;
  kvtest::require_error(d.init(m, 6), errc::invalid_argument, "--draft-layers 6 is outside [1, 5]");
  REQUIRE(d.init(m, m.cfg().n_layers).ok());
  const std::vector<int> prompt{1, 403, 407, 261, 378, 425};
  std::vector<int> draft;
  REQUIRE(d.draft(prompt, 8, draft).ok());
  REQUIRE(draft.size() == 8);
  // the full model's greedy continuation
  runner run;
  REQUIRE(run.init(m, {0, 0, 1}).ok());
  kv_cache cache;
  REQUIRE(cache.init(m.cfg()).ok());
  REQUIRE(run.forward(cache, tokens(prompt)).ok());
  std::vector<int> want;
  int tok = sampler::argmax(run.logits(0), m.cfg().vocab_size);
  for (int i = 0; i < 8; ++i) {
    want.push_back(tok);
    REQUIRE(run.decode(cache, tok).ok());
    tok = sampler::argmax(run.logits(0), m.cfg().vocab_size);
  }
  CHECK(draft == want);
  kvtest::require_error(d.draft(prompt, 600, draft), errc::invalid_argument, "do not fit the context of 512");
}
