"""Every stage binding against the PyTorch references of conftest.py, in fp32, fp16 and bf16."""
import pytest
import torch

import kvevict
from conftest import (KV_DTYPES, close, randn, ref_attention, ref_gqa, ref_pool, ref_protect, ref_recipe,
                      ref_window, topk_sorted)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("reduce", ["mean", "sum", "mean_visible", "mean_plus_variance"])
def test_attention_scores(gen, dtype, reduce):
    q, p, b = randn(gen, 8, 5, 16, dtype=dtype), randn(gen, 2, 40, 16, dtype=dtype), randn(gen, 2, 5, 16, dtype=dtype)
    opt = kvevict.ScoreOptions(reduce=reduce)
    close(kvevict.attention_scores(q, p, options=opt), ref_attention(q, p, reduce=reduce), rtol=1e-4)
    close(kvevict.attention_scores(q, p, b, options=opt, all_columns=True),
          ref_attention(q, p, b, reduce=reduce, all_columns=True), rtol=1e-4)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_window_h2o_tova_scores(gen, dtype):
    k = randn(gen, 2, 30, 8, dtype=dtype)
    q = randn(gen, 4, 30, 8, dtype=dtype)
    close(kvevict.window_scores(q[:, -6:], k), ref_window(q[:, -6:], k), rtol=1e-4)
    close(kvevict.h2o_scores(q, k), ref_attention(q, k[:, :0], k, reduce="sum", all_columns=True), rtol=1e-4)
    close(kvevict.h2o_scores(q, k, normalised=True),
          ref_attention(q, k[:, :0], k, reduce="mean_visible", all_columns=True), rtol=1e-4)
    close(kvevict.tova_scores(q[:, -1:], k), ref_attention(q[:, -1:], k[:, :-1], k[:, -1:], all_columns=True),
          rtol=1e-4)


def test_key_norm_and_position_scores(gen):
    k = randn(gen, 3, 20, 8)
    close(kvevict.key_norm_scores(k), -k.double().norm(dim=-1))
    out = torch.empty(3, 20)
    assert kvevict.position_scores(out) is out
    close(out, torch.arange(20.0).expand(3, 20))


@pytest.mark.parametrize("op", ["mean", "max", "sum"])
def test_gqa_reduce(gen, op):
    s = randn(gen, 8, 50)
    close(kvevict.gqa_reduce(s, 2, op), ref_gqa(s, 2, op))


@pytest.mark.parametrize("kind,kernel", [("max", 7), ("avg", 5), ("none", 3), ("max", 1)])
def test_pool1d(gen, kind, kernel):
    s = randn(gen, 3, 40)
    close(kvevict.pool1d(s, kind, kernel), ref_pool(s, kind, kernel))


def test_pool1d_valid_divisor(gen):
    s = randn(gen, 2, 10)
    ones = torch.ones(1, 1, 10)
    counts = torch.nn.functional.avg_pool1d(ones, 5, 1, 2, count_include_pad=True)[0] * 5
    ref = ref_pool(s, "avg", 5) * 5 / counts
    close(kvevict.pool1d(s, "avg", 5, divisor="valid"), ref)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_weight_by_value_norm(gen, dtype):
    v = randn(gen, 2, 30, 8, dtype=dtype)
    s = randn(gen, 4, 30).abs()
    norms = v.double().abs().sum(-1).repeat_interleave(2, dim=0)
    ref = s.double() * norms
    close(kvevict.weight_by_value_norm(s.clone(), v, "per_token"), ref, rtol=1e-5)
    ref = s.double() * norms.max(dim=1, keepdim=True).values
    close(kvevict.weight_by_value_norm(s.clone(), v, "head_max"), ref, rtol=1e-5)


def test_protect(gen):
    s = randn(gen, 3, 20)
    close(kvevict.protect(s.clone(), 2, 5), ref_protect(s, 2, 5))


@pytest.mark.parametrize("order", ["pool_first", "gqa_first"])
def test_postprocess_equals_the_chain(gen, order):
    s = randn(gen, 8, 60).abs()
    v = randn(gen, 2, 60, 8)
    opt = kvevict.PostprocessOptions(gqa="max", order=order, pool="max", kernel=5, weight_values=True,
                                     weight="per_token", n_sink=2, n_recent=4)
    if order == "pool_first":
        chain = ref_gqa(ref_pool(s, "max", 5), 2, "max")
    else:
        chain = ref_pool(ref_gqa(s, 2, "max"), "max", 5)
    chain = ref_protect(chain.double() * v.double().abs().sum(-1), 2, 4)
    close(kvevict.postprocess_scores(s, 2, v, opt), chain, rtol=1e-5)


def test_select_dense_ragged_flat(gen):
    s = randn(gen, 4, 100)
    assert torch.equal(kvevict.select_topk(s, 10), topk_sorted(s, 10))
    budgets = torch.tensor([3, 0, 10, 7], dtype=torch.int32)
    pos, cu = kvevict.select_topk_ragged(s, budgets)
    assert cu.tolist() == [0, 3, 3, 13, 20]
    for h in range(4):
        assert pos[cu[h]:cu[h + 1]].tolist() == topk_sorted(s[h:h + 1], int(budgets[h]))[0].tolist()
    out = (torch.full((20,), -1, dtype=torch.int32), torch.full((5,), -1, dtype=torch.int32))
    got = kvevict.select_topk_ragged(s, budgets, out=out)
    assert got[0].data_ptr() == out[0].data_ptr() and got[1].data_ptr() == out[1].data_ptr()
    assert torch.equal(out[0], pos) and torch.equal(out[1], cu)
    with pytest.raises(kvevict.Error, match="must be"):
        kvevict.select_topk_ragged(s, budgets, out=(torch.zeros(19, dtype=torch.int32), out[1]))
    with pytest.raises(kvevict.Error, match="contiguous"):
        kvevict.select_topk_ragged(s, budgets, out=(torch.zeros(40, dtype=torch.int32)[::2], out[1]))
    r = kvevict.Recipe.snapkv()
    r.window = r.n_recent = 2
    rpos, rcu = kvevict.recipe_select(r, s, torch.tensor([3, 2, 10, 7], dtype=torch.int32), out=None)
    got = kvevict.recipe_select(r, s, torch.tensor([3, 2, 10, 7], dtype=torch.int32),
                                out=(torch.zeros(22, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)))
    assert torch.equal(got[0], rpos) and torch.equal(got[1], rcu)
    with pytest.raises(kvevict.Error, match="protected"):  # a head's budget below its protected tokens
        kvevict.recipe_select(r, s, torch.tensor([3, 1, 10, 7], dtype=torch.int32))
    with pytest.raises(kvevict.Error, match="above the 100 tokens"):
        kvevict.recipe_select(r, s, torch.tensor([3, 2, 101, 7], dtype=torch.int32))
    pos, cu = kvevict.select_topk_flat(s, 50)
    flat = torch.topk(s.flatten(), 50).indices
    for h in range(4):
        mine = sorted(int(i) % 100 for i in flat if int(i) // 100 == h)
        assert pos[cu[h]:cu[h + 1]].tolist() == mine
    lengths = torch.tensor([100, 50, 20, 10], dtype=torch.int32)
    kept = kvevict.select_topk(s, 5, row_lengths=lengths)
    for h in range(4):
        assert kept[h].tolist() == topk_sorted(s[h:h + 1, : int(lengths[h])], 5)[0].tolist()


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_compact(gen, dtype):
    src = randn(gen, 2, 30, 8, dtype=dtype)
    kept = topk_sorted(randn(gen, 2, 30), 10)
    ref = torch.gather(src, 1, kept.long()[..., None].expand(-1, -1, 8))
    assert torch.equal(kvevict.compact(src, kept), ref)
    pos, cu = kvevict.select_topk_ragged(randn(gen, 2, 30), torch.tensor([4, 9], dtype=torch.int32))
    rows = kvevict.compact_ragged(src, pos, cu)
    assert torch.equal(rows[:4], src[0, pos[:4].long()]) and torch.equal(rows[4:], src[1, pos[4:].long()])
    cache = src.clone()
    kvevict.compact_inplace(cache, kept)
    assert torch.equal(cache[:, :10], ref)


RECIPES = ["snapkv", "streaming_llm", "h2o", "tova", "knorm", "vatp", "lava", "cake"]


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_recipes(gen, name, dtype):
    k, v = randn(gen, 2, 96, 16, dtype=dtype), randn(gen, 2, 96, 16, dtype=dtype)
    q_all = randn(gen, 4, 96, 16, dtype=dtype)
    r = kvevict.Recipe.from_name(name)
    q = {"h2o": q_all, "tova": q_all[:, -1:], "knorm": None, "streaming_llm": None}.get(name, q_all[:, -r.window:])
    scores = kvevict.recipe_scores(r, q, k, v)
    ref = ref_recipe(name, q, k, v)
    close(scores, ref, rtol=2e-4, atol=1e-6)
    kept = kvevict.recipe_select(r, scores, 48)
    assert kept.shape == (2, 48)
    # every protected token is kept, and the rest are the best of the others
    for h in range(2):
        prot = torch.isinf(ref[h]).nonzero().flatten().tolist()
        assert set(prot) <= set(kept[h].tolist())


def test_recipe_fields_and_names():
    r = kvevict.Recipe.snapkv()
    assert (r.window, r.kernel, r.pool, r.gqa, r.n_recent) == (32, 7, kvevict.PoolKind.max, kvevict.GqaOp.mean, 32)
    r.pool = "avg"
    r.kernel = 5
    assert r.pool == kvevict.PoolKind.avg
    assert kvevict.Recipe.cake().score.reduce == kvevict.ScoreReduce.mean_plus_variance
    assert kvevict.Recipe(window=8).window == 8
    with pytest.raises(kvevict.Error, match="unknown recipe 'snap'"):
        kvevict.Recipe.from_name("snap")
    with pytest.raises(kvevict.Error, match="no field 'windw'"):
        kvevict.Recipe(windw=8)
    assert kvevict.recipe_scores_workspace_bytes(r, 4, 32, 2, 96, 16) > 0
