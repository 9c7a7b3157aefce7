#!/usr/bin/env python3
"""paired.py REPORT_JSON A B: the paired difference A - B on the report's prompts at every budget both
rows have, for KL, top-1 agreement, greedy agreement and recall: mean of the per-prompt differences,
its standard error (sample sd / sqrt(n)), the two-sided p of the normal approximation, and on how many
prompts A's KL is lower. A and B name rows as RECIPE or RECIPE/DRIVER (post-fill by default), e.g.
  examples/report/paired.py docs/report/report.json lookaheadkv laq
  examples/report/paired.py docs/report/report.json snapkv/chunked-patched snapkv/chunked-naive
No multiple-comparison correction: with k comparisons, compare p with 0.05 / k (Bonferroni)."""
import json
import math
import sys


def rows_of(report, name):
    recipe, _, driver = name.partition("/")
    driver = driver or "postfill"
    return {r["budget"]: r for r in report["rows"]
            if r["recipe"] == recipe and r["driver"] == driver and "chunk_fraction" not in r}


def paired(a, b):
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    sem = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    p = math.erfc(abs(mean / sem) / math.sqrt(2)) if sem > 0 else (1.0 if mean == 0 else 0.0)
    return mean, sem, p


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        report = json.load(f)
    a, b = rows_of(report, sys.argv[2]), rows_of(report, sys.argv[3])
    budgets = sorted(k for k in a if k in b and k is not None)
    if not budgets:
        sys.exit(f"paired.py: no budget has both {sys.argv[2]} and {sys.argv[3]}")
    print(f"{sys.argv[2]} - {sys.argv[3]}, {len(a[budgets[0]]['per_prompt']['kl'])} prompts; mean ± se (p, two-sided)")
    for bud in budgets:
        pa, pb = a[bud]["per_prompt"], b[bud]["per_prompt"]
        cells = []
        for metric, fmt in (("kl", "%+.4f ± %.4f (p %.2g)"), ("top1", "%+.4f ± %.4f (p %.2g)"),
                            ("agreement", "%+.2f ± %.2f (p %.2g)"), ("recall", "%+.4f ± %.4f (p %.2g)")):
            if metric in pa and metric in pb:
                cells.append(f"{metric} " + fmt % paired(pa[metric], pb[metric]))
        lower = sum(1 for x, y in zip(pa["kl"], pb["kl"]) if x < y)
        print(f"B = {bud}: " + "; ".join(cells) + f"; KL lower on {lower}/{len(pa['kl'])}")


if __name__ == "__main__":
    main()
