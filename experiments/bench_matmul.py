"""The projections of a decode step: the skinny-matmul kernel vs XLA, against the HBM bandwidth.

For each Qwen3-8B projection (q/k/v with its RMSNorm prologue, attention output, gate/up with its
norm and SwiGLU, down, LM head; attention output and down with their residual add) and each row
count M, the product runs on ``--copies`` distinct
weight copies in one jitted call (so that no weight comes from L2), called back to back
``--calls`` times; time per product = wall time / (calls x copies), median of ``--repeats``. TB/s
counts the weight bytes (what the product must stream). Compared: XLA (the jnp reference), the
kernel with the config the device's policy picks, and with ``--sweep`` a grid of configs around
the policy (weight tiles, K splits, pipeline depth), and with ``--match-xla`` the kernel with the tiles
XLA's GEMM uses for the same product where that GEMM is a Triton one (read from its compiled HLO: does the
kernel stream as fast as XLA's GEMM when tiled alike?; where XLA calls a library GEMM there are no tiles to
copy, and the row says so), with ``--split-k`` XLA's product written as a split-K of each count given
(``split_product``: a batched GEMM over K's chunks and a sum; does another split stream faster than XLA's
own choice?), and with ``--mosaic`` the Mosaic GPU kernel (``matmul_mgpu``: TMA-fed wgmmas, its
prologue and epilogues as XLA ops; ``--mosaic-sweep`` a grid of its configs). Each result is checked
against the reference first. Prints a table and writes JSON.

    PYTHONPATH=. python experiments/bench_matmul.py --rows 1,16,64 --sweep --out bench_matmul.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.experiments.flags import int_list, name_list
from ddtree_jax.experiments.provenance import command_line
from pallas_kernels import configs
from pallas_kernels.configs import MatmulConfig
from pallas_kernels.matmul import matmul
from pallas_kernels.matmul_mgpu import ROWS as MOSAIC_ROWS
from pallas_kernels.matmul_mgpu import MosaicMatmulConfig, matmul_mgpu, split_count
from pallas_kernels.matmul_reference import matmul_reference, rms_norm, swiglu

# name: (K, N, gated, RMSNorm prologue, out dtype, residual epilogue)
SHAPES = {
    "qkv": (4096, 6144, False, True, jnp.bfloat16, False),
    "o": (4096, 4096, False, False, jnp.bfloat16, True),
    "gate_up": (4096, 24576, True, True, jnp.bfloat16, False),
    "down": (12288, 4096, False, False, jnp.bfloat16, True),
    "lm_head": (4096, 151936, False, False, jnp.float32, False),
}


def sweep_configs(policy, m, k, n, gated) -> dict:
    """Configs of a grid of policies around ``policy``: weight tiles, pipeline depth, and the program
    target that sets the K splits (1 = no split, so a gated product fuses its SwiGLU)."""
    grid = {}
    for block_n, block_k, stages, programs in itertools.product((64, 128), (128, 256), (3, 4), (1, 264, 528, 1056)):
        swept = dataclasses.replace(policy, block_n=block_n, block_k=block_k, num_stages=stages, min_programs=programs)
        config = configs.matmul_config(swept, m, k, n, gated)
        grid[f"n{config.block_n}_k{config.block_k}_s{config.num_stages}_x{config.splits}"] = config
    return grid


MOSAIC_SMEM_BYTES = 227 * 1024  # shared memory a Hopper thread block may take


def mosaic_sweep_configs(k, n) -> dict:
    """Mosaic GPU kernel configs of a grid: tile widths and heights, pipeline depth, and the K splits of
    the SM-count policy and twice as many (where they divide K's tiles); those whose buffers (``x`` and
    ``w`` tiles a stage, the float32 output tile) fit `MOSAIC_SMEM_BYTES`."""
    grid = {}
    sms = configs.device_multiprocessors() or configs.DEFAULT_MULTIPROCESSORS
    for block_n, block_k, stages in itertools.product((64, 128, 256), (64, 128), (4, 6)):
        tiles = k // block_k
        smem = stages * (MOSAIC_ROWS + block_n) * block_k * 2 + MOSAIC_ROWS * block_n * 4
        if k % block_k or n % block_n or smem > MOSAIC_SMEM_BYTES:
            continue
        policy = split_count(tiles, n // block_n, sms)
        for splits in sorted({policy, 2 * policy if tiles % (2 * policy) == 0 else policy}):
            config = MosaicMatmulConfig(block_n=block_n, block_k=block_k, splits=splits, num_stages=stages)
            grid[f"mosaic_n{block_n}_k{block_k}_s{stages}_x{splits}"] = config
    return grid


_GEMM_FIELDS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")


def xla_gemm_config(hlo_text: str, m: int, k: int, gated: bool) -> dict[str, MatmulConfig]:
    """Kernel configs with the tiles of the first Triton GEMM in a compiled product's HLO text (its
    ``triton_gemm_config``): ``{"xla_tiles": ...}``, and for a ``gated`` product also
    ``"xla_tiles_half"`` (half the columns a program, as a fused gate/up program reads two tiles);
    ``{}`` where XLA chose no Triton GEMM (cuBLAS)."""
    config_text = re.search(r'triton_gemm_config[^{]*\{([^}]*)\}', hlo_text)
    if not config_text:
        return {}
    fields = {name: int(v) for name, v in re.findall(r'"?(\w+)"?\s*:\s*"?(\d+)"?', config_text.group(1))
              if name in _GEMM_FIELDS}
    if set(fields) != set(_GEMM_FIELDS):
        return {}
    block_m = max(16, min(fields["block_m"], 1 << max(m - 1, 0).bit_length()))
    splits = max(1, min(fields["split_k"], -(-k // fields["block_k"])))
    base = MatmulConfig(block_m=block_m, block_n=fields["block_n"], block_k=fields["block_k"], splits=splits,
                        num_warps=fields["num_warps"], num_stages=fields["num_stages"])
    tiles = {"xla_tiles": base}
    if gated and fields["block_n"] >= 32:
        tiles["xla_tiles_half"] = dataclasses.replace(base, block_n=fields["block_n"] // 2)
    return tiles


def mosaic_product(x_MK, w_KN, *, norm_K, gated, out_dtype, residual_MN, config):
    """`matmul_reference`'s product with the Mosaic GPU kernel for ``x @ w`` and XLA's ops for the
    RMSNorm before it and the SwiGLU and residual after it (the kernel has no prologue or epilogue);
    interpreted off a GPU."""
    x_MK = x_MK if norm_K is None else rms_norm(x_MK, norm_K, 1e-6)
    y_MN = matmul_mgpu(x_MK, w_KN, out_dtype=out_dtype, config=config, interpret=jax.default_backend() != "gpu")
    y_MN = swiglu(y_MN) if gated else y_MN
    return y_MN if residual_MN is None else residual_MN + y_MN


def product_fn(config, gated, norm, out_dtype, residual):
    """A jitted ``(x, norm_K, residual, ws) -> [x @ w for w in ws]`` (with the shape's prologue and
    epilogues) on the kernel (a `MatmulConfig`), the Mosaic GPU kernel (a `MosaicMatmulConfig`), XLA
    (``None``) or XLA's product written as a split-K of that many chunks (an int)."""
    if config is None:
        fn = matmul_reference
    elif isinstance(config, int):
        fn = functools.partial(matmul_reference, splits=config)
    elif isinstance(config, MosaicMatmulConfig):
        fn = functools.partial(mosaic_product, config=config)
    else:
        fn = functools.partial(matmul, config=config)

    def run(x, norm_K, residual_MN, ws):
        return [fn(x, w, norm_K=norm_K if norm else None, gated=gated, out_dtype=out_dtype,
                   residual_MN=residual_MN if residual else None) for w in ws]

    return jax.jit(run)


def operands(m, k, n, copies, seed=0):
    keys = jax.random.split(jax.random.key(seed), copies + 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    norm = (1.0 + 0.1 * jax.random.normal(keys[1], (k,))).astype(jnp.bfloat16)
    residual = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    return x, norm, residual, [(jax.random.normal(key, (k, n)) * k ** -0.5).astype(jnp.bfloat16) for key in keys[3:]]


def time_per_product(fn, args, calls, repeats, copies) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / (calls * copies))
    return float(np.median(times))


def compile_all(jobs, copies):
    """``{job: compiled or error text}``, compiled in parallel threads (XLA and Triton compile outside
    the GIL)."""
    def one(job):
        name, m, _, config = job
        k, n, gated, norm, out_dtype, residual = SHAPES[name]
        S = jax.ShapeDtypeStruct
        try:
            return job, product_fn(config, gated, norm, out_dtype, residual).lower(
                S((m, k), jnp.bfloat16), S((k,), jnp.bfloat16), S((m, n), jnp.bfloat16),
                [S((k, n), jnp.bfloat16)] * copies).compile()
        except Exception as e:  # noqa: BLE001 (a config that does not compile is a row, not a crash)
            return job, repr(e)[:300]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return dict(pool.map(one, jobs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int_list, default=[1, 16, 64], help="comma-separated row counts M")
    p.add_argument("--shapes", type=name_list(SHAPES), default=list(SHAPES),
                   help=f"comma-separated projections, from: {', '.join(SHAPES)}")
    p.add_argument("--sweep", action="store_true", help="also time a grid of configs (rows <= --sweep-rows)")
    p.add_argument("--sweep-rows", type=int, default=16)
    p.add_argument("--match-xla", action="store_true",
                   help="also time the kernel tiled as XLA's GEMM of each product where that is a Triton GEMM "
                        "(read from its HLO)")
    p.add_argument("--split-k", type=int_list, default=[],
                   help="also time XLA's product as an explicit split-K of each of these chunk counts (those that "
                        "divide K)")
    p.add_argument("--mosaic", action="store_true",
                   help=f"also time the Mosaic GPU kernel (TMA-fed, Hopper; rows <= {MOSAIC_ROWS}; its RMSNorm, SwiGLU "
                        "and residual run as XLA ops)")
    p.add_argument("--mosaic-sweep", action="store_true",
                   help="with --mosaic, also time a grid of its configs (tiles, pipeline depth, K splits)")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench_matmul.json"))
    args = p.parse_args(argv)
    capability = configs.device_capability()
    policy = configs.matmul_policy(capability)
    device = jax.devices()[0].device_kind
    print(f"device {device}, capability {capability}, jax {jax.__version__}, policy {policy}", flush=True)
    result = dict(meta=dict(device=device, capability=capability, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                            command=command_line(), policy=dataclasses.asdict(policy)), rows=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    groups = {}
    for name in args.shapes:
        k, n, gated, *_ = SHAPES[name]
        for m in args.rows:
            impls = {"xla": None, "kernel": configs.matmul_config(policy, m, k, n, gated)}
            impls.update({f"xla_split{s}": s for s in args.split_k if k % s == 0})
            if args.sweep and m <= args.sweep_rows:
                impls.update(sweep_configs(policy, m, k, n, gated))
            if args.mosaic and m <= MOSAIC_ROWS:
                impls["mosaic"] = MosaicMatmulConfig()
                if args.mosaic_sweep:
                    impls.update(mosaic_sweep_configs(k, n))
            groups[(name, m)] = [(name, m, impl, config) for impl, config in impls.items()]
    compiled = compile_all([job for jobs in groups.values() for job in jobs], args.copies)
    if args.match_xla:
        matched = []
        for (name, m), jobs in groups.items():
            k, _, gated, *_ = SHAPES[name]
            xla = compiled[jobs[0]]
            tiles = {} if isinstance(xla, str) else xla_gemm_config(xla.as_text(), m, k, gated)
            print(f"{name:8s} M={m:4d} XLA's tiles: {tiles or 'none (not a Triton GEMM)'}", flush=True)
            new_jobs = [(name, m, impl, config) for impl, config in tiles.items()]
            jobs.extend(new_jobs)
            matched.extend(new_jobs)
        compiled.update(compile_all(matched, args.copies))
    print(f"compiled {len(compiled)} products", flush=True)
    for (name, m), jobs in groups.items():
        k, n, gated, norm, out_dtype, residual = SHAPES[name]
        x, nw, res, ws = operands(m, k, n, args.copies)
        reference = product_fn(None, gated, norm, out_dtype, residual)(x, nw, res, ws[:1])[0].astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(reference)))
        for job in jobs:
            _, _, impl, config = job
            fn = compiled[job]
            row = dict(shape=name, m=m, k=k, n=n, impl=impl,
                       config=config if config is None or isinstance(config, int) else dataclasses.asdict(config))
            if isinstance(fn, str):
                row.update(error=fn, ok=False)
                print(f"{name:8s} M={m:4d} {impl:22s} failed: {fn[:100]}", flush=True)
            else:
                err = float(jnp.max(jnp.abs(fn(x, nw, res, ws)[0].astype(jnp.float32) - reference)))
                seconds = time_per_product(fn, (x, nw, res, ws), args.calls, args.repeats, args.copies)
                row.update(us=1e6 * seconds, tbps=k * n * 2 / seconds / 1e12, max_abs_err=err, ref_scale=scale,
                           ok=bool(np.isfinite(err) and err <= 2e-2 * max(scale, 1.0)))
                print(f"{name:8s} M={m:4d} {impl:22s} {row['us']:8.1f} us {row['tbps']:5.2f} TB/s err {err:.1e}"
                      + ("" if row["ok"] else "  WRONG"), flush=True)
            result["rows"].append(row)
            args.out.write_text(json.dumps(result, indent=1))  # after every row: a run cut short keeps its rows
        del ws
    print("\nshape      M  xla TB/s  policy TB/s  best TB/s  best config", flush=True)
    for name, m in groups:
        rows = {r["impl"]: r for r in result["rows"] if (r["shape"], r["m"]) == (name, m)}
        timed = [r for r in rows.values() if r.get("ok") and r["impl"] != "xla"]
        best = min(timed, key=lambda r: r["us"]) if timed else {"tbps": float("nan"), "impl": "-"}
        print(f"{name:8s} {m:4d} {rows['xla'].get('tbps', float('nan')):9.2f} "
              f"{rows['kernel'].get('tbps', float('nan')):12.2f} {best['tbps']:10.2f}  {best['impl']}", flush=True)
    print(f"wrote {args.out}")
    return 0 if all(r.get("ok", False) for r in result["rows"] if r["impl"] in ("xla", "kernel")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
