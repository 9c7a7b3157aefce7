"""The footprint metrics, the eviction recorder, LAVa's output loss and bound, and the float64
training math, against NumPy / PyTorch references written for clarity."""
import math

import numpy as np
import pytest
import torch

import kvevict
from conftest import randn

NEVER = kvevict.NEVER_EVICTED


def ref_usage(sched):
    """evicted_at [L][H][N] -> (resident, full, peak, peak_query): a key j is resident for queries
    j <= i < evicted_at[j] (never = N)."""
    L, H, N = sched.shape
    end = np.where((sched == NEVER) | (sched >= N), N, sched).astype(np.int64)
    per_query = np.zeros(N, np.int64)
    for i in range(N):
        j = np.arange(i + 1)
        per_query[i] = (end[:, :, : i + 1] > i).sum()
    resident = int(per_query.sum())
    full = L * H * N * (N + 1) // 2
    return resident, full, int(per_query.max()), int(per_query.argmax())


def random_schedule(rng, L, H, N):
    s = np.full((L, H, N), NEVER, np.int32)
    for l in range(L):
        for h in range(H):
            for j in range(N):
                if rng.random() < 0.6:
                    s[l, h, j] = rng.integers(j + 1, N + 1)
    return s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_measure_kv_usage_against_reference(seed):
    rng = np.random.default_rng(seed)
    L, H, N = 2, 3, int(rng.integers(1, 40))
    s = random_schedule(rng, L, H, N)
    u = kvevict.measure_kv_usage(s)
    resident, full, peak, pq = ref_usage(s)
    assert (u["resident"], u["full"], u["peak"], u["peak_query"]) == (resident, full, peak, pq)
    assert u["footprint"] == pytest.approx(resident / full, rel=1e-15)
    assert u["peak_kv"] == pytest.approx(peak / (L * H * N), rel=1e-15)
    one = kvevict.measure_kv_usage(s, layer=1, head=2)
    assert one["resident"] == ref_usage(s[1:2, 2:3])[0]
    lay = kvevict.measure_kv_usage(s, layer=0)
    assert lay["resident"] == ref_usage(s[0:1])[0] and lay["rows"] == H
    # strided views: a torch transpose of a [H][L][N] buffer is a [L][H][N] schedule
    t = torch.from_numpy(np.ascontiguousarray(s.transpose(1, 0, 2))).transpose(0, 1)
    assert kvevict.measure_kv_usage(t)["resident"] == resident


def test_measure_kv_usage_errors():
    s = np.full((1, 1, 4), NEVER, np.int32)
    s[0, 0, 2] = 2  # evicted before it was created
    with pytest.raises(kvevict.Error, match="before the key was created") as e:
        kvevict.measure_kv_usage(s)
    assert e.value.code == "out_of_range"
    with pytest.raises(kvevict.Error, match="int32"):
        kvevict.measure_kv_usage(np.zeros((1, 1, 4), np.int64))
    with pytest.raises(kvevict.Error, match="layer"):
        kvevict.measure_kv_usage(np.full((1, 1, 4), NEVER, np.int32), layer=3)


def test_recorder_against_a_python_simulation():
    """A post-fill eviction then decode steps that evict one key each, recorded through every
    update form, against a schedule kept by hand."""
    rng = np.random.default_rng(7)
    L, H, P, N = 2, 3, 12, 20
    rec = kvevict.EvictionRecorder(L, H, N)
    assert rec.storage.shape == (L, H, N) and (rec.storage == NEVER).all()
    ref = np.full((L, H, N), NEVER, np.int32)
    resident = [[set(range(P)) for _ in range(H)] for _ in range(L)]
    # post-fill at step P: layer 0 dense [H][k], layer 1 ragged (different counts per head)
    kept0 = np.sort(np.stack([rng.choice(P, 6, replace=False) for _ in range(H)]), 1).astype(np.int32)
    rec.retain_only(0, kept0, step=P)
    lists = [np.sort(rng.choice(P, n, replace=False)).astype(np.int32) for n in (3, 7, 5)]
    cu = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    rec.retain_only(1, (np.concatenate(lists), cu), step=P)
    for l, kept in ((0, list(kept0)), (1, lists)):
        for h in range(H):
            for j in sorted(resident[l][h] - set(kept[h].tolist())):
                ref[l, h, j] = P
            resident[l][h] = set(kept[h].tolist())
    # decode: token t is created at step t, then one resident key of (l, h) leaves at step t + 1
    for t in range(P, N - 1):
        for l in range(L):
            for h in range(H):
                resident[l][h].add(t)
                victim = int(rng.choice(sorted(resident[l][h])))
                if (t + l + h) % 2:
                    rec.mark_evicted(l, h, np.array([victim], np.int32), step=t + 1)
                else:
                    keep = np.array(sorted(resident[l][h] - {victim}), np.int32)
                    rec.retain_only(l, keep, head=h, step=t + 1)
                resident[l][h].discard(victim)
                ref[l, h, victim] = t + 1
    np.testing.assert_array_equal(rec.storage, ref)
    sched = rec.schedule(N)
    assert np.shares_memory(sched, rec.storage)  # a view, not a copy
    assert rec.usage(N) == kvevict.measure_kv_usage(ref)
    assert rec.usage(N, layer=1, head=0)["resident"] == ref_usage(ref[1:2, 0:1])[0]
    # a ragged mark_evicted on every head of a layer
    rec2 = kvevict.EvictionRecorder(1, 2, 6)
    rec2.mark_evicted(0, (np.array([0, 3, 1], np.int32), np.array([0, 2, 3], np.int32)), step=4)
    assert rec2.storage[0].tolist() == [[4, NEVER, NEVER, 4, NEVER, NEVER], [NEVER, 4, NEVER, NEVER, NEVER, NEVER]]
    # errors: a key not created yet, not resident, positions not ascending
    with pytest.raises(kvevict.Error, match="created"):
        rec2.mark_evicted(0, 0, np.array([5], np.int32), step=4)
    with pytest.raises(kvevict.Error, match="not resident"):
        rec2.retain_only(0, np.array([0], np.int32), head=0, step=5)
    with pytest.raises(kvevict.Error, match="ascending"):
        rec2.retain_only(0, np.array([2, 1], np.int32), head=1, step=5)
    assert rec2.storage[0].tolist()[0] == [4, NEVER, NEVER, 4, NEVER, NEVER]  # checked before written


def test_recorder_schemes_and_caller_storage():
    buf = torch.zeros(4, 2, 10, dtype=torch.int32).transpose(0, 1)  # [2][4][10], strided
    rec = kvevict.EvictionRecorder(storage=buf)
    assert (buf == NEVER).all()  # the caller's tensor, written in place
    rec.set_streaming(0, 1, tokens=10, n_sink=2, recent=3)
    want = [NEVER, NEVER] + [j + 3 if j + 3 < 10 else NEVER for j in range(2, 10)]
    assert buf[0, 1].tolist() == want
    rec.set_post_fill(1, 2, prompt=6, kept=np.array([0, 4, 5], np.int32))
    assert buf[1, 2].tolist() == [NEVER, 6, 6, 6, NEVER, NEVER] + [NEVER] * 4
    rec.set_full(0, 1)
    assert (buf[0, 1] == NEVER).all()
    # StreamingLLM: query i sees min(i + 1, n_sink + recent) keys
    rec.set_streaming(1, 0, tokens=10, n_sink=2, recent=3)
    u = rec.usage(10, layer=1, head=0)
    assert u["resident"] == sum(min(i + 1, 5) for i in range(10))
    with pytest.raises(kvevict.Error, match="outside"):
        rec.schedule(11)


def ref_critical(f, p, full, frac):
    pts = sorted(zip(f, p))
    tau = frac * full
    for k, (fk, pk) in enumerate(pts):
        if pk >= tau:
            if k == 0:
                return fk, "at_or_below_min"
            f0, p0 = pts[k - 1]
            return f0 + (tau - p0) * (fk - f0) / (pk - p0), "interpolated"
    return pts[-1][0], "above_max"


def test_critical_footprint():
    f, p = [0.1, 0.4, 0.2, 0.8], [0.3, 0.85, 0.6, 0.95]
    cf, tau, kind = kvevict.critical_footprint(f, p, 1.0, fraction=0.8)
    want, wkind = ref_critical(f, p, 1.0, 0.8)
    assert cf == pytest.approx(want, rel=1e-12) and tau == pytest.approx(0.8) and kind.name == wkind
    assert kvevict.critical_footprint(f, p, 1.0, 0.2)[2] == kvevict.CriticalKind.at_or_below_min
    assert kvevict.critical_footprint(f, p, 1.0, 1.0)[2] == kvevict.CriticalKind("above_max")
    # a non-monotone curve: stays_above takes the last crossing
    f2, p2 = [0.1, 0.2, 0.3, 0.4], [0.5, 0.95, 0.7, 0.99]
    assert kvevict.critical_footprint(f2, p2, 1.0, 0.9)[0] == pytest.approx(0.1 + 0.4 / 0.45 * 0.1)
    assert kvevict.critical_footprint(f2, p2, 1.0, 0.9, rule="stays_above")[0] == pytest.approx(0.3 + 0.2 / 0.29 * 0.1)
    with pytest.raises(kvevict.Error, match="empty"):
        kvevict.critical_footprint([], [], 1.0)
    with pytest.raises(kvevict.Error, match="performances"):
        kvevict.critical_footprint([0.1], [0.2, 0.3], 1.0)


def ref_lava(att, values, w_o, keep, norm, layout):
    """y - y_hat of one query with GQA and renormalised kept attention (empty heads give 0)."""
    att = att.double() / att.double().sum(1, keepdim=True)
    Hq, N = att.shape
    Hkv, _, d = values.shape
    g = Hq // Hkv
    W = w_o.double() if layout == "in_out" else w_o.double().T
    keep = keep.bool()
    if keep.shape[0] == Hkv:
        keep = keep.repeat_interleave(g, 0)
    v = values.double().repeat_interleave(g, 0)  # [Hq][N][d]
    kept = att * keep
    mass = kept.sum(1, keepdim=True)
    hat = torch.where(mass > 0, kept / mass.clamp_min(1e-300), torch.zeros_like(kept))
    y = torch.einsum("hn,hnd->hd", att, v).reshape(-1) @ W
    yh = torch.einsum("hn,hnd->hd", hat, v).reshape(-1) @ W
    diff = y - yh
    loss = {"l1": diff.abs().sum(), "l2": diff.norm(), "linf": diff.abs().max()}[norm]
    c_hat = W.abs().sum(1).max()
    vbar = values.double().abs().sum(2).max(1).values.repeat_interleave(g)
    bound = 2 * c_hat * (vbar * (att * (~keep)).sum(1)).sum()
    return float(loss), float(bound)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_lava_loss_and_bound(gen, vdtype, layout):
    Hq, Hkv, N, d, D = 4, 2, 16, 8, 12
    att = torch.softmax(randn(gen, Hq, N) * 2, -1) * 3  # rows need not sum to 1: divided by their sums
    values = randn(gen, Hkv, N, d, dtype=vdtype)
    w_o = randn(gen, Hq * d, D) if layout == "in_out" else randn(gen, D, Hq * d)
    for rows in (Hkv, Hq):
        keep = (torch.rand(rows, N, generator=gen) < 0.5).to(torch.uint8)
        keep[0] = 0  # an empty head: zero output
        for norm in ("l1", "l2", "linf"):
            loss = kvevict.lava_output_loss(att, values, w_o, keep, norm=norm, layout=layout)
            want, bound = ref_lava(att, values, w_o, keep, norm, layout)
            assert loss == pytest.approx(want, rel=1e-9, abs=1e-9)
        b = kvevict.lava_loss_bound(att, values, w_o, keep.bool(), layout=layout)
        assert b == pytest.approx(bound, rel=1e-9)
        assert b >= kvevict.lava_output_loss(att, values, w_o, keep, layout=layout)
    with pytest.raises(kvevict.Error, match="keeps no attention mass"):
        kvevict.lava_output_loss(att, values, w_o, keep, layout=layout, on_empty="error")
    with pytest.raises(kvevict.Error):
        kvevict.lava_output_loss(att, values, w_o[:-1] if layout == "in_out" else w_o[:, :-1], keep, layout=layout)


# ---- the training math in float64 --------------------------------------------------------------

def test_lora_and_lookahead_in_float64(gen):
    n, din, dout, r, alpha, b0, b1 = 6, 8, 5, 2, 16.0, 1, 5
    x, w = randn(gen, n, din).double(), randn(gen, dout, din).double()
    a, b = randn(gen, din, r).double(), randn(gen, r, dout).double()
    y, xa = kvevict.lora_linear_forward(x, w, a, b, alpha, b0, b1)
    assert y.dtype == torch.float64 and xa.dtype == torch.float64
    ref = x @ w.T
    ref[b0:b1] += (alpha / r) * (x[b0:b1] @ a) @ b
    torch.testing.assert_close(y, ref, rtol=1e-13, atol=1e-13)
    dy = randn(gen, b1 - b0, dout).double()
    a_, b_, x_ = a.clone().requires_grad_(), b.clone().requires_grad_(), x[b0:b1].clone().requires_grad_()
    (x_ @ w.T + (alpha / r) * (x_ @ a_) @ b_).backward(dy)
    da, db, dx = kvevict.lora_linear_backward(x, w, a, b, alpha, b0, b1, xa, dy)
    for mine, want in ((da, a_.grad), (db, b_.grad), (dx, x_.grad)):
        torch.testing.assert_close(mine, want, rtol=1e-12, atol=1e-12)
    P = 10
    q, kp, kb = randn(gen, 4, 8).double(), randn(gen, P, 8).double(), randn(gen, 4, 8).double()
    s = kvevict.lookahead_window_scores(q, kp, kb)
    logits = q @ torch.cat([kp, kb]).T / math.sqrt(8)
    mask = torch.arange(P + 4)[None, :] >= P + 1 + torch.arange(4)[:, None]
    want = torch.softmax(logits.masked_fill(mask, float("-inf")), -1)[:, :P].mean(0)
    torch.testing.assert_close(s, want, rtol=1e-13, atol=1e-15)
    gt, est = randn(gen, 3, P).double().abs() + 0.1, randn(gen, 3, P).double().abs() + 0.1
    loss, grad = kvevict.lookahead_kl_loss(gt, est, eps=0.0)
    e_ = est.clone().requires_grad_()
    p = gt / gt.sum(1, keepdim=True)
    kl = (p * (p / (e_ / e_.sum(1, keepdim=True))).log()).sum(1).mean()
    kl.backward()
    assert grad.dtype == torch.float64 and loss == pytest.approx(float(kl), rel=1e-12)
    torch.testing.assert_close(grad, e_.grad, rtol=1e-12, atol=1e-14)
    with pytest.raises(kvevict.Error, match="one element type per call"):
        kvevict.linear_forward(x, w.float())
    with pytest.raises(kvevict.Error, match="float64|float32"):
        kvevict.linear_forward(x.half(), w.half())


def test_prulong_in_float64(gen):
    la = randn(gen, 3, 4).double()
    u = (torch.rand(3, 4, generator=gen) * 0.98 + 0.01).double()
    l, r, beta = -0.1, 1.1, 2.0 / 3.0
    la_ = la.clone().requires_grad_()
    zref = (torch.sigmoid((u.log() - (1 - u).log() + la_) / beta) * (r - l) + l).clamp(0, 1)
    zref.sum().backward()
    z, dz = kvevict.prulong_sample_gates(la, u)
    assert z.dtype == torch.float64
    torch.testing.assert_close(z, zref.detach(), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(dz, la_.grad, rtol=1e-12, atol=1e-14)
    sp, grad = kvevict.prulong_expected_sparsity(la)
    la_ = la.clone().requires_grad_()
    ref = 1 - torch.sigmoid(la_ - beta * math.log(-l / r)).mean()
    ref.backward()
    assert sp == pytest.approx(float(ref), rel=1e-13)
    torch.testing.assert_close(grad, la_.grad, rtol=1e-12, atol=1e-15)
    res = kvevict.prulong_lagrangian(la, 0.5, 0.3, 0.2)
    assert res["grad_log_alpha"].dtype == torch.float64
    zdet = kvevict.prulong_deterministic_gates(la)
    torch.testing.assert_close(zdet, (torch.sigmoid(la) * (r - l) + l).clamp(0, 1), rtol=1e-14, atol=1e-15)
    assert kvevict.prulong_topk_mask(la, 3).sum() == 3
    assert kvevict.binarize_head_mask(torch.tensor([[0.2, 0.7]], dtype=torch.float64), 0.5).tolist() == [[0, 1]]


# ---- CUDA refusals and the DLPack stream hand-off (host checks; the CUDA path is compiled, not run) --

def test_dlpack_stream_request(gen):
    # (the CUDA dispatch itself: test_cuda_dispatch.py)

    class CudaLike:
        """A DLPack producer that reports a CUDA device: the binding must ask it for the legacy
        default stream (stream=1). Its capsule is a host tensor's, so the call runs on the host."""

        def __init__(self, t):
            self.t, self.stream = t, "not asked"

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            self.stream = stream
            return self.t.__dlpack__()

    k = randn(gen, 2, 6, 4)
    src = CudaLike(k)
    kvevict.key_norm_scores(src)
    assert src.stream == 1
