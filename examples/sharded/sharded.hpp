// sharded/sharded.hpp: the reference model sharded over ranks (docs/distributed.md, "The runner
// sharded"): `mpirun -np P kvevict-run --tp P` splits the KV heads of every layer, `--pp P` the
// layers, and every rank produces the same tokens as one process, bit for bit.
//
// Tensor parallelism (--tp P, P divides the KV heads): rank r holds KV heads head_shard(H_kv, P, r)
// and their query heads. It computes only their q / k / v projections (the columns of wqkv, each a
// sum in the same order as the whole matmul's), RoPE, its cache and its heads' attention. The
// per-head attention outputs are then allgathered and every rank runs the output projection and
// the FFN on the whole row, in the order one process uses: no float sum is split across ranks (an
// all-reduce of partial output projections would change the summation order and the tokens).
// Eviction: the postfill, chunked (naive, patched) and decode drivers, each given the
// communicator (post_fill_config::tp, chunked_config::tp, decode_config::tp) and called as
// evictor does on one process: per-head budgets need none, AdaKV and LAVa select across the
// ranks with the library's exact sharded radix select, LAVa's entropies are sharded, CAKE's
// preferences come from the sharded cake_window_preference.
//
// Pipeline parallelism (--pp P, P <= layers): rank r holds the layers layer_shard(L, P, r). The
// stages run in order; after each, its activations reach every rank (an allgather of the block's
// rows, the other ranks' slots unused), so every rank computes the same logits and samples the same
// token. Eviction: the drivers on the stage's layers (uniform, PyramidKV need only the layer
// index, AdaKV selects within a layer; post-fill LAVa's and CAKE's layer budgets come from every
// stage's entropies / preferences, gathered by post_fill_driver's decide() (post_fill_config::pp),
// the chunked drivers' LAVa budget of every chunk by chunked_driver's (chunked_config::pp)).
//
// Both (--tp T --pp S on T x S ranks, shard_comms): stage-major ranks (kvevict::grid_place_of);
// the heads' allgathers run within a stage (tp), the stages' rows and gathers across the ranks
// holding the same heads (pp), the report's gathers over the world.
//
// The layerwise driver: per-layer allocators through post_fill_driver layer by layer (TP selects
// across the ranks), LAVa / CAKE through cascade_driver: across the head shards with its
// communicator (cascade_driver_config::tp: every step's selections sharded), across pipeline stages
// with add_remote_layer (the earlier stages' layers by their weights gathered at each stage
// boundary, the later ones after the prefill), or both. The oracle: the full cache's continuation
// generated sharded, then run after the prompt as an extra block whose queries and keys (this
// rank's heads) are the post-fill query block.
// SpecKV: the same with the draft response (the draft model, the target's first layers, run whole
// on every rank by the caller: methods/speckv.hpp). LAQ / LAQ++ (methods/laq.hpp): stage 1 evicts a
// copy of the prefilled cache (SnapKV, uniform, this rank's heads / layers) and decodes the pseudo
// tokens on it with the sharded forward (every rank samples the same argmax), their queries and keys
// (this rank's heads) the block; the full cache is then restored and evicted with that block (LAQ++:
// its union with the prompt's window, scored as evictor's laq_pp_scores on this rank's heads).
// LookaheadKV (lookaheadkv/scores.hpp): the module's lookahead rows run as an extra block through
// the sharded forward, its LoRA adapters on this rank's columns of q, k, v (their heads') and on
// the whole o, w1, w2, w3 (computed on whole rows on every rank), each delta column the same sum as
// lookahead_scorer's; every rank's heads' scores are lookahead_scorer's rows of those heads.
//
// The communicator is any of kvevict/comm.hpp's (kvevict-run passes the MPI adapter of
// kvevict/mpi.hpp; the tests also run it on threads). The head-type recipes (duo, prulong,
// duo-heuristic) run with every driver (the non-post-fill ones through the streaming heads, each
// rank on its slice of the head types). Every rank must pass the same options and prompt:
// sharded_runner's init and prefill agree on them first (one allgather), so a rank with others
// fails every rank instead of hanging.
#pragma once

#include <report/report.hpp>
#include <runner/evict.hpp>
#include <runner/generate.hpp>
#include <runner/model.hpp>
#include <runner/ops.hpp>
#include <methods/laq.hpp>
#include <methods/speckv.hpp>
#include <lookaheadkv/scores.hpp>

#include <kvevict/comm.hpp>
#include <kvevict/distributed.hpp>
#include <kvevict/driver.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace kvrun {

struct shard_options {
  int tp = 1;       ///< tensor-parallel ranks (the communicator's size when > 1)
  int pp = 1;       ///< pipeline stages (the communicator's size when > 1)
  int threads = 1;  ///< OpenMP threads of each rank's matmuls
};

/// One rank's KV rows: every layer (those of other stages stay empty) x its KV heads x capacity,
/// as ragged caches the drivers read and compact_layer compacts.
class shard_cache {
 public:
  void init(int layers, index_t heads, index_t head_size, index_t capacity) {
    layers_ = layers;
    heads_ = heads;
    hs_ = head_size;
    cap_ = capacity;
    const auto rows = static_cast<std::size_t>(layers * heads * capacity);
    keys_.assign(rows * static_cast<std::size_t>(head_size), 0.0f);
    values_.assign(keys_.size(), 0.0f);
    pos_.assign(rows, 0);
    lens_.assign(static_cast<std::size_t>(layers * heads), 0);
    cu_.resize(static_cast<std::size_t>(heads + 1));
    for (index_t h = 0; h <= heads; ++h) cu_[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * capacity);
  }
  index_t heads() const { return heads_; }
  index_t length(int l, index_t h) const { return lens_[static_cast<std::size_t>(l * heads_ + h)]; }
  float* key_row(int l, index_t h, index_t j) { return keys_.data() + off(l, h, j); }
  float* value_row(int l, index_t h, index_t j) { return values_.data() + off(l, h, j); }
  /// Appends one row (key, value, position) to head h of layer l (room: the caller's to check).
  void append(int l, index_t h, const float* k, const float* v, pos_t p) {
    const index_t j = length(l, h);
    std::copy(k, k + hs_, key_row(l, h, j));
    std::copy(v, v + hs_, value_row(l, h, j));
    pos_[static_cast<std::size_t>(off(l, h, j) / hs_)] = p;
    ++lens_[static_cast<std::size_t>(l * heads_ + h)];
  }
  pos_t position(int l, index_t h, index_t j) const { return pos_[static_cast<std::size_t>(off(l, h, j) / hs_)]; }
  kvevict::ragged_cache<float> keys(int l) { return {keys_.data() + off(l, 0, 0), cu_.data(), lens(l), heads_, hs_, hs_}; }
  kvevict::ragged_cache<float> values(int l) {
    return {values_.data() + off(l, 0, 0), cu_.data(), lens(l), heads_, hs_, hs_};
  }
  kvevict::ragged_cache<pos_t> positions(int l) {
    return {pos_.data() + off(l, 0, 0) / hs_, cu_.data(), lens(l), heads_, 1, 1};
  }
  kvevict::layer_kv<float> layer(int l) { return *kvevict::make_layer_kv(keys(l), values(l), positions(l)); }
  /// Layer l's first `rows` keys of every head, dense [heads][rows][d] (a ragged head is contiguous).
  kvevict::kv_view<const float> dense_keys(int l, index_t rows) const {
    return *kvevict::make_kv_view<const float>(keys_.data() + off(l, 0, 0), heads_, rows, hs_, cap_ * hs_, hs_);
  }
  /// Every (layer, head)'s length, and setting them back (an extra block's rows dropped).
  const std::vector<std::int32_t>& lengths() const { return lens_; }
  void set_lengths(const std::vector<std::int32_t>& lens) { std::copy(lens.begin(), lens.end(), lens_.begin()); }
  status compact(int l, kvevict::ragged_positions kept) {
    return kvevict::compact_layer(kvevict::seq, keys(l), values(l), positions(l), kept);
  }

 private:
  index_t off(int l, index_t h, index_t j) const { return ((l * heads_ + h) * cap_ + j) * hs_; }
  std::int32_t* lens(int l) { return lens_.data() + l * heads_; }
  int layers_ = 0;
  index_t heads_ = 0, hs_ = 0, cap_ = 0;
  std::vector<float> keys_, values_;
  std::vector<pos_t> pos_;
  std::vector<std::int32_t> lens_, cu_;
};

/// The methods a sharded run takes: every recipe with every driver check_evict_options accepts on
/// one process; on top, the layout (tp x pp ranks, heads and layers divisible) is checked here.
/// Error: a clear one naming what does not fit and why.
inline status check_sharded(const config& c, const shard_options& s, int ranks, const evict_options& o) {
  if (s.tp < 1 || s.pp < 1)
    return status::error(errc::invalid_argument, "--tp %d --pp %d: each must be >= 1", s.tp, s.pp);
  const int want = s.tp * s.pp;
  if (want != ranks) {
    char grid[64];
    if (s.tp > 1 && s.pp > 1)
      std::snprintf(grid, sizeof grid, "--tp %d --pp %d", s.tp, s.pp);
    else
      std::snprintf(grid, sizeof grid, "--%s %d", s.tp > 1 ? "tp" : "pp", s.tp > 1 ? s.tp : s.pp);
    return status::error(errc::invalid_argument, "%s but the job has %d ranks (run mpirun -np %d)", grid, ranks, want);
  }
  if (s.tp > 1)
    if (const auto r = kvevict::head_shard(c.n_kv_heads, s.tp, 0); !r) return r.error();
  if (s.pp > 1)
    if (const auto r = kvevict::layer_shard(c.n_layers, s.pp, 0); !r) return r.error();
  if (o.recipe == method::full) return {};
  return check_evict_options(c, o);
}

/// The communicators of a sharded job (kvevict/comm.hpp's grid_place_of: world rank = stage x tp +
/// head shard): `world` every rank, `tp` this stage's head shards (its rank: the shard), `pp` the
/// ranks holding this rank's heads, one per stage (its rank: the stage). With one kind of sharding
/// the job's communicator is all three (one_group); with both, the engine splits them (kvevict-run:
/// kvevict::mpi_grid).
template <class Comm>
struct shard_comms {
  Comm* world = nullptr;
  Comm* tp = nullptr;
  Comm* pp = nullptr;
};
template <class Comm>
shard_comms<Comm> one_group(Comm& c) {
  return {&c, &c, &c};
}

/// The model on one rank of a tensor- and / or pipeline-parallel job, with eviction by the
/// postfill, layerwise, chunked and decode drivers (each given the communicators), as evictor does
/// on one process.
template <class Comm>
class sharded_runner {
 public:
  /// Binds to `m` (must outlive this) and the communicators `g` (every rank calls the same methods
  /// in the same order). Errors: check_sharded's; the groups' sizes not tp x pp, tp and pp.
  /// Every rank must pass the same options: the ranks agree on them first (one allgather over
  /// `world`), so a rank with other options, or failing a check, fails every rank (no hang).
  /// `duo`: the head types of duo, prulong and duo-heuristic (the whole model's [L][H], the same on
  /// every rank; copied), as evictor::init takes them. `lookahead`: lookaheadkv's trained module
  /// (the same on every rank; must outlive the runner).
  status init(const model& m, const shard_comms<Comm>& g, const shard_options& s, const evict_options& o,
              const duo_heads* duo = nullptr, const lookahead_module* lookahead = nullptr) {
    const config& c = m.cfg();
    status local = check_sharded(c, s, g.world->size(), o);
    const bool typed = allocator_of(o) == budget_scheme::duo && o.recipe != method::full;
    if (local.ok() && typed &&
        (duo == nullptr || static_cast<index_t>(duo->global.size()) != index_t(c.n_layers) * c.n_kv_heads))
      local = status::error(errc::invalid_argument, "sharded_runner: %s needs the model's head types",
                            method_name(o.recipe));
    duo_ = typed && local.ok() ? *duo : duo_heads{};
    if (local.ok() && o.recipe == method::lookaheadkv)
      local = lookahead == nullptr ? status::error(errc::invalid_argument,
                                                   "--recipe lookaheadkv needs a trained lookahead module (--lookahead-module)")
                                   : lookahead->check_model(c);
    lkv_ = o.recipe == method::lookaheadkv ? lookahead : nullptr;
    if (local.ok() && ((s.tp > 1 && g.tp->size() != s.tp) || (s.pp > 1 && g.pp->size() != s.pp)))
      local = status::error(errc::invalid_argument,
                            "sharded_runner: --tp %d --pp %d but the groups have %d (tp) and %d (pp) ranks", s.tp, s.pp,
                            g.tp->size(), g.pp->size());
    char line[agree_text];
    std::snprintf(line, sizeof line,
                  "--tp %d --pp %d --recipe %s --allocator %s --driver %s --budget %lld --window %lld --sinks %lld "
                  "--chunk %lld --chunk-fraction %.17g --evict-every %lld, %d layers x %d KV heads, head types %016llx",
                  s.tp, s.pp, method_name(o.recipe), allocator_name(allocator_of(o)), driver_name(o.driver),
                  static_cast<long long>(o.budget), static_cast<long long>(o.window), static_cast<long long>(o.sinks),
                  static_cast<long long>(o.chunk), o.chunk_fraction, static_cast<long long>(o.evict_every), c.n_layers,
                  c.n_kv_heads, static_cast<unsigned long long>(head_types_hash()));
    world_ = g.world;
    KVEVICT_TRY(agree("sharded_runner::init", local, line));
    fault_rank_ = fault_layer_ = -1;  // the tests' fault injection: KVEVICT_SHARDED_FAULT=<world rank>:<layer>
    if (const char* f = std::getenv("KVEVICT_SHARDED_FAULT"); f != nullptr && std::sscanf(f, "%d:%d", &fault_rank_, &fault_layer_) != 2)
      fault_rank_ = fault_layer_ = -1;
    m_ = &m;
    tpc_ = g.tp;
    ppc_ = g.pp;
    s_ = s;
    o_ = o;
    rec_ = make_recipe(o);
    next_ = 0;
    recorder_ = nullptr;
    heads_ = {0, c.n_kv_heads};
    layers_ = {0, c.n_layers};
    if (s.tp > 1) heads_ = *kvevict::head_shard(c.n_kv_heads, s.tp, g.tp->rank());
    if (s.pp > 1) layers_ = *kvevict::layer_shard(c.n_layers, s.pp, g.pp->rank());
    group_ = c.group_size();
    hs_ = c.head_size();
    lq_ = heads_.count * group_;
    mine_cfg_ = c;  // this rank's heads (the head size kept), for block_capture
    mine_cfg_.dim = static_cast<int>(lq_ * hs_);
    mine_cfg_.n_heads = static_cast<int>(lq_);
    mine_cfg_.n_kv_heads = static_cast<int>(heads_.count);
    cache_.init(c.n_layers, heads_.count, hs_, c.seq_len);
    const auto T = static_cast<std::size_t>(c.seq_len), d = static_cast<std::size_t>(c.dim);
    x_.assign(T * d, 0.0f);
    xb_.assign(T * d, 0.0f);
    tmp_.assign(T * d, 0.0f);
    qkv_.assign(T * static_cast<std::size_t>((lq_ + 2 * heads_.count) * hs_), 0.0f);
    mine_.assign(T * static_cast<std::size_t>(lq_ * hs_), 0.0f);
    gathered_.assign(mine_.size() * static_cast<std::size_t>(s.tp), 0.0f);
    xs_.assign(T * d * static_cast<std::size_t>(s.pp), 0.0f);
    h13_.assign(T * 2 * static_cast<std::size_t>(c.hidden_dim), 0.0f);
    att_.assign(T, 0.0f);
    logits_.assign(static_cast<std::size_t>(c.vocab_size), 0.0f);
    pos_.assign(T, 0);
    return {};
  }

  /// The logits of the last forward's last row (row 0), or of its row `row` (extra with logits_mode::all).
  const float* logits(index_t row = 0) const { return logits_.data() + row * m_->cfg().vocab_size; }
  pos_t next_position() const { return next_; }
  /// This rank's KV heads and layers, its cache and the model config of its heads (for block_capture).
  kvevict::shard_range heads() const { return heads_; }
  kvevict::shard_range layers() const { return layers_; }
  const shard_cache& cache() const { return cache_; }
  const config& shard_config() const { return mine_cfg_; }
  /// KV rows the whole model holds (every rank's heads / layers, summed over the ranks).
  status rows(index_t& out) const {
    std::int64_t n = 0;
    for (int l = 0; l < m_->cfg().n_layers; ++l)
      for (index_t h = 0; h < heads_.count; ++h) n += cache_.length(l, h);
    KVEVICT_TRY(world_->allreduce_sum(&n, 1));
    out = n;
    return {};
  }

  /// Prefills `prompt` (an empty cache) and evicts as configured (evictor::prefill's drivers);
  /// logits() then holds the first generated token's. `rec` (may be null; must outlive the
  /// runner's decoding) receives the schedule of this rank's [layers().count][heads().count] rows.
  /// `response` (oracle: its query block, the true continuation; speckv: the draft response;
  /// every rank the same): run after the prompt as an extra block whose queries and keys are kept
  /// and KV rows dropped. laq, laq++: the pseudo tokens decoded on an evicted copy (laq_block).
  /// Errors: an empty or too long prompt, the oracle or speckv without a response or with one that
  /// does not fit the context, laq's pseudo tokens not fitting it, the driver's.
  status prefill(const std::vector<int>& prompt, kvevict::eviction_recorder* rec = nullptr,
                 const std::vector<int>* response = nullptr) {
    recorder_ = rec;
    const config& c = m_->cfg();
    const auto n = static_cast<index_t>(prompt.size());
    const bool oracle = o_.recipe == method::oracle || o_.recipe == method::speckv;  // an external response
    const auto m = static_cast<index_t>(oracle && response != nullptr ? response->size() : 0);
    status local;
    if (n < 1 || n > c.seq_len || next_ != 0)
      local = status::error(errc::invalid_argument, "sharded_runner: prefill of %lld tokens (1 to %d, once)",
                            static_cast<long long>(n), c.seq_len);
    else if (oracle && (m < 1 || n + m > c.seq_len))  // evictor::prefill's checks
      local = status::error(errc::invalid_argument, "%s: %s", method_name(o_.recipe),
                            m < 1 ? (o_.recipe == method::oracle ? "the true response is needed as the query block"
                                                                 : "the draft response (speckv.hpp) is needed as the query block")
                                  : "the prompt and the response do not fit the cache");
    else if (laq() && n + o_.laq_steps > c.seq_len)  // laq_pseudo_queries' check
      local = status::error(errc::invalid_argument,
                            "laq: the prompt (%lld tokens) and %lld pseudo tokens do not fit the cache (%lld rows)",
                            static_cast<long long>(n), static_cast<long long>(o_.laq_steps),
                            static_cast<long long>(c.seq_len));
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a of the prompt's tokens (and the oracle's response)
    for (const int t : prompt) h = (h ^ static_cast<std::uint32_t>(t)) * 1099511628211ull;
    if (m > 0)
      for (const int t : *response) h = (h ^ static_cast<std::uint32_t>(t)) * 1099511628211ull;
    char line[agree_text];
    std::snprintf(line, sizeof line, "a prompt of %lld tokens, a response of %lld, hash %016llx", static_cast<long long>(n),
                  static_cast<long long>(m), static_cast<unsigned long long>(h));
    KVEVICT_TRY(agree("sharded_runner::prefill", local, line));  // every rank the same prompt (and response)
    prefill_s_ = evict_s_ = 0.0;
    if (o_.recipe == method::full) return timed(prefill_s_, [&] { return forward(prompt.data(), n); });
    if (streaming()) return prefill_streaming(prompt);
    switch (o_.driver) {
      case driver_kind::chunked_naive:
      case driver_kind::chunked_patched: return prefill_chunked(prompt);
      case driver_kind::decode: return prefill_decode(prompt);
      case driver_kind::layerwise: return prefill_layerwise(prompt);
      default: break;
    }
    prompt_q_.reset(mine_cfg_, n);
    const forward_hooks hk = prompt_q_.hooks();
    KVEVICT_TRY(timed(prefill_s_, [&] { return forward(prompt.data(), n, &hk); }));
    if (oracle) {  // the true response after the prompt, its queries and keys kept, its KV rows dropped
      response_q_.reset(mine_cfg_, m);
      const forward_hooks rh = response_q_.hooks();
      KVEVICT_TRY(forward(response->data(), m, &rh, nullptr, true, logits_mode::none));
    }
    if (lkv_ != nullptr)  // the module's block and the eviction (none with a budget of at least the prompt)
      return timed(evict_s_, [&]() -> status {
        if (o_.budget >= n) return {};
        KVEVICT_TRY(lookahead_scores(n));
        return evict(n);
      });
    if (laq())  // LAQ's stage 1 and pseudo decoding count as eviction (evictor's evict_seconds)
      return timed(evict_s_, [&] {
        KVEVICT_TRY(laq_block(n));
        return evict(n, o_.recipe == method::laq_pp ? &union_q_ : &pseudo_q_);
      });
    return timed(evict_s_, [&] { return evict(n, oracle ? &response_q_ : nullptr); });
  }

  /// This rank's seconds in the last prefill's forward passes (chunked: every chunk's and patch's)
  /// and in eviction (the drivers' calls and the compaction; the decode driver: its begin and every
  /// step since), as evictor's prefill_seconds / evict_seconds (the report takes the max over ranks).
  double prefill_seconds() const { return prefill_s_; }
  double evict_seconds() const { return evict_s_; }

  /// runner::forward_extra: `tokens` at the next positions through the model, this rank's events
  /// to `hooks`, logits per `mode`; their KV rows dropped afterwards.
  status extra(const std::vector<int>& tokens, const forward_hooks* hooks, logits_mode mode) {
    const auto n = static_cast<index_t>(tokens.size());
    if (n < 1 || next_ + n > m_->cfg().seq_len)
      return status::error(errc::invalid_argument, "sharded_runner: an extra block of %lld tokens after %d",
                           static_cast<long long>(n), next_);
    return forward(tokens.data(), n, hooks, nullptr, true, mode);
  }

  /// Decodes one token; with the decode driver, decode_driver::step then runs on every layer of
  /// this rank (evictor::decode's).
  status decode(int token) {
    if (next_ >= m_->cfg().seq_len)
      return status::error(errc::out_of_range, "sharded_runner: the context of %d tokens is full", m_->cfg().seq_len);
    if (streaming()) {  // evictor::decode's: the streaming heads drop the key that left their window
      KVEVICT_TRY(forward(&token, 1));
      return timed(evict_s_, [&] { return stream_layers(); });
    }
    if (o_.recipe == method::full || o_.driver != driver_kind::decode) return forward(&token, 1);
    return decode_step(token);
  }

 private:
  const model* m_ = nullptr;
  Comm *world_ = nullptr, *tpc_ = nullptr, *ppc_ = nullptr;  // shard_comms
  shard_options s_;
  evict_options o_;
  kvevict::recipe rec_;
  kvevict::shard_range heads_, layers_;
  index_t group_ = 1, hs_ = 0, lq_ = 0;
  config mine_cfg_;
  shard_cache cache_;
  std::vector<float> x_, xb_, tmp_, qkv_, mine_, gathered_, xs_, h13_, att_, logits_;
  std::vector<pos_t> pos_, patch_pos_;
  std::vector<std::int32_t> held_;  // the lengths before an extra block
  pos_t next_ = 0;
  kvevict::eviction_recorder* recorder_ = nullptr;
  block_capture prompt_q_, chunk_q_, patch_q_, step_q_, recent_q_, response_q_;
  kvevict::post_fill_driver pf_;
  kvevict::chunked_driver ch_;
  kvevict::decode_driver dd_;
  kvevict::cascade_driver cd_;
  kvevict::streaming_heads_driver sh_;
  std::vector<std::uint8_t> retrieval_;  // this rank's [layers][heads] of the head types (streaming heads)
  driver_scratch scratch_;
  kvevict::workspace decode_ws_;  // the decode driver's (in scratch_.ws)
  allocation_plan alloc_;
  std::vector<std::int32_t> budgets_;
  std::vector<unsigned char> pref_ws_, init_ws_, gather_ws_;
  std::vector<float> initial_;
  std::vector<double> stage_weights_, model_weights_;  // the layerwise cascade's (pipeline stages)
  std::vector<pos_t> cascade_schedule_;                // its recorder's [L][heads][N]
  std::function<status(int)> after_stage_;             // forward(): after stage st's rows reached every rank
  shard_cache laq_full_;                               // laq, laq++: the full cache while stage 1 decodes
  block_capture pseudo_q_, union_q_;                   // their pseudo block, laq++'s union block
  std::vector<float> laq_logits_, laq_scores_;         // the prefill's logits; laq++'s scores [heads][P]
  std::vector<unsigned char> laq_ws_;
  const lookahead_module* lkv_ = nullptr;                     // lookaheadkv's module
  std::vector<float> lkv_raw_, lkv_scores_, lkv_xa_, lkv_delta_;  // its scores, adapters' scratch
  std::vector<unsigned char> lkv_ws_;

  bool owns_layer(int l) const { return l >= layers_.first && l < layers_.first + layers_.count; }

  double prefill_s_ = 0.0, evict_s_ = 0.0;
  duo_heads duo_;  // head types (duo, prulong, duo-heuristic): the whole model's
  /// FNV-1a of the head types (the ranks must hold the same; 0 bits without any).
  std::uint64_t head_types_hash() const {
    std::uint64_t h = 1469598103934665603ull;
    for (const auto x : duo_.global) {
      unsigned char b[sizeof x];
      std::memcpy(b, &x, sizeof x);
      for (unsigned char y : b) h = (h ^ y) * 1099511628211ull;
    }
    return h ^ static_cast<std::uint64_t>(duo_.retrieval);
  }
  /// Runs f(), adding its wall time to `acc`.
  template <class F>
  static status timed(double& acc, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    const status st = f();
    acc += seconds_since(t0);
    return st;
  }

  // The ranks agree (one allgather over the world of a status flag and a line): a rank that failed
  // fails every rank with its message; lines that differ (other options, another prompt) fail every
  // rank naming the first two that differ. Every rank returns the same status.
  static constexpr std::size_t agree_text = 248;
  struct agree_record {
    std::int32_t failed = 0, rank = 0;
    char text[agree_text] = {};
  };
  status agree(const char* fn, const status& local, const char* line) {
    agree_record mine;
    mine.failed = local.ok() ? 0 : 1;
    mine.rank = world_->rank();
    std::snprintf(mine.text, sizeof mine.text, "%s", local.ok() ? line : local.message());
    agree_all_.resize(static_cast<std::size_t>(world_->size()));
    KVEVICT_TRY(world_->allgather(&mine, sizeof mine, agree_all_.data()));
    const int P = world_->size();
    bool same = true;  // every rank failed the same way (e.g. the job's size): the message alone
    for (const agree_record& r : agree_all_) same = same && r.failed != 0 && std::strcmp(r.text, agree_all_[0].text) == 0;
    if (same) return status::error(errc::invalid_argument, "%s", agree_all_[0].text);
    for (const agree_record& r : agree_all_)
      if (r.failed != 0) return status::error(errc::invalid_argument, "rank %d of %d: %s", r.rank, P, r.text);
    for (const agree_record& r : agree_all_) {
      const char* a = agree_all_[0].text;
      std::size_t i = 0;  // the first difference, widened to its option ("--budget 8") or clause
      while (a[i] != '\0' && a[i] == r.text[i]) ++i;
      if (a[i] == '\0' && r.text[i] == '\0') continue;
      std::size_t b = i;
      while (b > 0 && a[b - 1] != ',' && !(a[b - 1] == ' ' && a[b] == '-')) --b;
      const auto field = [b](const char* t) {
        std::size_t e = b;
        while (t[e] != '\0' && t[e] != ',' && !(t[e] == ' ' && t[e + 1] == '-')) ++e;
        return std::string(t + b, t + e);
      };
      return status::error(errc::invalid_argument,
                           "%s: the ranks disagree (every rank must run the same configuration): rank 0 {%s}, rank %d {%s}",
                           fn, field(a).c_str(), r.rank, field(r.text).c_str());
    }
    return {};
  }
  std::vector<agree_record> agree_all_;

  // Mid-forward: a rank's own failure (a driver call, a compaction, a hook) reaches the other ranks
  // of `comm` at the next collective point instead of leaving them waiting: one allreduce of a flag;
  // only when a rank failed, an allgather of the statuses, and every rank returns the lowest failing
  // rank's error ("rank r of P: ..." in world ranks, unless the message names its rank already).
  struct fail_record {
    std::int32_t failed = 0, code = 0, rank = 0;
    char text[agree_text] = {};
  };
  template <class C>
  status agree_failure(C& comm, const status& local) {
    std::int64_t failed = local.ok() ? 0 : 1;
    KVEVICT_TRY(comm.allreduce_sum(&failed, 1));
    if (failed == 0) return {};
    fail_record mine;
    mine.failed = local.ok() ? 0 : 1;
    mine.code = static_cast<std::int32_t>(local.code());
    mine.rank = world_->rank();
    std::snprintf(mine.text, sizeof mine.text, "%s", local.ok() ? "" : local.message());
    fail_all_.resize(static_cast<std::size_t>(comm.size()));
    KVEVICT_TRY(comm.allgather(&mine, sizeof mine, fail_all_.data()));
    for (const fail_record& r : fail_all_) {
      if (r.failed == 0) continue;
      if (std::strncmp(r.text, "rank ", 5) == 0) return status::error(static_cast<errc>(r.code), "%s", r.text);
      return status::error(static_cast<errc>(r.code), "rank %d of %d: %s", r.rank, world_->size(), r.text);
    }
    return {};
  }
  std::vector<fail_record> fail_all_;
  int fault_rank_ = -1, fault_layer_ = -1;

  // The block's rows through the model; logits of the last row on every rank. Pipeline: the stages
  // run in order, stage s on the rows stage s - 1 produced, which reach every rank by an allgather.
  // hooks->after_layer sees this rank's layers' events (its heads' queries, keys and values);
  // hooks->after_projection their projections (q, k, v: its heads' columns only; o, w1, w3, w2 whole).
  // `extra` (runner::forward_extra): at `positions`, the block's rows dropped afterwards. `inputs`
  // (instead of tokens' embeddings): the block's input vectors [n][dim] (LookaheadKV's).
  status forward(const int* tokens, index_t n, const forward_hooks* hooks = nullptr, const pos_t* positions = nullptr,
                 bool extra = false, logits_mode mode = logits_mode::last, const float* inputs = nullptr) {
    const model& m = *m_;
    const config& c = m.cfg();
    const index_t d = c.dim;
    float* x = x_.data();
    for (index_t i = 0; i < n; ++i) {
      pos_[static_cast<std::size_t>(i)] = positions != nullptr ? positions[i] : static_cast<pos_t>(next_ + i);
      const float* e = inputs != nullptr ? inputs + i * d : m.embedding(tokens[i]);
      std::copy(e, e + d, x + i * d);
    }
    if (extra) held_ = cache_.lengths();
    const int stages = s_.pp;
    // a rank's failure in a layer (its hook: the drivers, the compaction) or after a stage reaches
    // every rank at the next collective point: the stage's ranks after every layer (tp), then every
    // stage before the rows' allgather (pp), every rank after the stage hook
    status pending;
    for (int st = 0; st < stages; ++st) {
      if (stages == 1 || st == ppc_->rank())
        for (index_t l = layers_.first; l < layers_.first + layers_.count && pending.ok(); ++l) {
          status r = layer(static_cast<int>(l), n, hooks, extra);
          if (r.ok() && l == fault_layer_ && world_->rank() == fault_rank_)
            r = status::error(errc::invalid_argument, "sharded_runner: injected fault at layer %d (KVEVICT_SHARDED_FAULT)",
                              static_cast<int>(l));
          pending = s_.tp > 1 ? agree_failure(*tpc_, r) : r;
        }
      if (stages > 1) {  // stage st's rows to every rank (each pp group: one rank of every stage)
        KVEVICT_TRY(agree_failure(*ppc_, pending));
        const auto bytes = static_cast<std::size_t>(n * d) * sizeof(float);
        KVEVICT_TRY(ppc_->allgather(x, bytes, xs_.data()));
        std::copy(xs_.data() + st * n * d, xs_.data() + (st + 1) * n * d, x);
        if (after_stage_) KVEVICT_TRY(agree_failure(*world_, after_stage_(st)));
      }
    }
    KVEVICT_TRY(pending);
    if (extra) cache_.set_lengths(held_);
    const index_t rows = mode == logits_mode::none ? 0 : mode == logits_mode::last ? 1 : n;  // as runner::run
    if (rows > 0) {
      float* xb = xb_.data();
      const auto V = static_cast<std::size_t>(c.vocab_size);
      if (logits_.size() < static_cast<std::size_t>(rows) * V) logits_.resize(static_cast<std::size_t>(rows) * V);
      for (index_t i = 0; i < rows; ++i) detail::rmsnorm(xb + i * d, x + (n - rows + i) * d, m.final_norm(), d);
      detail::matmul(s_.threads, xb, d, rows, d, m.classifier(), c.vocab_size, logits_.data(), c.vocab_size);
    }
    if (!extra) next_ += static_cast<pos_t>(n);
    return {};
  }

  // Layer l on the block's n rows (x), this rank's heads' attention.
  status layer(int l, index_t n, const forward_hooks* hooks, bool extra) {
    const model& m = *m_;
    const config& c = m.cfg();
    const index_t d = c.dim, qs = m.qkv_width(), hidden = c.hidden_dim, hk = heads_.count;
    const index_t lw = (lq_ + 2 * hk) * hs_;  // this rank's q | k | v columns
    const index_t q0 = heads_.first * group_ * hs_, k0 = d + heads_.first * hs_, v0 = d + c.kv_dim() + heads_.first * hs_;
    const int T = s_.threads;
    float *x = x_.data(), *xb = xb_.data(), *tmp = tmp_.data(), *qkv = qkv_.data(), *h13 = h13_.data();
    for (index_t i = 0; i < n; ++i) detail::rmsnorm(xb + i * d, x + i * d, m.attn_norm(l), d);
    // this rank's columns of wqkv: its query heads, then its key and value heads
    detail::matmul(T, xb, d, n, d, m.wqkv(l) + q0, lq_ * hs_, qkv, lw, qs);
    detail::matmul(T, xb, d, n, d, m.wqkv(l) + k0, hk * hs_, qkv + lq_ * hs_, lw, qs);
    detail::matmul(T, xb, d, n, d, m.wqkv(l) + v0, hk * hs_, qkv + (lq_ + hk) * hs_, lw, qs);
    // projection hooks (runner's; q, k, v: this rank's heads' columns only, out = their width)
    const bool projected = hooks != nullptr && static_cast<bool>(hooks->after_projection);
    if (projected) {
      KVEVICT_TRY(hooks->after_projection({l, projection::q, n, xb, d, d, qkv, lw, lq_ * hs_}));
      KVEVICT_TRY(hooks->after_projection({l, projection::k, n, xb, d, d, qkv + lq_ * hs_, lw, hk * hs_}));
      KVEVICT_TRY(hooks->after_projection({l, projection::v, n, xb, d, d, qkv + (lq_ + hk) * hs_, lw, hk * hs_}));
    }
    for (index_t i = 0; i < n; ++i) {
      float* row = qkv + i * lw;
      const pos_t p = pos_[static_cast<std::size_t>(i)];
      for (index_t j = 0; j < (lq_ + hk) * hs_; j += 2) {  // RoPE on q and k, as runner::run
        const int pair = static_cast<int>((j % hs_) / 2);
        const float fr = m.rope_cos(p, pair), fi = m.rope_sin(p, pair);
        const float a = row[j], b = row[j + 1];
        row[j] = a * fr - b * fi;
        row[j + 1] = a * fi + b * fr;
      }
      for (index_t h = 0; h < hk; ++h) {
        if (cache_.length(l, h) >= c.seq_len)
          return status::error(errc::capacity_exceeded, "sharded_runner: layer %d head %lld is full", l,
                               static_cast<long long>(heads_.first + h));
        cache_.append(l, h, row + (lq_ + h) * hs_, row + (lq_ + hk + h) * hs_, p);
      }
    }
    // this rank's heads' attention; row i sees the rows held before the block and the block's rows <= i
    for (index_t i = 0; i < n; ++i)
      for (index_t q = 0; q < lq_; ++q) {
        const index_t g = q / group_, rows = cache_.length(l, g) - n + i + 1;
        detail::attend(qkv + i * lw + q * hs_, cache_.key_row(l, g, 0), cache_.value_row(l, g, 0), hs_, rows, hs_,
                       att_.data(), mine_.data() + (i * lq_ + q) * hs_);
      }
    // every head's output on every rank, in head order; then wo and the FFN on whole rows
    const index_t per = n * lq_ * hs_;
    if (s_.tp > 1) {
      KVEVICT_TRY(tpc_->allgather(mine_.data(), static_cast<std::size_t>(per) * sizeof(float), gathered_.data()));
    } else {
      std::copy(mine_.data(), mine_.data() + per, gathered_.data());
    }
    const int ranks = s_.tp;
    for (int r = 0; r < ranks; ++r)
      for (index_t i = 0; i < n; ++i)
        std::copy(gathered_.data() + r * per + i * lq_ * hs_, gathered_.data() + r * per + (i + 1) * lq_ * hs_,
                  xb + i * d + r * lq_ * hs_);
    detail::matmul(T, xb, d, n, d, m.wo(l), d, tmp, d);
    if (projected) KVEVICT_TRY(hooks->after_projection({l, projection::o, n, xb, d, d, tmp, d, d}));
    for (index_t i = 0; i < n * d; ++i) x[i] += tmp[i];
    for (index_t i = 0; i < n; ++i) detail::rmsnorm(xb + i * d, x + i * d, m.ffn_norm(l), d);
    detail::matmul(T, xb, d, n, d, m.w13(l), 2 * hidden, h13, 2 * hidden);
    if (projected) {
      KVEVICT_TRY(hooks->after_projection({l, projection::w1, n, xb, d, d, h13, 2 * hidden, hidden}));
      KVEVICT_TRY(hooks->after_projection({l, projection::w3, n, xb, d, d, h13 + hidden, 2 * hidden, hidden}));
    }
    for (index_t i = 0; i < n; ++i) detail::swiglu(h13 + i * 2 * hidden, h13 + i * 2 * hidden + hidden, hidden);
    detail::matmul(T, h13, 2 * hidden, n, hidden, m.w2(l), d, tmp, d);
    if (projected) KVEVICT_TRY(hooks->after_projection({l, projection::w2, n, h13, 2 * hidden, hidden, tmp, d, d}));
    for (index_t i = 0; i < n * d; ++i) x[i] += tmp[i];
    if (hooks == nullptr || !hooks->after_layer) return {};
    layer_event ev;  // this rank's heads, as runner::run's event
    ev.layer = l;
    ev.rows = n;
    ev.positions = pos_.data();
    ev.queries = *kvevict::make_kv_view<const float>(qkv, lq_, n, hs_, hs_, lw);
    ev.keys = *kvevict::make_kv_view<const float>(qkv + lq_ * hs_, hk, n, hs_, hs_, lw);
    ev.values = *kvevict::make_kv_view<const float>(qkv + (lq_ + hk) * hs_, hk, n, hs_, hs_, lw);
    ev.rolled_back = extra;
    return hooks->after_layer(ev);
  }

  // CAKE's layer preference from the window's queries over the prompt's keys (sharded under --tp).
  status preference(kvevict::kv_view<const float> wq, kvevict::kv_view<const float> keys, double& pref) {
    return with_workspace(pref_ws_, [&](kvevict::workspace& ws) {
      if (s_.tp > 1) return kvevict::cake_window_preference(kvevict::seq, ws, *tpc_, wq, keys, {}, &pref);
      return kvevict::cake_window_preference(kvevict::seq, ws, wq, keys, {}, &pref);
    });
  }

  // The allocation of a `tokens`-token sequence (plan_allocation, as evictor::plan) with this
  // rank's block of the [L][H] budgets; `most`: max_head_rows of the whole model's allocation.
  status plan(index_t tokens, kvevict::allocation& out, index_t* most = nullptr) {
    return plan_as(allocator_of(o_), {rec_.n_sink, rec_.n_recent}, tokens, out, most);
  }
  // plan() with scheme `a` and protection `prot` (LAQ's stage 1: uniform, its SnapKV's).
  status plan_as(budget_scheme a, kvevict::protection prot, index_t tokens, kvevict::allocation& out, index_t* most = nullptr) {
    const config& c = m_->cfg();
    const index_t H = c.n_kv_heads, hk = heads_.count, Ls = layers_.count;
    KVEVICT_TRY(plan_allocation(c, a, o_.budget, tokens, prot, &duo_, alloc_));
    if (most != nullptr) *most = kvevict::max_head_rows(alloc_.alloc);
    out = alloc_.alloc;
    if (alloc_.budgets.empty()) return {};
    budgets_.assign(static_cast<std::size_t>(Ls * hk), 0);
    for (index_t l = 0; l < Ls; ++l)
      for (index_t h = 0; h < hk; ++h)
        budgets_[static_cast<std::size_t>(l * hk + h)] =
            alloc_.budgets[static_cast<std::size_t>((layers_.first + l) * H + heads_.first + h)];
    out.budgets = *kvevict::make_matrix_view(budgets_.data(), Ls, hk);
    return {};
  }
  kvevict::model_shape shape() const { return {layers_.count, heads_.count, lq_, hs_}; }
  // The post-fill driver's configuration of a P-token prompt on this rank's heads / layers (the
  // tensor-parallel communicator set; the pipeline's is the caller's to set).
  status post_fill_of(index_t P, kvevict::post_fill_config& pc) {
    KVEVICT_TRY(plan(P, pc.alloc));
    pc.model = shape();
    pc.tokens = P;
    pc.rec = rec_;
    pc.tp = tp();
    return {};
  }
  kvevict::comm_ref tp() { return s_.tp > 1 ? kvevict::comm_ref(*tpc_) : kvevict::comm_ref{}; }
  int model_layer(index_t ls) const { return static_cast<int>(layers_.first + ls); }
  template <class Driver>
  status compact_all(const Driver& d) {
    for (index_t ls = 0; ls < layers_.count; ++ls) KVEVICT_TRY(cache_.compact(model_layer(ls), d.kept(ls)));
    return {};
  }

  // Head types (duo, prulong, duo-heuristic) with the layerwise, chunked and decode drivers
  // (evictor::prefill_streaming on this rank's heads / layers): the prompt forwarded in chunks (the
  // chunked drivers' --chunk, else at once), after each the streaming heads drop what left their
  // window (kvevict::streaming_heads_driver on this rank's slice of the head types: head types are
  // per KV head, no communication); retrieval heads keep everything.
  bool streaming() const {
    return o_.recipe != method::full && allocator_of(o_) == budget_scheme::duo && o_.driver != driver_kind::postfill;
  }
  status prefill_streaming(const std::vector<int>& prompt) {
    const config& c = m_->cfg();
    const index_t P = static_cast<index_t>(prompt.size()), H = c.n_kv_heads, hk = heads_.count, Ls = layers_.count;
    const bool chunked = o_.driver == driver_kind::chunked_naive || o_.driver == driver_kind::chunked_patched;
    kvevict::allocation al;  // decode: the allocation of a max(B, P)-token sequence, as evictor's
    status st = plan(o_.driver == driver_kind::decode ? std::max(o_.budget, P) : P, al);
    if (st.ok() && static_cast<index_t>(alloc_.retrieval.size()) != index_t(c.n_layers) * H)
      st = status::error(errc::invalid_argument, "sharded_runner: %s has no head types", method_name(o_.recipe));
    if (st.ok()) {
      retrieval_.assign(static_cast<std::size_t>(Ls * hk), 0);
      for (index_t l = 0; l < Ls; ++l)
        for (index_t h = 0; h < hk; ++h)
          retrieval_[static_cast<std::size_t>(l * hk + h)] =
              alloc_.retrieval[static_cast<std::size_t>((layers_.first + l) * H + heads_.first + h)];
      kvevict::streaming_heads_config sc;
      sc.model = shape();
      sc.capacity = c.seq_len;  // the cache's: the heads grow by the decoded tokens
      sc.streaming = {rec_.n_sink, rec_.n_recent};
      sc.retrieval = *kvevict::make_matrix_view<const std::uint8_t>(retrieval_.data(), Ls, hk);
      kvevict::workspace ws;
      st = init_driver(sh_, scratch_, sc, recorder_, ws);
    }
    KVEVICT_TRY(agree_failure(*world_, st));
    for (index_t s = 0, e = 0; s < P; s = e) {
      e = chunked ? std::min(s + o_.chunk, P) : P;
      KVEVICT_TRY(timed(prefill_s_, [&] { return forward(prompt.data() + s, e - s); }));
      KVEVICT_TRY(timed(evict_s_, [&] { return stream_layers(); }));
    }
    return {};
  }
  // This rank's layers after a forward: the streaming heads' update at next_ tokens, the layers that
  // dropped rows compacted; a rank failing here fails every rank before the next forward.
  status stream_layers() {
    status st;
    for (index_t ls = 0; ls < layers_.count && st.ok(); ++ls) {
      const int l = model_layer(ls);
      st = sh_.update(ls, cache_.layer(l), next_);
      if (st.ok() && sh_.evicted(ls)) st = cache_.compact(l, sh_.kept(ls));
    }
    return agree_failure(*world_, st);
  }

  // evictor::prefill_chunked on this rank's heads / layers: forward a chunk (patched: then the
  // prompt's last w tokens as an extra block), add every layer, decide, compact.
  status prefill_chunked(const std::vector<int>& prompt) {
    const index_t P = static_cast<index_t>(prompt.size()), w = o_.window;
    const bool patched = o_.driver == driver_kind::chunked_patched;
    kvevict::chunked_config cc = chunked_config_of(o_, rec_, shape(), P);
    KVEVICT_TRY(plan(P, cc.alloc));
    cc.tp = tp();
    if (s_.pp > 1) {  // this stage's layers of the model's (lava: each chunk's budget gathered)
      cc.pp = kvevict::comm_ref(*ppc_);
      cc.first_layer = layers_.first;
      cc.model_layers = m_->cfg().n_layers;
    }
    kvevict::workspace ws;
    KVEVICT_TRY(init_driver(ch_, scratch_, cc, recorder_, ws));
    chunk_q_.reset(mine_cfg_, w);
    patch_q_.reset(mine_cfg_, w);
    for (index_t s = 0, e = 0; s < P; s = e) {
      e = std::min(s + o_.chunk, P);
      if (patched && e < P && e > P - w) e = P;  // the final chunk holds the whole window
      KVEVICT_TRY(ch_.begin_chunk(s, e));
      const index_t n = e - s, rows = ch_.query_rows();
      const kvevict::patch_block patch = ch_.patch();
      forward_hooks hk;
      if (rows > 0 && patch.count == 0)
        hk.after_layer = [this, n, rows](const layer_event& ev) { return chunk_q_.store(ev, 0, n - rows, rows); };
      KVEVICT_TRY(timed(prefill_s_, [&] { return forward(prompt.data() + s, n, &hk); }));
      const auto t0 = std::chrono::steady_clock::now();  // the patch's forward and the eviction (as evictor's)
      if (patch.count > 0) {
        patch_pos_.resize(static_cast<std::size_t>(patch.count));
        for (index_t i = 0; i < patch.count; ++i) patch_pos_[static_cast<std::size_t>(i)] = static_cast<pos_t>(patch.first + i);
        const forward_hooks ph = patch_q_.hooks();
        KVEVICT_TRY(forward(prompt.data() + patch.first, patch.count, &ph, patch_pos_.data(), true, logits_mode::none));
      }
      for (index_t ls = 0; ls < layers_.count; ++ls) {
        const int l = model_layer(ls);
        kvevict::kv_view<const float> q, pk;
        chunk_queries_of(patch_q_, chunk_q_, patch, rows, l, q, pk);
        KVEVICT_TRY(ch_.add_layer(kvevict::seq, ws, ls, cache_.layer(l), q, pk));
      }
      KVEVICT_TRY(ch_.decide(kvevict::seq, ws));
      KVEVICT_TRY(compact_all(ch_));
      evict_s_ += seconds_since(t0);
    }
    return {};
  }

  // evictor::prefill_layerwise on this rank's heads / layers, inside the prefill's after_layer hook:
  // per-layer allocators through post_fill_driver layer by layer (TP: flattened / adakv select
  // across the ranks in add_layer; PP: each stage's driver on its layers, no communication), then
  // decide(); lava / cake through cascade_driver holding the whole model's L layers, the other
  // stages' as remote layers (add_remote_layer, docs/distributed.md "The cascade"): the layers
  // before this stage by their weights gathered at each stage boundary, the layers after it once
  // the prefill is done, compacting this stage's layers whenever a step shrinks them; under --tp the
  // driver holds this rank's heads and selects across the head shards (cascade_driver_config::tp).
  status prefill_layerwise(const std::vector<int>& prompt) {
    const config& c = m_->cfg();
    const index_t P = static_cast<index_t>(prompt.size()), L = c.n_layers, w = o_.window, hk = heads_.count;
    const index_t a = layers_.first, b = layers_.first + layers_.count;
    const budget_scheme scheme = allocator_of(o_);
    const bool cascade = scheme == budget_scheme::lava || scheme == budget_scheme::cake;
    kvevict::workspace ws;
    kvevict::eviction_recorder cascade_rec;
    if (cascade) {
      kvevict::allocation al;
      KVEVICT_TRY(plan(P, al));
      kvevict::cascade_driver_config cc;
      cc.model = {L, hk, lq_, hs_};  // the whole model's layers (the other stages' are remote)
      cc.tokens = P;
      cc.rec = rec_;
      cc.total = al.total;
      cc.split = scheme == budget_scheme::lava ? kvevict::cascade_split::flattened : kvevict::cascade_split::per_head;
      cc.weight = scheme == budget_scheme::lava ? kvevict::weight_source::lava_entropy : kvevict::weight_source::caller;
      cc.tp = tp();  // total: the model's over every rank's heads (plan's)
      if (recorder_ != nullptr) {  // the driver records [L][heads][N]; this stage's layers copied out below
        const index_t N = recorder_->capacity();
        cascade_schedule_.assign(static_cast<std::size_t>(L * hk * N), 0);
        const auto made = kvevict::make_eviction_recorder(cascade_schedule_.data(), L, hk, N);
        if (!made) return made.error();
        cascade_rec = *made;
      }
      KVEVICT_TRY(init_driver(cd_, scratch_, cc, recorder_ != nullptr ? &cascade_rec : nullptr, ws));
      stage_weights_.assign(static_cast<std::size_t>(std::max<index_t>(layers_.count, 1)), 0.0);
      model_weights_.assign(static_cast<std::size_t>(L), 0.0);
    } else {
      kvevict::post_fill_config pc;
      KVEVICT_TRY(post_fill_of(P, pc));
      KVEVICT_TRY(init_driver(pf_, scratch_, pc, recorder_, ws));
    }
    // the cascade's layers [first, end): the other stages' remote ones, compacting this stage's
    // layers that shrink
    const auto remote = [&](index_t first, index_t end) -> status {
      for (index_t j = first; j < end; ++j) {
        KVEVICT_TRY(cd_.add_remote_layer(kvevict::seq, ws, j, model_weights_[static_cast<std::size_t>(j)]));
        for (index_t i = a; i < b; ++i)
          if (cd_.changed(i)) KVEVICT_TRY(cache_.compact(static_cast<int>(i), cd_.kept(i)));
      }
      return {};
    };
    // the weights of layers [0, end) on every rank, each stage giving its own layers among them
    const auto gather = [&](index_t end) {
      const index_t lo = std::min(a, end), hi = std::min(b, end);
      return with_workspace(gather_ws_, [&](kvevict::workspace& gws) {
        return kvevict::gather_layer_values(gws, *ppc_, kvevict::shard_range{lo, hi - lo}, stage_weights_.data(), end,
                                            model_weights_.data());
      });
    };
    double hook_s = 0.0;
    forward_hooks hk_;
    hk_.after_layer = [&](const layer_event& ev) -> status {
      const auto t0 = std::chrono::steady_clock::now();
      const int l = ev.layer;
      const auto q = kvevict::recipe_queries(rec_, ev.queries);
      if (!q) return q.error();
      if (cascade) {
        double weight = 0.0;
        if (scheme == budget_scheme::cake)
          KVEVICT_TRY(preference(*kvevict::token_range(ev.queries, P - w, w), cache_.dense_keys(l, P), weight));
        KVEVICT_TRY(cd_.add_layer(kvevict::seq, ws, l, cache_.layer(l), *q, {}, weight));
        stage_weights_[static_cast<std::size_t>(l - a)] = cd_.layer_weight(l);
        KVEVICT_TRY(cache_.compact(l, cd_.kept(l)));
        for (index_t j = a; j < l; ++j)
          if (cd_.changed(j)) KVEVICT_TRY(cache_.compact(static_cast<int>(j), cd_.kept(j)));
      } else {
        const index_t ls = l - a;
        KVEVICT_TRY(pf_.add_layer(kvevict::seq, ws, ls, cache_.layer(l), *q));
        KVEVICT_TRY(cache_.compact(l, pf_.kept(ls)));
      }
      hook_s += seconds_since(t0);
      return {};
    };
    const bool staged = cascade && s_.pp > 1;
    if (staged)  // every stage boundary but the last: the earlier layers' weights, the next stage adds them
      after_stage_ = [&](int st) -> status {
        const auto t0 = std::chrono::steady_clock::now();
        const kvevict::shard_range done = *kvevict::layer_shard(L, s_.pp, st);
        const index_t end = done.first + done.count;
        status r;
        if (end < L) {
          r = gather(end);
          if (r.ok() && st + 1 == ppc_->rank()) r = remote(0, end);
        }
        hook_s += seconds_since(t0);
        return r;
      };
    const auto t0 = std::chrono::steady_clock::now();
    const status fw = forward(prompt.data(), P, &hk_);
    after_stage_ = nullptr;
    KVEVICT_TRY(fw);
    if (!cascade) KVEVICT_TRY(pf_.decide(kvevict::seq, ws));
    const auto t1 = std::chrono::steady_clock::now();  // the prefill as evictor's: forward + decide - hooks
    prefill_s_ += seconds_since(t0) - hook_s;
    if (staged) {  // the later stages' layers, now that every weight is known
      KVEVICT_TRY(gather(L));
      KVEVICT_TRY(remote(b, L));
    }
    if (cascade && recorder_ != nullptr)  // this stage's layers of the driver's schedule
      for (index_t ls = 0; ls < layers_.count; ++ls)
        for (index_t h = 0; h < hk; ++h)
          for (index_t p = 0; p < recorder_->capacity(); ++p)
            recorder_->storage()(ls, h, p) = cascade_rec.storage()(a + ls, h, p);
    evict_s_ += hook_s + seconds_since(t1);
    return {};
  }

  // evictor::prefill_decode on this rank's heads / layers: a plain prefill, the decode driver
  // begun on the whole prompt (H2O from the prompt's accumulated attention), the last w queries kept.
  status prefill_decode(const std::vector<int>& prompt) {
    const config& c = m_->cfg();
    const index_t P = static_cast<index_t>(prompt.size()), w = o_.window, hk = heads_.count;
    prompt_q_.reset(mine_cfg_, P);
    const forward_hooks pq = prompt_q_.hooks();
    KVEVICT_TRY(timed(prefill_s_, [&] { return forward(prompt.data(), P, &pq); }));
    const auto t0 = std::chrono::steady_clock::now();  // the driver's plan, init and begin
    kvevict::decode_config dc;
    index_t most = 0;
    KVEVICT_TRY(plan(std::max(o_.budget, P), dc.alloc, &most));
    dc.model = shape();
    dc.capacity = std::min<index_t>(c.seq_len, std::max(P, most) + o_.evict_every);
    dc.interval = o_.evict_every;
    dc.rec = rec_;
    dc.tp = tp();
    KVEVICT_TRY(init_driver(dd_, scratch_, dc, recorder_, decode_ws_));
    const bool h2o = rec_.kind == kvevict::recipe_kind::h2o;
    initial_.assign(h2o ? static_cast<std::size_t>(hk * P) : 0, 0.0f);
    kvevict::recipe hr = rec_;  // H2O: the prompt's accumulated attention, unprotected
    hr.n_sink = hr.n_recent = 0;
    for (index_t ls = 0; ls < layers_.count; ++ls) {
      const int l = model_layer(ls);
      kvevict::matrix_view<const float> init_scores;
      if (h2o) {
        const auto out = *kvevict::make_matrix_view(initial_.data(), hk, P);
        KVEVICT_TRY(with_workspace(init_ws_, [&](kvevict::workspace& ws) {
          return kvevict::recipe_scores(kvevict::seq, ws, hr, prompt_q_.queries(l, 0, P), cache_.dense_keys(l, P),
                                        kvevict::kv_view<const float>{}, out);
        }));
        init_scores = out;
      }
      KVEVICT_TRY(dd_.begin(ls, cache_.layer(l), P, init_scores));
    }
    step_q_.reset(mine_cfg_, 1);
    recent_q_.reset(mine_cfg_, w);
    const index_t have = std::min(w, P);
    for (index_t ls = 0; ls < layers_.count; ++ls)
      recent_q_.put(model_layer(ls), w - have, prompt_q_.queries(model_layer(ls), P - have, have));
    evict_s_ += seconds_since(t0);
    return {};
  }

  // evictor::decode with the decode driver: the token's forward (its queries kept, the window of
  // recent queries shifted), then decode_driver::step on every layer, compacting those it evicts.
  status decode_step(int token) {
    const index_t w = o_.window;
    forward_hooks hk;
    hk.after_layer = [&](const layer_event& ev) -> status {
      KVEVICT_TRY(step_q_.store(ev, 0));
      for (index_t h = 0; h < lq_; ++h) {  // evictor::push_recent
        float* first = recent_q_.query_row(ev.layer, h, 0);
        std::memmove(first, first + hs_, static_cast<std::size_t>((w - 1) * hs_) * sizeof(float));
      }
      recent_q_.put(ev.layer, w - 1, ev.queries);
      return {};
    };
    KVEVICT_TRY(forward(&token, 1, &hk));
    return timed(evict_s_, [&]() -> status {
      for (index_t ls = 0; ls < layers_.count; ++ls) {
        const int l = model_layer(ls);
        const kvevict::kv_view<const float> q = decode_queries_of(rec_, step_q_, recent_q_, l, w);
        KVEVICT_TRY(dd_.step(kvevict::seq, decode_ws_, ls, cache_.layer(l), q));
        if (dd_.evicted(ls)) KVEVICT_TRY(cache_.compact(l, dd_.kept(ls)));
      }
      return {};
    });
  }

  bool laq() const { return o_.recipe == method::laq || o_.recipe == method::laq_pp; }

  // methods/laq.hpp's laq_queries on this rank's heads / layers, after the postfill prefill of a
  // P-token prompt (prompt_q_, logits_ its last row's): stage 1 evicts a copy of the cache (SnapKV,
  // uniform budget, the method's sinks: laq_pseudo_queries' configuration), the o_.laq_steps greedy
  // pseudo tokens are decoded on it (their queries and keys into pseudo_q_; every rank has the same
  // logits, so the same argmax), then the full cache, the position and the prefill's logits are
  // restored. laq++: union_q_ = the prompt's last w queries and keys, then the pseudo block
  // (laq_union_block's rows).
  status laq_block(index_t P) {
    const config& c = m_->cfg();
    const index_t V = c.vocab_size, n = o_.laq_steps;
    laq_full_ = cache_;
    kvevict::post_fill_config pc;
    pc.model = shape();
    pc.tokens = P;
    pc.rec = make_recipe(laq_stage1_options(o_));
    pc.tp = tp();
    if (s_.pp > 1) {
      pc.pp = kvevict::comm_ref(*ppc_);
      pc.first_layer = layers_.first;
      pc.model_layers = c.n_layers;
    }
    KVEVICT_TRY(plan_as(budget_scheme::uniform, {pc.rec.n_sink, pc.rec.n_recent}, P, pc.alloc));
    KVEVICT_TRY(post_fill_decide(
        pf_, scratch_, pc,
        [&](int ls, layer_inputs& in) -> status {
          const int l = model_layer(ls);
          in.kv = cache_.layer(l);
          const auto q = kvevict::recipe_queries(pc.rec, prompt_q_.queries(l, 0, P));
          if (!q) return q.error();
          in.queries = *q;
          return {};
        },
        nullptr));
    KVEVICT_TRY(compact_all(pf_));
    laq_logits_.assign(logits_.begin(), logits_.begin() + V);
    pseudo_q_.reset(mine_cfg_, n);
    int tok = sampler::argmax(laq_logits_.data(), static_cast<int>(V));
    for (index_t i = 0; i < n; ++i) {
      const forward_hooks hk = pseudo_q_.hooks(i);
      KVEVICT_TRY(forward(&tok, 1, &hk));
      tok = sampler::argmax(logits_.data(), static_cast<int>(V));
    }
    std::swap(cache_, laq_full_);
    next_ = static_cast<pos_t>(P);
    std::copy(laq_logits_.begin(), laq_logits_.end(), logits_.begin());
    if (o_.recipe != method::laq_pp) return {};
    const index_t w = o_.window;
    union_q_.reset(mine_cfg_, w + n);
    for (index_t ls = 0; ls < layers_.count; ++ls) {
      const int l = model_layer(ls);
      union_q_.put(l, 0, prompt_q_.queries(l, P - w, w), *kvevict::token_range(cache_.dense_keys(l, P), P - w, w));
      union_q_.put(l, w, pseudo_q_.queries(l, 0, n), pseudo_q_.keys(l, 0, n));
    }
    return {};
  }

  // evictor::laq_pp_scores on this rank's heads: layer l's [heads().count][P] scores into
  // laq_scores_, the prompt's first P - w columns scored with the union block (its own keys), the
  // window's w columns +inf (the recipe protects them).
  status laq_pp_scores(int l, index_t P, const block_capture& blk) {
    const index_t hk = heads_.count, w = rec_.n_recent, prefix = P - w;
    laq_scores_.assign(static_cast<std::size_t>(hk * P), std::numeric_limits<float>::infinity());
    const auto out = *kvevict::make_matrix_view(laq_scores_.data(), hk, prefix, P);
    kvevict::recipe r = rec_;
    r.n_recent = 0;  // the prefix's own last rows are not protected
    return with_workspace(laq_ws_, [&](kvevict::workspace& ws) {
      return kvevict::recipe_scores(kvevict::seq, ws, r, blk.queries(l, 0, blk.rows()),
                                    *kvevict::token_range(cache_.dense_keys(l, P), 0, prefix),
                                    kvevict::kv_view<const float>{}, out, blk.keys(l, 0, blk.rows()));
    });
  }

  // lookahead_scorer::score on this rank's heads / layers after the prefill of a P-token prompt: the
  // module's n lookahead rows as an extra block (positions P .. P + n - 1, KV dropped), the
  // adapters through lookahead_lora, at each layer its queries and own keys over the prompt's keys
  // (attention_scores, [lq][P]) pooled and GQA-reduced (postprocess_scores, the scorer's default
  // options) into lkv_scores_ [layers().count][heads().count][P].
  status lookahead_scores(index_t P) {
    const config& c = m_->cfg();
    const lookahead_module& mod = *lkv_;
    const index_t n = mod.n_lookahead(), hk = heads_.count;
    if (P + n > c.seq_len)
      return status::error(errc::out_of_range,
                           "lookahead_scorer: %lld prompt tokens + %lld lookahead tokens exceed the context of %d",
                           static_cast<long long>(P), static_cast<long long>(n), c.seq_len);
    lkv_raw_.assign(static_cast<std::size_t>(lq_ * P), 0.0f);
    lkv_scores_.assign(static_cast<std::size_t>(layers_.count * hk * P), 0.0f);
    lkv_xa_.assign(static_cast<std::size_t>(n * mod.rank()), 0.0f);
    lkv_delta_.assign(static_cast<std::size_t>(n * std::max<index_t>(c.dim, c.hidden_dim)), 0.0f);
    forward_hooks hk_;
    hk_.after_projection = [&](const projection_event& ev) { return lookahead_lora(ev); };
    hk_.after_layer = [&](const layer_event& ev) -> status {
      const auto raw = *kvevict::make_matrix_view(lkv_raw_.data(), lq_, P);
      const auto out = *kvevict::make_matrix_view(lkv_scores_.data() + (ev.layer - layers_.first) * hk * P, hk, P);
      KVEVICT_TRY(with_workspace(lkv_ws_, [&](kvevict::workspace& ws) {
        return kvevict::attention_scores(kvevict::seq, ws, ev.queries, cache_.dense_keys(ev.layer, P), ev.keys, raw);
      }));
      return with_workspace(lkv_ws_, [&](kvevict::workspace& ws) {
        return kvevict::postprocess_scores(kvevict::seq, ws, kvevict::matrix_view<const float>(raw), out,
                                           kvevict::postprocess_options{});
      });
    };
    return forward(nullptr, n, &hk_, nullptr, true, logits_mode::none, mod.embeddings());
  }

  // lookahead_scorer's adapters on an event of the sharded forward (lkv::add_lora): the event's
  // columns, which for q, k, v are this rank's heads' (B's columns from the heads' first one);
  // each delta column is the same sum over B's rows as the whole product's.
  status lookahead_lora(const projection_event& ev) {
    const config& c = m_->cfg();
    index_t first = 0, whole = ev.out;  // the event's first column of the whole projection, its width
    if (ev.which == projection::q) {
      first = heads_.first * group_ * hs_;
      whole = c.dim;
    } else if (ev.which == projection::k || ev.which == projection::v) {
      first = heads_.first * hs_;
      whole = c.kv_dim();
    }
    return lkv::add_lora(*lkv_, ev, first, whole, lkv_xa_.data(), lkv_delta_.data());
  }

  // The post-fill eviction of a prefilled prompt of P tokens on this rank's heads / layers; `block`
  // (the oracle's true response, speckv's draft, laq's pseudo block): an external query block with
  // its own keys, this rank's heads (laq++: its union block scores the prompt minus its window).
  status evict(index_t P, const block_capture* block = nullptr) {
    const config& c = m_->cfg();
    const index_t L = c.n_layers;
    kvevict::post_fill_config pc;
    KVEVICT_TRY(post_fill_of(P, pc));
    if (block != nullptr) pc.query_rows = block->rows();
    if (lkv_ != nullptr) pc.rec.window = 1;  // lookaheadkv: no queries are read on the scores path
    if (s_.pp > 1) {  // this stage's layers of the model's L
      pc.pp = kvevict::comm_ref(*ppc_);
      pc.first_layer = layers_.first;
      pc.model_layers = L;
    }
    const bool cake = allocator_of(o_) == budget_scheme::cake;
    const index_t w = o_.window;
    const auto inputs = [&](int ls, layer_inputs& in) {
      const int l = model_layer(ls);
      in.kv = cache_.layer(l);
      if (lkv_ != nullptr) {
        in.scores = *kvevict::make_matrix_view<const float>(lkv_scores_.data() + ls * heads_.count * P, heads_.count, P);
      } else if (block != nullptr && o_.recipe == method::laq_pp) {
        KVEVICT_TRY(laq_pp_scores(l, P, *block));
        in.scores = *kvevict::make_matrix_view<const float>(laq_scores_.data(), heads_.count, P);
      } else if (block != nullptr) {
        in.queries = block->queries(l, 0, block->rows());
        in.block_keys = block->keys(l, 0, block->rows());
      } else {
        const auto q = kvevict::recipe_queries(rec_, prompt_q_.queries(l, 0, P));
        if (!q) return q.error();
        in.queries = *q;
      }
      return cake ? preference(prompt_q_.queries(l, P - w, w), cache_.dense_keys(l, P), in.weight) : status{};
    };
    KVEVICT_TRY(post_fill_decide(pf_, scratch_, pc, inputs, recorder_));
    return compact_all(pf_);
  }
};

namespace detail {

/// The whole model's [L][H][e] values from every rank's [layers().count][heads().count][e] block
/// (one allgather, each block padded to the largest). `pad` and `blocks` are scratch.
template <class T, class Comm>
status gather_model(Comm& comm, const shard_options& s, const config& c, index_t e, const T* mine, std::vector<T>& pad,
                    std::vector<T>& blocks, std::vector<T>& out) {
  const int P = comm.size(), me = comm.rank();  // the world: rank = stage x tp + head shard
  const index_t L = c.n_layers, H = c.n_kv_heads;
  const auto range = [&](int r, kvevict::shard_range& hr, kvevict::shard_range& lr) {
    const kvevict::grid_place at = *kvevict::grid_place_of(s.tp, s.pp, r);
    hr = s.tp > 1 ? *kvevict::head_shard(H, s.tp, at.shard) : kvevict::shard_range{0, H};
    lr = s.pp > 1 ? *kvevict::layer_shard(L, s.pp, at.stage) : kvevict::shard_range{0, L};
  };
  index_t most = 0;
  for (int r = 0; r < P; ++r) {
    kvevict::shard_range hr, lr;
    range(r, hr, lr);
    most = std::max(most, hr.count * lr.count * e);
  }
  kvevict::shard_range hr, lr;
  range(me, hr, lr);
  pad.assign(static_cast<std::size_t>(most), T{});
  std::copy(mine, mine + hr.count * lr.count * e, pad.begin());
  blocks.resize(static_cast<std::size_t>(most * P));
  KVEVICT_TRY(comm.allgather(pad.data(), static_cast<std::size_t>(most) * sizeof(T), blocks.data()));
  out.resize(static_cast<std::size_t>(L * H * e));
  for (int r = 0; r < P; ++r) {
    range(r, hr, lr);
    for (index_t l = 0; l < lr.count; ++l)
      for (index_t h = 0; h < hr.count; ++h) {
        const T* from = blocks.data() + r * most + (l * hr.count + h) * e;
        std::copy(from, from + e, out.begin() + ((lr.first + l) * H + hr.first + h) * e);
      }
  }
  return {};
}

/// The report's times of a sharded row: each the max over the ranks (the slowest rank bounds the
/// step), one allgather of this rank's two.
template <class Comm>
status slowest_rank(Comm& world, std::array<double, 2> mine, double& prefill_ms, double& evict_ms) {
  std::vector<std::array<double, 2>> all(static_cast<std::size_t>(world.size()));
  KVEVICT_TRY(world.allgather(mine.data(), sizeof mine, all.data()));
  prefill_ms = evict_ms = 0.0;
  for (const auto& a : all) {
    prefill_ms = std::max(prefill_ms, a[0]);
    evict_ms = std::max(evict_ms, a[1]);
  }
  return {};
}

/// One rank's state of the sharded report.
template <class Comm>
struct sharded_report_worker {
  sharded_runner<Comm> full, run;
  block_capture response_q;            // the true response's queries and keys (this rank's heads)
  std::vector<float> gt;               // [layers().count][heads().count][P] ground truth
  std::vector<double> full_logp, logq, per_head, recall_pad, recall_blocks, recalls;
  std::vector<pos_t> schedule, schedule_pad, schedule_blocks, model_schedule, whole;
  std::vector<unsigned char> ws;
  std::vector<pos_t> kept_pos;
  std::vector<std::int32_t> kept_cu;
  speckv_drafter drafter;  // the speckv rows' draft model (whole on every rank)
  std::vector<int> draft;  // the prompt's draft tokens
};

/// held_recall on a sharded run: every rank's per-head recalls gathered, then averaged over the
/// heads and the layers in one process's order (kept_recall_at_k's sum over the rows).
template <class Comm>
status sharded_recall(const model& mdl, const shard_comms<Comm>& comm, const shard_options& s, index_t P, index_t k,
                      sharded_report_worker<Comm>& w, double& recall) {
  const config& c = mdl.cfg();
  const kvevict::shard_range hr = w.run.heads(), lr = w.run.layers();
  const index_t hk = hr.count, L = c.n_layers, H = c.n_kv_heads;
  w.per_head.assign(static_cast<std::size_t>(lr.count * hk), 0.0);
  for (index_t ls = 0; ls < lr.count; ++ls) {
    const int l = static_cast<int>(lr.first + ls);
    w.kept_pos.clear();
    w.kept_cu.assign(static_cast<std::size_t>(hk + 1), 0);
    for (index_t h = 0; h < hk; ++h) {
      for (index_t j = 0; j < w.run.cache().length(l, h); ++j)
        if (w.run.cache().position(l, h, j) < P) w.kept_pos.push_back(w.run.cache().position(l, h, j));
      w.kept_cu[static_cast<std::size_t>(h + 1)] = static_cast<std::int32_t>(w.kept_pos.size());
    }
    const kvevict::ragged_positions kept{w.kept_pos.data(), w.kept_cu.data(), hk};
    const auto truth = *kvevict::make_matrix_view<const float>(w.gt.data() + ls * hk * P, hk, P);
    double mean = 0.0;
    KVEVICT_TRY(with_workspace(w.ws, [&](kvevict::workspace& ws) {
      return kvevict::kept_recall_at_k(ws, kept, truth, k, mean, w.per_head.data() + ls * hk);
    }));
  }
  KVEVICT_TRY(gather_model(*comm.world, s, c, 1, w.per_head.data(), w.recall_pad, w.recall_blocks, w.recalls));
  double sum = 0.0;
  for (index_t l = 0; l < L; ++l) {
    double layer = 0.0;
    for (index_t h = 0; h < H; ++h) layer += w.recalls[static_cast<std::size_t>(l * H + h)];
    sum += layer / static_cast<double>(H);
  }
  recall = sum / static_cast<double>(L);
  return {};
}

/// evaluate_prompt on a sharded job: every configuration on one prompt, every number but the
/// times as one process computes it (the times: measured on every rank, the slowest rank's).
template <class Comm>
status sharded_evaluate_prompt(const model& mdl, const shard_comms<Comm>& comm, const shard_options& s, const report_options& o,
                               const std::vector<report_config>& configs, const std::vector<duo_heads>& heads,
                               const text_pair& tp,
                               sharded_report_worker<Comm>& w, std::vector<prompt_result>& out, double& draft_match) {
  const config& c = mdl.cfg();
  const index_t P = static_cast<index_t>(tp.prompt.size()), m = static_cast<index_t>(tp.response.size());
  const index_t V = c.vocab_size, L = c.n_layers, H = c.n_kv_heads, N = P + m - 1;
  // the full cache: prefill, the response teacher-forced (its queries and keys captured), the ground truth
  evict_options fo = o.base;
  fo.recipe = method::full;
  KVEVICT_TRY(w.full.init(mdl, comm, s, fo));
  KVEVICT_TRY(w.full.prefill(tp.prompt));
  w.full_logp.resize(static_cast<std::size_t>(m * V));
  log_softmax(w.full.logits(), V, w.full_logp.data());
  w.response_q.reset(w.full.shard_config(), m);
  const forward_hooks rh = w.response_q.hooks();
  KVEVICT_TRY(w.full.extra(tp.response, &rh, logits_mode::all));
  for (index_t t = 1; t < m; ++t) log_softmax(w.full.logits(t - 1), V, w.full_logp.data() + t * V);
  const kvevict::shard_range hr = w.full.heads(), lr = w.full.layers();
  const index_t hk = hr.count;
  w.gt.assign(static_cast<std::size_t>(lr.count * hk * P), 0.0f);
  const kvevict::recipe gr = ground_truth_recipe();
  for (index_t ls = 0; ls < lr.count; ++ls) {
    const int l = static_cast<int>(lr.first + ls);
    const auto out_l = *kvevict::make_matrix_view(w.gt.data() + ls * hk * P, hk, P);
    KVEVICT_TRY(with_workspace(w.ws, [&](kvevict::workspace& ws) {
      return kvevict::recipe_scores(kvevict::seq, ws, gr, w.response_q.queries(l, 0, m), w.full.cache().dense_keys(l, P),
                                    kvevict::kv_view<const float>{}, out_l, w.response_q.keys(l, 0, m));
    }));
  }
  // SpecKV's draft (prepare_prompt's): the draft model run whole on every rank, the same tokens
  double draft_s = 0.0;
  if (std::any_of(configs.begin(), configs.end(), [](const report_config& rc) { return rc.recipe == method::speckv; })) {
    KVEVICT_TRY(w.drafter.draft(tp.prompt, o.base.draft_tokens, w.draft));
    index_t same = 0;
    for (std::size_t i = 0; i < w.draft.size() && i < tp.response.size(); ++i) same += w.draft[i] == tp.response[i];
    draft_match = static_cast<double>(same) / static_cast<double>(w.draft.size());
    draft_s = w.drafter.seconds();
  }
  w.logq.resize(static_cast<std::size_t>(V));
  w.schedule.resize(static_cast<std::size_t>(lr.count * hk * N));
  out.assign(configs.size(), prompt_result{});
  for (std::size_t ci = 0; ci < configs.size(); ++ci) {
    const report_config& rc = configs[ci];
    KVEVICT_TRY(w.run.init(mdl, comm, s, config_options(o, rc), &heads[ci], o.lookahead));
    auto made = kvevict::make_eviction_recorder(w.schedule.data(), lr.count, hk, N);
    if (!made) return made.error();
    kvevict::eviction_recorder rec = *made;
    prompt_result& r = out[ci];
    const bool speckv = rc.recipe == method::speckv;  // its block: the draft; the oracle's: the true response
    KVEVICT_TRY(w.run.prefill(tp.prompt, &rec, speckv ? &w.draft : &tp.response));
    KVEVICT_TRY(w.run.rows(r.kept));
    // post-fill rows share the full cache's timed prefill, as one process's
    const double prefill_s = rc.driver == driver_kind::postfill ? w.full.prefill_seconds() : w.run.prefill_seconds();
    const index_t k = recall_k(rc, P, r.kept, L, H);
    bool agreeing = true;
    double kl = 0.0, recall = 0.0, step_recall = 0.0;
    for (index_t t = 0; t < m; ++t) {  // evaluate_prompt's loop
      kl += score_position(w.full_logp.data() + t * V, w.run.logits(), V, tp.response[static_cast<std::size_t>(t)],
                           w.logq.data(), agreeing, r);
      if (t + 1 < m) {
        if (t == 0 || rc.driver == driver_kind::decode) KVEVICT_TRY(sharded_recall(mdl, comm, s, P, k, w, step_recall));
        recall += step_recall;
        KVEVICT_TRY(w.run.decode(tp.response[static_cast<std::size_t>(t)]));
      }
    }
    // the whole model's schedule from every rank's block
    KVEVICT_TRY(gather_model(*comm.world, s, c, N, w.schedule.data(), w.schedule_pad, w.schedule_blocks, w.model_schedule));
    w.whole.resize(static_cast<std::size_t>(L * H * N));
    const auto whole = kvevict::make_eviction_recorder(w.whole.data(), L, H, N);  // the view measure_kv_usage takes
    if (!whole) return whole.error();
    std::copy(w.model_schedule.begin(), w.model_schedule.end(), w.whole.begin());
    const auto sched = whole->schedule(N);
    if (!sched) return sched.error();
    const double evict_s = w.run.evict_seconds() + (speckv ? draft_s : 0.0);  // finish_row's: the draft's time added
    KVEVICT_TRY(slowest_rank(*comm.world, {prefill_s * 1e3, evict_s * 1e3}, r.prefill_ms, r.evict_ms));
    r.overhead = r.prefill_ms > 0.0 ? (r.prefill_ms + r.evict_ms) / r.prefill_ms : 1.0;  // finish_row's
    KVEVICT_TRY(finish_prompt(kl, recall, m, *sched, w.ws, r));
  }
  return {};
}

}  // namespace detail

/// The quality report on a sharded job (kvevict-run --report --tp P / --pp P, docs/distributed.md):
/// run_report's prompts, configurations and numbers, the prompts one after another on every rank
/// (each configuration through sharded_runner), so that every number but the times equals the
/// one-process report's bit for bit (prefill_ms, evict_ms: measured per rank as evictor does, the
/// max over the ranks; overhead from those, per prompt, as finish_row's). Every rank
/// returns the same `out`. Errors: run_report's; a configuration that does not run sharded
/// (check_sharded), naming it, before any prompt runs.
template <class Comm>
status run_sharded_report(const model& mdl, const shard_comms<Comm>& comm, const shard_options& s, const report_options& o,
                          report_result& out) {
  const config& c = mdl.cfg();
  const auto t_start = std::chrono::steady_clock::now();
  if (o.prompts < 1) return status::error(errc::invalid_argument, "--prompts must be >= 1, got %lld", static_cast<long long>(o.prompts));
  std::vector<report_config> configs;
  KVEVICT_TRY(report_configs(c, o, configs));
  for (const report_config& rc : configs) {
    const status st = check_sharded(c, s, comm.world->size(), detail::config_options(o, rc));
    if (!st.ok())
      return status::error(errc::unsupported, "sharded report: %s / %s / budget %lld: %s (choose --recipes / --drivers that do)",
                           method_name(rc.recipe), driver_name(rc.driver), static_cast<long long>(rc.budget), st.message());
  }
  out = report_result{};
  out.options = o;
  out.options.progress = {};
  const int nt = thread_count(o.threads);
  out.threads = nt;
  std::vector<text_pair> pairs;
  KVEVICT_TRY(detail::report_prompts(mdl, o, nt, pairs, out));
  std::vector<duo_heads> heads;  // every rank calibrates and reads the masks alike (init agrees on a hash)
  KVEVICT_TRY(detail::report_head_types(mdl, o, configs, nt, out.duo, heads));
  const index_t n = o.prompts;
  std::vector<std::vector<prompt_result>> results(static_cast<std::size_t>(n));
  std::vector<double> draft_match(static_cast<std::size_t>(n), 0.0);
  detail::sharded_report_worker<Comm> w;
  const bool speckv =
      std::any_of(configs.begin(), configs.end(), [](const report_config& rc) { return rc.recipe == method::speckv; });
  if (speckv) KVEVICT_TRY(w.drafter.init(mdl, o.base.draft_layers));
  for (index_t i = 0; i < n; ++i) {
    KVEVICT_TRY(detail::sharded_evaluate_prompt(mdl, comm, s, o, configs, heads, pairs[static_cast<std::size_t>(i)], w,
                                                results[static_cast<std::size_t>(i)], draft_match[static_cast<std::size_t>(i)]));
    if (o.progress) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "report: %lld/%lld prompts, %.1f s", static_cast<long long>(i + 1),
                    static_cast<long long>(n), seconds_since(t_start));
      o.progress(msg);
    }
  }
  detail::report_rows(configs, heads, results, out);
  if (speckv) out.draft_match = std::move(draft_match);
  out.seconds = seconds_since(t_start);
  return {};
}

/// Generation on one rank of a sharded job: prefill `prompt` with eviction, then sample until
/// `steps` positions (prompt included) as continue_generation does; every rank gets the same `generated`.
/// `sample` draws a token from logits (every rank draws the same: the logits are equal bit for bit).
/// `response`: the oracle's query block (the full cache's continuation, e.g. from this function
/// with --recipe full) or speckv's (the draft), the same on every rank. `lookahead`: lookaheadkv's module.
template <class Comm, class Sample>
status sharded_generate(const model& m, const shard_comms<Comm>& comm, const shard_options& s, const evict_options& o,
                        const std::vector<int>& prompt, int steps, Sample&& sample, std::vector<int>& generated,
                        const duo_heads* duo = nullptr, const std::vector<int>* response = nullptr,
                        const lookahead_module* lookahead = nullptr) {
  sharded_runner<Comm> run;
  KVEVICT_TRY(run.init(m, comm, s, o, duo, lookahead));
  KVEVICT_TRY(run.prefill(prompt, nullptr, response));
  generated.clear();
  for (;;) {  // continue_generation's loop (generate.hpp): BOS ends, `steps` positions in all
    const int token = sample(run.logits());
    if (token == bos_token) break;
    generated.push_back(token);
    if (run.next_position() >= steps) break;
    KVEVICT_TRY(run.decode(token));
  }
  return {};
}

}  // namespace kvrun
