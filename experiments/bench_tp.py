"""Tensor-parallel target on several devices: identical greedy tokens, and latency per tp.

For each model shape (random weights, Qwen3-8B and Qwen3-32B by default):

1. **Tokens.** Greedy DDTree generation (budget ``--budget``, no cap) of ``--new-tokens`` tokens for
   ``--batch`` random prompts, once per tp in ``--check-tps`` (tp = 1 means no mesh); every run must
   give the tokens of the first. The shapes listed in ``--no-tp1`` (default Qwen3-32B, 64 GB of bf16
   weights) skip tp = 1.
2. **Latency.** For each tp in ``--tps``: one AR decode step and one DDTree round per budget in
   ``--budgets`` under ``make_mesh(tp)`` (the engine's round, state threaded through, median of warm
   calls), and the time of the all-reduces a layer needs at tp (the summed outputs of the row-split
   ``wqkv``, ``wo``, ``w_gate_up`` and ``w_down`` for the round's tokens), each timed alone as a
   ``psum`` inside ``shard_map``.

Prints a table per shape and writes JSON (rewritten after every row).

    python experiments/bench_tp.py --out experiments/results/bench_tp.json            # 8 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python experiments/bench_tp.py --shapes tiny --tps 1,2,4,8 --check-tps 1,8 --budgets 8 \\
      --context 32 --new-tokens 8 --repeats 2                                          # 8 CPU devices
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ddtree_jax import engine, sharding
from ddtree_jax.experiments import bench  # noqa: E402
from ddtree_jax.experiments.flags import int_list, name_list  # noqa: E402
from ddtree_jax.experiments.provenance import command_line  # noqa: E402


def check_tokens(target, drafter, tps, args) -> dict:
    """Greedy DDTree tokens per tp (tp = 1: no mesh); ``identical`` compares each with the first."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, target.config.vocab_size, size=(args.batch, args.prompt_tokens)).tolist()
    runs = {}
    for tp in tps:
        res = engine.generate(target, drafter, prompts, method="ddtree", budget=args.budget_check, topk_cap=None,
                              temperature=0.0, max_new_tokens=args.new_tokens, with_expected=False,
                              mesh=None if tp == 1 else sharding.make_mesh(tp))
        runs[tp] = res.tokens
    first = runs[tps[0]]
    out = dict(tps=tps, tokens={str(tp): t.tolist() for tp, t in runs.items()})
    out["identical"] = {str(tp): bool(np.array_equal(t, first)) for tp, t in runs.items()}
    out["first_difference"] = {str(tp): (None if np.array_equal(t, first) else int(np.argmax((t != first).any(0))))
                               for tp, t in runs.items()}
    return out


def allreduce_ms(mesh, rows: int, width: int, dtype, repeats: int) -> float:
    """Median ms of a ``psum`` over ``"tp"`` of a ``[rows, width]`` partial sum held by every device."""
    tp = sharding.tp_size(mesh)
    x = jax.device_put(jnp.ones((tp, rows, width), dtype), NamedSharding(mesh, P("tp")))
    reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "tp"), mesh=mesh, in_specs=P("tp"),
                                   out_specs=P("tp"), check_vma=False))
    return bench.median_ms(lambda: reduce(x), repeats)


def layer_allreduce_ms(target, mesh, tokens: int, repeats: int) -> float:
    """Summed all-reduce time of one layer's four row-split projections for ``tokens`` tokens."""
    c = target.config
    widths = ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size,
              2 * c.intermediate_size, c.hidden_size)
    return sum(allreduce_ms(mesh, tokens, w, target.dtype, repeats) for w in widths)


def bench_latency(target, drafter, tp, args) -> list[dict]:
    """Decode step and DDTree rounds at ``tp``, with the per-layer all-reduce time."""
    mesh = sharding.make_mesh(tp)
    placed = bench.shard_models(target, drafter, mesh)
    sampling = bench.constant_sampling(args.batch, 0.0, 0, 1.0)
    specs = [("decode", 0, engine.make_spec(target, None, "ar", 1, None, args.attention_impl, "xla"))]
    specs += [("ddtree", budget, engine.make_spec(target, drafter, "ddtree", budget, None, args.attention_impl, "xla"))
              for budget in args.budgets]
    rows = []
    for kind, budget, spec in specs:
        ms = bench.time_round(*placed, spec, bench.make_state(target, drafter, spec, args.batch, args.context),
                              sampling, args.repeats, mesh=mesh)
        per_layer = layer_allreduce_ms(target, mesh, args.batch * spec.num_nodes, args.repeats) if tp > 1 else 0.0
        rows.append(dict(tp=tp, kind=kind, budget=budget, ms=ms, allreduce_per_layer_ms=per_layer,
                         allreduce_share=per_layer * target.config.num_hidden_layers / ms))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=name_list(bench.SHAPES), default=["qwen3-8b", "qwen3-32b"],
                    help="comma-separated names of ddtree_jax.experiments.bench.SHAPES")
    ap.add_argument("--no-tp1", type=name_list(bench.SHAPES, empty=True), default=["qwen3-32b"],
                    help="shapes whose token check skips tp = 1 (\"\": none)")
    ap.add_argument("--tps", type=int_list, default=[1, 2, 4, 8], help="tp sizes of the latency table")
    ap.add_argument("--check-tps", type=int_list, default=[1, 8], help="tp sizes whose greedy tokens must agree")
    ap.add_argument("--budgets", type=int_list, default=[64, 256], help="DDTree budgets of the latency table")
    ap.add_argument("--budget-check", type=int, default=64, help="DDTree budget of the token check")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024, help="committed context of the latency table")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--attention-impl", choices=["auto", "xla", "pallas"], default="auto")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench_tp.json"))
    args = ap.parse_args(argv)
    devices = jax.devices()
    if max(args.tps + args.check_tps) > len(devices):
        raise SystemExit(f"bench_tp: tp up to {max(args.tps + args.check_tps)} needs that many devices, "
                         f"{len(devices)} visible")
    result = dict(meta=dict(device=devices[0].device_kind, devices=len(devices), jax=jax.__version__,
                            date=time.strftime("%Y-%m-%d"), command=command_line()), shapes={})
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(result, indent=1))

    print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}", flush=True)
    for name in args.shapes:
        target, drafter = bench.make_models(name)
        entry = result["shapes"][name] = dict(latency=[])
        check_tps = [tp for tp in args.check_tps if not (tp == 1 and name in args.no_tp1)]
        entry["tokens"] = check_tokens(target, drafter, check_tps, args)
        save()
        print(f"{name}: greedy DDTree tokens identical across tp {check_tps}: {entry['tokens']['identical']}",
              flush=True)
        for tp in args.tps:
            if tp == 1 and name in args.no_tp1:
                continue
            for row in bench_latency(target, drafter, tp, args):
                entry["latency"].append(row)
                save()
                print(f"  tp={tp} {row['kind']:>6} B={row['budget']:<4} {row['ms']:8.2f} ms | all-reduce "
                      f"{row['allreduce_per_layer_ms']:.3f} ms/layer ({100 * row['allreduce_share']:.0f}% of it)",
                      flush=True)
        del target, drafter
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
