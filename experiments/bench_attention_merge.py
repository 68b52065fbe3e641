"""A/B of the attention's split policy and tiling inside the engine's rounds, in one process.

At batch 1 the tree-attention kernel cuts a request's KV prefix into splits so that one request fills
the GPU (27 at a 5k-slot cache on an H200 without a bound on their number), and XLA merges their
partial outputs in two fusions per layer (the running maxima and sums, then the weighted sum of the
outputs fused with the pad of the output projection's rows); the partial outputs are
``[splits, rows, head_dim]`` in the activations' dtype, 3.7 MB a layer in bfloat16 for a 16-node tree and
27 splits.
This script compiles the AR round (the decode step) and a DDTree round per ``--budgets`` at Qwen3-8B
shapes, random weights, ``--batch`` requests of ``--context`` tokens (the drafter's head over
``--draft-vocab`` tokens), once per variant, times them back to back with the variants interleaved, and with
``--profile`` sums each round's device time.
``--variants`` names them:

  shipped        the local GPU's split policy and tiling as they are
  by_capacity    the cache's capacity cut into fixed chunks, of which a short prefix fills few
  by_length      each request's prefix cut into the splits by its length (equal chunks of whole key
                 blocks)
  chunk_<C>      the split policy's minimum chunk set to C slots (fewer splits to merge)
  programs_<P>   the split policy's minimum programs set to P (fewer splits to merge)
  splits_<S>     at most S splits (``max_splits``)
  whole_waves    the split count lowered to the fewest waves of programs per unit of prefix
  tile_<T>       the tiling T, as ``bench_kernels.py --sweep-configs`` names one (``tile_m64k32w4s3``:
                 64-row, 32-key blocks, 4 warps, 3 stages; fields left out stay the local entry's)

With ``--baseline-module PATH`` a variant ``baseline`` joins them: the rounds compiled with that file's
``tree_attention`` (a previous version of the kernel module) and the local GPU's entry, so that a change to
the kernel is timed inside the rounds against the version before it.

Prints a table and writes JSON. Off a GPU the attention is XLA's and every variant is the same program.

    PYTHONPATH=. python3 experiments/bench_attention_merge.py --variants shipped,by_capacity,programs_128 \
        --out experiments/results/bench_attention_merge.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ddtree_jax import checks, engine, kernels  # noqa: E402
from ddtree_jax.experiments import bench, profiling  # noqa: E402
from ddtree_jax.experiments.flags import attention_tiling, int_list  # noqa: E402
from ddtree_jax.experiments.provenance import command_line  # noqa: E402
from experiments.bench_kernels import load_baseline  # noqa: E402
from pallas_kernels import configs  # noqa: E402


FIXED_VARIANTS = {"shipped": {}, "by_capacity": dict(split_by_length=False), "by_length": dict(split_by_length=True),
                  "whole_waves": dict(whole_waves=True)}
NUMBERED_VARIANTS = {"chunk": "min_chunk", "programs": "min_programs", "splits": "max_splits"}


def parse_variant(name: str):
    """The ``TreeAttentionConfig`` fields of a ``--variants`` name (see the module docstring)."""
    if name in FIXED_VARIANTS:
        return FIXED_VARIANTS[name]
    prefix, _, number = name.rpartition("_")
    if prefix in NUMBERED_VARIANTS and number.isdigit() and int(number) >= 1:
        return {NUMBERED_VARIANTS[prefix]: int(number)}
    if prefix == "tile":
        try:
            return attention_tiling(number)
        except ValueError as err:
            raise ValueError(f"--variants: {err}") from None
    raise ValueError(f"--variants: {name!r} is not one of {', '.join(FIXED_VARIANTS)}, chunk_<C>, programs_<P>, "
                     f"splits_<S> (C, P, S >= 1) or tile_<tiling>")


@contextlib.contextmanager
def patched(capability, config, attend):
    """The local GPU's table entry set to ``config`` (where the table has one) and the library's attention
    kernel to ``attend`` while the rounds are compiled; both restored after."""
    table, kernel = dict(configs.TREE_ATTENTION_CONFIGS), kernels.tree_attention
    if capability in configs.TREE_ATTENTION_CONFIGS:
        configs.TREE_ATTENTION_CONFIGS[capability] = config
    kernels.tree_attention = attend
    try:
        yield
    finally:
        configs.TREE_ATTENTION_CONFIGS.clear()
        configs.TREE_ATTENTION_CONFIGS.update(table)
        kernels.tree_attention = kernel


def parse_variants(text: str, parse) -> list[tuple]:
    """``(name, parse(name))`` for each comma-separated name in ``text`` (a ``--variants`` flag); a
    ``ValueError`` naming the flag unless the names are distinct and there is at least one."""
    names = [v for v in text.split(",") if v]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--variants must name distinct variants, got {text!r}")
    return [(name, parse(name)) for name in names]


def compiled_round(target, drafter, spec, box, sampling):
    """The engine's round compiled now (traced afresh), and a runner threading the state ``box[0]``
    through. The variants of a round share one box: their states are alike, and a state each would hold
    a KV cache per variant (6 GB at batch 8, which ran an 80 GB GPU out of memory at three variants)."""
    jax.clear_caches()
    args = bench.round_args(box[0].root.shape[0], sampling)
    drafter = drafter if spec.method != "ar" else None
    exe = engine.decode_round.lower(target, drafter, box[0], *args, spec=spec, max_new_tokens=10**6,
                                    with_expected=False).compile()

    def run():
        box[0], out = exe(target, drafter, box[0], *args)
        return out

    return run


def compile_rounds(target, drafter, rounds, args, boxes: dict, sampling, name: str) -> dict:
    """``{(name, label): runner}`` of `compiled_round` for each ``(label, method, budget)`` of ``rounds``
    (``args``: the script's ``topk_cap``, ``batch`` and ``context``); ``boxes`` holds one state a label,
    made at its first round and shared by every variant after."""
    runners = {}
    for label, method, budget in rounds:
        spec = engine.make_spec(target, drafter, method, budget, args.topk_cap or None, "auto", "auto", "auto",
                                build_impl="auto")
        if label not in boxes:
            boxes[label] = [bench.make_state(target, drafter, spec, args.batch, args.context)]
        runners[name, label] = compiled_round(target, drafter, spec, boxes[label], sampling)
        print(f"compiled {name} {label}", flush=True)
    return runners


def time_interleaved(runners: dict, repeats: int) -> dict:
    """``{key: [ms a round back to back, one a pass]}`` of ``runners`` (`compiled_round`s), ``repeats`` passes
    that time every runner once in turn, so that a drift of the machine falls on all of them alike."""
    times = {key: [] for key in runners}
    for _ in range(repeats):
        for key, run in runners.items():
            times[key].append(bench.back_to_back_ms(run, 3))
    return times


def write_rows(out: Path, args, rows: list) -> None:
    """``rows`` with the run's device, versions, date, command line and flags, as JSON at ``out``."""
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                command=command_line(), settings={k: str(v) for k, v in vars(args).items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {out}")


def timed_rows(runners: dict, repeats: int, profile: bool) -> list[dict]:
    """A row a ``(variant, round)`` of ``runners``: the median of `time_interleaved`'s passes and, with
    ``profile``, the round's device time a call (``device_ms``: the traced ops of its busiest line, the main
    stream's, summed; XLA's copies on streams of their own overlap it) with the ops."""
    rows = []
    for (name, label), ms in time_interleaved(runners, repeats).items():
        row = dict(variant=name, round=label, back_to_back_ms=float(np.median(ms)), all_ms=ms)
        if profile:
            ops = profiling.device_op_times(runners[name, label], calls=3, top=20)
            row.update(device_ms=max((line["ms_per_call"] for line in ops.values()), default=0.0), profile=ops)
        rows.append(row)
    return rows


def add_round_flags(ap: argparse.ArgumentParser, *, budgets, draft_vocab: int, repeats: int, out: str) -> None:
    """The flags every round A/B script shares, with its defaults: the shapes, the requests, the DDTree
    budgets and cap, the drafter's vocabulary, the interleaved passes, ``--profile`` and ``--out``."""
    ap.add_argument("--shapes", choices=sorted(bench.SHAPES), default="qwen3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="requests per round, each with --context tokens")
    ap.add_argument("--budgets", type=int_list, default=budgets, help="comma-separated DDTree budgets")
    ap.add_argument("--topk-cap", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=draft_vocab,
                    help="the drafter's head over this many tokens (0: the whole vocabulary)")
    ap.add_argument("--repeats", type=int, default=repeats, help="interleaved passes over the variants")
    ap.add_argument("--profile", action="store_true", help="also trace each round and sum its device time")
    ap.add_argument("--out", type=Path, default=Path(out))


def run_variants(args, variants: list[tuple], ar: bool) -> int:
    """The rounds (AR's with ``ar``, a DDTree round per ``args.budgets``) compiled under each ``(name,
    patch)`` of ``variants`` (``patch()``: a context manager patching the library while tracing), timed
    interleaved (`timed_rows`), printed and written to ``args.out``; the flags of `add_round_flags` checked
    first. Returns 0."""
    checks.flags(args, [(name, lambda v: v >= 1, ">= 1") for name in ("context", "batch", "repeats")]
                 + [("topk_cap", lambda v: v >= 0, ">= 0"), ("draft_vocab", lambda v: v >= 0, ">= 0")])
    target, drafter = bench.make_models(args.shapes, args.draft_vocab)
    sampling = bench.constant_sampling(args.batch, 1.0, 0, 1.0)
    rounds = [("ar", "ar", 1)] if ar else []
    rounds += [(f"ddtree{b}", "ddtree", b) for b in args.budgets]
    runners, boxes = {}, {}
    for name, patch in variants:
        with patch():
            runners.update(compile_rounds(target, drafter, rounds, args, boxes, sampling, name))
    rows = timed_rows(runners, args.repeats, args.profile)
    print_rows(rows)
    write_rows(args.out, args, rows)
    return 0


def print_rows(rows: list[dict]) -> None:
    """A table of `timed_rows`, each round's time also as a ratio to the first variant's."""
    first = {row["round"]: row for row in reversed(rows)}
    print(f"{'variant':>14} {'round':>10} {'back to back':>13} {'vs ' + rows[0]['variant']:>14} {'device':>9}",
          flush=True)
    for row in rows:
        ratio = row["back_to_back_ms"] / first[row["round"]]["back_to_back_ms"]
        device = f"{row['device_ms']:.3f}" if "device_ms" in row else "-"
        print(f"{row['variant']:>14} {row['round']:>10} {row['back_to_back_ms']:10.3f} ms {ratio:13.3f}x "
              f"{device:>9}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_flags(ap, budgets=[16], draft_vocab=0, repeats=5, out="experiments/results/bench_attention_merge.json")
    ap.add_argument("--variants", default="shipped,splits_4,splits_16",
                    help="comma-separated, of shipped, by_capacity, by_length, whole_waves, chunk_<C>, "
                         "programs_<P>, splits_<S>, tile_<tiling>")
    ap.add_argument("--baseline-module", default=None,
                    help="a previous version of pallas_kernels/tree_attention.py, timed as the variant 'baseline'")
    args = ap.parse_args(argv)
    parsed = parse_variants(args.variants, parse_variant)
    shipped_config = configs.tree_attention_config()
    capability = configs.device_capability()
    baseline = load_baseline(args.baseline_module, "tree_attention_baseline") if args.baseline_module else None
    variants = []
    for name, fields in parsed + ([("baseline", {})] if baseline else []):
        attend = baseline.tree_attention if name == "baseline" else kernels.tree_attention
        variants.append((name, functools.partial(patched, capability, dataclasses.replace(shipped_config, **fields),
                                                 attend)))
    return run_variants(args, variants, ar=True)


if __name__ == "__main__":
    sys.exit(main())
