#include <kvevict/status.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <string>

using namespace kvevict;

static status fails_with(int v) { return status::error(errc::out_of_range, "value %d is outside [0, 3)", v); }
static status chained(int v) {
  KVEVICT_TRY(v >= 0 ? status{} : fails_with(v));
  return status::error(errc::unsupported, "reached the end");
}

TEST_CASE("status: default is ok, errors carry code and formatted message") {
  const status ok;
  CHECK(ok.ok());
  CHECK(static_cast<bool>(ok));
  CHECK(std::string(ok.message()) == "ok");
  const status bad = fails_with(7);
  CHECK_FALSE(bad.ok());
  CHECK(bad.code() == errc::out_of_range);
  CHECK(std::string(bad.message()) == "value 7 is outside [0, 3)");
  CHECK(std::string(errc_name(bad.code())) == "out_of_range");
}

TEST_CASE("status: long messages are truncated, never overflow") {
  std::string big(1000, 'x');
  const status st = status::error(errc::invalid_argument, "%s", big.c_str());
  CHECK(std::strlen(st.message()) == status::max_message - 1);
}

TEST_CASE("status: KVEVICT_TRY propagates the first failure") {
  CHECK(chained(-1).code() == errc::out_of_range);
  CHECK(chained(1).code() == errc::unsupported);
}

TEST_CASE("result: value or error, never garbage") {
  result<int> good(5);
  CHECK(good.ok());
  CHECK(*good == 5);
  result<int> bad(status::error(errc::format_error, "nope"));
  CHECK_FALSE(bad.ok());
  CHECK(bad.value() == 0);
  CHECK(std::string(bad.error().message()) == "nope");
}

TEST_CASE("check() throws kvevict::error with the code") {
  CHECK_NOTHROW(check(status{}));
  try {
    check(status::error(errc::overlap, "a and b overlap"));
    FAIL("check did not throw");
  } catch (const kvevict::error& e) {
    CHECK(e.code() == errc::overlap);
    CHECK(std::string(e.what()) == "a and b overlap");
  }
}
