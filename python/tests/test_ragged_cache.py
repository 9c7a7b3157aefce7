"""Ragged caches with capacity (one buffer, per-head regions, lens): append, in-place compaction
and compaction into one, against a PyTorch model of the cache as per-head lists of rows."""
import pytest
import torch

import kvevict
from conftest import KV_DTYPES, randn


def regions(buffer, cu_cap, lens):
    """The rows each head holds, as a list of [lens[h]][d] tensors."""
    return [buffer[int(cu_cap[h]):int(cu_cap[h]) + int(lens[h])] for h in range(len(lens))]


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_append_and_compact_against_lists(gen, dtype):
    H, d, T = 3, 8, 10
    caps = [12, 7, 15]
    cu_cap = torch.tensor([0] + list(torch.tensor(caps).cumsum(0)), dtype=torch.int32)
    buffer = torch.zeros(int(cu_cap[-1]) + 2, d, dtype=dtype)  # spare rows past the regions
    lens = torch.zeros(H, dtype=torch.int32)
    ptr = buffer.data_ptr()
    # a dense prefill, per-head kept positions of different counts, compacted into the cache
    src = randn(gen, H, T, d, dtype=dtype)
    kept = [sorted(torch.randperm(T, generator=gen)[:n].tolist()) for n in (5, 3, 8)]
    pos = torch.tensor(sum(kept, []), dtype=torch.int32)
    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    kvevict.compact_into_ragged_cache(src, pos, cu, buffer, cu_cap, lens)
    model = [src[h, kept[h]].clone() for h in range(H)]
    assert lens.tolist() == [5, 3, 8] and buffer.data_ptr() == ptr
    for got, want in zip(regions(buffer, cu_cap, lens), model):
        assert torch.equal(got, want)
    # decode: append two rows per head, twice
    for _ in range(2):
        rows = randn(gen, H, 2, d, dtype=dtype)
        kvevict.append(buffer, cu_cap, lens, rows)
        model = [torch.cat([model[h], rows[h]]) for h in range(H)]
    assert lens.tolist() == [9, 7, 12]
    for got, want in zip(regions(buffer, cu_cap, lens), model):
        assert torch.equal(got, want)
    # head 1 is full (7 of 7): an append fails for every head, nothing written
    before = buffer.clone()
    with pytest.raises(kvevict.Error) as e:
        kvevict.append(buffer, cu_cap, lens, randn(gen, H, 1, d, dtype=dtype))
    assert e.value.code == "capacity_exceeded"
    assert torch.equal(buffer, before) and lens.tolist() == [9, 7, 12]
    # in-place eviction back to a budget
    keep = [sorted(torch.randperm(int(n), generator=gen)[:k].tolist()) for n, k in zip(lens, (4, 2, 6))]
    kvevict.compact_ragged_inplace(buffer, cu_cap, lens, torch.tensor(sum(keep, []), dtype=torch.int32),
                                   torch.tensor([0, 4, 6, 12], dtype=torch.int32))
    model = [model[h][keep[h]] for h in range(H)]
    assert lens.tolist() == [4, 2, 6]
    for got, want in zip(regions(buffer, cu_cap, lens), model):
        assert torch.equal(got, want)


def test_ragged_cache_errors(gen):
    buffer, cu_cap, lens = torch.zeros(10, 4), torch.tensor([0, 5, 10], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(kvevict.Error, match="cu_capacity"):
        kvevict.append(buffer, cu_cap[:2], lens, torch.zeros(2, 1, 4))
    with pytest.raises(kvevict.Error, match="rows"):
        kvevict.append(buffer[:8], cu_cap, lens, torch.zeros(2, 1, 4))
    with pytest.raises(kvevict.Error, match="one element type"):
        kvevict.append(buffer, cu_cap, lens, torch.zeros(2, 1, 4, dtype=torch.float16))
    with pytest.raises(kvevict.Error, match="int32"):
        kvevict.append(buffer, cu_cap.long(), lens, torch.zeros(2, 1, 4))
