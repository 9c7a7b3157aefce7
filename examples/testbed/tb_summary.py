"""docs/report.md's testbed tables from the report runs' JSON (`testbed.py summary`).

Each run (tb_report.run_report) writes its own tables; docs/report.md combines them: the full cache and
the budget sweep of the matrix with the query-agnostic run's rows (marked †, lengths 256-1024), the
query-agnostic methods at 2032 tokens, the seed papers' pairs from the run that holds both rows, the
larger budgets and the head-type run (sparsities) with their footprints, and every critical footprint. The rows and their order are the
ones docs/report.md discusses (MATRIX_ROWS and the others below); a row a run does not hold is left out.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

import tb_report

MATRIX_ROWS = (("streaming_llm", "postfill"), ("h2o", "postfill"), ("tova", "postfill"), ("knorm", "postfill"),
               ("snapkv", "postfill"), ("snapkv", "decode"), ("pyramidkv", "postfill"), ("vatp", "postfill"),
               ("adakv", "postfill"), ("cake", "postfill"), ("lava", "postfill"), ("snapkv", "chunked-naive"),
               ("snapkv", "chunked-patched"), ("lava", "chunked-naive"), ("lava", "chunked-patched"),
               ("oracle", "postfill"))
"""the budget table's rows from the matrix"""
QUERY_AGNOSTIC_ROWS = (("snapkv", "postfill"), ("speckv", "postfill"), ("laq", "postfill"), ("laq++", "postfill"),
                       ("lookaheadkv", "postfill"))
"""its rows (†) from the query-agnostic run, and the 2032 table's (with the oracle)"""
BUDGET_ROWS = (("snapkv", "postfill"), ("snapkv", "chunked-naive"), ("snapkv", "chunked-patched"),
               ("lava", "postfill"), ("lava", "chunked-naive"), ("lava", "chunked-patched"))
"""the larger-budget table's rows"""
HEAD_TYPE_ROWS = (("duo", "postfill"), ("duo", "chunked-naive"), ("prulong", "postfill"), ("prulong", "chunked-naive"))
"""the head-type runs' rows (DuoAttention's run, then PruLong's: sweeps over the sparsity, % streaming heads)"""
RUNS = ("matrix", "query_agnostic", "budgets", "window8", "at_2048", "head_types", "prulong")


def load(dirs: Dict[str, str]) -> Dict[str, dict]:
    """{run: its testbed_report.json} for the runs named (a directory each); ValueError for a missing file."""
    out = {}
    for run, d in dirs.items():
        path = os.path.join(d, "testbed_report.json")
        try:
            with open(path) as f:
                out[run] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"summary: {run}: {path}: {e}") from None
    return out


def _cell(r) -> str:
    return "—" if r is None else f"{r['exact_match']:.2f} ± {r['se']:.2f}"


def full_cache(rep: dict) -> List[str]:
    """Answered / asked per kind and length, and the mean ± se over all lengths."""
    n = rep["per_cell"]
    out = ["| question | " + " | ".join(str(L) for L in rep["lengths"]) + f" | all ({n * len(rep['lengths'])}) |",
           "| --- |" + " ---: |" * (len(rep["lengths"]) + 1)]
    for r in (r for r in rep["rows"] if r["recipe"] == "full"):
        counts = [f"{round(r['per_length'][str(L)][0] * n)} / {n}" for L in rep["lengths"]]
        out.append(f"| {r['kind']} | " + " | ".join(counts) + f" | {r['exact_match']:.3f} ± {r['se']:.3f} |")
    return out


def budget_sweep(rep: dict, rows, tag: str = "", header: bool = True, footprints: bool = False) -> List[str]:
    """Exact match ± se per kind and budget for `rows` (recipe, driver) of one run, names suffixed by `tag`;
    with `footprints` a last column of each budget's mean footprint over both kinds' examples."""
    by, out = tb_report.rows_by_config(rep["rows"]), []
    budgets = rep["budgets"]
    if header:
        axis = "S" if rep.get("head_mask") else "B"
        fp = f" footprint at {axis} = {budgets[0]} … {budgets[-1]} |" if footprints else ""
        out += ["| method / driver | " + " | ".join(
            f"{k}: {b}" if i == 0 else str(b) for k in rep["kinds"] for i, b in enumerate(budgets)) + " |" + fp,
                "| --- |" + " ---: |" * (len(rep["kinds"]) * len(budgets) + footprints)]
    for rc, d in rows:
        cells = [by.get((rc, d, b, k)) for k in rep["kinds"] for b in budgets]
        if not any(c is not None for c in cells):
            continue
        line = f"| {tb_report.config_name(rc, d)}{tag} | " + " | ".join(_cell(c) for c in cells) + " |"
        if footprints:
            means = []
            for b in budgets:
                rs = [by[(rc, d, b, k)] for k in rep["kinds"] if (rc, d, b, k) in by]
                means.append(sum(r["footprint"] * r["n"] for r in rs) / sum(r["n"] for r in rs))
            line += " " + " / ".join(f"{f:.2f}" for f in means) + " |"
        out.append(line)
    return out


def pairs(reps: Dict[str, dict]) -> List[str]:
    """The seed papers' pairs (tb_report.PAPER_PAIRS), each from the first of the query-agnostic run and
    the matrix that holds both rows at every budget; `**` Bonferroni over that run's pairs, `*` p < 0.05."""
    sources = [reps[r] for r in ("query_agnostic", "matrix") if r in reps]
    budgets = sources[-1]["budgets"]
    out = ["| A − B | paper | question | " + " | ".join(f"B = {b}" for b in budgets) + " |",
           "| --- | --- | --- |" + " ---: |" * len(budgets)]
    for a, b, src in tb_report.PAPER_PAIRS:
        for rep in sources:
            got = [p for p in tb_report.paper_pairs(rep) if p[0] == a and p[1] == b]
            if len(got) == len(rep["kinds"]) * len(budgets):
                m = len(tb_report.paper_pairs(rep))
                for kind in rep["kinds"]:
                    ds = {p[4]: p[5] for p in got if p[3] == kind}
                    out.append(f"| {tb_report.config_name(*a)} − {tb_report.config_name(*b)} | {src} | {kind} | " + " | ".join(
                        f"{ds[x]['mean']:+.3f} ± {ds[x]['se']:.3f}{tb_report.stars(ds[x]['p'], m)}" for x in budgets) + " |")
                break
    return out


def critical(reps: Dict[str, dict]) -> List[str]:
    """Every curve's critical footprint (%), the question after and before, and the run it comes from: of the
    runs that measured the curve (RUNS' order; not the window-8 run, another protocol) the first that reaches
    F in both kinds (larger budgets reach it where the matrix's do not), else the first; rows by footprint."""
    found = {}  # (recipe, driver) -> [(run, {kind: critical})]
    for run in RUNS:
        if run in reps and run != "window8":
            cs = {}
            for c in reps[run]["critical"]:
                cs.setdefault((c["recipe"], c["driver"]), {})[c["kind"]] = c["critical"]
            for key, by_kind in cs.items():
                if set(by_kind) == {"after", "before"}:
                    found.setdefault(key, []).append((run, by_kind))
    reached = lambda by_kind: all(c is not None and c["kind"] != "above_max" for c in by_kind.values())  # noqa: E731
    rows = []
    for key, runs in found.items():
        run, by_kind = next((r for r in runs if reached(r[1])), runs[0])
        mean = sum(c["footprint"] if c else 1.0 for c in by_kind.values()) / 2
        rows.append((mean, key, by_kind, run))
    out = ["| method / driver | question after | question before | run |", "| --- | ---: | ---: | --- |"]
    for _, (rc, d), by_kind, run in sorted(rows, key=lambda x: x[0]):
        out.append(f"| {tb_report.config_name(rc, d)} | {tb_report.fmt_critical(by_kind['after'])} | "
                   f"{tb_report.fmt_critical(by_kind['before'])} | {run.replace('_', '-')} |")
    return out


def markdown(reps: Dict[str, dict]) -> str:
    out = []
    if "matrix" in reps:
        out += ["### Full cache", ""] + full_cache(reps["matrix"])
        out += ["", "### Exact match against the budget (all lengths; ± se)", ""]
        out += budget_sweep(reps["matrix"], MATRIX_ROWS)
        if "query_agnostic" in reps:
            out += budget_sweep(reps["query_agnostic"], QUERY_AGNOSTIC_ROWS, " †", header=False)
    if "at_2048" in reps:
        out += ["", "### At 2048 tokens: the query-agnostic methods", ""]
        out += budget_sweep(reps["at_2048"], QUERY_AGNOSTIC_ROWS + (("oracle", "postfill"),))
    if "window8" in reps:
        out += ["", "### Window 8", ""] + budget_sweep(reps["window8"], QUERY_AGNOSTIC_ROWS)
    if "matrix" in reps or "query_agnostic" in reps:
        out += ["", "### The seed papers' pairs (paired over the examples)", ""] + pairs(reps)
    if "budgets" in reps:
        out += ["", "### Larger budgets", ""] + budget_sweep(reps["budgets"], BUDGET_ROWS, footprints=True)
    heads = [reps[r] for r in ("head_types", "prulong") if r in reps]
    if heads:
        out += ["", "### Head types (columns: sparsity, % streaming heads)", ""]
        for i, rep in enumerate(heads):  # (a table a run: their sparsities may differ)
            out += ([""] if i else []) + budget_sweep(rep, HEAD_TYPE_ROWS, footprints=True)
    out += ["", "### Critical KV footprint (%)", ""] + critical(reps)
    return "\n".join(out) + "\n"
