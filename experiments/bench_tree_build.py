"""Micro-benchmark of the tree build at Qwen3 vocabulary size: the whole build and its parts.

Times, in one process (jit, warm, ``block_until_ready``, median of repeats), for each batch and
budget B (``--topk-cap``, default none, so K = B):
  full          = the XLA tree build (``build_impl="xla"``) + tree_attention_mask + tree_positions
                  from draft logits [batch, L, V], as the engine's round uses them
  full_in_loop  = the same, per build of 20 builds in one call (a ``lax.fori_loop``, one element of
                  the drafts changed a step): its cost inside a jitted round, where no dispatch is paid
  log_softmax   = the draft log-probabilities alone
  top_k         = the exact vocabulary top-K the build uses (`selection.top_k`, from log-probabilities;
                  its stages, `selection.top_k_plan`, in the column ``plan``, and whether it equals
                  ``lax.top_k`` on this device in ``top_k_exact``)
  beam          = the per-depth beam and the global order (`tree_from_top_k`, from the top-K)
  encodings     = attention mask + positions of a built tree
  lax_top_k     = plain ``lax.top_k(lp, K)`` over the vocabulary: what XLA gives for the top-k
  top_k_kernel  = the top-K by the radix-selection kernel (`pallas_kernels.top_k`), with
                  ``top_k_kernel_exact``; ``top_k_in_loop`` and ``top_k_kernel_in_loop`` the library's
                  top-K and the kernel's per call of 20 in one jitted loop; ``--top-k-variants s64``
                  adds ``top_k_kernel_<variant>_in_loop`` (and ``_exact``), other launches of the kernel
  beam_kernel   = ``beam`` by the Pallas tree-build kernel (`pallas_kernels.tree_build`, budgets it
                  takes; interpreted off a GPU), and ``kernel_in_loop`` the ``full_in_loop`` build
                  with it (``build_impl="pallas"``, `kernels.tree_build_fn`, up to the budgets where the
                  library runs it, `kernels.ONE_PROGRAM_BUILD_MAX_BUDGET`); ``kernel_equal`` says
                  whether its tree equals the XLA path's on this device
  beam_in_loop, beam_kernel_in_loop
                = the beam and global order alone (from the top-K), XLA's and the kernel's, per call
                  of 20 in one jitted loop; ``--kernel-variants w16,c0`` adds
                  ``beam_kernel_<variant>_in_loop`` (and ``kernel_<variant>_equal``): the kernel with
                  another launch than the library's (`tree_build.tree_build_config`; `parse_variant`:
                  warps, candidates a count tile)
  beam_wide_in_loop
                = the same by the wide build (`pallas_kernels.tree_build_wide`, the budgets it takes),
                  with ``wide_equal``, and ``wide_in_loop`` the ``full_in_loop`` build with it;
                  ``--wide-variants r64,w8`` adds ``beam_wide_<variant>_in_loop``
and two floors: reading the float32 draft logits once at 4.8 TB/s (the H200's HBM bandwidth) and
an empty jitted call (the dispatch cost every timed call above but ``full_in_loop`` carries). ``--profile`` adds the
device ops of the full build and of the library's ``pallas`` build, summed by kind
(`ddtree_jax.experiments.profiling`). Prints a table
and writes JSON.

    PYTHONPATH=. python3 experiments/bench_tree_build.py --out experiments/results/bench_tree_build.json
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax import kernels, selection  # noqa: E402
from ddtree_jax.experiments import profiling  # noqa: E402
from ddtree_jax.experiments.bench import checksum, loop_ms, nudged_loop_ms  # noqa: E402
from ddtree_jax.experiments.flags import int_list  # noqa: E402
from ddtree_jax.experiments.provenance import command_line  # noqa: E402
from ddtree_jax.tree import (  # noqa: E402
    draft_log_probs,
    top_k_width,
    tree_attention_mask,
    tree_from_nodes,
    tree_from_top_k,
    tree_positions,
)
from experiments.common import median_ms  # noqa: E402
from pallas_kernels.top_k import TopKConfig  # noqa: E402
from pallas_kernels.top_k import top_k as radix_top_k  # noqa: E402
from pallas_kernels.tree_build import TreeBuildConfig, kernel_supports, tree_build_config, tree_nodes  # noqa: E402
from pallas_kernels.tree_build_wide import WideBuildConfig, tree_nodes_wide, wide_build_config  # noqa: E402
from pallas_kernels.tree_build_wide import kernel_supports as wide_supports  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
LOOP_STEPS = 20
COLUMNS = ("full_ms", "full_in_loop_ms", "log_softmax_ms", "top_k_ms", "beam_ms", "encodings_ms", "lax_top_k_ms",
           "beam_kernel_ms", "kernel_in_loop_ms")


KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


def build_and_encode(draft_logits, roots, budget, topk_cap, impl="xla"):
    tree = kernels.tree_build_fn(impl)(draft_logits, roots, jnp.float32(1.0), budget=budget, topk_cap=topk_cap)
    return tree, tree_attention_mask(tree), tree_positions(tree, jnp.zeros_like(roots))


full = jax.jit(build_and_encode, static_argnames=("budget", "topk_cap", "impl"))


log_softmax = jax.jit(lambda logits: draft_log_probs(logits, jnp.float32(1.0)))
vocab_top_k = jax.jit(selection.top_k, static_argnames=("k",))
lax_top_k = jax.jit(jax.lax.top_k, static_argnames=("k",))
empty = jax.jit(lambda x: x + 1)


@functools.partial(jax.jit, static_argnames=("k", "config"))
def top_k_kernel(lp_BLV, *, k, config=None):
    batch, depth, vocab = lp_BLV.shape
    values, ids = radix_top_k(lp_BLV.reshape(batch * depth, vocab), k, config=config,
                              interpret=KERNEL_IMPL == "interpret")
    return values.reshape(batch, depth, k), ids.reshape(batch, depth, k)


@functools.partial(jax.jit, static_argnames=("budget",))
def beam(lp_BLK, tok_BLK, roots, *, budget):
    count_max = selection.count_limit(lp_BLK.shape[0])  # as build_tree_unchecked chooses it
    return jax.vmap(functools.partial(tree_from_top_k, budget=budget, count_max=count_max))(lp_BLK, tok_BLK, roots)


@functools.partial(jax.jit, static_argnames=("budget", "config"))
def beam_kernel(lp_BLK, tok_BLK, roots, *, budget, config):
    nodes = tree_nodes(lp_BLK, tok_BLK, budget=budget, config=config, interpret=KERNEL_IMPL == "interpret")
    return tree_from_nodes(roots, *nodes, max_depth=lp_BLK.shape[1])


@functools.partial(jax.jit, static_argnames=("budget", "config"))
def beam_wide(lp_BLK, tok_BLK, roots, *, budget, config):
    nodes = tree_nodes_wide(lp_BLK, tok_BLK, budget=budget, config=config, interpret=KERNEL_IMPL == "interpret")
    return tree_from_nodes(roots, *nodes, max_depth=lp_BLK.shape[1])


@jax.jit
def encodings(tree, roots):
    return tree_attention_mask(tree), tree_positions(tree, jnp.zeros_like(roots))


def time_row(draft_logits, budget, topk_cap, repeats, kernel_variants=(), wide_variants=(), top_k_variants=()) -> dict:
    """Every column of one (batch, budget) row, in ms (``topk_cap``: None or the per-depth cap;
    ``kernel_variants``, ``wide_variants``, ``top_k_variants``: the kernels' other launches to time,
    `parse_variant`, `parse_wide_variant` and `parse_top_k_variant` names)."""
    drafts = jnp.stack([draft_logits, draft_logits[:, ::-1], -draft_logits, draft_logits[:, :, ::-1]])
    batch, depth, vocab = draft_logits.shape
    k = top_k_width(budget, topk_cap, vocab)
    roots = jnp.zeros((batch,), jnp.int32)
    lp = log_softmax(draft_logits)
    lp_k, tok_k = vocab_top_k(lp, k=k)
    want_k, want_tok = lax_top_k(lp, k=k)
    exact = bool(jnp.array_equal(lp_k, want_k) and jnp.array_equal(tok_k, want_tok))
    tree = full(draft_logits, roots, budget=budget, topk_cap=topk_cap)[0]
    plan = selection.top_k_plan(vocab, k, batch * depth) if jax.default_backend() == "gpu" else None
    return dict(
        batch=batch, budget=budget, topk_cap=topk_cap, vocab=vocab, depth=depth, k=k,
        plan="lax" if plan is None else "x".join(map(str, plan)) or "count", top_k_exact=exact,
        full_ms=median_ms(lambda: full(draft_logits, roots, budget=budget, topk_cap=topk_cap), repeats),
        full_in_loop_ms=in_loop_ms(draft_logits, roots, budget, topk_cap, "xla", repeats),
        log_softmax_ms=median_ms(lambda: log_softmax(draft_logits), repeats),
        top_k_ms=median_ms(lambda: vocab_top_k(lp, k=k), repeats),
        beam_ms=median_ms(lambda: beam(lp_k, tok_k, roots, budget=budget), repeats),
        encodings_ms=median_ms(lambda: encodings(tree, roots), repeats),
        lax_top_k_ms=median_ms(lambda: lax_top_k(lp, k=k), repeats),
        **top_k_columns(drafts, lp, lp_k, tok_k, k, repeats, top_k_variants),
        beam_in_loop_ms=beam_in_loop_ms(functools.partial(beam, budget=budget), drafts, roots, k, repeats),
        hbm_floor_ms=1e3 * draft_logits.size * draft_logits.dtype.itemsize / HBM_BYTES_PER_S,
        **kernel_columns(drafts, lp_k, tok_k, roots, tree, budget, topk_cap, repeats, kernel_variants),
        **wide_columns(drafts, lp_k, tok_k, roots, tree, budget, topk_cap, repeats, wide_variants),
    )


def top_k_columns(drafts, lp, lp_k, tok_k, k, repeats, variants=()) -> dict:
    """The vocabulary top-K by the radix-selection kernel (`pallas_kernels.top_k`): ``top_k_kernel_ms``
    a call, ``top_k_kernel_exact`` (equal to the library's), and both top-Ks per call of 20 in one jitted
    loop (``top_k_in_loop``, ``top_k_kernel_in_loop``); for each launch v of ``variants``
    (`parse_top_k_variant` names) ``top_k_kernel_<v>_in_loop`` and ``top_k_kernel_<v>_exact``."""
    lps = jnp.stack([log_softmax(d) for d in drafts])

    def in_loop(fn):
        def step(lps, i, acc):
            return acc + checksum(fn(lps[i % 4], k=k))
        return loop_ms(step, lps, jnp.float32(0), max(3, repeats // 4), steps=LOOP_STEPS)

    def exact(config):
        got_k, got_tok = top_k_kernel(lp, k=k, config=config)
        return bool(jnp.array_equal(got_k, lp_k) and jnp.array_equal(got_tok, tok_k))

    columns = dict(top_k_kernel_ms=median_ms(lambda: top_k_kernel(lp, k=k), repeats), top_k_kernel_exact=exact(None),
                   top_k_in_loop_ms=in_loop(selection.top_k), top_k_kernel_in_loop_ms=in_loop(top_k_kernel))
    for name in variants:
        config = parse_top_k_variant(name)
        columns[f"top_k_kernel_{name}_exact"] = exact(config)
        columns[f"top_k_kernel_{name}_in_loop_ms"] = in_loop(functools.partial(top_k_kernel, config=config))
    return columns


def beam_in_loop_ms(beam_fn, drafts, roots, k, repeats) -> float:
    """ms per call of ``beam_fn(lp_BLK, tok_BLK, roots)`` (the beam and global order from the top-k)
    inside one jitted loop; step i takes the top-k of draft i % 4."""
    top = [vocab_top_k(log_softmax(d), k=k) for d in drafts]
    ops = (jnp.stack([t[0] for t in top]), jnp.stack([t[1] for t in top]), roots)

    def step(ops, i, acc):
        return acc + checksum(beam_fn(ops[0][i % 4], ops[1][i % 4], ops[2]))
    return loop_ms(step, ops, jnp.float32(0), max(3, repeats // 4), steps=LOOP_STEPS)


def in_loop_ms(draft_logits, roots, budget, topk_cap, impl, repeats) -> float:
    """ms per build + encodings by ``impl`` (`kernels.tree_build_fn`) of ``draft_logits`` inside one
    jitted loop, the logits threaded through it and nudged a step (`bench.nudged_loop_ms`)."""
    return nudged_loop_ms(lambda roots, drafts: build_and_encode(drafts, roots, budget, topk_cap, impl), roots,
                          draft_logits, max(3, repeats // 4), steps=LOOP_STEPS)


def kernel_columns(drafts, lp_k, tok_k, roots, tree, budget, topk_cap, repeats, variants=()) -> dict:
    """The tree-build kernel's columns of a row (NaN where the kernel does not take the budget). The
    beam alone in a loop, XLA's (``beam_in_loop``) and the kernel's (``beam_kernel_in_loop``, the
    library's launch, and ``beam_kernel_<v>_in_loop`` for each variant v of ``variants`` whose launch
    takes the budget), each with ``kernel[_<v>]_equal``: whether its tree equals XLA's."""
    k = lp_k.shape[2]
    if not kernel_supports(budget, k, lp_k.shape[1]):
        return dict(beam_kernel_ms=float("nan"), kernel_in_loop_ms=float("nan"), kernel_equal=None)

    def run(config):
        return functools.partial(beam_kernel, budget=budget, config=config)

    def equal(config):
        got = run(config)(lp_k, tok_k, roots)
        return all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree)))

    library = tree_build_config(budget, k)
    columns = dict(beam_kernel_ms=median_ms(lambda: run(library)(lp_k, tok_k, roots), repeats),
                   kernel_equal=equal(library),
                   kernel_in_loop_ms=(in_loop_ms(drafts[0], roots, budget, topk_cap, KERNEL_IMPL, repeats)
                                      if budget <= kernels.ONE_PROGRAM_BUILD_MAX_BUDGET else float("nan")),
                   beam_kernel_in_loop_ms=beam_in_loop_ms(run(library), drafts, roots, k, repeats))
    for name in variants:
        config = parse_variant(name)
        if config.supports(budget, k):
            columns[f"kernel_{name}_equal"] = equal(config)
            columns[f"beam_kernel_{name}_in_loop_ms"] = beam_in_loop_ms(run(config), drafts, roots, k, repeats)
    return columns


def wide_columns(drafts, lp_k, tok_k, roots, tree, budget, topk_cap, repeats, variants=()) -> dict:
    """The wide build's columns of a row (none where it does not take the budget): the whole build
    with it in a loop, ``wide_in_loop`` (``build_impl="pallas"``, as ``full_in_loop``; past
    `kernels.ONE_PROGRAM_BUILD_MAX_BUDGET`, where the library runs it), the beam and order
    alone in a loop, ``beam_wide_in_loop`` (the library's launch, `wide_build_config`) and
    ``beam_wide_<v>_in_loop`` for each variant v, each with ``wide[_<v>]_equal``: whether its tree equals XLA's."""
    k = lp_k.shape[2]
    if not wide_supports(budget, k, lp_k.shape[1]):
        return {}
    columns = {}
    if budget > kernels.ONE_PROGRAM_BUILD_MAX_BUDGET:  # the library's pallas build is the wide one
        columns["wide_in_loop_ms"] = in_loop_ms(drafts[0], roots, budget, topk_cap, KERNEL_IMPL, repeats)
    for name, config in [("wide", wide_build_config(budget, k)),
                         *((f"wide_{v}", parse_wide_variant(v)) for v in variants)]:
        run = functools.partial(beam_wide, budget=budget, config=config)
        got = run(lp_k, tok_k, roots)
        columns[f"{name}_equal"] = all(bool(jnp.array_equal(a, b))
                                       for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree)))
        columns[f"beam_{name}_in_loop_ms"] = beam_in_loop_ms(run, drafts, roots, k, repeats)
    return columns


def parse_launch(name: str, config_type, fields: tuple[tuple[str, str], ...], kind: str):
    """A ``config_type`` launch from its name: ``<letter><int>`` for each ``(letter, field)`` of ``fields``,
    in that order, each optional (the default config's value where left out)."""
    match = re.fullmatch("".join(rf"(?:{letter}(\d+))?" for letter, _ in fields), name)
    if not name or match is None:
        form = "".join(f"{letter}<{field}>" for letter, field in fields)
        raise ValueError(f"a {kind} variant is {form} in that order, got {name!r}")
    default = config_type()
    return config_type(**{field: getattr(default, field) if value is None else int(value)
                          for (_, field), value in zip(fields, match.groups())})


def parse_wide_variant(name: str) -> WideBuildConfig:
    """A wide-build launch: ``r<rows>c<cols>e<entries>w<warps>g<gather_keys>``, e.g. ``r64``, ``r16c256w8``,
    ``g1``."""
    return parse_launch(name, WideBuildConfig, (("r", "rows"), ("c", "cols"), ("e", "entries"), ("w", "num_warps"),
                                                ("g", "gather_keys")), "wide")


def parse_top_k_variant(name: str) -> TopKConfig:
    """A radix top-k launch: ``b<block>w<warps>s<segments>``, e.g. ``s64``, ``b512w4s32``."""
    return parse_launch(name, TopKConfig, (("b", "block"), ("w", "num_warps"), ("s", "segments")), "top-k")


def parse_variant(name: str) -> TreeBuildConfig:
    """A one-program tree-build launch: ``w<warps>c<chunk>`` (``c0``: one count tile), e.g. ``w16``,
    ``c0``, ``w4c16``."""
    return parse_launch(name, TreeBuildConfig, (("w", "num_warps"), ("c", "chunk")), "kernel")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--budgets", type=int_list, default=[16, 64, 512])
    ap.add_argument("--batches", type=int_list, default=[1, 8])
    ap.add_argument("--topk-cap", type=int, default=0, help="per-depth top-k cap of the trees (0 = none)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kernel-variants", default="",
                    help="comma-separated kernel launches to time besides the library's: w<warps>c<chunk> (each "
                         "part optional, c0 one tile), e.g. w16,c0,w4c16")
    ap.add_argument("--wide-variants", default="",
                    help="comma-separated launches of the wide build (budgets past the one-program kernel's) to "
                         "time besides its default: r<rows>c<cols>e<entries>w<warps> (each part optional), e.g. "
                         "r64,r16w8")
    ap.add_argument("--top-k-variants", default="",
                    help="comma-separated launches of the radix-selection top-k to time besides its default: "
                         "b<block>w<warps>s<segments> (each part optional), e.g. s64,b512w4s32")
    ap.add_argument("--profile", action="store_true",
                    help="device ops of the XLA build and the library's pallas build, summed by kind")
    ap.add_argument("--out", default="experiments/results/bench_tree_build.json")
    args = ap.parse_args(argv)
    budgets, batches = args.budgets, args.batches
    kernel_variants = [v for v in args.kernel_variants.split(",") if v]
    wide_variants = [v for v in args.wide_variants.split(",") if v]
    top_k_variants = [v for v in args.top_k_variants.split(",") if v]
    for flag, names, parse in (("kernel-variants", kernel_variants, parse_variant),
                               ("wide-variants", wide_variants, parse_wide_variant),
                               ("top-k-variants", top_k_variants, parse_top_k_variant)):
        for name in names:
            try:
                parse(name)
            except ValueError as e:
                raise ValueError(f"--{flag}: {e}") from None
    if args.topk_cap < 0:
        raise ValueError(f"--topk-cap must be >= 0, got {args.topk_cap}")
    for name in ("vocab", "depth", "repeats"):
        if getattr(args, name) < (2 if name == "vocab" else 1):
            raise ValueError(f"--{name} is too small: {getattr(args, name)}")
    device = jax.devices()[0]
    meta = dict(backend=jax.default_backend(), device=device.device_kind, jax=jax.__version__,
                date=time.strftime("%Y-%m-%d"), command=command_line(), repeats=args.repeats,
                dispatch_ms=median_ms(lambda: empty(jnp.ones((4,))), args.repeats))
    print(f"backend {meta['backend']}, device {meta['device']}, jax {meta['jax']}, "
          f"empty jitted call {meta['dispatch_ms']:.3f} ms", flush=True)
    header = " ".join(f"{c[:-3]:>11}" for c in COLUMNS)
    print(f"{'batch':>5} {'B':>5} {'plan':>10} {header} {'hbm floor':>10}  (ms)", flush=True)
    rows, start = [], time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for batch in batches:
        draft = jax.random.normal(jax.random.key(batch), (batch, args.depth, args.vocab), jnp.float32) * 3
        for budget in budgets:
            row = time_row(draft, budget, args.topk_cap or None, args.repeats, kernel_variants, wide_variants,
                           top_k_variants)
            if args.profile:
                for name, impl in (("full", "xla"), ("library", KERNEL_IMPL)):
                    try:  # a diagnostic: a trace that cannot be read must not cost the timed rows
                        run = functools.partial(full, draft, jnp.zeros((batch,), jnp.int32), budget=budget,
                                                topk_cap=args.topk_cap or None, impl=impl)
                        row[f"profile_{name}"] = profiling.device_op_times(run)
                        print(f"{name} build ({impl}):", profiling.format_summary(row[f"profile_{name}"]), flush=True)
                    except Exception as e:  # noqa: BLE001
                        row[f"profile_{name}_error"] = repr(e)
            rows.append(row)
            cells = " ".join(f"{row[c]:>11.3f}" for c in COLUMNS)
            print(f"{batch:>5} {budget:>5} {row['plan']:>10} {cells} {row['hbm_floor_ms']:>10.4f}"
                  f"{'' if row['top_k_exact'] else '  TOP-K NOT EXACT'}", flush=True)
            print(f"{'':>11} the top-K in a loop: XLA {row['top_k_in_loop_ms']:.3f} ms, radix kernel "
                  f"{row['top_k_kernel_in_loop_ms']:.3f} ms, exact {row['top_k_kernel_exact']}", flush=True)
            for v in top_k_variants:
                print(f"{'':>11} the radix top-K {v} in a loop: {row[f'top_k_kernel_{v}_in_loop_ms']:.3f} ms, "
                      f"exact {row[f'top_k_kernel_{v}_exact']}", flush=True)
            kernel = row.get("beam_kernel_in_loop_ms")
            print(f"{'':>11} the beam in a loop: XLA {row['beam_in_loop_ms']:.3f} ms"
                  + ("" if kernel is None else f", kernel {kernel:.3f} ms"), flush=True)
            if "wide_in_loop_ms" in row:
                print(f"{'':>11} the whole build with the wide beam in a loop: {row['wide_in_loop_ms']:.3f} ms "
                      f"(XLA's: {row['full_in_loop_ms']:.3f} ms)", flush=True)
            for name in ["wide", *(f"wide_{v}" for v in wide_variants)]:
                if f"beam_{name}_in_loop_ms" in row:
                    print(f"{'':>11} the beam {name} in a loop: {row[f'beam_{name}_in_loop_ms']:.3f} ms, "
                          f"equal {row[f'{name}_equal']}", flush=True)
            for v in (v for v in kernel_variants if f"beam_kernel_{v}_in_loop_ms" in row):
                print(f"{'':>11} the beam kernel {v} in a loop: {row[f'beam_kernel_{v}_in_loop_ms']:.3f} ms, "
                      f"equal {row[f'kernel_{v}_equal']}", flush=True)
            meta["elapsed_s"] = time.perf_counter() - start
            with open(args.out, "w") as f:  # after every row: an interrupted run keeps what it measured
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out} in {meta['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
