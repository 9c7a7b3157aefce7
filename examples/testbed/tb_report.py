"""The retrieval quality report on a testbed model (docs/testbed.md, "The retrieval report").

Every number comes from the C++ runner: for each held-out example (tb_data.eval_set of a split: the
question after or before the context, every length asked) and each configuration (recipe x driver x
budget, and the full cache), `kvevict-run --model M --prompt TEXT --ids --steps P+A-1 [--recipe R
--driver D --budget B --window W --stats]` decodes the answer's A tokens greedily after the P-token
prompt; the example is answered when those tokens equal the answer's (exact match: the key restated
and the code), and the KV footprint is the runner's `--stats` line (kvevict::measure_kv_usage of the
eviction schedule over the P + A - 1 query steps, docs/metrics.md). The runner's printed prompt ids
are checked against the generator's.

Aggregates, per (configuration, kind): exact match with its standard error (sample sd / sqrt(n)),
the code digits' accuracy, the mean footprint and peak KV, the paired difference to SnapKV post-fill
at the same budget (mean of the per-example differences, its standard error, the two-sided normal p),
and per (recipe, driver, kind) the critical footprint at F = 90 % of the full cache's exact match
(kvevict.critical_footprint, the library function the runner's --footprint protocol uses, over the
budget sweep's (mean footprint, mean exact match) points; its standard error a bootstrap over the
examples, the whole curve and the full cache's accuracy resampled together, 200 times, fixed seed).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np

import tb_data

# the default matrix (the runner's report: examples/report/report.hpp, default_matrix): every recipe
# post-fill, the cascades layer-wise, SnapKV and LAVa chunked naive and patched, the decode-time
# classics at decode time. The head-type methods (duo-heuristic, duo, prulong) are left out by
# default: duo / prulong ship masks for stories260K only and duo-heuristic recalibrates on
# model-generated texts in every kvevict-run call.
RECIPES = ("streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "knorm", "vatp", "adakv", "cake", "lava", "laq",
           "laq++", "speckv", "lookaheadkv", "oracle")
DRIVERS = ("postfill", "layerwise", "chunked-naive", "chunked-patched", "decode")
HEAD_TYPES = ("duo", "prulong")
"""recipes whose head types come from a trained mask (`--head-mask`, kvevict-headgates): their sweep is over
the sparsity (% streaming heads, the mask's top heads retrieval: `kvevict-run --head-sparsity`), not the budget;
post-fill, and chunked where the streaming heads stream during the prefill (naive = patched: nothing is scored).
A mask path with `{S}` names one mask per sparsity (PruLong's, trained at each target), S the percentage."""


def mask_path(pattern: str, sparsity: int) -> str:
    """The head mask of a head-type configuration: `pattern` with {S} replaced by the sparsity in %."""
    return pattern.replace("{S}", str(sparsity))


def default_matrix(recipe: str, driver: str) -> bool:
    if recipe in HEAD_TYPES:
        return driver in ("postfill", "chunked-naive")
    if driver == "postfill":
        return True
    if driver == "layerwise":
        return recipe in ("lava", "cake")
    if driver.startswith("chunked"):
        return recipe in ("snapkv", "lava")
    return recipe in ("streaming_llm", "h2o", "tova", "snapkv")


def configs(recipes, drivers, budgets):
    """[(recipe, driver, budget)] of the matrix, recipes in the given order; the full cache first."""
    out = [("full", "postfill", 0)]
    for r in recipes:
        for d in drivers:
            if default_matrix(r, d):
                out += [(r, d, b) for b in budgets]
    return out


def kvevict_binding():
    """`import kvevict` (the library's binding: critical_footprint); the release tree's build when
    PYTHONPATH names none."""
    try:
        import kvevict
    except ImportError:
        build = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "release", "python")
        sys.path.insert(0, os.path.normpath(build))
        try:
            import kvevict
        except ImportError as e:
            raise SystemExit(f"report: the kvevict Python package is not importable ({e}); build the target "
                             "kvevict_python or set PYTHONPATH") from None
    return kvevict


FOOTPRINT = re.compile(r"KV footprint ([0-9.eE+-]+), peak KV ([0-9.eE+-]+)")


class Example:
    """One held-out question: the prompt's text and ids, the answer's ids."""

    def __init__(self, e: tb_data.Example, index: int):
        n = e.meta["prompt_tokens"]
        self.index = index
        self.text = e.text[:e.text.rindex("Answer:") + len("Answer:")]
        self.prompt = e.ids[:n]
        self.answer = e.ids[n:n + len(e.answers)]
        self.kind, self.length, self.needles = e.meta["kind"], e.meta["length"], e.meta["needles"]
        self.depth = e.meta["depth"]


def run_one(opts, ex: Example, config):
    """One kvevict-run call: {"em": 0/1, "digits": correct code digits, "footprint", "peak"} or
    {"error": the runner's message}."""
    recipe, driver, budget = config
    P, A = len(ex.prompt), len(ex.answer)
    cmd = [opts.kvevict_run, "--model", opts.checkpoint, "--prompt", ex.text, "--ids", "--steps", str(P + A - 1),
           "--threads", str(opts.threads)]
    if recipe != "full":
        # (a head-type configuration's budget is its sparsity in %; the runner's budget then only has to cover the
        # streaming heads' 4 sinks + 12 recent tokens)
        runner_budget = 16 if recipe in HEAD_TYPES else budget
        cmd += ["--recipe", recipe, "--driver", driver, "--budget", str(runner_budget), "--window", str(opts.window),
                "--stats"]
        if recipe == "lookaheadkv":
            cmd += ["--lookahead-module", opts.lookahead_module]
        if recipe in HEAD_TYPES:
            cmd += ["--head-mask", mask_path(opts.head_mask, budget), "--head-sparsity", str(budget / 100)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit status {p.returncode}"}
    try:
        ids = [int(x) for x in p.stdout.split()]
    except ValueError:
        raise SystemExit(f"report: {opts.kvevict_run} printed no token ids for {config}: {p.stdout[:80]!r}") from None
    if ids[:P] != ex.prompt:
        raise SystemExit(f"report: example {ex.index}: kvevict-run's encoding of the prompt differs from the generator's ids")
    gen = ids[P:P + A]
    if len(gen) != A:
        raise SystemExit(f"report: example {ex.index}: kvevict-run printed {len(gen)} answer tokens, expected {A}")
    out = {"em": int(gen == ex.answer),
           "digits": sum(int(a == b) for a, b in zip(gen[-tb_data.DIGITS:], ex.answer[-tb_data.DIGITS:]))}
    if recipe == "full":
        out["footprint"], out["peak"] = 1.0, 1.0
    else:
        m = FOOTPRINT.search(p.stderr)
        if not m:
            raise SystemExit(f"report: kvevict-run --stats printed no footprint for {config}: {p.stderr.strip()[-200:]}")
        out["footprint"], out["peak"] = float(m.group(1)), float(m.group(2))
    return out


class ResultStore:
    """`report --results F`: every kvevict-run call's result as a JSON line, so that a rerun with the same
    file runs only the calls it lacks (a report cut short resumes; a run on the same examples with other
    budgets, recipes, drivers or window reuses what matches). A call is keyed by what decides its result: the checkpoint's and
    (LookaheadKV) the module's or (head types) the mask's sha256, the configuration, the window (not for the full cache) and the
    example's prompt and answer ids. Each line also names the kvevict-run binary (sha256): results made
    by another binary are used only after a sample of them, rerun with this one, gave the same results."""

    CHECKED = 8
    """how many of another binary's results are rerun before any of them is used"""

    def __init__(self, path, opts):
        self.path, self.window = path, opts.window
        self.runner, self.model = tb_data.sha256_of(opts.kvevict_run), tb_data.sha256_of(opts.checkpoint)
        self.module = tb_data.sha256_of(opts.lookahead_module) if opts.lookahead_module else ""
        self.masks = {}  # sparsity -> the sha256 of its head mask
        self.head_mask = getattr(opts, "head_mask", "")
        self.held = {}  # key -> (runner sha256, result)
        text = ""
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
        lines = text.splitlines()
        for n, line in enumerate(lines):
            try:
                row = json.loads(line)
                self.held[row["key"]] = (row["runner"], row["result"])
            except (json.JSONDecodeError, KeyError, TypeError):
                if n + 1 < len(lines) or text.endswith("\n"):  # (only the last line may be cut short by a kill)
                    raise SystemExit(f"report: --results {path}: line {n + 1} is not a result line") from None
        if text and not text.endswith("\n"):
            with open(path, "a") as f:
                f.write("\n")

    def key(self, ex, config):
        recipe, driver, budget = config
        ids = hashlib.sha256(json.dumps([ex.prompt, ex.answer]).encode()).hexdigest()
        module = self.module if recipe == "lookaheadkv" else ""
        if recipe in HEAD_TYPES:
            if budget not in self.masks:
                self.masks[budget] = tb_data.sha256_of(mask_path(self.head_mask, budget))
            module = self.masks[budget]
        return json.dumps([self.model, module, recipe, driver, budget,
                           0 if recipe == "full" or recipe in HEAD_TYPES else self.window, ids])

    def add(self, key, result):
        self.held[key] = (self.runner, result)
        with open(self.path, "a") as f:  # (one line a write: a kill loses at most the line being written)
            f.write(json.dumps({"key": key, "runner": self.runner, "result": result}) + "\n")


def config_name(recipe: str, driver: str) -> str:
    """"snapkv", "snapkv / chunked-naive": the tables' name of a curve (post-fill is the default driver)."""
    return recipe + ("" if driver == "postfill" else " / " + driver)


def rows_by_config(rows):
    """{(recipe, driver, budget, kind): row} of a report's rows."""
    return {(r["recipe"], r["driver"], r["budget"], r["kind"]): r for r in rows}


def mean_se(x):
    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0


def paired(a, b):
    """Mean of a - b per example, its standard error and the two-sided normal p (NaN when se is 0)."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    m, se = mean_se(d)
    p = math.erfc(abs(m / se) / math.sqrt(2)) if se > 0 else (1.0 if m == 0 else 0.0)
    return {"mean": m, "se": se, "p": p}


def critical(kvevict, points, full, fraction, rng, bootstrap):
    """points: [(footprints per example, exact match per example)] of one curve; full: the full cache's
    exact match per example. (result dict) from kvevict.critical_footprint on the mean curve, with a
    bootstrap standard error; None when the full cache answers nothing (no threshold exists)."""
    n = len(full)

    def at(take):
        f_full = float(np.mean(full[take]))
        if f_full <= 0:
            return None
        fs = [float(np.mean(f[take])) for f, _ in points]
        ps = [float(np.mean(e[take])) for _, e in points]
        cf, tau, kind = kvevict.critical_footprint(fs, ps, f_full, fraction)
        return cf, tau, str(kind).split(".")[-1]

    whole = at(np.arange(n))
    if whole is None:
        return None
    vals = []
    for _ in range(bootstrap if n > 1 else 0):
        r = at(rng.integers(n, size=n))
        if r is not None:
            vals.append(r[0])
    se = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
    return {"footprint": whole[0], "threshold": whole[1], "kind": whole[2], "se": se, "resamples": len(vals)}


def fmt_critical(c):
    if c is None:
        return "n/a (full cache 0)"
    f = 100 * c["footprint"]
    if c["kind"] == "at_or_below_min":
        return f"< {f:.1f}"
    if c["kind"] == "above_max":
        return f"> {f:.1f}"
    return f"{f:.1f} ± {100 * c['se']:.1f}"


def stars(p, m):
    return "**" if p < 0.05 / m else "*" if p < 0.05 else ""


def run_report(opts, examples, log=print):
    """Runs every (example, configuration) through kvevict-run on opts.jobs parallel processes.
    Returns the report dict (report.json's content)."""
    kvevict = kvevict_binding()
    cfgs = configs(opts.recipes, opts.drivers, opts.budgets)
    work = [(i, c) for c in cfgs for i in range(len(examples))]
    results = {}
    t0, done, last = time.time(), 0, 0.0
    store = ResultStore(opts.results, opts) if getattr(opts, "results", "") else None
    if store:
        keys = {w: store.key(examples[w[0]], w[1]) for w in work}
        held = [w for w in work if keys[w] in store.held]
        other = [w for w in held if store.held[keys[w]][0] != store.runner]
        for w in other[::max(1, len(other) // store.CHECKED)][:store.CHECKED]:
            now = run_one(opts, examples[w[0]], w[1])
            if now != store.held[keys[w]][1]:
                raise SystemExit(f"report: --results {opts.results}: another kvevict-run's result for example "
                                 f"{w[0]} {w[1]} is {store.held[keys[w]][1]}, this one's {now}: remove the file "
                                 "(or name another) to run the calls again")
            store.add(keys[w], now)
        for w in held:
            results[w] = store.held[keys[w]][1]
        log(f"report: {len(held)} of {len(work)} calls from --results {opts.results}"
            + (f" ({len(other)} by another kvevict-run: {min(len(other), store.CHECKED)} rerun, the same)" if other else ""))
        work = [w for w in work if w not in results]
    calls = len(work)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        futures = {pool.submit(run_one, opts, examples[i], c): (i, c) for i, c in work}
        try:
            for fut in concurrent.futures.as_completed(futures):
                results[futures[fut]] = fut.result()
                if store:
                    store.add(keys[futures[fut]], results[futures[fut]])
                done += 1
                now = time.time() - t0
                if done == len(work) or now - last >= opts.progress_every:
                    last = now
                    eta = now / done * (len(work) - done)
                    log(f"report: {done}/{len(work)} kvevict-run calls ({now:.0f} s, about {eta:.0f} s left)")
        except BaseException:  # a failed check or ^C: the queued calls are not started
            for fut in futures:
                fut.cancel()
            raise
    kinds = sorted({e.kind for e in examples}, key=("after", "before").index)
    lengths = sorted({e.length for e in examples})
    rows, skipped = [], []
    per = {}  # (config, kind) -> per-example arrays
    for c in cfgs:
        errs = {results[(i, c)]["error"] for i in range(len(examples)) if "error" in results[(i, c)]}
        if errs:
            skipped.append({"recipe": c[0], "driver": c[1], "budget": c[2], "error": sorted(errs)[0]})
            continue
        for kind in kinds:
            idx = [i for i, e in enumerate(examples) if e.kind == kind]
            rs = [results[(i, c)] for i in idx]
            em = np.array([r["em"] for r in rs], dtype=float)
            fp = np.array([r["footprint"] for r in rs], dtype=float)
            per[(c, kind)] = (fp, em)
            m, se = mean_se(em)
            row = {"recipe": c[0], "driver": c[1], "budget": c[2], "kind": kind, "n": len(idx), "exact_match": m,
                   "se": se, "code_digits": float(np.mean([r["digits"] for r in rs])) / tb_data.DIGITS,
                   "footprint": float(fp.mean()), "peak": float(np.mean([r["peak"] for r in rs])),
                   "per_length": {str(L): mean_se([r["em"] for i, r in zip(idx, rs) if examples[i].length == L])
                                  for L in lengths},
                   "per_example": {"exact_match": [int(x) for x in em], "footprint": [float(x) for x in fp]}}
            rows.append(row)
    by = rows_by_config(rows)
    for r in rows:
        ref = by.get(("snapkv", "postfill", r["budget"], r["kind"]))
        if r["recipe"] != "full" and ref is not None and ref is not r:
            r["d_snapkv"] = paired(r["per_example"]["exact_match"], ref["per_example"]["exact_match"])
    rng = np.random.Generator(np.random.PCG64(0x5EED))
    crit = []
    curves = [(rc, d) for rc in opts.recipes for d in opts.drivers if default_matrix(rc, d)]
    for rc, d in curves:
        for kind in kinds:
            pts = [per[((rc, d, b), kind)] for b in opts.budgets if ((rc, d, b), kind) in per]
            if not pts or (("full", "postfill", 0), kind) not in per:
                continue
            full = per[(("full", "postfill", 0), kind)][1]
            crit.append({"recipe": rc, "driver": d, "kind": kind,
                         "critical": critical(kvevict, pts, full, opts.fraction, rng, opts.bootstrap),
                         "footprint_range": [min(float(f.mean()) for f, _ in pts), max(float(f.mean()) for f, _ in pts)]})
    return {"what": "testbed retrieval report (examples/testbed/tb_report.py)", "model": opts.checkpoint,
            "split": opts.split, "per_cell": opts.per_cell, "lengths": lengths, "kinds": kinds,
            "budgets": list(opts.budgets), "window": opts.window, "fraction_of_full": opts.fraction,
            "head_mask": getattr(opts, "head_mask", "") if any(r in HEAD_TYPES for r in opts.recipes) else "",
            "examples": [{"kind": e.kind, "length": e.length, "needles": e.needles, "prompt_tokens": len(e.prompt),
                          "answer_tokens": len(e.answer), "depth": e.depth} for e in examples],
            "rows": rows, "critical": crit, "skipped": skipped, "seconds": time.time() - t0, "calls_run": calls}


# the seed papers' claims as (A, B, source): A keeps retrieval at least as well as B at equal budgets
PAPER_PAIRS = ((("lookaheadkv", "postfill"), ("snapkv", "postfill"), "LookaheadKV"),
               (("lookaheadkv", "postfill"), ("laq", "postfill"), "LookaheadKV"),
               (("speckv", "postfill"), ("snapkv", "postfill"), "LookaheadKV"),
               (("laq", "postfill"), ("snapkv", "postfill"), "Lookahead Q-Cache"),
               (("adakv", "postfill"), ("snapkv", "postfill"), "LAVa"),
               (("lava", "postfill"), ("adakv", "postfill"), "LAVa"),
               (("pyramidkv", "postfill"), ("snapkv", "postfill"), "Cache Me If You Can"),
               (("snapkv", "chunked-patched"), ("snapkv", "chunked-naive"), "Cache Me If You Can"),
               (("lava", "chunked-patched"), ("lava", "chunked-naive"), "Cache Me If You Can"))


def paper_pairs(rep):
    """[(A, B, source, kind, budget, paired difference of exact match)] for the PAPER_PAIRS both of whose
    rows the report holds, from the per-example results."""
    by = rows_by_config(rep["rows"])
    out = []
    for a, b, src in PAPER_PAIRS:
        for kind in rep["kinds"]:
            for budget in rep["budgets"]:
                ra, rb = by.get(a + (budget, kind)), by.get(b + (budget, kind))
                if ra is not None and rb is not None:
                    out.append((a, b, src, kind, budget,
                                paired(ra["per_example"]["exact_match"], rb["per_example"]["exact_match"])))
    return out


def sweep(rep):
    """(column label of a sweep point, the sweep's description): budgets (tokens per KV head), or for a
    head-type run (HEAD_TYPES) sparsities (% streaming heads)."""
    if rep.get("head_mask"):
        return (lambda b: f"S = {b} %"), (f"sparsities {rep['budgets']} (% streaming heads; the top heads of "
                                          f"{os.path.basename(rep['head_mask'])} retrieval heads)")
    return (lambda b: f"B = {b}"), f"budgets {rep['budgets']} (tokens per KV head)"


def markdown(rep):
    """Tables: the full cache per kind and length; per kind, exact match (± se) [paired difference to
    SnapKV post-fill] / mean footprint at every budget; the seed papers' pairs; exact match at the longest
    length (when there are several); the critical footprints."""
    col, swept = sweep(rep)
    out = [f"# Testbed retrieval report: {os.path.basename(rep['model'])}", "",
           f"{rep['split']} split, {rep['per_cell']} examples per (kind, length), lengths {rep['lengths']}, "
           f"{swept}, window {rep['window']}; exact match of the answer's "
           "tokens, greedy, with the standard error over the examples.", ""]
    full = [r for r in rep["rows"] if r["recipe"] == "full"]
    out += ["## Full cache", "", "| kind | " + " | ".join(f"{L}" for L in rep["lengths"]) + " | all | code digits |",
            "| --- |" + " ---: |" * (len(rep["lengths"]) + 2)]
    for r in full:
        cells = [f"{m:.3f} ± {s:.3f}" for m, s in (r["per_length"][str(L)] for L in rep["lengths"])]
        out.append(f"| {r['kind']} | " + " | ".join(cells) + f" | {r['exact_match']:.3f} ± {r['se']:.3f} | "
                   f"{r['code_digits']:.3f} |")
    m = sum(1 for r in rep["rows"] if "d_snapkv" in r)
    by_config = rows_by_config(rep["rows"])
    for kind in rep["kinds"]:
        out += ["", f"## Question {kind} the context: exact match (± se){' [− SnapKV post-fill]' if m else ''} / KV "
                "footprint", ""]
        if m:
            out += [f"`*` p < 0.05, `**` p < 0.05 / {m} (Bonferroni over the report's paired comparisons).", ""]
        out += ["| method / driver | " + " | ".join(col(b) for b in rep["budgets"]) + " |",
                "| --- |" + " ---: |" * len(rep["budgets"])]
        names = []
        for r in rep["rows"]:
            if r["kind"] == kind and r["recipe"] != "full" and (r["recipe"], r["driver"]) not in names:
                names.append((r["recipe"], r["driver"]))
        for rc, d in names:
            cells = []
            for b in rep["budgets"]:
                r = by_config.get((rc, d, b, kind))
                if r is None:
                    cells.append("—")
                    continue
                diff = r.get("d_snapkv")
                ds = (f" [{diff['mean']:+.3f} ± {diff['se']:.3f}{stars(diff['p'], m)}]" if diff
                      else " [ref]" if (rc, d) == ("snapkv", "postfill") else "")
                cells.append(f"{r['exact_match']:.3f} ± {r['se']:.3f}{ds} / {r['footprint']:.3f}")
            out.append(f"| {config_name(rc, d)} | " + " | ".join(cells) + " |")
    pairs = paper_pairs(rep)
    if pairs:
        out += ["", "## The seed papers' pairs: exact match of A − B, paired over the examples", "",
                f"`*` p < 0.05, `**` p < 0.05 / {len(pairs)} (Bonferroni over this table); the paper whose ranking "
                "(A at least as good as B) the row tests.", "",
                "| A − B | paper | question | " + " | ".join(col(b) for b in rep["budgets"]) + " |",
                "| --- | --- | --- |" + " ---: |" * len(rep["budgets"])]
        rows = {}
        for a, b, src, kind, budget, d in pairs:
            rows.setdefault((config_name(*a) + " − " + config_name(*b), src, kind), {})[budget] = d
        for (ab, src, kind), ds in rows.items():
            out.append(f"| {ab} | {src} | {kind} | " + " | ".join(
                f"{ds[b]['mean']:+.3f} ± {ds[b]['se']:.3f}{stars(ds[b]['p'], len(pairs))}" if b in ds else "—"
                for b in rep["budgets"]) + " |")
    if len(rep["lengths"]) > 1:  # the long contexts the methods are meant for, apart from the mean over lengths
        L = str(max(rep["lengths"]))
        out += ["", f"## Exact match at {L} tokens (± se)", "",
                "| method / driver | question | " + " | ".join(col(b) for b in rep["budgets"]) + " |",
                "| --- | --- |" + " ---: |" * len(rep["budgets"])]
        names = []
        for r in rep["rows"]:
            if r["recipe"] != "full" and (r["recipe"], r["driver"], r["kind"]) not in names:
                names.append((r["recipe"], r["driver"], r["kind"]))
        for rc, d, kind in sorted(names, key=lambda n: rep["kinds"].index(n[2])):
            cells = []
            for b in rep["budgets"]:
                r = by_config.get((rc, d, b, kind))
                cells.append("—" if r is None else "{:.3f} ± {:.3f}".format(*r["per_length"][L]))
            out.append(f"| {config_name(rc, d)} | {kind} | " + " | ".join(cells) + " |")
    out += ["", f"## Critical KV footprint at F = {rep['fraction_of_full']:.0%} of the full cache's exact match (%)", "",
            "Linear interpolation over the budget sweep (kvevict.critical_footprint); `< x`: the smallest footprint "
            "measured already meets it, `> x`: none does; ± a bootstrap standard error over the examples.", "",
            "| method / driver | " + " | ".join(f"question {k}" for k in rep["kinds"]) + " | footprint range (%) |",
            "| --- |" + " ---: |" * (len(rep["kinds"]) + 1)]
    seen = []
    for c in rep["critical"]:
        if (c["recipe"], c["driver"]) in seen:
            continue
        seen.append((c["recipe"], c["driver"]))
        cs = {x["kind"]: x for x in rep["critical"] if (x["recipe"], x["driver"]) == (c["recipe"], c["driver"])}
        lo, hi = c["footprint_range"]
        out.append(f"| {c['recipe']}{'' if c['driver'] == 'postfill' else ' / ' + c['driver']} | "
                   + " | ".join(fmt_critical(cs[k]["critical"]) if k in cs else "—" for k in rep["kinds"])
                   + f" | {100 * lo:.1f} – {100 * hi:.1f} |")
    if rep["skipped"]:
        out += ["", "## Configurations the runner refused", ""]
        out += [f"- {s['recipe']} / {s['driver']} / {col(s['budget'])}: {s['error']}" for s in rep["skipped"]]
    return "\n".join(out) + "\n"


def svg(rep):
    """Exact match against the budget and against the footprint, one panel pair per kind."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt
    kinds = rep["kinds"]
    fig, axes = plt.subplots(len(kinds), 2, figsize=(12, 4 * len(kinds)), squeeze=False)
    styles = {"postfill": "-", "layerwise": "-.", "chunked-naive": "--", "chunked-patched": ":", "decode": (0, (1, 3))}
    for ki, kind in enumerate(kinds):
        names = []
        for r in rep["rows"]:
            if r["kind"] == kind and r["recipe"] != "full" and (r["recipe"], r["driver"]) not in names:
                names.append((r["recipe"], r["driver"]))
        for j, (rc, d) in enumerate(names):
            pts = sorted((r["budget"], r["footprint"], r["exact_match"], r["se"]) for r in rep["rows"]
                         if (r["recipe"], r["driver"], r["kind"]) == (rc, d, kind))
            color = plt.cm.tab20(sorted({n[0] for n in names}).index(rc) % 20)
            label = config_name(rc, d)
            for ax, x in ((axes[ki][0], [p[0] for p in pts]), (axes[ki][1], [p[1] for p in pts])):
                ax.errorbar(x, [p[2] for p in pts], yerr=[p[3] for p in pts], ls=styles[d], color=color, marker=".",
                            lw=1, capsize=2, label=label)
        full = next((r for r in rep["rows"] if r["recipe"] == "full" and r["kind"] == kind), None)
        for ax in axes[ki]:
            if full:
                ax.axhline(full["exact_match"], color="black", lw=0.8, label="full cache")
                ax.axhline(rep["fraction_of_full"] * full["exact_match"], color="gray", lw=0.5, ls="--",
                           label=f"F = {rep['fraction_of_full']:.0%} of full")
            ax.set_ylim(-0.02, 1.02)
            ax.set_ylabel(f"exact match, question {kind}")
        if rep.get("head_mask"):
            axes[ki][0].set_xlabel("sparsity (% streaming heads)")
        else:
            axes[ki][0].set_xscale("log", base=2)
            axes[ki][0].set_xlabel("KV budget (tokens per KV head)")
        axes[ki][1].set_xlabel("KV footprint (fraction of the full cache's)")
    handles, labels = axes[0][1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"testbed retrieval report: {os.path.basename(rep['model'])}, {rep['split']} split; "
                 "colour = recipe, dash = driver, bars = standard errors")
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def write_all(out_dir, contents):
    """Writes {name: text} into out_dir, all or nothing: every file to a temporary name first, then
    each renamed into place."""
    tmps = []
    try:
        for name, text in contents.items():
            tmp = os.path.join(out_dir, f".{name}.tmp")
            with open(tmp, "w") as f:
                f.write(text)
            tmps.append((tmp, os.path.join(out_dir, name)))
    except BaseException:
        for tmp, _ in tmps:
            os.unlink(tmp)
        raise
    for tmp, dst in tmps:
        os.replace(tmp, dst)
