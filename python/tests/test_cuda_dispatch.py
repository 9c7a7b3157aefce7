"""The host/CUDA dispatch (on_device in python/src/common.hpp), checked without a GPU: CUDA tensors
are simulated by DLPack capsules that report a CUDA device (their data is a host tensor's, never
read). In a host-only build every function refuses them before any work; in a CUDA build
(kvevict.has_cuda) the functions of kvevict.cuda_functions reach the library's cuda_t path, which
fails with code 'cuda_error' here because the machine has no GPU, and every other function refuses
them naming the functions that take CUDA tensors."""
import ctypes

import pytest
import torch

import kvevict
from conftest import randn


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    _fields_ = [("dl", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16), torch.int32: (0, 32)}


class FakeCuda:
    """A DLPack producer of a tensor on CUDA device 0 (the shape, strides and type of `t`)."""

    def __init__(self, t):
        self.t = t
        n = t.dim()
        self.shape = (ctypes.c_int64 * n)(*t.shape)
        self.strides = (ctypes.c_int64 * n)(*t.stride())
        code, bits = _DTYPES[t.dtype]
        self.managed = _Managed(_Tensor(t.data_ptr(), _Device(2, 0), n, _DType(code, bits, 1), self.shape,
                                        self.strides, 0), None, None)

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        assert stream == 1  # the binding asks CUDA producers for the legacy default stream
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)


def cuda(t):
    return FakeCuda(t)


def _paged(gen):
    """Two sequences of 10 tokens, 2 KV heads, pages of 4 (NHD), per-sequence lists: pools, table."""
    k, v = randn(gen, 6, 4, 2, 8), randn(gen, 6, 4, 2, 8)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return k, v, i32(0, 3, 6), i32(3, 0, 5, 1, 4, 2), i32(2, 2)


def _calls(gen, cuda=cuda):
    """(function, call) pairs covering every function of kvevict.cuda_functions (and each CUDA form of
    it), every device tensor (outputs too) on the fake GPU (or, with cuda=lambda t: t, the same call on
    the host). Host-side metadata stays on the host: ragged budgets (they size the outputs) and page
    tables (validated on the host, copied to the device by the bridge)."""
    q, k, v = randn(gen, 4, 3, 8), randn(gen, 2, 10, 8), randn(gen, 2, 10, 8)
    s4, s2 = randn(gen, 4, 10), randn(gen, 2, 10)
    kept = torch.tensor([[0, 3, 9], [1, 2, 5]], dtype=torch.int32)
    i32 = lambda *n: torch.zeros(*n, dtype=torch.int32)  # noqa: E731
    f32 = lambda *n: torch.zeros(*n)  # noqa: E731
    ints = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    r = kvevict.Recipe.snapkv()
    r.window = r.n_recent = 3
    pk, pv, indptr, indices, last = _paged(gen)
    table = (indptr, indices, last)
    kept_rows = (ints(*([0, 3, 9] * 4)), ints(0, 3, 6, 9, 12))  # 4 paged rows keep 3 tokens each

    def cache():  # a ragged cache with capacity 12 per head holding 10 rows each
        return cuda(randn(gen, 24, 8)), cuda(ints(0, 12, 24)), cuda(ints(10, 10))

    return [
        ("attention_scores", lambda: kvevict.attention_scores(cuda(q), cuda(k), out=cuda(f32(4, 10)))),
        ("window_scores", lambda: kvevict.window_scores(cuda(q), cuda(k), out=cuda(f32(4, 10)))),
        ("h2o_scores", lambda: kvevict.h2o_scores(cuda(randn(gen, 4, 10, 8)), cuda(k), out=cuda(f32(4, 10)))),
        ("tova_scores", lambda: kvevict.tova_scores(cuda(q[:, -1:]), cuda(k), out=cuda(f32(4, 10)))),
        ("key_norm_scores", lambda: kvevict.key_norm_scores(cuda(k), out=cuda(f32(2, 10)))),
        ("position_scores", lambda: kvevict.position_scores(cuda(f32(2, 10)))),
        ("gqa_reduce", lambda: kvevict.gqa_reduce(cuda(s4), 2, out=cuda(f32(2, 10)))),
        ("pool1d", lambda: kvevict.pool1d(cuda(s2), "max", 3, out=cuda(f32(2, 10)))),
        ("weight_by_value_norm", lambda: kvevict.weight_by_value_norm(cuda(s2), cuda(v))),
        ("protect", lambda: kvevict.protect(cuda(s2), 1, 2)),
        ("postprocess_scores", lambda: kvevict.postprocess_scores(cuda(s4), 2, cuda(v), out=cuda(f32(2, 10)))),
        ("select_topk", lambda: kvevict.select_topk(cuda(s2), 3, out=cuda(i32(2, 3)))),
        ("select_topk_flat", None),  # makes its own outputs: a DLPack CUDA input cannot (out= needed), see below
        ("select_topk_ragged", lambda: kvevict.select_topk_ragged(cuda(s2), ints(2, 3), row_lengths=cuda(ints(10, 9)),
                                                                  out=(cuda(i32(5)), cuda(i32(3))))),
        ("select_topk_batch", lambda: kvevict.select_topk_batch(cuda(s4), cuda(ints(3, 4)), kv_heads=2,
                                                                row_lengths=cuda(ints(10, 9, 8, 10)),
                                                                out=(cuda(i32(40)), cuda(i32(5))))),
        ("select_topk_batch", lambda: kvevict.select_topk_batch(cuda(s2), cuda(ints(3, 4)),
                                                                cu_seqlens=cuda(ints(0, 4, 10)),
                                                                out=(cuda(i32(20)), cuda(i32(5))))),
        ("select_topk_batch", lambda: kvevict.select_topk_batch(cuda(s4), cuda(ints(3, 4)), kv_heads=2,
                                                                kind="flattened", row_lengths=cuda(ints(10, 9, 8, 10)),
                                                                out=(cuda(i32(40)), cuda(i32(5))))),
        ("select_topk_batch", lambda: kvevict.select_topk_batch(cuda(s2), cuda(ints(3, 4)), kind="flattened",
                                                                cu_seqlens=cuda(ints(0, 4, 10)),
                                                                out=(cuda(i32(20)), cuda(i32(5))))),
        ("compact", lambda: kvevict.compact(cuda(k), cuda(kept), out=cuda(f32(2, 3, 8)))),
        ("compact_ragged", lambda: kvevict.compact_ragged(cuda(k), cuda(kept.flatten()), cuda(ints(0, 3, 6)),
                                                          out=cuda(f32(6, 8)))),
        ("compact_inplace", lambda: kvevict.compact_inplace(cuda(k.clone()), cuda(kept))),
        ("recipe_scores", lambda: kvevict.recipe_scores(r, cuda(q), cuda(k), out=cuda(f32(2, 10)))),
        ("recipe_select", lambda: kvevict.recipe_select(r, cuda(s2), 3, out=cuda(i32(2, 3)))),
        ("recipe_select", lambda: kvevict.recipe_select(r, cuda(s2), ints(3, 4), out=(cuda(i32(7)), cuda(i32(3))))),
        ("append", lambda: kvevict.append(*cache(), cuda(randn(gen, 2, 2, 8)))),
        ("compact_ragged_inplace", lambda: kvevict.compact_ragged_inplace(*cache(), cuda(kept.flatten()),
                                                                          cuda(ints(0, 3, 6)))),
        ("compact_into_ragged_cache", lambda: kvevict.compact_into_ragged_cache(
            cuda(k), cuda(kept.flatten()), cuda(ints(0, 3, 6)), *cache())),
        ("paged_key_norm_scores", lambda: kvevict.paged_key_norm_scores(cuda(pk), cuda(pv), *table, 2,
                                                                        out=cuda(f32(4, 10)))),
        ("paged_window_scores", lambda: kvevict.paged_window_scores(cuda(q), cuda(pk), cuda(pv), *table, 2,
                                                                    out=cuda(f32(4, 7)))),
        ("paged_weight_by_value_norm", lambda: kvevict.paged_weight_by_value_norm(cuda(f32(4, 10)), cuda(pk), cuda(pv),
                                                                                  *table, 2)),
        ("compact_paged", lambda: kvevict.compact_paged(cuda(pk.clone()), cuda(pv.clone()), *table, 2,
                                                        tuple(cuda(t) for t in kept_rows),
                                                        out=(cuda(i32(2)), cuda(i32(6))))),
    ]


def test_cuda_functions_listed_once_and_all_exist():
    names = kvevict.cuda_functions
    assert len(set(names)) == len(names)
    assert all(callable(getattr(kvevict, n)) for n in names)
    assert set(names) == {name for name, _ in _calls(torch.Generator().manual_seed(0))}


def test_the_same_calls_run_on_the_host(gen):
    # so that on a (fake) GPU the only thing that can fail is the device itself
    for name, call in _calls(gen, cuda=lambda t: t):
        if call is not None:
            call()


def test_cuda_functions_reach_the_cuda_path_or_refuse(gen):
    for name, call in _calls(gen):
        if call is None:
            continue
        with pytest.raises(kvevict.Error) as e:
            call()
        if kvevict.has_cuda:
            # the cuda_t path was reached (views, checks, then the runtime): no GPU here
            assert e.value.code == "cuda_error", (name, str(e.value))
        else:
            assert e.value.code == "unsupported", name
            assert "this build has none" in str(e.value), (name, str(e.value))


def test_select_topk_flat_cuda_needs_a_producer_of_outputs(gen):
    # its outputs are made by the input's library: a DLPack CUDA input cannot make them
    with pytest.raises(kvevict.Error) as e:
        kvevict.select_topk_flat(cuda(randn(gen, 2, 10)), 4)
    assert e.value.code == "unsupported"


def test_other_functions_refuse_cuda_naming_the_supported_ones(gen):
    # no cuda_t path in the library: AdaKV's selection, compact_layer (ragged and paged), CAKE's
    # window preference (docs/python.md, "CUDA tensors")
    s2 = randn(gen, 2, 10)
    ints = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    pk, pv, indptr, indices, last = _paged(gen)
    kept_rows = (ints(*([0, 3, 9] * 4)), ints(0, 3, 6, 9, 12))
    calls = [
        lambda: kvevict.adakv_budgets(cuda(s2), 3),
        lambda: kvevict.compact_layer(cuda(randn(gen, 24, 8)), cuda(randn(gen, 24, 8)), cuda(ints(*range(24))),
                                      cuda(ints(0, 12, 24)), cuda(ints(10, 10)), cuda(ints(0, 3, 1, 2)),
                                      cuda(ints(0, 2, 4))),
        lambda: kvevict.compact_layer_paged(cuda(pk), cuda(pv), cuda(torch.zeros(6, 4, 2, 1, dtype=torch.int32)),
                                            indptr, indices, last, 2, tuple(cuda(t) for t in kept_rows)),
        lambda: kvevict.cake_window_preference(cuda(randn(gen, 4, 3, 8)), cuda(randn(gen, 2, 10, 8))),
    ]
    for call in calls:
        with pytest.raises(kvevict.Error) as e:
            call()
        assert e.value.code == "unsupported", str(e.value)
        assert "recipe_scores" in str(e.value) and "compact_paged" in str(e.value), str(e.value)


def test_cuda_forms_that_need_host_metadata(gen):
    s2 = randn(gen, 2, 10)
    ints = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = (cuda(torch.zeros(5, dtype=torch.int32)), cuda(torch.zeros(3, dtype=torch.int32)))
    # ragged budgets size the output: a CPU tensor (in a host build the CUDA scores are refused first)
    with pytest.raises(kvevict.Error, match="CPU tensor" if kvevict.has_cuda else "this build has none"):
        kvevict.select_topk_ragged(cuda(s2), cuda(ints(2, 3)), out=out)
    # page tables are validated on the host
    pk, pv, indptr, indices, last = _paged(gen)
    with pytest.raises(kvevict.Error, match="page tables are read on the host"):
        kvevict.paged_key_norm_scores(cuda(pk), cuda(pv), cuda(indptr), indices, last, 2,
                                      out=cuda(torch.zeros(4, 10)))


def test_mixed_host_and_cuda_tensors_refused(gen):
    if not kvevict.has_cuda:
        pytest.skip("a host-only build refuses every CUDA tensor (test above)")
    with pytest.raises(kvevict.Error, match="on the host but another tensor"):
        kvevict.compact(cuda(randn(gen, 2, 10, 8)), torch.zeros(2, 3, dtype=torch.int32),
                        out=cuda(torch.zeros(2, 3, 8)))
