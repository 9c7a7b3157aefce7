"""The sharded calls over MPI from Python (kvevict.mpi_comm of an mpi4py communicator), run under
`mpirun -n P` (CTest python.mpi.np2): every rank must get exactly the single-process answer for
its rows, as with thread_comms (test_distributed.py). Exits non-zero on the first mismatch."""
import sys

import numpy as np
from mpi4py import MPI

import kvevict


def main():
    world = MPI.COMM_WORLD
    comm = kvevict.mpi_comm(world)
    P, r = comm.size, comm.rank
    assert (P, r) == (world.Get_size(), world.Get_rank())
    rng = np.random.default_rng(7)  # the same layer on every rank
    R, T, total = 3, 40, 37
    scores = (rng.random((P * R, T)) * 16).round().astype(np.float32) / 16  # ties
    mine = np.ascontiguousarray(scores[r * R:(r + 1) * R])
    # flattened selection: this rank's rows of the single-process answer
    pos, cu = kvevict.select_topk_flat_sharded(comm, mine, total)
    wpos, wcu = kvevict.select_topk_flat(scores, total)
    rows = [wpos[wcu[i]:wcu[i + 1]].tolist() for i in range(r * R, (r + 1) * R)]
    assert [pos[cu[i]:cu[i + 1]].tolist() for i in range(R)] == rows, "select_topk_flat_sharded"
    # AdaKV, LAVa entropy, CAKE statistics, a layer gather
    protected = kvevict.protect(scores.copy(), 1, 2)
    pos, cu = kvevict.adakv_budgets_sharded(comm, np.ascontiguousarray(protected[r * R:(r + 1) * R]), 9,
                                            n_sink=1, n_recent=2)
    wpos, wcu = kvevict.adakv_budgets(protected, 9, n_sink=1, n_recent=2)
    rows = [wpos[wcu[i]:wcu[i + 1]].tolist() for i in range(r * R, (r + 1) * R)]
    assert [pos[cu[i]:cu[i + 1]].tolist() for i in range(R)] == rows, "adakv_budgets_sharded"
    assert kvevict.lava_layer_entropy_sharded(comm, mine) == kvevict.lava_layer_entropy(scores), "lava entropy"
    att = rng.random((P * R, 4, 11)).astype(np.float32)
    att /= att.sum(-1, keepdims=True)
    assert (kvevict.cake_layer_stats_sharded(comm, np.ascontiguousarray(att[r * R:(r + 1) * R]))
            == kvevict.cake_layer_stats(att)), "cake stats"
    q, k = rng.random((P * 2, 4, 8)).astype(np.float32), rng.random((P, 19, 8)).astype(np.float32)
    assert (kvevict.cake_window_preference_sharded(comm, np.ascontiguousarray(q[2 * r:2 * r + 2]),
                                                   np.ascontiguousarray(k[r:r + 1]), tau1=1.6, tau2=0.4)
            == kvevict.cake_window_preference(q, k, tau1=1.6, tau2=0.4)), "cake window preference"
    values = [float(v) for v in rng.random(5)]
    cuts = np.linspace(0, 5, P + 1).astype(int)
    assert kvevict.gather_layer_values(comm, int(cuts[r]), values[cuts[r]:cuts[r + 1]], 5) == values, "gather"
    # an error on one rank reaches every rank (the library's agreement)
    try:
        kvevict.select_topk_flat_sharded(comm, mine, total + (1 if r == 0 else 0))
        raise AssertionError("ranks disagreeing on the total were not refused")
    except kvevict.Error:
        pass
    print(f"rank {r}/{P}: sharded calls over MPI exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
