#!/usr/bin/env python3
"""compare_json.py COMMITTED NEW: checks that every non-timing number of a regenerated quality JSON
(kvevict-run --report's report.json, kvevict-lookahead eval's --json) equals the committed one bit
for bit. Timing fields (wall-clock milliseconds, ratios of them, seconds, load average, thread
counts) and paths are skipped. Parts the new run did not compute (e.g. eval without --ablation: the
ablation's methods, the tail of per-pair rows) are skipped and counted. Rows (report.json's "rows",
footprint.json's "curves") are matched by what they configure (recipe, driver, budget, chunk fraction,
head sparsity; a curve's sweep), so a run with more rows compares the committed ones wherever they
are; rows and keys only in the new file are additions: listed, not differences. Exit status 0: every
committed value is reproduced."""
import json
import sys

TIMING = {"seconds", "total_seconds", "train_seconds", "evict_ms", "prefill_ms", "overhead", "timing",
          "prefill_lookaheadkv_ms", "prefill_snapkv_ms", "lookaheadkv_scoring_ms", "snapkv_scoring_ms",
          "lookaheadkv_ratio", "snapkv_ratio", "load_average", "timing_runs", "threads",
          "command", "path", "model", "module"}


ROW_KEYS = ("recipe", "driver", "budget", "chunk_fraction", "head_sparsity", "sweep")


def row_key(x):
    if not isinstance(x, dict) or "recipe" not in x:
        return None
    return tuple(json.dumps(x.get(k)) for k in ROW_KEYS)


def walk_rows(a, b, where, stats):
    """Committed rows a against new rows b, matched by row_key; new-only rows are additions."""
    new = {}
    for y in b:
        new.setdefault(row_key(y), []).append(y)
    used = {}
    for i, x in enumerate(a):
        k = row_key(x)
        n = used.get(k, 0)
        if k not in new or n >= len(new[k]):
            stats["not_in_new"].append(f"{where}[{i}]")
            continue
        used[k] = n + 1
        walk(x, new[k][n], f"{where}[{i}]", stats)
    for k, ys in new.items():
        for y in ys[used.get(k, 0):]:
            stats["added"].append(f"{where}: {'/'.join(str(y.get(f)) for f in ROW_KEYS if y.get(f) is not None)}")


def walk(a, b, where, stats):
    if isinstance(a, dict):
        if not isinstance(b, dict):
            stats["diff"].append(f"{where}: object vs {type(b).__name__}")
            return
        for k, v in a.items():
            if k in TIMING:
                stats["skipped_timing"] += 1
            elif k not in b:
                stats["not_in_new"].append(f"{where}.{k}")
            else:
                walk(v, b[k], f"{where}.{k}", stats)
        for k in b:
            if k not in a and k not in TIMING:
                stats["added"].append(f"{where}.{k}")
    elif isinstance(a, list):
        if not isinstance(b, list):
            stats["diff"].append(f"{where}: array vs {type(b).__name__}")
            return
        if a and all(row_key(x) is not None for x in a) and all(row_key(y) is not None for y in b):
            walk_rows(a, b, where, stats)
            return
        if len(b) < len(a):
            stats["truncated"].append(f"{where}: {len(b)} of {len(a)} entries compared")
        elif len(b) > len(a):
            stats["diff"].append(f"{where}: {len(b)} entries, committed {len(a)}")
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{where}[{i}]", stats)
    else:
        stats["values"] += 1
        # bit for bit: the same JSON text for numbers (both files print with the same precision)
        if json.dumps(a) != json.dumps(b):
            stats["diff"].append(f"{where}: committed {a!r}, new {b!r}")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        committed = json.load(f)
    with open(sys.argv[2]) as f:
        new = json.load(f)
    stats = {"values": 0, "skipped_timing": 0, "diff": [], "not_in_new": [], "truncated": [], "added": []}
    walk(committed, new, "$", stats)
    for d in stats["diff"][:20]:
        print("DIFF", d)
    print(f"{stats['values']} values compared, {len(stats['diff'])} differ; {stats['skipped_timing']} timing fields "
          f"skipped; not computed by the new run: {len(stats['not_in_new'])} fields "
          f"{stats['not_in_new'][:6]}{' ...' if len(stats['not_in_new']) > 6 else ''}, {len(stats['truncated'])} "
          f"arrays compared on their prefix; added by the new run: {len(stats['added'])} "
          f"{stats['added'][:6]}{' ...' if len(stats['added']) > 6 else ''}")
    sys.exit(1 if stats["diff"] else 0)


if __name__ == "__main__":
    main()
