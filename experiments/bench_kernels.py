"""Benchmark the Pallas kernels against the XLA paths at Qwen3-8B shapes (meant for a GPU).

- ``attention``: tree attention (32 query heads, 8 KV heads, head_dim 128, bf16), the Triton
  kernel vs the models' XLA attention (``--impls`` adds the Mosaic GPU kernel and
  ``jax.nn.dot_product_attention`` with a mask), for N tree nodes, a committed context and a
  batch, in a cache of ``context + N`` slots or ``--capacity`` (as the engine's cache, sized for the
  prompt and every new token). Achieved HBM bandwidth counts the bytes the call must move: K/V of
  the prefix and the tree for every KV head, queries and outputs.
- ``sweep``: candidate tilings (``--sweep-configs``, by default ``SWEEP_CONFIGS``) on a few
  shapes (how the measured config table entry is chosen). With ``--baseline-module PATH``, both
  attention parts also time that file's ``tree_attention`` (a previous version of the kernel
  module) as ``baseline``, interleaved on the same inputs.
- ``sampling``: fused tree sampling vs the jnp path (``verify_from_coins``) for V = 151,936,
  tree budgets and batches, plain temperature and temperature + top-k + top-p; also checks
  that both give the same results, and relates the time to a Qwen3-8B verify forward's
  weight-streaming floor (16.4 GB of bf16 weights at the HBM bandwidth). ``--baseline-module
  PATH`` loads a previous version of the kernel module from a file (its ``tree_sample(tree,
  logits, coins, final_coins, t, k, p, backend=...) -> VerifyResult``) and times it interleaved
  with each fused configuration on the same inputs, recording whether their accepted paths and
  emitted tokens are identical.

    PYTHONPATH=. python experiments/bench_kernels.py attention sampling --out experiments/results

prints tables and writes ``bench_<part>.json`` under ``--out`` after every shape. Every
executable of a part is compiled up front, in parallel threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib.util
import inspect
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import kernels
from ddtree_jax.experiments import profiling
from ddtree_jax.experiments.bench import interleaved_ms
from ddtree_jax.experiments.flags import attention_tiling, int_list, name_list
from ddtree_jax.tree import build_tree, tree_positions
from ddtree_jax.verify import verify_from_coins
from pallas_kernels import configs
from pallas_kernels.configs import TreeAttentionConfig
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_attention_mgpu import tree_attention_mgpu
from pallas_kernels.tree_attention_reference import tree_attention_reference
from pallas_kernels.tree_sampling import SamplerConfig

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
VOCAB, DRAFT_DEPTH = 151_936, 15
QWEN3_8B_WEIGHT_BYTES = 16.4e9
# Tilings of the sweep part: m<block_m>k<block_k>w<warps>s<stages>, optionally p<min_programs>,
# c<min_chunk>, j<max_splits>, l<0|1> (split_by_length) and v<0|1> (whole_waves); fields left out come
# from the local GPU's table entry (sm_90: p512 c128 j8 l1 v1); `flags.attention_tiling` parses them.
SWEEP_CONFIGS = ("m64k64w4s3", "m64k128w4s3", "m128k64w8s3", "m64k64w4s4", "m128k128w8s2",
                 "m64k64w4s3p528")
# (temperature, top_k, top_p). T2.5_p0.9: flat rows whose sub-block maxima confine no candidates (the
# whole-GPU floor passes); T1_k1000: 256 < candidates <= capacity (the register search of a larger
# tile); T2_p0.99: kept sets beyond the capacity (streamed in the walk).
SAMPLING_PARAMS = {"T1": (1.0, 0, 1.0), "T0.7_k50_p0.9": (0.7, 50, 0.9), "T2.5_p0.9": (2.5, 0, 0.9),
                   "T1_k1000": (1.0, 1000, 1.0), "T2_p0.99": (2.0, 0, 0.99)}
ATTENTION_IMPLS = ("pallas", "mosaic", "xla", "dpa")
_FUSED_FIELDS = ("block_v", "num_warps", "num_stages", "stats_blocks", "parallel_rows", "capacity")


def tree_mask(num_nodes: int) -> np.ndarray:
    """Ancestor mask of a binary heap-shaped tree (node i's parent is (i - 1) // 2)."""
    mask = np.eye(num_nodes, dtype=bool)
    for i in range(1, num_nodes):
        mask[i] |= mask[(i - 1) // 2]
    return mask


def attention_shapes(batch, nodes, context, slots, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    return (s((batch, nodes, HEADS, HEAD_DIM), dtype), s((batch, KV_HEADS, slots, HEAD_DIM), dtype),
            s((batch, KV_HEADS, slots, HEAD_DIM), dtype), s((batch,), jnp.int32),
            s((batch, nodes, nodes), jnp.bool_))


def attention_inputs(batch, nodes, context, slots, dtype=jnp.bfloat16, seed=0):
    """Random q and cache of ``slots >= context + nodes`` slots, lengths = context, a tree mask."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, nodes, HEADS, HEAD_DIM), dtype)
    k = jax.random.normal(kk, (batch, KV_HEADS, slots, HEAD_DIM), dtype)
    v = jax.random.normal(kv, (batch, KV_HEADS, slots, HEAD_DIM), dtype)
    lengths = jnp.full((batch,), context, jnp.int32)
    mask = jnp.broadcast_to(jnp.asarray(tree_mask(nodes)), (batch, nodes, nodes))
    return q, k, v, lengths, mask


def attention_bytes(batch, nodes, context, dtype=jnp.bfloat16) -> int:
    item = jnp.dtype(dtype).itemsize
    kv = 2 * batch * KV_HEADS * (context + nodes) * HEAD_DIM * item
    return kv + 2 * batch * nodes * HEADS * HEAD_DIM * item


def dot_product_attention(q, k, v, lengths, mask, *, scale):
    """``jax.nn.dot_product_attention`` with the full visibility mask (cache transposed to BSKD)."""
    slots, nodes = k.shape[2], mask.shape[2]
    rel = jnp.arange(slots)[None, :] - lengths[:, None]
    idx = jnp.broadcast_to(jnp.clip(rel, 0, nodes - 1)[:, None, :], (*mask.shape[:2], slots))
    tree_part = jnp.take_along_axis(mask, idx, axis=2) & ((rel >= 0) & (rel < nodes))[:, None]
    visible = (rel < 0)[:, None] | tree_part
    return jax.nn.dot_product_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                        mask=visible[:, None], scale=scale)


def chained(fn, chain):
    """``chain`` dependent calls of an attention function (q += 1e-6 * out), for timing."""
    def run(q, *rest):
        for _ in range(chain):
            q = q + (1e-6 * fn(q, *rest)).astype(q.dtype)
        return q
    return run


def compile_all(jobs, workers=12):
    """``{name: compiled}`` for ``{name: (fn, arg_shapes)}``: lowered here, compiled in threads.

    A job that fails gives its exception instead of an executable.
    """
    lowered = {}
    for name, (fn, shapes) in jobs.items():
        try:
            lowered[name] = jax.jit(fn).lower(*shapes)
        except Exception as err:  # noqa: BLE001 (recorded with the results)
            lowered[name] = err

    def compile_one(item):
        name, low = item
        if isinstance(low, Exception):
            return name, low
        try:
            return name, low.compile()
        except Exception as err:  # noqa: BLE001
            return name, err

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        compiled = dict(pool.map(compile_one, lowered.items()))
    print(f"compiled {len(jobs)} executables in {time.perf_counter() - start:.0f} s", flush=True)
    for name, exe in compiled.items():
        if isinstance(exe, Exception):
            print(f"{name}: {error_text(exe)}", flush=True)
    return compiled


def within_budget(items, budget_s):
    """``items`` in order until ``budget_s`` seconds have passed (checked before each item)."""
    deadline = time.monotonic() + budget_s
    for item in items:
        if time.monotonic() > deadline:
            print("time budget reached, stopping", flush=True)
            return
        yield item


def error_text(err) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def timed_or_errors(runs: dict, repeats: int, row: dict) -> dict[str, list[float]]:
    """`interleaved_ms` of ``runs``; if a call fails (an OOM at run time is a result, not a crash), ``{}``
    and each run's error recorded in ``row``."""
    try:
        return interleaved_ms(runs, repeats)
    except Exception as err:  # noqa: BLE001
        row.update({name: dict(error=error_text(err)) for name in runs})
        return {}


def bench_attention(shapes, impls, *, peak_gbs, budget_s, report, chain=8, repeats=5):
    """Time each implementation on each shape: ``repeats`` rounds of one ``chain`` of dependent
    calls per implementation in turn (``interleaved_ms``); per call = median round / ``chain``.
    ``<impl>_speedup``: the median over rounds of the XLA path's time / that implementation's."""
    jobs = {(shape, name): (chained(fn, chain), attention_shapes(*shape))
            for shape in shapes for name, fn in impls.items()}
    compiled = compile_all(jobs)
    records = []
    for shape in within_budget(shapes, budget_s):
        args = attention_inputs(*shape)
        nbytes = attention_bytes(*shape[:3])  # the slots past the tree are not read
        row = dict(batch=shape[0], nodes=shape[1], context=shape[2], slots=shape[3], bytes=nbytes)
        runs = {}
        for name in impls:
            exe = compiled[(shape, name)]
            if isinstance(exe, Exception):
                row[name] = dict(error=error_text(exe))
            else:
                runs[name] = functools.partial(exe, *args)
        times = timed_or_errors(runs, repeats, row)
        for name, rounds in times.items():
            seconds = float(np.median(rounds)) / 1e3 / chain
            row[name] = dict(ms=seconds * 1e3, gbs=nbytes / seconds / 1e9,
                             hbm_frac=nbytes / seconds / 1e9 / peak_gbs, rounds_ms=rounds)
            if "xla" in times and name != "xla":
                row[f"{name}_speedup"] = float(np.median(np.divide(times["xla"], rounds)))
        records.append(row)
        report(records)
        print(format_attention_row(row, list(impls)), flush=True)
        del args
    return records


def format_attention_row(row, names):
    cells = [f"B={row['batch']:>2} N={row['nodes']:>3} ctx={row['context']:>6} slots={row['slots']:>6}"]
    for name in names:
        r = row.get(name, {})
        cells.append(f"{name} {r['ms']:8.3f} ms {r['gbs']:6.0f} GB/s" if "ms" in r else f"{name} n/a")
    for name in names:
        if f"{name}_speedup" in row:
            cells.append(f"{name} speedup {row[f'{name}_speedup']:.2f}x")
    return " | ".join(cells)


def sampling_inputs(batch, budget, params, vocab=VOCAB, seed=0, noise=1.0, dtype=jnp.float32):
    """A drafted tree of ``budget`` nodes, target logits in ``dtype``, coins and parameters.

    The target's logits after a node at depth d are the draft logits of depth d + 1 plus Gaussian
    ``noise``: a target that mostly agrees with its drafter, so walks go deep (with independent
    random logits every walk would stop at the root). ``params``: ``(temperature, top_k, top_p)``
    rows, cycled over the batch.
    """
    keys = jax.random.split(jax.random.key(seed), 5)
    # float32: a bfloat16 normal has a truncated, quantised tail (ties at the top, flat shallow trees)
    draft = 10.0 * jax.random.normal(keys[0], (batch, DRAFT_DEPTH, vocab), jnp.float32)  # peaked: deep trees
    tree = build_tree(draft, jnp.zeros((batch,), jnp.int32), budget=budget)
    depth = jnp.minimum(tree_positions(tree, jnp.zeros((batch,), jnp.int32)), DRAFT_DEPTH - 1)
    logits = draft[jnp.arange(batch)[:, None], depth]
    logits = (logits + noise * jax.random.normal(keys[1], logits.shape, jnp.float32)).astype(dtype)
    coins = jax.random.uniform(keys[2], (batch, budget + 1), minval=1e-6, maxval=1.0)
    final = jax.random.uniform(keys[3], (batch,), minval=1e-6, maxval=1.0)
    t, k, p = np.resize(np.asarray(params, np.float64), (batch, 3)).T
    return tree, logits, coins, final, jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), \
        jnp.asarray(p, jnp.float32)


def fused_sampler(config: SamplerConfig, interpret: bool = False):
    """The fused kernel with ``config`` as a step-5 sampler (`kernels.sampler_fn`)."""
    return kernels.sampler_fn("interpret" if interpret else "pallas", config=config)


def load_baseline(path, name="tree_sampling_baseline"):
    """A previous version of a kernel module, loaded from the file ``path`` under the module name
    ``name`` (the library it imports is this checkout's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def baseline_sampler(module, config: SamplerConfig, interpret: bool = False):
    """``module.tree_sample`` (the old API: ``(tree, logits, coins, final_coins, t, k, p, backend=...,
    <launch knobs>) -> VerifyResult``) with the knobs of ``config`` that it takes."""
    params = inspect.signature(module.tree_sample).parameters
    knobs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name in params}
    return functools.partial(module.tree_sample, backend="interpret" if interpret else "triton", **knobs)


def bench_sampling(cases, fused_configs, *, vocab, peak_gbs, budget_s, report, profile=False, baseline=None,
                   repeats=5, interpret=False):
    """Fused sampling (one implementation per ``SamplerConfig`` of ``fused_configs``) vs the jnp path on
    ``(budget, batch, params name)`` cases (``budget_s`` as in ``bench_attention``): the median of
    ``repeats`` blocking calls each. ``baseline``: a previous kernel module (``load_baseline``), run
    as ``baseline_<name>`` with each configuration's knobs, timed interleaved with that configuration
    (``interleaved_ms``), with its median time ratio and whether both give identical accepted paths
    and emitted tokens. ``profile``: also record where each kernel call's device time goes
    (``ddtree_jax.experiments.profiling``). ``interpret``: run the kernels interpreted (a test on the CPU)."""
    names = [fused_name(c, len(fused_configs)) for c in fused_configs]
    impls = {name: fused_sampler(c, interpret) for name, c in zip(names, fused_configs)}
    groups = [[name] for name in names]
    if baseline is not None:
        impls.update({f"baseline_{name}": baseline_sampler(baseline, c, interpret) for name, c in zip(names,
                                                                                                     fused_configs)})
        groups = [[name, f"baseline_{name}"] for name in names]
    impls["jnp"] = verify_from_coins
    groups.append(["jnp"])
    floor_s = QWEN3_8B_WEIGHT_BYTES / (peak_gbs * 1e9)
    make = lambda budget, batch, pname: sampling_inputs(batch, budget, [SAMPLING_PARAMS[pname]], vocab)  # noqa: E731
    jobs = {(case, name): (fn, jax.eval_shape(lambda c=case: make(*c)))
            for case in cases for name, fn in impls.items()}
    compiled = compile_all(jobs)
    records = []
    for case in within_budget(cases, budget_s):
        args = make(*case)
        row = dict(budget=case[0], batch=case[1], params=case[2])
        results = {}
        for group in groups:
            runs = {}
            for name in group:
                try:
                    exe = compiled[(case, name)]
                    if isinstance(exe, Exception):
                        raise exe
                    results[name] = jax.block_until_ready(exe(*args))
                    runs[name] = functools.partial(exe, *args)
                except Exception as err:  # noqa: BLE001
                    row[name] = dict(error=error_text(err))
            times = timed_or_errors(runs, repeats, row)
            for name, rounds in times.items():
                seconds = float(np.median(rounds)) / 1e3
                row[name] = dict(ms=seconds * 1e3, frac_of_verify_floor=seconds / floor_s, rounds_ms=rounds)
                if profile and name != "jnp":
                    row[name]["profile"] = profiling.device_op_times(runs[name], calls=3)
                    print(f"  {name}:\n" + profiling.format_summary(row[name]["profile"]), flush=True)
            if len(times) == 2:
                new, old = group
                row[new]["vs_baseline"] = dict(
                    speedup=float(np.median(np.divide(times[old], times[new]))),
                    identical=same_path(results[new], results[old]))
        if "jnp" in results:
            row["mean_accepted"] = float(np.mean(np.asarray(results["jnp"].num_accepted)))
            for name in results.keys() - {"jnp"}:
                row[name].update(compare_results(results[name], results["jnp"]))
        records.append(row)
        report(records)
        print(row, flush=True)
        print(format_sampling_row(row, [name for group in groups for name in group]), flush=True)
        del args, results
    return records


def same_path(result, other) -> bool:
    """Whether two ``VerifyResult`` have identical accepted paths and emitted tokens."""
    return all(bool(np.array_equal(np.asarray(getattr(result, f)), np.asarray(getattr(other, f))))
               for f in ("accept_index", "emitted"))


def format_sampling_row(row, names):
    """One line of the sampling table: each implementation's median ms, identity with the jnp path
    and, against a baseline, the speedup and identity of paths and tokens."""
    cells = [f"B={row['budget']:>4} batch={row['batch']:>2} {row['params']}"]
    for name in names:
        r = row.get(name, {})
        if "ms" not in r:
            cells.append(f"{name} n/a")
            continue
        cell = f"{name} {r['ms']:7.3f} ms" + (f" same={r['identical']}" if "identical" in r else "")
        if "vs_baseline" in r:
            cell += f" vs baseline {r['vs_baseline']['speedup']:.2f}x same={r['vs_baseline']['identical']}"
        cells.append(cell)
    return " | ".join(cells)


def attention_impls(part: str, args, scale: float) -> dict:
    """``{name: attention function}`` of the ``attention`` part (``--impls``) or the ``sweep`` part (one
    per ``--sweep-configs`` tiling, ``xla`` for the reference); with ``--baseline-module``, also
    ``baseline``: that file's ``tree_attention`` with the local GPU's table entry."""
    if part == "attention":
        available = {
            "pallas": functools.partial(tree_attention, scale=scale, config=configs.tree_attention_config()),
            "mosaic": functools.partial(tree_attention_mgpu, scale=scale),
            "xla": functools.partial(tree_attention_reference, scale=scale),
            "dpa": functools.partial(dot_product_attention, scale=scale)}
        impls = {name: available[name] for name in args.impls}
    else:
        xla = functools.partial(tree_attention_reference, scale=scale)
        impls = {name: xla if name == "xla" else functools.partial(
            tree_attention, scale=scale, config=sweep_config(name))
            for name in args.sweep_configs.split(",")}
    if args.baseline_module:
        module = load_baseline(args.baseline_module, "tree_attention_baseline")
        impls["baseline"] = functools.partial(module.tree_attention, scale=scale,
                                              config=configs.tree_attention_config())
    return impls


def sweep_config(text: str) -> TreeAttentionConfig:
    """``"m64k128w4s2c1024"`` -> that tiling; fields left out keep the local table entry's values."""
    try:
        fields = attention_tiling(text)
    except ValueError as err:
        raise SystemExit(f"--sweep-configs: {err}") from None
    return dataclasses.replace(configs.tree_attention_config(), **fields)


def fused_config(text: str) -> SamplerConfig:
    """``"block_v:num_warps:num_stages[:stats_blocks[:parallel_rows[:capacity]]]"`` -> that
    ``SamplerConfig`` (its defaults for the fields left out)."""
    values = [int(x) for x in text.split(":")]
    if not 3 <= len(values) <= len(_FUSED_FIELDS):
        raise ValueError("a fused config is block_v:num_warps:num_stages[:stats_blocks[:parallel_rows[:capacity]]], "
                         f"got {text!r}")
    return SamplerConfig(**dict(zip(_FUSED_FIELDS, values)))


def fused_name(config: SamplerConfig, count):
    """``"fused"`` for a single configuration, else
    ``"fused_<block_v>_<warps>_<stages>_<stats_blocks>_<parallel_rows>"``."""
    return "fused" if count == 1 else "fused_" + "_".join(str(getattr(config, f)) for f in _FUSED_FIELDS)


def compare_results(result, reference):
    """Whether two ``VerifyResult`` agree; the number of requests whose emitted tokens differ."""
    same = [bool(np.array_equal(np.asarray(getattr(result, f)), np.asarray(getattr(reference, f))))
            for f in ("accept_index", "emitted", "predicts")]
    differing = np.any(np.asarray(result.emitted) != np.asarray(reference.emitted), axis=1)
    return dict(identical=all(same), requests_differing=int(np.sum(differing)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", choices=("attention", "sweep", "sampling"))
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--batches", type=int_list, default=[1, 16])
    parser.add_argument("--nodes", type=int_list, default=[16, 64, 256])
    parser.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768, 65536])
    parser.add_argument("--sweep-contexts", type=int_list, default=[16384])
    parser.add_argument("--capacity", type=int, default=0,
                        help="attention, sweep: cache slots per request, at least context + nodes (0: exactly "
                             "that); the engine's cache holds the prompt and every new token, so a decoding "
                             "step's context is shorter than its cache")
    parser.add_argument("--sweep-configs", default=",".join(SWEEP_CONFIGS),
                        help="tilings for the sweep part, m<block_m>k<block_k>w<warps>s<stages>"
                             "[p<min_programs>][c<min_chunk>][j<max_splits>][l<0|1>: split_by_length]"
                             "[v<0|1>: whole_waves], left-out fields from the GPU's table entry; 'xla' adds the XLA "
                             "path (and each tiling's speedup over it)")
    parser.add_argument("--sampling-cases", default="64:1,64:8,64:64,256:1,256:16,1024:1,1024:4",
                        help="budget:batch pairs")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--impls", type=name_list(ATTENTION_IMPLS), default=["pallas", "xla"],
                        help="attention implementations to time: pallas (Triton kernel), mosaic "
                             "(Mosaic GPU kernel, Hopper), xla, dpa (jax.nn.dot_product_attention)")
    parser.add_argument("--sampling-params", type=name_list(SAMPLING_PARAMS), default=list(SAMPLING_PARAMS),
                        help=f"sampling parameter sets, from {list(SAMPLING_PARAMS)}")
    parser.add_argument("--fused-configs", default="32768:8:1",
                        help="fused sampler configs block_v:num_warps:num_stages[:stats_blocks[:parallel_rows"
                             "[:capacity]]], "
                             "comma-separated (stats_blocks: vocabulary blocks per program of the "
                             "row-statistics pass, default 1; parallel_rows: up to this many node rows the "
                             "candidates are found over the whole GPU, default "
                             f"{SamplerConfig().parallel_rows})")
    parser.add_argument("--baseline-module", default=None,
                        help="a previous version of the part's kernel module, a .py file timed interleaved on "
                             "the same inputs: sampling, one with the old API tree_sample(tree, ..., backend=...) "
                             "-> VerifyResult, beside each fused config; attention and sweep, one with "
                             "tree_attention(q, k, v, lengths, mask, scale=..., config=...), as 'baseline' with the "
                             "local GPU's table entry")
    parser.add_argument("--profile", action="store_true",
                        help="sampling: record where each fused call's device time goes (per kernel and op)")
    parser.add_argument("--peak-gbs", type=float, default=4800.0,
                        help="HBM bandwidth for the fraction columns (H200: 4.8 TB/s)")
    parser.add_argument("--chain", type=int, default=8,
                        help="attention, sweep: dependent calls per timed executable")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds (every implementation of a group once per round)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="per part, stop starting new shapes this many seconds after compiling")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    info = dict(python=platform.python_version(), jax=jax.__version__, device=device.device_kind,
                capability=configs.device_capability(), config=str(configs.tree_attention_config()))
    print(info, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scale = HEAD_DIM ** -0.5
    for part in args.parts:
        path = out / f"bench_{part}.json"
        report = lambda records, path=path: path.write_text(  # noqa: E731
            json.dumps(dict(info=info, records=records), indent=1))
        if part == "sampling":
            cases = [(int(b), int(n), pname) for pname in args.sampling_params
                     for b, n in (c.split(":") for c in args.sampling_cases.split(","))]
            fused = [fused_config(c) for c in args.fused_configs.split(",")]
            baseline = load_baseline(args.baseline_module) if args.baseline_module else None
            bench_sampling(cases, fused, vocab=args.vocab, peak_gbs=args.peak_gbs, budget_s=args.budget_s,
                           report=report, profile=args.profile, baseline=baseline, repeats=args.repeats)
            continue
        contexts = args.contexts if part == "attention" else args.sweep_contexts
        shapes = [(b, n, c, max(args.capacity, c + n)) for b in args.batches for n in args.nodes
                  for c in contexts]
        impls = attention_impls(part, args, scale)
        bench_attention(shapes, impls, peak_gbs=args.peak_gbs, budget_s=args.budget_s, report=report,
                        chain=args.chain, repeats=args.repeats)


if __name__ == "__main__":
    main()
