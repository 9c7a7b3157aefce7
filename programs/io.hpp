// programs/io.hpp: how kvevict's programs (the `kvevict` tool, kvevict-run, kvevict-lookahead,
// kvevict-headgates) read inputs and write outputs. Not part of the library (which does no file I/O);
// the rules are docs/conventions.md, "Programs: inputs, outputs, errors".
//
//   io::input_file in;                                   // regular files only, size known first
//   KVEVICT_TRY(io::input_file::open(path, "checkpoint", io::limit::model_bytes, in));
//   KVEVICT_TRY(io::check_paths({{"--k", k}}, {{"--scores", s}, {"--kept", kept}}));  // at start
//   io::output_transaction out;                          // every output of the run, all or nothing
//   KVEVICT_TRY(out.stage(s, bytes_s));                  // temp file in the same directory, fsync'ed
//   KVEVICT_TRY(out.stage(kept, bytes_kept));
//   KVEVICT_TRY(out.commit());                           // renames into place only now
//
// A failure anywhere before commit() leaves the previous files untouched and removes the temp
// files (the destructor does it). POSIX only.
#pragma once

#include <kvevict/status.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace kvevict::io {

/// Upper bounds on input files, in bytes: a regular file larger than its kind's bound is rejected
/// before anything is read (bigger inputs are possible in principle but not for these programs).
namespace limit {
inline constexpr std::uint64_t npy_bytes = std::uint64_t(16) << 30;       ///< a tensor for the kvevict tool
inline constexpr std::uint64_t model_bytes = std::uint64_t(16) << 30;     ///< a llama2.c checkpoint
inline constexpr std::uint64_t tokenizer_bytes = std::uint64_t(64) << 20; ///< a llama2.c tokenizer
inline constexpr std::uint64_t module_bytes = std::uint64_t(4) << 30;     ///< a LookaheadKV module
inline constexpr std::uint64_t token_lines_bytes = std::uint64_t(1) << 30; ///< a file of token-id lines (prompts)
}  // namespace limit

namespace detail {
inline const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}
}  // namespace detail

/// An input opened for reading: a regular file of known size, at most `max_bytes`. Opened with
/// O_NONBLOCK so that a FIFO cannot block the open; FIFOs, devices (/dev/zero) and directories are
/// rejected from the open descriptor's fstat (no race between the check and the read).
class input_file {
 public:
  input_file() = default;
  input_file(const input_file&) = delete;
  input_file& operator=(const input_file&) = delete;
  input_file(input_file&& o) noexcept { swap(o); }
  input_file& operator=(input_file&& o) noexcept {
    swap(o);
    return *this;
  }
  ~input_file() {
    if (f_) std::fclose(f_);
  }

  /// Errors (io_error; `what` names the kind of input, as the program's loaders do):
  ///   checkpoint: cannot open 'm.bin': No such file or directory
  ///   tokenizer: '/dev/zero' is not a regular file (a character device)
  ///   lookahead module: 'big.bin' has 5000000000 bytes, more than the 4294967296-byte limit
  static status open(const std::string& path, const char* what, std::uint64_t max_bytes, input_file& out) {
    out = input_file{};
    const char* p = path.c_str();
    if (path.empty()) return status::error(errc::io_error, "%s: the path is empty", what);
    const int fd = ::open(p, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) return status::error(errc::io_error, "%s: cannot open '%s': %s", what, p, std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return status::error(errc::io_error, "%s: cannot stat '%s': %s", what, p, std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return status::error(errc::io_error, "%s: '%s' is not a regular file (%s)", what, p, detail::file_kind(st.st_mode));
    }
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size > max_bytes) {
      ::close(fd);
      return status::error(errc::io_error, "%s: '%s' has %llu bytes, more than the %llu-byte limit", what, p,
                           static_cast<unsigned long long>(size), static_cast<unsigned long long>(max_bytes));
    }
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    std::FILE* f = ::fdopen(fd, "rb");
    if (f == nullptr) {
      const int err = errno;
      ::close(fd);
      return status::error(errc::io_error, "%s: cannot open '%s': %s", what, p, std::strerror(err));
    }
    out.f_ = f;
    out.what_ = what;
    out.size_ = size;
    out.path_ = path;
    return {};
  }

  std::FILE* get() const noexcept { return f_; }
  /// The file's size when it was opened (every size read from the file is checked against it).
  std::uint64_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }

  /// Reads exactly n bytes at the current position; a short read is an error (the file shrank).
  status read_exact(void* dst, std::size_t n) const {
    if (n == 0) return {};
    if (std::fread(dst, 1, n, f_) != n)
      return status::error(errc::io_error, "%s: cannot read %zu bytes of '%s' (%s)", what_, n, path_.c_str(),
                           std::ferror(f_) ? std::strerror(errno) : "the file is shorter than when it was opened");
    return {};
  }

 private:
  std::FILE* f_ = nullptr;
  std::uint64_t size_ = 0;
  std::string path_;
  const char* what_ = "input";
  void swap(input_file& o) noexcept {
    std::swap(f_, o.f_);
    std::swap(what_, o.what_);
    std::swap(size_, o.size_);
    std::swap(path_, o.path_);
  }
};

/// Reads a whole input file (see input_file::open for the checks): allocates only its real size.
inline status read_file(const std::string& path, const char* what, std::uint64_t max_bytes,
                        std::vector<unsigned char>& out) {
  out.clear();
  input_file in;
  KVEVICT_TRY(input_file::open(path, what, max_bytes, in));
  out.resize(static_cast<std::size_t>(in.size()));
  KVEVICT_TRY(in.read_exact(out.data(), out.size()));
  if (std::fgetc(in.get()) != EOF)
    return status::error(errc::io_error, "%s: '%s' grew while it was read", what, path.c_str());
  return {};
}

/// A file of token-id sequences (kvevict-lookahead's and kvevict-headgates' --prompts): one sequence a
/// line, token ids as decimal integers separated by spaces, blank lines skipped. Errors name the file
/// and the line; `what` names the option for read_file's messages. The ids' range is the caller's check.
inline status read_token_lines(const std::string& path, const char* what, std::vector<std::vector<int>>& out) {
  std::vector<unsigned char> bytes;
  KVEVICT_TRY(read_file(path, what, limit::token_lines_bytes, bytes));
  out.clear();
  std::istringstream lines(std::string(bytes.begin(), bytes.end()));
  std::string line;
  for (long long n = 1; std::getline(lines, line); ++n) {
    std::vector<int> ids;
    std::istringstream words(line);
    std::string w;
    while (words >> w) {
      long long v = 0;
      std::size_t used = 0;
      bool ok = !w.empty() && w.size() <= 9;
      if (ok) {
        try {
          v = std::stoll(w, &used);
        } catch (const std::exception&) {
          ok = false;
        }
      }
      if (!ok || used != w.size() || v < 0)
        return status::error(errc::invalid_argument, "%s:%lld: \"%s\" is not a token id (a non-negative integer)",
                             path.c_str(), n, w.c_str());
      ids.push_back(static_cast<int>(v));
    }
    if (!ids.empty()) out.push_back(std::move(ids));
  }
  if (out.empty()) return status::error(errc::invalid_argument, "%s: no prompts", path.c_str());
  return {};
}

/// A path given on the command line and the option that named it (for messages).
struct named_path {
  const char* option;
  std::string path;
};

namespace detail {
/// The identity of a path for equality: (device, inode) when it exists, else its normalised
/// absolute form (symlinks in the existing part resolved).
struct path_identity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  std::string normal;
  bool same(const path_identity& o) const {
    if (exists && o.exists) return dev == o.dev && ino == o.ino;
    return normal == o.normal;
  }
};
inline path_identity identity_of(const std::string& path) {
  path_identity id;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    id.exists = true;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
  }
  std::error_code ec;
  auto n = std::filesystem::weakly_canonical(std::filesystem::absolute(path, ec), ec);
  id.normal = ec ? path : n.lexically_normal().string();
  return id;
}
inline std::string parent_dir(const std::string& path) {
  const auto parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}
}  // namespace detail

/// Checks, before any work: every output's directory exists and a file can be created in it (a
/// probe file is created and removed), an existing output
/// is a regular file (never a FIFO, device or directory: it is replaced by rename), no two
/// outputs are the same file, and no output is one of the inputs (same file by inode, or by
/// normalised path when it does not exist yet). Entries with an empty path are skipped.
inline status check_paths(const std::vector<named_path>& inputs, const std::vector<named_path>& outputs) {
  std::vector<detail::path_identity> in_ids, out_ids;
  for (const auto& i : inputs) in_ids.push_back(i.path.empty() ? detail::path_identity{} : detail::identity_of(i.path));
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    const auto& out = outputs[o];
    out_ids.push_back(out.path.empty() ? detail::path_identity{} : detail::identity_of(out.path));
    if (out.path.empty()) continue;
    const char* p = out.path.c_str();
    if (out.path.back() == '/')
      return status::error(errc::io_error, "%s %s: names a directory, not a file", out.option, p);
    const std::string dir = detail::parent_dir(out.path);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return status::error(errc::io_error, "%s %s: the directory %s does not exist", out.option, p, dir.c_str());
    // writable means a file can be created there (what stage() will do): try it, root included
    std::string probe = (std::filesystem::path(dir) / ".kvevict-probe-XXXXXX").string();
    const int fd = ::mkstemp(probe.data());
    if (fd < 0)
      return status::error(errc::io_error, "%s %s: cannot create files in %s: %s", out.option, p, dir.c_str(),
                           std::strerror(errno));
    ::close(fd);
    ::unlink(probe.c_str());
    if (::lstat(p, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
      return status::error(errc::io_error, "%s %s: exists and is %s, not a regular file", out.option, p,
                           detail::file_kind(st.st_mode));
    if (::stat(p, &st) == 0 && !S_ISREG(st.st_mode))
      return status::error(errc::io_error, "%s %s: exists and is %s, not a regular file", out.option, p,
                           detail::file_kind(st.st_mode));
    for (std::size_t e = 0; e < o; ++e)
      if (!outputs[e].path.empty() && out_ids[o].same(out_ids[e]))
        return status::error(errc::invalid_argument, "%s and %s name the same file %s: give each output its own path",
                             outputs[e].option, out.option, p);
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (!inputs[i].path.empty() && out_ids[o].same(in_ids[i]))
        return status::error(errc::invalid_argument, "%s %s is also the input %s: an output never replaces an input",
                             out.option, p, inputs[i].option);
  }
  return {};
}

/// The outputs of one run, written all or nothing: stage() writes each to a temporary file in its
/// destination's directory (so the final rename stays on one file system) and fsyncs it; commit()
/// renames them into place once every output is staged. Until commit() the previous files are
/// untouched; the destructor removes every temporary file not committed. A rename failing inside
/// commit() (which needs no space) stops it and is reported; outputs renamed before it stay.
class output_transaction {
 public:
  output_transaction() = default;
  output_transaction(const output_transaction&) = delete;
  output_transaction& operator=(const output_transaction&) = delete;
  ~output_transaction() { discard(); }

  /// Writes `n` bytes for `path` into a new temporary file next to it.
  status stage(const std::string& path, const void* data, std::size_t n) {
    const std::string dir = detail::parent_dir(path);
    std::string tmp = (std::filesystem::path(dir) / ("." + std::filesystem::path(path).filename().string() +
                                                     ".tmp-XXXXXX")).string();
    const int fd = ::mkstemp(tmp.data());
    if (fd < 0) return status::error(errc::io_error, "%s: cannot create a temporary file in %s: %s", path.c_str(),
                                     dir.c_str(), std::strerror(errno));
    staged_.push_back({tmp, path});
    const mode_t mask = ::umask(0);
    ::umask(mask);
    (void)::fchmod(fd, 0666 & ~mask);  // what fopen would have created (mkstemp makes 0600)
    const auto* p = static_cast<const unsigned char*>(data);
    std::size_t left = n;
    while (left > 0) {
      const ssize_t w = ::write(fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int err = w < 0 ? errno : EIO;
        ::close(fd);
        return status::error(errc::io_error, "%s: cannot write (%zu of %zu bytes written): %s", path.c_str(), n - left,
                             n, std::strerror(err));
      }
      p += w;
      left -= static_cast<std::size_t>(w);
    }
    if (::fsync(fd) != 0) {
      const int err = errno;
      ::close(fd);
      return status::error(errc::io_error, "%s: cannot flush to disk: %s", path.c_str(), std::strerror(err));
    }
    if (::close(fd) != 0) return status::error(errc::io_error, "%s: cannot write: %s", path.c_str(), std::strerror(errno));
    return {};
  }
  status stage(const std::string& path, const std::string& text) { return stage(path, text.data(), text.size()); }
  status stage(const std::string& path, const std::vector<unsigned char>& bytes) {
    return stage(path, bytes.data(), bytes.size());
  }

  /// Renames every staged file into place, then syncs their directories.
  status commit() {
    std::vector<std::string> dirs;
    for (std::size_t i = 0; i < staged_.size(); ++i) {
      if (::rename(staged_[i].tmp.c_str(), staged_[i].path.c_str()) != 0)
        return status::error(errc::io_error, "%s: cannot rename the finished temporary file into place: %s",
                             staged_[i].path.c_str(), std::strerror(errno));
      staged_[i].tmp.clear();
      dirs.push_back(detail::parent_dir(staged_[i].path));
    }
    staged_.clear();
    for (const auto& d : dirs) {
      const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (fd >= 0) {
        (void)::fsync(fd);  // the renames survive a crash; EINVAL on some file systems is harmless
        ::close(fd);
      }
    }
    return {};
  }

  /// Removes the temporary files of everything not committed.
  void discard() noexcept {
    for (const auto& s : staged_)
      if (!s.tmp.empty()) ::unlink(s.tmp.c_str());
    staged_.clear();
  }

 private:
  struct staged_file {
    std::string tmp, path;
  };
  std::vector<staged_file> staged_;
};

}  // namespace kvevict::io
