// libFuzzer target: the head-mask TSV parser (kvevict/train/prulong.hpp) on arbitrary bytes. Any input must
// give a status (never a crash, an overread or UB); accepted inputs must round-trip through
// format_head_mask_tsv (exactly for float storage), and a shape mismatch must be reported, never written past.
#include <kvevict/train/prulong.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

using namespace kvevict;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const char* text = reinterpret_cast<const char*>(data);
  for (const head_mask_range range : {head_mask_range::strict, head_mask_range::clip}) {
    const head_mask_tsv_options opts{range};
    index_t L = 0, H = 0;
    if (!head_mask_tsv_shape(text, size, &L, &H, opts).ok()) continue;
    if (L < 1 || H < 1 || L * H > (1 << 20)) std::abort();
    std::vector<double> values(static_cast<std::size_t>(L * H), -1.0);
    auto view = make_matrix_view(values.data(), L, H);
    if (!view.ok() || !parse_head_mask_tsv(text, size, *view, opts).ok()) std::abort();
    for (double v : values)
      if (!(v >= 0.0 && v <= 1.0)) std::abort();
    // float storage round-trips exactly through %.9g; double storage to 9 significant digits
    std::vector<float> fvalues(values.size(), -1.f), fback(values.size(), -1.f);
    auto fview = make_matrix_view(fvalues.data(), L, H);
    if (!parse_head_mask_tsv(text, size, *fview, opts).ok()) std::abort();
    std::string out, fout;
    if (!format_head_mask_tsv(*view, out).ok() || !format_head_mask_tsv(*fview, fout).ok()) std::abort();
    std::vector<double> back(values.size(), -1.0);
    auto back_view = make_matrix_view(back.data(), L, H);
    auto fback_view = make_matrix_view(fback.data(), L, H);
    if (!parse_head_mask_tsv(out.data(), out.size(), *back_view).ok()) std::abort();
    if (!parse_head_mask_tsv(fout.data(), fout.size(), *fback_view).ok()) std::abort();
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (fback[i] != fvalues[i]) std::abort();
      const double d = back[i] - values[i];
      if (d > 1e-8 * values[i] || -d > 1e-8 * values[i]) std::abort();
    }
    // the wrong expected shape is an error and writes nothing
    std::vector<double> small(static_cast<std::size_t>(L * H + 1), 0.5);
    auto wrong = make_matrix_view(small.data(), L, H + 1);
    if (parse_head_mask_tsv(text, size, *wrong, opts).ok()) std::abort();
    for (double v : small)
      if (v != 0.5) std::abort();
  }
  return 0;
}
