"""Micro-benchmark of the DDTree core: build_tree (+ encoding) and verify at Qwen3 vocabulary size.

Times, on whatever backend is present (jit, warm, ``block_until_ready``, median of repeats):
  build   = build_tree + compile_retrieve-free encodings (mask, positions) from draft logits [B, L, V]
  verify  = verify() from target logits [B, N, V] at T = 1 with top-p 0.95 (the sampled path)
  greedy  = verify() at T = 0
Prints a table and writes JSON.

    python experiments/bench_core.py --out experiments/results/bench_core.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax.experiments.flags import int_list  # noqa: E402
from ddtree_jax.experiments.provenance import command_line  # noqa: E402
from ddtree_jax.sampling import coins_from_keys, request_keys  # noqa: E402
from ddtree_jax.tree import build_tree_unchecked, tree_attention_mask, tree_positions  # noqa: E402
from ddtree_jax.verify import verify_from_coins  # noqa: E402
from experiments.common import median_ms  # noqa: E402


@functools.partial(jax.jit, static_argnames=("budget",))
def build(draft_logits, roots, *, budget):
    tree = build_tree_unchecked(draft_logits, roots, jnp.float32(1.0), budget=budget, topk_cap=None)
    return tree, tree_attention_mask(tree), tree_positions(tree, jnp.zeros_like(roots))


@jax.jit
def sample(tree, logits, key, temperature, top_p):
    batch = logits.shape[0]
    coins, final = coins_from_keys(request_keys(key, jnp.arange(batch), 0), logits.shape[1])
    t = jnp.full((batch,), temperature)
    return verify_from_coins(tree, logits, coins, final, t, jnp.zeros((batch,), jnp.int32), jnp.full((batch,), top_p))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--budgets", type=int_list, default=[16, 64, 256, 1024])
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="experiments/results/bench_core.json")
    args = ap.parse_args(argv)
    print(f"backend {jax.default_backend()}, device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = []
    meta = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=time.strftime("%Y-%m-%d"), command=command_line())
    key = jax.random.key(0)
    print(f"{'batch':>5} {'B':>5} {'build ms':>9} {'verify ms':>10} {'greedy ms':>10}")
    for batch in args.batches:
        draft = jax.random.normal(key, (batch, args.depth, args.vocab), jnp.float32) * 3
        roots = jnp.zeros((batch,), jnp.int32)
        for budget in args.budgets:
            tree = build(draft, roots, budget=budget)[0]
            logits = jax.random.normal(key, (batch, budget + 1, args.vocab), jnp.bfloat16) * 3
            row = dict(batch=batch, budget=budget, vocab=args.vocab, depth=args.depth,
                       build_ms=median_ms(functools.partial(build, draft, roots, budget=budget), args.repeats),
                       verify_ms=median_ms(functools.partial(sample, tree, logits, key, 1.0, 0.95), args.repeats),
                       greedy_ms=median_ms(functools.partial(sample, tree, logits, key, 0.0, 1.0), args.repeats))
            rows.append(row)
            print(f"{batch:>5} {budget:>5} {row['build_ms']:>9.3f} {row['verify_ms']:>10.3f} {row['greedy_ms']:>10.3f}",
                  flush=True)
            with open(args.out, "w") as f:  # after every row: an interrupted run keeps what it measured
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
            del logits
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
