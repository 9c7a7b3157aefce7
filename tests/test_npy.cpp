#include "support.hpp"

#include <npy.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <unistd.h>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;
namespace fs = std::filesystem;

namespace {

// A scratch directory removed at exit.
struct scratch_dir {
  fs::path path;
  scratch_dir() {
    path = fs::temp_directory_path() / ("kvevict_test_npy_" + std::to_string(::getpid()));
    fs::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};
const scratch_dir& scratch() {
  static scratch_dir d;
  return d;
}

std::vector<unsigned char> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// A v1.0 file: magic, version, header length, `dict` (padded like numpy), then `data` bytes.
std::vector<unsigned char> npy_file(const std::string& dict, std::size_t data_bytes, unsigned char major = 1) {
  std::string header = dict;
  const std::size_t pre = major == 1 ? 10 : 12;
  while ((pre + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::vector<unsigned char> f = {0x93, 'N', 'U', 'M', 'P', 'Y', major, 0};
  const std::size_t n = header.size();
  f.push_back(static_cast<unsigned char>(n & 0xff));
  f.push_back(static_cast<unsigned char>((n >> 8) & 0xff));
  if (major != 1) {
    f.push_back(static_cast<unsigned char>((n >> 16) & 0xff));
    f.push_back(static_cast<unsigned char>((n >> 24) & 0xff));
  }
  f.insert(f.end(), header.begin(), header.end());
  for (std::size_t i = 0; i < data_bytes; ++i) f.push_back(static_cast<unsigned char>(i * 7));
  return f;
}
std::vector<unsigned char> npy_file(const std::string& descr, const std::string& shape, std::size_t data_bytes) {
  return npy_file("{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }", data_bytes);
}

status parse(const std::vector<unsigned char>& f, npy::array& a) {
  return npy::parse(f.data(), f.size(), "q.npy", a);
}
void require_format_error(const std::vector<unsigned char>& f, const std::string& needle) {
  npy::array a;
  const status st = parse(f, a);
  require_error(st, errc::format_error, needle);
  CHECK(a.bytes.empty());
  CHECK(a.shape.empty());
}

bool python_numpy_available(std::string& why) {
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0) {
    why = "/usr/bin/python3 -c 'import numpy' failed (no python3 or no numpy)";
    return false;
  }
  return true;
}

}  // namespace

TEST_CASE("npy: every dtype and rank 0..4 round-trips through memory and through a file") {
  auto g = kvtest::rng(5);
  const std::vector<std::vector<std::int64_t>> shapes = {{}, {0}, {7}, {3, 5}, {2, 0, 4}, {2, 3, 4}, {1, 2, 3, 5}};
  for (npy::dtype t : {npy::dtype::float32, npy::dtype::float16, npy::dtype::int32})
    for (const auto& shape : shapes) {
      CAPTURE(npy::dtype_name(t));
      CAPTURE(shape.size());
      npy::array a;
      a.type = t;
      a.shape = shape;
      a.bytes.resize(static_cast<std::size_t>(a.elements()) * npy::itemsize(t));
      for (auto& b : a.bytes) b = static_cast<unsigned char>(kvtest::uniform_int(g, 0, 255));
      std::vector<unsigned char> file;
      REQUIRE(npy::serialize(a, file).ok());
      CHECK(file.size() % 64 == a.bytes.size() % 64);  // header padded to a multiple of 64 bytes
      CHECK(file[10 + (file.size() - a.bytes.size() - 10) - 1] == '\n');
      npy::array b;
      REQUIRE(parse(file, b).ok());
      CHECK(b.type == a.type);
      CHECK(b.shape == a.shape);
      CHECK(b.bytes == a.bytes);
      const std::string path = scratch().file("rt.npy");
      REQUIRE(npy::write(path, a).ok());
      npy::array c;
      REQUIRE(npy::read(path, c).ok());
      CHECK(c.type == a.type);
      CHECK(c.shape == a.shape);
      CHECK(c.bytes == a.bytes);
    }
}

TEST_CASE("npy: write_f32 / write_i32 headers are numpy's, and views of the arrays") {
  const std::vector<float> q = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  const std::string path = scratch().file("q.npy");
  REQUIRE(npy::write_f32(path, {2, 3, 2}, q.data()).ok());
  npy::array a;
  REQUIRE(npy::read(path, a).ok());
  std::vector<unsigned char> file;
  REQUIRE(npy::serialize(a, file).ok());
  const std::string head(file.begin(), file.end() - static_cast<std::ptrdiff_t>(a.bytes.size()));
  CHECK(head.size() == 128);
  CHECK(head.substr(0, 8) == std::string("\x93NUMPY\x01\x00", 8));
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 2), }";
  CHECK(head.substr(10, dict.size()) == dict);
  CHECK(head.substr(10 + dict.size()) == std::string(128 - 10 - dict.size() - 1, ' ') + "\n");

  // [H][T][D] head-major and the same bytes read as [T][H][D]
  auto kv = value_of(npy::as_kv_view<float>(a));
  CHECK(kv.extent(0) == 2);
  CHECK(kv.extent(1) == 3);
  CHECK(kv(1, 2, 1) == 11.f);
  const npy::array& ca = a;
  auto tm = value_of(npy::as_kv_view<float>(ca, kv_layout::token_major));
  CHECK(tm.extent(0) == 3);  // heads
  CHECK(tm.extent(1) == 2);  // tokens
  CHECK(tm(2, 1, 0) == 10.f);  // token 1, head 2 = element [1][2][0]
  require_error(npy::as_kv_view<float16>(a).error(), errc::invalid_argument, "npy::as_kv_view: the array is float32, not float16");
  require_error(npy::as_matrix_view<float>(a).error(), errc::shape_mismatch, "is 2x3x2 (rank 3), not rank 2");

  const std::vector<std::int32_t> pos = {3, 1, 4, 1, 5, 9};
  REQUIRE(npy::write_i32(scratch().file("p.npy"), {2, 3}, pos.data()).ok());
  npy::array p;
  REQUIRE(npy::read(scratch().file("p.npy"), p).ok());
  CHECK(p.type == npy::dtype::int32);
  auto pv = value_of(npy::as_matrix_view<const std::int32_t>(p));
  CHECK(pv(1, 2) == 9);

  // float16 files viewed as kvevict::float16
  npy::array h;
  const std::vector<std::uint16_t> halves = {0x3c00, 0x4000, 0xc000, 0x7c00};  // 1, 2, -2, inf
  REQUIRE(npy::make_array(npy::dtype::float16, {1, 2, 2}, halves.data(), h).ok());
  auto hv = value_of(npy::as_kv_view<const float16>(h));
  CHECK(to_float(hv(0, 1, 0)) == -2.f);

  // writer errors
  require_error(npy::write_f32(path, {2, -1}, q.data()), errc::invalid_argument, "negative dimension -1");
  require_error(npy::write_f32(path, {1, 1, 1, 1, 1}, q.data()), errc::invalid_argument, "rank 5 exceeds 4");
  require_error(npy::write_f32(path, {2}, nullptr), errc::null_pointer, "data is null");
  require_error(npy::write_f32(scratch().file("no/such/dir/x.npy"), {1}, q.data()), errc::io_error, "cannot create");
  a.bytes.pop_back();
  require_error(npy::write(path, a), errc::invalid_argument, "shape 2x3x2 float32 needs 48 bytes but the array holds 47");
}

TEST_CASE("npy: malformed files give one specific line each") {
  // magic, version, header length
  require_format_error(bytes_of("NUMPY\x01\x00"), "q.npy: not a .npy file");
  require_format_error(bytes_of("\x93NUMPX\x01\x00\x10\x00"), "not a .npy file");
  require_format_error({}, "q.npy: truncated: 0 bytes, shorter than the .npy magic");
  require_format_error(bytes_of("\x93NUM"), "truncated: 4 bytes");
  require_format_error(bytes_of(std::string("\x93NUMPY\x04\x00\x10\x00", 10)), "unsupported .npy format version 4.0");
  require_format_error(bytes_of(std::string("\x93NUMPY\x01\x01\x10\x00", 10)), "version 1.1");
  require_format_error(bytes_of(std::string("\x93NUMPY\x00\x00\x10\x00", 10)), "version 0.0");
  require_format_error(bytes_of(std::string("\x93NUMPY\x01\x00\x10", 9)), "the header length field ends at byte 10");
  require_format_error(bytes_of(std::string("\x93NUMPY\x02\x00\x10\x00\x00", 11)), "ends at byte 12");
  require_format_error(bytes_of(std::string("\x93NUMPY\x01\x00\x40\x00{}\n", 13)),
                       "header length 64 runs past the end of the file (3 bytes follow the length field)");
  require_format_error(bytes_of(std::string("\x93NUMPY\x02\x00\xff\xff\xff\x7f", 12)),
                       "header length 2147483647 exceeds the 1048576-byte limit");

  // the dict
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': False}", 0), "the header has no 'shape' key");
  require_format_error(npy_file("{'shape': (1,), 'fortran_order': False}", 4), "the header has no 'descr' key");
  require_format_error(npy_file("{'descr': '<f4', 'shape': (1,)}", 4), "the header has no 'fortran_order' key");
  require_format_error(npy_file("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': ()}", 4),
                       "duplicate key 'descr'");
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (), 'extra': 1}", 4),
                       "unexpected key 'extra' in the header");
  require_format_error(npy_file("['descr', '<f4']", 4), "header is not a dict: expected '{' at offset 10");
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", 8),
                       "unterminated header dict");
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), ", 8),
                       "unterminated header dict");
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", 8),
                       "trailing garbage after the header dict at offset");
  require_format_error(npy_file("{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}", 8),
                       "expected ',' or '}' after the value of 'descr'");
  require_format_error(npy_file("{'descr' '<f4', 'fortran_order': False, 'shape': (2,)}", 8),
                       "expected ':' after the key 'descr'");
  require_format_error(npy_file("{descr: '<f4', 'fortran_order': False, 'shape': (2,)}", 8),
                       "expected a quoted string as a key at offset 11");
  require_format_error(npy_file("{'descr: '<f4', 'fortran_order': False, 'shape': (2,)}", 8), "expected ':'");
  require_format_error(npy_file("{'descr': '<f4\\n', 'fortran_order': False, 'shape': (2,)}", 8),
                       "escape sequences in header strings are not supported");
  require_format_error(npy_file("{'descr': '<f4", 0), "unterminated string starting at offset 20");
  // non-ASCII and control characters, a missing final newline
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'caf\xc3\xa9': 1}", 8),
                       "is not ASCII");
  require_format_error(npy_file(std::string("{'descr': '<f4', \0'fortran_order': False, 'shape': (2,)}", 56), 8),
                       "header byte 0x00 at offset 27 is a control character");
  {
    auto f = npy_file("<f4", "(2,)", 8);
    f[f.size() - 9] = ' ';  // the newline before the data
    require_format_error(f, "header does not end with a newline");
  }
  // descr
  require_format_error(npy_file(">f4", "(2,)", 8), "big-endian dtype '>f4' is not supported");
  require_format_error(npy_file("<f8", "(2,)", 16), "dtype '<f8' is not supported (only '<f4' float32");
  require_format_error(npy_file("|b1", "(2,)", 2), "dtype '|b1' is not supported");
  require_format_error(npy_file("=f4", "(2,)", 8), "dtype '=f4' is not supported");
  require_format_error(npy_file("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}", 8),
                       "'descr' must be a string at offset 20 (structured dtypes are not supported)");
  // fortran order
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2)}", 16),
                       "fortran_order is True: column-major arrays are not supported");
  require_format_error(npy_file("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 2)}", 16),
                       "'fortran_order' must be True or False");
  // shape
  require_format_error(npy_file("<f4", "(2, -3)", 0), "negative dimension -3 in 'shape'");
  require_format_error(npy_file("<f4", "(3)", 12), "'shape' (3) is an integer, not a tuple (write (3,))");
  require_format_error(npy_file("<f4", "[2, 3]", 24), "'shape' must be a tuple");
  require_format_error(npy_file("<f4", "(1, 1, 1, 1, 1)", 4), "'shape' has more than 4 dimensions");
  require_format_error(npy_file("<f4", "(2, 3L)", 24), "malformed integer in 'shape'");
  require_format_error(npy_file("<f4", "(02,)", 8), "malformed integer in 'shape'");
  require_format_error(npy_file("<f4", "(2 3)", 24), "expected ',' or ')' in 'shape'");
  require_format_error(npy_file("<f4", "(99999999999999999999,)", 0), "dimension 99999999999999999999 in 'shape' does not fit in 64 bits");
  require_format_error(npy_file("<f4", "(9223372036854775807, 2)", 0),
                       "shape 9223372036854775807x2 float32 has more bytes than fit in 64 bits");
  require_format_error(npy_file("<f4", "(4611686018427387904,)", 0), "has more bytes than fit in 64 bits");
  // an empty array whose other dimensions overflow: its strides could not be represented
  require_format_error(npy_file("<f4", "(0, 233790048077, 85485484)", 0),
                       "shape 0x233790048077x85485484 float32 has more bytes than fit in 64 bits");
  // sizes both ways
  require_format_error(npy_file("<f4", "(2, 3, 4)", 80),
                       "q.npy: truncated: header says 2x3x4 float32 (96 bytes) but 80 bytes follow");
  require_format_error(npy_file("<f4", "(2, 3, 4)", 100),
                       "q.npy: 4 bytes of trailing data after the 2x3x4 float32 array (96 bytes)");
  require_format_error(npy_file("<i4", "()", 0), "header says scalar int32 (4 bytes) but 0 bytes follow");
  require_format_error(npy_file("<f2", "(0, 5)", 1), "1 bytes of trailing data after the 0x5 float16 array (0 bytes)");
}

TEST_CASE("npy: accepted variations of the header") {
  npy::array a;
  // double quotes, no trailing comma, extra whitespace, -0, version 2.0 and 3.0 preambles
  REQUIRE(parse(npy_file("{ \"shape\" : ( 2 , 3 , ) ,\"descr\":\"<i4\",'fortran_order':False}", 24), a).ok());
  CHECK(a.shape == std::vector<std::int64_t>{2, 3});
  CHECK(a.type == npy::dtype::int32);
  REQUIRE(parse(npy_file("{'descr': '<f2', 'fortran_order': False, 'shape': (-0, 3), }", 0, 2), a).ok());
  CHECK(a.shape == std::vector<std::int64_t>{0, 3});
  REQUIRE(parse(npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", 4, 3), a).ok());
  CHECK(a.shape.empty());
  CHECK(a.elements() == 1);
}

TEST_CASE("npy: file errors") {
  npy::array a;
  require_error(npy::read(scratch().file("missing.npy"), a), errc::io_error, "missing.npy: no such file");
  require_error(npy::read(scratch().path.string(), a), errc::io_error, "not a regular file");
  // a truncated file on disk gives the same message as in memory, with the path
  const auto f = npy_file("<f4", "(2, 3, 4)", 80);
  const std::string path = scratch().file("short.npy");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(f.data()), static_cast<std::streamsize>(f.size()));
  require_error(npy::read(path, a), errc::format_error, "short.npy: truncated: header says 2x3x4 float32 (96 bytes) but 80 bytes follow");
  // a header claiming 2^62 elements: rejected against the real file size before any allocation
  const auto big = npy_file("<f4", "(1073741824, 1073741824)", 16);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(big.data()), static_cast<std::streamsize>(big.size()));
  require_error(npy::read(path, a), errc::format_error, "(4611686018427387904 bytes) but 16 bytes follow");
  for (std::size_t cut : {0, 3, 7, 9, 40}) {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(f.data()), static_cast<std::streamsize>(cut));
    CAPTURE(cut);
    require_error(npy::read(path, a), errc::format_error, "short.npy: ");
  }
}

TEST_CASE("npy: files written by Python's numpy, and numpy reading ours") {
  std::string why;
  if (!python_numpy_available(why)) {
    std::printf("test_npy: skipping the numpy interoperability test: %s\n", why.c_str());
    return;
  }
  const std::string dir = scratch().path.string();
  const std::string script =
      "import numpy as np, sys\n"
      "d = sys.argv[1]\n"
      "np.save(d + '/np_f4.npy', (np.arange(24, dtype='<f4').reshape(2, 3, 4) * 0.5 - 3))\n"
      "np.save(d + '/np_f2.npy', np.array([[1.5, -2.0], [65504.0, np.inf]], dtype='<f2'))\n"
      "np.save(d + '/np_i4.npy', np.arange(-3, 3, dtype='<i4'))\n"
      "np.save(d + '/np_scalar.npy', np.float32(7.25))\n"
      "np.save(d + '/np_empty.npy', np.zeros((0, 5), dtype='<f4'))\n"
      "np.save(d + '/np_big_endian.npy', np.arange(4, dtype='>f4'))\n"
      "np.save(d + '/np_fortran.npy', np.asfortranarray(np.ones((2, 3), dtype='<f4')))\n"
      "np.save(d + '/np_f8.npy', np.ones(3))\n"
      "np.lib.format.write_array(open(d + '/np_v2.npy', 'wb'), np.arange(6, dtype='<f4'), version=(2, 0))\n"
      "np.lib.format.write_array(open(d + '/np_v3.npy', 'wb'), np.arange(6, dtype='<i4'), version=(3, 0))\n";
  {
    std::ofstream(dir + "/gen.py") << script;
  }
  REQUIRE(std::system(("/usr/bin/python3 " + dir + "/gen.py " + dir).c_str()) == 0);
  npy::array a;
  REQUIRE(npy::read(dir + "/np_f4.npy", a).ok());
  REQUIRE(a.shape == std::vector<std::int64_t>{2, 3, 4});
  auto v = value_of(npy::as_kv_view<float>(a));
  for (index_t i = 0; i < 24; ++i) CHECK(v(i / 12, (i / 4) % 3, i % 4) == static_cast<float>(i) * 0.5f - 3.f);
  REQUIRE(npy::read(dir + "/np_f2.npy", a).ok());
  auto h = value_of(npy::as_matrix_view<const float16>(a));
  CHECK(to_float(h(0, 0)) == 1.5f);
  CHECK(to_float(h(1, 0)) == 65504.f);
  CHECK(to_float(h(1, 1)) == std::numeric_limits<float>::infinity());
  REQUIRE(npy::read(dir + "/np_i4.npy", a).ok());
  CHECK(a.shape == std::vector<std::int64_t>{6});
  std::int32_t last = 0;
  std::memcpy(&last, a.bytes.data() + 20, 4);
  CHECK(last == 2);
  REQUIRE(npy::read(dir + "/np_scalar.npy", a).ok());
  CHECK(a.shape.empty());
  float s = 0;
  std::memcpy(&s, a.bytes.data(), 4);
  CHECK(s == 7.25f);
  REQUIRE(npy::read(dir + "/np_empty.npy", a).ok());
  CHECK(a.shape == std::vector<std::int64_t>{0, 5});
  REQUIRE(npy::read(dir + "/np_v2.npy", a).ok());
  CHECK(a.shape == std::vector<std::int64_t>{6});
  REQUIRE(npy::read(dir + "/np_v3.npy", a).ok());
  CHECK(a.type == npy::dtype::int32);
  require_error(npy::read(dir + "/np_big_endian.npy", a), errc::format_error, "big-endian dtype '>f4'");
  require_error(npy::read(dir + "/np_fortran.npy", a), errc::format_error, "fortran_order is True");
  require_error(npy::read(dir + "/np_f8.npy", a), errc::format_error, "dtype '<f8' is not supported");

  // numpy reads what we write
  const std::vector<float> q = {1.5f, -2.f, 3.25f, 0.f, -0.f, 1e-30f};
  REQUIRE(npy::write_f32(dir + "/ours_f4.npy", {3, 2}, q.data()).ok());
  const std::vector<std::int32_t> p = {7, -8, 2147483647};
  REQUIRE(npy::write_i32(dir + "/ours_i4.npy", {3}, p.data()).ok());
  const float one = 1.f;
  REQUIRE(npy::write_f32(dir + "/ours_scalar.npy", {}, &one).ok());
  const std::string check =
      "import numpy as np, sys\n"
      "d = sys.argv[1]\n"
      "a = np.load(d + '/ours_f4.npy')\n"
      "assert a.dtype == np.float32 and a.shape == (3, 2), (a.dtype, a.shape)\n"
      "assert (a == np.array([[1.5, -2], [3.25, 0], [0, 1e-30]], dtype=np.float32)).all()\n"
      "b = np.load(d + '/ours_i4.npy')\n"
      "assert b.dtype == np.int32 and list(b) == [7, -8, 2147483647]\n"
      "c = np.load(d + '/ours_scalar.npy')\n"
      "assert c.shape == () and c == 1.0\n";
  {
    std::ofstream(dir + "/check.py") << check;
  }
  CHECK(std::system(("/usr/bin/python3 " + dir + "/check.py " + dir).c_str()) == 0);
}
