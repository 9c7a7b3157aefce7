"""Press-style eviction of a layer's cache, in the spirit of kvpress (docs/python.md).

    press = kvevict.presses.SnapKV(budget=256, window=32)
    keys, values = press(keys, values, queries)        # [batch, heads, tokens, dim] tensors

A press is a kvevict recipe (how tokens are scored) plus a budget rule (how many each head keeps).
Scores, selection and compaction run in the compiled library on views of the caller's tensors
(no copies in, the GIL released); only the compacted caches are new tensors.

Budgets count every kept token of a head, protected ones (sinks, the observation window)
included, as everywhere in kvevict. ``budget`` is tokens per KV head; ``compression_ratio``
(kvpress's parameter) keeps ``int(T * (1 - compression_ratio))`` instead.

Uniform presses return dense ``[batch, heads, budget, dim]`` tensors. Presses whose heads keep
different numbers of tokens (AdaKV, Duo, LAVa, and PyramidKV/CAKE across layers) return
:class:`Ragged` caches: one row buffer with per-(batch, head) offsets.

Presses that share a budget across layers (PyramidKV, LAVa, CAKE) take the layer index in
``__call__`` (PyramidKV) or evict every layer at once through :meth:`Press.evict_layers`
(LAVa's entropy layer budgets, CAKE's preferences), as kvevict's post-fill driver does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import _core

__all__ = [
    "Ragged", "Press", "SnapKV", "StreamingLLM", "H2O", "TOVA", "Knorm", "VATP", "LAVa", "CAKE",
    "PyramidKV", "AdaKV", "Duo", "ALL",
]


@dataclass
class Ragged:
    """A ragged cache: the rows of (batch b, head h) are ``data[cu[b*H + h] : cu[b*H + h + 1]]``.

    ``positions`` holds each kept row's original token position (ascending per head).
    """

    data: object       # [total, dim], the input's library and dtype
    cu: object         # [batch * heads + 1] int32 offsets
    positions: object  # [total] int32
    batch: int
    heads: int

    def head(self, b: int, h: int):
        """Rows of head h of batch element b: a view, no copy."""
        i = b * self.heads + h
        return self.data[int(self.cu[i]): int(self.cu[i + 1])]

    def lengths(self):
        """Tokens kept per (batch, head): [batch, heads]."""
        cu = np.asarray(_to_numpy(self.cu), dtype=np.int64)
        return (cu[1:] - cu[:-1]).reshape(self.batch, self.heads)


def _to_numpy(x):
    return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else np.asarray(x)


def _empty_like(x, shape, dtype_of=None):
    """A new tensor of shape in x's library (and dtype_of's dtype, x's by default)."""
    ref = x if dtype_of is None else dtype_of
    if isinstance(x, np.ndarray):
        return np.empty(shape, dtype=ref.dtype)
    import torch
    return torch.empty(shape, dtype=ref.dtype, device=x.device)


def _int32(x, values):
    arr = np.ascontiguousarray(values, dtype=np.int32)
    if isinstance(x, np.ndarray):
        return arr
    import torch
    return torch.from_numpy(arr)


class Press:
    """A recipe and a budget rule. Subclasses set the recipe; see the module docstring."""

    #: "uniform" (every head the same), "adakv", "flattened" (heads of a layer compete), "pyramid",
    #: "lava", "cake", "duo"
    allocator = "uniform"

    def __init__(self, recipe: _core.Recipe, budget: Optional[int] = None,
                 compression_ratio: Optional[float] = None):
        if (budget is None) == (compression_ratio is None):
            raise ValueError(f"{type(self).__name__}: give exactly one of budget and compression_ratio")
        if compression_ratio is not None and not 0.0 <= compression_ratio < 1.0:
            raise ValueError(f"{type(self).__name__}: compression_ratio {compression_ratio} is outside [0, 1)")
        if budget is not None and budget < 0:
            raise ValueError(f"{type(self).__name__}: budget {budget} is negative")
        self.recipe = recipe
        self.budget = budget
        self.compression_ratio = compression_ratio

    def __repr__(self):
        b = f"budget={self.budget}" if self.budget is not None else f"compression_ratio={self.compression_ratio}"
        return f"{type(self).__name__}({b}, recipe={self.recipe!r}, allocator={self.allocator})"

    # -- scoring ---------------------------------------------------------------------------
    def tokens_kept(self, tokens: int) -> int:
        """Tokens per head for a prompt of ``tokens`` (the budget, capped at the prompt)."""
        if self.budget is not None:
            return min(self.budget, tokens)
        return int(tokens * (1.0 - self.compression_ratio))

    def query_rows(self, queries, tokens: int):
        """The rows of ``queries`` [H_q, T_q, d] the recipe reads (a view)."""
        r = self.recipe
        if not r.uses_attention:
            return None
        if queries is None:
            raise ValueError(f"{type(self).__name__}: the {r.name} recipe needs queries")
        if r.source == _core.QuerySource.external_block:
            return queries
        if r.kind == _core.RecipeKind.h2o:
            return queries[:, -tokens:]
        if r.kind == _core.RecipeKind.tova:
            return queries[:, -1:]
        if queries.shape[1] < r.window:
            raise ValueError(f"{type(self).__name__}: queries hold {queries.shape[1]} rows, the window is {r.window}")
        return queries[:, -r.window:]

    def scores(self, keys, values, queries=None, block_keys=None):
        """Final per-KV-head scores [batch, H_kv, T] float32 (protected tokens +inf)."""
        B, H, T, _ = keys.shape
        scores = _empty_like(keys, (B, H, T), dtype_of=_float32_like(keys))
        for b in range(B):
            q = self.query_rows(None if queries is None else queries[b], T)
            _core.recipe_scores(self.recipe, q, keys[b], values[b],
                                None if block_keys is None else block_keys[b], out=scores[b])
        return scores

    # -- budgets and selection ---------------------------------------------------------------
    def protected(self, tokens: int) -> int:
        r = self.recipe
        return min(tokens, r.n_sink + r.n_recent)

    def select(self, scores, layer: int = 0, num_layers: int = 1):
        """Kept positions of one layer's scores [B, H, T]: dense [B, H, k] int32, or a list of
        per-batch (positions, cu) for allocators that give heads different budgets."""
        B, H, T = scores.shape
        k = self.tokens_kept(T)
        if self.allocator in ("uniform", "cake"):  # CAKE's layer budgets need every layer: evict_layers
            out = _empty_like(scores, (B, H, k), dtype_of=_int32_like(scores))
            for b in range(B):
                _core.recipe_select(self.recipe, scores[b], k, out=out[b])
            return out
        ragged = []
        for b in range(B):
            s = scores[b]
            if self.allocator == "adakv":
                ragged.append(_core.adakv_budgets(s, k, alpha=self.alpha, floor=self.floor,
                                                  n_sink=self.recipe.n_sink, n_recent=self.recipe.n_recent))
            elif self.allocator in ("flattened", "lava"):
                ragged.append(_core.select_topk_flat(s, k * H))
            elif self.allocator == "pyramid":
                budgets = _core.pyramid_budgets(k, T, num_layers, H, beta=self.beta, n_sink=self.recipe.n_sink,
                                                n_recent=self.recipe.n_recent)
                ragged.append(_core.recipe_select(self.recipe, s, _int32(s, budgets[layer])))
            elif self.allocator == "duo":
                mask = np.asarray(self.retrieval[layer], dtype=np.uint8).reshape(1, H)
                budgets, _ = _core.duo_budgets(mask, T, n_sink=self.recipe.n_sink, n_recent=self.recipe.n_recent)
                ragged.append(_core.recipe_select(self.recipe, s, _int32(s, budgets[0])))
            else:
                raise ValueError(f"{type(self).__name__}: allocator {self.allocator} needs every layer "
                                 "(use evict_layers)")
        return ragged

    # -- compaction --------------------------------------------------------------------------
    @staticmethod
    def compact(keys, values, kept):
        """Gather the kept rows of keys and values [B, H, T, d]: dense kept -> dense tensors,
        ragged kept -> (Ragged keys, Ragged values)."""
        B, H, _, d = keys.shape
        if not isinstance(kept, list):
            k = kept.shape[2]
            ko = _empty_like(keys, (B, H, k, d))
            vo = _empty_like(values, (B, H, k, values.shape[3]))
            for b in range(B):
                _core.compact(keys[b], kept[b], out=ko[b])
                _core.compact(values[b], kept[b], out=vo[b])
            return ko, vo
        counts = [_to_numpy(cu)[-1] for _, cu in kept]
        total = int(sum(counts))
        ko = _empty_like(keys, (total, d))
        vo = _empty_like(values, (total, values.shape[3]))
        cu_all = np.zeros(B * H + 1, dtype=np.int64)
        start = 0
        for b, (pos, cu) in enumerate(kept):
            cun = _to_numpy(cu).astype(np.int64)
            n = int(cun[-1])
            _core.compact_ragged(keys[b], pos, cu, out=ko[start:start + n])
            _core.compact_ragged(values[b], pos, cu, out=vo[start:start + n])
            cu_all[b * H + 1:(b + 1) * H + 1] = start + cun[1:]
            start += n
        positions = np.concatenate([_to_numpy(p) for p, _ in kept]) if kept else np.zeros(0, np.int32)
        cu_t = _int32(keys, cu_all)
        pos_t = _int32(keys, positions)
        return Ragged(ko, cu_t, pos_t, B, H), Ragged(vo, cu_t, pos_t, B, H)

    def __call__(self, keys, values, queries=None, *, layer: int = 0, num_layers: int = 1, block_keys=None):
        """Evict one layer: keys, values [B, H_kv, T, d], queries [B, H_q, T_q, d] (post-RoPE)."""
        _check_cache(keys, values, queries)
        scores = self.scores(keys, values, queries, block_keys)
        kept = self.select(scores, layer, num_layers)
        self.last_kept = kept
        return self.compact(keys, values, kept)

    def evict_layers(self, layers: Sequence[Tuple[object, object, object]]):
        """Evict every layer at once ([(keys, values, queries)] per layer): the allocators that
        share a budget across layers (LAVa's entropies, CAKE's preferences, PyramidKV) see them all.
        Returns one (keys, values) per layer."""
        L = len(layers)
        for k, v, q in layers:
            _check_cache(k, v, q)
        scores = [self.scores(k, v, q) for k, v, q in layers]
        if self.allocator not in ("lava", "cake"):
            return [self.compact(k, v, self.select(s, l, L)) for l, ((k, v, _), s) in enumerate(zip(layers, scores))]
        B, H, T = scores[0].shape
        kb = self.tokens_kept(T)
        prot = dict(n_sink=self.recipe.n_sink, n_recent=self.recipe.n_recent)
        kept: List[list] = [[] for _ in range(L)]
        for b in range(B):
            if self.allocator == "lava":
                e = [_core.lava_layer_entropy(s[b], **prot) for s in scores]
                totals = _core.lava_layer_budgets(e, H, T, kb * H * L, **prot)
                for l in range(L):
                    kept[l].append(_core.select_topk_flat(scores[l][b], int(totals[l])))
            else:
                prefs = [self.cake_preference(q[b], k[b]) for k, _, q in layers]
                budgets = _core.cake_budgets(prefs, kb, T, H, **prot)
                for l in range(L):
                    kept[l].append(_core.recipe_select(self.recipe, scores[l][b], _int32(scores[l], budgets[l])))
        self.last_kept = kept
        return [self.compact(k, v, kept[l]) for l, (k, v, _) in enumerate(layers)]


def _float32_like(x):
    if isinstance(x, np.ndarray):
        return np.empty(0, dtype=np.float32)
    import torch
    return torch.empty(0, dtype=torch.float32)


def _int32_like(x):
    if isinstance(x, np.ndarray):
        return np.empty(0, dtype=np.int32)
    import torch
    return torch.empty(0, dtype=torch.int32)


def _check_cache(keys, values, queries):
    if len(keys.shape) != 4 or len(values.shape) != 4:
        raise ValueError(f"keys and values must be [batch, heads, tokens, dim], got {tuple(keys.shape)} and "
                         f"{tuple(values.shape)}")
    if tuple(keys.shape[:3]) != tuple(values.shape[:3]):
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in batch, heads or tokens")
    if queries is not None and (len(queries.shape) != 4 or queries.shape[0] != keys.shape[0]
                                or queries.shape[3] != keys.shape[3]):
        raise ValueError(f"queries must be [batch, query heads, rows, dim] like keys {tuple(keys.shape)}, got "
                         f"{tuple(queries.shape)}")


def _recipe(base, **fields):
    r = base
    for k, v in fields.items():
        if v is not None:
            setattr(r, k, v)
    return r


class SnapKV(Press):
    """SnapKV: the last ``window`` queries' attention, max-pooled (kernel 7), GQA mean, window kept.
    kvpress's SnapKVPress: window_size 64, avg pool kernel 5 (pass window=64, pool="avg", kernel=5)."""

    def __init__(self, budget=None, window=32, kernel=None, pool=None, compression_ratio=None):
        super().__init__(_recipe(_core.Recipe.snapkv(), window=window, n_recent=window, kernel=kernel, pool=pool),
                         budget, compression_ratio)


class StreamingLLM(Press):
    """StreamingLLM: ``n_sink`` sinks + the most recent tokens (kvpress StreamingLLMPress, n_sink 4)."""

    def __init__(self, budget=None, n_sink=4, compression_ratio=None):
        super().__init__(_core.Recipe.streaming_llm(n_sink), budget, compression_ratio)


class H2O(Press):
    """H2O: accumulated attention of every prompt query, the last ``n_recent`` kept. ``normalised``
    divides by the queries that see each key (kvpress ObservedAttentionPress)."""

    def __init__(self, budget=None, n_recent=32, normalised=False, compression_ratio=None):
        r = _core.Recipe.h2o()
        r.n_recent = n_recent
        if normalised:
            s = r.score
            s.reduce = _core.ScoreReduce.mean_visible
            r.score = s
        super().__init__(r, budget, compression_ratio)


class TOVA(Press):
    """TOVA: the last token's attention per KV head (kvpress TOVAPress averages over heads)."""

    def __init__(self, budget=None, compression_ratio=None):
        super().__init__(_core.Recipe.tova(), budget, compression_ratio)


class Knorm(Press):
    """Knorm: keep the keys of smallest L2 norm (kvpress KnormPress)."""

    def __init__(self, budget=None, compression_ratio=None):
        super().__init__(_core.Recipe.knorm(), budget, compression_ratio)


class VATP(Press):
    """VATP: SnapKV's window scores times ||v_i||_1."""

    def __init__(self, budget=None, window=32, compression_ratio=None):
        super().__init__(_recipe(_core.Recipe.vatp(), window=window, n_recent=window), budget, compression_ratio)


class LAVa(Press):
    """LAVa: window attention x max_k ||v_k||_1, GQA max; heads of a layer compete for the layer's
    budget (Algorithm 1). :meth:`evict_layers` adds the entropy layer budgets (Eq. 7-8)."""

    allocator = "lava"

    def __init__(self, budget=None, window=32, compression_ratio=None):
        super().__init__(_recipe(_core.Recipe.lava(), window=window, n_recent=window), budget, compression_ratio)


class CAKE(Press):
    """CAKE: mean + gamma var of the window attention; per-layer budgets from the layers'
    preferences (entropy^(1/tau1) x variance^(1/tau2)) through :meth:`evict_layers`. A single
    layer called directly keeps the uniform budget."""

    allocator = "cake"

    def __init__(self, budget=None, window=32, tau1=1.0, tau2=1.0, compression_ratio=None):
        super().__init__(_recipe(_core.Recipe.cake(), window=window, n_recent=window), budget, compression_ratio)
        self.tau1, self.tau2 = tau1, tau2

    def cake_preference(self, queries, keys):
        """A layer's preference from its window's queries and its keys (the library's
        cake_window_preference: the window's causal attention over the prefix, in float32)."""
        import torch
        w = self.recipe.window
        q = torch.as_tensor(queries)[:, -w:].float()
        k = torch.as_tensor(keys).float()
        return _core.cake_window_preference(q, k, self.tau1, self.tau2)


class PyramidKV(Press):
    """PyramidKV: SnapKV scores, per-layer budgets from the pyramid (beta 20); pass ``layer`` and
    ``num_layers`` to __call__ (kvpress PyramidKVPress reads them from the module)."""

    allocator = "pyramid"

    def __init__(self, budget=None, window=32, kernel=None, beta=20, compression_ratio=None):
        super().__init__(_recipe(_core.Recipe.snapkv(), window=window, n_recent=window, kernel=kernel),
                         budget, compression_ratio)
        self.beta = beta


class AdaKV(Press):
    """AdaKV around a scoring press: every head keeps floor(alpha B) of its best, then the heads
    compete for the rest of the layer's B x H (kvpress AdaKVPress, alpha_safeguard 0.2)."""

    allocator = "adakv"

    def __init__(self, press: Press, alpha=0.2, floor="budget"):
        super().__init__(press.recipe, press.budget, press.compression_ratio)
        self.alpha, self.floor = alpha, floor


class Duo(Press):
    """DuoAttention / PruLong: retrieval heads (mask 1) keep the whole prompt, streaming heads
    ``n_sink`` sinks + ``n_recent`` recent tokens. ``retrieval``: [layers, heads] 0/1."""

    allocator = "duo"

    def __init__(self, retrieval, n_sink=128, n_recent=1024):
        r = _core.Recipe.streaming_llm(n_sink)
        r.n_recent = n_recent
        super().__init__(r, budget=1 << 30)
        self.retrieval = np.asarray(retrieval)


#: Every press class, for sweeps.
ALL = (SnapKV, StreamingLLM, H2O, TOVA, Knorm, VATP, LAVa, CAKE, PyramidKV, AdaKV, Duo)
