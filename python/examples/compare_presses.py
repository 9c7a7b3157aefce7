"""Compare eviction presses on the shipped stories260K model, entirely in PyTorch + kvevict.

For each prompt the full-cache model writes a context (greedy), which becomes the prefill; each
press evicts it (post-fill, layer by layer, through the reference model's hook) to a budget; the
evicted model then reads the full-cache continuation (teacher forcing) and we measure the mean
KL(full || evicted) of its next-token distributions and how often its top token agrees.

    PYTHONPATH=build/release/python python3 python/examples/compare_presses.py [--out presses.svg]
"""
import argparse
import os

import torch

from kvevict import presses
from kvevict import reference as R

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "..", "models")
PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog was sad because",
           "One day, a big bird"]
PRESSES = {
    "SnapKV (w 8)": lambda b: presses.SnapKV(budget=b, window=8),
    "TOVA": lambda b: presses.TOVA(budget=b),
    "StreamingLLM": lambda b: presses.StreamingLLM(budget=b),
}


def evaluate(model, tok, budgets, context=160, continuation=64):
    results = {name: [] for name in PRESSES}
    for text in PROMPTS:
        cache = model.new_cache()
        ids = tok.encode(text)
        logits = model.forward(cache, ids)
        while len(ids) < context + continuation:  # the full cache's greedy story
            ids.append(int(logits[-1].argmax()))
            logits = model.forward(cache, ids[-1:])
        prefill, follow = ids[:context], ids[context:]
        full_cache = model.new_cache()
        full = torch.cat([model.forward(full_cache, prefill)[-1:], model.forward(full_cache, follow[:-1])])
        for name, make in PRESSES.items():
            row = []
            for b in budgets:
                cache = model.new_cache()
                first = model.forward(cache, prefill, hook=R.evict_with(make(b)))[-1:]
                evicted = torch.cat([first, model.forward(cache, follow[:-1])])
                kl = float(R.kl_divergence(full, evicted).mean())
                agree = float((full.argmax(-1) == evicted.argmax(-1)).double().mean())
                row.append((kl, agree))
            results[name].append(row)
    # mean over prompts: results[name][i] = (kl, agreement) at budgets[i]
    return {name: [tuple(sum(r[i][j] for r in rows) / len(rows) for j in range(2)) for i in range(len(budgets))]
            for name, rows in results.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="presses.svg", help="the plot (.svg or .png)")
    ap.add_argument("--budgets", default="8,16,32,64,128")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    model = R.Model.load(os.path.join(MODELS, "stories260K.bin"))
    tok = R.Tokenizer.load(os.path.join(MODELS, "tok512.bin"), model.vocab_size)
    res = evaluate(model, tok, budgets)
    print("press          " + "".join(f"  B={b:<4} KL / top-1" for b in budgets))
    for name, row in res.items():
        print(f"{name:<14} " + "".join(f"  {kl:8.4f} / {ag:4.2f}" for kl, ag in row))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, row in res.items():
        ax[0].plot(budgets, [kl for kl, _ in row], marker="o", label=name)
        ax[1].plot(budgets, [ag for _, ag in row], marker="o", label=name)
    for a, title in zip(ax, ["mean KL(full || evicted)", "top-1 agreement with the full cache"]):
        a.set_xscale("log", base=2)
        a.set_xlabel("tokens kept per KV head (context 160)")
        a.set_title(title, fontsize=10)
        a.grid(alpha=0.3)
    ax[0].set_yscale("log")
    ax[1].legend(fontsize=8)
    fig.suptitle(f"stories260K, {len(PROMPTS)} prompts, 64 teacher-forced tokens after eviction", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
