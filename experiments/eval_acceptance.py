"""Acceptance of AR, DFlash chain and DDTree on held-out stdlib prompts.

For each method and temperature: mean acceptance length tau (accepted drafts + the bonus token, per
round) with a 95% bootstrap interval over prompts, and the mean exact expected number of accepted
drafts per round (from the target's law on the drafted tree). Writes JSON and CSV after every
cell (a run stopped midway keeps the cells it finished) and a PNG at the end.

    python experiments/eval_acceptance.py --prompts 100 --new-tokens 128
    python experiments/eval_acceptance.py --methods chain,ddtree64,ddtree16cap4   # B = 16 with a per-depth cap 4
    python experiments/eval_acceptance.py --methods chain,ddtree64 --temperatures 0 --draft-temperature 0.5,0.6
    python experiments/eval_acceptance.py --methods ddtree16cap4 --draft-vocabs 0,2048   # drafts from 2,048 tokens
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ddtree_jax import checks  # noqa: E402
from ddtree_jax.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from ddtree_jax.checkpoint import load_drafter, load_target  # noqa: E402
from ddtree_jax.draft_vocab import with_frequent_tokens  # noqa: E402
from ddtree_jax.engine import generate  # noqa: E402
from ddtree_jax.experiments import corpus  # noqa: E402
from ddtree_jax.experiments.flags import float_list, non_negative_int_list, positive_float_list  # noqa: E402
from ddtree_jax.experiments.stats import bootstrap_ci, per_request_tau  # noqa: E402
from ddtree_jax.tokenizer import Tokenizer  # noqa: E402


def parse_methods(spec: str, default_cap: int = 0) -> list[tuple[str, str, int, int]]:
    """``"ar,chain,ddtree16,ddtree16cap4"`` -> [(label, method, budget, topk_cap)]; a ``capN`` suffix
    sets DDTree's per-depth cap (0 = none), else ``default_cap``."""
    out = []
    for item in spec.split(","):
        if item.startswith("ddtree"):
            budget, _, cap = item[len("ddtree"):].partition("cap")
            if not budget.isdigit() or int(budget) < 1 or (cap and not cap.isdigit()):
                raise ValueError(f"--methods: {item!r} is not ddtreeB or ddtreeBcapK (B >= 1)")
            out.append((item, "ddtree", int(budget), int(cap) if cap else default_cap))
        elif item in ("ar", "chain"):
            out.append((item, item, 1, 0))
        else:
            raise ValueError(f"--methods: unknown method {item!r} (ar, chain, ddtreeB, ddtreeBcapK)")
    return out


def grid(methods, temperatures, draft_temperatures, draft_vocabs=(0,)) -> list[tuple]:
    """The cells ``(label, method, budget, topk_cap, temperature, draft_temperature, draft_vocab)``:
    every method at every temperature, the drafted ones at every draft temperature (labelled ``"...
    dtX"`` when there are several) and draft vocabulary (``"... vW"`` for W > 0), AR once per
    temperature."""
    several = len(draft_temperatures) > 1
    return [((f"{label} dt{dt:g}" if several and method != "ar" else label) + (f" v{w}" if w else ""),
             method, budget, cap, t, dt, w)
            for t in temperatures for label, method, budget, cap in methods
            for dt in (draft_temperatures[:1] if method == "ar" else draft_temperatures)
            for w in ((0,) if method == "ar" else draft_vocabs)]


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(labels)), 4))
    width = 0.8 / len(temps)
    for i, t in enumerate(temps):
        sel = [next(r for r in rows if r["label"] == lab and r["temperature"] == t) for lab in labels]
        x = np.arange(len(labels)) + i * width
        err = np.array([[r["tau"] - r["tau_lo"], r["tau_hi"] - r["tau"]] for r in sel]).T
        ax.bar(x, [r["tau"] for r in sel], width, yerr=err, capsize=3, label=f"T = {t:g}")
    ax.set_xticks(np.arange(len(labels)) + width * (len(temps) - 1) / 2, labels, rotation=30, ha="right")
    ax.set_ylabel("tau (accepted + bonus per round)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_rows(out: Path, meta: dict, rows: list[dict]) -> None:
    """``out.json`` (``meta`` and ``rows``) and ``out.csv`` (the rows)."""
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=TARGET_DIR, help="HF-format target directory (default: embedded)")
    ap.add_argument("--drafter", type=Path, default=DRAFTER_DIR, help="HF-format drafter directory (default: embedded)")
    ap.add_argument("--prompts", type=int, default=100, help="held-out prompts (default: 100)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default: 64)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    ap.add_argument("--methods", default="ar,chain,ddtree16,ddtree64,ddtree256",
                    help="comma-separated: ar, chain, ddtreeB, ddtreeBcapK (default: the five listed)")
    ap.add_argument("--temperatures", type=float_list, default=[0.0, 1.0],
                    help="comma-separated target temperatures (default: 0,1)")
    ap.add_argument("--draft-temperature", type=positive_float_list, default=[1.0],
                    help="temperature of the draft marginals the chain and DDTree draft from; a comma-separated "
                         "list runs every drafted cell at each, in one process (default: 1)")
    ap.add_argument("--draft-vocabs", type=non_negative_int_list, default=[0],
                    help="comma-separated draft vocabulary sizes: the chain and DDTree draft from that many most "
                         "frequent tokens (counts: <target>/token_counts.npy); 0 = the whole vocabulary (default: 0)")
    ap.add_argument("--topk-cap", type=int, default=0, help="DDTree per-depth cap of ddtreeB methods; 0 = none")
    ap.add_argument("--batch", type=int, default=100, help="prompts per generate call (default: 100)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt choice and of the coins (default: 0)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/acceptance"),
                    help="output path without suffix: .json, .csv and .png are written")
    args = ap.parse_args(argv)
    counts = ("prompts", "prompt_tokens", "new_tokens", "batch")
    try:  # every flag before the models load: a bad one ends the script with argparse's one-line error
        checks.flags(args, [(name, lambda v: v >= 1, ">= 1") for name in counts]
                     + [("topk_cap", lambda v: v >= 0, ">= 0 (0 = none)")])
        methods = parse_methods(args.methods, args.topk_cap)
    except ValueError as e:
        ap.error(str(e))

    dtype = jnp.dtype(args.dtype)
    target, drafter = load_target(args.target, dtype), load_drafter(args.drafter, dtype)
    tokenizer = Tokenizer.from_file(args.target / "tokenizer.json")
    prompts = corpus.heldout_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)
    cells = grid(methods, args.temperatures, args.draft_temperature, args.draft_vocabs)
    drafters = {w: with_frequent_tokens(drafter, target, args.target, w) for w in args.draft_vocabs}
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                python=sys.version.split()[0], command=" ".join(sys.argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, method, budget, cap, temperature, draft_temperature, draft_vocab in tqdm(cells, desc="cells"):
        emitted, rounds, expected, seconds = [], [], [], 0.0
        for start in range(0, len(prompts), args.batch):
            res = generate(target, drafters[draft_vocab], prompts[start:start + args.batch], method=method,
                           budget=budget, topk_cap=cap or None, temperature=temperature,
                           draft_temperature=draft_temperature,
                           max_new_tokens=args.new_tokens, key=jax.random.key(args.seed),
                           request_ids=np.arange(start, start + len(prompts[start:start + args.batch])))
            e, r = per_request_tau(res)
            emitted.append(e)
            rounds.append(r)
            acc = np.stack([x.accepted for x in res.rounds])
            expected.append(np.stack([x.expected for x in res.rounds])[acc >= 0])
            seconds += res.seconds
        emitted, rounds, expected = np.concatenate(emitted), np.concatenate(rounds), np.concatenate(expected)
        lo, hi = bootstrap_ci(emitted, rounds, seed=args.seed)
        row = dict(label=label, method=method, budget=budget, topk_cap=cap, temperature=temperature,
                   draft_temperature=draft_temperature, draft_vocab=draft_vocab,
                   tau=float(emitted.sum() / rounds.sum()), tau_lo=lo, tau_hi=hi,
                   expected_accepted=float(expected.mean()), measured_accepted=float(emitted.sum() / rounds.sum() - 1),
                   prompts=len(prompts), new_tokens=args.new_tokens, tokens_per_s=float(emitted.sum() / seconds))
        rows.append(row)
        tqdm.write(f"{label:>12} T={temperature:g}: tau {row['tau']:.3f} [{lo:.3f}, {hi:.3f}]  "
                   f"expected accepted {row['expected_accepted']:.3f}")
        write_rows(args.out, meta, rows)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out}.json/.csv/.png")


if __name__ == "__main__":
    main()
