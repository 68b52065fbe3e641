"""A/B of the kernels that sum split-K partials inside the engine's rounds, in one process.

Under ``auto`` on sm_90 the attention output and down products of the verify forwards (17 rows or more,
`kernels.RESIDUAL_NORM_MIN_ROWS`) are a split-K (`kernels.split_k_chunks` chunks) whose partials the
``residual_norm`` kernel sums, adds to the residual and normalises by the next product's RMSNorm weight in
one launch, the next product taking the normalised rows; and every q/k/v product hands its partials to the
q/k norm + RoPE + K/V-write kernel, which sums them (`kernels.QKV_PARTIALS`). This script compiles the DDTree
rounds per ``--budgets`` (and the AR round with ``--ar``) at Qwen3-8B shapes, random weights, ``--batch``
requests of ``--context`` tokens, once per variant, times them back to back with the variants interleaved,
and with ``--profile`` sums each round's device time. ``--variants`` names them:

  shipped      the library as it is
  xla          XLA's split-K sum + residual and RMSNorm fusions everywhere (the kernel's rows emptied)
  output_only  the kernel after the attention output product only: the target's down products leave the
               next layer's input norm to its q/k/v product's prologue (XLA picks another q/k/v GEMM for a
               normalised input at 64 rows)
  rows_<R>     the kernel from R rows
  splits_<S>   the kernel's split-K in S chunks for every product (4: before `split_k_chunks`)
  qkv_summed   XLA sums the q/k/v partials before the norm + RoPE + write kernel

Prints a table and writes JSON. Off a GPU every variant is XLA's program.

    PYTHONPATH=. python3 experiments/bench_residual_norm.py --budgets 16,63,64 --variants shipped,xla,qkv_summed \
        --profile --out experiments/results/bench_residual_norm.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax import kernels  # noqa: E402
from ddtree_jax.models import layers  # noqa: E402
from experiments.bench_attention_merge import add_round_flags, parse_variants, run_variants  # noqa: E402
from pallas_kernels import configs  # noqa: E402
from pallas_kernels.matmul_reference import matmul_reference  # noqa: E402

FIXED = {"shipped": {}, "xla": {"rows": 0}, "output_only": {"down": False}, "qkv_summed": {"qkv": False}}


def parse_variant(name: str) -> dict:
    """The patches of one variant (`variant`'s keywords): ``rows`` (the kernel's first row count, 0: never),
    ``down`` (whether the down products pass the next layer's input norm on), ``splits`` (the split's chunks
    for every product), ``qkv`` (whether the q/k/v products hand their partials over); none for ``shipped``."""
    if name in FIXED:
        return FIXED[name]
    prefix, _, number = name.partition("_")
    if prefix in ("rows", "splits") and number.isdigit() and int(number) >= 1:
        return {prefix: int(number)}
    raise ValueError(f"--variants: {name!r} is not one of {', '.join(FIXED)}, rows_<R> or splits_<S>")


@contextlib.contextmanager
def variant(rows: int | None = None, down: bool = True, splits: int | None = None, qkv: bool = True):
    """The library patched for one variant while tracing (`parse_variant`), restored after."""
    capability = configs.device_capability()
    saved = dict(kernels.RESIDUAL_NORM_MIN_ROWS), set(kernels.QKV_PARTIALS), kernels.split_k_chunks
    dense_mlp = layers.dense_mlp

    def without_next_norm(layer, x_BND, shape, matmul=matmul_reference, h_BND=None, then_norm_D=None):
        return dense_mlp(layer, x_BND, shape, matmul, h_BND, None)

    try:
        if rows == 0:
            kernels.RESIDUAL_NORM_MIN_ROWS.clear()
        elif rows is not None:
            kernels.RESIDUAL_NORM_MIN_ROWS[capability] = rows
        if not down:
            layers.dense_mlp = without_next_norm
        if splits is not None:
            kernels.split_k_chunks = lambda k: splits
        if not qkv:
            kernels.QKV_PARTIALS.clear()
        yield
    finally:
        kernels.RESIDUAL_NORM_MIN_ROWS.clear()
        kernels.RESIDUAL_NORM_MIN_ROWS.update(saved[0])
        kernels.QKV_PARTIALS.clear()
        kernels.QKV_PARTIALS.update(saved[1])
        kernels.split_k_chunks = saved[2]
        layers.dense_mlp = dense_mlp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_flags(ap, budgets=[16, 63, 64], draft_vocab=32768, repeats=7,
                    out="experiments/results/bench_residual_norm.json")
    ap.add_argument("--ar", action="store_true", help="also time the AR round (the decode step)")
    ap.add_argument("--variants", default="shipped,xla,qkv_summed",
                    help="comma-separated, of shipped, xla, output_only, qkv_summed, rows_<R>, splits_<S>")
    args = ap.parse_args(argv)
    parsed = parse_variants(args.variants, parse_variant)
    return run_variants(args, [(name, functools.partial(variant, **patches)) for name, patches in parsed], args.ar)


if __name__ == "__main__":
    sys.exit(main())
