"""The round-four bindings: the sharded CAKE statistics, paged window scores and value weighting,
compact_layer (ragged and paged), the cascading budget rule alone (LayerCascade) and the head-mask
TSV reader, each against a PyTorch / NumPy reference or the dense stage on a gathered copy."""
import os

import numpy as np
import pytest
import torch

import kvevict
from conftest import SOURCE_DIR, randn, ref_window, run_threads
from test_paged import gather, make_paged, row_lengths


# ---- sharded CAKE statistics ------------------------------------------------------------------

@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("variance", ["unbiased", "biased"])
def test_sharded_cake_stats_exact(gen, P, variance):
    R, w, C = 2, 5, 17
    a = torch.softmax(randn(gen, P * R, w, C), dim=-1)
    want = kvevict.cake_layer_stats(a, variance=variance)
    comms = kvevict.thread_comms(P)
    got = run_threads(P, lambda r: kvevict.cake_layer_stats_sharded(comms[r], a[r * R:(r + 1) * R], variance=variance))
    assert got == [want] * P  # bit for bit on every rank
    a64 = a.double()
    assert want[0] == pytest.approx(float(-(a64 * a64.log()).sum()), rel=1e-10)
    assert want[1] == pytest.approx(float(a64.var(dim=1, unbiased=variance == "unbiased").sum()), rel=1e-10)
    assert kvevict.cake_layer_stats_sharded(kvevict.Comm(), a, variance=variance) == want


def test_sharded_cake_stats_errors_reach_every_rank(gen):
    P = 2
    comms = kvevict.thread_comms(P)
    shapes = [(2, 5, 17), (2, 5, 16)]  # ranks disagree on C
    with pytest.raises(kvevict.Error):
        run_threads(P, lambda r: kvevict.cake_layer_stats_sharded(comms[r], torch.rand(*shapes[r], generator=gen)))


# ---- CAKE window preference (single process and sharded) ------------------------------------

def ref_cake_window_preference(q, k, tau1, tau2):
    """The window's causal attention over the prefix in float64, then CAKE's statistics."""
    H_q, w, d = q.shape
    T = k.shape[1]
    kk = k.double().repeat_interleave(H_q // k.shape[0], dim=0)
    logits = q.double() @ kk.transpose(1, 2) / d ** 0.5
    causal = torch.arange(T)[None, :] > (T - w + torch.arange(w))[:, None]
    a = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)[:, :, : T - w]
    entropy = float(-(a * a.log()).sum())
    variance = float(a.var(dim=1, unbiased=True).sum())
    return entropy ** (1 / tau1) * variance ** (1 / tau2)


@pytest.mark.parametrize("P", [2, 3])
def test_cake_window_preference_sharded_exact(gen, P):
    R_kv, group, w, T, d = 1, 2, 4, 19, 8
    q, k = randn(gen, P * R_kv * group, w, d), randn(gen, P * R_kv, T, d)
    want = kvevict.cake_window_preference(q, k, tau1=1.6, tau2=0.4)
    assert want == pytest.approx(ref_cake_window_preference(q, k, 1.6, 0.4), rel=1e-4)
    comms = kvevict.thread_comms(P)
    Rq = R_kv * group
    got = run_threads(P, lambda r: kvevict.cake_window_preference_sharded(
        comms[r], q[r * Rq:(r + 1) * Rq], k[r * R_kv:(r + 1) * R_kv], tau1=1.6, tau2=0.4))
    assert got == [want] * P  # bit for bit on every rank
    assert kvevict.cake_window_preference_sharded(kvevict.Comm(), q, k, tau1=1.6, tau2=0.4) == want


def test_cake_window_preference_errors(gen):
    q, k = randn(gen, 4, 4, 8), randn(gen, 2, 19, 8)
    with pytest.raises(kvevict.Error, match="prefix"):
        kvevict.cake_window_preference(q, k[:, :4])  # the window leaves no prefix
    with pytest.raises(kvevict.Error, match="float32"):
        kvevict.cake_window_preference(q.half(), k.half())
    with pytest.raises(kvevict.Error, match="rank"):
        kvevict.cake_window_preference(q[0], k)
    P = 2
    comms = kvevict.thread_comms(P)
    with pytest.raises(kvevict.Error):  # ranks disagree on the window
        run_threads(P, lambda r: kvevict.cake_window_preference_sharded(comms[r], q[2 * r:2 * r + 2, r:], k[r:r + 1]))


# ---- paged window scores and value weighting -------------------------------------------------

@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("lists", ["per_sequence", "per_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_window_scores(gen, layout, lists, dtype):
    S, H, g, d, ps, w = 3, 2, 2, 8, 4, 4
    lengths = [13, 4, 9]
    k, v, indptr, indices, last = make_paged(gen, S, H, d, ps, lengths, layout, lists, dtype)
    q = randn(gen, S * H * g, w, d, dtype=dtype)
    lens = row_lengths(indptr, last, ps, H, lists)
    full = kvevict.paged_window_scores(q, k, v, indptr, indices, last, H, lists=lists, layout=layout,
                                       include_window=True)
    prefix = kvevict.paged_window_scores(q, k, v, indptr, indices, last, H, lists=lists, layout=layout)
    assert full.shape == (S * H * g, max(lens)) and prefix.shape == (S * H * g, max(lens) - w)
    for r in range(S * H):
        n = lens[r]
        dense = gather(k, indptr, indices, last, ps, r, H, layout, lists).unsqueeze(0).contiguous()
        rows = q[r * g:(r + 1) * g]
        want = kvevict.window_scores(rows, dense)  # the dense stage on a copy: the same bits
        assert torch.equal(full[r * g:(r + 1) * g, :n], want)
        assert torch.equal(prefix[r * g:(r + 1) * g, :n - w], want[:, :n - w])
        assert not full[r * g:(r + 1) * g, n:].any()  # past the row's end: zeros of the new tensor
        torch.testing.assert_close(want.double(), ref_window(rows, dense), rtol=2e-3 if dtype == torch.float16 else 1e-5,
                                   atol=1e-5)


def test_paged_window_scores_errors(gen):
    S, H, d, ps, w = 2, 2, 8, 4, 4
    k, v, indptr, indices, last = make_paged(gen, S, H, d, ps, [9, 3])  # the second row is shorter than w
    q = randn(gen, S * H, w, d)
    with pytest.raises(kvevict.Error):
        kvevict.paged_window_scores(q, k, v, indptr, indices, last, H)
    k, v, indptr, indices, last = make_paged(gen, S, H, d, ps, [9, 8])
    with pytest.raises(kvevict.Error, match="float32, float16, bfloat16|element type"):
        kvevict.paged_window_scores(q.double(), k, v, indptr, indices, last, H)


@pytest.mark.parametrize("mode", ["per_token", "head_max"])
@pytest.mark.parametrize("lists", ["per_sequence", "per_head"])
def test_paged_weight_by_value_norm(gen, mode, lists):
    S, H, g, d, ps = 2, 3, 2, 8, 4
    lengths = [11, 6]
    k, v, indptr, indices, last = make_paged(gen, S, H, d, ps, lengths, "nhd", lists, torch.bfloat16)
    lens = row_lengths(indptr, last, ps, H, lists)
    scores = torch.rand(S * H * g, max(lens) + 2, generator=gen)
    before = scores.clone()
    got = kvevict.paged_weight_by_value_norm(scores, k, v, indptr, indices, last, H, mode=mode, lists=lists)
    assert got.data_ptr() == scores.data_ptr()  # in place
    for r in range(S * H):
        n = lens[r]
        dense = gather(v, indptr, indices, last, ps, r, H, "nhd", lists).unsqueeze(0).contiguous()
        want = before[r * g:(r + 1) * g, :n].clone()
        kvevict.weight_by_value_norm(want, dense.expand(1, n, d).contiguous(), mode)  # the dense stage: same bits
        assert torch.equal(scores[r * g:(r + 1) * g, :n], want)
        norms = dense[0].double().abs().sum(1)
        factor = norms if mode == "per_token" else norms.max().expand(n)
        torch.testing.assert_close(want.double(), before[r * g:(r + 1) * g, :n].double() * factor, rtol=1e-6, atol=0)
        assert torch.equal(scores[r * g:(r + 1) * g, n:], before[r * g:(r + 1) * g, n:])  # untouched


# ---- compact_layer ---------------------------------------------------------------------------

def test_compact_layer_ragged(gen):
    H, d = 3, 4
    caps = [6, 9, 5]
    lens = torch.tensor([5, 9, 0], dtype=torch.int32)
    cu_cap = torch.tensor([0, 6, 15, 20], dtype=torch.int32)
    kb, vb = randn(gen, 20, d), randn(gen, 20, d, dtype=torch.float32)
    pb = torch.randint(0, 1000, (20,), generator=gen, dtype=torch.int32)
    kept_rows = [[0, 2, 4], [1, 2, 3, 7, 8], []]
    positions = torch.tensor(sum(kept_rows, []), dtype=torch.int32)
    cu = torch.tensor([0, 3, 8, 8], dtype=torch.int32)
    want = []
    for h in range(H):
        base = int(cu_cap[h])
        rows = [base + j for j in kept_rows[h]]
        want.append((kb[rows].clone(), vb[rows].clone(), pb[rows].clone()))
    kvevict.compact_layer(kb, vb, pb, cu_cap, lens, positions, cu)
    assert lens.tolist() == [3, 5, 0]
    for h in range(H):
        base, n = int(cu_cap[h]), int(lens[h])
        assert torch.equal(kb[base:base + n], want[h][0]) and torch.equal(vb[base:base + n], want[h][1])
        assert torch.equal(pb[base:base + n], want[h][2])
    assert caps == (cu_cap[1:] - cu_cap[:-1]).tolist()
    # a position beyond a head's rows: refused before anything moves
    snapshot = kb.clone()
    with pytest.raises(kvevict.Error):
        kvevict.compact_layer(kb, vb, pb, cu_cap, lens, torch.tensor([0, 3, 0], dtype=torch.int32),
                              torch.tensor([0, 2, 3, 3], dtype=torch.int32))
    assert torch.equal(kb, snapshot) and lens.tolist() == [3, 5, 0]


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_compact_layer_paged(gen, layout):
    S, H, d, ps = 2, 2, 8, 4
    lengths = [10, 7]
    k, v, indptr, indices, last = make_paged(gen, S, H, d, ps, lengths, layout)
    pshape = k.shape[:-1] + (1,)
    pool = torch.randint(0, 10_000, pshape, generator=gen, dtype=torch.int32)
    lens = row_lengths(indptr, last, ps, H)
    # every head of a sequence keeps the same count (per-sequence lists)
    keep = {0: [1, 4, 5, 9], 1: [0, 6, 8, 9], 2: [2, 3, 6], 3: [0, 1, 2]}
    pos = torch.tensor(sum((keep[r] for r in range(S * H)), []), dtype=torch.int32)
    cu = torch.tensor([0, 4, 8, 11, 14], dtype=torch.int32)
    before = {r: [gather(t, indptr, indices, last, ps, r, H, layout).clone() for t in (k, v, pool)]
              for r in range(S * H)}
    k2, v2 = k.clone(), v.clone()
    ref_len, ref_freed = kvevict.compact_paged(k2, v2, indptr, indices, last, H, (pos, cu), layout=layout)
    new_len, freed = kvevict.compact_layer_paged(k, v, pool, indptr, indices, last, H, (pos, cu), layout=layout)
    assert torch.equal(new_len, ref_len) and torch.equal(freed, ref_freed)
    assert torch.equal(k, k2) and torch.equal(v, v2)  # keys and values exactly as compact_paged
    kvevict.shrink_page_table(indptr, indices, last, ps, new_len)
    for r in range(S * H):
        idx = torch.tensor(keep[r])
        for t, b in zip((k, v, pool), before[r]):
            assert torch.equal(gather(t, indptr, indices, last, ps, r, H, layout), b[idx])
    with pytest.raises(kvevict.Error):  # a position pool of dim 2
        kvevict.compact_layer_paged(k, v, torch.zeros(k.shape[:-1] + (2,), dtype=torch.int32), indptr, indices,
                                    last, H, (pos[:0], torch.zeros(5, dtype=torch.int32)), layout=layout)


# ---- LayerCascade ----------------------------------------------------------------------------

def _protected(gen, H, N, n_sink, n_recent):
    s = (torch.rand(H, N, generator=gen) * 8).round() / 8  # ties
    return kvevict.protect(s, n_sink, n_recent)


@pytest.mark.parametrize("split", ["flattened", "per_head"])
def test_layer_cascade_invariants(gen, split):
    L, H, N, n_sink, n_recent = 4, 2, 24, 1, 2
    total = L * H * 9
    c = kvevict.LayerCascade(L, H, N, total, n_sink=n_sink, n_recent=n_recent, split=split)
    scores = [_protected(gen, H, N, n_sink, n_recent) for _ in range(L)]
    weights = [0.5, 2.0, 1.0, 0.25]
    held = {}
    for l in range(L):
        c.add_layer(l, scores[l], weights[l])
        assert c.layers_added == l + 1 and c.changed(l)
        pos, cu = c.kept(l)
        assert torch.equal(torch.as_tensor(pos), torch.as_tensor(c.positions(l)[0]))  # the new layer: prompt positions
        for j in range(l):
            if not c.changed(j):
                continue
            kpos, kcu = c.kept(j)
            hpos, hcu = held[j]
            for h in range(H):
                rows = kpos[kcu[h]:kcu[h + 1]]
                old = hpos[hcu[h]:hcu[h + 1]]
                now_pos, now_cu = c.positions(j)
                assert list(old[rows]) == list(now_pos[now_cu[h]:now_cu[h + 1]])  # rows of what it held
        held = {j: tuple(np.asarray(a) for a in c.positions(j)) for j in range(l + 1)}
    assert sum(c.layer_total(l) for l in range(L)) == total == c.held_total
    for l in range(L):
        pos, cu = c.positions(l)
        t = c.layer_total(l)
        if split == "flattened":
            wpos, wcu = kvevict.select_topk_flat(scores[l], t)  # top-k of a top-k is the top-k
        else:
            wpos, wcu = kvevict.select_topk_ragged(scores[l], torch.full((H,), t // H, dtype=torch.int32))
        assert np.array_equal(np.asarray(pos), np.asarray(wpos)) and np.array_equal(np.asarray(cu), np.asarray(wcu))


def test_layer_cascade_errors(gen):
    with pytest.raises(kvevict.Error):
        kvevict.LayerCascade(2, 2, 10, 2 * 2 * 11)  # more than the prompt
    c = kvevict.LayerCascade(2, 2, 10, 16)
    with pytest.raises(kvevict.Error):
        c.add_layer(1, torch.rand(2, 10, generator=gen), 1.0)  # out of order
    with pytest.raises(kvevict.Error):
        c.add_layer(0, torch.rand(2, 10, generator=gen), float("nan"))
    with pytest.raises(kvevict.Error):
        c.positions(1)


# ---- head-mask TSV --------------------------------------------------------------------------

def test_parse_head_mask_tsv():
    m = kvevict.parse_head_mask_tsv("1\t0\t0.5\r\n0 \t 1\t0.25\n\n")
    assert m.dtype == np.float64 and m.tolist() == [[1.0, 0.0, 0.5], [0.0, 1.0, 0.25]]
    assert kvevict.parse_head_mask_tsv("-9.6e-05\t1.5\n", clip=True).tolist() == [[0.0, 1.0]]
    for bad in ["", "1\t0\n1\n", "1.5\t0\n", "nan\t1\n", "1\tx\n"]:
        with pytest.raises(kvevict.Error):
            kvevict.parse_head_mask_tsv(bad)


def test_read_head_mask_tsv(tmp_path):
    path = os.path.join(SOURCE_DIR, "models", "duo", "stories260K.tsv")
    want = np.loadtxt(path, delimiter="\t", ndmin=2)
    got = kvevict.read_head_mask_tsv(path, *want.shape)
    assert np.array_equal(got, want)
    assert np.array_equal(kvevict.parse_head_mask_tsv(open(path).read()), want)
    with pytest.raises(kvevict.Error) as e:
        kvevict.read_head_mask_tsv(path, want.shape[0] + 1, want.shape[1])
    assert e.value.code == "shape_mismatch"
    with pytest.raises(kvevict.Error) as e:
        kvevict.read_head_mask_tsv(str(tmp_path / "missing.tsv"), 1, 1)
    assert e.value.code == "io_error"
