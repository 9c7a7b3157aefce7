"""The pure-PyTorch reference model (kvevict.reference) against the C++ runner: logits to 1e-5,
greedy tokens, and greedy tokens under post-fill eviction by a press (kvevict-run --recipe)."""
import os
import subprocess

import numpy as np
import pytest
import torch

from kvevict import presses
from kvevict import reference as R
from conftest import SOURCE_DIR

MODEL = os.path.join(SOURCE_DIR, "models", "stories260K.bin")
TOKENIZER = os.path.join(SOURCE_DIR, "models", "tok512.bin")
LONG_PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
               "One day she saw a big red ball")


@pytest.fixture(scope="module")
def model():
    return R.Model.load(MODEL)


@pytest.fixture(scope="module")
def tok(model):
    return R.Tokenizer.load(TOKENIZER, model.vocab_size)


def greedy(model, ids, steps, hook=None):
    cache = model.new_cache()
    logits = [model.forward(cache, ids, hook=hook)]
    out = list(ids)
    while len(out) < steps:
        out.append(int(logits[-1][-1].argmax()))
        logits.append(model.forward(cache, [out[-1]]))
    return out, torch.cat(logits)


def tool(env):
    path = os.environ.get(env, "")
    if not path or not os.path.exists(path):
        pytest.skip(f"{env} is not built (the examples are off)")
    return path


def test_logits_and_greedy_tokens_match_the_cpp_runner(model, tok, tmp_path):
    helper = tool("KVEVICT_RUNNER_LOGITS")
    out = tmp_path / "logits.f32"
    ids = subprocess.run([helper, MODEL, TOKENIZER, "Once upon a time", "48", str(out)], check=True,
                         capture_output=True, text=True).stdout.split()
    ref = torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(-1, model.vocab_size))
    prompt = tok.encode("Once upon a time")
    assert [int(i) for i in ids[:len(prompt)]] == prompt  # the Python tokenizer is run.c's
    mine_ids, logits = greedy(model, prompt, 48)
    assert mine_ids == [int(i) for i in ids]
    # every row: the prompt's rows, then one per decoded token
    assert logits.shape == ref.shape
    assert float((logits - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("recipe,press", [("snapkv", lambda: presses.SnapKV(budget=16, window=8)),
                                          ("tova", lambda: presses.TOVA(budget=16)),
                                          ("h2o", lambda: presses.H2O(budget=16, n_recent=8))])
def test_press_eviction_matches_kvevict_run(model, tok, recipe, press):
    run = tool("KVEVICT_RUN")
    ref = subprocess.run([run, "--prompt", LONG_PROMPT, "--ids", "--steps", "60", "--recipe", recipe, "--budget",
                          "16", "--window", "8"], check=True, capture_output=True, text=True).stdout.split()
    # kvevict-run prints run.c's ids: BOS, then the tokens of positions 1 .. steps
    ids, _ = greedy(model, tok.encode(LONG_PROMPT), len(ref), hook=R.evict_with(press()))
    assert len(ref) == 61 and ids == [int(i) for i in ref]


def test_hook_evicts_and_a_large_budget_changes_nothing(model, tok):
    ids = tok.encode(LONG_PROMPT)
    full_ids, full = greedy(model, ids, 40)
    same_ids, same = greedy(model, ids, 40, hook=R.evict_with(presses.SnapKV(budget=512, window=8)))
    assert same_ids == full_ids and torch.equal(same, full)
    cache = model.new_cache()
    model.forward(cache, ids, hook=R.evict_with(presses.AdaKV(presses.SnapKV(budget=12, window=8))))
    for layer in range(model.cfg.n_layers):
        lengths = cache.lengths(layer)
        assert sum(lengths) == 12 * model.cfg.n_kv_heads and min(lengths) >= 8
        for h in range(model.cfg.n_kv_heads):  # original positions kept, ascending, window included
            pos = cache.positions[layer][h].tolist()
            assert pos == sorted(pos) and pos[-8:] == list(range(len(ids) - 8, len(ids)))
    assert float(R.kl_divergence(full[:1], full[:1])[0]) == 0.0


def test_compare_presses_example_runs(model, tok):
    import importlib.util
    path = os.path.join(SOURCE_DIR, "python", "examples", "compare_presses.py")
    spec = importlib.util.spec_from_file_location("compare_presses", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    res = example.evaluate(model, tok, [8, 64], context=80, continuation=8)
    for name, ((kl_small, _), (kl_large, agree_large)) in res.items():
        assert kl_small >= 0 and kl_large >= 0 and 0 <= agree_large <= 1
