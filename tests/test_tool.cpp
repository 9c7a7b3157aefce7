// The kvevict tool end to end on .npy files: a SnapKV selection computed by hand, and agreement
// with the library on random fp16 inputs with GQA.
#include "support.hpp"

#include "kvevict_tool.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <unistd.h>

using namespace kvevict;

namespace {
std::string temp_dir(const char* name) {
  const auto dir = std::filesystem::temp_directory_path() / ("kvevict_test_tool_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::create_directories(dir);
  return dir.string();
}
}  // namespace

TEST_CASE("tool: SnapKV on a case computed by hand") {
  // One head, d = 1, T = 4 keys [0, ln 2, 0, 0], window w = 2 with queries [1, 1], no pooling,
  // budget 3. Scale 1/sqrt(1) = 1, so the logits are the keys.
  //   window row 0 (position 2) sees keys 0..2: e^{0, ln2, 0} = {1, 2, 1} / 4 = {.25, .5, .25}
  //   window row 1 (position 3) sees keys 0..3: {1, 2, 1, 1} / 5 = {.2, .4, .2, .2}
  //   prefix scores (mean of the rows): key 0 = (.25 + .2) / 2 = .225, key 1 = (.5 + .4) / 2 = .45
  //   window keys 2, 3 protected (+inf); budget 3 keeps the window and key 1 -> kept = {1, 2, 3}
  const std::string dir = temp_dir("hand");
  const float keys[] = {0.f, std::log(2.f), 0.f, 0.f};
  const float queries[] = {1.f, 1.f};
  REQUIRE(npy::write_f32(dir + "/k.npy", {1, 4, 1}, keys).ok());
  REQUIRE(npy::write_f32(dir + "/q.npy", {1, 2, 1}, queries).ok());
  tool::options opt;
  opt.q_path = dir + "/q.npy";
  opt.k_path = dir + "/k.npy";
  opt.scores_path = dir + "/scores.npy";
  opt.kept_path = dir + "/kept.npy";
  opt.r.pool = pool_kind::none;
  opt.budget = 3;
  std::string summary;
  const status st = tool::run(opt, summary);
  REQUIRE_MESSAGE(st.ok(), std::string(st.message()));
  CHECK(summary.find("kept 3 of 4 tokens") != std::string::npos);

  npy::array scores, kept;
  REQUIRE(npy::read(opt.scores_path, scores).ok());
  REQUIRE(npy::read(opt.kept_path, kept).ok());
  REQUIRE(scores.type == npy::dtype::float32);
  REQUIRE(scores.shape == std::vector<std::int64_t>{1, 4});
  const auto* s = reinterpret_cast<const float*>(scores.bytes.data());
  CHECK(s[0] == doctest::Approx(0.225).epsilon(1e-6));
  CHECK(s[1] == doctest::Approx(0.45).epsilon(1e-6));
  CHECK(s[2] == std::numeric_limits<float>::infinity());
  CHECK(s[3] == std::numeric_limits<float>::infinity());
  REQUIRE(kept.type == npy::dtype::int32);
  REQUIRE(kept.shape == std::vector<std::int64_t>{1, 3});
  const auto* k = reinterpret_cast<const std::int32_t*>(kept.bytes.data());
  CHECK(k[0] == 1);
  CHECK(k[1] == 2);
  CHECK(k[2] == 3);

  // with budget 2 only the window survives
  opt.budget = 2;
  REQUIRE(tool::run(opt, summary).ok());
  REQUIRE(npy::read(opt.kept_path, kept).ok());
  k = reinterpret_cast<const std::int32_t*>(kept.bytes.data());
  CHECK(k[0] == 2);
  CHECK(k[1] == 3);
  std::filesystem::remove_all(dir);
}

TEST_CASE("tool: fp16 GQA inputs agree with the library called directly; errors are one line") {
  auto g = kvtest::rng(7);
  const index_t hq = 4, hkv = 2, T = 50, d = 8, w = 6;
  const auto qf = kvtest::random_floats(g, hq * w * d, -2, 2), kf = kvtest::random_floats(g, hkv * T * d, -2, 2),
             vf = kvtest::random_floats(g, hkv * T * d, -1, 1);
  std::vector<float16> qh, kh, vh;
  for (float x : qf) qh.push_back(to_float16(x));
  for (float x : kf) kh.push_back(to_float16(x));
  for (float x : vf) vh.push_back(to_float16(x));
  const std::string dir = temp_dir("fp16");
  npy::array a;
  REQUIRE(npy::make_array(npy::dtype::float16, {hq, w, d}, qh.data(), a).ok());
  REQUIRE(npy::write(dir + "/q.npy", a).ok());
  REQUIRE(npy::make_array(npy::dtype::float16, {hkv, T, d}, kh.data(), a).ok());
  REQUIRE(npy::write(dir + "/k.npy", a).ok());
  REQUIRE(npy::make_array(npy::dtype::float16, {hkv, T, d}, vh.data(), a).ok());
  REQUIRE(npy::write(dir + "/v.npy", a).ok());

  tool::options opt;
  opt.q_path = dir + "/q.npy";
  opt.k_path = dir + "/k.npy";
  opt.v_path = dir + "/v.npy";
  opt.scores_path = dir + "/s.npy";
  opt.kept_path = dir + "/kept.npy";
  opt.r = recipe::lava();
  opt.budget = 20;
  opt.parallel = true;
  std::string summary;
  REQUIRE(tool::run(opt, summary).ok());
  npy::array kept;
  REQUIRE(npy::read(opt.kept_path, kept).ok());

  // the library on the same fp16 tensors
  recipe r = recipe::lava();
  r.window = w;
  r.n_recent = w;
  std::vector<float> scores(hkv * T);
  auto sv = *make_matrix_view(scores.data(), hkv, T);
  workspace ws;
  auto qv = *make_kv_view<const float16>(qh.data(), hq, w, d);
  auto kv = *make_kv_view<const float16>(kh.data(), hkv, T, d);
  auto vv = *make_kv_view<const float16>(vh.data(), hkv, T, d);
  REQUIRE(recipe_scores(seq, ws, r, qv, kv, vv, sv).ok());
  std::vector<float> buf(ws.bytes / 4 + 16);
  ws.data = buf.data();
  REQUIRE(recipe_scores(seq, ws, r, qv, kv, vv, sv).ok());
  std::vector<pos_t> ref(hkv * 20);
  workspace sel;
  auto keptv = *make_matrix_view(ref.data(), hkv, 20);
  REQUIRE(recipe_select(seq, sel, r, matrix_view<const float>(sv), keptv).ok());
  std::vector<float> sbuf(sel.bytes / 4 + 16);
  sel.data = sbuf.data();
  REQUIRE(recipe_select(seq, sel, r, matrix_view<const float>(sv), keptv).ok());
  CHECK(std::memcmp(ref.data(), kept.bytes.data(), ref.size() * sizeof(pos_t)) == 0);

  // errors: budget above the prompt, vatp without values, a truncated file
  opt.budget = T + 1;
  kvtest::require_error(tool::run(opt, summary), errc::invalid_argument, "budget 51 is larger than the prompt (50 tokens)");
  opt.budget = 10;
  opt.r = recipe::vatp();
  opt.v_path.clear();
  kvtest::require_error(tool::run(opt, summary), errc::invalid_argument, "recipe vatp weights by values: give --v");
  std::filesystem::resize_file(dir + "/k.npy", 100);
  opt.r = recipe::snapkv();
  kvtest::require_error(tool::run(opt, summary), errc::format_error, "k.npy");
  std::filesystem::remove_all(dir);
}
