"""The long-context testbed (examples/testbed, docs/testbed.md): the data generator is deterministic and
its splits are disjoint, examples encode exactly as run.c's encoder, the llama2.c export round-trips,
and the C++ runner's logits and greedy ids on an exported checkpoint equal the PyTorch model's."""
import argparse
import collections
import contextlib
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

SOURCE_DIR = os.environ.get("KVEVICT_SOURCE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(SOURCE_DIR, "examples", "testbed"))
import tb_data  # noqa: E402
import tb_model  # noqa: E402
import testbed  # noqa: E402

STORIES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she "
    "saw a big, red ball. She wanted to play with it, but it was too high.",
    "Tim had a dog named Spot. Spot liked to run and jump! Every morning they went to the lake. \"Look, a boat!\" "
    "said Tim. They were very happy.",
    "The sun was warm. A bird sang in the tree. Sue smiled and waved at the bird. Then she went home to eat.",
]


@pytest.fixture(scope="module")
def tok():
    return testbed.tokenizer()


def test_splits_are_disjoint():
    ranges = [set(tb_data.story_seeds(s)) for s in tb_data.SPLITS]
    assert all(not (a & b) for i, a in enumerate(ranges) for b in ranges[i + 1:])
    assert len({v[0] for v in tb_data.SPLITS.values()}) == len(tb_data.SPLITS)  # distinct example streams


def test_generator_is_deterministic_and_seeded(tok):
    a = tb_data.Generator(tok, STORIES, "train", 7)
    b = tb_data.Generator(tok, STORIES, "train", 7)
    for i, (L, kind, n) in enumerate([(256, "after", 1), (512, "before", 4), (256, "plain", 1), (1024, "after", 2)]):
        ea, eb = a.example(i, L, kind, n), b.example(i, L, kind, n)
        assert ea.ids == eb.ids and ea.weights == eb.weights and ea.answers == eb.answers and ea.meta == eb.meta
    other_seed = tb_data.Generator(tok, STORIES, "train", 8).example(0, 256, "after")
    other_split = tb_data.Generator(tok, STORIES, "test", 7).example(0, 256, "after")
    first = a.example(0, 256, "after")
    assert other_seed.meta["code"] != first.meta["code"] or other_seed.meta["key"] != first.meta["key"]
    assert other_split.meta["code"] != first.meta["code"] or other_split.meta["key"] != first.meta["key"]


@pytest.mark.parametrize("kind,needles", [("after", 1), ("before", 1), ("after", 4), ("before", 2), ("plain", 1)])
@pytest.mark.parametrize("length", [256, 2048])
def test_examples_encode_as_run_c_and_hold_their_facts(tok, kind, needles, length):
    gen = tb_data.Generator(tok, STORIES, "val", 3)
    for i in range(2):
        e = gen.example(i, length, kind, needles)
        if length <= 512:  # reference.Tokenizer merges in O(n^2): the chunking does not depend on the length
            assert e.ids == tok.encode(e.text)  # the runner's encoding of the example's text
        assert length - 64 < len(e.ids) <= length and len(e.weights) == len(e.ids) - 1
        if kind == "plain":
            assert e.answers == [] and min(e.weights) == 1.0
            continue
        code, key = e.meta["code"], e.meta["key"]
        assert e.text.endswith(f"Answer: the {key}'s code is {code}.")
        assert sum(f"The {k}'s code is {c}." in e.text for k, c in e.meta["facts"]) == needles
        assert len({k for k, _ in e.meta["facts"]}) == needles
        question = f"Question: What is the {key}'s code?"
        assert e.text.startswith(question) == (kind == "before")
        assert tok.decode([e.ids[t + 1] for t in e.answers]) == f" the {key}'s code is {code}"
        assert tok.decode([e.ids[t + 1] for t in e.answers[-e.digits:]]) == code and e.digits == 4
        assert e.meta["prompt_tokens"] == e.answers[0] + 1 == len(e.ids) - len(e.answers) - 1
        assert tok.decode([e.ids[e.meta["prompt_tokens"] - 1]]) == ":"
        # the asked fact starts at its recorded depth; its digits carry no loss
        fact = tok.encode(f"The {key}'s code is {code}.")[1:]
        d = e.meta["depth"]
        assert e.ids[d:d + len(fact)] == fact
        assert e.weights[d + len(fact) - 6:d + len(fact) - 2] == [0.0] * 4


def test_stories_from_the_runner_are_deterministic(tmp_path):
    run = built("KVEVICT_RUN")
    for name in ("a.jsonl", "b.jsonl"):
        tb_data.generate_stories(run, "val", str(tmp_path / name), limit=2)
    a, b = tb_data.load_stories(str(tmp_path / "a.jsonl")), tb_data.load_stories(str(tmp_path / "b.jsonl"))
    assert a == b and len(a) == 2 and a[0] != a[1] and a[0].startswith("Once upon a time")
    tb_data.generate_stories(run, "test", str(tmp_path / "t.jsonl"), limit=1)
    assert tb_data.load_stories(str(tmp_path / "t.jsonl"))[0] not in a


def small_model(seed=5):
    m = tb_model.Model(tb_model.Config(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                       seq_len=2048), seed=seed)
    with torch.no_grad():  # larger weights than training's init: peaked logits, no near-ties for greedy
        for p in (m.tok, m.wq, m.wk, m.wv, m.wo, m.w1, m.w2, m.w3):
            p.mul_(10.0)
    return m


def exported_small_model(tmp_path):
    """small_model() and its llama2.c export (tmp_path/m.bin)."""
    m = small_model()
    path = str(tmp_path / "m.bin")
    tb_model.export(m, path)
    return m, path


def built(variable):
    """The path of a program CTest names in `variable`; skips the test when it is not built."""
    path = os.environ.get(variable, "")
    if not path or not os.path.exists(path):
        pytest.skip(f"{variable} is not built (the examples are off)")
    return path


def test_export_round_trip_and_reference_model(tmp_path, tok):
    m = small_model()
    path = str(tmp_path / "m.bin")
    tb_model.export(m, path)
    c = m.cfg
    hs = c.head_size
    floats = (c.vocab_size * c.dim + c.n_layers * (2 * c.dim + 2 * c.dim * c.dim + 2 * c.n_kv_heads * hs * c.dim
                                                    + 3 * c.dim * c.hidden_dim) + c.dim + 2 * c.seq_len * hs // 2)
    assert os.path.getsize(path) == 28 + 4 * floats
    back = tb_model.load(path)
    assert vars(back.cfg) == vars(m.cfg)
    for (n, p), (_, q) in zip(m.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), n
    # python/kvevict/reference.py reads the file as the runner does and computes the same logits
    ref = testbed.reference().Model.load(path)
    ids = tok.encode(" ".join(STORIES))
    with torch.no_grad():
        mine = m(torch.tensor([ids]))[0]
    theirs = ref.forward(ref.new_cache(), ids)
    assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    # a truncated file is refused
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(raw[:-4])
    with pytest.raises(ValueError, match="the header implies"):
        tb_model.load(path)


def test_runner_matches_the_pytorch_model_on_an_exported_checkpoint(tmp_path, tok):
    helper = built("KVEVICT_RUNNER_LOGITS")
    m, path = exported_small_model(tmp_path)
    gen = tb_data.Generator(tok, STORIES, "test", 1)
    e = gen.example(0, 512, "before", 2)
    prompt = e.text[:e.text.rindex("Answer:") + len("Answer:")]
    steps = e.meta["prompt_tokens"] + 16
    out = tmp_path / "logits.f32"
    ids = subprocess.run([helper, path, testbed.TOKENIZER, prompt, str(steps), str(out)], check=True,
                         capture_output=True, text=True).stdout.split()
    ids = [int(i) for i in ids]
    assert ids[:e.meta["prompt_tokens"]] == e.ids[:e.meta["prompt_tokens"]]
    assert ids == testbed.greedy(m, ids[:e.meta["prompt_tokens"]], steps)
    ref = torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(-1, 512))
    with torch.no_grad():
        mine = m(torch.tensor([ids]))[0]
    assert mine.shape == ref.shape
    assert float((mine - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_training_resumes_bit_identically(tmp_path):
    stories = tmp_path / "stories"
    stories.mkdir()
    for split in ("train", "val"):  # a story pool is a file of JSON strings, one per line
        (stories / f"{split}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    common = ["train", "--stories-dir", str(stories), "--dim", "32", "--hidden", "48", "--layers", "2", "--heads", "4",
              "--kv-heads", "2", "--seq-len", "512", "--max-length", "256", "--batch-tokens", "512", "--warmup", "2",
              "--log-every", "1", "--ckpt-every", "2", "--eval-every", "1000", "--eval-per-cell", "1"]
    threads = torch.get_num_threads()
    try:
        testbed.main(common + ["--run-dir", str(tmp_path / "a"), "--steps", "4"])
        testbed.main(common + ["--run-dir", str(tmp_path / "b"), "--steps", "2"])
        testbed.main(common + ["--run-dir", str(tmp_path / "b"), "--steps", "4"])  # resumes at step 2
    finally:
        torch.set_num_threads(threads)  # train sets one thread
    a, b = torch.load(tmp_path / "a" / "ckpt.pt"), torch.load(tmp_path / "b" / "ckpt.pt")
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert "resumed from" in (tmp_path / "b" / "train.log").read_text()
    assert (tmp_path / "a" / "model.bin").read_bytes() == (tmp_path / "b" / "model.bin").read_bytes()


def test_training_starts_from_an_exported_checkpoint(tmp_path):
    """train --init: a new run starts from a llama2.c checkpoint's weights at --init-step (stopping there
    exports the same bytes), then trains and resumes from its own ckpt.pt; a checkpoint of other model
    options, a missing file and --init-step without --init are refused before the run directory exists."""
    stories = tmp_path / "stories"
    stories.mkdir()
    for split in ("train", "val"):
        (stories / f"{split}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    common = ["train", "--stories-dir", str(stories), "--dim", "32", "--hidden", "48", "--layers", "2", "--heads", "4",
              "--kv-heads", "2", "--seq-len", "512", "--max-length", "256", "--batch-tokens", "512", "--warmup", "2",
              "--log-every", "1", "--ckpt-every", "1000", "--eval-every", "1000", "--eval-per-cell", "1",
              "--steps", "4"]
    init = str(tmp_path / "a" / "model.bin")
    threads = torch.get_num_threads()
    try:
        testbed.main(common + ["--run-dir", str(tmp_path / "a"), "--stop-step", "2"])
        testbed.main(common + ["--run-dir", str(tmp_path / "b"), "--init", init, "--init-step", "2",
                               "--stop-step", "2"])
        assert (tmp_path / "b" / "model.bin").read_bytes() == (tmp_path / "a" / "model.bin").read_bytes()
        assert torch.load(tmp_path / "b" / "ckpt.pt")["step"] == 2
        testbed.main(common + ["--run-dir", str(tmp_path / "b"), "--init", init, "--init-step", "2"])
        with pytest.raises(SystemExit, match="holds a model of"):
            testbed.main(common + ["--run-dir", str(tmp_path / "c"), "--init", init, "--heads", "8"])
        with pytest.raises(SystemExit, match="--init-step 4: in"):
            testbed.main(common + ["--run-dir", str(tmp_path / "c"), "--init", init, "--init-step", "4"])
        with pytest.raises(SystemExit, match="--init-step needs --init"):
            testbed.main(common + ["--run-dir", str(tmp_path / "c"), "--init-step", "1"])
        with pytest.raises(SystemExit, match="--init .*nothing.bin"):
            testbed.main(common + ["--run-dir", str(tmp_path / "c"), "--init", str(tmp_path / "nothing.bin")])
        with pytest.raises(SystemExit, match="--init-grow: .* grows only into more layers"):
            testbed.main(common + ["--run-dir", str(tmp_path / "c"), "--init", init, "--init-grow", "--heads", "8"])
        with pytest.raises(SystemExit, match="--init-grow needs --init"):
            testbed.main(common + ["--run-dir", str(tmp_path / "c"), "--init-grow"])
    finally:
        torch.set_num_threads(threads)
    assert not (tmp_path / "c").exists()
    log = (tmp_path / "b" / "train.log").read_text()
    assert f"start from {init} at step 2" in log and "resumed from" in log and "step 4/4" in log
    b = torch.load(tmp_path / "b" / "ckpt.pt")
    assert b["step"] == 4 and (tmp_path / "b" / "model.bin").read_bytes() != (tmp_path / "a" / "model.bin").read_bytes()


def test_grown_model_computes_the_small_ones_function(tmp_path):
    """tb_model.grow: the added layers are identity blocks at the start (the same logits to float
    rounding), the first layers are the small model's, and the grown model trains (train --init-grow)."""
    small = tb_model.Model(tb_model.Config(32, 48, 2, 4, 2, 512, 512), seed=3)
    big = tb_model.grow(small, tb_model.Config(32, 48, 3, 4, 2, 512, 512), seed=1)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(small(ids), big(ids))
    assert torch.equal(big.wq[:2], small.wq) and big.wq[2].abs().sum() > 0 and big.wo[2].abs().sum() == 0
    with pytest.raises(ValueError, match="grows only into more layers"):
        tb_model.grow(big, tb_model.Config(32, 48, 2, 4, 2, 512, 512), seed=1)
    stories = tmp_path / "stories"
    stories.mkdir()
    for split in ("train", "val"):
        (stories / f"{split}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    tb_model.export(small, str(tmp_path / "small.bin"))
    threads = torch.get_num_threads()
    try:
        testbed.main(["train", "--stories-dir", str(stories), "--dim", "32", "--hidden", "48", "--layers", "3",
                      "--heads", "4", "--kv-heads", "2", "--seq-len", "512", "--max-length", "256", "--batch-tokens",
                      "512", "--warmup", "1", "--log-every", "1", "--ckpt-every", "1000", "--eval-every", "1000",
                      "--eval-per-cell", "1", "--steps", "2", "--run-dir", str(tmp_path / "g"), "--init",
                      str(tmp_path / "small.bin"), "--init-grow"])
    finally:
        torch.set_num_threads(threads)
    grown = tb_model.load(str(tmp_path / "g" / "model.bin"))
    assert grown.cfg.n_layers == 3 and grown.wo[2].abs().sum() > 0  # (trained: the new block's output moved)


def test_dump_writes_prompts_that_encode_to_their_ids(tmp_path, tok):
    stories = tmp_path / "stories"
    stories.mkdir()
    (stories / "test.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    out = tmp_path / "set.jsonl"
    testbed.main(["dump", "--stories-dir", str(stories), "--per-cell", "2", "--max-length", "256", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and [r["meta"]["kind"] for r in rows] == ["after", "after", "before", "before"]
    for r in rows:
        assert tok.encode(r["prompt"]) == r["prompt_ids"] and r["prompt"].endswith("Answer:")
        assert tok.decode(r["answer_ids"]).lstrip() == r["answer"] == f"the {r['meta']['key']}'s code is {r['meta']['code']}"


def test_recall_examples_are_deterministic_and_answerable_from_their_context(tok):
    a = tb_data.Generator(tok, STORIES, "train", 7)
    b = tb_data.Generator(tok, STORIES, "train", 7)
    for i, L in enumerate([256, 512, 1024]):
        e, f = a.example(i, L, "recall"), b.example(i, L, "recall")
        assert e.ids == f.ids and e.weights == f.weights and e.questions == f.questions and e.meta == f.meta
        assert len(e.ids) <= L and len(e.weights) == len(e.ids) - 1
        if L == 256:
            assert e.ids == tok.encode(e.text)
        m = e.meta
        assert len(e.questions) == L // 128 + 1 == len(m["asked"]) <= m["needles"] == len(m["facts"])
        assert len({k for k, _ in m["facts"]}) == len(m["facts"])  # distinct keys
        assert e.answers == [t for q in e.questions for t in q] and e.digits == tb_data.DIGITS
        spans = a.questions_facts(e)
        for q, (key, code), (span, others) in zip(e.questions, m["asked"], spans):
            # the answer is the asked fact restated, and that fact is in the context before its question
            assert tok.decode([e.ids[t + 1] for t in q]) == f" the {key}'s code is {code}"
            fact = tok.encode(f"The {key}'s code is {code}.")[1:]
            d = m["depths"][[k for k, _ in m["asked"]].index(key)]
            assert e.ids[d:d + len(fact)] == fact and d + len(fact) <= q[0]
            # the code span is the space and the digits of that fact, which carry no loss there
            assert [e.ids[p] for p in span] == fact[-6:-1] and tok.decode(fact[-5:-1]) == code
            assert all(e.weights[p - 1] == 0.0 for p in span)
            assert len(others) == len(m["facts"]) - 1 and all(set(o).isdisjoint(span) for o in others)
        assert len({k for k, _ in m["asked"]}) == len(m["asked"])  # every question about a different fact
    # another seed or split: other examples (the splits' story pools are disjoint: test_splits_are_disjoint)
    first = a.example(0, 256, "recall").meta["asked"]
    assert tb_data.Generator(tok, STORIES, "train", 8).example(0, 256, "recall").meta["asked"] != first
    assert tb_data.Generator(tok, STORIES, "val", 7).example(0, 256, "recall").meta["asked"] != first


def test_code_spans_of_the_single_question_kinds(tok):
    gen = tb_data.Generator(tok, STORIES, "val", 3)
    for kind in ("after", "before"):
        e = gen.example(1, 512, kind, 4)
        (span, others), = gen.questions_facts(e)
        assert span == gen.code_span((e.meta["key"], e.meta["code"]), e.meta["depth"])
        assert tok.decode([e.ids[p] for p in span]).strip() == e.meta["code"] and len(others) == 3
        codes = {tok.decode([e.ids[p] for p in o]).strip() for o in others}
        assert codes == {c for k, c in e.meta["facts"] if k != e.meta["key"]}


def test_attention_probe_rows_are_the_model_attention():
    m = small_model()
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(3))
    rows = [0, 5, 255, 256, 299]
    with torch.no_grad():
        plain = m(ids)
        logits, maps = m(ids, probe_rows=rows)
    assert torch.equal(plain, logits) and len(maps) == m.cfg.n_layers
    for a in maps:
        assert a.shape == (1, m.cfg.n_heads, len(rows), 300)
        assert torch.allclose(a.sum(-1), torch.ones(1, m.cfg.n_heads, len(rows)), atol=1e-5)
        for j, r in enumerate(rows):
            assert float(a[0, :, j, r + 1:].abs().sum()) == 0.0  # causal
    # layer 0's rows recomputed naively from the weights: softmax(q k^T / sqrt(hs)) with RoPE, GQA
    c, hs = m.cfg, m.cfg.head_size
    with torch.no_grad():
        xb = m.rmsnorm(m.tok[ids], m.rms_att[0])
        q = m.rope((xb @ m.wq[0].T).view(1, 300, c.n_heads, hs))[0]
        k = m.rope((xb @ m.wk[0].T).view(1, 300, c.n_kv_heads, hs))[0]
        for h in range(c.n_heads):
            kh = k[:, h // (c.n_heads // c.n_kv_heads)]
            for j, r in enumerate(rows):
                ref = torch.softmax(q[r, h] @ kh[:r + 1].T / hs ** 0.5, dim=-1)
                assert torch.allclose(maps[0][0, h, j, :r + 1], ref, atol=1e-6)


def test_recall_phase_comes_first_and_stop_time(tok):
    gen = tb_data.Generator(tok, STORIES, "train", 1)
    args = argparse.Namespace(seed=1, steps=10, recall_steps=4, recall_mix=0.0, plain=0.0,
                              batch_tokens=1024, seq_len=2048, max_length=512)
    for step in range(10):
        batch = testbed.step_batch(gen, args, step)
        kinds = {e.meta["kind"] for e in batch}
        assert (kinds == {"recall"}) == (step < 4) and (step < 4) == (testbed.allowed_lengths(args, step) == [256])
        assert all(len(e.questions) >= 1 for e in batch)
    assert testbed.stop_time("") is None
    t = testbed.stop_time(time.strftime("%H:%M", time.gmtime(time.time() + 120)))
    assert 0 < t - time.time() <= 180


def test_min_length_keeps_the_curriculums_long_lengths(tok):
    """--min-length M: after the dense-recall phase only the curriculum's lengths >= M (its longest while every
    allowed length is shorter); 0 changes nothing, and the step's batch has that length."""
    gen = tb_data.Generator(tok, STORIES, "train", 1)
    base = dict(seed=1, steps=100, recall_steps=4, recall_mix=0.0, plain=0.0, batch_tokens=2048, seq_len=2048,
                max_length=0)
    plain, longer = argparse.Namespace(**base, min_length=0), argparse.Namespace(**base, min_length=1024)
    assert testbed.allowed_lengths(plain, 99) == [256, 512, 1024, 2048]
    assert testbed.allowed_lengths(longer, 99) == [1024, 2048]
    assert testbed.allowed_lengths(longer, 3) == [256]  # the dense-recall phase is not touched
    assert testbed.allowed_lengths(longer, 10) == [512]  # the curriculum's top is 512 at 6 % of the steps
    assert testbed.allowed_lengths(argparse.Namespace(**base), 99) == testbed.allowed_lengths(plain, 99)
    for step in range(60, 70):
        assert all(512 < len(e.ids) <= 2048 for e in testbed.step_batch(gen, longer, step))


def test_long_weight_draws_the_longest_length_more_often(tok):
    """--long-weight W: the curriculum's longest allowed length W times as often as each other one; 1 draws
    as without the option (the same lengths, the same batches)."""
    base = dict(seed=1, steps=4000, recall_steps=0, recall_mix=0.0, plain=0.0, batch_tokens=2048, seq_len=2048,
                max_length=0, min_length=0)
    plain, one, four = (argparse.Namespace(**base, **w) for w in ({}, {"long_weight": 1.0}, {"long_weight": 4.0}))

    def lengths(args, steps):
        out = []
        for step in steps:
            out.append(testbed.draw_length(testbed.step_rng(args, step), testbed.allowed_lengths(args, step),
                                           getattr(args, "long_weight", 1.0)))
        return out
    late = range(3000, 4000)  # every length allowed
    assert lengths(plain, late) == lengths(one, late)
    counts = collections.Counter(lengths(four, late))
    assert sorted(counts) == [256, 512, 1024, 2048]
    assert abs(counts[2048] / 1000 - 4 / 7) < 0.05 and all(abs(counts[L] / 1000 - 1 / 7) < 0.04 for L in (256, 512, 1024))
    assert set(lengths(four, range(0, 50))) == {256, 512}  # the curriculum's top at 1 %: 512 drawn 4 times as often
    gen = tb_data.Generator(tok, STORIES, "train", 1)
    assert [e.ids for e in testbed.step_batch(gen, one, 3500)] == [e.ids for e in testbed.step_batch(gen, plain, 3500)]
    with pytest.raises(SystemExit, match="long-weight must be > 0, got 0.0"):
        testbed.main(["train", "--run-dir", "/nonexistent/x", "--long-weight", "0"])


def test_train_checks_the_command_line_options_as_a_phase(tmp_path, capsys):
    """train without --schedule checks its options as tb_schedule checks a schedule's phase, before any
    work: a bad option is refused by name and the run directory is not made; the defaults pass."""
    testbed.tb_schedule.check_phase("train", testbed.train_defaults(str(tmp_path / "run")), 0, None)
    run = tmp_path / "run"
    for option, value, message in [("--steps", "0", "steps must be >= 1, got 0"),
                                   ("--plain", "1.5", r"plain must be in \[0, 1\], got 1.5"),
                                   ("--recall-mix", "-0.1", r"recall-mix must be in \[0, 1\], got -0.1"),
                                   ("--threads", "0", "threads must be >= 1, got 0"),
                                   ("--long-weight", "0", "long-weight must be > 0, got 0.0"),
                                   ("--lr", "0", "lr must be > 0 and answer-weight >= 0, got 0.0 and 1.0"),
                                   ("--answer-weight", "-1", "lr .* answer-weight >= 0, got 0.002 and -1.0"),
                                   ("--warmup", "-1", "warmup must be >= 0, got -1"),
                                   ("--eval-every", "0", "eval-every must be >= 1, got 0")]:
        with pytest.raises(SystemExit, match=f"train: {message}"):
            testbed.main(["train", "--run-dir", str(run), option, value])
        assert not run.exists()
    with pytest.raises(SystemExit, match="--init-step 9: in"):  # (its own message, before --init is read)
        testbed.main(["train", "--run-dir", str(run), "--init", str(tmp_path / "nothing.bin"), "--init-step", "9",
                      "--steps", "4"])
    with pytest.raises(SystemExit):  # argparse's choices
        testbed.main(["train", "--run-dir", str(run), "--fact-format", "nonsense"])
    assert "--fact-format: invalid choice" in capsys.readouterr().err and not run.exists()


def test_synthetic_diagnosis_tasks():
    rng = np.random.default_rng(0)
    for _ in range(20):
        e = testbed.synth_example(rng, "copy", 8)
        assert len(e.weights) == len(e.ids) - 1 and sum(e.weights) == 7 == len(e.questions[0])
        rep = e.ids[-8:]
        first = max(i for i in range(1, len(e.ids) - 8) if e.ids[i:i + 8] == rep)  # the earlier occurrence
        assert [e.ids[t + 1] for t in e.questions[0]] == rep[1:] and first + 8 <= len(e.ids) - 8
        assert all(e.weights[t] == 1.0 for t in e.questions[0])
        r = testbed.synth_example(rng, "recall", 6)
        pairs = dict(zip(r.ids[1:13:2], r.ids[2:13:2]))
        assert len(pairs) == 6 and len(r.questions) == 3 and sum(r.weights) == 3
        for (t,) in r.questions:  # the query's key is the token at t, its answer the pair's value
            assert r.ids[t + 1] == pairs[r.ids[t]] and r.weights[t] == 1.0
        m = testbed.synth_example(rng, "recall", 4, key_tokens=3)  # 4 keys of 3 tokens, then 2 queries
        keys = [tuple(m.ids[1 + 4 * j:4 + 4 * j]) for j in range(4)]
        vals = dict(zip(keys, m.ids[4:17:4]))
        assert len(set(keys)) == 4 and all(100 <= t < 112 for k in keys for t in k) and len(m.questions) == 2
        for (t,) in m.questions:  # the query's key is the 3 tokens ending at t
            assert tuple(m.ids[t - 2:t + 1]) in vals and m.ids[t + 1] == vals[tuple(m.ids[t - 2:t + 1])]
        assert sum(m.weights) == 2 and len(m.weights) == len(m.ids) - 1


def test_training_stops_at_the_wall_clock_and_resumes(tmp_path, monkeypatch):
    stories = tmp_path / "stories"
    stories.mkdir()
    for split in ("train", "val"):
        (stories / f"{split}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    common = ["train", "--stories-dir", str(stories), "--run-dir", str(tmp_path / "r"), "--dim", "32", "--hidden",
              "48", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "512", "--max-length", "256",
              "--batch-tokens", "512", "--warmup", "2", "--steps", "3", "--recall-steps", "2", "--eval-every", "1000",
              "--eval-per-cell", "1", "--ckpt-every", "1000"]
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(testbed, "stop_time", lambda hhmm: 0.0)  # already past: stop before the first step
        testbed.main(common + ["--stop-at", "00:00"])
        assert torch.load(tmp_path / "r" / "ckpt.pt")["step"] == 0 and (tmp_path / "r" / "model.bin").exists()
        monkeypatch.undo()
        testbed.main(common)
    finally:
        torch.set_num_threads(threads)
    log = (tmp_path / "r" / "train.log").read_text()
    assert "stopped at step 0" in log and "resumed from" in log and "recall@256" in log
    assert "most selective head layer" in log
    assert torch.load(tmp_path / "r" / "ckpt.pt")["step"] == 3
    rows = [json.loads(r) for r in (tmp_path / "r" / "eval.jsonl").read_text().splitlines()]
    assert rows and all(len(r["head"]) == 4 and 0.0 <= r["head"][3] <= 1.0 for r in rows)


def test_report_scores_the_runner_and_writes_its_files(tmp_path, tok):
    """testbed.py report on an exported random model: the runner's greedy answer is scored against a target
    the PyTorch model's greedy continuation makes (exact match 1 with the full cache and with a budget that
    keeps the whole prompt; the runner's ids are the PyTorch model's), footprints come from the runner's
    --stats, and the critical footprint is kvevict.critical_footprint of the mean curve."""
    run = built("KVEVICT_RUN")
    import tb_report
    m, path = exported_small_model(tmp_path)
    gen = tb_data.Generator(tok, STORIES, "test", 1)
    examples = [tb_report.Example(e, i) for i, e in
                enumerate(tb_data.eval_set(gen, 1, lengths=(256,), kinds=("after", "before")))]
    for ex in examples:  # the target: what the model itself decodes greedily after the prompt
        ex.answer = testbed.greedy(m, ex.prompt, len(ex.prompt) + len(ex.answer))[len(ex.prompt):]
    opts = argparse.Namespace(kvevict_run=run, checkpoint=path, threads=1, window=8, lookahead_module="",
                              recipes=["snapkv", "h2o"], drivers=["postfill", "chunked-naive", "decode"],
                              budgets=[16, 512], jobs=2, progress_every=1e9, fraction=0.9, bootstrap=20,
                              split="test", per_cell=1)
    rep = tb_report.run_report(opts, examples, log=lambda _: None)
    rows = {(r["recipe"], r["driver"], r["budget"], r["kind"]): r for r in rep["rows"]}
    assert len(rows) == 2 * (1 + 5 * 2) and not rep["skipped"]  # (full + (snapkv x 3 drivers + h2o x 2) x 2 budgets) x 2 kinds
    for kind in ("after", "before"):
        full = rows[("full", "postfill", 0, kind)]
        assert full["exact_match"] == 1.0 and full["footprint"] == 1.0 and full["code_digits"] == 1.0
        keep_all = rows[("snapkv", "postfill", 512, kind)]  # 512 >= the prompt: nothing is evicted
        assert keep_all["exact_match"] == 1.0 and "d_snapkv" not in keep_all  # it is the reference row
        assert rows[("snapkv", "chunked-naive", 512, kind)]["exact_match"] == 1.0
        for (rc, d, b, k), r in rows.items():
            if k == kind and rc != "full":
                assert 0.0 < r["footprint"] <= 1.0 and 0.0 <= r["exact_match"] <= 1.0
                if b == 16:  # evicting to 16 of ~250 rows per head holds less KV than keeping them all
                    assert r["footprint"] < rows[(rc, d, 512, kind)]["footprint"]
        assert rows[("h2o", "postfill", 16, kind)]["d_snapkv"]["mean"] == (
            rows[("h2o", "postfill", 16, kind)]["exact_match"] - rows[("snapkv", "postfill", 16, kind)]["exact_match"])
    # the critical footprint of one curve, recomputed from its rows with the library function
    kvevict = tb_report.kvevict_binding()
    c = next(x for x in rep["critical"] if (x["recipe"], x["driver"], x["kind"]) == ("snapkv", "postfill", "after"))
    pts = [rows[("snapkv", "postfill", b, "after")] for b in (16, 512)]
    ref = kvevict.critical_footprint([p["footprint"] for p in pts], [p["exact_match"] for p in pts], 1.0, 0.9)
    assert c["critical"]["footprint"] == ref[0] and c["critical"]["kind"] == str(ref[2]).split(".")[-1]
    # the command: files written, tables and plot
    stories = tmp_path / "stories"
    stories.mkdir()
    (stories / "test.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    out = tmp_path / "rep"
    out.mkdir()
    testbed.main(["report", "--checkpoint", path, "--kvevict-run", run, "--stories-dir", str(stories), "--per-cell",
                  "1", "--lengths", "256", "--kinds", "after", "--budgets", "16,32", "--recipes", "snapkv",
                  "--drivers", "postfill", "--window", "8", "--bootstrap", "5", "--out-dir", str(out)])
    files = sorted(os.listdir(out))
    assert files == ["testbed_report.json", "testbed_report.md", "testbed_report.svg"]
    rep = json.loads((out / "testbed_report.json").read_text())
    assert [r["budget"] for r in rep["rows"]] == [0, 16, 32] and rep["examples"][0]["kind"] == "after"
    assert "## Critical KV footprint" in (out / "testbed_report.md").read_text()
    assert (out / "testbed_report.svg").read_text().startswith("<?xml")
    # --reserve: the examples are that many tokens shorter (room for LAQ's pseudo tokens at the full context)
    testbed.main(["report", "--checkpoint", path, "--kvevict-run", run, "--stories-dir", str(stories), "--per-cell",
                  "1", "--lengths", "256", "--kinds", "after", "--budgets", "16", "--recipes", "snapkv", "--drivers",
                  "postfill", "--window", "8", "--bootstrap", "5", "--reserve", "16", "--out-dir", str(out)])
    rep = json.loads((out / "testbed_report.json").read_text())
    assert rep["lengths"] == [240] and rep["examples"][0]["length"] == 240
    assert 128 < rep["examples"][0]["prompt_tokens"] + rep["examples"][0]["answer_tokens"] <= 240
    with pytest.raises(SystemExit, match="--reserve 129"):
        testbed.main(["report", "--checkpoint", path, "--kvevict-run", run, "--stories-dir", str(stories),
                      "--lengths", "256", "--reserve", "129", "--out-dir", str(out)])
    with pytest.raises(SystemExit, match="needs --lookahead-module"):
        testbed.main(["report", "--checkpoint", path, "--kvevict-run", run, "--stories-dir", str(stories),
                      "--recipes", "lookaheadkv", "--out-dir", str(out)])
    short = out / "short.bin"
    with open(path, "rb") as f:
        short.write_bytes(f.read(20))
    with pytest.raises(SystemExit, match="report: --checkpoint .*short.bin: 20 bytes, shorter than a checkpoint's"):
        testbed.main(["report", "--checkpoint", str(short), "--kvevict-run", run, "--stories-dir", str(stories),
                      "--out-dir", str(out)])


def test_report_head_type_rows_sweep_the_sparsity(tmp_path, tok):
    """duo with a head mask: its sweep is over the sparsity (kvevict-run --head-sparsity S/100 with the mask), the
    chunked driver streams during the prefill (the footprint falls with S; post-fill it stays near 1), results are
    keyed by the mask's sha256, the tables say S; prulong with one mask per sparsity ({S} in the path); the command
    refuses a missing mask, mixed sweeps, bad S."""
    run = built("KVEVICT_RUN")
    import tb_report
    m, path = exported_small_model(tmp_path)
    mask = tmp_path / "duo.tsv"
    mask.write_text("0.9\t0.2\n0.7\t0.4\n")  # 2 layers x 2 KV heads, DuoAttention's alpha
    gen = tb_data.Generator(tok, STORIES, "test", 1)
    examples = [tb_report.Example(e, i)
                for i, e in enumerate(tb_data.eval_set(gen, 1, lengths=(256,), kinds=("after",)))]
    opts = argparse.Namespace(kvevict_run=run, checkpoint=path, threads=1, window=8, lookahead_module="",
                              head_mask=str(mask), recipes=["duo"], drivers=["postfill", "chunked-naive", "decode"],
                              budgets=[25, 75], jobs=2, progress_every=1e9, fraction=0.9, bootstrap=5, split="test",
                              per_cell=1, results=str(tmp_path / "results.jsonl"))
    rep = tb_report.run_report(opts, examples, log=lambda _: None)
    rows = {(r["recipe"], r["driver"], r["budget"]): r for r in rep["rows"]}
    duo = {("duo", d, s) for d in ("postfill", "chunked-naive") for s in (25, 75)}
    assert set(rows) == {("full", "postfill", 0)} | duo
    assert rep["head_mask"] == str(mask) and not rep["skipped"]
    chunked = [rows[("duo", "chunked-naive", s)]["footprint"] for s in (25, 75)]
    assert chunked[1] < chunked[0] < rows[("duo", "postfill", 25)]["footprint"]  # 1 / 3 streaming heads, then fewer
    assert rows[("duo", "postfill", 75)]["footprint"] > 0.9  # post-fill: the whole prompt is held while it is read
    md = tb_report.markdown(rep)
    assert "| method / driver | S = 25 % | S = 75 % |" in md and "sparsities [25, 75] (% streaming heads" in md
    store = tb_report.ResultStore(opts.results, opts)
    key = store.key(examples[0], ("duo", "chunked-naive", 75))
    assert json.loads(key)[1] == tb_data.sha256_of(str(mask)) and json.loads(key)[5] == 0 and key in store.held
    # prulong: one mask per sparsity ({S} in the path), each call keyed by its own mask
    for S, text in ((25, "1\t0\n1\t1\n"), (75, "1\t0\n0\t0\n")):
        (tmp_path / f"p-s{S}.tsv").write_text(text)
    opts.recipes, opts.drivers, opts.head_mask = ["prulong"], ["chunked-naive"], str(tmp_path / "p-s{S}.tsv")
    rep = tb_report.run_report(opts, examples, log=lambda _: None)
    fp = {r["budget"]: r["footprint"] for r in rep["rows"] if r["recipe"] == "prulong"}
    assert set(fp) == {25, 75} and fp[75] < fp[25] and not rep["skipped"]
    store = tb_report.ResultStore(opts.results, opts)
    for S in (25, 75):
        key = store.key(examples[0], ("prulong", "chunked-naive", S))
        assert json.loads(key)[1] == tb_data.sha256_of(str(tmp_path / f"p-s{S}.tsv")) and key in store.held
    stories = tmp_path / "stories"
    stories.mkdir()
    (stories / "test.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    common = ["report", "--checkpoint", path, "--kvevict-run", run, "--stories-dir", str(stories),
              "--out-dir", str(tmp_path)]
    for extra, message in ((["--recipes", "duo"], "duo needs --head-mask"),
                           (["--recipes", "prulong", "--head-mask", str(tmp_path / "p-s{S}.tsv"), "--budgets", "25,50"],
                            "no file at S = 50"),
                           (["--recipes", "duo,prulong", "--head-mask", str(mask)], "give it a run of its own"),
                           (["--recipes", "duo,snapkv", "--head-mask", str(mask)], "give it a run of its own"),
                           (["--recipes", "duo", "--head-mask", str(mask), "--budgets", "25,100"],
                            "each in \\(0, 100\\)")):
        with pytest.raises(SystemExit, match=message):
            testbed.main(common + extra)


def test_paper_pairs_are_paired_over_the_examples():
    """The seed papers' pairs: A - B of exact match per example (mean, standard error, p), only where the
    report holds both rows; the markdown's table lists them with the Bonferroni count of that table."""
    import tb_report
    ems = {"lookaheadkv": [1, 1, 1, 0], "snapkv": [0, 1, 0, 0], "laq": [1, 1, 1, 0]}
    rows = [{"recipe": rc, "driver": "postfill", "budget": 32, "kind": "before", "n": 4, "exact_match": np.mean(em),
             "se": 0.0, "footprint": 0.5, "per_example": {"exact_match": em, "footprint": [0.5] * 4},
             "per_length": {"256": [np.mean(em[:2]), 0.5], "512": [np.mean(em[2:]), 0.5]}}
            for rc, em in ems.items()]
    rep = {"model": "m.bin", "split": "test", "per_cell": 2, "lengths": [256, 512], "kinds": ["before"],
           "budgets": [32], "window": 32, "rows": rows, "critical": [], "skipped": [], "fraction_of_full": 0.9}
    pairs = tb_report.paper_pairs(rep)
    got = {(a[0], b[0]): d for a, b, _, kind, budget, d in pairs}
    assert set(got) == {("lookaheadkv", "snapkv"), ("lookaheadkv", "laq"), ("laq", "snapkv")}  # others lack rows
    d = got[("lookaheadkv", "snapkv")]  # differences 1, 0, 1, 0
    assert d["mean"] == 0.5 and abs(d["se"] - np.std([1, 0, 1, 0], ddof=1) / 2) < 1e-12 and 0 < d["p"] < 0.1
    assert got[("lookaheadkv", "laq")] == {"mean": 0.0, "se": 0.0, "p": 1.0}
    md = tb_report.markdown(rep)
    assert "## The seed papers' pairs" in md and "p < 0.05 / 3" in md
    assert "| lookaheadkv − snapkv | LookaheadKV | before | +0.500 ± 0.289 |" in md
    # the longest length's table: the rows' per-length means at 512 (the examples' second half)
    assert "## Exact match at 512 tokens" in md and "| lookaheadkv | before | 0.500 ± 0.500 |" in md
    assert "| snapkv | before | 0.000 ± 0.500 |" in md


def test_report_results_file_resumes_and_checks_another_runners_results(tmp_path, tok):
    """report --results: the second run makes no kvevict-run call and gives the same rows; a cut-short last
    line is dropped, a bad line elsewhere refused; another binary's results are used once a sample rerun
    agrees, and refused when one differs."""
    run = built("KVEVICT_RUN")
    import tb_report
    _, path = exported_small_model(tmp_path)
    gen = tb_data.Generator(tok, STORIES, "test", 1)
    examples = [tb_report.Example(e, i) for i, e in
                enumerate(tb_data.eval_set(gen, 1, lengths=(256,), kinds=("after", "before")))]
    store = tmp_path / "results.jsonl"
    opts = argparse.Namespace(kvevict_run=run, checkpoint=path, threads=1, window=8, lookahead_module="",
                              recipes=["snapkv"], drivers=["postfill"], budgets=[16, 512], jobs=2,
                              progress_every=1e9, fraction=0.9, bootstrap=5, split="test", per_cell=1,
                              results=str(store))
    first = tb_report.run_report(opts, examples, log=lambda _: None)
    assert first["calls_run"] == 6 and len(store.read_text().splitlines()) == 6  # (full + 2 budgets) x 2 examples
    again = tb_report.run_report(opts, examples, log=lambda _: None)
    assert again["calls_run"] == 0 and again["rows"] == first["rows"]
    wider = tb_report.run_report(argparse.Namespace(**dict(vars(opts), budgets=[16, 32, 512])), examples,
                                 log=lambda _: None)
    assert wider["calls_run"] == 2  # only the new budget's calls
    lines = store.read_text().splitlines()
    store.write_text("\n".join(lines) + "\n" + lines[0][:30])  # a line cut short by a kill
    assert tb_report.run_report(opts, examples, log=lambda _: None)["calls_run"] == 0
    store.write_text("\n".join(lines[:3] + ["{oops"] + lines[3:]) + "\n")
    with pytest.raises(SystemExit, match="line 4 is not a result line"):
        tb_report.run_report(opts, examples, log=lambda _: None)
    other = [dict(json.loads(line), runner="another") for line in lines]
    store.write_text("".join(json.dumps(r) + "\n" for r in other))
    said = []
    assert tb_report.run_report(opts, examples, log=said.append)["rows"] == first["rows"]
    assert "6 of 6 calls from --results" in said[0] and "6 by another kvevict-run: 6 rerun, the same" in said[0]
    for r in other:
        r["result"]["em"] = 1 - r["result"].get("em", 0)
    store.write_text("".join(json.dumps(r) + "\n" for r in other))
    with pytest.raises(SystemExit, match="another kvevict-run's result for example"):
        tb_report.run_report(opts, examples, log=lambda _: None)


def test_report_md_tables_are_the_committed_reports(tmp_path):
    """docs/report.md's testbed tables (full cache, budget sweep, 2032 cell, the papers' pairs, larger budgets, head
    types) are `testbed.py summary` of the committed docs/testbed/report*/ JSON, row for row."""
    d = os.path.join(SOURCE_DIR, "docs", "testbed")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        testbed.main(["summary", "--matrix", os.path.join(d, "report"), "--query-agnostic",
                      os.path.join(d, "report-lookahead"), "--budgets", os.path.join(d, "report-budgets"),
                      "--window8", os.path.join(d, "report-window8"), "--at-2048", os.path.join(d, "report-2048"),
                      "--head-types", os.path.join(d, "report-duo"), "--prulong", os.path.join(d, "report-prulong")])
    with open(os.path.join(SOURCE_DIR, "docs", "report.md")) as f:
        doc = set(f.read().splitlines())
    checked = 0
    for section in ("\n" + printed.getvalue()).split("\n### ")[1:]:
        title, *lines = section.splitlines()
        if title.startswith(("Window 8", "Critical")):  # (the doc cites these in its text)
            continue
        for line in lines[3:]:  # (the data rows after the blank line, the header and the rule; a second table's all)
            if line:
                assert line in doc, f"{title}: {line}"
                checked += 1
    assert checked == 2 + 21 + 6 + 18 + 6 + 2 + 4  # (the head types: Duo's rows, PruLong's table)
    with pytest.raises(SystemExit, match="summary: name at least one report directory"):
        testbed.main(["summary"])
    with pytest.raises(SystemExit, match="summary: matrix: .*testbed_report.json"):
        testbed.main(["summary", "--matrix", str(tmp_path)])


def test_lookahead_prompts_leave_room_for_the_response(tok):
    gen = tb_data.Generator(tok, STORIES, "train", 1)
    prompts = testbed.lookahead_prompts(gen, 30_000_000, 6, [256, 512], 24)
    assert len(prompts) == 6
    for j, ids in enumerate(prompts):
        L = [256, 512][j // 2 % 2]
        assert ids[0] == 1 and len(ids) + 24 <= L and tok.decode(ids[-1:]) == ":"
        text = tok.decode(ids[1:])
        assert text.rstrip().endswith("Answer:") and text.lstrip().startswith("Question:") == (j % 2 == 1)
    assert prompts == testbed.lookahead_prompts(gen, 30_000_000, 6, [256, 512], 24)  # a function of the seed


def test_headgates_writes_retrieval_prompts_and_runs_the_duo_trainer(tmp_path, tok):
    """testbed.py headgates: the train split's retrieval prompts (lookahead_prompts from example 32,000,000) in
    WORK/headgates_prompts.txt, then kvevict-headgates duo on them (a stand-in program records its arguments)."""
    m, path = exported_small_model(tmp_path)
    stories = tmp_path / "stories"
    stories.mkdir()
    (stories / "train.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    fake = tmp_path / "kvevict-headgates"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args.txt\n")
    fake.chmod(0o755)
    out = tmp_path / "duo.tsv"
    common = ["headgates", "--checkpoint", path, "--kvevict-headgates", str(fake), "--stories-dir", str(stories),
              "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        testbed.main(common + ["--prompts", "4", "--lengths", "256,512", "--response", "8", "--steps", "3"])
    assert done.value.code == 0
    lines = (tmp_path / "headgates_prompts.txt").read_text().splitlines()
    gen = tb_data.Generator(tok, STORIES, "train", 1)
    expected = testbed.lookahead_prompts(gen, 32_000_000, 4, [256, 512], 8)
    assert [[int(x) for x in line.split()] for line in lines] == expected
    args = (tmp_path / "args.txt").read_text().split()
    assert args[args.index("--prompts") + 1] == str(tmp_path / "headgates_prompts.txt")
    assert args[-3:] == ["duo", "--out", str(out)]
    assert args[args.index("--response") + 1] == "8" and args[args.index("--steps") + 1] == "3"
    with pytest.raises(SystemExit, match="--lengths \\[4096\\]"):
        testbed.main(common + ["--lengths", "4096"])


TINY = ["--dim", "32", "--hidden", "48", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "512"]
PHASES = [  # 3 phases over 6 steps: the lr schedule re-stretched, the mix, the lengths and the loss change
    {"from": 0, "set": {"steps": 6, "recall-steps": 2, "max-length": 256, "batch-tokens": 512, "warmup": 2}},
    {"from": 2, "set": {"steps": 9, "plain": 0.5, "recall-mix": 0.5, "lr": 3e-3}},
    {"from": 4, "set": {"steps": 6, "answer-weight": 3.0, "max-length": 0}},
]
HAND = [  # the same run by hand: stop at each phase's end, resume with its options on the command line
    ["--steps", "6", "--recall-steps", "2", "--max-length", "256", "--batch-tokens", "512", "--warmup", "2",
     "--stop-step", "2"],
    ["--steps", "9", "--recall-steps", "2", "--max-length", "256", "--batch-tokens", "512", "--warmup", "2",
     "--plain", "0.5", "--recall-mix", "0.5", "--lr", "3e-3", "--stop-step", "4"],
    ["--steps", "6", "--recall-steps", "2", "--max-length", "0", "--batch-tokens", "512", "--warmup", "2",
     "--plain", "0.5", "--recall-mix", "0.5", "--lr", "3e-3", "--answer-weight", "3"],
]


def tiny_pools(tmp_path):
    stories = tmp_path / "stories"
    stories.mkdir()
    for split in ("train", "val", "test"):
        (stories / f"{split}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    return stories


def train_runs(runs):
    threads = torch.get_num_threads()
    try:
        for argv in runs:
            testbed.main(argv)
    finally:
        torch.set_num_threads(threads)  # train sets one thread


def assert_same_state(a, b):
    a, b = torch.load(a), torch.load(b)
    assert a["step"] == b["step"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for p in sa:
        for k in sa[p]:
            assert torch.equal(sa[p][k], sb[p][k]), (p, k)
    return a, b


def test_schedule_equals_the_hand_resumes_and_resumes_mid_phase(tmp_path):
    stories = tiny_pools(tmp_path)
    sched = tmp_path / "schedule.json"
    sched.write_text(json.dumps({"run": {"seed": 3}, "phases": PHASES}))
    common = ["train", "--stories-dir", str(stories), "--log-every", "1", "--ckpt-every", "1000", "--eval-every",
              "1000", "--eval-per-cell", "1", "--seed", "3"] + TINY
    train_runs([common + ["--run-dir", str(tmp_path / "hand")] + h for h in HAND])
    common = common[:-len(TINY) - 2] + TINY  # the seed is the schedule's
    train_runs([common + ["--run-dir", str(tmp_path / "sched"), "--schedule", str(sched)]])
    train_runs([common + ["--run-dir", str(tmp_path / "mid"), "--schedule", str(sched), "--stop-step", str(s)]
                for s in (3, 5)] + [common + ["--run-dir", str(tmp_path / "mid"), "--schedule", str(sched)]])
    hand, straight = assert_same_state(tmp_path / "hand" / "ckpt.pt", tmp_path / "sched" / "ckpt.pt")
    assert hand["step"] == 6 and straight["args"]["answer_weight"] == 3.0 and straight["args"]["lr"] == 3e-3
    assert_same_state(tmp_path / "sched" / "ckpt.pt", tmp_path / "mid" / "ckpt.pt")
    for run in ("sched", "mid"):
        assert (tmp_path / "hand" / "model.bin").read_bytes() == (tmp_path / run / "model.bin").read_bytes()
    log = (tmp_path / "mid" / "train.log").read_text()
    assert "stopped at step 3: --stop-step 3" in log and "at step 3 phase 1 (from 2)" in log
    assert "schedule: phase 2 from step 4" in log and log.rstrip().endswith("done")
    # the lr the log prints per step is the hand run's
    lr = lambda text: [line.split(" lr ")[1].split()[0] for line in text.splitlines() if " lr " in line]
    assert lr((tmp_path / "hand" / "train.log").read_text()) == lr((tmp_path / "sched" / "train.log").read_text())

    # a checkpoint of another past is refused, and so is an option the schedule sets
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"run": {"seed": 3}, "phases": PHASES[:2] + [dict(PHASES[2], set={"steps": 7})]}))
    with pytest.raises(SystemExit, match=r"trained with steps 6 \(schedule: 7\), answer-weight 3.0 \(schedule: 1.0\), "
                                         r"max-length 0 \(schedule: 256\)"):
        train_runs([common + ["--run-dir", str(tmp_path / "sched"), "--schedule", str(other)]])
    with pytest.raises(SystemExit, match="--steps set by the schedule"):
        train_runs([common + ["--run-dir", str(tmp_path / "x"), "--schedule", str(sched), "--steps", "7"]])


def test_schedule_grow_and_end_equal_the_hand_run(tmp_path):
    """A phase's grow is train --init RUN/model.bin --init-grow --init-step FROM there, and `end` is a
    --stop-step: the same weights and AdamW state, straight or stopped and resumed at and after the grow."""
    stories = tiny_pools(tmp_path)
    first = {"from": 0, "set": {"steps": 6, "recall-steps": 2, "max-length": 256, "batch-tokens": 512, "warmup": 2}}
    sched = tmp_path / "schedule.json"
    shape = {"dim": 32, "hidden": 48, "layers": 2, "heads": 4, "kv-heads": 2, "seq-len": 512}  # TINY
    sched.write_text(json.dumps({"run": dict(shape, seed=3), "end": 6, "phases": [
        first, {"from": 3, "set": {"steps": 8, "lr": 3e-3}, "grow": {"layers": 3}}]}))
    common = ["train", "--stories-dir", str(stories), "--log-every", "1", "--ckpt-every", "1000", "--eval-every",
              "1000", "--eval-per-cell", "1", "--seed", "3"] + TINY
    opts = ["--recall-steps", "2", "--max-length", "256", "--batch-tokens", "512", "--warmup", "2"]
    hand = tmp_path / "hand"
    grown = [x if x != "2" or common[i - 1] != "--layers" else "3" for i, x in enumerate(common)]
    train_runs([common + ["--run-dir", str(tmp_path / "small"), "--steps", "6", "--stop-step", "3"] + opts,
                grown + ["--run-dir", str(hand), "--init", str(tmp_path / "small" / "model.bin"), "--init-grow",
                         "--init-step", "3", "--steps", "8", "--lr", "3e-3", "--stop-step", "6"] + opts])
    common = common[:-len(TINY) - 2]  # (the seed and the shape are the schedule's)
    train_runs([common + ["--run-dir", str(tmp_path / "sched"), "--schedule", str(sched)]])
    train_runs([common + ["--run-dir", str(tmp_path / "mid"), "--schedule", str(sched), "--stop-step", str(s)]
                for s in (3, 4)] + [common + ["--run-dir", str(tmp_path / "mid"), "--schedule", str(sched)]])
    a, b = assert_same_state(hand / "ckpt.pt", tmp_path / "sched" / "ckpt.pt")
    assert a["step"] == 6 and b["config"]["n_layers"] == 3 and b["args"]["layers"] == 3
    assert_same_state(tmp_path / "sched" / "ckpt.pt", tmp_path / "mid" / "ckpt.pt")
    log = (tmp_path / "mid" / "train.log").read_text()
    assert "stopped at step 3" in log and log.count("the model grown to 3 layers at step 3") == 1
    assert "stopped at step 4" in log and log.rstrip().endswith("done")
    lr = lambda text: [line.split(" lr ")[1].split()[0] for line in text.splitlines() if " lr " in line]
    assert lr((tmp_path / "small" / "train.log").read_text()) + lr((hand / "train.log").read_text()) == \
        lr((tmp_path / "sched" / "train.log").read_text())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        testbed.main(["schedule", "--schedule", str(sched)])
    assert "phase 1: steps 3..5: train" in printed.getvalue() and "--layers 3" in printed.getvalue()
    assert "--init RUN/model.bin --init-grow --init-step 3 --stop-step 6" in printed.getvalue()


@pytest.mark.parametrize("phases,message", [
    ([{"from": 1, "set": {"steps": 4}}], "starts at step 0"),
    ([{"from": 0, "set": {"steps": 4}}, {"from": 0, "set": {"steps": 5}}], "not after the previous"),
    ([{"from": 0, "set": {"steps": 2}}, {"from": 3, "set": {"steps": 5}}], "before the next phase"),
    ([{"from": 0, "set": {"steps": 4, "dim": 8}}], "'dim' is not one of"),
    ([{"from": 0, "set": {"steps": 4.5}}], "steps must be an integer"),
    ([{"from": 0, "set": {"steps": 4, "plain": 2}}], r"plain must be in \[0, 1\]"),
    ([{"from": 0, "set": {"steps": 4, "fact-format": "next"}}], "fact-format must be one of is, adjacent"),
    ([{"from": 0, "set": {"steps": 4, "fact-format": 1}}], "fact-format must be a string"),
    ([{"from": 0, "set": {"steps": 4, "answer-tokens": "key"}}], "answer-tokens must be one of code, all"),
    ([{"from": 0, "set": {"steps": 4, "min-length": -1}}], "min-length must be >= 0"),
    ([], "non-empty list"),
    ([{"from": 0, "set": {"steps": 4}, "grow": {"layers": 9}}], "in a phase after the first"),
    ([{"from": 0, "set": {"steps": 4}}, {"from": 2, "grow": {"layers": 2}}], "more than the 4 layers"),
    ([{"from": 0, "set": {"steps": 4}}, {"from": 2, "grow": {"layers": 6, "dim": 8}}], "is {\"layers\": n}"),
])
def test_schedule_errors(tmp_path, phases, message):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"phases": phases}))
    with pytest.raises(ValueError, match=message):
        testbed.tb_schedule.load(str(path), testbed.train_defaults("R"))


@pytest.mark.parametrize("end", [2, 5, "4", True])
def test_schedule_end_errors(tmp_path, end):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"end": end, "phases": [{"from": 0, "set": {"steps": 4}}, {"from": 2}]}))
    with pytest.raises(ValueError, match="\"end\" must be a step after the last phase's start 2 and at most its steps 4"):
        testbed.tb_schedule.load(str(path), testbed.train_defaults("R"))


def test_the_committed_schedule_is_the_runs_hand_resumes():
    """examples/testbed/schedule.json replays the run's RESUME.txt commands (docs/testbed.md, "Reproduce")."""
    sched = testbed.tb_schedule.load(os.path.join(SOURCE_DIR, "examples", "testbed", "schedule.json"),
                                     testbed.train_defaults("R"))
    assert [p for p, _ in sched.phases] == [0, 450, 4000, 7247, 8400, 14000, 15300, 20000, 23050, 24600, 26450,
                                           27450, 31450]
    got = [(a.steps, a.recall_steps, a.recall_mix, a.plain, a.max_length, a.answer_weight, a.eval_every)
           for _, a in sched.phases]
    assert got == [(1500, 500, 0.25, 0.2, 0, 1.0, 100), (4000, 4000, 0.25, 0.1, 512, 1.0, 100),
                   (8000, 8000, 0.25, 0.1, 512, 1.0, 100), (12000, 12000, 0.25, 0.1, 512, 1.0, 100),
                   (14000, 8400, 0.25, 0.1, 0, 1.0, 250), (22000, 8400, 0.25, 0.1, 0, 3.0, 250),
                   (22000, 8400, 1.0, 0.1, 256, 1.0, 100000), (30000, 20000, 0.5, 0.1, 0, 1.0, 500),
                   (30000, 20000, 0.25, 0.1, 0, 1.0, 500), (30000, 20000, 0.25, 0.1, 0, 1.0, 500),
                   (27450, 20000, 0.25, 0.1, 0, 1.0, 500), (31450, 20000, 0.25, 0.1, 0, 1.0, 500),
                   (34450, 20000, 0.25, 0.1, 0, 1.0, 500)]
    assert all(a.min_length == 0 for _, a in sched.phases)
    assert [(a.short_keys, a.fact_format, a.lr) for _, a in sched.phases[6:]] == [(1.0, "adjacent", 2e-3),
                                                                                  (1.0, "adjacent", 1e-3),
                                                                                  (1.0, "adjacent", 1e-3),
                                                                                  (1.0, "adjacent", 1e-3),
                                                                                  (1.0, "adjacent", 1e-3),
                                                                                  (1.0, "adjacent", 1e-3),
                                                                                  (1.0, "adjacent", 2e-3)]
    assert [a.answer_tokens for _, a in sched.phases] == ["code"] * 9 + ["all"] * 4
    # round thirteen: the grow to 6 layers at 31450 with the longest length 3 times as often, stopped at 33050
    assert [(a.layers, a.long_weight) for _, a in sched.phases] == [(4, 1.0)] * 12 + [(6, 3.0)]
    assert sched.grows == {12} and sched.steps == 33050
    assert all(a.seed == 1 and a.threads == 1 and a.batch_tokens == 4096 for _, a in sched.phases)
    assert all(a.short_keys == 0 and a.fact_format == "is" and a.lr == 2e-3 for _, a in sched.phases[:6])
    # a checkpoint written at a phase's end carries that phase's options
    ck = dict(vars(sched.phases[3][1]))
    assert testbed.tb_schedule.mismatch(ck, 8400, sched) == [] and testbed.tb_schedule.mismatch(ck, 8401, sched)


def test_make_goes_from_nothing_to_the_shipped_files(tmp_path):
    run = built("KVEVICT_RUN")
    sched = tmp_path / "tiny.json"
    sched.write_text(json.dumps({"run": {"seed": 3, "dim": 32, "hidden": 48, "layers": 2, "heads": 4, "kv_heads": 2,
                                         "seq_len": 256}, "stories": {"train": 3, "val": 2, "test": 2},
                                 "phases": [dict(p, set=dict(p["set"], **{"eval-per-cell": 1, "log-every": 1}))
                                            for p in PHASES]}))
    out = tmp_path / "ship"
    threads = torch.get_num_threads()
    try:
        testbed.main(["make", "--schedule", str(sched), "--kvevict-run", run, "--run-dir", str(tmp_path / "run"),
                      "--out-dir", str(out), "--per-cell", "1"])
    finally:
        torch.set_num_threads(threads)
    assert sorted(os.listdir(out)) == ["eval.jsonl", "eval_test.txt", "model.bin", "parity.txt", "schedule.json",
                                       "train.log"]
    assert [len(tb_data.load_stories(str(tmp_path / "run" / "stories" / f"{s}.jsonl"))) for s in ("train", "val", "test")] == [3, 2, 2]
    ck = torch.load(tmp_path / "run" / "ckpt.pt")
    assert ck["step"] == 6 and (tmp_path / "run" / "model.bin").read_bytes() == (out / "model.bin").read_bytes()
    lines = (out / "eval_test.txt").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("test after    256: exact match") and "lm loss" in lines[-1]
    assert "parity: 1/1 prompts identical" in (out / "parity.txt").read_text()
    assert (out / "schedule.json").read_text() == sched.read_text()
    # rerun: nothing is generated or trained again, the same model ships
    shipped, pools = (out / "model.bin").read_bytes(), (tmp_path / "run" / "stories" / "train.jsonl").read_bytes()
    try:
        testbed.main(["make", "--schedule", str(sched), "--kvevict-run", run, "--run-dir", str(tmp_path / "run"),
                      "--out-dir", str(out), "--per-cell", "1"])
    finally:
        torch.set_num_threads(threads)
    assert (out / "model.bin").read_bytes() == shipped and torch.load(tmp_path / "run" / "ckpt.pt")["step"] == 6
    assert (tmp_path / "run" / "stories" / "train.jsonl").read_bytes() == pools
    make_log = (tmp_path / "run" / "make.log").read_text()
    assert make_log.count("stories train: 0 -> 3") == 1 and make_log.count("make: done") == 2


def test_make_refuses_full_pools_of_another_sha256(tmp_path):
    """With the full pools' sizes the schedule's sha256 must match, before any training."""
    stories = tmp_path / "run" / "stories"
    stories.mkdir(parents=True)
    for split, (_, _, n) in tb_data.SPLITS.items():
        (stories / f"{split}.jsonl").write_text("".join(json.dumps(f"story {i}.") + "\n" for i in range(n)))
    sched = tmp_path / "s.json"
    sched.write_text(json.dumps({"stories": {"sha256": {"val": "0" * 64}}, "phases": [{"from": 0, "set": {"steps": 1}}]}))
    fake_run = tmp_path / "kvevict-run"
    fake_run.write_text("")
    with pytest.raises(SystemExit, match="val.jsonl has sha256 .*, the schedule's pool 0000"):
        testbed.main(["make", "--schedule", str(sched), "--kvevict-run", str(fake_run), "--run-dir",
                      str(tmp_path / "run"), "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "run" / "ckpt.pt").exists()


def test_first_digit_errors_classify_the_prediction(tok):
    """first_digit_errors on a stand-in model that predicts chosen tokens at the first code digit."""
    gen = tb_data.Generator(tok, STORIES, "val", 5)
    exs = [gen.example(i, 256, ("after", "before")[i % 2], 4) for i in range(8)]
    digit = lambda c: gen.digit_ids[int(c)]
    want, chosen = [], {}
    for j, e in enumerate(exs):
        m = e.meta
        others = [(c, d) for (k, c), d in zip(m["facts"], m["fact_depths"]) if k != m["key"]]
        firsts = {c[0] for c, _ in others} - {m["code"][0]}
        if j % 4 == 1 and firsts:
            pick = sorted(firsts)[0]
            sides = {"later" if d > m["depth"] else "earlier" for c, d in others if c[0] == pick}
            want.append(("other fact", sides.pop() if len(sides) == 1 else "either"))
            chosen[j] = digit(pick)
        elif j % 4 == 2:
            chosen[j] = digit(min(set("0123456789") - firsts - {m["code"][0]}))
            want.append(("other digit", ""))
        elif j % 4 == 3:
            chosen[j] = tok.encode(" the")[-1]
            want.append(("non-digit", ""))
        else:
            chosen[j] = digit(m["code"][0])
            want.append(("right", ""))

    def fake(ids):  # the next true token everywhere (truth for this test), the chosen one at the first digit
        out = torch.zeros(ids.shape[0], ids.shape[1], 512)
        for b in range(ids.shape[0]):
            j = next(j for j, e in enumerate(exs) if e.ids[:-1] == ids[b].tolist())
            out[b, torch.arange(ids.shape[1]), torch.tensor(exs[j].ids[1:])] = 1.0
            out[b, exs[j].questions[0][-tb_data.DIGITS]] = 0.0
            out[b, exs[j].questions[0][-tb_data.DIGITS], chosen[j]] = 1.0
        return out

    rows = testbed.first_digit_errors(fake, exs, gen.digit_ids, batch_tokens=512)
    order = sorted(range(len(exs)), key=lambda j: len(exs[j].ids))  # rows come grouped by length
    assert [(rows[i]["class"], rows[i]["side"]) for i in range(len(rows))] == [want[j] for j in order]
    assert all(0 < r["depth"] < 1 and r["needles"] == 4 and 0 <= r["chance"] <= 1 and 0.25 <= r["pick"] <= 1 for r in rows)
    assert [r["pick"] for r in rows] == [sum(c[0] == exs[j].meta["code"][0] for _, c in exs[j].meta["facts"]) / 4
                                         for j in order]
    assert sum(r["class"] == "other fact" for r in rows) == 2
    lines = testbed.digit_table(rows, lambda r: "all")
    assert "right 2, other fact 2, other digit 2, non-digit 2" in lines[0] and "2/4" in lines[0]


def test_short_keys_are_one_token_and_leave_the_default_data_unchanged(tok):
    """keys="short" (the key-match curriculum): every key one token in the fact, the question and the
    answer, no piece shared between keys; the same random stream as the real keys (only the key table
    differs); --short-keys 0 leaves step_batch's batches as without the option; the rate is about F."""
    gen = tb_data.Generator(tok, STORIES, "train", 4)
    assert len({tok.encode(k)[-1] for k in tb_data.SHORT_KEYS}) == len(tb_data.SHORT_KEYS)
    for i, (L, kind, n) in enumerate([(256, "after", 4), (256, "before", 2), (512, "after", 1)]):
        e, w = gen.example(i, L, kind, n, "short"), gen.example(i, L, kind, n)
        m = e.meta
        assert m["keys"] == "short" and "keys" not in w.meta and m["key"] in tb_data.SHORT_KEYS
        assert e.ids == tok.encode(e.text) and len(e.ids) <= L
        assert len({k for k, _ in m["facts"]}) == n and all(k in tb_data.SHORT_KEYS for k, _ in m["facts"])
        assert [c for _, c in m["facts"]] == [c for _, c in w.meta["facts"]]  # same stream, other keys
        key_id = tok.encode(m["key"])[-1]
        fact = tok.encode(f"The {m['key']}'s code is {m['code']}.")[1:]
        assert fact[1] == key_id and e.ids[m["depth"]:m["depth"] + len(fact)] == fact
        assert tok.decode([e.ids[t + 1] for t in e.answers]) == f" the {m['key']}'s code is {m['code']}"
        assert e.ids[e.answers[0] + 2] == key_id  # " the", then the key as its one token
        span, others = gen.questions_facts(e)[0]
        assert [e.ids[p] for p in span] == fact[-6:-1] and len(others) == n - 1
    r = gen.example(0, 256, "recall", keys="short")
    assert r.meta["keys"] == "short" and len(r.meta["facts"]) > gen.example(0, 256, "recall").meta["needles"]
    assert all(tok.decode([r.ids[t + 1] for t in q]) == f" the {k}'s code is {c}"
               for q, (k, c) in zip(r.questions, r.meta["asked"]))
    with pytest.raises(ValueError, match="keys 'long'"):
        gen.example(0, 256, "after", 1, "long")
    args = argparse.Namespace(seed=1, steps=40, recall_steps=0, recall_mix=0.5, plain=0.1,
                              batch_tokens=2048, seq_len=2048, max_length=256)
    plain = [testbed.step_batch(gen, args, s) for s in range(6)]
    args.short_keys = 0.0
    assert [[e.ids for e in b] for b in plain] == [[e.ids for e in b] for b in
                                                   (testbed.step_batch(gen, args, s) for s in range(6))]
    args.short_keys = 0.5
    mixed = [e for s in range(6) for e in testbed.step_batch(gen, args, s) if e.meta["kind"] != "plain"]
    short = sum(e.meta.get("keys") == "short" for e in mixed)
    assert 0.25 * len(mixed) < short < 0.75 * len(mixed)


@pytest.mark.parametrize("keys", ["short", "words"])
def test_adjacent_facts_put_the_key_right_before_the_code(tok, keys):
    """fact_format="adjacent": "The note said {key} {code}." answered "{key} {code}.": in the fact and in the
    answer the key's last piece (one-token keys: the key), then the space token, then the first digit; the
    question as before; the same random stream as the default format (the same haystack, keys, codes and
    fact order, so the splits stay disjoint); code spans on the code; the default unchanged; step_batch's
    --fact-format reaches every recall and retrieval example."""
    gen = tb_data.Generator(tok, STORIES, "val", 3)
    space = tok.encode(" 1")[1]
    for i, (L, kind, n) in enumerate([(256, "after", 4), (256, "before", 2), (512, "after", 1), (256, "recall", 0)]):
        e = gen.example(i, L, kind, max(n, 1), keys, "adjacent")
        w = gen.example(i, L, kind, max(n, 1), keys)
        assert w.ids == gen.example(i, L, kind, max(n, 1), keys, "is").ids and "fact_format" not in w.meta
        m = e.meta
        assert m["fact_format"] == "adjacent" and e.ids == tok.encode(e.text) and len(e.ids) <= L
        # (recall: the shorter facts leave room for more of them, the first ones the same)
        assert m["facts"][:len(w.meta["facts"])] == w.meta["facts"]
        assert all(f"The {k}'s code is {c}." in w.text for k, c in w.meta["facts"])
        hay = lambda x: [s for s in tb_data.sentences(x.text) if "code" not in s and "note said" not in s]  # noqa: E731
        assert hay(e)[:len(hay(w))] == hay(w)  # the same haystack (shorter facts leave room for a little more)
        asked = m["asked"] if kind == "recall" else [(m["key"], m["code"])]
        for (key, code), q, (span, others) in zip(asked, e.questions, gen.questions_facts(e)):
            key_ids = tok.encode(key)[1:]
            assert len(key_ids) == 1 or keys == "words"
            assert f"Question: What is the {key}'s code?" in e.text and f"Answer: {key} {code}." in e.text
            assert f"The note said {key} {code}." in e.text
            digits = [gen.digit_ids[int(c)] for c in code]
            # the answer: the key's pieces, the space, the digits (all weighted), the "." not an answer token
            assert [e.ids[t + 1] for t in q] == key_ids + [space] + digits
            assert all(e.weights[t] == 1.0 for t in q) and e.ids[q[-1] + 2] == tok.encode(".")[-1]
            # the fact: its code span is the space and the digits, right after the key's last piece
            assert [e.ids[p] for p in span] == [space] + digits and e.ids[span.start - 1] == key_ids[-1]
            assert e.ids[span.start - len(key_ids):span.start] == key_ids
            assert all(e.weights[p - 1] == 0.0 for p in span)  # no loss on the facts' random codes
            assert len(others) == len(m["facts"]) - 1
            for o in others:
                assert e.ids[o.start] == space and all(e.ids[p] in gen.digit_ids for p in o[1:])
    with pytest.raises(ValueError, match="fact_format 'next'"):
        gen.example(0, 256, "after", 1, keys, "next")
    args = argparse.Namespace(seed=1, steps=40, recall_steps=0, recall_mix=0.5, plain=0.1,
                              batch_tokens=2048, seq_len=2048, max_length=256)
    plain = [[e.ids for e in testbed.step_batch(gen, args, s)] for s in range(4)]
    args.fact_format = "is"
    assert plain == [[e.ids for e in testbed.step_batch(gen, args, s)] for s in range(4)]
    args.fact_format = "adjacent"
    adj = [e for s in range(4) for e in testbed.step_batch(gen, args, s)]
    assert {e.meta["kind"] for e in adj} == {"plain", "recall", "after", "before"}
    assert all(e.meta.get("fact_format") == ("adjacent" if e.meta["kind"] != "plain" else None) for e in adj)
    assert tb_data.FACT_FORMATS == testbed.tb_schedule.FACT_FORMATS and "fact_format" in testbed.tb_schedule.BITS


def test_schedule_switches_the_fact_format(tmp_path):
    """--fact-format as a schedule option: a phase sets it, the phase's command names it, and a checkpoint
    trained with the other format is not on the schedule (it is among the weight-relevant options)."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"phases": [{"from": 0, "set": {"steps": 4}},
                                           {"from": 2, "set": {"fact-format": "adjacent"}}]}))
    defaults = testbed.train_defaults("R")
    sched = testbed.tb_schedule.load(str(path), defaults)
    assert [testbed.fact_format_of(sched.args(s)) for s in range(4)] == ["is", "is", "adjacent", "adjacent"]
    assert "--fact-format adjacent" in sched.command(1, defaults) and "fact-format" not in sched.command(0, defaults)
    ck = dict(vars(sched.args(3)), fact_format="is")
    assert testbed.tb_schedule.mismatch(ck, 4, sched) == ["fact-format is (schedule: adjacent)"]
    assert testbed.tb_schedule.mismatch(vars(sched.args(1)), 2, sched) == []


def test_recall_facts_caps_the_facts_of_a_recall_example(tok):
    """recall_facts=N (train --recall-facts N): at most N facts in a recall example, each asked once when N is
    below the question count, answers right after their keys; 0 (the default) as before; step_batch passes it."""
    gen = tb_data.Generator(tok, STORIES, "train", 2)
    for fmt in tb_data.FACT_FORMATS:
        for i in range(3):
            full, two = gen.example(i, 256, "recall", fact_format=fmt), gen.example(i, 256, "recall", fact_format=fmt,
                                                                                        recall_facts=2)
            assert full.ids == gen.example(i, 256, "recall", fact_format=fmt, recall_facts=0).ids
            assert len(full.meta["facts"]) > 2 and len(two.meta["facts"]) == 2 == len(two.questions)
            assert two.meta["facts"] == full.meta["facts"][:2] and sorted(two.meta["asked"]) == sorted(two.meta["facts"])
            assert two.ids == tok.encode(two.text) and len(two.ids) <= 256
            for q, (k, c) in zip(two.questions, two.meta["asked"]):
                assert [two.ids[t + 1] for t in q[-tb_data.DIGITS:]] == [gen.digit_ids[int(d)] for d in c]
    args = argparse.Namespace(seed=1, steps=40, recall_steps=40, recall_mix=0.0, plain=0.1,
                              batch_tokens=2048, seq_len=2048, max_length=256, fact_format="adjacent", recall_facts=2)
    batch = [e for s in range(2) for e in testbed.step_batch(gen, args, s) if e.meta["kind"] == "recall"]
    assert batch and all(len(e.meta["facts"]) == 2 and e.meta["fact_format"] == "adjacent" for e in batch)


def test_questions_follow_the_run_format(tmp_path, tok):
    """--keys / --fact-format on every command that makes questions (dump here), and a run's own format for
    its evaluations: a run trained with --short-keys 1 is validated (and `make` tests it) on one-token keys,
    with fewer it stays on the colour-object keys."""
    stories = tmp_path / "stories"
    stories.mkdir()
    (stories / "test.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STORIES))
    out = tmp_path / "set.jsonl"
    testbed.main(["dump", "--stories-dir", str(stories), "--per-cell", "2", "--max-length", "256", "--out", str(out),
                  "--keys", "short", "--fact-format", "adjacent"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert r["meta"]["keys"] == "short" and r["meta"]["key"] in tb_data.SHORT_KEYS
        assert tok.encode(r["prompt"]) == r["prompt_ids"] and r["answer"] == f"{r['meta']['key']} {r['meta']['code']}"
    gen = tb_data.Generator(tok, STORIES, "val", 1)
    args = argparse.Namespace(eval_per_cell=2, max_length=256, seq_len=2048, recall_steps=0, recall_mix=1.0,
                              fact_format="adjacent", short_keys=1.0)
    assert testbed.keys_of(args) == "short"
    val = testbed.train_val_set(gen, args)
    assert len(val) == 6 and all(e.meta["keys"] == "short" and e.meta["fact_format"] == "adjacent" for e in val)
    args.short_keys = 0.9
    assert testbed.keys_of(args) == "words" and all("keys" not in e.meta for e in testbed.train_val_set(gen, args))


def test_answer_tokens_all_puts_the_key_in_the_answer_term(tok):
    """--answer-tokens all: the answer term is the mean cross-entropy of every answer token of every question
    (the key restated, the space, the code), "code" (the default) of the code digits only; the LM term and
    the hits are the same either way."""
    gen = tb_data.Generator(tok, STORIES, "train", 3)
    torch.manual_seed(0)
    model = tb_model.Model(tb_model.Config(32, 64, 2, 4, 2, 512, 512), seed=3)
    batch = [gen.example(i, 256, kind, 2, "short", "adjacent") for i, kind in enumerate(("after", "before", "recall"))]
    lm_c, code, hits_c = testbed.losses(model, batch)
    lm_a, every, hits_a = testbed.losses(model, batch, "all")
    assert float(lm_c) == float(lm_a) and all(torch.equal(x, y) for a, b in zip(hits_c, hits_a) for x, y in zip(a, b))
    ids, _ = testbed.batch_tensors(batch)
    with torch.no_grad():
        logits = model(ids[:, :-1])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), ids[:, 1:].reshape(-1), reduction="none").view(ids.shape[0], -1)
    qs = [(b, q) for b, e in enumerate(batch) for q in e.questions]
    assert all(len(q) > tb_data.DIGITS for _, q in qs)  # the key and the space before the code
    want_all = sum(float(ce[b, t]) for b, q in qs for t in q) / sum(len(q) for _, q in qs)
    want_code = sum(float(ce[b, t]) for b, q in qs for t in q[-tb_data.DIGITS:]) / (len(qs) * tb_data.DIGITS)
    assert abs(float(every) - want_all) < 1e-5 and abs(float(code) - want_code) < 1e-5 and float(every) != float(code)
    assert testbed.train_options(argparse.ArgumentParser()).parse_args(["--run-dir", "R"]).answer_tokens == "code"


def test_first_answer_token_is_classified(tok):
    """first_digit_errors(..., enc=): the answer's first token (the key restated) given the prompt is `right`,
    `other fact` (another fact's key as its answer would start) or `other`, on a stand-in model."""
    gen = tb_data.Generator(tok, STORIES, "val", 6)
    exs = [gen.example(i, 256, ("before", "after")[i % 2], 4, "short", "adjacent") for i in range(6)]
    chosen, want = {}, []
    for j, e in enumerate(exs):
        m = e.meta
        other = next(k for k, _ in m["facts"] if k != m["key"])
        chosen[j] = [e.ids[e.questions[0][0] + 1], gen.enc.encode(other)[0], gen.digit_ids[7]][j % 3]
        want.append(("right", "other fact", "other")[j % 3])

    def fake(ids):  # the true next token everywhere but the chosen one at the answer's first token
        out = torch.zeros(ids.shape[0], ids.shape[1], 512)
        for b in range(ids.shape[0]):
            j = next(j for j, e in enumerate(exs) if e.ids[:-1] == ids[b].tolist())
            out[b, torch.arange(ids.shape[1]), torch.tensor(exs[j].ids[1:])] = 1.0
            t0 = exs[j].questions[0][0]
            out[b, t0] = 0.0
            out[b, t0, chosen[j]] = 1.0
        return out

    rows = testbed.first_digit_errors(fake, exs, gen.digit_ids, batch_tokens=512, enc=gen.enc)
    order = sorted(range(len(exs)), key=lambda j: len(exs[j].ids))
    assert [r["first_token"] for r in rows] == [want[j] for j in order]
    assert all(r["class"] == "right" for r in rows)  # the first code digit is still the true one
    assert "first_token" not in testbed.first_digit_errors(fake, exs, gen.digit_ids, batch_tokens=512)[0]


SHIPPED = [("", 6, 33050, 115712), ("4-layer", 4, 31450, 77824)]  # models/testbed/...: layers, last step, module size


@pytest.mark.parametrize("sub,layers,steps,_", SHIPPED)
def test_the_shipped_model_is_made_by_its_schedule(sub, layers, steps, _):
    """models/testbed (and the 4-layer model it was grown from): its schedule is the committed schedule up to
    its last step (the run continues from there in later phases), and model.bin is that run's llama2.c
    checkpoint (the testbed's shape)."""
    root = os.path.join(SOURCE_DIR, "models", "testbed", sub)
    defaults = testbed.train_defaults("R")
    shipped = testbed.tb_schedule.load(os.path.join(root, "schedule.json"), defaults)
    current = testbed.tb_schedule.load(os.path.join(SOURCE_DIR, "examples", "testbed", "schedule.json"), defaults)
    n = len(shipped.phases)
    assert shipped.steps == steps and [(p, vars(a)) for p, a in shipped.phases] == [(p, vars(a)) for p, a in current.phases[:n]]
    assert all(p >= shipped.steps for p, _ in current.phases[n:])
    header = np.frombuffer(open(os.path.join(root, "model.bin"), "rb").read(28), dtype="<i4").tolist()
    assert header == [128, 384, layers, 8, 2, 512, 2048]
    assert os.path.getsize(os.path.join(root, "model.bin")) == 28 + 4 * tb_model.Model(tb_model.Config(*header)).n_params() \
        + 4 * 2 * 2048 * 8  # the weights, then the two legacy RoPE tables (seq_len x head_size / 2 floats each)


@pytest.mark.parametrize("sub,layers,_,params", SHIPPED)
def test_the_shipped_lookahead_module_is_for_the_shipped_model(sub, layers, _, params):
    """models/testbed/lookahead-n16.bin (and the 4-layer model's): its header (docs/lookaheadkv.md) names the
    testbed's dimensions and its size is exactly the header plus its parameters (16 tokens, LoRA rank 8 on all
    seven targets)."""
    data = open(os.path.join(SOURCE_DIR, "models", "testbed", sub, "lookahead-n16.bin"), "rb").read()
    assert data[:8] == b"KVLOOKAH"
    version, = np.frombuffer(data[8:12], dtype="<u4")
    dims = np.frombuffer(data[12:44], dtype="<i4").tolist()  # dim, layers, heads, kv heads, hidden, vocab, n, rank
    placement, = np.frombuffer(data[48:52], dtype="<u4")
    assert version == 1 and dims == [128, layers, 8, 2, 384, 512, 16, 8] and placement == 127
    dim, heads, kv, hidden = 128, 8, 2, 384
    kv_dim = dim * kv // heads
    shapes = [(dim, dim), (dim, kv_dim), (dim, kv_dim), (dim, dim), (dim, hidden), (hidden, dim), (dim, hidden)]
    count = 16 * dim + layers * sum(8 * (i + o) for i, o in shapes)
    assert len(data) == 52 + 4 * count and count == params
