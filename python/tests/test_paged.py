"""Paged KV caches (page pools + CSR block tables) and batched selection, against a PyTorch
reference that gathers each (sequence, KV head) row into a dense tensor."""
import pytest
import torch

import kvevict
from conftest import randn


def make_paged(gen, S, H, d, ps, lengths, layout="nhd", lists="per_sequence", dtype=torch.float32, spare=3):
    """Random pools and a table whose lists own distinct, shuffled pages."""
    n_lists = S if lists == "per_sequence" else S * H
    pool_heads = H if lists == "per_sequence" else 1
    lens = lengths if lists == "per_sequence" else [lengths[r // H] for r in range(n_lists)]
    need = [(n + ps - 1) // ps for n in lens]
    P = sum(need) + spare
    perm = torch.randperm(P, generator=gen).to(torch.int32)
    indptr = torch.zeros(n_lists + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(need, dtype=torch.int32).cumsum(0)
    indices = perm[: int(indptr[-1])].clone()
    last = torch.tensor([0 if n == 0 else n - (p - 1) * ps for n, p in zip(lens, need)], dtype=torch.int32)
    shape = (P, ps, pool_heads, d) if layout == "nhd" else (P, pool_heads, ps, d)
    k, v = randn(gen, *shape, dtype=dtype), randn(gen, *shape, dtype=dtype)
    return k, v, indptr, indices, last


def gather(pool, indptr, indices, last, ps, row, H, layout="nhd", lists="per_sequence"):
    """Row r = (s, h) as a dense [n][d] tensor: token j of its list is in page
    indices[indptr[list] + j // ps], slot j % ps."""
    lst, head = (row // H, row % H) if lists == "per_sequence" else (row, 0)
    pages = indices[indptr[lst]:indptr[lst + 1]].long()
    if len(pages) == 0:
        return pool.new_zeros(0, pool.shape[-1])
    blocks = pool[pages][:, :, head] if layout == "nhd" else pool[pages][:, head]
    n = (len(pages) - 1) * ps + int(last[lst])
    return blocks.reshape(-1, pool.shape[-1])[:n]


def row_lengths(indptr, last, ps, H, lists="per_sequence"):
    n = [(int(indptr[i + 1] - indptr[i]) - 1) * ps + int(last[i]) if indptr[i + 1] > indptr[i] else 0
         for i in range(len(last))]
    return [n[r // H] for r in range(len(n) * H)] if lists == "per_sequence" else n


def ref_topk(scores, k):
    order = sorted(range(len(scores)), key=lambda j: (-float(scores[j]), j))[:k]
    return sorted(order)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("lists", ["per_sequence", "per_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_knorm_select_compact(gen, layout, lists, dtype):
    S, H, d, ps = 3, 2, 8, 4
    lengths = [13, 0, 7]
    k, v, indptr, indices, last = make_paged(gen, S, H, d, ps, lengths, layout, lists, dtype)
    kp, vp = k.data_ptr(), v.data_ptr()
    scores = kvevict.paged_key_norm_scores(k, v, indptr, indices, last, H, lists=lists, layout=layout)
    lens = row_lengths(indptr, last, ps, H, lists)
    assert scores.shape == (S * H, max(lens))
    for r in range(S * H):
        dense = gather(k, indptr, indices, last, ps, r, H, layout, lists)
        if lens[r]:
            # the same bits as the dense Knorm stage on the gathered row
            want = kvevict.key_norm_scores(dense.unsqueeze(0).contiguous())[0]
            assert torch.equal(scores[r, : lens[r]], want)
            torch.testing.assert_close(want.double(), -dense.double().norm(dim=1), rtol=1e-5, atol=1e-5)
    # ties: quantise the scores
    scores = (scores * 2).round() / 2
    budgets = torch.tensor([5, 3, 9], dtype=torch.int32)
    pos, cu = kvevict.select_topk_batch(scores, budgets, kv_heads=H, row_lengths=torch.tensor(lens, dtype=torch.int32))
    for r in range(S * H):
        want = ref_topk(scores[r, : lens[r]], min(int(budgets[r // H]), lens[r]))
        assert pos[cu[r]:cu[r + 1]].tolist() == want
    before = [(gather(k, indptr, indices, last, ps, r, H, layout, lists).clone(),
               gather(v, indptr, indices, last, ps, r, H, layout, lists).clone()) for r in range(S * H)]
    old_indptr, old_indices = indptr.clone(), indices.clone()
    new_len, freed = kvevict.compact_paged(k, v, indptr, indices, last, H, (pos, cu), lists=lists, layout=layout)
    assert k.data_ptr() == kp and v.data_ptr() == vp  # in place
    n_lists = len(last)
    kept_n = [int(cu[l * (H if lists == "per_sequence" else 1) + 1] - cu[l * (H if lists == "per_sequence" else 1)])
              for l in range(n_lists)]
    assert new_len.tolist() == kept_n
    want_freed = []
    for l in range(n_lists):
        want_freed += old_indices[old_indptr[l] + (kept_n[l] + ps - 1) // ps: old_indptr[l + 1]].tolist()
    assert freed.tolist() == want_freed
    kvevict.shrink_page_table(indptr, indices, last, ps, new_len)
    assert int(indptr[-1]) == int(old_indptr[-1]) - len(want_freed)
    for r in range(S * H):
        sel = pos[cu[r]:cu[r + 1]].long()
        assert torch.equal(gather(k, indptr, indices, last, ps, r, H, layout, lists), before[r][0][sel])
        assert torch.equal(gather(v, indptr, indices, last, ps, r, H, layout, lists), before[r][1][sel])


def test_select_topk_batch_flattened_and_varlen(gen):
    S, H = 2, 3
    lens = [6, 9]
    T = max(lens)
    scores = (randn(gen, S * H, T) * 2).round() / 2
    budgets = torch.tensor([2, 4], dtype=torch.int32)
    rl = torch.tensor([lens[r // H] for r in range(S * H)], dtype=torch.int32)
    pos, cu = kvevict.select_topk_batch(scores, budgets, kv_heads=H, kind="flattened", row_lengths=rl)
    for s in range(S):
        cand = [(-float(scores[s * H + h, j]), h, j) for h in range(H) for j in range(lens[s])]
        keep = sorted(cand)[: min(int(budgets[s]) * H, len(cand))]
        for h in range(H):
            r = s * H + h
            assert pos[cu[r]:cu[r + 1]].tolist() == sorted(j for _, hh, j in keep if hh == h)
    # varlen [H][total]: sequence s is columns cu_seqlens[s] .. cu_seqlens[s+1]; same answer as padded
    varlen = torch.cat([scores[s * H:(s + 1) * H, : lens[s]] for s in range(S)], 1)
    cs = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
    pos2, cu2 = kvevict.select_topk_batch(varlen, budgets, kind="flattened", cu_seqlens=cs)
    assert torch.equal(pos2, pos) and torch.equal(cu2, cu)


def test_paged_and_batch_outputs_in_place(gen):
    # out= for the calls that make ragged outputs: the caller's tensors, the same answer
    S, H, d, ps = 2, 2, 4, 4
    k, v, indptr, indices, last = make_paged(gen, S, H, d, ps, [9, 6])
    scores = kvevict.paged_key_norm_scores(k, v, indptr, indices, last, H)
    rl = torch.tensor(row_lengths(indptr, last, ps, H), dtype=torch.int32)
    budgets = torch.tensor([3, 5], dtype=torch.int32)
    pos, cu = kvevict.select_topk_batch(scores, budgets, kv_heads=H, row_lengths=rl)
    out = (torch.zeros(scores.numel(), dtype=torch.int32), torch.zeros(S * H + 1, dtype=torch.int32))
    got = kvevict.select_topk_batch(scores, budgets, kv_heads=H, row_lengths=rl, out=out)
    assert got[0].data_ptr() == out[0].data_ptr() and got[1].data_ptr() == out[1].data_ptr()
    assert torch.equal(got[0], pos) and torch.equal(got[1], cu)
    k2, v2 = k.clone(), v.clone()
    lengths, freed = kvevict.compact_paged(k, v, indptr, indices, last, H, (pos, cu))
    out = (torch.full((S,), -1, dtype=torch.int32), torch.full((int(indptr[-1]),), -1, dtype=torch.int32))
    got = kvevict.compact_paged(k2, v2, indptr, indices, last, H, (pos, cu), out=out)
    assert got[0].data_ptr() == out[0].data_ptr() and got[1].data_ptr() == out[1].data_ptr()
    assert torch.equal(got[0], lengths) and torch.equal(got[1], freed)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    with pytest.raises(kvevict.Error, match="lengths"):
        kvevict.compact_paged(k2, v2, indptr, indices, last, H, (pos, cu), out=(out[0][:1], out[1]))


def test_paged_errors(gen):
    k, v, indptr, indices, last = make_paged(gen, 2, 2, 4, 4, [5, 6])
    dup = indices.clone()
    dup[-1] = dup[0]  # a page listed twice
    with pytest.raises(kvevict.Error, match="shared by lists"):
        kvevict.paged_key_norm_scores(k, v, indptr, dup, last, 2)
    with pytest.raises(kvevict.Error, match="last_page_len"):
        kvevict.paged_key_norm_scores(k, v, indptr, indices, last[:1], 2)
    with pytest.raises(kvevict.Error, match="int32"):
        kvevict.paged_key_norm_scores(k, v, indptr.long(), indices, last, 2)
    with pytest.raises(kvevict.Error, match="budgets"):
        kvevict.select_topk_batch(torch.zeros(4, 5), torch.tensor([1], dtype=torch.int32), kv_heads=2)
