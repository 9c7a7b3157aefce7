#!/usr/bin/env python3
"""Turns the raw results of scripts/bench into docs/performance/ and the generated section of
docs/PERFORMANCE.md.

Input (--raw): bench_<stage>.json (Google Benchmark JSON, aggregates), torch_snapkv.json (the same
shape, from bench/torch_snapkv.py), machine.txt and load.log written by scripts/bench.
Output (--out): results.csv (one row per measured case: median and min of the repetitions),
summary.json (every target of issue 8 with its ratio and whether it is met), and SVG plots; the text
between the GENERATED markers of --doc is replaced by the tables.

Benchmark names are <stage>/<op>/<impl>/<backend>/<params> (bench/harness.hpp); a kvevict
measurement is paired with the baselines of the same stage, op and params measured in the same run.
Every ratio is computed from medians (the min of the repetitions is given next to it: on a shared
machine interference only adds time). Only the standard library is used.
"""
import argparse
import csv
import glob
import json
import math
import os
import re

BEGIN = "<!-- BEGIN GENERATED (bench/report.py) -->"
END = "<!-- END GENERATED -->"


def load(raw):
    rows = {}
    for path in sorted(glob.glob(os.path.join(raw, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError as e:  # a binary still running (or killed) leaves a truncated file
            print(f"bench/report.py: skipping {path}: {e}")
            continue
        for b in data.get("benchmarks", []):
            if b.get("run_type") != "aggregate" or b.get("error_occurred"):
                continue
            agg = b.get("aggregate_name")
            if agg not in ("median", "min", "cv"):
                continue
            parts = b["run_name"].split("/")
            if len(parts) < 5:
                continue
            key = tuple(parts[:5])  # stage, op, impl, backend, params
            r = rows.setdefault(key, {"source": os.path.basename(path)})
            if agg == "cv":
                r["cv"] = b["real_time"] if b.get("aggregate_unit") == "percentage" else b.get("cv", 0.0)
                continue
            unit = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b.get("time_unit", "us")]
            r[agg] = b["real_time"] * unit
            if agg == "median":
                for c in ("score_us", "alloc_us", "select_us", "compact_us", "bytes_per_second", "cv", "threads",
                          "per_chunk_us", "chunks", "add_layer_us", "decide_us"):
                    if c in b:
                        r[c] = b[c]
    for r in rows.values():
        r.setdefault("min", r.get("median"))
    return {k: v for k, v in rows.items() if "median" in v}


def params_of(p):
    return dict(kv.split("=", 1) for kv in p.split(",") if "=" in kv)


def fmt_us(us):
    if us is None:
        return "–"
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def fmt_ratio(x):
    return "–" if x is None else (f"{x:.2f}×" if x < 100 else f"{x:.0f}×")


def get(rows, stage, op, impl, backend, params):
    return rows.get((stage, op, impl, backend, params))


# ------------------------------------------------------------------------------------------------
# targets

def targets(rows):
    out = []

    def add(target, case, kv, base, ratio_med, ratio_min, goal, met, note=""):
        out.append({"target": target, "case": case, "kvevict_us": kv, "baseline_us": base, "ratio": ratio_med,
                    "ratio_min": ratio_min, "goal": goal, "met": met, "note": note})

    # selection: >= 2x faster than nth_element + sort
    for p in sorted({k[4] for k in rows if k[:2] == ("select", "dense")}):
        pp = params_of(p)
        if (pp.get("rows"), pp.get("T"), pp.get("k")) not in (("8", "32768", "2048"), ("32", "131072", "4096")):
            continue
        for be in ("seq", "par"):
            a, b = get(rows, "select", "dense", "kvevict", be, p), get(rows, "select", "dense", "nth_element_sort", be, p)
            if a and b:
                r, rm = b["median"] / a["median"], b["min"] / a["min"]
                add("selection ≥ 2× faster than nth_element + sort", f"{be} {p}", a["median"], b["median"], r, rm,
                    "≥ 2", r >= 2)
    # window scores at 32K: <= 1.5x sgemm Q.K^T, >= 5x faster than naive
    for p in sorted({k[4] for k in rows if k[:2] == ("score", "window")}):
        if params_of(p).get("T") != "32768":
            continue
        for impl in ("kvevict", "kvevict_fma"):
            for be in ("seq", "par"):
                a, b = get(rows, "score", "window", impl, be, p), get(rows, "score", "window", "sgemm_qk", be, p)
                if a and b:
                    r, rm = a["median"] / b["median"], a["min"] / b["min"]
                    add("window scores ≤ 1.5× sgemm Q·Kᵀ", f"{impl} {be} {p}", a["median"], b["median"], r, rm,
                        "≤ 1.5", r <= 1.5)
        a, b = get(rows, "score", "window", "kvevict", "seq", p), get(rows, "score", "window", "naive", "seq", p)
        if a and b:
            r, rm = b["median"] / a["median"], b["min"] / a["min"]
            add("window scores ≥ 5× faster than naive", f"kvevict seq {p}", a["median"], b["median"], r, rm, "≥ 5",
                r >= 5)
    # compaction: >= 70% of memcpy bandwidth (memcpy of the same traffic)
    for k, a in sorted(rows.items()):
        if k[0] != "compact" or k[2] != "kvevict" or params_of(k[4]).get("shape") != "engine":
            continue  # the runner's and smoke shapes move a few KiB: call overhead, not bandwidth
        b = get(rows, "compact", k[1], "memcpy", k[3], k[4])
        if b:
            r, rm = b["median"] / a["median"], b["min"] / a["min"]
            add("compaction ≥ 70% of memcpy bandwidth", f"{k[1]} {k[3]} {k[4]}", a["median"], b["median"], r, rm,
                "≥ 0.70", r >= 0.70)
    # whole SnapKV eviction of a layer: faster than PyTorch
    for k, a in sorted(rows.items()):
        if k[:3] != ("evict", "snapkv", "kvevict"):
            continue
        for impl in ("torch_kvpress", "torch_lean", "blas_nth"):
            b = get(rows, "evict", "snapkv", impl, k[3], k[4])
            if b:
                r, rm = b["median"] / a["median"], b["min"] / a["min"]
                goal = "> 1" if impl.startswith("torch") else "(reported)"
                add(f"SnapKV eviction of a layer faster than {impl}", f"{k[3]} {k[4]}", a["median"], b["median"], r,
                    rm, goal, r > 1 if impl.startswith("torch") else None)
    return out


def driver_rows(rows):
    """bench_driver: the chunked patched driver against naive chunking and post-fill eviction of the same
    prompt at the same budget (per case and backend), and its par speed-up."""
    out = []
    for k, a in sorted(rows.items()):
        if k[0] != "driver" or k[2] != "kvevict":
            continue
        naive = get(rows, "driver", k[1], "kvevict_naive", k[3], k[4])
        post = get(rows, "driver", k[1], "kvevict_post_fill", k[3], k[4])
        par = get(rows, "driver", k[1], "kvevict", "par", k[4]) if k[3] == "seq" else None
        out.append({"alloc": k[1], "backend": k[3], "params": k[4], "patched_us": a["median"],
                    "patched_min_us": a["min"], "per_chunk_us": a.get("per_chunk_us"), "chunks": a.get("chunks"),
                    "naive_us": naive["median"] if naive else None, "post_fill_us": post["median"] if post else None,
                    "vs_post_fill": a["median"] / post["median"] if post else None,
                    "vs_post_fill_min": a["min"] / post["min"] if post else None,
                    "seq_over_par": a["median"] / par["median"] if par else None})
    return out


def scaling(rows):
    """seq / par time of every kvevict case (par runs on every OpenMP thread)."""
    out = []
    for k, a in sorted(rows.items()):
        if not k[2].startswith("kvevict") or k[3] != "seq":
            continue
        b = rows.get((k[0], k[1], k[2], "par", k[4]))
        if b:
            out.append({"stage": k[0], "op": k[1], "impl": k[2], "params": k[4], "seq_us": a["median"],
                        "par_us": b["median"], "speedup": a["median"] / b["median"]})
    return out


# ------------------------------------------------------------------------------------------------
# SVG (log-log line plot, no dependencies)

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]


def svg_plot(path, title, xlabel, ylabel, series):
    """series: [(label, [(x, y_us), ...])], log-log."""
    series = [(l, sorted(p)) for l, p in series if p]
    if not series:
        return False
    W, H, L, R, T, B = 720, 440, 80, 220, 40, 60
    xs = [x for _, p in series for x, _ in p]
    ys = [y for _, p in series for _, y in p]
    lx0, lx1 = math.log10(min(xs)), math.log10(max(xs))
    ly0, ly1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    if lx1 == lx0:
        lx0, lx1 = lx0 - 0.5, lx1 + 0.5
    if ly1 == ly0:
        ly1 += 1
    pad = (lx1 - lx0) * 0.05
    lx0, lx1 = lx0 - pad, lx1 + pad

    def X(x):
        return L + (math.log10(x) - lx0) / (lx1 - lx0) * (W - L - R)

    def Y(y):
        return H - B - (math.log10(y) - ly0) / (ly1 - ly0) * (H - T - B)

    e = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{(W - R + L) / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    for d in range(ly0, ly1 + 1):
        y = Y(10 ** d)
        e.append(f'<line x1="{L}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" stroke="#ddd"/>')
        e.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_us(10 ** d)}</text>')
    for x in sorted(set(xs)):
        e.append(f'<line x1="{X(x):.1f}" y1="{T}" x2="{X(x):.1f}" y2="{H - B}" stroke="#eee"/>')
        lab = f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x)
        e.append(f'<text x="{X(x):.1f}" y="{H - B + 16}" text-anchor="middle">{lab}</text>')
    e.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#333"/>')
    e.append(f'<text x="{(W - R + L) / 2}" y="{H - 18}" text-anchor="middle">{xlabel}</text>')
    e.append(f'<text x="18" y="{(H - B + T) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 18 {(H - B + T) / 2})">{ylabel}</text>')
    for i, (label, pts) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        dash = ' stroke-dasharray="6 4"' if not label.startswith("kvevict") else ""
        e.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="'
                 + " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts) + '"/>')
        for x, y in pts:
            e.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{c}"/>')
        ly = T + 16 + 18 * i
        e.append(f'<line x1="{W - R + 12}" y1="{ly - 4}" x2="{W - R + 36}" y2="{ly - 4}" stroke="{c}" '
                 f'stroke-width="2"{dash}/>')
        e.append(f'<text x="{W - R + 42}" y="{ly}">{label}</text>')
    e.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(e) + "\n")
    return True


def plots(rows, out):
    made = []
    # window scores vs context (engine shape, fp16 KV)
    series = []
    for impl, be in (("kvevict", "seq"), ("kvevict", "par"), ("sgemm_qk", "seq"), ("sgemm_softmax", "seq"),
                     ("naive", "seq")):
        pts = []
        for k, r in rows.items():
            if k[:4] == ("score", "window", impl, be):
                pp = params_of(k[4])
                if pp.get("shape") == "engine" and pp.get("kv") == "fp16":
                    pts.append((int(pp["T"]), r["median"]))
        series.append((f"{impl} {be}", pts))
    if svg_plot(os.path.join(out, "score_vs_context.svg"), "Window scores (32 q heads, 8 KV heads, d 128, w 32, fp16)",
                "context T (tokens)", "time per layer (median)", series):
        made.append("score_vs_context.svg")
    # selection vs row length (8 rows, k = 1024, attention-like scores)
    series = []
    for impl, be in (("kvevict", "seq"), ("nth_element_sort", "seq"), ("partial_sort", "seq"), ("kvevict", "par"),
                     ("nth_element_sort", "par")):
        pts = []
        for k, r in rows.items():
            if k[:4] == ("select", "dense", impl, be):
                pp = params_of(k[4])
                if (pp.get("rows"), pp.get("k"), pp.get("scores")) == ("8", "1024", "attn"):
                    pts.append((int(pp["T"]), r["median"]))
        series.append((f"{impl} {be}", pts))
    if svg_plot(os.path.join(out, "select_vs_length.svg"), "Top-k selection (8 rows, k 1024, attention-like scores)",
                "row length T", "time (median)", series):
        made.append("select_vs_length.svg")
    # SnapKV eviction of a layer vs context (B = 1024)
    series = []
    for impl in ("kvevict", "blas_nth", "torch_lean", "torch_kvpress"):
        pts = []
        for k, r in rows.items():
            if k[:4] == ("evict", "snapkv", impl, "seq"):
                pp = params_of(k[4])
                if pp.get("shape") == "engine" and pp.get("kv") == "fp16" and pp.get("B") == "1024":
                    pts.append((int(pp["T"]), r["median"]))
        series.append((f"{impl} seq", pts))
    if svg_plot(os.path.join(out, "evict_vs_context.svg"), "SnapKV eviction of one layer (engine shape, fp16, B 1024)",
                "context T (tokens)", "time per layer (median)", series):
        made.append("evict_vs_context.svg")
    return made


# ------------------------------------------------------------------------------------------------
# markdown

def stage_tables(rows):
    """Per stage: every kvevict case with each baseline's time and baseline / kvevict."""
    lines = []
    stages = []
    for k in rows:
        if k[0] not in stages:
            stages.append(k[0])
    for stage in stages:
        keys = sorted({(k[1], k[3], k[4]) for k in rows if k[0] == stage and k[2] == "kvevict"})
        if not keys:
            continue
        impls = sorted({k[2] for k in rows if k[0] == stage and k[2] != "kvevict"})
        lines.append(f"#### {stage}\n")
        lines.append("| op | backend | params | kvevict | " + " | ".join(f"{i} (÷ kvevict)" for i in impls) + " |")
        lines.append("|" + " --- |" * (4 + len(impls)))
        for op, be, p in keys:
            a = rows[(stage, op, "kvevict", be, p)]
            cells = []
            for i in impls:
                b = rows.get((stage, op, i, be, p))
                cells.append("" if not b else f"{fmt_us(b['median'])} ({fmt_ratio(b['median'] / a['median'])})")
            lines.append(f"| {op} | {be} | `{p}` | {fmt_us(a['median'])} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def write_doc(doc, raw, rows, tg, sc, made):
    machine = ""
    mp = os.path.join(raw, "machine.txt")
    if os.path.exists(mp):
        with open(mp) as f:
            text = f.read()
        keep = []
        for line in text.splitlines():
            if re.match(r"(date|commit|compiler|OMP_|reps|load |Model name|CPU\(s\)|Thread|L[123]|Flags)", line):
                if line.startswith("Flags"):
                    fl = line.split()
                    line = "Flags (SIMD): " + " ".join(x for x in fl if x.startswith(("avx512f", "avx2", "fma", "f16c")))
                keep.append(line.strip())
        machine = "\n".join(keep)
    loadlog = ""
    lp = os.path.join(raw, "load.log")
    if os.path.exists(lp):
        with open(lp) as f:
            loadlog = f.read().strip()
    L = [BEGIN, "", "### Machine and run", "", "```", machine, "```", "", "Load average (1, 5, 15 min) at the start and end of each binary:", "",
         "```", loadlog, "```", "", "### Targets (issue 8)", "",
         "| target | case | kvevict | baseline | ratio (medians) | ratio (mins) | goal | met |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in tg:
        met = "—" if t["met"] is None else ("**met**" if t["met"] else "**not met**")
        L.append(f"| {t['target']} | `{t['case']}` | {fmt_us(t['kvevict_us'])} | {fmt_us(t['baseline_us'])} | "
                 f"{t['ratio']:.2f} | {t['ratio_min']:.2f} | {t['goal']} | {met} |")
    L += ["", "Ratios: selection, naive, PyTorch and BLAS-eviction rows are baseline time ÷ kvevict time; the "
          "sgemm row is kvevict time ÷ sgemm time; compaction is memcpy time ÷ kvevict time for the same "
          "bytes (the fraction of memcpy bandwidth reached).", ""]
    L += ["### par vs seq (kvevict, every case)", "", "| stage | op | impl | params | seq | par | seq ÷ par |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in sc:
        L.append(f"| {s['stage']} | {s['op']} | {s['impl']} | `{s['params']}` | {fmt_us(s['seq_us'])} | "
                 f"{fmt_us(s['par_us'])} | {s['speedup']:.2f} |")
    L += [""]
    dr = driver_rows(rows)
    if dr:
        L += ["### Chunked patched driver vs naive chunking and post-fill eviction", "",
              "The driver's work over the whole prompt (add_layer + decide + compact_inplace of K, V and positions "
              "per chunk; the forward pass and the queries are synthetic and not timed): chunked patched, its mean "
              "per chunk, chunked naive, and post-fill eviction of the same prompt at the same budget.", "",
              "| allocator | backend | params | patched | per chunk | chunks | naive | post-fill | patched ÷ post-fill "
              "(medians / mins) | seq ÷ par |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

        def r2(x):
            return "–" if x is None else f"{x:.2f}"

        for d in dr:
            chunks = "–" if d["chunks"] is None else f"{d['chunks']:.0f}"
            L.append(f"| {d['alloc']} | {d['backend']} | `{d['params']}` | {fmt_us(d['patched_us'])} | "
                     f"{fmt_us(d['per_chunk_us'])} | {chunks} | {fmt_us(d['naive_us'])} | "
                     f"{fmt_us(d['post_fill_us'])} | {r2(d['vs_post_fill'])} / {r2(d['vs_post_fill_min'])} | "
                     f"{r2(d['seq_over_par'])} |")
        L += [""]
    if made:
        L += ["### Plots", ""] + [f"![{m}](performance/{m})" for m in made] + [""]
    L += ["### Every case, with its baselines", "", "Time per call (median of the repetitions); in parentheses "
          "baseline ÷ kvevict (above 1: kvevict is faster).", ""]
    L += stage_tables(rows)
    L.append(END)
    text = ""
    if os.path.exists(doc):
        with open(doc) as f:
            text = f.read()
    block = "\n".join(L)
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + "\n" + block + "\n"
    with open(doc, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--doc", required=True)
    a = ap.parse_args()
    rows = load(a.raw)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stage", "op", "impl", "backend", "params", "median_us", "min_us", "source"])
        for k, r in sorted(rows.items()):
            w.writerow(list(k) + [f"{r['median']:.3f}", f"{r['min']:.3f}", r["source"]])
    tg, sc = targets(rows), scaling(rows)
    made = plots(rows, a.out)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"targets": tg, "scaling": sc, "driver": driver_rows(rows), "plots": made}, f, indent=1)
    write_doc(a.doc, a.raw, rows, tg, sc, made)
    met = sum(1 for t in tg if t["met"]), sum(1 for t in tg if t["met"] is False)
    print(f"bench/report.py: {len(rows)} cases, {len(tg)} target rows ({met[0]} met, {met[1]} not met), "
          f"plots: {', '.join(made) or 'none'}")


if __name__ == "__main__":
    main()
