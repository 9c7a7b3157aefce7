"""A training run's phases as one file (docs/testbed.md, "Reproduce"): `testbed.py train --schedule F`
switches the train options at the steps the file lists, exactly as stopping the run there and resuming
it by hand with the new options does (same lr, same batches, same bits), so a run that was resumed
with changed options is one command.

    {"about": "...",
     "run": {"seed": 1, "threads": 1},                       # fixed for the whole run
     "stories": {"train": 3000, "val": 200, "test": 400,     # pool sizes (optional; default the full pools)
                 "sha256": {"train": "...", ...}},           # checked by `make` when the pools are full
     "phases": [{"from": 0, "set": {"steps": 1500, "recall-steps": 500}, "note": "..."},
                {"from": 450, "set": {"steps": 4000, "plain": 0.1}}, ...,
                {"from": 31450, "set": {...}, "grow": {"layers": 6}}],   # optional: more layers from here
     "end": 33050}                                                      # optional: stop before the last steps

A phase's `set` changes the options of the phase before it (the first phase's, the train defaults);
the options are train's, spelled as on the command line without the dashes. Phase k covers the steps
`from_k` .. `from_{k+1} - 1` (step s is the update that takes the weights from s to s + 1 steps); the
run ends at `end` when given (a run stopped by hand: the lr still follows the last phase's `steps`),
otherwise at the last phase's `steps`. A phase with `grow` starts from the model before it grown to
that many layers (tb_model.grow: the added layers identity blocks) with a fresh AdamW state, as
stopping there and starting `train --init RUN/model.bin --init-grow --init-step FROM --layers N` does.
"""
from __future__ import annotations

import argparse
import copy
import json
from typing import Dict, List, Tuple

PHASE_OPTIONS = {"steps": int, "batch_tokens": int, "lr": float, "warmup": int, "plain": float,
                 "answer_weight": float, "answer_tokens": str, "recall_steps": int, "recall_mix": float,
                 "max_length": int, "min_length": int, "long_weight": float, "short_keys": float, "fact_format": str,
                 "recall_facts": int,
                 "log_every": int, "ckpt_every": int, "eval_every": int, "eval_per_cell": int}
"""train options a phase may change (what a hand resume with new options could change)"""

RUN_OPTIONS = {"seed": int, "threads": int, "dim": int, "hidden": int, "layers": int, "heads": int,
               "kv_heads": int, "seq_len": int}
"""train options fixed for the whole run: the initial weights, the model's shape (but a phase's `grow`
adds layers), the bits (the thread count changes the float sums)"""

BITS = ("seed", "threads", "steps", "batch_tokens", "lr", "warmup", "plain", "answer_weight", "answer_tokens",
        "recall_steps", "recall_mix", "max_length", "min_length", "long_weight", "short_keys", "fact_format",
        "recall_facts")
"""the options the weights depend on (the others only say when to log, checkpoint and evaluate)"""

SPLIT_NAMES = ("train", "val", "test")
FACT_FORMATS = ("is", "adjacent")
"""tb_data.FACT_FORMATS (repeated: this module does not import the data's dependencies; a test checks they agree)"""
ANSWER_TOKENS = ("code", "all")
"""train --answer-tokens: the answer term over the code digits, or over every answer token (testbed.losses)"""


class Schedule:
    """A loaded, checked schedule: `phases` [(from, argparse.Namespace of that phase's train options)]."""

    def __init__(self, path: str, doc: dict, phases: List[Tuple[int, argparse.Namespace]], set_options: set,
                 defaults: argparse.Namespace, grows: set, end):
        self.path, self.doc, self.phases, self.set_options, self.defaults = path, doc, phases, set_options, defaults
        self.grows, self.end = grows, end  # the indices of the phases that grow the model; the run's end or None

    def index(self, step: int) -> int:
        """The phase that runs step `step` (the update from `step` to `step + 1` done steps)."""
        i = 0
        while i + 1 < len(self.phases) and self.phases[i + 1][0] <= step:
            i += 1
        return i

    def args(self, step: int) -> argparse.Namespace:
        return self.phases[self.index(step)][1]

    @property
    def steps(self) -> int:
        """The step the run ends at."""
        return self.end if self.end is not None else self.phases[-1][1].steps

    def stories(self) -> Dict[str, int]:
        """Pool sizes per split (None: the full pool)."""
        s = self.doc.get("stories", {})
        return {k: s.get(k) for k in SPLIT_NAMES}

    def command(self, i: int, defaults: argparse.Namespace) -> str:
        """Phase i as the hand command's train options (those that differ from the defaults)."""
        a = self.phases[i][1]
        keys = [k for k in list(RUN_OPTIONS) + list(PHASE_OPTIONS) if getattr(a, k) != getattr(defaults, k) or k == "steps"]
        return " ".join(f"--{k.replace('_', '-')} {getattr(a, k):g}" if isinstance(getattr(a, k), float)
                        else f"--{k.replace('_', '-')} {getattr(a, k)}" for k in keys)


def _options(where: str, given: dict, allowed: Dict[str, type]) -> dict:
    if not isinstance(given, dict):
        raise ValueError(f"{where}: must be an object of options, got {given!r}")
    out = {}
    for name, value in given.items():
        key = name.replace("-", "_")
        if key not in allowed:
            raise ValueError(f"{where}: {name!r} is not one of {', '.join(k.replace('_', '-') for k in allowed)}")
        kind = allowed[key]
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(f"{where}: {name} must be a string, got {value!r}")
            out[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise ValueError(f"{where}: {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        out[key] = kind(value)
    return out


def check_phase(where: str, a: argparse.Namespace, first: int, next_from) -> None:
    """ValueError naming every option of one phase (train's options `a`, from step `first`, the next
    phase from `next_from` or None) that is out of range; train runs it on its command line too."""
    problems = []
    for k in ("steps", "batch_tokens", "log_every", "ckpt_every", "eval_every", "eval_per_cell", "threads"):
        if getattr(a, k) < 1:
            problems.append(f"{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    for k in ("warmup", "recall_steps", "max_length", "min_length", "recall_facts"):
        if getattr(a, k) < 0:
            problems.append(f"{k.replace('_', '-')} must be >= 0, got {getattr(a, k)}")
    if not a.long_weight > 0:
        problems.append(f"long-weight must be > 0, got {a.long_weight}")
    for k in ("plain", "recall_mix"):
        if not 0.0 <= getattr(a, k) <= 1.0:
            problems.append(f"{k.replace('_', '-')} must be in [0, 1], got {getattr(a, k)}")
    if a.fact_format not in FACT_FORMATS:
        problems.append(f"fact-format must be one of {', '.join(FACT_FORMATS)}, got {a.fact_format!r}")
    if a.answer_tokens not in ANSWER_TOKENS:
        problems.append(f"answer-tokens must be one of {', '.join(ANSWER_TOKENS)}, got {a.answer_tokens!r}")
    if not a.lr > 0 or not a.answer_weight >= 0:
        problems.append(f"lr must be > 0 and answer-weight >= 0, got {a.lr} and {a.answer_weight}")
    if a.steps <= first:
        problems.append(f"steps {a.steps} ends the run before the phase's first step {first}")
    if next_from is not None and a.steps < next_from:
        problems.append(f"steps {a.steps} ends the run before the next phase (from {next_from})")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def load(path: str, defaults: argparse.Namespace) -> Schedule:
    """The schedule in `path` on top of `defaults` (train's options); ValueError names what is wrong."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"schedule {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("phases"), list) or not doc["phases"]:
        raise ValueError(f"schedule {path}: needs a non-empty list \"phases\"")
    unknown = set(doc) - {"about", "run", "stories", "phases", "end"}
    if unknown:
        raise ValueError(f"schedule {path}: unknown entries {sorted(unknown)} (about, run, stories, phases, end)")
    stories = doc.get("stories", {})
    if not isinstance(stories, dict) or set(stories) - set(SPLIT_NAMES) - {"sha256"} or any(
            not isinstance(stories[k], int) or isinstance(stories[k], bool) or stories[k] < 1
            for k in SPLIT_NAMES if k in stories):
        raise ValueError(f"schedule {path}: \"stories\" holds positive pool sizes for train / val / test and \"sha256\"")
    a = copy.deepcopy(defaults)
    run = _options(f"schedule {path}: run", doc.get("run", {}), RUN_OPTIONS)
    set_options = set(run)
    for k, v in run.items():
        setattr(a, k, v)
    phases, raw, grows = [], doc["phases"], set()
    for i, ph in enumerate(raw):
        where = f"schedule {path}: phase {i}"
        if not isinstance(ph, dict) or set(ph) - {"from", "set", "grow", "note"} or "from" not in ph:
            raise ValueError(f"{where}: a phase is {{\"from\": step, \"set\": {{options}}, \"grow\": "
                             f"{{\"layers\": n}} (optional), \"note\": text}}")
        start = ph["from"]
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"{where}: \"from\" must be a step >= 0, got {start!r}")
        if i == 0 and start != 0:
            raise ValueError(f"{where}: the first phase starts at step 0, not {start}")
        if i > 0 and start <= phases[-1][0]:
            raise ValueError(f"{where}: from {start} is not after the previous phase's {phases[-1][0]}")
        changes = _options(where, ph.get("set", {}), PHASE_OPTIONS)
        set_options |= set(changes)
        a = copy.deepcopy(a)
        for k, v in changes.items():
            setattr(a, k, v)
        if "grow" in ph:
            g = ph["grow"]
            if not isinstance(g, dict) or set(g) != {"layers"} or not isinstance(g["layers"], int) \
                    or isinstance(g["layers"], bool) or g["layers"] <= a.layers or i == 0:
                raise ValueError(f"{where}: \"grow\" is {{\"layers\": n}} with n more than the {a.layers} layers "
                                 f"before it, in a phase after the first, got {g!r}")
            a.layers = g["layers"]
            grows.add(i)
        phases.append((start, a))
    end = doc.get("end")
    if end is not None and (not isinstance(end, int) or isinstance(end, bool) or not phases[-1][0] < end
                            <= phases[-1][1].steps):
        raise ValueError(f"schedule {path}: \"end\" must be a step after the last phase's start {phases[-1][0]} "
                         f"and at most its steps {phases[-1][1].steps}, got {end!r}")
    for i, (start, a) in enumerate(phases):
        check_phase(f"schedule {path}: phase {i} (from {start})", a, start,
                     phases[i + 1][0] if i + 1 < len(phases) else None)
    return Schedule(path, doc, phases, set_options, copy.deepcopy(defaults), grows, end)


def mismatch(ckpt_args: dict, step: int, sched: Schedule) -> List[str]:
    """The weight-relevant options in which a checkpoint written after `step` steps differs from the
    schedule's phase of its last step (empty: the checkpoint is on this schedule)."""
    if step == 0:
        return []
    a = sched.args(step - 1)
    return [f"{k.replace('_', '-')} {ckpt_args[k]} (schedule: {getattr(a, k)})" for k in BITS
            if k in ckpt_args and ckpt_args[k] != getattr(a, k)]
