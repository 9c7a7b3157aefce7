#!/usr/bin/env python3
"""The long-context testbed (docs/testbed.md): story pools, training, evaluation, export, parity.

    testbed.py stories --kvevict-run build/release/examples/runner/kvevict-run --out-dir RUN/stories
    testbed.py train --run-dir RUN            # starts, or resumes from RUN/ckpt.pt
    testbed.py eval --checkpoint RUN/model.bin --stories-dir RUN/stories --split test
    testbed.py dump --stories-dir RUN/stories --split test --out test.jsonl   # prompts and answers
    testbed.py parity --checkpoint RUN/model.bin --kvevict-run build/release/examples/runner/kvevict-run
    testbed.py bench                          # training tokens/s per length
    testbed.py report --checkpoint RUN/model.bin --kvevict-run build/release/examples/runner/kvevict-run \
        --stories-dir RUN/stories --out-dir REPORT   # exact match vs budget / footprint, every recipe x driver
    testbed.py lookahead --checkpoint RUN/model.bin --kvevict-lookahead B/kvevict-lookahead \
        --stories-dir RUN/stories --out RUN/lookahead.bin   # LookaheadKV on the testbed's prompts

Python: Debian's /usr/bin/python3 with python3-torch and python3-numpy.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import tb_data  # noqa: E402
import tb_model  # noqa: E402
import tb_report  # noqa: E402
import tb_schedule  # noqa: E402
import tb_summary  # noqa: E402

TOKENIZER = os.path.join(SOURCE, "models", "tok512.bin")


def reference():
    """python/kvevict/reference.py (the PyTorch reference of the runner) without the compiled package."""
    name = "kvevict_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(SOURCE, "python", "kvevict", "reference.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def tokenizer():
    return reference().Tokenizer.load(TOKENIZER, 512)


def log_to(path):
    def log(msg):
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
        print(line, flush=True)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return log


# ---- batches and loss --------------------------------------------------------------------------

def batch_tensors(examples):
    T = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), T, dtype=torch.long)
    w = torch.zeros(len(examples), T - 1)
    for b, e in enumerate(examples):
        ids[b, :len(e.ids)] = torch.tensor(e.ids)
        w[b, :len(e.weights)] = torch.tensor(e.weights)
    return ids, w


def losses(model, examples, answer_tokens="code"):
    """(language-model loss over the weighted targets, the answers' loss, per example and question the
    answer tokens' hits [n_answer] (argmax == target given the true prefix; the last DIGITS are the code)).
    The answers' loss is the mean cross-entropy of every question's code digits (answer_tokens "code"), or
    of all its answer tokens, the key restated included ("all")."""
    ids, w = batch_tensors(examples)
    logits = model(ids[:, :-1])
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none").view_as(w)
    lm = (ce * w).sum() / w.sum()
    hit = logits.argmax(-1) == ids[:, 1:]
    codes = [ce[b, q if answer_tokens == "all" else q[-tb_data.DIGITS:]] for b, e in enumerate(examples)
             for q in e.questions]
    answer = torch.cat(codes).mean() if codes else torch.zeros(())
    return lm, answer, [[hit[b, q] for q in e.questions] for b, e in enumerate(examples)]


def length_batches(examples, batch_tokens):
    """The examples in batches of one token count each (shortest first), about batch_tokens tokens a batch."""
    by_len = {}
    for e in examples:
        by_len.setdefault(len(e.ids), []).append(e)
    for _, group in sorted(by_len.items()):
        per = max(1, batch_tokens // len(group[0].ids))
        for s in range(0, len(group), per):
            yield group[s:s + per]


@torch.no_grad()
def evaluate(model, examples, batch_tokens=4096):
    """Exact match per question: every answer token (the key restated, then the code) is the argmax
    given the true prefix, which is the same as greedy decoding reproducing the answer. Returns
    {(kind, length): [correct, total, code digits correct]}, mean LM loss."""
    cells, lm_sum, n = {}, 0.0, 0
    for part in length_batches(examples, batch_tokens):
        lm, _, hits = losses(model, part)
        lm_sum += float(lm) * len(part)
        n += len(part)
        for e, hs in zip(part, hits):
            c = cells.setdefault((e.meta["kind"], e.meta["length"]), [0, 0, 0])
            for h in hs:  # one per question (the recall kind asks several)
                c[0] += int(h.all())
                c[1] += 1
                c[2] += int(h[-tb_data.DIGITS:].sum())
    return cells, lm_sum / max(n, 1)


@torch.no_grad()
def retrieval_attention(model, gen, examples):
    """The retrieval-head check: for every question, the attention of the position that predicts the
    code's first digit (the space after "is" in the answer) onto the asked fact's code (its space and
    digits), against the mean over the other facts' codes. Returns (asked [layers, heads], distractor
    [layers, heads], number of questions): mean attention mass."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    asked, other, n, n_other = torch.zeros(L, H), torch.zeros(L, H), 0, 0
    for e in examples:
        rows = [q[-tb_data.DIGITS] for q in e.questions]
        _, maps = model(torch.tensor([e.ids[:-1]]), probe_rows=rows)
        att = torch.stack([m[0] for m in maps])  # [L, H, R, T]
        for r, (span, others) in enumerate(gen.questions_facts(e)):
            asked += att[:, :, r, list(span)].sum(-1)
            n += 1
            for o in others:
                other += att[:, :, r, list(o)].sum(-1)
                n_other += 1
    return asked / max(n, 1), other / max(n_other, 1), n


def selective_head(asked, other):
    """(layer, head) of the largest asked - other attention mass (retrieval_attention's outputs)."""
    return divmod(int((asked - other).argmax()), asked.shape[1])


def format_cells(cells):
    return " ".join(f"{k}@{L}={c}/{t} (digits {d / (t * tb_data.DIGITS):.2f})"
                    for (k, L), (c, t, d) in sorted(cells.items()))


# ---- training ----------------------------------------------------------------------------------

def allowed_lengths(args, step):
    """The length curriculum: 256 during the dense-recall phase (the first --recall-steps steps), then
    256..512 for the first 15 % of the remaining steps, up to 1024 until 35 %, then all (never above
    --max-length); with --min-length M only the lengths >= M of those (their longest while all are shorter)."""
    if step < args.recall_steps:
        return [tb_data.LENGTHS[0]]
    f = (step - args.recall_steps) / max(1, args.steps - args.recall_steps)
    top = min(512 if f < 0.15 else 1024 if f < 0.35 else args.seq_len, args.max_length or args.seq_len)
    lengths = [L for L in tb_data.LENGTHS if L <= top]
    return [L for L in lengths if L >= getattr(args, "min_length", 0)] or lengths[-1:]


def step_rng(args, step):
    """The random stream of one training step's batch (its length first: draw_length)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([args.seed, 99, step])))


def draw_length(rng, lengths, long_weight):
    """One step's length: each of `lengths` alike, or the longest `long_weight` times as often as each other
    one (--long-weight; 1 draws as without the option, so a run's batches stay those of its seed)."""
    if long_weight == 1.0 or len(lengths) == 1:
        return int(lengths[rng.integers(len(lengths))])
    u = rng.random() * (len(lengths) - 1 + long_weight)
    return int(lengths[min(int(u), len(lengths) - 1)])


def step_batch(gen, args, step):
    """The examples of one step, a pure function of (seed, step): one length for the whole step,
    batch_tokens // length sequences, each plain text with probability args.plain, else during the
    dense-recall phase (step < args.recall_steps) a recall example (many facts and questions), after it
    a recall example with probability args.recall_mix and otherwise a retrieval example (question
    after or before, 1, 2 or 4 needles). With --short-keys F > 0 a recall or retrieval example has
    one-token keys (tb_data.SHORT_KEYS) with probability F (drawn after its kind; F = 0 draws nothing,
    so the batches of a run without it are unchanged). --fact-format sets the fact and answer sentences of
    every recall and retrieval example (tb_data.FACT_FORMATS; no draw, the default "is" the testbed's);
    --recall-facts N > 0 caps a recall example's facts at N (0: as many as fit)."""
    rng = step_rng(args, step)
    L = draw_length(rng, allowed_lengths(args, step), getattr(args, "long_weight", 1.0))
    out = []
    for b in range(max(1, args.batch_tokens // L)):
        i = step * 64 + b  # distinct example seeds: at most 64 sequences a step
        u = rng.random()
        if u < args.plain:
            out.append(gen.example(i, L, "plain"))
        elif step < args.recall_steps or rng.random() < args.recall_mix:
            out.append(gen.example(i, L, "recall", keys=key_set(args, rng), fact_format=fact_format_of(args),
                                   recall_facts=getattr(args, "recall_facts", 0)))
        else:
            kind = "after" if rng.random() < 0.5 else "before"
            needles = int((1, 2, 4)[rng.integers(3)])
            out.append(gen.example(i, L, kind, needles, key_set(args, rng), fact_format_of(args)))
    return out


def fact_format_of(args):
    """The fact format of a run's examples ("is" for runs and checkpoints from before the option)."""
    return getattr(args, "fact_format", "is")


def keys_of(args):
    """The key table a run's questions are evaluated on: 'short' once every training question has
    one-token keys (--short-keys 1), else the colour-object keys."""
    return "short" if getattr(args, "short_keys", 0.0) >= 1.0 else "words"


def key_set(args, rng):
    """The key table of one training example: 'short' with probability --short-keys (no draw when 0)."""
    short = getattr(args, "short_keys", 0.0)
    return "short" if short > 0 and rng.random() < short else "words"


def lr_at(args, step):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    f = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, f))))


def model_config(args):
    return tb_model.Config(args.dim, args.hidden, args.layers, args.heads, args.kv_heads, 512, args.seq_len)


def save_atomic(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_atomic(path, data):
    """Write bytes or text to path through path.tmp, so that a stopped run never leaves a half file."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    os.replace(tmp, path)


def export_atomic(model, run_dir):
    tb_model.export(model, os.path.join(run_dir, "model.bin.tmp"))
    os.replace(os.path.join(run_dir, "model.bin.tmp"), os.path.join(run_dir, "model.bin"))


def stop_time(hhmm):
    """--stop-at HH:MM (UTC) -> the next such time as a Unix time (None without a stop)."""
    if not hhmm:
        return None
    h, m = (int(x) for x in hhmm.split(":"))
    now = time.time()
    t = now - now % 86400 + 3600 * h + 60 * m
    return t if t > now else t + 86400


def train_val_set(val, args):
    """The validation set of a run with these options (16 examples per length and kind up to
    --max-length, plus the recall cell when the run uses that kind)."""
    fmt, keys = fact_format_of(args), keys_of(args)
    out = tb_data.eval_set(val, args.eval_per_cell,
                           lengths=[L for L in tb_data.LENGTHS if L <= (args.max_length or args.seq_len)], keys=keys,
                           fact_format=fmt)
    if args.recall_steps or args.recall_mix:  # the recall kind's own cell (3 questions an example)
        out += [val.example(11_000_000 + j, tb_data.LENGTHS[0], "recall", keys=keys, fact_format=fmt)
                for j in range(args.eval_per_cell)]
    return out


def cmd_train(args):
    """Trains, or resumes from RUN/ckpt.pt. With --schedule the options of each step are its phase's
    (tb_schedule.py): a switch in the loop does what a stop and a resume with the new options do (the
    batches, the lr and the val set are functions of the options and the step; the weights and AdamW's
    state carry over). Returns "done" or "stopped"."""
    sched = None
    init, init_step, init_grow = args.init, args.init_step, args.init_grow  # (the schedule's phases replace args)
    if args.schedule:
        try:
            sched = tb_schedule.load(args.schedule, args)
        except ValueError as e:
            raise SystemExit(f"train: {e}") from None
        clash = sorted(k for k in getattr(args, "given", ()) if k in sched.set_options)
        if clash:
            raise SystemExit(f"train: {', '.join('--' + k.replace('_', '-') for k in clash)} set by the schedule "
                             f"{args.schedule}: change it there (add a phase), not on the command line")
        args = sched.phases[0][1]
    else:  # the options checked as a schedule's one phase (from 0: --init-step is checked below, with its message)
        try:
            tb_schedule.check_phase("train", args, 0, None)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    ckpt_path = os.path.join(args.run_dir, "ckpt.pt")
    init_model = None
    if (init_step or init_grow) and not init:
        raise SystemExit(f"train: --init-{'grow' if init_grow else 'step'} needs --init")
    if not 0 <= init_step < (sched.steps if sched else args.steps):
        raise SystemExit(f"train: --init-step {init_step}: in [0, the run's steps)")
    if init and not os.path.exists(ckpt_path):  # (a run with a checkpoint resumes from it: --init is its start)
        try:
            init_model = tb_model.load(init)
        except (OSError, ValueError) as e:
            raise SystemExit(f"train: --init {init}: {e}") from None
        if init_grow:  # (the added layers: tb_model.grow)
            try:
                init_model = tb_model.grow(init_model, model_config(args), args.seed)
            except ValueError as e:
                raise SystemExit(f"train: --init {init} --init-grow: {e}") from None
        elif vars(init_model.cfg) != vars(model_config(args)):
            raise SystemExit(f"train: --init {init} holds a model of {vars(init_model.cfg)}, not the model options' "
                             f"{vars(model_config(args))}")
    torch.set_num_threads(args.threads)
    os.makedirs(args.run_dir, exist_ok=True)
    log = log_to(os.path.join(args.run_dir, "train.log"))
    tok = tokenizer()
    stories = os.path.join(args.stories_dir or os.path.join(args.run_dir, "stories"))
    train = tb_data.Generator(tok, tb_data.load_stories(os.path.join(stories, "train.jsonl")), "train", args.seed)
    val = tb_data.Generator(tok, tb_data.load_stories(os.path.join(stories, "val.jsonl")), "val", args.seed)
    val_sets = {}

    def val_set_of(a):
        key = (a.eval_per_cell, a.max_length, bool(a.recall_steps or a.recall_mix), fact_format_of(a), keys_of(a))
        if key not in val_sets:
            val_sets[key] = train_val_set(val, a)
        return val_sets[key]

    stop_at = stop_time(args.stop_at)
    torch.manual_seed(args.seed)
    ck = torch.load(ckpt_path) if os.path.exists(ckpt_path) else None

    def options_that_ran(done):  # the options of the phase that ran step done - 1 (phase 0's before any)
        return sched.args(done - 1) if sched and done > 0 else sched.phases[0][1] if sched else args

    # (a checkpoint has the layers of the phase that ran its last step: a phase's grow happens at its first step)
    model = tb_model.Model(model_config(options_that_ran(ck["step"] if ck else 0)), seed=args.seed)

    def new_adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    opt = new_adamw(model)
    step = 0
    if ck:
        if ck["config"] != vars(model.cfg):
            raise SystemExit(f"{ckpt_path} holds a model of {ck['config']}, not {vars(model.cfg)}")
        step = ck["step"]
        off = tb_schedule.mismatch(ck["args"], step, sched) if sched else []
        if off:
            raise SystemExit(f"train: {ckpt_path} (step {step}) was trained with {', '.join(off)}: the schedule "
                             f"{args.schedule} does not hold this run's past (extend it with a phase from step {step})")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        log(f"resumed from {ckpt_path} at step {step}")
    elif init_model is not None:
        model.load_state_dict(init_model.state_dict())
        step = init_step
        log(f"start from {init} at step {step} (its weights, a fresh AdamW state): {vars(args)}")
    else:
        log(f"start: {vars(args)}")
    phase = None
    if sched:
        phase = sched.index(step)
        args = sched.phases[phase][1]
        log(f"schedule {args.schedule}: {len(sched.phases)} phases to step {sched.steps}; at step {step} phase {phase} "
            f"(from {sched.phases[phase][0]}): {sched.command(phase, sched.defaults)}")
    log(f"model: {vars(model.cfg)}, {model.n_params()} parameters; val set {len(val_set_of(args))} examples")
    def checkpoint():  # (also when a stop falls on a phase's first step: the phase before it ran the last step)
        save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                     "config": vars(model.cfg), "args": vars(options_that_ran(step))}, ckpt_path)
        export_atomic(model, args.run_dir)

    t0, tokens, acc = time.time(), 0, []
    start_step = step
    end = sched.steps if sched else args.steps  # (a schedule's `end` can come before the last phase's steps)
    while True:
        if sched and sched.index(step) != phase:  # the next phase: as a resume with its options
            phase = sched.index(step)
            args = sched.phases[phase][1]
            log(f"schedule: phase {phase} from step {step}: {sched.command(phase, sched.defaults)}")
        if step >= end:
            break
        at_step = args.stop_step is not None and step >= args.stop_step
        if at_step or stop_at is not None and time.time() >= stop_at:
            checkpoint()
            why = f"--stop-step {args.stop_step}" if at_step else f"the wall-clock stop {args.stop_at} UTC"
            log(f"stopped at step {step}: {why} (rerun the command to resume)")
            return "stopped"
        if model.cfg.n_layers != args.layers:  # a phase's grow (tb_schedule): as train --init --init-grow there
            model = tb_model.grow(model, model_config(args), args.seed)
            opt = new_adamw(model)
            log(f"schedule: the model grown to {args.layers} layers at step {step} (a fresh AdamW state): "
                f"{model.n_params()} parameters")
        for g in opt.param_groups:
            g["lr"] = lr_at(args, step)
        batch = step_batch(train, args, step)
        lm, answer, hit = losses(model, batch, getattr(args, "answer_tokens", "code"))
        loss = lm + args.answer_weight * answer
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += sum(len(e.ids) for e in batch)
        codes = [h[-tb_data.DIGITS:] for hs in hit for h in hs]
        acc.append((float(lm), float(answer), sum(int(h.sum()) for h in codes), sum(h.numel() for h in codes)))
        if step % args.log_every == 0 or step == args.steps:
            dt = time.time() - t0
            n = len(acc)
            hits, total = sum(a[2] for a in acc), max(1, sum(a[3] for a in acc))
            log(f"step {step}/{args.steps} lr {lr_at(args, step - 1):.2e} lm {sum(a[0] for a in acc) / n:.4f} "
                f"answer {sum(a[1] for a in acc) / n:.4f} code-digit acc {hits / total:.3f} "
                f"len<= {max(allowed_lengths(args, step - 1))} {tokens / dt:.0f} tok/s")
            t0, tokens, acc = time.time(), 0, []
        if step % args.ckpt_every == 0 or step == args.steps or step == end:
            checkpoint()
        if step % args.eval_every == 0 or step == args.steps or step == start_step + 1 == 1:
            te = time.time()
            val_set = val_set_of(args)
            cells, vlm = evaluate(model, val_set)
            tot = [sum(c[0] for c in cells.values()), sum(c[1] for c in cells.values())]
            row = {"step": step, "val_lm": vlm, "cells": {f"{k}@{L}": c for (k, L), c in cells.items()}}
            head = ""
            recall = [e for e in val_set if e.meta["kind"] == "recall"]
            if recall:  # the retrieval-head check on the recall cell (cmd_probe's numbers)
                asked, other, _ = retrieval_attention(model, val, recall)
                l, h = selective_head(asked, other)
                row["head"] = [l, h, float(asked[l, h]), float(other[l, h])]
                head = f"; most selective head layer {l} head {h}: {row['head'][2]:.3f} asked / {row['head'][3]:.3f} other"
            log(f"eval step {step}: val lm {vlm:.4f} exact match {tot[0]}/{tot[1]} {format_cells(cells)}{head} "
                f"({time.time() - te:.0f} s)")
            with open(os.path.join(args.run_dir, "eval.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            t0 = time.time() - (te - t0)  # eval time does not count in tok/s
    log("done")
    return "done"


# ---- evaluation, export, parity, bench ----------------------------------------------------------

def eval_lines(checkpoint, stories_dir, split, seed, per_cell, max_length=0, threads=1, fact_format="is", keys="words"):
    """The held-out exact match per (kind, length) of a llama2.c checkpoint, as printed lines."""
    torch.set_num_threads(threads)
    model = tb_model.load(checkpoint)
    gen = tb_data.Generator(tokenizer(), tb_data.load_stories(os.path.join(stories_dir, f"{split}.jsonl")), split, seed)
    lengths = [L for L in tb_data.LENGTHS if L <= (max_length or model.cfg.seq_len)]
    cells, lm = evaluate(model, tb_data.eval_set(gen, per_cell, lengths=lengths, keys=keys, fact_format=fact_format))
    out = []
    for (k, L), (c, t, d) in sorted(cells.items()):
        p = c / t
        out.append(f"{split} {k:6s} {L:5d}: exact match {c}/{t} = {p:.3f} (se {math.sqrt(p * (1 - p) / t):.3f}), "
                   f"answer digits {d / (t * tb_data.DIGITS):.3f}")
    out.append(f"{split} lm loss {lm:.4f}")
    return out


def cmd_eval(args):
    for line in eval_lines(args.checkpoint, args.stories_dir, args.split, args.seed, args.per_cell, args.max_length,
                           args.threads, args.fact_format, args.keys):
        print(line)


def cmd_probe(args):
    """Prints per layer and head the attention mass of the first code digit's prediction onto the asked
    fact's code and onto another fact's code (retrieval_attention), for each kind and length, and the
    most selective head (the largest asked - other)."""
    torch.set_num_threads(args.threads)
    model = tb_model.load(args.checkpoint)
    gen = tb_data.Generator(tokenizer(), tb_data.load_stories(os.path.join(args.stories_dir, f"{args.split}.jsonl")),
                            args.split, args.seed)
    for kind, length in [("recall", 256)] + [(k, L) for L in tb_data.LENGTHS if L <= (args.max_length or 2048)
                                              for k in ("after", "before")]:
        if kind == "recall":
            exs = [gen.example(11_000_000 + j, length, "recall", keys=args.keys, fact_format=args.fact_format)
                   for j in range(args.per_cell)]
        else:  # the needle count cycling 2, 4: a distractor fact in every example
            exs = [gen.example(12_000_000 + j, length, kind, (2, 4)[j % 2], args.keys, args.fact_format)
                   for j in range(args.per_cell)]
        asked, other, n = retrieval_attention(model, gen, exs)
        l, h = selective_head(asked, other)
        print(f"{args.split} {kind:6s} {length:5d}: {n} questions; most selective head layer {l} head {h}: "
              f"{float(asked[l, h]):.3f} on the asked code, {float(other[l, h]):.3f} on another fact's code")
        if args.verbose:
            for li in range(asked.shape[0]):
                print("   layer", li, " ".join(f"{float(a):.2f}/{float(o):.2f}" for a, o in zip(asked[li], other[li])))


FIRST_DIGIT_CLASSES = ("right", "other fact", "other digit", "non-digit")


@torch.no_grad()
def first_digit_errors(model, examples, digit_ids, batch_tokens=4096, enc=None):
    """Per question of the single-question kinds: what the model predicts for the code's first digit
    given the true prefix (the argmax at the space before the code). Classes: `right`; `other fact`
    (the first digit of another fact's code in the context, not the asked one's: retrieval confusion);
    `other digit` (a digit that starts no fact's code here); `non-digit` (any other token). Returns
    rows {kind, length, needles, depth (the asked fact's token position / the example's length),
    class, predicted (token id), shares_word (for `other fact`: the confused fact's key shares its
    colour or object with the asked key), side (for `other fact`: "later" / "earlier" when every fact
    whose code starts with the predicted digit comes after / before the asked fact in the context, else
    "either"), chance (the fraction of the 9 wrong digits that start another fact's code: `other
    fact`'s share of the wrong digits if they were drawn at random), pick (the chance of `right` if the
    model copied the first digit of a fact of the context drawn at random: no key matching)}. With `enc` (the
    generator's ChunkEncoder) also `first_token`: the answer's first token (the key restated, which the
    question-before kind writes from the question at the start) given the prompt: `right`, `other fact` (the
    first answer token of another fact of the context) or `other`."""
    rows = []
    for part in length_batches(examples, batch_tokens):
        logits = model(torch.tensor([e.ids[:-1] for e in part]))
        for b, e in enumerate(part):
            m = e.meta
            t = e.questions[0][-tb_data.DIGITS]  # target position of the first code digit
            pred, truth = int(logits[b, t].argmax()), e.ids[t + 1]
            others = [(k, c, d) for (k, c), d in zip(m["facts"], m["fact_depths"]) if k != m["key"]]
            wrong_firsts = {digit_ids[int(c[0])] for _, c, _ in others} - {truth}
            cls = ("right" if pred == truth else "other fact" if pred in wrong_firsts
                   else "other digit" if pred in digit_ids else "non-digit")
            confused = [(k, d) for k, c, d in others if cls == "other fact" and digit_ids[int(c[0])] == pred]
            sides = {"later" if d > m["depth"] else "earlier" for _, d in confused}
            rows.append({"kind": m["kind"], "length": m["length"], "needles": m["needles"],
                         "depth": m["depth"] / len(e.ids), "class": cls, "predicted": pred,
                         "shares_word": any(set(k.split()) & set(m["key"].split()) for k, _ in confused),
                         "side": sides.pop() if len(sides) == 1 else "either" if sides else "",
                         "chance": len(wrong_firsts) / 9,
                         "pick": sum(f[1][0] == m["code"][0] for f in m["facts"]) / len(m["facts"])})
            if enc is not None:
                t0, fmt = e.questions[0][0], m.get("fact_format", "is")
                others0 = {enc.encode(tb_data.answer_text(k, c, fmt))[0] for k, c, _ in others}
                pred0 = int(logits[b, t0].argmax())
                rows[-1]["first_token"] = ("right" if pred0 == e.ids[t0 + 1] else
                                           "other fact" if pred0 in others0 else "other")
    return rows


def digit_table(rows, key, label=str):
    """Counts of FIRST_DIGIT_CLASSES per value of `key` (a function of a row) as printed lines."""
    out = []
    for v in sorted({key(r) for r in rows}):
        sel = [r for r in rows if key(r) == v]
        n = {c: sum(r["class"] == c for r in sel) for c in FIRST_DIGIT_CLASSES}
        wrong = [r for r in sel if r["class"] in ("other fact", "other digit")]
        chance = sum(r["chance"] for r in wrong) / max(1, len(wrong))
        side = {d: sum(r["side"] == d for r in sel) for d in ("later", "earlier", "either")}
        out.append(f"{label(v):>11s}: {len(sel):4d} questions, " + ", ".join(f"{c} {n[c]}" for c in FIRST_DIGIT_CLASSES)
                   + f" (right by a random fact's code {sum(r['pick'] for r in sel):.1f} "
                      f"sd {math.sqrt(sum(r['pick'] * (1 - r['pick']) for r in sel)):.1f})"
                   + (f"; wrong digits starting another fact's code {n['other fact']}/{len(wrong)} (chance {chance:.2f}; "
                      f"that fact later / earlier / either {side['later']}/{side['earlier']}/{side['either']}, "
                      f"sharing a key word {sum(r['shares_word'] for r in sel)})" if wrong else ""))
    return out


def cmd_digits(args):
    """The first code digit's failures by class (first_digit_errors), per kind x length, needles and depth."""
    torch.set_num_threads(args.threads)
    model = tb_model.load(args.checkpoint)
    gen = split_generator(args)
    lengths = [L for L in tb_data.LENGTHS if L <= (args.max_length or model.cfg.seq_len)]
    rows = first_digit_errors(model, tb_data.eval_set(gen, args.per_cell, lengths=lengths, keys=args.keys,
                                                      fact_format=args.fact_format), gen.digit_ids, enc=gen.enc)
    print(f"{args.checkpoint}: the first code digit of {len(rows)} {args.split} questions, keys {args.keys}, "
          f"facts {args.fact_format} "
          f"(argmax given the true prefix)")
    quarter = lambda r: min(3, int(r["depth"] * 4)) / 4
    for title, key, label in (("kind x length", lambda r: (r["kind"], r["length"]), lambda v: f"{v[0]}@{v[1]}"),
                              ("needles", lambda r: r["needles"], str),
                              ("depth of the asked fact", quarter, lambda v: f"{v:.2f}-{v + 0.25:.2f}"),
                              ("all", lambda r: "all", str)):
        print(f"by {title}:")
        for line in digit_table(rows, key, label):
            print(line)
    print("the answer's first token (the key restated) given the prompt, by kind x length:")
    for v in sorted({(r["kind"], r["length"]) for r in rows}):
        sel = [r["first_token"] for r in rows if (r["kind"], r["length"]) == v]
        print(f"{v[0] + '@' + str(v[1]):>11s}: {len(sel):4d} questions, "
              + ", ".join(f"{c} {sel.count(c)}" for c in ("right", "other fact", "other")))
    if args.out:
        write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))


def synth_example(rng, task, n, key_tokens=1):
    """The diagnosis tasks (docs/testbed.md), on token ids 100..399 (no text): `copy`: a random prefix of
    0..63 tokens, n random tokens, 0..63 random tokens, the n tokens again (loss on the repeat but its
    first token: an induction copy at a random offset); `recall`: n (key, value) pairs (distinct keys
    out of 200, values out of 10: a digit-like alphabet), then n // 2 of the keys again (at least one), each
    followed by its value (loss on those values only); with key_tokens > 1 every key is that many tokens out
    of a 12-token alphabet (distinct keys sharing pieces, as the testbed's keys do in tok512)."""
    if task == "copy":
        pre, s, gap = (rng.integers(100, 400, size=k).tolist() for k in (rng.integers(64), n, rng.integers(64)))
        ids = [1] + pre + s + gap + s
        w = [0.0] * (len(ids) - 1 - n) + [0.0] + [1.0] * (n - 1)
        q = list(range(len(ids) - n, len(ids) - 1))
        return tb_data.Example(ids=ids, weights=w, answers=q, digits=n - 1, questions=[q], meta={})
    if key_tokens == 1:  # keys drawn before the values: the round-five runs' streams
        keys = [[int(k)] for k in rng.choice(np.arange(100, 300), size=n, replace=False)]
    else:  # multi-token keys over a 12-token alphabet, distinct as sequences: pieces shared between keys, as in tok512
        keys = []
        while len(keys) < n:
            k = [int(x) for x in rng.integers(100, 112, size=key_tokens)]
            if k not in keys:
                keys.append(k)
    vals = rng.integers(300, 310, size=n)
    ids, w, qs = [1], [], []
    for k, v in zip(keys, vals):
        ids += k + [int(v)]
        w += [0.0] * (len(k) + 1)
    for j in rng.choice(n, size=max(1, n // 2), replace=False):
        ids += keys[j] + [int(vals[j])]
        w += [0.0] * len(keys[j]) + [1.0]
        qs.append([len(ids) - 2])
    return tb_data.Example(ids=ids, weights=w, answers=[t for q in qs for t in q], digits=1, questions=qs, meta={})


def cmd_synth(args):
    """The diagnosis: a synthetic task through the same model class, loss and AdamW settings as `train`
    (lr with 50 warm-up steps, weight decay 0.1, clip 1); prints the answer tokens' accuracy."""
    torch.set_num_threads(args.threads)
    model = tb_model.Model(model_config(args), seed=args.seed, init_std=args.init_std)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 50)
        batch = [synth_example(rng, args.task, args.n, args.key_tokens) for _ in range(args.batch)]
        lm, _, hits = losses(model, batch)
        opt.zero_grad(set_to_none=True)
        lm.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == 1:
            h = torch.cat([x for hs in hits for x in hs]).float()
            print(f"{args.task} step {step}: loss {float(lm):.3f} answer accuracy {float(h.mean()):.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)


def cmd_plot(args):
    """Exact match and code digits' accuracy against the training step, from RUN/eval.jsonl, as SVG."""
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: a smaller file
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(os.path.join(args.run_dir, "eval.jsonl")) if line.strip()]
    cells = sorted({c for r in rows for c in r["cells"]}, key=lambda c: (c.split("@")[0], int(c.split("@")[1])))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c in cells:
        pts = [(r["step"], r["cells"][c]) for r in rows if c in r["cells"]]
        steps = [p[0] for p in pts]
        style = "-" if c.startswith("recall") else "--" if c.startswith("after") else ":"
        axes[0].plot(steps, [v[0] / v[1] for _, v in pts], style, marker=".", label=c)
        axes[1].plot(steps, [v[2] / (v[1] * tb_data.DIGITS) for _, v in pts], style, marker=".", label=c)
    axes[0].set(xlabel="training step", ylabel="exact match (validation)", ylim=(-0.02, 1.02))
    axes[1].set(xlabel="training step", ylabel="code digits' accuracy (chance 0.1)", ylim=(-0.02, 1.02))
    axes[1].axhline(0.1, color="gray", lw=0.5)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(args.title or os.path.basename(os.path.normpath(args.run_dir)))
    fig.tight_layout()
    fig.savefig(args.out, format="svg" if args.out.endswith(".svg") else None,
                metadata={"Date": None} if args.out.endswith(".svg") else None)
    print(f"{args.out}: {len(rows)} evaluations, steps {rows[0]['step']}..{rows[-1]['step']}")


def cmd_dump(args):
    """The evaluation set of a split as JSON lines, for programs outside Python (the report): the prompt's
    text (a `kvevict-run --prompt`) and ids (BOS first, ending with the space before the answer), the
    answer's ids and text, and the example's metadata."""
    gen = tb_data.Generator(tokenizer(), tb_data.load_stories(os.path.join(args.stories_dir, f"{args.split}.jsonl")),
                            args.split, args.seed)
    lengths = [L for L in tb_data.LENGTHS if L <= (args.max_length or tb_data.LENGTHS[-1])]
    lines = []
    for e in tb_data.eval_set(gen, args.per_cell, lengths=lengths, keys=args.keys, fact_format=args.fact_format):
        n = e.meta["prompt_tokens"]
        lines.append(json.dumps({"prompt": e.text[:e.text.rindex("Answer:") + len("Answer:")],
                                 "prompt_ids": e.ids[:n], "answer": e.text[e.text.rindex("Answer:") + 8:-1],
                                 "answer_ids": e.ids[n:n + len(e.answers)], "meta": e.meta}) + "\n")
    write_atomic(args.out, "".join(lines))


def cmd_export(args):
    ck = torch.load(args.ckpt)
    model = tb_model.Model(tb_model.Config(**ck["config"]))
    model.load_state_dict(ck["model"])
    tb_model.export(model, args.out)
    print(f"{args.out}: step {ck['step']}, {model.n_params()} parameters")


@torch.no_grad()
def greedy(model, ids, steps):
    ids = list(ids)
    while len(ids) < steps:
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


def cmd_parity(args):
    """kvevict-run's full-cache greedy ids against the PyTorch model's, for prompts of the test split."""
    model = tb_model.load(args.checkpoint)
    tok = tokenizer()
    gen = tb_data.Generator(tok, tb_data.load_stories(os.path.join(args.stories_dir, "test.jsonl")), "test", args.seed)
    ok = 0
    cases = [(L, kind) for L, kind in [(256, "after"), (512, "before"), (1024, "after"), (2048, "before")]
             if L <= model.cfg.seq_len][:args.prompts]
    for i, (L, kind) in enumerate(cases):
        e = gen.example(20_000_000 + i, L, kind, 2, args.keys, args.fact_format)
        prompt_text = e.text[:e.text.rindex("Answer:") + len("Answer:")]
        prompt = tok.encode(prompt_text)
        if prompt != e.ids[:e.meta["prompt_tokens"]]:
            raise SystemExit(f"prompt {i}: run.c's encoding of the text differs from the generator's ids")
        steps = min(len(prompt) + args.new_tokens, model.cfg.seq_len)
        ref = subprocess.run([args.kvevict_run, "--model", args.checkpoint, "--prompt", prompt_text, "--ids",
                              "--steps", str(steps), "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True).stdout.split()
        # kvevict-run prints BOS and the tokens of positions 1 .. steps (run.c's count): steps + 1 ids
        mine = greedy(model, prompt, len(ref))
        same = [int(x) for x in ref] == mine and len(ref) == steps + 1
        ok += same
        print(f"prompt {i} ({kind}, {len(prompt)} tokens): runner {'==' if same else '!='} PyTorch over "
              f"{steps - len(prompt)} greedy tokens; continuation {tok.decode(mine[len(prompt):])!r} "
              f"(truth: {tb_data.answer_text(e.meta['key'], e.meta['code'], args.fact_format)})")
    print(f"parity: {ok}/{len(cases)} prompts identical")
    if ok != len(cases):
        raise SystemExit(1)


def cmd_bench(args):
    torch.set_num_threads(args.threads)
    model = tb_model.Model(model_config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(f"model {vars(model.cfg)}: {model.n_params()} parameters, {args.threads} thread(s)")
    for L in tb_data.LENGTHS:
        ids = torch.randint(0, 512, (max(1, args.batch_tokens // L), L))
        times = []
        for _ in range(args.reps):
            t = time.time()
            loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, 512), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.time() - t)
        print(f"length {L}: {ids.numel() / min(times):.0f} tokens/s (best of {args.reps} steps of {ids.numel()} tokens)",
              flush=True)


def train_defaults(run_dir):
    return train_options(argparse.ArgumentParser()).parse_args(["--run-dir", run_dir])


def load_schedule(path, defaults):
    try:
        return tb_schedule.load(path, defaults)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def cmd_schedule(args):
    """The phases as the hand commands they replay; --check: each checkpoint's options are its phase's."""
    defaults = train_defaults("RUN")
    sched = load_schedule(args.schedule, defaults)
    for i, (start, a) in enumerate(sched.phases):
        end = sched.phases[i + 1][0] if i + 1 < len(sched.phases) else sched.steps
        grow = f" --init RUN/model.bin --init-grow --init-step {start}" if i in sched.grows else ""
        print(f"phase {i}: steps {start}..{end - 1}: train {sched.command(i, defaults)}{grow}"
              + (f" --stop-step {end}" if end < a.steps else ""))
    bad = 0
    for path in args.check:
        ck = torch.load(path)
        off = tb_schedule.mismatch(ck["args"], ck["step"], sched)
        bad += bool(off)
        print(f"{path}: step {ck['step']}: " + (f"differs from phase {sched.index(max(0, ck['step'] - 1))}: "
                                               f"{', '.join(off)}" if off else
                                               f"on the schedule (phase {sched.index(max(0, ck['step'] - 1))})"))
    if bad:
        raise SystemExit(1)


def cmd_make(args):
    """From nothing to the shipped model, each step skipped when its output is there (rerun to resume):
    the story pools (kvevict-run), `train --schedule`, the llama2.c export with the training log, the
    held-out test exact match, the runner's parity."""
    for what, path in (("--kvevict-run", args.kvevict_run), ("--schedule", args.schedule)):
        if not os.path.isfile(path):
            raise SystemExit(f"make: {what} {path} is not a file")
    if args.per_cell < 1:
        raise SystemExit(f"make: --per-cell must be >= 1, got {args.per_cell}")
    sched = load_schedule(args.schedule, train_defaults(args.run_dir))
    sizes, sums = sched.stories(), sched.doc.get("stories", {}).get("sha256", {})
    for split, n in sizes.items():
        if n is not None and n > tb_data.SPLITS[split][2]:
            raise SystemExit(f"make: the schedule's {split} pool of {n} stories is larger than the split's "
                             f"{tb_data.SPLITS[split][2]}")
    stories = os.path.join(args.run_dir, "stories")
    os.makedirs(stories, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    log = log_to(os.path.join(args.run_dir, "make.log"))
    log(f"make: {args.schedule} -> {args.out_dir} (run {args.run_dir})")
    for split in ("val", "test", "train"):
        path, n = os.path.join(stories, f"{split}.jsonl"), sizes[split]
        want = n or tb_data.SPLITS[split][2]
        have = sum(1 for _ in open(path)) if os.path.exists(path) else 0
        if have > want:
            raise SystemExit(f"make: {path} holds {have} stories, the schedule {want}")
        if have < want:
            log(f"make: stories {split}: {have} -> {want} (kvevict-run)")
            tb_data.generate_stories(args.kvevict_run, split, path, limit=want, log=log)
        if split in sums and want == tb_data.SPLITS[split][2] and tb_data.sha256_of(path) != sums[split]:
            raise SystemExit(f"make: {path} has sha256 {tb_data.sha256_of(path)}, the schedule's pool {sums[split]}")
    targs = train_options(argparse.ArgumentParser()).parse_args(
        ["--run-dir", args.run_dir, "--schedule", args.schedule] + (["--stop-at", args.stop_at] if args.stop_at else []))
    targs.given = {"run_dir", "schedule"} | ({"stop_at"} if args.stop_at else set())
    if cmd_train(targs) != "done":
        log("make: the training stopped (rerun the same command to resume)")
        return
    run_args = sched.phases[-1][1]
    ck = torch.load(os.path.join(args.run_dir, "ckpt.pt"))
    model = tb_model.Model(tb_model.Config(**ck["config"]))
    model.load_state_dict(ck["model"])
    shipped = os.path.join(args.out_dir, "model.bin")
    tb_model.export(model, shipped + ".tmp")
    os.replace(shipped + ".tmp", shipped)
    for src, name in ((os.path.join(args.run_dir, "train.log"), "train.log"),
                      (os.path.join(args.run_dir, "eval.jsonl"), "eval.jsonl"), (args.schedule, "schedule.json")):
        with open(src, "rb") as f:
            write_atomic(os.path.join(args.out_dir, name), f.read())
    log(f"make: {shipped}: step {ck['step']}, {model.n_params()} parameters, sha256 {tb_data.sha256_of(shipped)}")
    lines = eval_lines(shipped, stories, "test", run_args.seed, args.per_cell, threads=run_args.threads,
                       fact_format=fact_format_of(run_args), keys=keys_of(run_args))
    write_atomic(os.path.join(args.out_dir, "eval_test.txt"), "".join(line + "\n" for line in lines))
    for line in lines:
        log(f"make: {line}")
    buf = io.StringIO()
    pargs = argparse.Namespace(checkpoint=shipped, kvevict_run=args.kvevict_run, stories_dir=stories,
                               seed=run_args.seed, prompts=4, new_tokens=16, threads=1,
                               keys=keys_of(run_args), fact_format=fact_format_of(run_args))
    failed = None
    with contextlib.redirect_stdout(buf):
        try:
            cmd_parity(pargs)
        except SystemExit as e:
            failed = e
    write_atomic(os.path.join(args.out_dir, "parity.txt"), buf.getvalue())
    for line in buf.getvalue().splitlines():
        log(f"make: {line}")
    if failed is not None:
        raise SystemExit(f"make: the runner's greedy ids differ from the PyTorch model's ({args.out_dir}/parity.txt)")
    log(f"make: done: {args.out_dir} holds model.bin, train.log, eval.jsonl, schedule.json, eval_test.txt, parity.txt")


def split_generator(args):
    return tb_data.Generator(tokenizer(), tb_data.load_stories(os.path.join(args.stories_dir, f"{args.split}.jsonl")),
                             args.split, args.seed)


def csv_list(text, conv=str):
    return [conv(x) for x in text.split(",") if x.strip()]


def cmd_report(args):
    """The retrieval report (tb_report.py): every check before any work, the examples, then the runs."""
    for what, path in (("--checkpoint", args.checkpoint), ("--kvevict-run", args.kvevict_run)):
        if not os.path.isfile(path):
            raise SystemExit(f"report: {what} {path} is not a file")
    if not os.path.isdir(args.out_dir):
        raise SystemExit(f"report: --out-dir {args.out_dir} is not a directory")
    args.recipes = csv_list(args.recipes) if args.recipes else [
        r for r in tb_report.RECIPES if r != "lookaheadkv" or args.lookahead_module]
    args.drivers = csv_list(args.drivers) if args.drivers else list(tb_report.DRIVERS)
    args.budgets = csv_list(args.budgets, int)
    known = tb_report.RECIPES + ("duo-heuristic",) + tb_report.HEAD_TYPES
    for r in args.recipes:
        if r not in known:
            raise SystemExit(f"report: --recipes: unknown or unsupported recipe {r!r} (one of {', '.join(known)})")
    heads = [r for r in args.recipes if r in tb_report.HEAD_TYPES]
    if heads:
        if not args.head_mask:
            raise SystemExit(f"report: {heads[0]} needs --head-mask, a mask trained for this model (testbed.py headgates)")
        if len(heads) != len(args.recipes) or len(heads) > 1:
            raise SystemExit(f"report: {heads[0]} sweeps the sparsity (--budgets in %) with its own --head-mask: "
                             "give it a run of its own")
        if any(not 0 < b < 100 for b in args.budgets):
            raise SystemExit(f"report: {heads[0]}: --budgets are sparsities in %, each in (0, 100), got {args.budgets}")
        for b in args.budgets:
            if not os.path.isfile(tb_report.mask_path(args.head_mask, b)):
                raise SystemExit(f"report: --head-mask {args.head_mask}: no file at S = {b} ({{S}} in the path: "
                                 "one mask a sparsity)")
    for d in args.drivers:
        if d not in tb_report.DRIVERS:
            raise SystemExit(f"report: --drivers: unknown driver {d!r} (one of {', '.join(tb_report.DRIVERS)})")
    if "lookaheadkv" in args.recipes and not (args.lookahead_module and os.path.isfile(args.lookahead_module)):
        raise SystemExit("report: lookaheadkv needs --lookahead-module, a module trained for this model (testbed.py lookahead)")
    if not args.budgets or min(args.budgets) < 1:
        raise SystemExit(f"report: --budgets must be positive integers, got {args.budgets}")
    if not (0 < args.fraction <= 1) or args.per_cell < 1 or args.jobs < 1:
        raise SystemExit("report: --fraction must be in (0, 1], --per-cell and --jobs >= 1")
    seq_len = checkpoint_context(args.checkpoint, "report")
    lengths = csv_list(args.lengths, int) if args.lengths else [L for L in tb_data.LENGTHS if L <= seq_len]
    if any(L > seq_len or L not in tb_data.LENGTHS for L in lengths):
        raise SystemExit(f"report: --lengths {lengths}: each one of {tb_data.LENGTHS} and at most the model's context {seq_len}")
    if not 0 <= args.reserve <= min(lengths) - 128:
        raise SystemExit(f"report: --reserve {args.reserve}: in [0, shortest length {min(lengths)} - 128]")
    # examples of at most L - reserve tokens: the context keeps `reserve` rows free for the tokens LAQ, SpecKV and
    # LookaheadKV append after the prompt (their configurations are refused where prompt + those exceed seq_len)
    lengths = [L - args.reserve for L in lengths]
    kinds = csv_list(args.kinds)
    if not kinds or any(k not in ("after", "before") for k in kinds):
        raise SystemExit(f"report: --kinds must be after and/or before, got {kinds}")
    tb_report.kvevict_binding()  # fail now, not after the runs
    gen = split_generator(args)
    examples = [tb_report.Example(e, i) for i, e in
                enumerate(tb_data.eval_set(gen, args.per_cell, lengths=lengths, kinds=tuple(kinds), keys=args.keys,
                                           fact_format=args.fact_format))]
    n_cfg = len(tb_report.configs(args.recipes, args.drivers, args.budgets))
    print(f"report: {len(examples)} examples ({args.split}, lengths {lengths}, {kinds}), {n_cfg} configurations: "
          f"{len(examples) * n_cfg} kvevict-run calls on {args.jobs} processes", file=sys.stderr, flush=True)
    rep = tb_report.run_report(args, examples, log=lambda m: print(m, file=sys.stderr, flush=True))
    rep["command"] = "testbed.py " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("testbed.py") else ""
    md = tb_report.markdown(rep)
    tb_report.write_all(args.out_dir, {"testbed_report.json": json.dumps(rep, indent=1) + "\n",
                                       "testbed_report.md": md, "testbed_report.svg": tb_report.svg(rep)})
    sys.stdout.write(md)
    print(f"report: wrote testbed_report.json, .md and .svg in {args.out_dir} ({rep['seconds']:.0f} s)",
          file=sys.stderr)


def cmd_summary(args):
    """docs/report.md's testbed tables from the report runs' directories (tb_summary.py), on stdout."""
    dirs = {run: getattr(args, run) for run in tb_summary.RUNS if getattr(args, run)}
    if not dirs:
        raise SystemExit("summary: name at least one report directory (--matrix, --query-agnostic, ...)")
    try:
        sys.stdout.write(tb_summary.markdown(tb_summary.load(dirs)))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def checkpoint_context(path, cmd):
    """The context length of the checkpoint a command runs (a clear error for a short or missing file)."""
    try:
        return tb_model.read_config(path).seq_len
    except (OSError, ValueError) as e:
        raise SystemExit(f"{cmd}: --checkpoint {path}: {e}") from None


def lookahead_prompts(gen, first, count, lengths, response, keys="words", fact_format="is"):
    """`count` prompts of a split (ids, BOS first, ending at "Answer:"): example indices first, first + 1, ...,
    the question after / before the context in turn, the lengths and the needle counts (1, 2, 4) cycling;
    each example made `response` tokens shorter than its length so that prompt + response fit in it."""
    out = []
    for j in range(count):
        e = gen.example(first + j, lengths[j // 2 % len(lengths)] - response, ("after", "before")[j % 2], (1, 2, 4)[j % 3],
                        keys, fact_format)
        out.append(e.ids[:e.meta["prompt_tokens"]])
    return out


def trainer_inputs(args, cmd, option, trainer):
    """lookahead's and headgates' checks before any work: the checkpoint and the trainer are files, --lengths
    (default: every length up to the context) fit the context with room for --response, the prompt files'
    directory (--work-dir, else --out's) exists. Returns (lengths, that directory)."""
    for what, path in (("--checkpoint", args.checkpoint), (option, trainer)):
        if not os.path.isfile(path):
            raise SystemExit(f"{cmd}: {what} {path} is not a file")
    seq_len = checkpoint_context(args.checkpoint, cmd)
    lengths = csv_list(args.lengths, int) if args.lengths else [L for L in tb_data.LENGTHS if L <= seq_len]
    if not lengths or any(L > seq_len or L - args.response < 128 for L in lengths):
        raise SystemExit(f"{cmd}: --lengths {lengths}: each at most the context {seq_len} and >= 128 + --response")
    work = args.work_dir or os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(work):
        raise SystemExit(f"{cmd}: {work} is not a directory")
    return lengths, work


def write_prompts(path, args, split, first, count, lengths):
    """`count` retrieval prompts of a split (lookahead_prompts from example `first`) as a token-id file, one
    prompt a line (the trainers' --prompts format), written atomically."""
    gen = tb_data.Generator(tokenizer(), tb_data.load_stories(os.path.join(args.stories_dir, f"{split}.jsonl")), split,
                            args.seed)
    write_atomic(path, "".join(" ".join(map(str, ids)) + "\n" for ids in lookahead_prompts(
        gen, first, count, lengths, args.response, args.keys, args.fact_format)))


def cmd_lookahead(args):
    """LookaheadKV for a testbed model with the existing trainer (kvevict-lookahead train, docs/lookaheadkv.md):
    training prompts from the train split (example indices 30,000,000 ..), validation prompts from the val
    split (31,000,000 ..), written as token-id files next to --out; the responses are the model's greedy ones."""
    if args.train_prompts < 1 or args.val_prompts < 1 or args.response < 2:
        raise SystemExit("lookahead: --train-prompts and --val-prompts must be >= 1, --response >= 2")
    lengths, work = trainer_inputs(args, "lookahead", "--kvevict-lookahead", args.kvevict_lookahead)
    files = {}
    for split, first, count in (("train", 30_000_000, args.train_prompts), ("val", 31_000_000, args.val_prompts)):
        files[split] = os.path.join(work, f"lookahead_{split}_prompts.txt")
        write_prompts(files[split], args, split, first, count, lengths)
        print(f"lookahead: {count} {split} prompts (lengths {lengths}) in {files[split]}", flush=True)
    cmd = [args.kvevict_lookahead, "--model", args.checkpoint, "--threads", str(args.threads), "--response",
           str(args.response), "train", "--out", args.out, "--prompts", files["train"], "--val-prompts", files["val"],
           "--n-lookahead", str(args.n_lookahead), "--steps", str(args.steps), "--batch", str(args.batch),
           "--lr", str(args.lr), "--seed", str(args.seed), "--log-every", str(args.log_every),
           "--validate-every", str(args.validate_every)] + args.extra
    print("lookahead: " + " ".join(cmd[:1] + [c if len(c) < 200 else "..." for c in cmd[1:]]), flush=True)
    raise SystemExit(subprocess.run(cmd).returncode)


def cmd_headgates(args):
    """DuoAttention's gates for a testbed model with the existing trainer (kvevict-headgates duo, docs/prulong.md):
    DuoAttention's passkey setting, retrieval prompts of the train split (example indices 32,000,000 ..,
    apart from the LookaheadKV prompts) with the model's greedy answers as the distilled rows."""
    if args.prompts < 1 or args.response < 1:
        raise SystemExit("headgates: --prompts and --response must be >= 1")
    lengths, work = trainer_inputs(args, "headgates", "--kvevict-headgates", args.kvevict_headgates)
    prompts = os.path.join(work, "headgates_prompts.txt")
    write_prompts(prompts, args, "train", 32_000_000, args.prompts, lengths)
    print(f"headgates: {args.prompts} train prompts (lengths {lengths}) in {prompts}", flush=True)
    cmd = [args.kvevict_headgates, "--model", args.checkpoint, "--threads", str(args.threads), "--prompts", prompts,
           "--response", str(args.response), "--steps", str(args.steps), "--batch", str(args.batch), "--seed",
           str(args.seed), "--log-every", str(args.log_every), "duo", "--out", args.out] + args.extra
    print("headgates: " + " ".join(cmd), flush=True)
    raise SystemExit(subprocess.run(cmd).returncode)


def train_options(p):
    """train's options (also parsed without defaults to see which ones the command line gives)."""
    p.add_argument("--run-dir", required=True)
    p.add_argument("--stories-dir", default=None, help="default RUN/stories")
    p.add_argument("--schedule", default="", help="the run's phases (tb_schedule.py): the options switch at their steps")
    p.add_argument("--init", default="", help="a new run starts from this llama2.c checkpoint's weights (model.bin of "
                                              "the same model options), not from random ones")
    p.add_argument("--init-step", type=int, default=0,
                   help="with --init: the step it starts at (the lr, the curriculum and the batches are the step's)")
    p.add_argument("--init-grow", action="store_true",
                   help="with --init: the checkpoint may hold fewer layers (the same other options); the model's "
                        "first layers are its, the added ones start as identity blocks (tb_model.grow)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--plain", type=float, default=0.2, help="fraction of plain story sequences")
    p.add_argument("--answer-weight", type=float, default=1.0)
    p.add_argument("--answer-tokens", default="code", choices=list(tb_schedule.ANSWER_TOKENS),
                   help="the answer term's tokens: the code digits, or all the answer's tokens (the key restated "
                        "too: the question-before kind has to write the key from the question at the start)")
    p.add_argument("--recall-steps", type=int, default=0,
                   help="steps of the dense associative-recall phase (length 256) before the length curriculum")
    p.add_argument("--recall-mix", type=float, default=0.0,
                   help="after that phase, the fraction of retrieval sequences that stay recall examples")
    p.add_argument("--stop-at", default="", help="wall-clock stop, HH:MM UTC: checkpoint and exit at that time")
    p.add_argument("--stop-step", type=int, default=None, help="checkpoint and exit once this many steps are done")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-per-cell", type=int, default=16)
    p.add_argument("--max-length", type=int, default=0, help="cap the curriculum and the val set (0 = the context)")
    p.add_argument("--min-length", type=int, default=0,
                   help="after the dense-recall phase, train only the curriculum's lengths >= this (the val set keeps all)")
    p.add_argument("--long-weight", type=float, default=1.0,
                   help="draw the curriculum's longest allowed length this many times as often as each other one")
    p.add_argument("--short-keys", type=float, default=0.0,
                   help="fraction of recall / retrieval examples with one-token keys (the key-match curriculum)")
    fact_format_arg(p)
    p.add_argument("--recall-facts", type=int, default=0,
                   help="at most this many facts in a recall example (0: as many as fit; 2: synth's smallest task)")
    model_args(p)
    return p


def given_options(argv):
    """The train options that `argv` (after "train") names: a parse without defaults."""
    p = train_options(argparse.ArgumentParser(add_help=False))
    for a in p._actions:
        a.default = argparse.SUPPRESS
        a.required = False
    return set(vars(p.parse_known_args(argv)[0]))


def fact_format_arg(p):
    p.add_argument("--fact-format", default="is", choices=list(tb_data.FACT_FORMATS),
                   help="facts and answers: 'is' (The blue door's code is 4721.) or 'adjacent' "
                        "(The note said blue door 4721.: the key right before the code)")


def question_args(p):
    """The format of the questions a command makes: the fact sentences and the key table (a trained
    model is evaluated in the format it was trained on)."""
    fact_format_arg(p)
    p.add_argument("--keys", default="words", choices=list(tb_data.KEY_SETS),
                   help="the key table of the questions: words (colour object) or short (one token a key)")


def trainer_args(p, program, out_help):
    """The options of the commands that run a C++ trainer on testbed prompts (lookahead, headgates)."""
    question_args(p)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--" + program, required=True)
    p.add_argument("--stories-dir", required=True)
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--work-dir", default="", help="where the prompt files go (default: --out's directory)")
    p.add_argument("--seed", type=int, default=1)


def model_args(p):
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)


def eval_set_args(p):
    """The options that choose an evaluation set (eval, dump)."""
    p.add_argument("--stories-dir", required=True)
    p.add_argument("--split", default="test", choices=["val", "test"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--per-cell", type=int, default=64)
    p.add_argument("--max-length", type=int, default=0, help="only lengths up to this (0 = all)")
    question_args(p)
    return p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stories", help="the story pools from the shipped model (kvevict-run)")
    p.add_argument("--kvevict-run", required=True)
    p.add_argument("--out-dir", required=True)
    train_options(sub.add_parser("train", help="train (or resume from RUN/ckpt.pt)"))
    p = sub.add_parser("schedule", help="a schedule's phases as hand commands; checks checkpoints against it")
    p.add_argument("--schedule", required=True)
    p.add_argument("--check", nargs="*", default=[], help="checkpoints (ckpt.pt) that must be on the schedule")
    p = sub.add_parser("make", help="from nothing to the shipped model: stories, train --schedule, export, eval, parity")
    p.add_argument("--schedule", required=True)
    p.add_argument("--kvevict-run", required=True)
    p.add_argument("--run-dir", required=True, help="the run (RUN/stories, RUN/ckpt.pt, logs); rerun to resume")
    p.add_argument("--out-dir", required=True, help="what ships: model.bin, train.log, eval.jsonl, schedule.json, eval_test.txt, parity.txt")
    p.add_argument("--stop-at", default="", help="wall-clock stop of the training, HH:MM UTC (rerun to resume)")
    p.add_argument("--per-cell", type=int, default=64, help="held-out test examples per (kind, length)")
    p = eval_set_args(sub.add_parser("eval", help="exact-match retrieval accuracy of a llama2.c checkpoint"))
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--threads", type=int, default=1)
    p = eval_set_args(sub.add_parser("probe", help="the retrieval-head check: attention onto the asked fact's code"))
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--verbose", action="store_true", help="every layer and head")
    p = eval_set_args(sub.add_parser("digits", help="diagnosis: the first code digit's failures (wrong fact's code or not)"))
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="", help="the per-question rows as JSON lines")
    p = sub.add_parser("synth", help="diagnosis: a synthetic copy / associative-recall task, same model and optimizer")
    p.add_argument("--task", choices=["copy", "recall"], required=True)
    p.add_argument("--n", type=int, default=16, help="copy: tokens repeated; recall: pairs")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--key-tokens", type=int, default=1, help="recall: tokens a key (> 1: a 12-token alphabet)")
    model_args(p)
    p = sub.add_parser("plot", help="learning curves (RUN/eval.jsonl) as SVG")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    p = eval_set_args(sub.add_parser("dump", help="an evaluation set as JSON lines (prompt text and ids, answer)"))
    p.add_argument("--out", required=True)
    p = sub.add_parser("export", help="ckpt.pt -> llama2.c checkpoint")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("parity", help="kvevict-run's greedy ids == the PyTorch model's")
    question_args(p)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--kvevict-run", required=True)
    p.add_argument("--stories-dir", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p = eval_set_args(sub.add_parser("report", help="retrieval exact match vs KV budget and footprint (kvevict-run)"))
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--kvevict-run", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--lengths", default="", help="comma-separated (default: every length up to the context)")
    p.add_argument("--kinds", default="after,before")
    p.add_argument("--reserve", type=int, default=0,
                   help="examples of at most length - this tokens (room for LAQ's / LookaheadKV's 16 appended tokens)")
    p.add_argument("--budgets", default="32,64,128,256", help="tokens kept per KV head, comma-separated")
    p.add_argument("--window", type=int, default=32, help="observation window (the question's ~25 tokens fit)")
    p.add_argument("--recipes", default="", help="comma-separated (default: every recipe of tb_report.RECIPES)")
    p.add_argument("--drivers", default="", help="comma-separated (default: all; the runner report's matrix)")
    p.add_argument("--lookahead-module", default="", help="lookaheadkv's module for this model (else left out)")
    p.add_argument("--head-mask", default="", help="duo's or prulong's head mask for this model ({S} in the path: one "
                                                   "a sparsity); a run with them takes --budgets as sparsities in %%")
    p.add_argument("--fraction", type=float, default=0.9, help="F of the critical footprint")
    p.add_argument("--bootstrap", type=int, default=200)
    p.add_argument("--jobs", type=int, default=2, help="kvevict-run processes at a time")
    p.add_argument("--threads", type=int, default=1, help="threads of each kvevict-run")
    p.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--results", default="", help="a JSON-lines file of every call's result: a rerun with it runs only "
                   "the calls it lacks (tb_report.ResultStore)")
    p = sub.add_parser("summary", help="docs/report.md's testbed tables from the report runs' JSON")
    for run in tb_summary.RUNS:
        p.add_argument("--" + run.replace("_", "-"), default="", help=f"the {run.replace('_', ' ')} run's directory")
    p = sub.add_parser("lookahead", help="train LookaheadKV for a testbed model (kvevict-lookahead on testbed prompts)")
    trainer_args(p, "kvevict-lookahead", "the module file")
    p.add_argument("--lengths", default="", help="comma-separated (default: every length up to the context)")
    p.add_argument("--train-prompts", type=int, default=512)
    p.add_argument("--val-prompts", type=int, default=32)
    p.add_argument("--response", type=int, default=24, help="greedy response tokens (the answer is ~16-21)")
    p.add_argument("--n-lookahead", type=int, default=16)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--validate-every", type=int, default=200)
    p.add_argument("extra", nargs="*", help="further kvevict-lookahead train options (after --)")
    p = sub.add_parser("headgates", help="train DuoAttention's gates for a testbed model (kvevict-headgates duo on "
                                         "testbed prompts)")
    trainer_args(p, "kvevict-headgates", "the alpha TSV file")
    p.add_argument("--lengths", default="256,512,1024", help="comma-separated (the trainer's cost grows with the square)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--response", type=int, default=8, help="greedy tokens after the prompt (the answer: ~7)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("extra", nargs="*", help="further kvevict-headgates duo options (after --)")
    p = sub.add_parser("bench", help="training tokens/s per length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    model_args(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.cmd == "train":
        args.given = given_options(argv[1:])
    if args.cmd == "stories":
        os.makedirs(args.out_dir, exist_ok=True)
        for split in ("val", "test", "train"):
            tb_data.generate_stories(args.kvevict_run, split, os.path.join(args.out_dir, f"{split}.jsonl"),
                                     log=log_to(None))
    else:
        {"train": cmd_train, "eval": cmd_eval, "probe": cmd_probe, "digits": cmd_digits, "synth": cmd_synth, "plot": cmd_plot, "dump": cmd_dump, "export": cmd_export, "parity": cmd_parity,
         "report": cmd_report, "summary": cmd_summary, "lookahead": cmd_lookahead, "headgates": cmd_headgates, "schedule": cmd_schedule, "make": cmd_make,
         "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    main()
