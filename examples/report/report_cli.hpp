// report/report_cli.hpp: the quality report's part of kvevict-run: --report and its options, and
// the run (table on stdout, report.json and report.svg in --out-dir, progress on stderr).
//
//   kvrun::report_cli rc;  rc.add_to(app);                          // before app.parse
//   kvrun::report_options r;
//   st = rc.options(model, base, calibration, threads, r);             // checks the options
//   if (needs_lookahead(r)) { load the module; r.lookahead = &module; r.lookahead_path = path; }
//   st = rc.run(model, r, model_path, command);
//
// Errors are statuses whose messages name the option (kvevict-run prints them as one line).
#pragma once

#include <lookaheadkv/module.hpp>
#include <report/report.hpp>
#include <report/svg.hpp>
#include <runner/evict.hpp>
#include <runner/model.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kvrun {

struct report_cli {
  bool enabled = false;  ///< --report
  std::string out_dir = ".";
  index_t prompts = 32;
  std::vector<index_t> budgets{16, 32, 64, 128};
  std::vector<std::string> recipes, drivers;
  bool all_drivers = false;
  std::vector<CLI::Option*> need_report;  ///< the options that only --report takes

  /// Registers --report and its options on `app` (which must outlive this).
  void add_to(CLI::App& app) {
    app.add_flag("--report", enabled, "run the quality report: table on stdout, report.json and report.svg in --out-dir");
    need_report.push_back(app.add_option("--out-dir", out_dir, "report: directory for report.json and report.svg")
                          ->capture_default_str());
    need_report.push_back(app.add_option("--prompts", prompts, "report: test prompts")->capture_default_str());
    need_report.push_back(
        app.add_option("--budgets", budgets, "report: budgets, comma-separated")->delimiter(',')->capture_default_str());
    need_report.push_back(app.add_option("--recipes", recipes, "report: only these recipes (comma-separated)")->delimiter(','));
    need_report.push_back(app.add_option("--drivers", drivers, "report: only these drivers (comma-separated)")->delimiter(','));
    need_report.push_back(
        app.add_flag("--all-drivers", all_drivers, "report: every supported recipe x driver pair, not the default matrix"));
  }

  /// The report's options from these and the command line's eviction options `base`.
  status options(const model& m, const evict_options& base, index_t calibration, int threads, report_options& r) const {
    r = report_options{};
    r.prompts = prompts;
    r.budgets = budgets;
    r.base = base;
    r.calibration = calibration;
    r.threads = threads;
    r.all_drivers = all_drivers;
    for (const std::string& name : recipes) {
      method x;
      if (auto st = parse_method(name, x); !st.ok()) return status::error(st.code(), "--recipes: %s", st.message());
      r.recipes.push_back(x);
    }
    for (const std::string& name : drivers) {
      driver_kind d;
      if (auto st = parse_driver(name, d); !st.ok()) return status::error(st.code(), "--drivers: %s", st.message());
      r.drivers.push_back(d);
    }
    const int seq_len = m.cfg().seq_len;
    for (const index_t b : budgets)
      if (b < 1 || b > seq_len)
        return status::error(errc::invalid_argument, "--budgets: %lld is outside [1, %d]", static_cast<long long>(b), seq_len);
    if (prompts < 1) return status::error(errc::invalid_argument, "--prompts must be >= 1, got %lld", static_cast<long long>(prompts));
    if (std::error_code ec; !std::filesystem::is_directory(out_dir, ec))
      return status::error(errc::invalid_argument, "--out-dir %s is not a directory", out_dir.c_str());
    if (calibration < 1)
      return status::error(errc::invalid_argument, "--calibration must be >= 1, got %lld", static_cast<long long>(calibration));
    return {};
  }

  /// Runs the report `r` (options() and, if needs_lookahead(r), the module) and writes its files;
  /// `model_path` names the model in them, `command` is recorded in the JSON.
  status run(const model& m, report_options r, const std::string& model_path, const std::string& command) const {
    std::vector<report_config> configs;
    KVEVICT_TRY(report_configs(m.cfg(), r, configs));
    r.progress = [](const char* line) { std::fprintf(stderr, "%s\n", line); };
    report_result result;
    KVEVICT_TRY(run_report(m, r, result));
    std::fputs(report_table(result).c_str(), stdout);
    std::string name = model_path;
    if (const auto slash = name.find_last_of('/'); slash != std::string::npos) name = name.substr(slash + 1);
    if (const auto dot = name.rfind(".bin"); dot != std::string::npos && dot + 4 == name.size()) name.resize(dot);
    const std::string json = out_dir + "/report.json", svg = out_dir + "/report.svg";
    KVEVICT_TRY(write_text(json, report_json(result, name, command)));
    KVEVICT_TRY(write_text(svg, report_svg(result, name)));
    std::fprintf(stderr, "report: wrote %s and %s\n", json.c_str(), svg.c_str());
    return {};
  }

 private:
  static status write_text(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
    if (!f.flush()) return status::error(errc::io_error, "cannot write %s", path.c_str());
    return {};
  }
};

/// Whether report `r` runs the lookaheadkv method (every method runs unless --recipes leaves it out).
inline bool needs_lookahead(const report_options& r) {
  return r.recipes.empty() || std::find(r.recipes.begin(), r.recipes.end(), method::lookaheadkv) != r.recipes.end();
}

}  // namespace kvrun
