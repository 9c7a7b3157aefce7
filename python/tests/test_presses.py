"""The kvpress-style presses: [batch, heads, tokens, dim] in, compacted caches out."""
import numpy as np
import pytest
import torch

import kvevict
from kvevict import presses
from conftest import KV_DTYPES, randn, topk_sorted

B, HQ, H, T, D = 2, 4, 2, 128, 16


def cache(gen, dtype=torch.float32):
    return (randn(gen, B, H, T, D, dtype=dtype), randn(gen, B, H, T, D, dtype=dtype),
            randn(gen, B, HQ, T, D, dtype=dtype))


def gather(x, kept):
    return torch.gather(x, 2, kept.long()[..., None].expand(-1, -1, -1, x.shape[-1]))


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_snapkv_press_is_the_recipe_then_topk_then_gather(gen, dtype):
    k, v, q = cache(gen, dtype)
    press = presses.SnapKV(budget=48, window=16)
    ko, vo = press(k, v, q)
    assert ko.shape == (B, H, 48, D) and ko.dtype == dtype
    for b in range(B):
        r = kvevict.Recipe.snapkv()
        r.window = 16
        r.n_recent = 16
        s = kvevict.recipe_scores(r, q[b, :, -16:], k[b])
        kept = kvevict.recipe_select(r, s, 48)
        assert torch.equal(press.last_kept[b], kept)
        assert torch.equal(ko[b], gather(k[b:b + 1], kept[None])[0])
        assert torch.equal(vo[b], gather(v[b:b + 1], kept[None])[0])


def test_compression_ratio_and_default_recipes(gen):
    k, v, q = cache(gen)
    ko, _ = presses.Knorm(compression_ratio=0.75)(k, v)
    assert ko.shape[2] == 32
    # Knorm keeps the keys of smallest norm
    kept = topk_sorted(-k.double().norm(dim=-1), 32)
    assert torch.equal(ko, gather(k, kept))
    ko, _ = presses.StreamingLLM(budget=20)(k, v)
    assert torch.equal(ko, torch.cat([k[:, :, :4], k[:, :, -16:]], dim=2))


@pytest.mark.parametrize("cls", [presses.SnapKV, presses.H2O, presses.TOVA, presses.Knorm, presses.VATP,
                                 presses.StreamingLLM, presses.CAKE])
def test_uniform_presses_keep_the_budget(gen, cls):
    k, v, q = cache(gen)
    ko, vo = cls(budget=40)(k, v, q)
    assert ko.shape == (B, H, 40, D) and vo.shape == (B, H, 40, D)


def test_adakv_press_is_ragged(gen):
    k, v, q = cache(gen)
    press = presses.AdaKV(presses.SnapKV(budget=40), alpha=0.2)
    rk, rv = press(k, v, q)
    assert isinstance(rk, presses.Ragged)
    lengths = rk.lengths()
    assert lengths.shape == (B, H) and (lengths.sum(axis=1) == 40 * H).all()
    assert (lengths >= 32).all()  # the protected window (32) is every head's floor at least
    for b in range(B):
        pos, cu = press.last_kept[b]
        for h in range(H):
            p = pos[cu[h]:cu[h + 1]].long()
            assert torch.equal(rk.head(b, h), k[b, h, p]) and torch.equal(rv.head(b, h), v[b, h, p])
            off = b * H + h
            assert torch.equal(rk.positions[rk.cu[off]:rk.cu[off + 1]].long(), p)


def test_lava_and_cake_share_budgets_across_layers(gen):
    layers = [cache(gen) for _ in range(3)]
    out = presses.LAVa(budget=48).evict_layers(layers)
    kept = sum(int(rk.lengths().sum()) for rk, _ in out)
    assert kept == 48 * H * B * 3
    out = presses.CAKE(budget=48).evict_layers(layers)
    per_layer = [int(rk.lengths().sum()) for rk, _ in out]
    assert sum(per_layer) == 48 * H * B * 3 and len(set(per_layer)) > 1
    out = presses.PyramidKV(budget=48).evict_layers(layers)
    per_layer = [int(rk.lengths().sum()) for rk, _ in out]
    assert sum(per_layer) == 48 * H * B * 3 and per_layer[0] > per_layer[2]


def test_pyramid_press_single_layer_and_duo(gen):
    k, v, q = cache(gen)
    rk, _ = presses.PyramidKV(budget=48)(k, v, q, layer=0, num_layers=4)
    assert (rk.lengths() > 48).all()
    duo = presses.Duo(np.array([[1, 0]]), n_sink=4, n_recent=8)
    rk, rv = duo(k, v, q, layer=0)
    assert rk.lengths().tolist() == [[T, 12]] * B
    assert torch.equal(rk.head(0, 1), torch.cat([k[0, 1, :4], k[0, 1, -8:]]))


def test_numpy_press(gen):
    k, v, q = (x.numpy() for x in cache(gen))
    ko, vo = presses.SnapKV(budget=40)(k, v, q)
    assert isinstance(ko, np.ndarray) and ko.shape == (B, H, 40, D)


def test_press_errors(gen):
    k, v, q = cache(gen)
    with pytest.raises(ValueError, match="exactly one of budget and compression_ratio"):
        presses.SnapKV()
    with pytest.raises(ValueError, match="needs queries"):
        presses.SnapKV(budget=40)(k, v)
    with pytest.raises(ValueError, match=r"\[batch, heads, tokens, dim\]"):
        presses.SnapKV(budget=40)(k[0], v[0], q[0])
    with pytest.raises(kvevict.Error, match="budget|protected"):
        presses.SnapKV(budget=8)(k, v, q)  # below the 32 protected window tokens


@pytest.mark.parametrize("scheme", ["uniform", "pyramid", "adakv", "lava", "cake"])
def test_post_fill_driver(gen, scheme):
    """kvevict's post-fill driver over three layers: the kept rows of every layer, the budgets the
    scheme promises, and (uniform) the recipe's own selection."""
    L = 3
    layers = [cache(gen) for _ in range(L)]
    r = kvevict.Recipe.snapkv()
    r.window, r.n_recent = 16, 16
    d = kvevict.PostFillDriver(r, L, H, HQ, D, T, scheme=scheme, budget=40)
    cake = presses.CAKE(budget=40, window=16)
    for l, (k, v, q) in enumerate(layers):
        pref = cake.cake_preference(q[0], k[0]) if scheme == "cake" else 0.0
        d.add_layer(l, k[0], v[0], queries=q[0, :, -16:], cake_preference=pref)
    d.decide()
    total = 0
    for l, (k, v, q) in enumerate(layers):
        assert d.ready(l)
        pos, cu = d.kept(l)
        total += int(cu[-1])
        for h in range(H):  # the protected window is kept by every head
            assert set(range(T - 16, T)) <= set(pos[cu[h]:cu[h + 1]].tolist())
        if scheme == "uniform":
            s = kvevict.recipe_scores(r, q[0, :, -16:], k[0])
            assert torch.equal(torch.as_tensor(pos).view(H, 40), torch.as_tensor(kvevict.recipe_select(r, s, 40)))
    assert total == 40 * H * L
    k, v, q = layers[0]
    with pytest.raises(kvevict.Error, match="post_fill_driver::add_layer"):  # layers come once, in order
        d.add_layer(0, k[0], v[0], queries=q[0, :, -16:])


def test_decode_driver_tova(gen):
    """kvevict's decode driver with TOVA, back to the budget after every decoded token: each step
    keeps what recipe_scores + recipe_select keep on the layer's rows."""
    B_, C = 24, 25
    keys, values = torch.zeros(H, C, D), torch.zeros(H, C, D)
    positions = torch.zeros(H, C, dtype=torch.int32)
    keys[:, :B_], values[:, :B_] = randn(gen, H, B_, D), randn(gen, H, B_, D)
    positions[:, :B_] = torch.arange(B_, dtype=torch.int32)
    lens = torch.full((H,), B_, dtype=torch.int32)
    r = kvevict.Recipe.tova()
    d = kvevict.DecodeDriver(r, 1, H, HQ, D, C, interval=1, budget=B_)
    d.begin(0, keys, values, lens, positions, tokens=B_)
    for t in range(3):
        assert d.evicts_next(0)
        keys[:, B_], values[:, B_] = randn(gen, H, D), randn(gen, H, D)
        positions[:, B_] = B_ + t
        lens.fill_(C)
        q = randn(gen, HQ, 1, D)
        kept = d.step(0, keys, values, lens, positions, queries=q)
        assert kept is not None
        pos, cu = kept
        ref = kvevict.recipe_select(r, kvevict.recipe_scores(r, q, keys), B_)
        assert torch.equal(torch.as_tensor(pos).view(H, B_), torch.as_tensor(ref))
        for h in range(H):  # the engine compacts: keys, values and positions alike
            rows = torch.as_tensor(pos[cu[h]:cu[h + 1]]).long()
            keys[h, :B_], values[h, :B_], positions[h, :B_] = keys[h, rows], values[h, rows], positions[h, rows]
        lens.fill_(B_)
        assert d.tokens(0) == B_ + t + 1 and d.held(0, 0) == B_
    with pytest.raises(kvevict.Error, match="decode_driver::step"):
        d.step(0, keys, values, lens, positions, queries=randn(gen, HQ, 1, D))  # no new row appended


@pytest.mark.parametrize("split,weight", [("flattened", "lava_entropy"), ("per_head", "caller")])
def test_cascade_driver(gen, split, weight):
    """kvevict's layer-wise cascade (LAVa / CAKE): the engine compacts the new layer and every
    changed earlier layer; the model never holds more than the total, and ends holding it."""
    L, total = 3, 40 * H * 3
    r = kvevict.Recipe.lava() if split == "flattened" else kvevict.Recipe.cake()
    r.window, r.n_recent = 16, 16
    d = kvevict.CascadeDriver(r, L, H, HQ, D, T, total, split=split, weight=weight)
    cake = presses.CAKE(budget=40, window=16)
    held = []  # per layer, per head: the original positions the engine's cache holds
    for l in range(L):
        k, v, q = cache(gen)
        pref = cake.cake_preference(q[0], k[0]) if weight == "caller" else 0.0
        d.add_layer(l, k[0], v[0], queries=q[0, :, -16:], weight=pref)
        pos, cu = d.kept(l)
        held.append([pos[cu[h]:cu[h + 1]].tolist() for h in range(H)])
        for j in range(l):
            if d.changed(j):
                pos, cu = d.kept(j)
                held[j] = [[held[j][h][i] for i in pos[cu[h]:cu[h + 1]]] for h in range(H)]
        assert d.held_rows == sum(len(x) for layer in held for x in layer) <= total
    assert d.held_rows == total and d.peak_rows <= total + H * T
    for j in range(L):
        pos, cu = d.positions(j)
        assert [pos[cu[h]:cu[h + 1]].tolist() for h in range(H)] == held[j]
        for h in range(H):
            assert set(range(T - 16, T)) <= set(held[j][h])  # the window stays


def test_chunked_driver_naive(gen):
    """kvevict's chunked-prefill driver (naive): two chunks of 64 down to 40 rows per head; the first
    chunk alone is a post-fill eviction of its rows, and the prompt's last window survives."""
    B_, W, CH = 40, 16, 64
    C = B_ + CH
    r = kvevict.Recipe.snapkv()
    r.window, r.n_recent = W, W
    d = kvevict.ChunkedDriver(r, 1, H, HQ, D, T, C, queries="naive", budget=B_)
    k_all, v_all = randn(gen, H, T, D), randn(gen, H, T, D)
    keys, values = torch.zeros(H, C, D), torch.zeros(H, C, D)
    positions = torch.zeros(H, C, dtype=torch.int32)
    lens = torch.zeros(H, dtype=torch.int32)
    for s in range(0, T, CH):
        d.begin_chunk(s, s + CH)
        n = int(lens[0])
        keys[:, n:n + CH], values[:, n:n + CH] = k_all[:, s:s + CH], v_all[:, s:s + CH]
        positions[:, n:n + CH] = torch.arange(s, s + CH, dtype=torch.int32)
        lens.fill_(n + CH)
        assert d.query_rows() == W and d.patch()[1] == 0
        q = randn(gen, HQ, W, D)
        d.add_layer(0, keys, values, lens, positions, queries=q)
        d.decide()
        pos, cu = d.kept(0)
        if s == 0:
            ref = kvevict.recipe_select(r, kvevict.recipe_scores(r, q, keys[:, :CH]), B_)
            assert torch.equal(torch.as_tensor(pos).view(H, B_), torch.as_tensor(ref))
        for h in range(H):
            rows = torch.as_tensor(pos[cu[h]:cu[h + 1]]).long()
            m = rows.numel()
            keys[h, :m], values[h, :m], positions[h, :m] = keys[h, rows], values[h, rows], positions[h, rows]
            lens[h] = m
    assert lens.tolist() == [B_] * H and d.final_chunk()
    for h in range(H):
        assert positions[h, B_ - W:B_].tolist() == list(range(T - W, T))
