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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax import checks, kernels  # noqa: E402
from ddtree_jax.experiments import bench  # noqa: E402
from ddtree_jax.experiments.flags import int_list  # noqa: E402
from ddtree_jax.models import layers  # noqa: E402
from experiments.bench_attention_merge import (  # noqa: E402
    compile_rounds,
    parse_variants,
    print_rows,
    timed_rows,
    write_rows,
)
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
    ap.add_argument("--shapes", choices=sorted(bench.SHAPES), default="qwen3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="requests per round, each with --context tokens")
    ap.add_argument("--budgets", type=int_list, default=[16, 63, 64], help="comma-separated DDTree budgets")
    ap.add_argument("--ar", action="store_true", help="also time the AR round (the decode step)")
    ap.add_argument("--topk-cap", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="the drafter's head over this many tokens (0: the whole vocabulary)")
    ap.add_argument("--variants", default="shipped,xla,qkv_summed",
                    help="comma-separated, of shipped, xla, output_only, qkv_summed, rows_<R>, splits_<S>")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved passes over the variants")
    ap.add_argument("--profile", action="store_true", help="also trace each round and sum its device time")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/bench_residual_norm.json"))
    args = ap.parse_args(argv)
    parsed = parse_variants(args.variants, parse_variant)
    checks.flags(args, [(name, lambda v: v >= 1, ">= 1") for name in ("context", "batch", "repeats")]
                 + [("topk_cap", lambda v: v >= 0, ">= 0"), ("draft_vocab", lambda v: v >= 0, ">= 0")])
    target, drafter = bench.make_models(args.shapes, args.draft_vocab)
    sampling = bench.constant_sampling(args.batch, 1.0, 0, 1.0)
    rounds = [("ar", "ar", 1)] if args.ar else []
    rounds += [(f"ddtree{b}", "ddtree", b) for b in args.budgets]
    runners, boxes = {}, {}
    for name, patches in parsed:
        with variant(**patches):
            runners.update(compile_rounds(target, drafter, rounds, args, boxes, sampling, name))
    rows = timed_rows(runners, args.repeats, args.profile)
    print_rows(rows)
    write_rows(args.out, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
