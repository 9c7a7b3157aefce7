// Hostile input to kvevict's programs (issue 17), one class per test case: non-regular or bounded
// inputs (FIFOs, /dev/zero, directories), sizes that lie or are absurd, output paths that are
// invalid or collide, a file-size limit hit while writing (RLIMIT_FSIZE in the child), absurd
// numbers, out of memory, a full stdout. Every failure must be ONE stderr line
// `<program>: ...`, a non-zero exit, nothing on stdout, no partial or temporary file, and the
// previous outputs byte-identical. The programs run as child processes (fork + exec) with a
// watchdog, so a hang is a failure, not a stuck test.
#include "support.hpp"

#include "io.hpp"
#include "main.hpp"
#include "npy.hpp"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#if !defined(KVEVICT_TOOL_PATH) || !defined(KVEVICT_RUN_PATH) || !defined(KVEVICT_LOOKAHEAD_PATH)
#  error "KVEVICT_TOOL_PATH, KVEVICT_RUN_PATH and KVEVICT_LOOKAHEAD_PATH (the programs) must be defined by the build"
#endif

namespace fs = std::filesystem;
using namespace kvevict;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool under_asan = true;
#elif defined(__has_feature)
#  if __has_feature(address_sanitizer)
constexpr bool under_asan = true;
#  else
constexpr bool under_asan = false;
#  endif
#else
constexpr bool under_asan = false;
#endif

struct limits {
  rlim_t file_bytes = RLIM_INFINITY;    // RLIMIT_FSIZE: a full disk, as the writer sees it
  rlim_t address_bytes = RLIM_INFINITY; // RLIMIT_AS: a memory limit
  bool stdout_full = false;             // stdout is /dev/full
};

struct outcome {
  int status = -1;  // exit status, or 128 + signal
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

/// Runs argv[0] with the given limits; a watchdog kills it after 60 s (a hang). stdout and stderr
/// are pipes (a file-size limit does not apply to them), drained while the child runs.
outcome run(const std::vector<std::string>& args, const limits& lim = {}) {
  int out_pipe[2], err_pipe[2];
  REQUIRE(::pipe(out_pipe) == 0);
  REQUIRE(::pipe(err_pipe) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int o = lim.stdout_full ? ::open("/dev/full", O_WRONLY) : out_pipe[1];
    if (o < 0) ::_exit(126);
    ::dup2(o, 1);
    ::dup2(err_pipe[1], 2);
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    if (lim.file_bytes != RLIM_INFINITY) {
      const rlimit r{lim.file_bytes, lim.file_bytes};
      ::setrlimit(RLIMIT_FSIZE, &r);
    }
    if (lim.address_bytes != RLIM_INFINITY) {
      const rlimit r{lim.address_bytes, lim.address_bytes};
      ::setrlimit(RLIMIT_AS, &r);
    }
    ::alarm(60);  // SIGALRM kills a hung child
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  outcome r;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  char buf[4096];
  while (open_fds > 0) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, static_cast<std::size_t>(n));
      } else {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  int ws = 0;
  REQUIRE(::waitpid(pid, &ws, 0) == pid);
  r.status = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
  return r;
}

/// The failure contract: exit 1 (not a signal, not 0), nothing on stdout, one stderr line
/// `<program>: ...` containing `needle`.
void require_one_line_failure(const outcome& r, const std::string& program, const std::string& needle,
                              int code = 1) {
  INFO("stderr: " << r.err << " stdout: " << r.out);
  CHECK(r.status == code);
  CHECK(r.out.empty());
  REQUIRE(!r.err.empty());
  CHECK(r.err.back() == '\n');
  CHECK(r.err.find('\n') == r.err.size() - 1);
  CHECK(r.err.rfind(program + ": ", 0) == 0);
  CHECK(r.err.find(needle) != std::string::npos);
}

/// The same for a program that prints progress on stderr while it works (training, the report):
/// the error is the last stderr line; stdout may hold what the program printed before failing.
void require_last_line_failure(const outcome& r, const std::string& program, const std::string& needle) {
  INFO("stderr: " << r.err);
  CHECK(r.status == 1);
  REQUIRE(r.err.size() > 1);
  CHECK(r.err.back() == '\n');
  const std::size_t start = r.err.find_last_of("\n\r", r.err.size() - 2);
  const std::string last = r.err.substr(start == std::string::npos ? 0 : start + 1);
  CHECK(last.rfind(program + ": ", 0) == 0);
  CHECK(last.find(needle) != std::string::npos);
}

/// A scratch directory per test case, removed at the end.
struct scratch_dir {
  fs::path path;
  explicit scratch_dir(const char* name)
      : path(fs::temp_directory_path() / ("kvevict_hostile_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  /// Every file name in the directory (to spot partial or temporary files).
  std::vector<std::string> names() const {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(path)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

/// A .npy header (v1.0) announcing `shape` of dtype `descr`, followed by `data_bytes` zero bytes.
std::string npy_with(const std::string& descr, const std::string& shape, std::size_t data_bytes) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  dict.append((64 - (10 + dict.size() + 1) % 64) % 64, ' ');
  dict += '\n';
  std::string f("\x93NUMPY\x01\x00", 8);
  f += static_cast<char>(dict.size() & 0xff);
  f += static_cast<char>(dict.size() >> 8);
  return f + dict + std::string(data_bytes, '\0');
}

/// A small valid SnapKV problem: q [2][4][8], k [2][64][8] (float32).
void write_problem(const scratch_dir& d) {
  auto g = kvtest::rng(11);
  const auto q = kvtest::random_floats(g, 2 * 4 * 8, -1, 1), k = kvtest::random_floats(g, 2 * 64 * 8, -1, 1);
  REQUIRE(npy::write_f32(d.file("q.npy"), {2, 4, 8}, q.data()).ok());
  REQUIRE(npy::write_f32(d.file("k.npy"), {2, 64, 8}, k.data()).ok());
}

std::vector<std::string> tool_args(const scratch_dir& d, std::vector<std::string> extra) {
  std::vector<std::string> a = {KVEVICT_TOOL_PATH, "--q", d.file("q.npy"), "--k", d.file("k.npy"), "--budget", "16",
                                "--scores", d.file("scores.npy"), "--kept", d.file("kept.npy")};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("hostile: the kvevict tool rejects inputs that are not bounded regular files, without hanging") {
  scratch_dir d("inputs");
  write_problem(d);
  const std::string fifo = d.file("fifo.npy");
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  auto with_k = [&](const std::string& k) {
    auto a = tool_args(d, {});
    a[4] = k;
    return a;
  };
  require_one_line_failure(run(with_k(fifo)), "kvevict", "not a regular file (a FIFO)");
  require_one_line_failure(run(with_k("/dev/zero")), "kvevict", "npy: '/dev/zero' is not a regular file (a character device)");
  require_one_line_failure(run(with_k(d.path.string())), "kvevict", "not a regular file (a directory)");
  require_one_line_failure(run(with_k(d.file("missing.npy"))), "kvevict", "missing.npy: no such file");
  // an input given but not needed by the recipe is still read: a missing --q is an error
  auto knorm = tool_args(d, {"--recipe", "knorm"});
  knorm[2] = d.file("missing_q.npy");
  require_one_line_failure(run(knorm), "kvevict", "missing_q.npy: no such file");
  CHECK(d.names() == std::vector<std::string>{"fifo.npy", "k.npy", "q.npy"});
}

TEST_CASE("hostile: sizes in a file are checked against its real size and sane limits before allocating") {
  scratch_dir d("sizes");
  write_problem(d);
  auto with_k = [&](const std::string& bytes) {
    write_bytes(d.file("bad.npy"), bytes);
    auto a = tool_args(d, {});
    a[4] = d.file("bad.npy");
    return run(a);
  };
  // a header declaring 2^40 elements over 16 bytes of data
  require_one_line_failure(with_k(npy_with("<f4", "(1, 1099511627776, 1)", 16)), "kvevict", "truncated: header says");
  // an empty array whose other dimensions are huge: nothing backs them, they are bounded anyway
  require_one_line_failure(with_k(npy_with("<f4", "(1, 1099511627776, 0)", 0)), "kvevict", "exceed the");
  // an empty axis with moderate dimensions: the tool has nothing to score (it used to write
  // [H][T] scores for T of the header's choosing)
  require_one_line_failure(with_k(npy_with("<f4", "(1, 100000000, 0)", 0)), "kvevict", "an empty axis leaves nothing");
  require_one_line_failure(with_k(npy_with("<f4", "(0, 100000000, 8)", 0)), "kvevict", "an empty axis leaves nothing");
  // trailing bytes, a header length past the end, a dimension overflowing 64 bits
  require_one_line_failure(with_k(npy_with("<f4", "(2, 64, 8)", 4096 + 4)), "kvevict", "trailing data");
  require_one_line_failure(with_k(std::string("\x93NUMPY\x01\x00\xff\xff", 10)), "kvevict", "runs past the end");
  require_one_line_failure(with_k(npy_with("<f4", "(99999999999999999999, 1, 1)", 0)), "kvevict", "does not fit in 64 bits");
  CHECK(d.names() == std::vector<std::string>{"bad.npy", "k.npy", "q.npy"});
}

TEST_CASE("hostile: absurd numbers are refused before any file is read") {
  scratch_dir d("numbers");
  write_problem(d);
  // the keys are a FIFO: an option error must come first, so reading would hang the test
  const std::string fifo = d.file("k_fifo.npy");
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  auto bad = [&](std::vector<std::string> extra, const std::string& needle) {
    auto a = tool_args(d, {});
    a[4] = fifo;
    for (std::size_t i = 0; i + 1 < extra.size(); i += 2) {
      auto it = std::find(a.begin(), a.end(), extra[i]);
      if (it != a.end()) *(it + 1) = extra[i + 1];
      else a.insert(a.end(), {extra[i], extra[i + 1]});
    }
    require_one_line_failure(run(a), "kvevict", needle);
  };
  bad({"--budget", "-5"}, "--budget must be >= 0, got -5");
  bad({"--window", "-3"}, "--window must be >= 1, got -3");
  bad({"--window", "0"}, "--window must be >= 1, got 0");
  bad({"--kernel", "4"}, "--kernel must be odd, got 4");
  bad({"--kernel", "-1"}, "--kernel must be >= 1");
  bad({"--sinks", "-2"}, "--sinks must be >= 0, got -2");
  bad({"--recent", "-1"}, "--recent must be >= 0, got -1");
  bad({"--budget", "99999999999999999999999"}, "99999999999999999999999 is outside");
  bad({"--budget", "twelve"}, "--budget: 'twelve' is not a decimal integer");
  bad({"--window", "0x10"}, "is not a decimal integer");
  bad({"--backend", "gpu"}, "unknown --backend 'gpu'");
  CHECK(d.names() == std::vector<std::string>{"k.npy", "k_fifo.npy", "q.npy"});
}

TEST_CASE("hostile: output paths are checked at start: writable, distinct, never an input") {
  scratch_dir d("paths");
  write_problem(d);
  auto with = [&](const std::string& scores, const std::string& kept) {
    auto a = tool_args(d, {});
    a[8] = scores;
    a[10] = kept;
    return run(a);
  };
  require_one_line_failure(with(d.file("same.npy"), d.file("same.npy")), "kvevict",
                           "--scores and --kept name the same file");
  // the same file through another spelling of the path
  require_one_line_failure(with(d.file("same.npy"), d.path.string() + "/./same.npy"), "kvevict", "name the same file");
  require_one_line_failure(with(d.file("k.npy"), d.file("kept.npy")), "kvevict", "is also the input --k");
  require_one_line_failure(with(d.file("s.npy"), d.file("q.npy")), "kvevict", "is also the input --q");
  fs::create_hard_link(d.file("k.npy"), d.file("k_link.npy"));
  require_one_line_failure(with(d.file("k_link.npy"), d.file("kept.npy")), "kvevict", "is also the input --k");
  require_one_line_failure(with(d.file("no/such/dir/s.npy"), d.file("kept.npy")), "kvevict", "does not exist");
  require_one_line_failure(with("/proc/kvevict_s.npy", d.file("kept.npy")), "kvevict", "cannot create files in /proc");
  const std::string fifo = d.file("out_fifo.npy");
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  require_one_line_failure(with(fifo, d.file("kept.npy")), "kvevict", "exists and is a FIFO");
  require_one_line_failure(with("/dev/null", d.file("kept.npy")), "kvevict", "exists and is a character device");
  require_one_line_failure(with(d.path.string(), d.file("kept.npy")), "kvevict", "exists and is a directory");
  CHECK(d.names() == std::vector<std::string>{"k.npy", "k_link.npy", "out_fifo.npy", "q.npy"});
}

TEST_CASE("hostile: a file-size limit while writing leaves the previous outputs untouched and no partial file") {
  scratch_dir d("fsize");
  write_problem(d);
  // a successful run first: its outputs are "the previous files"
  const auto ok = run(tool_args(d, {}));
  REQUIRE_MESSAGE(ok.status == 0, ok.err);
  const std::string scores = slurp(d.file("scores.npy")), kept = slurp(d.file("kept.npy"));
  REQUIRE(scores.size() > 512);
  // a different selection, so that new outputs would differ; writes beyond 256 bytes fail
  limits lim;
  lim.file_bytes = 256;
  const auto r = run(tool_args(d, {"--recipe", "knorm"}), lim);
  require_one_line_failure(r, "kvevict", "File too large");
  CHECK(slurp(d.file("scores.npy")) == scores);
  CHECK(slurp(d.file("kept.npy")) == kept);
  CHECK(d.names() == std::vector<std::string>{"k.npy", "kept.npy", "q.npy", "scores.npy"});
}

TEST_CASE("hostile: an output transaction whose second file fails leaves both previous files untouched") {
  scratch_dir d("txn");
  write_bytes(d.file("a.bin"), "previous a");
  write_bytes(d.file("b.bin"), "previous b");
  // in a child: RLIMIT_FSIZE lets the small first output through and stops the big second one
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    const rlimit rl{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    int code = 0;
    {
      io::output_transaction t;
      if (!t.stage(d.file("a.bin"), std::string("new a")).ok()) code = 2;
      const status st = t.stage(d.file("b.bin"), std::string(8192, 'b'));
      if (st.ok() || std::string(st.message()).find("File too large") == std::string::npos) code = 3;
    }  // destroyed without commit
    ::_exit(code);
  }
  int ws = 0;
  REQUIRE(::waitpid(pid, &ws, 0) == pid);
  REQUIRE(WIFEXITED(ws));
  CHECK(WEXITSTATUS(ws) == 0);
  CHECK(slurp(d.file("a.bin")) == "previous a");
  CHECK(slurp(d.file("b.bin")) == "previous b");
  CHECK(d.names() == std::vector<std::string>{"a.bin", "b.bin"});
  // and a committed transaction replaces both
  io::output_transaction t;
  REQUIRE(t.stage(d.file("a.bin"), std::string("new a")).ok());
  REQUIRE(t.stage(d.file("b.bin"), std::string("new b")).ok());
  CHECK(slurp(d.file("a.bin")) == "previous a");  // nothing replaced before commit
  REQUIRE(t.commit().ok());
  CHECK(slurp(d.file("a.bin")) == "new a");
  CHECK(slurp(d.file("b.bin")) == "new b");
  CHECK(d.names() == std::vector<std::string>{"a.bin", "b.bin"});
}

TEST_CASE("hostile: out of memory and a full stdout end in one line, not a crash") {
  scratch_dir d("memory");
  write_problem(d);
  // stdout is /dev/full: the summary line cannot be written, which is an error
  limits full;
  full.stdout_full = true;
  const auto r = run(tool_args(d, {}), full);
  CHECK(r.status == 1);
  CHECK(r.err == "kvevict: cannot write to standard output\n");
  if (!under_asan) {  // ASan reserves terabytes of address space: RLIMIT_AS cannot apply there
    // keys of 64 MiB under a 48 MiB address-space limit: the read cannot allocate
    std::vector<float> big(static_cast<std::size_t>(1) << 24, 0.5f);
    REQUIRE(npy::write_f32(d.file("big.npy"), {1, index_t(1) << 21, 8}, big.data()).ok());
    auto a = tool_args(d, {"--recipe", "knorm"});
    a[4] = d.file("big.npy");
    a.erase(a.begin() + 1, a.begin() + 3);  // no --q
    limits lim;
    lim.address_bytes = rlim_t(48) << 20;
    require_one_line_failure(run(a, lim), "kvevict", "out of memory");
  }
  // the wrapper itself: every kind of escape becomes one line and exit status 1
  CHECK(program::guarded_main("p", [] () -> int { throw std::bad_alloc(); }) == 1);
  CHECK(program::guarded_main("p", [] () -> int { throw std::runtime_error("two\nlines"); }) == 1);
  CHECK(program::guarded_main("p", [] () -> int { throw 42; }) == 1);
  CHECK(program::guarded_main("p", [] { return 0; }) == 0);
}

// ---- kvevict-run and kvevict-lookahead -----------------------------------------------------------
// (exit status 2 is their documented status for command-line syntax errors, CLI11's and the
// integer validator's; every other error is 1)

namespace {
const std::string models = KVEVICT_SOURCE_DIR "/models";
const std::string module_path = models + "/lookahead/stories260K-n16.bin";

std::string first_bytes(const std::string& path, std::size_t n) { return slurp(path).substr(0, n); }

void put_i32(std::string& s, std::size_t at, std::int32_t v) {
  for (int i = 0; i < 4; ++i) s[at + static_cast<std::size_t>(i)] = static_cast<char>((static_cast<std::uint32_t>(v) >> (8 * i)) & 0xff);
}
}  // namespace

TEST_CASE("hostile: kvevict-run and kvevict-lookahead read only bounded regular files, without hanging") {
  scratch_dir d("runner_inputs");
  const std::string fifo = d.file("fifo.bin");
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  const std::string krun = KVEVICT_RUN_PATH, lkv = KVEVICT_LOOKAHEAD_PATH;
  require_one_line_failure((run({krun, "--model", fifo})), "kvevict-run", "checkpoint: '" + fifo + "' is not a regular file (a FIFO)");
  require_one_line_failure(run({krun, "--model", "/dev/zero"}), "kvevict-run", "is not a regular file (a character device)");
  require_one_line_failure(run({krun, "--tokenizer", fifo}), "kvevict-run", "tokenizer: '" + fifo + "' is not a regular file");
  require_one_line_failure(run({krun, "--tokenizer", "/dev/zero"}), "kvevict-run", "tokenizer: '/dev/zero' is not a regular file");
  require_one_line_failure(run({krun, "--recipe", "lookaheadkv", "--lookahead-module", fifo}), "kvevict-run",
                           "lookahead module: '" + fifo + "' is not a regular file");
  require_one_line_failure(run({lkv, "info", "--module", "/dev/zero"}), "kvevict-lookahead", "is not a regular file");
  require_one_line_failure(run({lkv, "info", "--module", fifo}), "kvevict-lookahead", "is not a regular file (a FIFO)");
  require_one_line_failure(run({lkv, "--model", fifo, "eval", "--test-pairs", "1"}), "kvevict-lookahead", "not a regular file");
  require_one_line_failure(run({lkv, "info", "--module", d.path.string()}), "kvevict-lookahead", "(a directory)");
}

TEST_CASE("hostile: declared dimensions are checked against the real file size before anything is allocated") {
  scratch_dir d("runner_sizes");
  const std::string lkv = KVEVICT_LOOKAHEAD_PATH, krun = KVEVICT_RUN_PATH;
  limits small;  // no allocation of the declared sizes may happen: 256 MiB of address space is plenty otherwise
  if (!under_asan) small.address_bytes = rlim_t(256) << 20;
  // a LookaheadKV module header declaring 2^30 layers (gigabytes of offsets and parameters) over 52 bytes
  std::string header = first_bytes(module_path, 52);
  REQUIRE(header.size() == 52);
  put_i32(header, 16, 1 << 30);  // n_layers
  write_bytes(d.file("huge_layers.bin"), header);
  require_one_line_failure(run({lkv, "info", "--module", d.file("huge_layers.bin")}, small), "kvevict-lookahead",
                           "1073741824 layers is more than the 65536 supported");
  // the same with no adapted projection: the parameter count (16 x 64 embedding values) then
  // matches a 4 KiB file, and only the layer bound stops a per-layer table of gigabytes (fuzzing)
  put_i32(header, 48, 0);  // placement
  write_bytes(d.file("emb_only_huge_layers.bin"), header + std::string(4 * 16 * 64, '\0'));
  require_one_line_failure(run({lkv, "info", "--module", d.file("emb_only_huge_layers.bin")}, small), "kvevict-lookahead",
                           "1073741824 layers is more than the 65536 supported");
  put_i32(header, 48, 127);
  put_i32(header, 16, 5);
  put_i32(header, 12, 1 << 30);  // dim: the parameter count overflows nothing but is absurd
  put_i32(header, 28, 1 << 30);  // hidden
  write_bytes(d.file("huge_dim.bin"), header);
  require_one_line_failure(run({lkv, "info", "--module", d.file("huge_dim.bin")}, small), "kvevict-lookahead",
                           "lookahead module");
  // a checkpoint header declaring a huge model over 28 bytes
  std::string ckpt(28, '\0');
  const std::int32_t dims[7] = {1 << 16, 1 << 30, 1000, 1, 1, 32000, 1 << 20};
  for (int i = 0; i < 7; ++i) put_i32(ckpt, 4 * static_cast<std::size_t>(i), dims[i]);
  write_bytes(d.file("huge.ckpt"), ckpt);
  require_one_line_failure(run({krun, "--model", d.file("huge.ckpt")}, small), "kvevict-run", "checkpoint");
  // a module whose parameters end early, and one with trailing bytes
  const std::string good = slurp(module_path);
  write_bytes(d.file("short.bin"), good.substr(0, good.size() - 4));
  require_one_line_failure(run({lkv, "info", "--module", d.file("short.bin")}), "kvevict-lookahead", "truncated by 4 bytes");
  write_bytes(d.file("long.bin"), good + "xxxx");
  require_one_line_failure(run({lkv, "info", "--module", d.file("long.bin")}), "kvevict-lookahead", "trailing 4 bytes");
}

TEST_CASE("hostile: kvevict-run and kvevict-lookahead validate every number before any work") {
  const std::string krun = KVEVICT_RUN_PATH, lkv = KVEVICT_LOOKAHEAD_PATH;
  // kvevict-lookahead's defaults train for minutes and evaluate 128 pairs: a check made after the
  // work would hit the 60 s watchdog
  require_one_line_failure(run({krun, "--calibration", "-5"}), "kvevict-run", "--calibration must be >= 1, got -5");
  require_one_line_failure(run({krun, "--recipe", "snapkv", "--window", "-3"}), "kvevict-run", "--window must be >= 1, got -3");
  require_one_line_failure(run({krun, "--recipe", "snapkv", "--sinks", "-7"}), "kvevict-run", "--sinks must be >= 0");
  require_one_line_failure(run({krun, "--seed", "-1"}), "kvevict-run", "--seed: -1 is outside", 2);
  require_one_line_failure(run({krun, "--steps", "99999999999999999999"}), "kvevict-run", "is outside", 2);
  require_one_line_failure(run({krun, "--recipe", "h2o", "--budget", "0x20"}), "kvevict-run", "is not a decimal integer", 2);
  require_one_line_failure(run({krun, "--recipe", "h2o", "--driver", "decode", "--evict-every", "-1"}), "kvevict-run",
                           "--evict-every must be >= 1, got -1");
  require_one_line_failure(run({krun, "--report", "--prompts", "-2"}), "kvevict-run", "--prompts must be >= 1");
  require_one_line_failure(run({lkv, "train", "--out", "/tmp/kvevict_never.bin", "--train-pairs", "-5"}), "kvevict-lookahead",
                           "--train-pairs must be >= 1, got -5");
  require_one_line_failure(run({lkv, "train", "--out", "/tmp/kvevict_never.bin", "--lr", "nan"}), "kvevict-lookahead",
                           "--lr nan is outside");
  require_one_line_failure(run({lkv, "train", "--out", "/tmp/kvevict_never.bin", "--seed", "-4"}), "kvevict-lookahead",
                           "--seed: -4 is outside", 2);
  require_one_line_failure(run({lkv, "train", "--out", "/tmp/kvevict_never.bin", "--rank", "0"}), "kvevict-lookahead",
                           "rank 0 is outside");
  require_one_line_failure(run({lkv, "eval", "--timing-pairs", "-1"}), "kvevict-lookahead", "--timing-pairs must be >= 1");
  require_one_line_failure(run({lkv, "eval", "--test-pairs", "0"}), "kvevict-lookahead", "--test-pairs must be >= 1, got 0");
  require_one_line_failure(run({lkv, "sweep", "--lrs", "0.01,-1"}), "kvevict-lookahead", "--lrs: -1 is outside");
  // --prompts files (testbed.py lookahead): both or neither, every token id checked before any work
  scratch_dir d("lookahead_prompts");
  write_bytes(d.file("ok.txt"), "1 50 60\n\n1 70 80 90\n");
  write_bytes(d.file("word.txt"), "1 50 60\n1 7x 80\n");
  write_bytes(d.file("vocab.txt"), "1 50 512\n");
  std::string long_prompt = "1";
  for (int i = 0; i < 510; ++i) long_prompt += " 5";
  write_bytes(d.file("long.txt"), long_prompt + "\n");
  const std::string out = "/tmp/kvevict_never.bin";
  require_one_line_failure(run({lkv, "train", "--out", out, "--prompts", d.file("ok.txt")}), "kvevict-lookahead",
                           "--prompts and --val-prompts go together");
  require_one_line_failure(run({lkv, "train", "--out", out, "--prompts", d.file("word.txt"), "--val-prompts", d.file("ok.txt")}),
                           "kvevict-lookahead", "word.txt:2: \"7x\" is not a token id");
  require_one_line_failure(run({lkv, "train", "--out", out, "--prompts", d.file("ok.txt"), "--val-prompts", d.file("vocab.txt")}),
                           "kvevict-lookahead", "vocab.txt: prompt 1: token 512 is outside the vocabulary");
  require_one_line_failure(run({lkv, "train", "--out", out, "--prompts", d.file("long.txt"), "--val-prompts", d.file("ok.txt")}),
                           "kvevict-lookahead", "prompt 1: 511 tokens + a response of 64 exceed the context of 512");
  require_one_line_failure(run({lkv, "train", "--out", out, "--prompts", d.file("none.txt"), "--val-prompts", d.file("ok.txt")}),
                           "kvevict-lookahead", "none.txt");
  CHECK(!fs::exists("/tmp/kvevict_never.bin"));
}

TEST_CASE("hostile: kvevict-run and kvevict-lookahead check their outputs at start and never leave partial files") {
  scratch_dir d("runner_outputs");
  const std::string krun = KVEVICT_RUN_PATH, lkv = KVEVICT_LOOKAHEAD_PATH;
  // train's output path is checked before minutes of training (the default run would hit the watchdog)
  require_one_line_failure(run({lkv, "train", "--out", "/proc/kvevict_module.bin"}), "kvevict-lookahead",
                           "cannot create files in /proc");
  require_one_line_failure(run({lkv, "train", "--out", d.file("no/dir/m.bin")}), "kvevict-lookahead", "does not exist");
  require_one_line_failure(run({lkv, "train", "--out", models + "/stories260K.bin"}), "kvevict-lookahead",
                           "is also the input --model");
  require_one_line_failure(run({lkv, "eval", "--json", module_path}), "kvevict-lookahead", "is also the input --module");
  require_one_line_failure(run({lkv, "eval", "--json", "/dev/null"}), "kvevict-lookahead", "exists and is a character device");
  require_one_line_failure(run({krun, "--report", "--out-dir", "/proc"}), "kvevict-run", "cannot create files in /proc");
  // the report under a file-size limit: report.json and report.svg keep their previous contents
  write_bytes(d.file("report.json"), "previous json");
  write_bytes(d.file("report.svg"), "previous svg");
  limits lim;
  lim.file_bytes = 512;
  require_last_line_failure(run({krun, "--report", "--prompts", "1", "--budgets", "32", "--recipes", "snapkv", "--threads", "1",
                                     "--out-dir", d.path.string()}, lim),
                            "kvevict-run", "File too large");
  CHECK(slurp(d.file("report.json")) == "previous json");
  CHECK(slurp(d.file("report.svg")) == "previous svg");
  // a tiny training under the same limit: the previous module survives whole
  write_bytes(d.file("m.bin"), "previous module");
  require_last_line_failure(run({lkv, "--threads", "1", "train", "--out", d.file("m.bin"), "--train-pairs", "2", "--val-pairs",
                                     "1", "--steps", "1", "--batch", "1", "--n-lookahead", "2", "--placement", "qv"}, lim),
                            "kvevict-lookahead", "File too large");
  CHECK(slurp(d.file("m.bin")) == "previous module");
  CHECK(d.names() == std::vector<std::string>{"m.bin", "report.json", "report.svg"});
}

TEST_CASE("hostile: the decode driver at a budget above a short prompt (issue 17's failing configuration) runs") {
  const outcome r = run({KVEVICT_RUN_PATH, "--recipe", "adakv", "--driver", "decode", "--budget", "32", "--prompt",
                              "Once upon a time there was a big dog", "--steps", "64"});
  INFO(r.err);
  CHECK(r.status == 0);
  CHECK(r.out.rfind("Once upon a time there was a big dog", 0) == 0);
}
