"""Zero-copy tensors in and out (PyTorch, NumPy, DLPack), layouts, and the errors for bad input."""

import numpy as np
import pytest
import torch

import kvevict
from conftest import KV_DTYPES, close, randn, ref_window, run_threads, topk_sorted


def test_out_tensors_are_written_in_place(gen):
    q, k = randn(gen, 4, 8, 16), randn(gen, 2, 64, 16)
    out = torch.empty(4, 64)
    res = kvevict.window_scores(q, k, out=out)
    assert res is out and res.data_ptr() == out.data_ptr()
    close(out, ref_window(q, k), rtol=1e-4)
    kept = torch.empty(2, 5, 10, dtype=torch.int32)[:, 3]  # a strided row of a bigger buffer
    assert kvevict.select_topk(randn(gen, 2, 64), 10, out=kept).data_ptr() == kept.data_ptr()
    # a sub-view of a bigger scores buffer: only the view is written
    big = torch.zeros(3, 4, 64)
    kvevict.window_scores(q, k, out=big[1])
    assert torch.equal(big[0], torch.zeros(4, 64)) and torch.equal(big[1], out)


def test_in_place_stages_keep_the_callers_memory(gen):
    s = randn(gen, 2, 20)
    ptr = s.data_ptr()
    assert kvevict.protect(s, 1, 1).data_ptr() == ptr
    cache = randn(gen, 2, 20, 4)
    ptr = cache.data_ptr()
    kvevict.compact_inplace(cache, topk_sorted(randn(gen, 2, 20), 5))
    assert cache.data_ptr() == ptr


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_token_major_and_padded_layouts_are_viewed_not_copied(gen, dtype):
    k = randn(gen, 2, 64, 16, dtype=dtype)
    q = randn(gen, 4, 8, 16, dtype=dtype)
    ref = kvevict.window_scores(q, k)
    token_major = k.transpose(0, 1).contiguous().transpose(0, 1)  # memory [T][H][d]
    assert not token_major.is_contiguous()
    assert torch.equal(kvevict.window_scores(q, token_major), ref)
    padded = torch.zeros(2, 80, 24, dtype=dtype)
    padded[:, :64, :16] = k
    assert torch.equal(kvevict.window_scores(q, padded[:, :64, :16]), ref)
    # a batched [B, H, T, d] cache: each batch element is a view
    cache = torch.stack([k, k])
    assert torch.equal(kvevict.window_scores(q, cache[1]), ref)
    # compact writes through a view into the caller's output
    kept = topk_sorted(randn(gen, 2, 64), 16)
    out = torch.empty(2, 2, 16, 16, dtype=dtype)
    assert kvevict.compact(token_major, kept, out=out[1]).data_ptr() == out[1].data_ptr()
    assert torch.equal(out[1], torch.gather(k, 1, kept.long()[..., None].expand(-1, -1, 16)))


def test_numpy_in_numpy_out(gen):
    q = randn(gen, 4, 8, 16).numpy()
    k = randn(gen, 2, 64, 16).numpy()
    s = kvevict.window_scores(q, k)
    assert isinstance(s, np.ndarray) and s.dtype == np.float32
    close(torch.from_numpy(s), ref_window(torch.from_numpy(q), torch.from_numpy(k)), rtol=1e-4)
    out = np.empty((4, 64), np.float32)
    assert kvevict.window_scores(q, k, out=out) is out
    # fp16 through the buffer protocol
    s16 = kvevict.window_scores(q.astype(np.float16), k.astype(np.float16))
    close(torch.from_numpy(s16), ref_window(torch.from_numpy(q).half(), torch.from_numpy(k).half()), rtol=1e-4)
    kept = kvevict.select_topk(kvevict.gqa_reduce(s, 2), 8)
    assert isinstance(kept, np.ndarray) and kept.dtype == np.int32
    rows = kvevict.compact(k, kept)
    assert isinstance(rows, np.ndarray) and np.array_equal(rows, np.take_along_axis(k, kept[..., None], axis=1))
    out = np.empty((2, 8, 16), np.float32)
    assert kvevict.compact(k, kept, out=out) is out


class DLPackOnly:
    """An object that offers nothing but __dlpack__ (as JAX or CuPy arrays do)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_dlpack_inputs_and_outputs_are_zero_copy(gen, dtype):
    q, k = randn(gen, 4, 8, 16, dtype=dtype), randn(gen, 2, 64, 16, dtype=dtype)
    ref = kvevict.window_scores(q, k)
    out = torch.empty(4, 64)
    kvevict.window_scores(DLPackOnly(q), DLPackOnly(k.transpose(0, 1).contiguous().transpose(0, 1)),
                          out=DLPackOnly(out))
    assert torch.equal(out, ref)  # the library wrote into out's memory through DLPack


def test_wrong_dtype_rank_device_layout_shape_are_refused(gen):
    q, k = randn(gen, 4, 8, 16), randn(gen, 2, 64, 16)
    with pytest.raises(kvevict.Error, match="keys has element type float64") as e:
        kvevict.window_scores(q, k.double())
    assert e.value.code == "invalid_argument" and isinstance(e.value, ValueError)
    with pytest.raises(kvevict.Error, match="one element type per call"):
        kvevict.window_scores(q, k.half())
    with pytest.raises(kvevict.Error, match="must have rank 3, got rank 2"):
        kvevict.window_scores(q, k[0])
    with pytest.raises(kvevict.Error, match="device 'meta'"):
        kvevict.window_scores(q, torch.empty(2, 64, 16, device="meta"))
    with pytest.raises(kvevict.Error, match="stride 0 must be positive") as e:
        kvevict.window_scores(q, k[:1].expand(2, 64, 16))  # a broadcast view aliases its heads
    with pytest.raises(kvevict.Error, match="must be positive"):
        kvevict.window_scores(q.numpy(), k.numpy()[:, ::-1])  # negative strides
    with pytest.raises(kvevict.Error, match="not a multiple") as e:
        kvevict.window_scores(randn(gen, 3, 8, 16), k)
    assert e.value.code == "shape_mismatch"
    with pytest.raises(kvevict.Error, match=r"out is \[4, 63\] but must be \[4, 64\]"):
        kvevict.window_scores(q, k, out=torch.empty(4, 63))
    with pytest.raises(kvevict.Error, match="out has element type float16"):
        kvevict.window_scores(q, k, out=torch.empty(4, 64, dtype=torch.float16))
    with pytest.raises(kvevict.Error, match="expected a torch.Tensor"):
        kvevict.window_scores(q, [[1.0]])
    with pytest.raises(kvevict.Error, match="not writable"):
        ro = np.empty((4, 64), np.float32)
        ro.flags.writeable = False
        kvevict.window_scores(q.numpy(), k.numpy(), out=ro)
    # enum names convert implicitly; an unknown name is refused by the conversion (TypeError listing the
    # signature) and by the enum's own constructor with the known names
    with pytest.raises(TypeError, match="incompatible function arguments"):
        kvevict.gqa_reduce(randn(gen, 4, 10), 2, "median")
    with pytest.raises(kvevict.Error, match=r"unknown GqaOp 'median' \(mean, max, sum\)"):
        kvevict.GqaOp("median")
    with pytest.raises(kvevict.Error, match="select_topk: row 0 keeps 70 tokens|larger than|length"):
        kvevict.select_topk(randn(gen, 2, 64), 70)


def test_errors_leave_outputs_untouched(gen):
    q, k = randn(gen, 4, 8, 16), randn(gen, 2, 64, 16)
    kept = torch.full((2, 5), -7, dtype=torch.int32)
    with pytest.raises(kvevict.Error):
        kvevict.compact(k, torch.full((2, 5), 99, dtype=torch.int32), out=torch.zeros(2, 5, 16))
    out = torch.full((2, 5, 16), 3.0)
    with pytest.raises(kvevict.Error, match="outside"):
        kvevict.compact(k, torch.full((2, 5), 64, dtype=torch.int32), out=out)
    assert torch.equal(out, torch.full((2, 5, 16), 3.0)) and kept.eq(-7).all()


def test_several_threads_at_once(gen):
    """The GIL is released during the work: threads overlap and each gets its own right answer."""
    inputs = [(randn(gen, 8, 32, 32), randn(gen, 2, 2048, 32)) for _ in range(4)]
    expected = [kvevict.window_scores(q, k) for q, k in inputs]

    def work(i):
        q, k = inputs[i]
        for _ in range(5):
            s = kvevict.window_scores(q, k)
            kept = kvevict.select_topk(s, 100)
            rows = kvevict.compact(k, kvevict.select_topk(kvevict.gqa_reduce(s, 2), 100))
            assert rows.shape == (2, 100, 32)
        return s, kept

    results = run_threads(len(inputs), work)
    for (s, kept), ref in zip(results, expected):
        assert torch.equal(s, ref)
        assert torch.equal(kept, kvevict.select_topk(ref, 100))
