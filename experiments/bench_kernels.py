"""Benchmark the Pallas kernels against the XLA paths at Qwen3-8B shapes (meant for a GPU).

Tree attention (32 query heads, 8 KV heads, head_dim 128, bf16): the Triton kernel vs the
models' XLA attention and ``jax.nn.dot_product_attention`` with a mask, for N tree nodes,
a committed context and a batch; achieved HBM bandwidth counts the K/V bytes the call must
read (prefix + tree, every KV head) plus the queries and outputs.

    PYTHONPATH=. python experiments/bench_kernels.py --out experiments/results

prints a table and writes ``--name`` (default ``bench_kernels.json``) under ``--out``. ``--sweep`` also times the
candidate tilings of ``SWEEP_CONFIGS`` (how the measured config table entry was chosen).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import configs
from pallas_kernels.configs import TreeAttentionConfig
from pallas_kernels.reference import tree_attention_reference
from pallas_kernels.tree_attention import tree_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SWEEP_CONFIGS = {
    "m64k64w4s3": TreeAttentionConfig(block_m=64, block_k=64, num_warps=4, num_stages=3),
    "m64k128w4s3": TreeAttentionConfig(block_m=64, block_k=128, num_warps=4, num_stages=3),
    "m128k64w8s3": TreeAttentionConfig(block_m=128, block_k=64, num_warps=8, num_stages=3),
    "m64k64w4s4": TreeAttentionConfig(block_m=64, block_k=64, num_warps=4, num_stages=4),
    "m128k128w8s2": TreeAttentionConfig(block_m=128, block_k=128, num_warps=8, num_stages=2),
}


def tree_mask(num_nodes: int) -> np.ndarray:
    """Ancestor mask of a binary heap-shaped tree (node i's parent is (i - 1) // 2)."""
    mask = np.eye(num_nodes, dtype=bool)
    for i in range(1, num_nodes):
        mask[i] |= mask[(i - 1) // 2]
    return mask


def attention_inputs(batch, nodes, context, dtype=jnp.bfloat16, seed=0):
    """Random q, a cache of ``context + nodes`` slots, lengths = context, a tree mask."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    slots = context + nodes
    q = jax.random.normal(kq, (batch, nodes, HEADS, HEAD_DIM), dtype)
    k = jax.random.normal(kk, (batch, KV_HEADS, slots, HEAD_DIM), dtype)
    v = jax.random.normal(kv, (batch, KV_HEADS, slots, HEAD_DIM), dtype)
    lengths = jnp.full((batch,), context, jnp.int32)
    mask = jnp.broadcast_to(jnp.asarray(tree_mask(nodes)), (batch, nodes, nodes))
    return q, k, v, lengths, mask


def dot_product_attention(q, k, v, lengths, mask, *, scale):
    """``jax.nn.dot_product_attention`` with the full visibility mask (cache transposed to BSKD)."""
    slots, nodes = k.shape[2], mask.shape[2]
    rel = jnp.arange(slots)[None, :] - lengths[:, None]
    tree_part = jnp.take_along_axis(mask, jnp.clip(rel, 0, nodes - 1)[:, None, :].repeat(mask.shape[1], 1),
                                    axis=2)
    visible = (rel < 0)[:, None] | (tree_part & ((rel >= 0) & (rel < nodes))[:, None])
    return jax.nn.dot_product_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                        mask=visible[:, None], scale=scale)


def time_per_call(fn, args, *, chain=8, repeats=5) -> float:
    """Seconds per call: ``chain`` dependent calls in one jit (q += 1e-6 * out), median of repeats."""
    def chained(q, *rest):
        for _ in range(chain):
            q = q + (1e-6 * fn(q, *rest)).astype(q.dtype)
        return q
    run = jax.jit(chained)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - start) / chain)
    return float(np.median(times))


def attention_bytes(batch, nodes, context, dtype=jnp.bfloat16) -> int:
    item = jnp.dtype(dtype).itemsize
    kv = 2 * batch * KV_HEADS * (context + nodes) * HEAD_DIM * item
    return kv + 2 * batch * nodes * HEADS * HEAD_DIM * item


def bench_attention(batches, nodes_list, contexts, *, peak_gbs, deadline, sweep, report):
    """Time every implementation on every shape; ``report(records)`` after each shape."""
    scale = HEAD_DIM ** -0.5
    impls = {
        "pallas": lambda *a: tree_attention(*a, scale=scale, backend="triton"),
        "xla": lambda *a: tree_attention_reference(*a, scale=scale),
        "dpa": lambda *a: dot_product_attention(*a, scale=scale),
    }
    if sweep:
        impls.update({f"pallas_{name}": (lambda c: lambda *a: tree_attention(
            *a, scale=scale, backend="triton", config=c))(c) for name, c in SWEEP_CONFIGS.items()})
    records = []
    for batch in batches:
        for nodes in nodes_list:
            for context in contexts:
                if time.monotonic() > deadline:
                    print("time budget reached, stopping", flush=True)
                    return records
                args = attention_inputs(batch, nodes, context)
                nbytes = attention_bytes(batch, nodes, context)
                row = dict(batch=batch, nodes=nodes, context=context, bytes=nbytes)
                for name, fn in impls.items():
                    try:
                        seconds = time_per_call(fn, args)
                        row[name] = dict(ms=seconds * 1e3, gbs=nbytes / seconds / 1e9,
                                         hbm_frac=nbytes / seconds / 1e9 / peak_gbs)
                    except Exception as err:  # noqa: BLE001 (an OOM or unsupported path is a result)
                        row[name] = dict(error=f"{type(err).__name__}: {str(err)[:200]}")
                records.append(row)
                report(records)
                print(format_attention_row(row, sorted(impls)), flush=True)
                del args
    return records


def format_attention_row(row, names):
    cells = [f"B={row['batch']:>2} N={row['nodes']:>3} ctx={row['context']:>6}"]
    for name in names:
        r = row.get(name, {})
        cells.append(f"{name} {r['ms']:8.3f} ms {r['gbs']:6.0f} GB/s" if "ms" in r else f"{name} n/a")
    xla, pallas = row.get("xla", {}), row.get("pallas", {})
    if "ms" in xla and "ms" in pallas:
        cells.append(f"speedup {xla['ms'] / pallas['ms']:.2f}x")
    return " | ".join(cells)


def copy_bandwidth_gbs(nbytes=1 << 30) -> float:
    """Measured read + write bandwidth of an elementwise pass over ``nbytes`` of bf16."""
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    seconds = time_per_call(lambda q: q * 0.5, (x,), chain=4)
    return 2 * nbytes / seconds / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--name", default="bench_kernels.json", help="JSON file name under --out")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--nodes", default="16,64,256")
    parser.add_argument("--contexts", default="1024,4096,16384,32768,65536")
    parser.add_argument("--peak-gbs", type=float, default=4800.0,
                        help="HBM bandwidth used for the fraction column (H200: 4.8 TB/s)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="stop starting new shapes after this many seconds")
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP_CONFIGS")
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    device = jax.devices()[0]
    info = dict(python=platform.python_version(), jax=jax.__version__, device=device.device_kind,
                capability=configs.device_capability(),
                config=str(configs.tree_attention_config()), copy_gbs=copy_bandwidth_gbs())
    print(info, flush=True)
    path = Path(args.out) / args.name
    path.parent.mkdir(parents=True, exist_ok=True)
    report = lambda records: path.write_text(json.dumps(dict(info=info, attention=records), indent=1))  # noqa: E731
    deadline = time.monotonic() + args.budget_s
    bench_attention(ints(args.batches), ints(args.nodes), ints(args.contexts), peak_gbs=args.peak_gbs,
                    deadline=deadline, sweep=args.sweep, report=report)


if __name__ == "__main__":
    main()
