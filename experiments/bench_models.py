"""Target forward speed at Qwen3-8B shapes (random bf16 weights): decode vs tree verify vs the HBM roofline.

One process, warm jit, ``block_until_ready``, medians. The roofline is the bytes every forward must
stream (all layer weights + the LM head) over the HBM bandwidth (default 4.8 TB/s, H200).

    python experiments/bench_models.py --context 4096 --nodes 16,64,256
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

from ddtree_jax.bench import streamed_bytes  # noqa: E402
from ddtree_jax.models import Qwen3Config, init_cache, init_target, target_forward  # noqa: E402
from experiments.common import median_ms  # noqa: E402

QWEN3_8B = dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                tie_word_embeddings=False, max_position_embeddings=131072)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--nodes", default="16,64,256")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=QWEN3_8B["num_hidden_layers"])
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="experiments/results/bench_models.json")
    args = ap.parse_args()
    cfg = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": args.layers})
    target = init_target(cfg, jax.random.key(0), jnp.bfloat16)
    nodes = [1] + [int(n) for n in args.nodes.split(",")]
    cache = init_cache(cfg.num_hidden_layers, args.batch, cfg.num_key_value_heads, args.context + max(nodes),
                       cfg.head_dim, jnp.bfloat16)
    cache = type(cache)(k=cache.k, v=cache.v, lengths=jnp.full((args.batch,), args.context, jnp.int32))
    roofline_ms = 1e3 * streamed_bytes(target) / (args.hbm_tbps * 1e12)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; weights streamed "
          f"{streamed_bytes(target) / 1e9:.2f} GB, roofline {roofline_ms:.2f} ms")
    rows = []
    for n in nodes:
        tokens = jnp.zeros((args.batch, n), jnp.int32)
        positions = args.context + jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (args.batch, n))
        # A chain-shaped ancestor mask has the same cost as any tree mask of n nodes.
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (args.batch, n, n))
        forward = functools.partial(target_forward, target, tokens, positions, mask, cache)
        ms = median_ms(lambda f=forward: f()[0], args.repeats)
        rows.append(dict(nodes=n, ms=ms, vs_roofline=ms / roofline_ms))
        print(f"{'decode' if n == 1 else f'verify N={n}':>14}: {ms:8.2f} ms  {ms / roofline_ms:5.2f}x roofline",
              flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                context=args.context, batch=args.batch, layers=args.layers, roofline_ms=roofline_ms)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
