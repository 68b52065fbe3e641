"""A/B of reading weights into L2 ahead of their products (`kernels.L2_PREFETCH`) inside the engine's rounds.

Between the products of a decoder layer the norms, RoPE, cache write, attention and the merge of its splits
leave HBM idle; the `l2_prefetch` kernel, on a second stream, reads a fraction of the next product's weights
into L2 meanwhile (`kernels.prefetch_fn`). This script compiles the AR round (the decode step) and a DDTree
round per ``--budgets`` at Qwen3-8B shapes, random weights, ``--batch`` requests of ``--context`` tokens, once
per variant, times them back to back with the variants interleaved, and with ``--profile`` sums each round's
device time by stream. ``--variants`` names them:

  shipped      the library as it is
  off          nothing read ahead
  <fields>     `kernels.L2Prefetch` fields joined by ``+``, e.g. ``wo=1+programs=32``: the shipped
               entry (or the defaults, where the device has none) with those fields

Prints a table and writes JSON. Off a GPU nothing is read ahead and every variant is the same program.

    PYTHONPATH=. python3 experiments/bench_prefetch.py --budgets 16,63 --variants off,wo=1,wo=0.5 \
        --profile --out experiments/results/bench_prefetch.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax import checks, kernels  # noqa: E402
from ddtree_jax.experiments import bench  # noqa: E402
from ddtree_jax.experiments.flags import int_list  # noqa: E402
from experiments.bench_attention_merge import (  # noqa: E402
    compile_rounds,
    parse_variants,
    print_rows,
    timed_rows,
    write_rows,
)
from pallas_kernels import configs  # noqa: E402

FRACTIONS = ("wo",)


def parse_variant(name: str, base: kernels.L2Prefetch | None) -> kernels.L2Prefetch | None:
    """The `kernels.L2Prefetch` of one variant (``None``: nothing read ahead), from ``base`` (the shipped
    entry or ``None``); a ``ValueError`` naming the variant unless it is ``shipped``, ``off`` or ``+``-joined
    ``field=value`` pairs of known fields."""
    if name == "shipped":
        return base
    if name == "off":
        return None
    fields = {}
    names = {f.name for f in dataclasses.fields(kernels.L2Prefetch)}
    for pair in name.split("+"):
        field, _, value = pair.partition("=")
        if field not in names or not value:
            raise ValueError(f"--variants: {name!r} is not shipped, off or '+'-joined field=value pairs of "
                             f"{', '.join(sorted(names))}")
        try:
            fields[field] = float(value) if field in FRACTIONS else int(value)
        except ValueError:
            raise ValueError(f"--variants: {field} in {name!r} must be a number, got {value!r}") from None
    return dataclasses.replace(base or kernels.L2Prefetch(), **fields)


@contextlib.contextmanager
def variant(capability, config: kernels.L2Prefetch | None):
    """`kernels.L2_PREFETCH` holding ``config`` (nothing, for ``None``) for ``capability`` while tracing."""
    saved = dict(kernels.L2_PREFETCH)
    try:
        kernels.L2_PREFETCH.pop(capability, None)
        if config is not None:
            kernels.L2_PREFETCH[capability] = config
        yield
    finally:
        kernels.L2_PREFETCH.clear()
        kernels.L2_PREFETCH.update(saved)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(bench.SHAPES), default="qwen3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="requests per round, each with --context tokens")
    ap.add_argument("--budgets", type=int_list, default=[16, 63], help="comma-separated DDTree budgets")
    ap.add_argument("--no-ar", dest="ar", action="store_false", help="leave out the AR round (the decode step)")
    ap.add_argument("--topk-cap", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="the drafter's head over this many tokens (0: the whole vocabulary)")
    ap.add_argument("--variants", default="off,wo=1", help="comma-separated, of shipped, off, field=value+...")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved passes over the variants")
    ap.add_argument("--profile", action="store_true", help="also trace each round and sum its device time")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/bench_prefetch.json"))
    args = ap.parse_args(argv)
    capability = configs.device_capability()
    parsed = parse_variants(args.variants, lambda name: parse_variant(name, kernels.L2_PREFETCH.get(capability)))
    checks.flags(args, [(name, lambda v: v >= 1, ">= 1") for name in ("context", "batch", "repeats")]
                 + [("topk_cap", lambda v: v >= 0, ">= 0"), ("draft_vocab", lambda v: v >= 0, ">= 0")])
    target, drafter = bench.make_models(args.shapes, args.draft_vocab)
    sampling = bench.constant_sampling(args.batch, 1.0, 0, 1.0)
    rounds = [("ar", "ar", 1)] if args.ar else []
    rounds += [(f"ddtree{b}", "ddtree", b) for b in args.budgets]
    runners, boxes = {}, {}
    for name, config in parsed:
        with variant(capability, config):
            runners.update(compile_rounds(target, drafter, rounds, args, boxes, sampling, name))
    rows = timed_rows(runners, args.repeats, args.profile)
    print_rows(rows)
    write_rows(args.out, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
