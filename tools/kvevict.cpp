// kvevict: apply an eviction recipe to tensors in .npy files (see tools/kvevict_tool.hpp and
// docs/tool.md). One line on stderr and exit status 1 for every error (programs/main.hpp).
#include "cli.hpp"
#include "kvevict_tool.hpp"
#include "main.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <optional>
#include <string>

namespace {

int run(int argc, char** argv) {
  using namespace kvevict;
  tool::options opt;
  std::string recipe_name = "snapkv", pool, gqa, order, source, backend = "seq";
  std::optional<index_t> kernel, sinks, recent, window, budget;  // unset: the recipe's default

  const CLI::Validator integer = program::integer<index_t>();  // no saturation of absurd numbers
  CLI::App app{"kvevict: apply a KV-cache eviction recipe to .npy tensors and write the kept positions"};
  app.add_option("--q", opt.q_path, "queries [H_q][T_q][d] (float32/float16, post-RoPE)");
  app.add_option("--k", opt.k_path, "keys [H_kv][T][d] (float32/float16, post-RoPE)")->required();
  app.add_option("--v", opt.v_path, "values [H_kv][T][d] (needed by vatp and lava)");
  app.add_option("--block-keys", opt.block_keys_path, "the external query block's own keys [H_kv][T_q][d]");
  app.add_option("--recipe", recipe_name,
                 "streaming_llm | h2o | tova | snapkv | knorm | vatp | lava | cake (default snapkv)");
  app.add_option("--budget", budget, "tokens kept per KV head, protected ones included")->required()->check(integer);
  app.add_option("--window", window, "observation window w (default: the query rows of q.npy)")->check(integer);
  app.add_option("--source", source, "window (queries are the last w prompt tokens) | external (queries after the prompt)");
  app.add_option("--pool", pool, "none | max | avg (default: the recipe's)");
  app.add_option("--kernel", kernel, "pooling kernel, odd (default: the recipe's)")->check(integer);
  app.add_option("--gqa", gqa, "mean | max | sum over each query-head group (default: the recipe's)");
  app.add_option("--gqa-order", order, "pool-then-reduce | reduce-then-pool (default: the recipe's)");
  app.add_option("--sinks", sinks, "first tokens always kept (default: the recipe's)")->check(integer);
  app.add_option("--recent", recent, "last tokens always kept (default: the recipe's, e.g. the window)")->check(integer);
  app.add_option("--backend", backend, "seq | par (default seq)");
  app.add_option("--scores", opt.scores_path, "output: final scores, float32 [H_kv][T] (default scores.npy)");
  app.add_option("--kept", opt.kept_path, "output: kept positions, int32 [H_kv][budget], ascending (default kept.npy)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return program::fail("kvevict", std::string(e.what()) + " (see --help)");
  }

  auto fail = [](const char* msg) { return program::fail("kvevict", msg); };
  const auto r = recipe_from_name(recipe_name);
  if (!r) return fail(r.error().message());
  opt.r = *r;
  const std::map<std::string, pool_kind> pools{{"none", pool_kind::none}, {"max", pool_kind::max}, {"avg", pool_kind::avg}};
  const std::map<std::string, gqa_op> gqas{{"mean", gqa_op::mean}, {"max", gqa_op::max}, {"sum", gqa_op::sum}};
  const std::map<std::string, gqa_order> orders{{"pool-then-reduce", gqa_order::pool_first},
                                                {"reduce-then-pool", gqa_order::gqa_first}};
  const std::map<std::string, query_source> sources{{"window", query_source::prompt_window},
                                                    {"external", query_source::external_block}};
  std::string err;
  auto pick = [&](const auto& table, const std::string& v, const char* what, auto& field) {
    if (v.empty()) return true;
    const auto it = table.find(v);
    if (it == table.end()) {
      err = std::string("unknown ") + what + " '" + v + "'";
      return false;
    }
    field = it->second;
    return true;
  };
  if (!pick(pools, pool, "--pool", opt.r.pool) || !pick(gqas, gqa, "--gqa", opt.r.gqa) ||
      !pick(orders, order, "--gqa-order", opt.r.order) || !pick(sources, source, "--source", opt.r.source))
    return fail(err.c_str());
  if (backend != "seq" && backend != "par") return fail(("unknown --backend '" + backend + "' (seq or par)").c_str());
  opt.parallel = backend == "par";
  // every number is checked for its range here, before any file is read
  auto at_least = [&](const std::optional<index_t>& v, index_t lo, const char* name) {
    if (!v || *v >= lo) return true;
    err = std::string(name) + " must be >= " + std::to_string(lo) + ", got " + std::to_string(*v);
    return false;
  };
  if (!at_least(budget, 0, "--budget") || !at_least(window, 1, "--window") || !at_least(kernel, 1, "--kernel") ||
      !at_least(sinks, 0, "--sinks") || !at_least(recent, 0, "--recent"))
    return fail(err.c_str());
  if (kernel && *kernel % 2 == 0) return fail(("--kernel must be odd, got " + std::to_string(*kernel)).c_str());
  if (kernel) opt.r.kernel = *kernel;
  opt.budget = *budget;
  opt.window = window.value_or(0);
  opt.sinks = sinks.value_or(-1);
  opt.recent = recent.value_or(-1);

  std::string summary;
  const status st = tool::run(opt, summary);
  if (!st) return fail(st.message());
  std::printf("%s\n", summary.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::program::guarded_main("kvevict", [&] { return run(argc, argv); });
}
