"""A pure-PyTorch reference of kvevict's runner (docs/runner.md): llama2.c checkpoints
(models/stories260K.bin), a per-(layer, KV head) cache that keeps each row's original position,
and a hook after each layer where a press evicts. The whole eviction loop in PyTorch:

    model = Model.load("models/stories260K.bin")
    tok = Tokenizer.load("models/tok512.bin", model.vocab_size)
    cache = model.new_cache()
    logits = model.forward(cache, tok.encode("Once upon a time"), hook=evict_with(press))  # prefill + evict
    logits = model.forward(cache, [next_token])                                            # decode

Numerics follow run.c (fp32, RMSNorm eps 1e-5, RoPE base 10000 on pairs, 1/sqrt(head_size)),
so logits match kvevict-run's to about 1e-6 (PyTorch sums in another order).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

__all__ = ["Model", "Cache", "Tokenizer", "evict_with", "kl_divergence"]


@dataclass
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int

    @property
    def head_size(self):
        return self.dim // self.n_heads


class Cache:
    """Per layer and KV head: keys [n, hs], values [n, hs] (post-RoPE) and original positions [n].
    Heads may hold different numbers of rows after eviction."""

    def __init__(self, cfg: Config):
        hs = cfg.head_size
        self.keys = [[torch.zeros(0, hs) for _ in range(cfg.n_kv_heads)] for _ in range(cfg.n_layers)]
        self.values = [[torch.zeros(0, hs) for _ in range(cfg.n_kv_heads)] for _ in range(cfg.n_layers)]
        self.positions = [[torch.zeros(0, dtype=torch.long) for _ in range(cfg.n_kv_heads)]
                          for _ in range(cfg.n_layers)]
        self.next_position = 0

    def lengths(self, layer: int) -> List[int]:
        return [k.shape[0] for k in self.keys[layer]]

    def dense(self, layer: int):
        """keys, values [1, H, T, hs] of a layer whose heads hold the same number of rows."""
        if len(set(self.lengths(layer))) != 1:
            raise ValueError(f"layer {layer}: heads hold {self.lengths(layer)} rows (ragged)")
        return torch.stack(self.keys[layer])[None], torch.stack(self.values[layer])[None]

    def keep(self, layer: int, head: int, rows):
        """Head `head` of `layer` keeps `rows` (ascending row indices into its current rows)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        self.keys[layer][head] = self.keys[layer][head][rows]
        self.values[layer][head] = self.values[layer][head][rows]
        self.positions[layer][head] = self.positions[layer][head][rows]


class Model:
    def __init__(self, cfg: Config, w: dict):
        self.cfg = cfg
        self.w = w
        hs = cfg.head_size
        # run.c's RoPE: freq = 1 / 10000^(head_dim / head_size) in fp32, angle = pos * freq in fp32
        head_dim = torch.arange(0, hs, 2, dtype=torch.float32)
        self.freq = 1.0 / torch.pow(torch.tensor(10000.0), head_dim / hs)

    @property
    def vocab_size(self):
        return self.cfg.vocab_size

    @staticmethod
    def load(path: str) -> "Model":
        raw = open(path, "rb").read()
        dim, hidden, L, nh, nkv, vocab, seq = struct.unpack("<7i", raw[:28])
        shared = vocab > 0
        vocab = abs(vocab)
        cfg = Config(dim, hidden, L, nh, nkv, vocab, seq)
        hs = dim // nh
        kv_dim = nkv * hs
        data = np.frombuffer(raw, dtype="<f4", offset=28)
        off = 0

        def take(*shape):
            nonlocal off
            n = int(np.prod(shape))
            t = torch.from_numpy(data[off:off + n].copy()).reshape(*shape)
            off += n
            return t

        w = {"tok": take(vocab, dim), "rms_att": take(L, dim), "wq": take(L, dim, dim), "wk": take(L, kv_dim, dim),
             "wv": take(L, kv_dim, dim), "wo": take(L, dim, dim), "rms_ffn": take(L, dim),
             "w1": take(L, hidden, dim), "w2": take(L, dim, hidden), "w3": take(L, hidden, dim),
             "rms_final": take(dim)}
        off += 2 * seq * (hs // 2)  # the legacy RoPE tables, skipped as run.c does
        w["cls"] = w["tok"] if shared else take(vocab, dim)
        if off != data.size:
            raise ValueError(f"{path}: the header implies {off} floats after it, the file holds {data.size}")
        return Model(cfg, w)

    def new_cache(self) -> Cache:
        return Cache(self.cfg)

    @staticmethod
    def rmsnorm(x, weight):
        ss = (x * x).sum(-1, keepdim=True) / x.shape[-1] + 1e-5
        return weight * (x / torch.sqrt(ss))

    def rope(self, x, pos):
        """x [n, heads, hs] rotated pairwise by pos [n]."""
        angle = pos.to(torch.float32)[:, None] * self.freq[None, :]
        cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    @torch.no_grad()
    def forward(self, cache: Cache, ids: Sequence[int], positions=None, hook: Optional[Callable] = None):
        """Runs a block of tokens (prefill or decode) and returns its logits [n, vocab].

        hook(layer, cache, queries [1, H_q, n, hs]) runs after each layer has attended (the block's
        keys and values are in the cache); it may evict rows of that layer (Cache.keep)."""
        c, w = self.cfg, self.w
        ids = torch.as_tensor(list(ids), dtype=torch.long)
        n = ids.shape[0]
        pos = torch.arange(cache.next_position, cache.next_position + n) if positions is None \
            else torch.as_tensor(positions, dtype=torch.long)
        hs, g = c.head_size, c.n_heads // c.n_kv_heads
        x = w["tok"][ids]
        for l in range(c.n_layers):
            xb = self.rmsnorm(x, w["rms_att"][l])
            q = self.rope((xb @ w["wq"][l].T).view(n, c.n_heads, hs), pos)
            k = self.rope((xb @ w["wk"][l].T).view(n, c.n_kv_heads, hs), pos)
            v = (xb @ w["wv"][l].T).view(n, c.n_kv_heads, hs)
            att = torch.empty(n, c.n_heads, hs)
            for h in range(c.n_kv_heads):
                held = cache.keys[l][h].shape[0]
                cache.keys[l][h] = torch.cat([cache.keys[l][h], k[:, h]])
                cache.values[l][h] = torch.cat([cache.values[l][h], v[:, h]])
                cache.positions[l][h] = torch.cat([cache.positions[l][h], pos])
                K, V = cache.keys[l][h], cache.values[l][h]
                qh = q[:, h * g:(h + 1) * g]                      # [n, g, hs]
                logits = torch.einsum("ngd,td->ngt", qh, K) / math.sqrt(hs)
                # row i sees every row held before the block and the block's rows up to its own
                visible = torch.arange(K.shape[0])[None, :] < held + 1 + torch.arange(n)[:, None]
                logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
                att[:, h * g:(h + 1) * g] = torch.einsum("ngt,td->ngd", torch.softmax(logits, -1), V)
            x = x + att.reshape(n, c.dim) @ w["wo"][l].T
            xb = self.rmsnorm(x, w["rms_ffn"][l])
            h1, h3 = xb @ w["w1"][l].T, xb @ w["w3"][l].T
            x = x + (torch.nn.functional.silu(h1) * h3) @ w["w2"][l].T
            if hook is not None:
                hook(l, cache, q.permute(1, 0, 2)[None])
        cache.next_position = int(pos.max()) + 1
        return self.rmsnorm(x, w["rms_final"]) @ w["cls"].T


def evict_with(press, only_if_longer: bool = True):
    """A forward hook that evicts each layer with `press` (kvevict.presses) after it has attended:
    post-fill eviction, layer by layer, as kvevict's post-fill driver with per-layer budgets."""

    def hook(layer, cache: Cache, queries):
        keys, values = cache.dense(layer)
        if only_if_longer and press.tokens_kept(keys.shape[2]) >= keys.shape[2]:
            return
        press(keys, values, queries, layer=layer, num_layers=len(cache.keys))
        kept = press.last_kept
        for h in range(keys.shape[1]):
            if isinstance(kept, list):  # ragged: (positions, cu) of batch element 0
                pos, cu = kept[0]
                rows = pos[int(cu[h]):int(cu[h + 1])]
            else:
                rows = kept[0, h]
            cache.keep(layer, h, rows.long())

    return hook


def kl_divergence(p_logits, q_logits):
    """KL(softmax(p) || softmax(q)) per row, in float64."""
    p = torch.log_softmax(torch.as_tensor(p_logits, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.as_tensor(q_logits, dtype=torch.float64), -1)
    return (p.exp() * (p - q)).sum(-1)


class Tokenizer:
    """llama2.c's tokenizer (run.c's encode): BOS, a dummy-prefix " ", one token per UTF-8 code
    point in the vocabulary (else its bytes + 3), then the best-scoring merges."""

    def __init__(self, vocab: List[bytes], scores: List[float]):
        self.vocab, self.scores = vocab, scores
        self.index = {t: i for i, t in reversed(list(enumerate(vocab)))}

    @staticmethod
    def load(path: str, vocab_size: int) -> "Tokenizer":
        with open(path, "rb") as f:
            raw = f.read()
        off = 4
        vocab, scores = [], []
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", raw, off)
            off += 8
            vocab.append(raw[off:off + length])
            scores.append(score)
            off += length
        return Tokenizer(vocab, scores)

    def encode(self, text: str, bos: bool = True) -> List[int]:
        out = [1] if bos else []
        if text:
            out.append(self.index[b" "])
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.index:
                out.append(self.index[b])
            else:
                out.extend(x + 3 for x in b)
        start = 1 if bos else 0
        while True:
            best, best_i = -1e10, -1
            for i in range(start, len(out) - 1):
                merged = self.vocab[out[i]] + self.vocab[out[i + 1]]
                j = self.index.get(merged)
                if j is not None and self.scores[j] > best:
                    best, best_i, best_id = self.scores[j], i, j
            if best_i < 0:
                return out
            out[best_i:best_i + 2] = [best_id]

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.vocab[i] for i in ids if i > 2).decode("utf-8", errors="replace")
