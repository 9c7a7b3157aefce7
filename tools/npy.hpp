// tools/npy.hpp: a small, strict reader and writer of NumPy .npy files (format versions 1.0, 2.0
// and 3.0) for the `kvevict` command-line tool and the tests. Not part of the library's API.
//
//   npy::array a;                                  // {type, shape, bytes}: owning, C order, little-endian
//   if (auto st = npy::read("q.npy", a); !st.ok()) { puts(st.message()); ... }
//   auto q = npy::as_kv_view<const float>(a);      // rank-3 float32 -> kv_view<const float>
//   st = npy::write_f32("scores.npy", {8, 512}, data);
//
// Accepted: dtypes '<f4' (float32), '<f2' (float16), '<i4' (int32); fortran_order False; shapes
// of rank 0..4 with non-negative dimensions; exactly as many data bytes as the shape needs. Every
// other input gives a kvevict::status (errc::format_error, or errc::io_error for the file system)
// with ONE specific line naming the file, e.g.
//   q.npy: truncated: header says 2x3x4 float32 (96 bytes) but 80 bytes follow
// The reader never reads past its input, accepts only regular files of bounded size, and
// allocates only after checking the sizes against the real file size (a lying header cannot make
// it allocate more than the file holds); an empty array's other dimensions are bounded too. The
// writer is atomic (programs/io.hpp).
// docs/npy.md lists the accepted subset and every error.
#pragma once

#include "io.hpp"

#include <kvevict/numeric.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#  error "tools/npy.hpp assumes a little-endian host"
#endif

namespace kvevict::npy {

enum class dtype { float32, float16, int32 };

constexpr const char* dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return "float32";
    case dtype::float16: return "float16";
    case dtype::int32: return "int32";
  }
  return "unknown";
}
/// The .npy 'descr' string of a dtype ("<f4").
constexpr const char* dtype_descr(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return "<f4";
    case dtype::float16: return "<f2";
    case dtype::int32: return "<i4";
  }
  return "?";
}
constexpr std::size_t itemsize(dtype t) noexcept { return t == dtype::float16 ? 2 : 4; }

inline constexpr std::size_t max_rank = 4;
/// Largest header accepted (numpy's own writer needs < 200 bytes for these dtypes and ranks).
inline constexpr std::size_t max_header_bytes = std::size_t(1) << 20;

/// An owning n-dimensional array: C (row-major) order, little-endian elements.
struct array {
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;  ///< empty: a scalar (one element)
  std::vector<unsigned char> bytes;

  /// Number of elements (1 for a scalar). Valid for arrays returned by read/parse.
  std::int64_t elements() const noexcept {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

namespace detail {

/// "2x3x4", "5" (rank 1) or "scalar" (rank 0).
inline std::string shape_string(const std::int64_t* shape, std::size_t rank) {
  if (rank == 0) return "scalar";
  std::string s;
  for (std::size_t i = 0; i < rank; ++i) {
    if (i) s += 'x';
    s += std::to_string(shape[i]);
  }
  return s;
}

/// Byte size of a shape, or false if it overflows 64 bits. The product of the non-zero dimensions
/// must fit too, even when another dimension is 0 (as numpy requires): otherwise the strides of
/// an empty array could not be represented.
inline bool shape_bytes(const std::int64_t* shape, std::size_t rank, dtype t, std::int64_t& bytes) {
  std::int64_t n = 1;
  bool empty = false;
  for (std::size_t i = 0; i < rank; ++i) {
    if (shape[i] < 0) return false;
    if (shape[i] == 0) empty = true;
    else if (!kvevict::detail::checked_mul(n, shape[i], n)) return false;
  }
  if (!kvevict::detail::checked_mul(n, static_cast<std::int64_t>(itemsize(t)), bytes)) return false;
  if (empty) bytes = 0;
  return true;
}

/// What the header says.
struct header {
  dtype type = dtype::float32;
  std::int64_t shape[max_rank] = {};
  std::size_t rank = 0;
  std::int64_t data_bytes = 0;
  std::size_t data_offset = 0;  ///< bytes before the data: preamble + header
};

/// Parser of the header's Python dict literal: {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class dict_parser {
 public:
  dict_parser(const unsigned char* p, std::size_t n, std::size_t base, const char* name)
      : p_(p), n_(n), base_(base), name_(name) {}

  status parse(header& h) {
    // characters first: ASCII, no control characters but whitespace; a final newline
    for (std::size_t i = 0; i < n_; ++i) {
      const unsigned char c = p_[i];
      if (c >= 0x80) return fail("header byte 0x%02X at offset %zu is not ASCII", c, base_ + i);
      if (c < 0x20 && c != '\n' && c != '\r' && c != '\t')
        return fail("header byte 0x%02X at offset %zu is a control character", c, base_ + i);
    }
    if (n_ == 0 || p_[n_ - 1] != '\n') return fail("%s", "header does not end with a newline");
    skip_ws();
    if (!eat('{')) return fail("header is not a dict: expected '{' at offset %zu", base_ + i_);
    bool have_descr = false, have_order = false, have_shape = false;
    for (;;) {
      skip_ws();
      if (at_end()) return fail("%s", "unterminated header dict (no closing '}')");
      if (eat('}')) break;
      std::string key;
      KVEVICT_TRY(string_literal(key, "a key"));
      skip_ws();
      if (!eat(':')) return fail("expected ':' after the key '%s' at offset %zu", key.c_str(), base_ + i_);
      skip_ws();
      if (key == "descr") {
        if (have_descr) return fail("%s", "duplicate key 'descr' in the header");
        have_descr = true;
        KVEVICT_TRY(descr(h));
      } else if (key == "fortran_order") {
        if (have_order) return fail("%s", "duplicate key 'fortran_order' in the header");
        have_order = true;
        KVEVICT_TRY(fortran_order());
      } else if (key == "shape") {
        if (have_shape) return fail("%s", "duplicate key 'shape' in the header");
        have_shape = true;
        KVEVICT_TRY(shape(h));
      } else {
        return fail("unexpected key '%.40s' in the header (only 'descr', 'fortran_order' and 'shape' are allowed)",
                    key.c_str());
      }
      skip_ws();
      if (eat(',')) continue;
      if (eat('}')) break;
      if (at_end()) return fail("%s", "unterminated header dict (no closing '}')");
      return fail("expected ',' or '}' after the value of '%s' at offset %zu", key.c_str(), base_ + i_);
    }
    skip_ws();
    if (!at_end()) return fail("trailing garbage after the header dict at offset %zu", base_ + i_);
    if (!have_descr) return fail("%s", "the header has no 'descr' key");
    if (!have_order) return fail("%s", "the header has no 'fortran_order' key");
    if (!have_shape) return fail("%s", "the header has no 'shape' key");
    return {};
  }

 private:
  const unsigned char* p_;
  std::size_t n_, base_, i_ = 0;
  const char* name_;

#if defined(__GNUC__)
  __attribute__((format(printf, 2, 3)))
#endif
  status fail(const char* fmt, ...) const {
    char what[200];
    std::va_list args;
    va_start(args, fmt);
    std::vsnprintf(what, sizeof what, fmt, args);
    va_end(args);
    return status::error(errc::format_error, "%s: %s", name_, what);
  }
  bool at_end() const { return i_ >= n_; }
  void skip_ws() {
    while (i_ < n_ && (p_[i_] == ' ' || p_[i_] == '\n' || p_[i_] == '\r' || p_[i_] == '\t')) ++i_;
  }
  bool eat(char c) {
    if (i_ < n_ && p_[i_] == static_cast<unsigned char>(c)) {
      ++i_;
      return true;
    }
    return false;
  }
  bool is_ident(unsigned char c) const {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  }

  status string_literal(std::string& out, const char* what) {
    if (at_end() || (p_[i_] != '\'' && p_[i_] != '"'))
      return fail("expected a quoted string as %s at offset %zu", what, base_ + i_);
    const unsigned char q = p_[i_++];
    const std::size_t start = i_;
    while (i_ < n_ && p_[i_] != q) {
      if (p_[i_] == '\\') return fail("escape sequences in header strings are not supported (offset %zu)", base_ + i_);
      if (p_[i_] == '\n') break;
      ++i_;
    }
    if (at_end() || p_[i_] != q) return fail("unterminated string starting at offset %zu", base_ + start - 1);
    out.assign(reinterpret_cast<const char*>(p_ + start), i_ - start);
    ++i_;
    return {};
  }

  status descr(header& h) {
    if (at_end() || (p_[i_] != '\'' && p_[i_] != '"'))
      return fail("'descr' must be a string at offset %zu (structured dtypes are not supported)", base_ + i_);
    std::string d;
    KVEVICT_TRY(string_literal(d, "'descr'"));
    if (d == "<f4") h.type = dtype::float32;
    else if (d == "<f2") h.type = dtype::float16;
    else if (d == "<i4") h.type = dtype::int32;
    else if (!d.empty() && d[0] == '>')
      return fail("big-endian dtype '%.20s' is not supported (convert with a.astype(a.dtype.newbyteorder('<')))",
                  d.c_str());
    else
      return fail("dtype '%.20s' is not supported (only '<f4' float32, '<f2' float16 and '<i4' int32)", d.c_str());
    return {};
  }

  status fortran_order() {
    const std::size_t start = i_;
    while (i_ < n_ && is_ident(p_[i_])) ++i_;
    const std::string word(reinterpret_cast<const char*>(p_ + start), i_ - start);
    if (word == "False") return {};
    if (word == "True")
      return fail("%s", "fortran_order is True: column-major arrays are not supported (save np.ascontiguousarray(a))");
    return fail("'fortran_order' must be True or False at offset %zu", base_ + start);
  }

  status integer(std::int64_t& v) {
    const std::size_t start = i_;
    const bool neg = eat('-');
    const std::size_t digits = i_;
    std::uint64_t x = 0;
    bool big = false;
    while (i_ < n_ && p_[i_] >= '0' && p_[i_] <= '9') {
      const unsigned d = p_[i_++] - '0';
      if (x > (UINT64_MAX - d) / 10) big = true;
      else x = x * 10 + d;
    }
    const std::size_t len = i_ - digits;
    if (len == 0 || (i_ < n_ && is_ident(p_[i_])) || (len > 1 && p_[digits] == '0'))
      return fail("malformed integer in 'shape' at offset %zu", base_ + start);
    const std::string text(reinterpret_cast<const char*>(p_ + start), (i_ - start) < 30 ? i_ - start : 30);
    if (neg && (x != 0 || big)) return fail("negative dimension %s in 'shape'", text.c_str());
    if (big || x > static_cast<std::uint64_t>(INT64_MAX))
      return fail("dimension %s%s in 'shape' does not fit in 64 bits", text.c_str(), i_ - start > 30 ? "..." : "");
    v = static_cast<std::int64_t>(x);
    return {};
  }

  status shape(header& h) {
    if (!eat('(')) return fail("'shape' must be a tuple at offset %zu", base_ + i_);
    h.rank = 0;
    skip_ws();
    if (eat(')')) return {};  // () : a scalar
    for (;;) {
      std::int64_t v = 0;
      KVEVICT_TRY(integer(v));
      if (h.rank == max_rank)
        return fail("'shape' has more than %zu dimensions (ranks 0 to %zu are supported)", max_rank, max_rank);
      h.shape[h.rank++] = v;
      skip_ws();
      if (eat(')')) {
        if (h.rank == 1) return fail("'shape' (%lld) is an integer, not a tuple (write (%lld,))",
                                     static_cast<long long>(v), static_cast<long long>(v));
        return {};
      }
      if (!eat(',')) {
        if (at_end()) return fail("%s", "unterminated 'shape' tuple");
        return fail("expected ',' or ')' in 'shape' at offset %zu", base_ + i_);
      }
      skip_ws();
      if (eat(')')) return {};
    }
  }
};

inline std::uint32_t read_le(const unsigned char* p, std::size_t n) {
  std::uint32_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}

/// Parses the preamble and header in `p[0, avail)` of a file of `total` bytes (avail <= total;
/// the caller passes at least the preamble and header when the file has them). On success fills h
/// (data_offset, data_bytes checked against total).
inline status parse_header(const unsigned char* p, std::size_t avail, std::uint64_t total, const char* name,
                           header& h) {
  static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  bool magic_ok = true;
  for (std::size_t i = 0; i < 6 && i < avail; ++i) magic_ok = magic_ok && p[i] == magic[i];
  if (!magic_ok)
    return status::error(errc::format_error, "%s: not a .npy file (the magic string \\x93NUMPY is missing)", name);
  if (total < 8)
    return status::error(errc::format_error, "%s: truncated: %llu bytes, shorter than the .npy magic and version",
                         name, static_cast<unsigned long long>(total));
  const unsigned major = p[6], minor = p[7];
  if (major < 1 || major > 3 || minor != 0)
    return status::error(errc::format_error, "%s: unsupported .npy format version %u.%u (1.0, 2.0 and 3.0 are)",
                         name, major, minor);
  const std::size_t len_bytes = major == 1 ? 2 : 4, preamble = 8 + len_bytes;
  if (total < preamble)
    return status::error(errc::format_error, "%s: truncated: the header length field ends at byte %zu but the file "
                         "has %llu bytes", name, preamble, static_cast<unsigned long long>(total));
  const std::uint32_t hlen = read_le(p + 8, len_bytes);
  if (hlen > max_header_bytes)
    return status::error(errc::format_error, "%s: header length %u exceeds the %zu-byte limit", name, hlen,
                         max_header_bytes);
  if (preamble + hlen > total)
    return status::error(errc::format_error, "%s: header length %u runs past the end of the file (%llu bytes follow "
                         "the length field)", name, hlen, static_cast<unsigned long long>(total - preamble));
  if (avail < preamble + hlen)
    return status::error(errc::io_error, "%s: internal error: header not fully read", name);
  KVEVICT_TRY(dict_parser(p + preamble, hlen, preamble, name).parse(h));
  for (std::size_t i = 0; i < h.rank; ++i)
    if (h.shape[i] < 0)  // unreachable: the parser rejects negatives; kept as a guard
      return status::error(errc::format_error, "%s: negative dimension in 'shape'", name);
  const std::string shp = shape_string(h.shape, h.rank);
  if (!shape_bytes(h.shape, h.rank, h.type, h.data_bytes))
    return status::error(errc::format_error, "%s: shape %.120s %s has more bytes than fit in 64 bits", name,
                         shp.c_str(), dtype_name(h.type));
  if (h.data_bytes == 0 && h.rank > 0) {
    // an empty array's other dimensions are backed by no data: bound them as if the zeros were 1,
    // so that a 0 x 10^12 header cannot make a consumer allocate or write for 10^12 elements
    std::int64_t logical = 0;
    std::int64_t ones[max_rank];
    for (std::size_t i = 0; i < h.rank; ++i) ones[i] = h.shape[i] == 0 ? 1 : h.shape[i];
    if (!shape_bytes(ones, h.rank, h.type, logical) || static_cast<std::uint64_t>(logical) > io::limit::npy_bytes)
      return status::error(errc::format_error, "%s: empty array %.120s %s: its non-zero dimensions exceed the "
                           "%llu-byte input limit", name, shp.c_str(), dtype_name(h.type),
                           static_cast<unsigned long long>(io::limit::npy_bytes));
  }
  h.data_offset = preamble + hlen;
  const std::uint64_t follow = total - h.data_offset, want = static_cast<std::uint64_t>(h.data_bytes);
  if (follow < want)
    return status::error(errc::format_error, "%s: truncated: header says %.120s %s (%llu bytes) but %llu bytes follow",
                         name, shp.c_str(), dtype_name(h.type), static_cast<unsigned long long>(want),
                         static_cast<unsigned long long>(follow));
  if (follow > want)
    return status::error(errc::format_error,
                         "%s: %llu bytes of trailing data after the %.120s %s array (%llu bytes)", name,
                         static_cast<unsigned long long>(follow - want), shp.c_str(), dtype_name(h.type),
                         static_cast<unsigned long long>(want));
  return {};
}

inline void fill_array(const header& h, array& out) {
  out.type = h.type;
  out.shape.assign(h.shape, h.shape + h.rank);
  out.bytes.clear();
}

}  // namespace detail

/// Parses a whole .npy file held in memory (`name` is used in messages). The in-memory entry point
/// of the reader (the fuzzer's target). On error `out` is left empty.
inline status parse(const void* data, std::size_t size, const char* name, array& out) {
  out = array{};
  if (data == nullptr && size > 0) return status::error(errc::null_pointer, "%s: data is null", name);
  static const unsigned char none = 0;
  const auto* p = size > 0 ? static_cast<const unsigned char*>(data) : &none;
  detail::header h;
  KVEVICT_TRY(detail::parse_header(p, size, size, name, h));
  detail::fill_array(h, out);
  out.bytes.assign(p + h.data_offset, p + h.data_offset + static_cast<std::size_t>(h.data_bytes));
  return {};
}

/// Reads a .npy file: a regular file of at most io::limit::npy_bytes (programs/io.hpp). Errors:
/// errc::io_error (cannot open / read, not a regular file, too large) or errc::format_error (see
/// docs/npy.md), each message starting with the path.
inline status read(const std::string& path, array& out) {
  out = array{};
  const char* name = path.c_str();
  std::error_code ec;
  if (std::filesystem::status(path, ec).type() == std::filesystem::file_type::not_found)
    return status::error(errc::io_error, "%s: no such file", name);
  io::input_file in;
  KVEVICT_TRY(io::input_file::open(path, "npy", io::limit::npy_bytes, in));
  const std::uint64_t total = in.size();
  // the preamble (at most 12 bytes), then exactly the header it announces (bounded by the file size)
  std::vector<unsigned char> head(static_cast<std::size_t>(total < 12 ? total : 12));
  KVEVICT_TRY(in.read_exact(head.data(), head.size()));
  detail::header h;
  if (head.size() >= 10 && head[6] >= 1 && head[6] <= 3 && head[7] == 0 && head[0] == 0x93) {
    const std::size_t preamble = head[6] == 1 ? 10 : 12;
    const std::uint32_t hlen = preamble <= head.size() ? detail::read_le(head.data() + 8, preamble - 8) : 0;
    if (hlen <= max_header_bytes && preamble + hlen <= total) {
      const std::size_t have = head.size();
      head.resize(preamble + hlen);
      KVEVICT_TRY(in.read_exact(head.data() + have, head.size() - have));
    }
  }
  KVEVICT_TRY(detail::parse_header(head.data(), head.size(), total, name, h));
  // the sizes now agree with the file: allocating data_bytes is bounded by the file size
  detail::fill_array(h, out);
  out.bytes.resize(static_cast<std::size_t>(h.data_bytes));
  if (std::fseek(in.get(), static_cast<long>(h.data_offset), SEEK_SET) != 0 ||
      !in.read_exact(out.bytes.data(), out.bytes.size()).ok()) {
    out = array{};
    return status::error(errc::io_error, "%s: cannot read the data (file changed while reading?)", name);
  }
  return {};
}

/// The bytes of a .npy v1.0 file holding `a` (header padded to a multiple of 64 bytes, as numpy
/// writes it). Errors (invalid_argument): rank > 4, a negative dimension, a byte count that does
/// not match the shape.
inline status serialize(const array& a, std::vector<unsigned char>& out) {
  constexpr const char* fn = "npy::serialize";
  if (a.shape.size() > max_rank)
    return status::error(errc::invalid_argument, "%s: rank %zu exceeds %zu", fn, a.shape.size(), max_rank);
  if (a.type != dtype::float32 && a.type != dtype::float16 && a.type != dtype::int32)
    return status::error(errc::invalid_argument, "%s: unknown dtype %d", fn, static_cast<int>(a.type));
  for (auto d : a.shape)
    if (d < 0) return status::error(errc::invalid_argument, "%s: negative dimension %lld", fn, static_cast<long long>(d));
  std::int64_t bytes = 0;
  if (!detail::shape_bytes(a.shape.data(), a.shape.size(), a.type, bytes))
    return status::error(errc::invalid_argument, "%s: the shape's byte count overflows 64 bits", fn);
  if (static_cast<std::uint64_t>(bytes) != a.bytes.size())
    return status::error(errc::invalid_argument, "%s: shape %s %s needs %lld bytes but the array holds %zu", fn,
                         detail::shape_string(a.shape.data(), a.shape.size()).c_str(), dtype_name(a.type),
                         static_cast<long long>(bytes), a.bytes.size());
  std::string dict = std::string("{'descr': '") + dtype_descr(a.type) + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < a.shape.size(); ++i) {
    dict += std::to_string(a.shape[i]);
    if (a.shape.size() == 1 || i + 1 < a.shape.size()) dict += a.shape.size() == 1 ? "," : ", ";
  }
  dict += "), }";
  const std::size_t unpadded = 10 + dict.size() + 1;  // + '\n'
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  const std::size_t hlen = dict.size();
  out.clear();
  out.reserve(10 + hlen + a.bytes.size());
  const unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<unsigned char>(hlen & 0xff),
                                 static_cast<unsigned char>(hlen >> 8)};
  out.insert(out.end(), pre, pre + 10);
  out.insert(out.end(), dict.begin(), dict.end());
  out.insert(out.end(), a.bytes.begin(), a.bytes.end());
  return {};
}

/// Writes `a` to `path` (.npy v1.0) atomically: a temporary file renamed into place when complete
/// (programs/io.hpp); on failure the previous file is untouched. Errors: serialize's, or
/// errc::io_error naming the path. Programs writing several outputs stage serialize()'s bytes in
/// one io::output_transaction instead.
inline status write(const std::string& path, const array& a) {
  std::vector<unsigned char> file;
  KVEVICT_TRY(serialize(a, file));
  io::output_transaction out;
  KVEVICT_TRY(out.stage(path, file));
  return out.commit();
}

/// An array of the given type and shape holding a copy of `data` (elements in C order).
inline status make_array(dtype type, const std::vector<std::int64_t>& shape, const void* data, array& out) {
  out = array{};
  out.type = type;
  out.shape = shape;
  std::int64_t bytes = 0;
  if (shape.size() > max_rank)
    return status::error(errc::invalid_argument, "npy::make_array: rank %zu exceeds %zu", shape.size(), max_rank);
  for (auto d : shape)
    if (d < 0)
      return status::error(errc::invalid_argument, "npy::make_array: negative dimension %lld", static_cast<long long>(d));
  if (!detail::shape_bytes(shape.data(), shape.size(), type, bytes))
    return status::error(errc::invalid_argument, "npy::make_array: the shape's byte count overflows 64 bits");
  if (data == nullptr && bytes > 0) return status::error(errc::null_pointer, "npy::make_array: data is null");
  const auto* p = static_cast<const unsigned char*>(data);
  if (bytes > 0) out.bytes.assign(p, p + bytes);
  return {};
}

/// Writes float32 elements (C order) with the given shape.
inline status write_f32(const std::string& path, const std::vector<std::int64_t>& shape, const float* data) {
  array a;
  KVEVICT_TRY(make_array(dtype::float32, shape, data, a));
  return write(path, a);
}
/// Writes int32 elements (C order) with the given shape.
inline status write_i32(const std::string& path, const std::vector<std::int64_t>& shape, const std::int32_t* data) {
  array a;
  KVEVICT_TRY(make_array(dtype::int32, shape, data, a));
  return write(path, a);
}

namespace detail {
template <class T>
constexpr dtype dtype_of() {
  using U = std::remove_const_t<T>;
  static_assert(std::is_same_v<U, float> || std::is_same_v<U, float16> || std::is_same_v<U, std::int32_t>,
                "npy views: element type must be float, kvevict::float16 or std::int32_t");
  return std::is_same_v<U, float> ? dtype::float32 : std::is_same_v<U, float16> ? dtype::float16 : dtype::int32;
}
template <class T, class A>
status check_view_of(const char* fn, A& a, std::size_t rank) {
  if (a.type != dtype_of<T>())
    return status::error(errc::invalid_argument, "%s: the array is %s, not %s", fn, dtype_name(a.type),
                         dtype_name(dtype_of<T>()));
  if (a.shape.size() != rank)
    return status::error(errc::shape_mismatch, "%s: the array is %s (rank %zu), not rank %zu", fn,
                         shape_string(a.shape.data(), a.shape.size()).c_str(), a.shape.size(), rank);
  std::int64_t bytes = 0;
  if (!shape_bytes(a.shape.data(), rank, a.type, bytes) || static_cast<std::uint64_t>(bytes) != a.bytes.size())
    return status::error(errc::shape_mismatch, "%s: the array's shape does not match its %zu bytes", fn,
                         a.bytes.size());
  return {};
}
template <class T, class A>
result<kv_view<T>> kv_view_of(A& a, kv_layout layout) {
  KVEVICT_TRY((check_view_of<T>("npy::as_kv_view", a, 3)));
  T* data = reinterpret_cast<T*>(a.bytes.data());
  // head-major files are [H][T][D]; token-major files are [T][H][D]
  if (layout == kv_layout::head_major) return make_kv_view(data, a.shape[0], a.shape[1], a.shape[2], layout);
  return make_kv_view(data, a.shape[1], a.shape[0], a.shape[2], layout);
}
template <class T, class A>
result<matrix_view<T>> matrix_view_of(A& a) {
  KVEVICT_TRY((check_view_of<T>("npy::as_matrix_view", a, 2)));
  return make_matrix_view(reinterpret_cast<T*>(a.bytes.data()), a.shape[0], a.shape[1]);
}
}  // namespace detail

/// Views a rank-3 array as a kv_view (logical [head][token][dim]). head_major: the array is
/// [H][T][D]; token_major: the array is [T][H][D]. T is float, float16 or int32, const-qualified
/// for a const array. Errors: dtype differs (invalid_argument), rank != 3 (shape_mismatch).
template <class T>
result<kv_view<T>> as_kv_view(array& a, kv_layout layout = kv_layout::head_major) {
  return detail::kv_view_of<T>(a, layout);
}
template <class T>
result<kv_view<const T>> as_kv_view(const array& a, kv_layout layout = kv_layout::head_major) {
  return detail::kv_view_of<const T>(a, layout);
}
/// Views a rank-2 array as a matrix_view ([rows][cols]); same rules as as_kv_view.
template <class T>
result<matrix_view<T>> as_matrix_view(array& a) {
  return detail::matrix_view_of<T>(a);
}
template <class T>
result<matrix_view<const T>> as_matrix_view(const array& a) {
  return detail::matrix_view_of<const T>(a);
}

}  // namespace kvevict::npy
