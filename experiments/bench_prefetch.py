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
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax import kernels  # noqa: E402
from experiments.bench_attention_merge import add_round_flags, parse_variants, run_variants  # noqa: E402
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
    add_round_flags(ap, budgets=[16, 63], draft_vocab=32768, repeats=7, out="experiments/results/bench_prefetch.json")
    ap.add_argument("--no-ar", dest="ar", action="store_false", help="leave out the AR round (the decode step)")
    ap.add_argument("--variants", default="off,wo=1", help="comma-separated, of shipped, off, field=value+...")
    args = ap.parse_args(argv)
    capability = configs.device_capability()
    parsed = parse_variants(args.variants, lambda name: parse_variant(name, kernels.L2_PREFETCH.get(capability)))
    return run_variants(args, [(name, functools.partial(variant, capability, config)) for name, config in parsed],
                        args.ar)


if __name__ == "__main__":
    sys.exit(main())
