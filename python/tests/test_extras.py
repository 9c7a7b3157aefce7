"""Metrics and the training math (LookaheadKV LoRA / window scores / loss, PruLong gates) against
PyTorch, autograd giving the reference gradients."""
import math

import numpy as np
import pytest
import torch

import kvevict
from conftest import randn, topk_sorted


def test_recall_and_kendall(gen):
    est, truth = randn(gen, 3, 50), randn(gen, 3, 50)
    mean, rows = kvevict.recall_at_k(est, truth, 10)
    ref = [len(set(topk_sorted(est[r:r + 1], 10)[0].tolist()) & set(topk_sorted(truth[r:r + 1], 10)[0].tolist())) / 10
           for r in range(3)]
    assert rows.tolist() == pytest.approx(ref) and mean == pytest.approx(sum(ref) / 3)
    kept = topk_sorted(est, 20)
    mean, rows = kvevict.kept_recall_at_k(kept, truth, 10)
    ref = [len(set(kept[r].tolist()) & set(topk_sorted(truth[r:r + 1], 10)[0].tolist())) / 10 for r in range(3)]
    assert rows.tolist() == pytest.approx(ref)
    pos, cu = kvevict.select_topk_ragged(est, torch.tensor([20, 20, 20], dtype=torch.int32))
    assert kvevict.kept_recall_at_k((pos, cu), truth, 10)[1].tolist() == pytest.approx(ref)
    mean, rows = kvevict.kendall_tau_b(est, truth)
    for r in range(3):  # no ties: tau = (concordant - discordant) / (n (n - 1) / 2)
        a, b = est[r].double(), truth[r].double()
        sign = torch.sign(a[:, None] - a[None, :]) * torch.sign(b[:, None] - b[None, :])
        assert rows[r] == pytest.approx(float(sign.sum() / (50 * 49)), abs=1e-12)


def test_lora_layer_against_autograd(gen):
    n, din, dout, r, alpha, b0, b1 = 6, 8, 5, 2, 16.0, 2, 5
    x, w = randn(gen, n, din), randn(gen, dout, din)
    a, b = randn(gen, din, r), randn(gen, r, dout)
    y, xa = kvevict.lora_linear_forward(x, w, a, b, alpha, b0, b1)
    a_, b_ = a.double().requires_grad_(), b.double().requires_grad_()
    ref = x.double() @ w.double().T
    lora = ref[b0:b1] + (alpha / r) * (x[b0:b1].double() @ a_) @ b_
    full = torch.cat([ref[:b0], lora, ref[b1:]])
    torch.testing.assert_close(y.double(), full.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kvevict.linear_forward(x, w).double(), ref, rtol=1e-5, atol=1e-5)
    dy = randn(gen, b1 - b0, dout)
    x_ = x[b0:b1].double().requires_grad_()
    out = x_ @ w.double().T + (alpha / r) * (x_ @ a_) @ b_
    out.backward(dy.double())
    da, db, dx = kvevict.lora_linear_backward(x, w, a, b, alpha, b0, b1, xa, dy)
    for mine, ref in ((da, a_.grad), (db, b_.grad), (dx, x_.grad)):
        torch.testing.assert_close(mine.double(), ref, rtol=1e-4, atol=1e-5)


def test_lookahead_window_scores_and_loss(gen):
    n, P, d = 4, 12, 8
    q, kp, kb = randn(gen, n, d), randn(gen, P, d), randn(gen, n, d)
    s = kvevict.lookahead_window_scores(q, kp, kb)
    q_, kb_ = q.double().requires_grad_(), kb.double().requires_grad_()
    logits = q_ @ torch.cat([kp.double(), kb_]).T / math.sqrt(d)
    mask = torch.arange(P + n)[None, :] >= P + 1 + torch.arange(n)[:, None]
    ref = torch.softmax(logits.masked_fill(mask, float("-inf")), -1)[:, :P].mean(0)
    torch.testing.assert_close(s.double(), ref.detach(), rtol=1e-5, atol=1e-7)
    ds = randn(gen, P)
    ref.backward(ds.double())
    dq, dkb = kvevict.lookahead_window_scores_backward(q, kp, kb, ds)
    torch.testing.assert_close(dq.double(), q_.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dkb.double(), kb_.grad, rtol=1e-4, atol=1e-6)
    gt, est = randn(gen, 3, P).abs() + 0.1, randn(gen, 3, P).abs() + 0.1
    loss, grad = kvevict.lookahead_kl_loss(gt, est, eps=0.0)
    e_ = est.double().requires_grad_()
    p = gt.double() / gt.double().sum(1, keepdim=True)
    qn = e_ / e_.sum(1, keepdim=True)
    ref = (p * (p / qn).log()).sum(1).mean()
    ref.backward()
    assert loss == pytest.approx(float(ref), rel=1e-10)
    torch.testing.assert_close(grad.double(), e_.grad, rtol=1e-5, atol=1e-7)


def test_prulong_gates_and_lagrangian(gen):
    la = randn(gen, 3, 4)
    u = torch.rand(3, 4, generator=gen) * 0.98 + 0.01
    l, r, beta = -0.1, 1.1, 2.0 / 3.0
    la_ = la.double().requires_grad_()
    s = torch.sigmoid((u.double().log() - (1 - u.double()).log() + la_) / beta)
    zref = (s * (r - l) + l).clamp(0, 1)
    zref.sum().backward()
    z, dz = kvevict.prulong_sample_gates(la, u)
    torch.testing.assert_close(z.double(), zref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dz.double(), la_.grad, rtol=1e-4, atol=1e-6)
    zdet = kvevict.prulong_deterministic_gates(la)
    ref = (torch.sigmoid(la.double()) * (r - l) + l).clamp(0, 1)
    torch.testing.assert_close(zdet.double(), ref, rtol=1e-5, atol=1e-6)
    sp, grad = kvevict.prulong_expected_sparsity(la)
    la_ = la.double().requires_grad_()
    ref = 1 - torch.sigmoid(la_ - beta * math.log(-l / r)).mean()
    ref.backward()
    assert sp == pytest.approx(float(ref), rel=1e-6)
    torch.testing.assert_close(grad.double(), la_.grad, rtol=1e-4, atol=1e-7)
    res = kvevict.prulong_lagrangian(la, 0.5, 0.3, 0.2)
    gap = res["sparsity"] - 0.5
    assert res["value"] == pytest.approx(0.3 * gap + 0.2 * gap * gap, rel=1e-9)
    assert kvevict.prulong_retrieval_heads(10, 0.9) == 1
    mask = kvevict.prulong_topk_mask(la, 5)
    assert mask.sum() == 5 and mask.flatten()[torch.topk(la.flatten(), 5).indices].eq(1).all()
    assert kvevict.binarize_head_mask(torch.tensor([[0.2, 0.7]]), 0.5).tolist() == [[0, 1]]
    with pytest.raises(kvevict.Error, match="sparsity"):
        kvevict.prulong_retrieval_heads(10, 1.5)


def test_host_isa_limit_changes_no_bit(gen):
    supported = kvevict.host_isa_supported()
    assert kvevict.host_isa_limit() == kvevict.HostIsa.avx512 and kvevict.host_isa_active() == supported
    with pytest.raises(kvevict.Error, match="unknown HostIsa 'sse9'"):
        kvevict.set_host_isa_limit("sse9")
    with pytest.raises(kvevict.Error, match="limit must be a HostIsa"):
        kvevict.set_host_isa_limit(5)
    q, k = randn(gen, 8, 32, 64), randn(gen, 2, 700, 64)
    v = randn(gen, 2, 700, 64).to(torch.float16)
    outs = []
    for level in ("baseline", "avx2", "avx512"):
        with kvevict.host_isa_limit_guard(level):
            assert kvevict.host_isa_limit() == kvevict.HostIsa(level)
            assert int(kvevict.host_isa_active()) == min(int(supported), int(kvevict.HostIsa(level)))
            outs.append(kvevict.recipe_scores(kvevict.Recipe.vatp(), q.to(torch.float16), k.to(torch.float16), v))
        assert kvevict.host_isa_limit() == kvevict.HostIsa.avx512  # (restored)
    with pytest.raises(ZeroDivisionError):  # restored when the block raises too
        with kvevict.host_isa_limit_guard(kvevict.HostIsa.baseline):
            1 / 0
    assert kvevict.host_isa_limit() == kvevict.HostIsa.avx512
    with pytest.raises(kvevict.Error, match="unknown HostIsa"):
        with kvevict.host_isa_limit_guard("avx3"):
            pass
    assert kvevict.host_isa_limit() == kvevict.HostIsa.avx512
    for s in outs[1:]:
        assert torch.equal(s.view(torch.int32), outs[0].view(torch.int32))

