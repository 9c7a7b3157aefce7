"""Shared fixtures and the PyTorch references the bindings are checked against.

The references are written for clarity, not speed: float64, attention materialised, one line
per published step. They restate the stage contracts of docs/score.md ... docs/compact.md.
"""
import math
import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

# the package built in the release tree when PYTHONPATH names none (CTest sets PYTHONPATH, e.g. to
# the cuda build's; this keeps a bare `pytest python/tests` working)
_here = os.path.dirname(os.path.abspath(__file__))
_build = os.path.join(_here, "..", "..", "build", "release", "python")
if os.path.isdir(_build) and _build not in sys.path and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, _build)

import kvevict  # noqa: E402

SOURCE_DIR = os.environ.get("KVEVICT_SOURCE_DIR", os.path.join(_here, "..", ".."))

KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def run_threads(n, fn):
    """Runs fn(i) on n threads at once; returns the results in order (the first exception re-raised)."""
    results, errors = [None] * n, []

    def body(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# ---- scores ------------------------------------------------------------------------------------

def ref_attention(q, prefix, block=None, reduce="mean", all_columns=False, scale=None, gamma=200.0):
    """Attention of q [Hq, w, d] over prefix [Hkv, P, d] (+ block [Hkv, w, d], causal), reduced
    over the rows: [Hq, P] or [Hq, P + w]."""
    Hq, w, d = q.shape
    Hkv, P, _ = prefix.shape
    g = Hq // Hkv
    keys = prefix if block is None else torch.cat([prefix, block], dim=1)
    keys = keys.double().repeat_interleave(g, dim=0)
    logits = (q.double() @ keys.transpose(1, 2)) * (scale if scale else 1.0 / math.sqrt(d))
    if block is not None:
        row = torch.arange(w)[:, None]
        col = torch.arange(P + w)[None, :]
        logits = logits.masked_fill((col >= P) & (col - P > row), float("-inf"))
    p = torch.softmax(logits, dim=-1)
    cols = P + (w if all_columns else 0)
    p = p[..., :cols]
    if reduce == "mean":
        return p.sum(1) / w
    if reduce == "sum":
        return p.sum(1)
    if reduce == "mean_visible":
        seen = torch.cat([torch.full((P,), float(w)), w - torch.arange(cols - P, dtype=torch.float64)])
        return p.sum(1) / seen
    if reduce == "mean_plus_variance":
        return p.mean(1) + gamma * p.var(1, unbiased=True)
    raise ValueError(reduce)


def ref_window(q, keys, **kw):
    w = q.shape[1]
    T = keys.shape[1]
    return ref_attention(q, keys[:, : T - w], keys[:, T - w:], all_columns=True, **kw)


def ref_gqa(s, hkv, op="mean"):
    g = s.shape[0] // hkv
    s = s.reshape(hkv, g, -1)
    return {"mean": s.mean(1), "max": s.max(1).values, "sum": s.sum(1)}[op]


def ref_pool(s, kind, kernel):
    if kind == "none" or kernel == 1:
        return s.clone()
    x = s[:, None, :]
    if kind == "max":
        return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)[:, 0]
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True)[:, 0]


def ref_protect(s, n_sink, n_recent):
    s = s.clone()
    T = s.shape[1]
    s[:, : min(n_sink, T)] = float("inf")
    if n_recent:
        s[:, max(0, T - n_recent):] = float("inf")
    return s


def ref_recipe(name, q, k, v):
    """kvevict's published recipes (docs/recipes.md) in plain PyTorch: [Hkv, T] float64."""
    Hkv, T, d = k.shape
    if name == "knorm":
        return -k.double().norm(dim=-1)
    if name == "streaming_llm":
        return ref_protect(torch.arange(T, dtype=torch.float64).expand(Hkv, T), 4, 0)
    if name == "h2o":
        s = ref_attention(q, k[:, :0], k, reduce="sum", all_columns=True)
        return ref_protect(ref_gqa(s, Hkv, "mean"), 0, 32)
    if name == "tova":
        s = ref_attention(q, k[:, : T - 1], k[:, T - 1:], all_columns=True)
        return ref_gqa(s, Hkv, "mean")
    w = q.shape[1]
    reduce = "mean_plus_variance" if name == "cake" else "mean"
    s = ref_window(q, k, reduce=reduce)
    kind, kernel = ("avg", 5) if name == "cake" else ("max", 7)
    # only the prefix columns are pooled (KVCache-Factory pools attn[..., -w:, :-w])
    s = torch.cat([ref_pool(s[:, : T - w], kind, kernel), s[:, T - w:]], dim=1)
    s = ref_gqa(s, Hkv, "max" if name == "lava" else "mean")
    norms = v.double().abs().sum(-1)  # ||v_j||_1 per KV head and token
    if name == "vatp":
        s = s * norms
    if name == "lava":
        s = s * norms.max(dim=1, keepdim=True).values
    return ref_protect(s, 0, w)


def topk_sorted(s, k):
    """Positions of the k largest scores of each row, ascending (distinct scores assumed)."""
    return torch.sort(torch.topk(s, k, dim=-1).indices, dim=-1).values.to(torch.int32)


def close(a, b, rtol=1e-5, atol=1e-6):
    a = torch.as_tensor(a).double()
    b = torch.as_tensor(b).double()
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite), "infinite entries differ"
    assert torch.equal(a[~finite], b[~finite]), "infinite entries differ in sign"
    torch.testing.assert_close(a[finite], b[finite], rtol=rtol, atol=atol)
