"""The budget allocators against their definitions (docs/budget.md), written out in PyTorch."""
import math

import numpy as np
import pytest
import torch

import kvevict
from conftest import randn, ref_protect


def test_uniform_budgets():
    b = kvevict.uniform_budgets(100, 64, 3, 4, n_recent=4)
    assert b.dtype == np.int32 and b.shape == (3, 4) and b.sum() == 100
    # floor(100 / 12) = 8 everywhere, the first 100 mod 12 = 4 heads in (layer, head) order one more
    assert b.flatten().tolist() == [9] * 4 + [8] * 8
    with pytest.raises(kvevict.Error, match="uniform_budgets"):
        kvevict.uniform_budgets(12, 64, 3, 4, n_recent=4)  # 1 per head < 4 protected


@pytest.mark.parametrize("rounding", ["exact", "kvcache_factory"])
def test_pyramid_budgets(rounding):
    L, H, N, B, W = 8, 2, 1024, 128, 32
    b = kvevict.pyramid_budgets(B, N, L, H, n_recent=W, rounding=rounding)
    P = B - W
    mn = P // 20
    mx = 2 * P - mn
    assert (np.diff(b[:, 0]) <= 0).all() and (b == b[:, :1]).all()
    if rounding == "kvcache_factory":
        steps = (mx - mn) // (L - 1)
        assert b[:, 0].tolist() == [mx - l * steps + W for l in range(L)]
    else:
        assert b.sum() == B * H * L
        exact = [(mx * (L - 1) - l * (mx - mn)) / (L - 1) + W for l in range(L)]
        assert all(abs(b[l, 0] - exact[l]) < 1 for l in range(L))


@pytest.mark.parametrize("floor", ["budget", "evictable"])
def test_adakv_budgets(gen, floor):
    H, T, B, alpha, W = 4, 64, 16, 0.25, 4
    s = kvevict.protect(randn(gen, H, T), 0, W)
    pos, cu = kvevict.adakv_budgets(s, B, alpha=alpha, floor=floor, n_recent=W)
    assert int(cu[-1]) == B * H
    # reference: each head's floor first, then the joint best of the remaining entries
    f = math.floor(alpha * B + 1e-9) if floor == "budget" else W + math.floor(alpha * (B - W) + 1e-9)
    keep = torch.zeros(H, T, dtype=torch.bool)
    for h in range(H):
        keep[h, torch.topk(s[h], f).indices] = True
    rest = s.masked_fill(keep, float("-inf")).flatten()
    keep.view(-1)[torch.topk(rest, B * H - f * H).indices] = True
    for h in range(H):
        assert pos[cu[h]:cu[h + 1]].tolist() == keep[h].nonzero().flatten().tolist()


def test_lava_entropy_and_layer_budgets(gen):
    H, T, W = 2, 40, 8
    s = kvevict.protect(randn(gen, H, T).abs(), 0, W)
    e = kvevict.lava_layer_entropy(s, n_recent=W)
    x = s[:, : T - W].double().flatten()
    p = x / x.sum()
    assert e == pytest.approx(float(-(p * p.log()).sum() / math.log(x.numel())), rel=1e-12)
    totals = kvevict.lava_layer_budgets([0.2, 0.5, 0.3], H, T, 3 * H * 16, n_recent=W)
    assert totals.sum() == 3 * H * 16
    # evictable parts proportional to the entropies (within one token), protected tokens on top
    ev = totals - H * W
    share = np.array([0.2, 0.5, 0.3]) * (3 * H * 16 - 3 * H * W)
    assert (abs(ev - share) < 1).all()


def test_cake(gen):
    a = torch.softmax(randn(gen, 3, 6, 20), dim=-1)  # [R][w][C] probabilities
    ent, var = kvevict.cake_layer_stats(a)
    a64 = a.double()
    assert ent == pytest.approx(float(-(a64 * a64.log()).sum()), rel=1e-10)
    assert var == pytest.approx(float(a64.var(dim=1, unbiased=True).sum()), rel=1e-10)
    assert kvevict.cake_preference(ent, var, 2.0, 0.5) == pytest.approx(ent ** 0.5 * var ** 2, rel=1e-12)
    b = kvevict.cake_budgets([1.0, 3.0], 24, 100, 2, n_recent=8)
    assert b.sum() == 24 * 2 * 2 and (b[:, 0] - 8).tolist() == [8, 24]


def test_duo_and_streaming():
    mask = np.array([[1, 0], [0, 0]], dtype=np.uint8)
    b, total = kvevict.duo_budgets(mask, 100, n_sink=4, n_recent=8)
    assert b.tolist() == [[100, 12], [12, 12]] and total == 136
    assert kvevict.streaming_positions(20, 2, 3).tolist() == [0, 1, 17, 18, 19]
    assert kvevict.duo_retrieval_heads(136, 2, 2, 100, 4, 8) == 1


@pytest.mark.parametrize("scheme", ["uniform", "pyramid", "adakv", "lava", "cake", "duo"])
def test_make_allocation(scheme):
    mask = np.array([[1, 0], [0, 1]], dtype=np.uint8) if scheme == "duo" else None
    kind, budgets, kept = kvevict.make_allocation(scheme, 32, 200, 2, 2, n_recent=8, retrieval=mask)
    expected = {"uniform": "per_head", "pyramid": "per_head", "adakv": "adakv", "lava": "lava", "cake": "cake",
                "duo": "per_head"}[scheme]
    assert kind == kvevict.Allocator(expected)
    if scheme in ("uniform", "pyramid", "adakv"):
        assert budgets.sum() == kept == 32 * 4
    if scheme == "duo":
        assert budgets.tolist() == [[200, 8], [8, 200]] and kept == 416


def test_offsets_and_apportion():
    assert kvevict.budget_offsets(np.array([3, 0, 5], np.int32)).tolist() == [0, 3, 3, 8]
    assert kvevict.apportion(4, [1, 1, 1]).tolist() == [2, 1, 1]
    assert kvevict.apportion(10, [1, 3], caps=[10, 5]).tolist() == [5, 5]
    with pytest.raises(kvevict.Error, match="caps has 1 entries"):
        kvevict.apportion(4, [1, 1], caps=[3])


def test_protect_reference_used_by_allocators(gen):
    s = randn(gen, 2, 10)
    assert torch.equal(kvevict.protect(s.clone(), 1, 2), ref_protect(s, 1, 2).float())
