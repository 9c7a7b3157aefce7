// programs/shipped_models.hpp: where kvevict's programs (kvevict-run, kvevict-lookahead,
// kvevict-headgates) find the files shipped in models/ (the stories260K checkpoint and tokenizer,
// the trained LookaheadKV module, the head masks) by default, and how their outputs name inputs.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

#ifndef KVEVICT_SOURCE_DIR
#  define KVEVICT_SOURCE_DIR "."
#endif

namespace kvevict::program {

/// The shipped file `name` (a path under models/). An installed tool uses its installed copy,
/// <directory of the executable>/KVEVICT_MODELS_FROM_BINDIR/name (cmake/kvevictInstall.cmake sets
/// the macro from the GNU install directories, e.g. "../share/kvevict/models"), found through
/// /proc/self/exe, so a moved install prefix still works. Anywhere else (a binary in the build
/// tree) it is the source tree's models/name.
inline std::string shipped_model(const std::string& name) {
#ifdef KVEVICT_MODELS_FROM_BINDIR
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path installed = (exe.parent_path() / KVEVICT_MODELS_FROM_BINDIR / name).lexically_normal();
    if (std::filesystem::is_regular_file(installed, ec)) return installed.string();
  }
#endif
  return KVEVICT_SOURCE_DIR "/models/" + name;
}

/// How outputs (report.json) name an input file: a file in the source tree by its path inside it
/// (models/duo/stories260K.tsv), so committed outputs do not carry one machine's checkout path;
/// any other path as given.
inline std::string recorded_path(const std::string& path) {
  const std::string root = KVEVICT_SOURCE_DIR "/";
  return path.compare(0, root.size(), root) == 0 ? path.substr(root.size()) : path;
}

}  // namespace kvevict::program
