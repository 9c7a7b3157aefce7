#!/usr/bin/env python3
"""Per-kernel register, spill and shared-memory figures of the CUDA build, and their budget check.

The CUDA objects that instantiate every kernel (tests/cuda/instantiate_*.cu) are compiled with
`-Xptxas=-v`, through this script as the compiler launcher (`capture`), which keeps ptxas' report of
each object in `<object>.ptxas` and passes every other line of the compiler's output through.

  cuda_resources.py capture -- <compiler command ...>   (CMake's CUDA_COMPILER_LAUNCHER)
  cuda_resources.py table <file.ptxas ...>               print the table (TSV) of the reports
  cuda_resources.py check --table T <file.ptxas ...>     compare with the committed table T
  cuda_resources.py update --table T <file.ptxas ...>    rewrite T (keeping its register budgets)

`check` fails (exit 1) when a kernel of T is missing from the build, a built kernel is not in T, a
kernel uses more registers than its budget, or spills (stores or loads) or uses more stack or shared
memory than T's figure. docs/cuda.md, "Resource budgets", describes the table.
"""
import argparse
import os
import re
import subprocess
import sys

COLUMNS = ["arch", "kernel", "registers", "register_budget", "spill_stores", "spill_loads", "stack_frame", "smem"]

ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(sm_\d+a?)'")
PROPS = re.compile(r"ptxas info\s*: Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"ptxas info\s*: Used (\d+) registers(.*)")
SMEM = re.compile(r"(\d+) bytes smem")


def capture(cmd):
    """Run the compiler command; ptxas' -v report goes to <object>.ptxas, the rest to stderr."""
    out = None
    for i, a in enumerate(cmd):
        if a == "-o" and i + 1 < len(cmd):
            out = cmd[i + 1]
        elif a.startswith("-o") and len(a) > 2 and not a.startswith("-options"):
            out = a[2:]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report, rest = [], []
    for line in (proc.stderr + proc.stdout).splitlines(keepends=True):
        (report if line.startswith("ptxas info") or FRAME.search(line) else rest).append(line)
    sys.stderr.write("".join(rest))
    if proc.returncode == 0 and out is not None:
        path = out if os.path.isabs(out) else os.path.join(os.getcwd(), out)
        with open(path + ".ptxas", "w") as f:
            f.write("".join(report))
    return proc.returncode


def demangle(names):
    if not names:
        return {}
    res = subprocess.run(["c++filt"], input="\n".join(names) + "\n", stdout=subprocess.PIPE, text=True, check=True)
    return dict(zip(names, res.stdout.splitlines()))


def parse(paths):
    """{(arch, mangled kernel): figures} from ptxas -v reports."""
    kernels = {}
    for path in paths:
        entry = arch = None
        frame = None
        with open(path) as f:
            for line in f:
                m = ENTRY.search(line)
                if m:
                    entry, arch, frame = m.group(1), m.group(2), None
                    continue
                m = PROPS.search(line)
                if m:
                    if m.group(1) != entry:
                        entry = None  # a non-inlined device function: not a kernel
                    continue
                m = FRAME.search(line)
                if m and entry is not None:
                    frame = tuple(int(x) for x in m.groups())
                    continue
                m = USED.search(line)
                if m and entry is not None:
                    sm = SMEM.search(m.group(2))
                    st, ss, sl = frame if frame else (0, 0, 0)
                    fig = {"registers": int(m.group(1)), "spill_stores": ss, "spill_loads": sl, "stack_frame": st,
                           "smem": int(sm.group(1)) if sm else 0}
                    key = (arch, entry)
                    if key in kernels and kernels[key] != fig:
                        sys.exit(f"cuda_resources: {entry} for {arch} differs between objects")
                    kernels[key] = fig
                    entry = None
    names = demangle(sorted({k for _, k in kernels}))
    return {(a, names[k]): v for (a, k), v in kernels.items()}


def default_budget(regs):
    """A new kernel's register budget: its figure rounded up to the allocation granularity (8)."""
    return (regs + 7) // 8 * 8


def read_table(path):
    rows = {}
    with open(path) as f:
        header = None
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            cells = line.rstrip("\n").split("\t")
            if header is None:
                header = cells
                if header != COLUMNS:
                    sys.exit(f"cuda_resources: {path}: header must be {COLUMNS}")
                continue
            r = dict(zip(header, cells))
            rows[(r["arch"], r["kernel"])] = {c: int(r[c]) for c in COLUMNS[2:]}
    return rows


def format_table(kernels, budgets):
    lines = ["# Registers, spills (bytes per thread), stack frame and static shared memory (bytes per block) of",
             "# every CUDA kernel, from ptxas -v of the cuda preset build (nvcc 13.0). Checked by the CTest",
             "# cuda.resources (scripts/cuda_resources.py check); regenerate with scripts/cuda_resources.py update.",
             "\t".join(COLUMNS)]
    for (arch, name) in sorted(kernels):
        f = kernels[(arch, name)]
        budget = budgets.get((arch, name), default_budget(f["registers"]))
        lines.append("\t".join([arch, name, str(f["registers"]), str(budget), str(f["spill_stores"]),
                                str(f["spill_loads"]), str(f["stack_frame"]), str(f["smem"])]))
    return "\n".join(lines) + "\n"


def check(table, kernels):
    errors = []
    for key, want in sorted(table.items()):
        arch, name = key
        got = kernels.get(key)
        if got is None:
            errors.append(f"missing from the build: {name} ({arch})")
            continue
        if got["registers"] > want["register_budget"]:
            errors.append(f"{name} ({arch}): {got['registers']} registers > budget {want['register_budget']}")
        for c in ("spill_stores", "spill_loads", "stack_frame", "smem"):
            if got[c] > want[c]:
                errors.append(f"{name} ({arch}): {c} {got[c]} > committed {want[c]}")
    for key in sorted(set(kernels) - set(table)):
        errors.append(f"not in the table: {key[1]} ({key[0]}) (scripts/cuda_resources.py update)")
    return errors


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "capture":
        cmd = sys.argv[2:]
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        return capture(cmd)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["table", "check", "update"])
    ap.add_argument("--table")
    ap.add_argument("reports", nargs="+")
    a = ap.parse_args()
    missing = [p for p in a.reports if not os.path.exists(p)]
    if missing:
        sys.exit("cuda_resources: no ptxas report " + ", ".join(missing) + " (build the cuda preset first)")
    kernels = parse(a.reports)
    if not kernels:
        sys.exit("cuda_resources: the reports name no kernel")
    if a.mode == "table":
        sys.stdout.write(format_table(kernels, {}))
        return 0
    if not a.table:
        sys.exit("cuda_resources: --table is required")
    if a.mode == "update":
        budgets = {}
        if os.path.exists(a.table):
            budgets = {k: max(v["register_budget"], kernels[k]["registers"]) if k in kernels else v["register_budget"]
                       for k, v in read_table(a.table).items()}
        with open(a.table, "w") as f:
            f.write(format_table(kernels, budgets))
        return 0
    errors = check(read_table(a.table), kernels)
    for e in errors:
        print("cuda_resources: " + e)
    worst = max(kernels.values(), key=lambda f: f["registers"])
    print(f"cuda_resources: {len(kernels)} kernel builds checked, {len(errors)} regression(s); "
          f"most registers {worst['registers']}, most spill "
          f"{max(f['spill_stores'] for f in kernels.values())} B")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
