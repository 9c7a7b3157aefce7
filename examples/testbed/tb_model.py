"""The testbed's trainable LLaMA-architecture model (docs/testbed.md) and its llama2.c export.

The same network as kvevict-run's runner and python/kvevict/reference.py (RMSNorm eps 1e-5, RoPE
on adjacent pairs with base 10000, GQA: query head h reads KV head h // (n_heads / n_kv_heads),
SwiGLU, a classifier shared with the token embedding), written batched and differentiable for
training: the reference model is an inference model (no gradients, one cache per KV head).

The parameters are stored in llama2.c's layout ([out][in] matrices), so `export` writes them in
order and `reference.Model.load` / `kvrun::model::load_file` read the file back.
"""
from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Config:
    dim: int = 128
    hidden_dim: int = 384
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    vocab_size: int = 512
    seq_len: int = 2048

    @property
    def head_size(self):
        return self.dim // self.n_heads

    def check(self):
        if min(asdict(self).values()) <= 0:
            raise ValueError(f"every dimension must be positive: {self}")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.head_size % 2:
            raise ValueError(f"dim {self.dim} / n_heads {self.n_heads} / n_kv_heads {self.n_kv_heads}: "
                             "need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head size")
        return self


ATTENTION_BLOCK = 256


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(hs) + causal mask) v for q, k, v [N, T, hs], in blocks of query rows
    that read only the keys up to the block's end (the masked upper triangle is never computed:
    about 3x faster than the full T x T map at T = 2048 on one core)."""
    T, hs = q.shape[1], q.shape[2]
    mask = torch.full((T, T), float("-inf")).triu(1)
    out = []
    for s in range(0, T, ATTENTION_BLOCK):
        e = min(T, s + ATTENTION_BLOCK)
        scores = torch.baddbmm(mask[s:e, :e].expand(q.shape[0], e - s, e), q[:, s:e], k[:, :e].transpose(1, 2),
                               alpha=1.0 / math.sqrt(hs))
        out.append(torch.softmax(scores, dim=-1) @ v[:, :e])
    return torch.cat(out, dim=1)


class Model(torch.nn.Module):
    def __init__(self, cfg: Config, seed: int = 0, init_std: float = 0.02):
        super().__init__()
        self.cfg = cfg.check()
        L, d, hd, kv = cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.n_kv_heads * cfg.head_size
        g = torch.Generator().manual_seed(seed)

        def init(*shape, std=init_std):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * std)

        out_std = init_std / math.sqrt(2 * L)  # GPT-2 / llama2.c: residual projections scaled down
        self.tok = init(cfg.vocab_size, d)
        self.rms_att = torch.nn.Parameter(torch.ones(L, d))
        self.wq, self.wk, self.wv = init(L, d, d), init(L, kv, d), init(L, kv, d)
        self.wo = init(L, d, d, std=out_std)
        self.rms_ffn = torch.nn.Parameter(torch.ones(L, d))
        self.w1, self.w2, self.w3 = init(L, hd, d), init(L, d, hd, std=out_std), init(L, hd, d)
        self.rms_final = torch.nn.Parameter(torch.ones(d))
        hs = cfg.head_size
        # run.c's RoPE: freq = 1 / 10000^(2i / head_size) in fp32, angle = pos * freq in fp32
        freq = 1.0 / torch.pow(torch.tensor(10000.0), torch.arange(0, hs, 2, dtype=torch.float32) / hs)
        angle = torch.arange(cfg.seq_len, dtype=torch.float32)[:, None] * freq[None, :]
        self.register_buffer("cos", torch.cos(angle), persistent=False)
        self.register_buffer("sin", torch.sin(angle), persistent=False)

    @staticmethod
    def rmsnorm(x, weight):
        return weight * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5))

    def rope(self, x):
        """x [B, T, heads, hs] rotated pairwise by its position 0..T-1."""
        T = x.shape[1]
        cos, sin = self.cos[:T, None, :], self.sin[:T, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)

    def forward(self, ids, probe_rows=None):
        """ids [B, T] at positions 0..T-1 -> logits [B, T, vocab]. With `probe_rows` (query positions R)
        also the attention probabilities of those rows, per layer [B, n_heads, R, T]: (logits, maps)."""
        c = self.cfg
        B, T = ids.shape
        if T > c.seq_len:
            raise ValueError(f"{T} tokens exceed the context of {c.seq_len}")
        hs, g = c.head_size, c.n_heads // c.n_kv_heads
        x = self.tok[ids]
        maps = []
        for l in range(c.n_layers):
            xb = self.rmsnorm(x, self.rms_att[l])
            q = self.rope((xb @ self.wq[l].T).view(B, T, c.n_heads, hs)).transpose(1, 2)
            k = self.rope((xb @ self.wk[l].T).view(B, T, c.n_kv_heads, hs)).transpose(1, 2)
            v = (xb @ self.wv[l].T).view(B, T, c.n_kv_heads, hs).transpose(1, 2)
            k = k.repeat_interleave(g, dim=1).reshape(B * c.n_heads, T, hs)  # query head h reads KV head h // g
            v = v.repeat_interleave(g, dim=1).reshape(B * c.n_heads, T, hs)
            if probe_rows is not None:
                r = torch.as_tensor(probe_rows, dtype=torch.long)
                sc = q[:, :, r] @ k.view(B, c.n_heads, T, hs).transpose(2, 3) / math.sqrt(hs)
                sc = sc.masked_fill(torch.arange(T)[None, :] > r[:, None], float("-inf"))
                maps.append(torch.softmax(sc, dim=-1))
            att = causal_attention(q.reshape(B * c.n_heads, T, hs), k, v)
            x = x + att.view(B, c.n_heads, T, hs).transpose(1, 2).reshape(B, T, c.dim) @ self.wo[l].T
            xb = self.rmsnorm(x, self.rms_ffn[l])
            x = x + (F.silu(xb @ self.w1[l].T) * (xb @ self.w3[l].T)) @ self.w2[l].T
        logits = self.rmsnorm(x, self.rms_final) @ self.tok.T
        return logits if probe_rows is None else (logits, maps)

    def n_params(self):
        return sum(p.numel() for p in self.parameters())


def export(model: Model, path: str):
    """Writes `model` as a llama2.c checkpoint (docs/runner.md, "Model format handling"): seven int32,
    the fp32 weights in llama2.c's order, the two legacy RoPE tables; a positive vocab size = the
    classifier shares the token embedding."""
    c = model.cfg
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size,
                            c.seq_len))
        for t in (model.tok, model.rms_att, model.wq, model.wk, model.wv, model.wo, model.rms_ffn, model.w1,
                  model.w2, model.w3, model.rms_final, model.cos, model.sin):
            f.write(t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes())


def _header_config(head: bytes, path: str) -> Config:
    if len(head) < 28:
        raise ValueError(f"{path}: {len(head)} bytes, shorter than a checkpoint's 28-byte header")
    return Config(*struct.unpack("<7i", head[:28]))


def read_config(path: str) -> Config:
    """The model shape in a llama2.c checkpoint's header (ValueError when the file is shorter than it)."""
    with open(path, "rb") as f:
        return _header_config(f.read(28), path)


def grow(small: Model, cfg: Config, seed: int) -> Model:
    """A model of cfg (small's options but more layers) whose first layers are small's and whose added
    ones are fresh (seed) with their output projections wo and w2 zero: each added block adds nothing
    to the residual stream, so the grown model computes small's function until training moves them."""
    a, b = vars(small.cfg), vars(cfg)
    if {k: v for k, v in a.items() if k != "n_layers"} != {k: v for k, v in b.items() if k != "n_layers"} \
            or cfg.n_layers < small.cfg.n_layers:
        raise ValueError(f"a model of {a} grows only into more layers of the same options, not {b}")
    big, n = Model(cfg, seed=seed), small.cfg.n_layers
    with torch.no_grad():
        for name, p in big.named_parameters():
            q = getattr(small, name)
            if p.shape == q.shape:
                p.copy_(q)
            else:  # per-layer [L, ...]: the first n from small, the new layers' residual outputs zero
                p[:n].copy_(q)
                if name in ("wo", "w2"):
                    p[n:].zero_()
    return big


def load(path: str) -> Model:
    """Reads a checkpoint `export` wrote (shared classifier only) back into a trainable Model."""
    with open(path, "rb") as f:
        raw = f.read()
    cfg = _header_config(raw, path)
    if cfg.vocab_size <= 0:
        raise ValueError(f"{path}: an unshared classifier (vocab {cfg.vocab_size}) is not a testbed checkpoint")
    m = Model(cfg)
    data = np.frombuffer(raw, dtype="<f4", offset=28)
    off = 0
    with torch.no_grad():
        for t in (m.tok, m.rms_att, m.wq, m.wk, m.wv, m.wo, m.rms_ffn, m.w1, m.w2, m.w3, m.rms_final):
            t.copy_(torch.from_numpy(data[off:off + t.numel()].copy()).view_as(t))
            off += t.numel()
    off += 2 * cfg.seq_len * (cfg.head_size // 2)
    if off != data.size:
        raise ValueError(f"{path}: the header implies {off} floats after it, the file holds {data.size}")
    return m
