#!/usr/bin/python3
"""SnapKV eviction of one layer with PyTorch on the CPU, the way kvpress does it, timed on the
shapes of bench/bench_evict.cpp so scripts/bench can put the two side by side.

Written for this repository (no code copied from kvpress); it follows the steps of kvpress's
SnapKVPress.score + ScorerPress.compress:

  keys repeated per query head (repeat_kv), logits = Q Kᵀ / sqrt(d) by torch.matmul, a -inf
  causal mask over the window columns, softmax in fp32 (cast back to the KV dtype), the prefix
  columns averaged over the window rows, F.avg_pool1d(kernel 5, padding 2, stride 1), the mean over
  each GQA group, the window padded with the row maximum (so it is kept), scores.topk(B), and
  keys/values gathered at those indices.

Two variants:
  torch_kvpress  exactly those steps, including kvpress's full-size mask tensor
                 (ones_like(logits) * -inf, triu) added to the whole logits block
  torch_lean     the same result with the obvious savings: the GQA group as a batch dimension
                 instead of repeated keys, and the mask applied to the w window columns only

fp16 KV: PyTorch 1.13 has no CPU fp16 matmul, pooling or topk ("addmm_impl_cpu_ not implemented
for 'Half'"), so the fp16 cases convert Q and K to fp32 inside the timing (as an engine on this
CPU would have to) and keep the scores in fp32; the gather moves the fp16 rows.

seq = torch.set_num_threads(1), par = torch.set_num_threads(<cores>). Output: a JSON file shaped
like Google Benchmark's (benchmarks[].name, real_time in us, aggregate median), with the names of
bench_evict's cases:  evict/snapkv/<variant>/<seq|par>/shape=...,hq=...,hkv=...,d=...,T=...,w=...,B=...,kv=...

kvevict_binding (with --binding-path, or when `import kvevict` works): the same eviction through the
Python binding (python/, docs/python.md): recipe_scores + recipe_select + compact on views of the
same tensors (fp16 read natively, no conversion), with kvevict.set_num_threads as the thread count.

--check-tool PATH runs the kvevict command-line tool (build/.../tools/kvevict) on the same tensors
for each runner-sized and 4K case and reports how many kept positions agree (they differ only
where two scores are within rounding of each other at the budget's edge).
"""
import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ENGINE = dict(name="engine", hq=32, hkv=8, d=128, w=32)
RUNNER = dict(name="runner", hq=8, hkv=4, d=8, w=32)
SMOKE = dict(name="smoke", hq=4, hkv=2, d=16, w=8)


def repeat_heads(x, g):
    """[1, hkv, T, d] -> [1, hkv * g, T, d], each KV head repeated for its g query heads."""
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, g, t, d).reshape(b, h * g, t, d)


def scores_kvpress(q, k, w, kernel):
    hq, hkv, T, d = q.shape[1], k.shape[1], k.shape[2], k.shape[3]
    g = hq // hkv
    if k.dtype == torch.float16:  # no CPU fp16 matmul in this PyTorch
        q, k = q.float(), k.float()
    kk = repeat_heads(k, g)
    logits = torch.matmul(q, kk.transpose(2, 3)) / math.sqrt(d)
    mask = torch.ones_like(logits) * float("-inf")
    mask = torch.triu(mask, diagonal=T - w + 1)
    logits += mask
    att = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    att = att[..., :-w]
    s = att.mean(dim=-2)
    s = F.avg_pool1d(s, kernel_size=kernel, padding=kernel // 2, stride=1)
    s = s.view(1, hkv, g, T - w).mean(2)
    return F.pad(s, (0, w), value=s.max().item())


def scores_lean(q, k, w, kernel):
    hq, hkv, T, d = q.shape[1], k.shape[1], k.shape[2], k.shape[3]
    g = hq // hkv
    if k.dtype == torch.float16:
        q, k = q.float(), k.float()
    qg = q.view(1, hkv, g * w, d)                       # the group's rows share their KV head
    logits = torch.matmul(qg, k.transpose(2, 3)).mul_(1.0 / math.sqrt(d)).view(1, hkv, g, w, T)
    causal = torch.ones(w, w, dtype=torch.bool).triu(1)
    logits[..., T - w:].masked_fill_(causal, float("-inf"))
    att = torch.softmax(logits, dim=-1)
    s = att[..., : T - w].mean(dim=-2)                  # [1, hkv, g, T - w]
    s = F.avg_pool1d(s.reshape(1, hq, T - w), kernel_size=kernel, padding=kernel // 2, stride=1)
    s = s.view(1, hkv, g, T - w).mean(2)
    return F.pad(s, (0, w), value=s.max().item())


def binding_recipe(w, kernel):
    import kvevict
    r = kvevict.Recipe.snapkv()  # kvpress's SnapKVPress settings: avg pool, the window kept
    r.window, r.n_recent, r.pool, r.kernel = w, w, "avg", kernel
    return r


def evict_binding(q, k, v, w, budget, kernel, phases):
    import kvevict
    r = binding_recipe(w, kernel)
    t0 = time.perf_counter()
    s = kvevict.recipe_scores(r, q[0], k[0])
    t1 = time.perf_counter()
    kept = kvevict.recipe_select(r, s, budget)
    t2 = time.perf_counter()
    k2, v2 = kvevict.compact(k[0], kept), kvevict.compact(v[0], kept)
    t3 = time.perf_counter()
    phases[0] += t1 - t0
    phases[1] += t2 - t1
    phases[2] += t3 - t2
    return s, k2, v2


def evict(q, k, v, w, budget, kernel, variant, phases):
    if variant == "kvevict_binding":
        return evict_binding(q, k, v, w, budget, kernel, phases)
    t0 = time.perf_counter()
    s = (scores_kvpress if variant == "torch_kvpress" else scores_lean)(q, k, w, kernel)
    t1 = time.perf_counter()
    idx = s.topk(budget, dim=-1).indices
    t2 = time.perf_counter()
    idx = idx.unsqueeze(-1).expand(-1, -1, -1, k.shape[3])
    k2 = k.gather(2, idx).contiguous()
    v2 = v.gather(2, idx).contiguous()
    t3 = time.perf_counter()
    phases[0] += t1 - t0
    phases[1] += t2 - t1
    phases[2] += t3 - t2
    return s, k2, v2


def make_tensors(shape, T, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, shape["hq"], shape["w"], shape["d"], generator=gen).to(dtype)
    k = torch.randn(1, shape["hkv"], T, shape["d"], generator=gen).to(dtype)
    v = torch.randn(1, shape["hkv"], T, shape["d"], generator=gen).to(dtype)
    return q, k, v


def bench_name(variant, backend, shape, T, budget, kv):
    return (f"evict/snapkv/{variant}/{backend}/shape={shape['name']},hq={shape['hq']},hkv={shape['hkv']},"
            f"d={shape['d']},T={T},w={shape['w']},B={budget},kv={kv}")


def time_case(q, k, v, w, budget, kernel, variant, reps, min_rep_seconds):
    phases = [0.0, 0.0, 0.0]
    with torch.inference_mode():
        evict(q, k, v, w, budget, kernel, variant, phases)  # warm-up
        start = time.perf_counter()
        evict(q, k, v, w, budget, kernel, variant, phases)
        est = time.perf_counter() - start
        iters = max(1, int(min_rep_seconds / max(est, 1e-9)))
        per_rep = []
        phases = [0.0, 0.0, 0.0]
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(iters):
                evict(q, k, v, w, budget, kernel, variant, phases)
            per_rep.append((time.perf_counter() - t) / iters)
    n = reps * iters
    return per_rep, iters, [p / n for p in phases]


def check_with_tool(tool, q, k, v, w, budget, kernel):
    """Kept positions of kvevict's tool vs torch's topk on the same fp32 tensors: overlap fraction."""
    import numpy as np

    qf, kf = q.float(), k.float()
    with torch.inference_mode():
        s = scores_kvpress(qf, kf, w, kernel)
        torch_kept = torch.sort(s.topk(budget, dim=-1).indices, dim=-1).values[0].numpy()
    with tempfile.TemporaryDirectory() as d:
        np.save(os.path.join(d, "q.npy"), qf[0].numpy().astype(np.float32))
        np.save(os.path.join(d, "k.npy"), kf[0].numpy().astype(np.float32))
        cmd = [tool, "--q", os.path.join(d, "q.npy"), "--k", os.path.join(d, "k.npy"), "--recipe", "snapkv",
               "--budget", str(budget), "--window", str(w), "--pool", "avg", "--kernel", str(kernel),
               "--kept", os.path.join(d, "kept.npy"), "--scores", os.path.join(d, "scores.npy")]
        subprocess.run(cmd, check=True, capture_output=True)
        kv_kept = np.load(os.path.join(d, "kept.npy"))
    same = sum(len(np.intersect1d(a, b)) for a, b in zip(torch_kept, kv_kept))
    return same / torch_kept.size


def check_binding(q, k, w, budget, kernel):
    """Kept positions of the binding vs torch's topk on the same tensors: overlap fraction."""
    import kvevict
    with torch.inference_mode():
        s = scores_kvpress(q.float(), k.float(), w, kernel)
        torch_kept = torch.sort(s.topk(budget, dim=-1).indices, dim=-1).values[0]
    r = binding_recipe(w, kernel)
    kept = kvevict.recipe_select(r, kvevict.recipe_scores(r, q[0], k[0]), budget)
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(torch_kept, kept))
    return same / torch_kept.numel()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-rep-seconds", type=float, default=0.3)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the par cases")
    ap.add_argument("--variants", default="torch_kvpress,torch_lean")
    ap.add_argument("--check-tool", default=None, help="path of the kvevict tool, to cross-check kept sets")
    ap.add_argument("--binding-path", default="", help="directory holding the kvevict Python package (build/release/python)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (a quick self-test)")
    a = ap.parse_args()

    kernel = 5
    if a.binding_path:
        sys.path.insert(0, a.binding_path)
    try:
        import kvevict
        if "kvevict_binding" not in a.variants:
            a.variants += ",kvevict_binding"
    except ImportError:
        kvevict = None
    if a.smoke:
        cases = [(SMOKE, 96, 16), (RUNNER, 512, 64)]
        a.reps, a.min_rep_seconds = 1, 0.0
    else:
        cases = [(ENGINE, int(T), 1024) for T in a.contexts.split(",")]
        if "32768" in a.contexts.split(","):
            cases += [(ENGINE, 32768, 128), (ENGINE, 32768, 4096)]
        cases.append((RUNNER, 512, 64))
    out = {"context": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch_version": torch.__version__,
                       "python": platform.python_version(), "host_name": platform.node(),
                       "par_threads": a.threads, "load_avg": os.getloadavg(),
                       "torch_config": torch.__config__.show()},
           "benchmarks": []}
    failed = False
    for shape, T, budget in cases:
        for kvname, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
            q, k, v = make_tensors(shape, T, dtype, seed=T + budget)
            if a.check_tool and T <= 4096:
                agree = check_with_tool(a.check_tool, q, k, v, shape["w"], budget, kernel)
                print(f"check vs kvevict tool: {shape['name']} T={T} B={budget} {kvname}: "
                      f"{agree * 100:.3f}% of the kept positions agree", flush=True)
                out["benchmarks"].append({"name": bench_name("tool_check", "seq", shape, T, budget, kvname),
                                          "kept_agreement": agree})
                if a.smoke and agree < 0.99:  # the CTest smoke run fails when the two disagree
                    print("FAILED: kvevict's tool and the PyTorch path keep different positions", flush=True)
                    failed = True
            if kvevict is not None:
                agree = check_binding(q, k, shape["w"], budget, kernel)
                print(f"check vs kvevict binding: {shape['name']} T={T} B={budget} {kvname}: "
                      f"{agree * 100:.3f}% of the kept positions agree", flush=True)
                if a.smoke and agree < 0.99:
                    print("FAILED: kvevict's binding and the PyTorch path keep different positions", flush=True)
                    failed = True
            for backend, threads in (("seq", 1), ("par", a.threads)):
                torch.set_num_threads(threads)
                if kvevict is not None:
                    kvevict.set_num_threads(threads)
                for variant in a.variants.split(","):
                    per_rep, iters, ph = time_case(q, k, v, shape["w"], budget, kernel, variant, a.reps,
                                                   a.min_rep_seconds)
                    med = statistics.median(per_rep)
                    cv = statistics.pstdev(per_rep) / statistics.mean(per_rep) if len(per_rep) > 1 else 0.0
                    name = bench_name(variant, backend, shape, T, budget, kvname)
                    out["benchmarks"].append({
                        "name": name + "_median", "run_name": name, "run_type": "aggregate",
                        "aggregate_name": "median", "iterations": iters, "repetitions": a.reps,
                        "real_time": med * 1e6, "cpu_time": med * 1e6, "time_unit": "us", "cv": cv,
                        "score_us": ph[0] * 1e6, "select_us": ph[1] * 1e6, "compact_us": ph[2] * 1e6,
                        "threads": threads,
                        "note": "fp16: Q and K converted to fp32 inside the timing (no CPU fp16 matmul)"
                                if kvname == "fp16" else ""})
                    print(f"{name:100s} {med * 1e3:10.3f} ms  cv {cv * 100:4.1f}%  "
                          f"(score {ph[0] * 1e3:.2f} / topk {ph[1] * 1e3:.2f} / gather {ph[2] * 1e3:.2f} ms)",
                          flush=True)
            del q, k, v
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
