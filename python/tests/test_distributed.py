"""The sharded calls with Python-made communicators: one process (Comm()) and P thread ranks
(thread_comms(P)); every rank must get exactly the single-process answer for its rows."""
import pytest
import torch

import kvevict
from conftest import randn, run_threads


def run_ranks(comms, fn):
    """Runs fn(rank, comm) on one thread per rank; returns the results in rank order."""
    return run_threads(len(comms), lambda r: fn(r, comms[r]))


@pytest.mark.parametrize("P", [1, 2, 4])
def test_sharded_flat_selection_is_exact(gen, P):
    R, T = 2, 23
    scores = (randn(gen, P * R, T) * 2).round() / 2  # ties across ranks go to the lower rank
    lengths = torch.randint(5, T + 1, (P * R,), generator=gen, dtype=torch.int32)
    total = int(lengths.sum()) * 2 // 3
    floors = torch.full((P * R,), 2, dtype=torch.int32)
    pos, cu = kvevict.select_topk_flat(scores, total, row_lengths=lengths, floors=floors)
    one = kvevict.select_topk_flat_sharded(kvevict.Comm(), scores, total, row_lengths=lengths, floors=floors)
    assert torch.equal(one[0], pos) and torch.equal(one[1], cu)
    comms = kvevict.thread_comms(P)
    assert [c.rank for c in comms] == list(range(P)) and all(c.size == P for c in comms)
    got = run_ranks(comms, lambda r, c: kvevict.select_topk_flat_sharded(
        c, scores[r * R:(r + 1) * R], total, row_lengths=lengths[r * R:(r + 1) * R], floors=floors[r * R:(r + 1) * R]))
    for r, (p, c) in enumerate(got):
        for i in range(R):
            row = r * R + i
            assert p[c[i]:c[i + 1]].tolist() == pos[cu[row]:cu[row + 1]].tolist()


@pytest.mark.parametrize("P", [1, 2, 3])
def test_sharded_adakv_is_exact(gen, P):
    R, T, B = 2, 20, 6
    scores = (torch.rand(P * R, T, generator=gen) * 4).round() / 4
    kvevict.protect(scores, 2, 0)  # two protected sinks per head, in place
    pos, cu = kvevict.adakv_budgets(scores, B, alpha=0.25, n_sink=2)
    got = run_ranks(kvevict.thread_comms(P), lambda r, c: kvevict.adakv_budgets_sharded(
        c, scores[r * R:(r + 1) * R], B, alpha=0.25, n_sink=2))
    for r, (p, c) in enumerate(got):
        for i in range(R):
            row = r * R + i
            assert p[c[i]:c[i + 1]].tolist() == pos[cu[row]:cu[row + 1]].tolist()
    assert sum(int(c[-1]) for _, c in got) == B * P * R


@pytest.mark.parametrize("P", [2, 3])
def test_sharded_lava_entropy_and_layer_gather(gen, P):
    R, T = 2, 16
    scores = torch.rand(P * R, T, generator=gen)
    want = kvevict.lava_layer_entropy(scores, n_sink=1, n_recent=2)
    got = run_ranks(kvevict.thread_comms(P), lambda r, c: kvevict.lava_layer_entropy_sharded(
        c, scores[r * R:(r + 1) * R], n_sink=1, n_recent=2))
    assert got == [want] * P  # bit for bit on every rank
    layers = 7
    values = [float(v) for v in torch.rand(layers, generator=gen, dtype=torch.float64)]
    cuts = [0, 3, 5, 7] if P == 3 else [0, 4, 7]
    got = run_ranks(kvevict.thread_comms(P), lambda r, c: kvevict.gather_layer_values(
        c, cuts[r], values[cuts[r]:cuts[r + 1]], layers))
    assert got == [values] * P


def test_sharded_errors_reach_every_rank(gen):
    P, R, T = 2, 2, 8
    scores = torch.rand(P * R, T, generator=gen)
    # rank 1 asks for another total: every rank returns the same error instead of waiting
    with pytest.raises(kvevict.Error, match="total|disagree|differ"):
        run_ranks(kvevict.thread_comms(P), lambda r, c: kvevict.select_topk_flat_sharded(
            c, scores[r * R:(r + 1) * R], 5 + r))
    with pytest.raises(kvevict.Error, match="size"):
        kvevict.thread_comms(0)


def test_thread_comm_timeout_is_an_error_not_a_hang(gen):
    # rank 1 never calls: rank 0 gets an Error after the group's timeout (kvevict/thread_comm.hpp)
    comms = kvevict.thread_comms(2, timeout=0.2)
    with pytest.raises(kvevict.Error, match="waited 200 ms"):
        kvevict.lava_layer_entropy_sharded(comms[0], torch.rand(2, 8, generator=gen))
    with pytest.raises(kvevict.Error):
        kvevict.thread_comms(2, timeout=0.0)


def test_thread_comm_ranks_agree_after_many_collectives(gen):
    # the slots and the barrier are reused: 50 calls in a row on 3 ranks, each exact
    P, R, T = 3, 2, 12
    comms = kvevict.thread_comms(P)
    layers = [torch.rand(P * R, T, generator=gen) for _ in range(50)]
    want = [kvevict.lava_layer_entropy(s) for s in layers]
    got = run_ranks(comms, lambda r, c: [kvevict.lava_layer_entropy_sharded(c, s[r * R:(r + 1) * R]) for s in layers])
    assert got == [want] * P


def test_head_and_layer_shards():
    assert [kvevict.head_shard(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kvevict.layer_shard(5, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    for L, P in [(7, 3), (12, 5), (4, 4)]:
        parts = [kvevict.layer_shard(L, P, r) for r in range(P)]
        assert parts[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert sum(c for _, c in parts) == L and max(c for _, c in parts) - min(c for _, c in parts) <= 1
    with pytest.raises(kvevict.Error, match="not divisible"):
        kvevict.head_shard(6, 4, 0)
    with pytest.raises(kvevict.Error, match="layer_shard"):
        kvevict.layer_shard(2, 3, 0)
