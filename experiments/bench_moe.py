"""Qwen3-MoE target cost study: the decode step against the roofline of the experts it touches, and
the verify forward per tree budget with the number of distinct experts a tree touches.

For the ``--shapes`` (default ``qwen3-30b-a3b``: 48 layers, 128 experts of width 768, 8 per token,
random bf16 weights, about 61 GB: one H200) and ``--batch`` requests with ``--context`` committed
(zero) cache slots, one device:

* **decode**: the target forward of one new token per request (N = 1) over the cache.
* **verify**: for each ``B`` in ``--budgets`` (16, 64, 256), the forward over a DDTree of ``B + 1``
  nodes per request (`build_tree` on random draft logits of ``--depth`` rows, the tree attention
  mask and positions), as a round's verify step runs it.

Each row has the median time of warm calls (``ms``), the distinct experts its tokens are routed to
in every sparse layer (counted from the router outputs of the same forward, `expert_routes`, over
the whole batch: a step streams each touched expert once; mean, min and max over the sparse
layers), and two rooflines over ``--hbm-tbps``: ``roofline_ms`` streams every weight a forward
reads except the experts nobody was routed to (attention, norms, routers, dense MLPs, the LM head,
the touched experts) plus the KV cache, and ``all_experts_roofline_ms`` streams every expert (what
a grouped matmul lowered to a dense product over the experts would read). ``experts_ms`` is the
two grouped matmuls of one sparse layer alone on the row's tokens (``jax.lax.ragged_dot``), so a
slow lowering of the grouped matmul shows apart from the rest of the forward. ``over_decode`` is
the row's time over the decode step's: the tau at which DDTree with that budget breaks even,
before drafting costs.

With random weights and tokens the router spreads tokens nearly uniformly, so the distinct counts
are close to the most a tree can touch; a trained model on real text routes more tokens alike.

    python experiments/bench_moe.py --out experiments/results/bench_moe.json       # one H200
    python experiments/bench_moe.py --shapes tiny-moe --budgets 4,8 --context 16 --repeats 2   # CPU check
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
import numpy as np  # noqa: E402

from ddtree_jax.experiments import bench  # noqa: E402
from ddtree_jax.experiments.flags import int_list  # noqa: E402
from ddtree_jax.experiments.provenance import command_line  # noqa: E402
from ddtree_jax.models import (  # noqa: E402
    KVCache,
    MoeDecoderLayer,
    Qwen3MoeConfig,
    distinct_experts,
    expert_routes,
    init_cache,
    init_target,
    target_forward,
)
from ddtree_jax.models import moe  # noqa: E402
from ddtree_jax.tree import build_tree, tree_attention_mask, tree_positions  # noqa: E402


def make_target(shapes: str):
    """The target of ``bench.SHAPES[shapes]`` with random weights (bf16); it must be a Qwen3-MoE one."""
    fields = bench.SHAPES[shapes]["target"]
    if "num_experts" not in fields:
        raise ValueError(f"--shapes {shapes} is not a Qwen3-MoE shape (no num_experts)")
    return init_target(Qwen3MoeConfig(**fields), jax.random.key(0))


def expert_bytes(target) -> int:
    """Bytes of one expert (its ``[gate | up]`` and ``down`` slices)."""
    layer = next(x for x in target.params.layers if isinstance(x, MoeDecoderLayer))
    return (layer.experts_gate_up[0].size + layer.experts_down[0].size) * layer.experts_down.dtype.itemsize


def other_bytes(target) -> int:
    """Bytes of every weight a forward streams in full except the experts (`bench.streamed_bytes`
    less the expert stacks)."""
    stacks = [x for layer in target.params.layers if isinstance(layer, MoeDecoderLayer)
              for x in (layer.experts_gate_up, layer.experts_down)]
    return bench.streamed_bytes(target) - bench.weight_bytes(stacks)


def cache_bytes(cache: KVCache, context: int) -> int:
    """Bytes of the committed K and V a forward reads (``context`` slots per request)."""
    layers, batch, heads, _, head_dim = cache.k.shape
    return 2 * layers * batch * heads * context * head_dim * cache.k.dtype.itemsize


def step_inputs(target, batch: int, context: int, budget: int | None, depth: int, seed: int = 0):
    """``(tokens, positions, mask, cache)`` of a decode step (``budget=None``: one token per
    request) or of the verify forward of a DDTree of ``budget + 1`` nodes, after ``context``
    committed slots."""
    cfg = target.config
    nodes = 1 if budget is None else budget + 1
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, context + nodes, cfg.head_dim,
                       target.dtype)
    cache = KVCache(cache.k, cache.v, jnp.full((batch,), context, jnp.int32))
    key_root, key_draft = jax.random.split(jax.random.key(seed))
    root = jax.random.randint(key_root, (batch,), 0, cfg.vocab_size, jnp.int32)
    if budget is None:
        return root[:, None], cache.lengths[:, None], jnp.ones((batch, 1, 1), bool), cache
    tree = build_tree(jax.random.normal(key_draft, (batch, depth, cfg.vocab_size)), root, budget=budget)
    return tree.tokens, tree_positions(tree, cache.lengths), tree_attention_mask(tree), cache


def experts_runner(target, tokens: int, seed: int = 0):
    """One sparse layer's grouped matmuls alone on ``tokens`` random rows routed by its router."""
    layer = next(x for x in target.params.layers if isinstance(x, MoeDecoderLayer))
    cfg = target.config
    h = jax.random.normal(jax.random.key(seed), (tokens, cfg.hidden_size)).astype(target.dtype)
    weights, chosen = moe.route(h, layer.router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    fn = jax.jit(moe.grouped_experts)
    return lambda: fn(h, weights, chosen, layer.experts_gate_up, layer.experts_down)


def measure(target, args, budget: int | None, hbm_bytes_per_s: float) -> dict:
    """One row (see the module docstring): ``budget=None`` is the decode step."""
    cfg = target.config
    tokens, positions, mask, cache = step_inputs(target, args.batch, args.context, budget, args.depth)
    routes_SBNK = expert_routes(target, tokens, positions, mask, cache)
    batch, nodes = tokens.shape
    touched_S = np.asarray(distinct_experts(routes_SBNK.reshape(len(cfg.sparse_layers), 1, batch * nodes, -1),
                                            cfg.num_experts))[:, 0]
    forward = jax.jit(functools.partial(target_forward, attention_impl=args.attention_impl))
    run = lambda: forward(target, tokens, positions, mask, cache)[0]  # noqa: E731
    first_s = bench.first_call_s(run)
    base = other_bytes(target) + cache_bytes(cache, args.context)
    touched_bytes = base + int(touched_S.sum()) * expert_bytes(target)
    all_bytes = base + len(cfg.sparse_layers) * cfg.num_experts * expert_bytes(target)
    return dict(kind="decode" if budget is None else "verify", budget=budget or 0, nodes=nodes, batch=batch,
                context=args.context, ms=bench.median_ms(run, args.repeats), first_call_s=first_s,
                experts_ms=bench.median_ms(experts_runner(target, batch * nodes), args.repeats),
                distinct_experts_mean=float(touched_S.mean()), distinct_experts_min=int(touched_S.min()),
                distinct_experts_max=int(touched_S.max()), touched_fraction=float(touched_S.mean() / cfg.num_experts),
                roofline_ms=1e3 * touched_bytes / hbm_bytes_per_s,
                all_experts_roofline_ms=1e3 * all_bytes / hbm_bytes_per_s, streamed_gb=touched_bytes / 1e9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=sorted(k for k, v in bench.SHAPES.items() if "num_experts" in v["target"]),
                   default="qwen3-30b-a3b")
    p.add_argument("--batch", type=int, default=1, help="requests per step")
    p.add_argument("--context", type=int, default=1024, help="committed cache slots per request")
    p.add_argument("--budgets", type=int_list, default=[16, 64, 256],
                   help="DDTree node budgets of the verify rows")
    p.add_argument("--depth", type=int, default=15, help="drafted depths L of the random draft logits")
    p.add_argument("--attention-impl", choices=["auto", "xla", "pallas"], default="auto")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth of the rooflines, TB/s")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench_moe.json"), help="JSON output (rewritten after every row)")
    args = p.parse_args(argv)
    for name, ok in (("batch", args.batch >= 1), ("context", args.context >= 1), ("depth", args.depth >= 1),
                     ("repeats", args.repeats >= 1), ("hbm_tbps", args.hbm_tbps > 0)):
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    device = jax.devices()[0].device_kind
    print(f"device {device}, jax {jax.__version__}", flush=True)
    target = make_target(args.shapes)
    cfg = target.config
    result = dict(meta=dict(device=device, backend=jax.default_backend(), jax=jax.__version__,
                            date=time.strftime("%Y-%m-%d"), command=command_line(),
                            settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                            sparse_layers=len(cfg.sparse_layers), num_experts=cfg.num_experts,
                            experts_per_token=cfg.num_experts_per_tok, expert_bytes=expert_bytes(target),
                            weight_gb=bench.weight_bytes(target.params) / 1e9), rows=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    decode_ms = None
    for budget in [None, *args.budgets]:
        row = measure(target, args, budget, args.hbm_tbps * 1e12)
        decode_ms = decode_ms or row["ms"]
        row["over_decode"] = row["ms"] / decode_ms
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"{row['kind']:>6} B={row['budget']:4d} ({row['nodes']} tokens/request): {row['ms']:8.2f} ms "
              f"= {row['over_decode']:.2f} decode steps | distinct experts/layer {row['distinct_experts_mean']:.1f} "
              f"of {cfg.num_experts} ({row['distinct_experts_min']}-{row['distinct_experts_max']}) | roofline "
              f"{row['roofline_ms']:.2f} ms (all experts {row['all_experts_roofline_ms']:.2f}) | one layer's experts "
              f"{row['experts_ms']:.3f} ms", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
