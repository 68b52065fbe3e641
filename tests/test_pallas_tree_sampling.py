"""Fused tree sampling (interpret mode on CPU) vs its jnp reference ``tree_sample_reference``: the
accepted paths and emitted tokens, from which ``result_from_path`` derives every other field of a
``VerifyResult``. The statistics and candidate passes against NumPy: test_pallas_tree_sampling_passes."""

import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_jax.tree import build_tree
from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.tree_sampling import SamplerConfig, tree_sample, tree_sample_reference

PARALLEL_ROWS = SamplerConfig().parallel_rows


@functools.partial(jax.jit, static_argnames=("batch", "depth", "vocab", "budget", "logit_scale", "tie_step", "agree",
                                             "dtype", "topk_cap"))
def make_round(seed, *, batch, depth, vocab, budget, logit_scale=3.0, tie_step=None, agree=0.0,
               dtype=jnp.float32, topk_cap=None):
    """A drafted tree, target logits, coins. ``tie_step`` rounds logits to create ties;
    ``agree`` adds that much to each node's logit of its first child's token."""
    keys = jax.random.split(jax.random.key(seed), 5)
    draft = 2.0 * jax.random.normal(keys[0], (batch, depth, vocab))
    tree = build_tree(draft, jax.random.randint(keys[1], (batch,), 0, vocab), budget=budget,
                      topk_cap=topk_cap)
    logits = logit_scale * jax.random.normal(keys[2], (batch, budget + 1, vocab))
    if tie_step:
        logits = jnp.round(logits / tie_step) * tie_step
    if agree:
        first_child = jnp.full((batch, budget + 1), budget + 1).at[
            jnp.arange(batch)[:, None], jnp.maximum(tree.parents, 0)].min(
            jnp.where(tree.parents >= 0, jnp.arange(budget + 1), budget + 1), mode="drop")
        token = jnp.take_along_axis(tree.tokens, jnp.clip(first_child, 0, budget), axis=1)
        bump = jax.nn.one_hot(token, vocab) * agree * (first_child <= budget)[..., None]
        logits = logits + bump
    coins = jax.random.uniform(keys[3], (batch, budget + 1), minval=1e-6, maxval=1.0)
    final = jax.random.uniform(keys[4], (batch,), minval=1e-6, maxval=1.0)
    return tree, logits.astype(dtype), coins, final


def params(*rows):
    """(temperature, top_k, top_p) per request -> three [batch] arrays."""
    t, k, p = zip(*rows)
    return jnp.array(t, jnp.float32), jnp.array(k, jnp.int32), jnp.array(p, jnp.float32)


def assert_same(tree, logits, coins, final, temperature, top_k, top_p, **config):
    """The interpreted kernels with ``SamplerConfig(**config)`` give the reference's accepted paths
    and emitted tokens; returns them."""
    args = (tree.tokens, tree.parents, logits, coins, final, temperature, top_k, top_p)
    ref = tree_sample_reference(*args, max_depth=tree.max_depth)
    out = tree_sample(*args, max_depth=tree.max_depth, config=SamplerConfig(**config), interpret=True)
    for name, got, want in zip(("accept_index", "emitted"), out, ref):
        assert got.shape == (tree.tokens.shape[0], tree.max_depth + 1), name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    return out


MIXED = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (0.9, 50, 0.6), (1.0, 1, 1.0),
         (2.0, 0, 0.3), (0.5, 500, 1.0)]


@pytest.mark.parametrize("seed, stats_blocks", [(0, 1), (1, 1), (2, 3)])
def test_mixed_parameters_match_jnp_path(seed, stats_blocks):
    tree, logits, coins, final = make_round(seed, batch=len(MIXED), depth=4, vocab=300, budget=12)
    assert_same(tree, logits, coins, final, *params(*MIXED), block_v=64, stats_blocks=stats_blocks)


@pytest.mark.parametrize("parallel_rows", [0, PARALLEL_ROWS])
@pytest.mark.parametrize("capacity", [16, 64, 512])
@pytest.mark.parametrize("seed", range(2))
def test_truncation_by_candidates_and_by_passes(seed, capacity, parallel_rows):
    """A vocabulary larger than the candidate scratch: kept sets are found from candidate floors
    (geometric, then refined; by the walk, or over the whole GPU before it) and searched in
    registers, or, when more tokens than ``capacity`` reach every usable floor, by bit searches
    over the whole row. ``block_v = 1024`` gives candidate passes of 64-entry blocks (47 per row, the
    interpreter runs one program per row and block) and the same rows in each category (found by the
    rows pass, by the passes over the whole GPU, left to bit searches) as 256 with four times the
    programs; the walk still reads the row in three blocks, the last one short."""
    rows = [(1.0, 5, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.5), (1.3, 0, 0.9), (0.6, 40, 0.8), (1.0, 0, 0.99),
            (1.0, 300, 1.0), (0.3, 0, 0.95), (2.0, 1, 1.0), (1.0, 12, 0.2)]
    tree, logits, coins, final = make_round(seed, batch=len(rows), depth=4, vocab=3000, budget=10,
                                            logit_scale=4.0, agree=8.0)
    assert_same(tree, logits, coins, final, *params(*rows), block_v=1024, capacity=capacity,
                parallel_rows=parallel_rows)


@pytest.mark.parametrize("seed", [0, 1, 10])  # seed 10 failed before the fix
def test_rejected_tokens_that_recur_elsewhere_in_the_tree(seed):
    """A tiny vocabulary makes a rejected child's token recur at other nodes; the final draw must
    still remove it (a masked scatter of duplicate ids once lost the mark)."""
    tree, logits, coins, final = make_round(seed, batch=4, depth=4, vocab=8, budget=6, logit_scale=2.0)
    assert_same(tree, logits, coins, final, *params((1.0, 3, 1.0), (1.0, 0, 1.0), (0.8, 0, 0.7), (1.0, 2, 1.0)))


request_params = st.tuples(st.sampled_from([0.0, 0.4, 1.0, 1.7]), st.sampled_from([0, 1, 3, 17, 60]),
                           st.sampled_from([1.0, 0.95, 0.6, 0.2]))


# Derandomized: a fixed set of draws, so the suite is reproducible. A random draw once found a
# mismatch (vocab 150, block 256, capacity 16, logits on a 0.5 grid, T 1.7 / top-p 0.6) that is an
# artefact of compiling the interpreted kernel for the CPU: the same case agrees with the jnp path
# with jit disabled, with a debug print added, or with XLA's algebraic simplifier turned off. (Both
# paths then divided by the temperature, which XLA on the CPU computes differently in different
# programs; both now multiply by its reciprocal.)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), vocab=st.integers(17, 700), block_v=st.sampled_from([16, 64, 256]),
       capacity=st.sampled_from([16, 32, 128, 1024]), tie_step=st.sampled_from([None, 0.5]),
       parallel_rows=st.sampled_from([0, PARALLEL_ROWS]),
       rows=st.lists(request_params, min_size=1, max_size=4))
def test_random_shapes_and_parameters_match_jnp_path(seed, vocab, block_v, capacity, tie_step, parallel_rows, rows):
    """Any vocabulary, block and candidate capacity, with and without ties: the same walk and
    tokens as the jnp path (candidates in registers, refined floors or bit-search passes)."""
    tree, logits, coins, final = make_round(seed, batch=len(rows), depth=3, vocab=vocab, budget=6,
                                            logit_scale=3.0, tie_step=tie_step, agree=4.0)
    assert_same(tree, logits, coins, final, *params(*rows), block_v=block_v, capacity=capacity,
                parallel_rows=parallel_rows)


def test_ties_at_top_k_and_top_p_boundaries():
    """Integer logits: dozens of tokens share the boundary value of most kept sets."""
    rows = [(1.0, 7, 1.0), (1.0, 20, 1.0), (1.0, 0, 0.3), (1.0, 0, 0.6), (1.0, 12, 0.5),
            (0.5, 3, 1.0), (1.0, 0, 0.9), (2.0, 40, 0.8), (0.0, 0, 1.0)]
    tree, logits, coins, final = make_round(11, batch=len(rows), depth=3, vocab=257, budget=9,
                                            logit_scale=1.0, tie_step=1.0)
    for capacity in (16, 64, 2048):  # by passes, refined floors, everything a candidate
        for parallel_rows in (0, PARALLEL_ROWS):
            assert_same(tree, logits, coins, final, *params(*rows), block_v=32, capacity=capacity,
                        parallel_rows=parallel_rows)


def test_long_accepted_paths_and_depth_limit():
    """Target logits that favour the drafts: walks reach the depth limit (nothing rejected)."""
    rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 10, 0.9), (1.0, 0, 0.95)]
    tree, logits, coins, final = make_round(5, batch=len(rows), depth=5, vocab=200, budget=5,
                                            logit_scale=1.0, agree=12.0, topk_cap=1)
    accept, _ = assert_same(tree, logits, coins, final, *params(*rows), block_v=64)
    assert int(jnp.max(jnp.sum(accept >= 0, axis=1))) == tree.max_depth + 1


def test_bfloat16_logits_and_one_block_vocab():
    rows = [(1.0, 0, 1.0), (0.6, 5, 0.8), (0.0, 0, 1.0)]
    tree, logits, coins, final = make_round(2, batch=3, depth=3, vocab=100, budget=6,
                                            dtype=jnp.bfloat16)
    assert_same(tree, logits, coins, final, *params(*rows), block_v=4096)


def test_jits_inside_a_caller_and_matches_the_reference():
    tree, logits, coins, final = make_round(4, batch=2, depth=2, vocab=50, budget=4)
    args = (tree.tokens, tree.parents, logits, coins, final, *params((1.0, 0, 1.0), (0.0, 0, 1.0)))
    ref = tree_sample_reference(*args, max_depth=tree.max_depth)
    out = jax.jit(lambda *a: tree_sample(*a, max_depth=tree.max_depth, interpret=True))(*args)
    for got, want in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("field, value", [("block_v", 100), ("capacity", 8), ("num_warps", 6), ("num_stages", 0),
                                          ("stats_blocks", 0), ("parallel_rows", -1)])
def test_invalid_config(field, value):
    with pytest.raises(ValueError, match=field):
        SamplerConfig(**{field: value})


def test_invalid_arguments():
    tree, logits, coins, final = make_round(0, batch=1, depth=2, vocab=50, budget=3)
    args = (tree.tokens, tree.parents, logits, coins, final, *params((1.0, 0, 1.0)))
    with pytest.raises(ValueError, match="logits_BNV"):
        tree_sample(*args[:2], logits[:, :2], *args[3:], max_depth=2)
    with pytest.raises(ValueError, match="coins_BN"):
        tree_sample(*args[:3], coins[:, :2], *args[4:], max_depth=2)
    with pytest.raises(ValueError, match="top_p_B"):
        tree_sample(*args[:7], jnp.ones((2,)), max_depth=2)
    with pytest.raises(ValueError, match="max_depth"):
        tree_sample(*args, max_depth=-1)
    with pytest.raises(ValueError, match="config"):
        tree_sample(*args, max_depth=2, config=dict(block_v=64))


@pytest.mark.parametrize("dtype, stats_blocks, parallel_rows", [(jnp.float32, 1, PARALLEL_ROWS),
                                                                 (jnp.bfloat16, 1, PARALLEL_ROWS),
                                                                 (jnp.float32, 16, PARALLEL_ROWS), (jnp.float32, 1, 0)])
def test_lowers_to_valid_triton_ir(dtype, stats_blocks, parallel_rows):
    """Qwen3-sized vocabulary: the kernels (statistics, rows with their candidates and boundaries,
    the floor passes, compaction and boundaries of the rows those leave without, walk; with
    ``parallel_rows=0`` rows without candidates and a walk that finds them itself) lower to Triton IR
    that the MLIR verifier accepts."""
    batch, nodes, vocab = 4, 65, 151936
    s = jax.ShapeDtypeStruct
    args = [s((batch, nodes), jnp.int32), s((batch, nodes), jnp.int32), s((batch, nodes, vocab), dtype),
            s((batch, nodes), jnp.float32), s((batch,), jnp.float32), s((batch,), jnp.float32),
            s((batch,), jnp.int32), s((batch,), jnp.float32)]
    config = SamplerConfig(block_v=32768, num_warps=16, num_stages=1, capacity=2048, stats_blocks=stats_blocks,
                           parallel_rows=parallel_rows)
    fn = lambda *a: tree_sample(*a, max_depth=8, config=config)  # noqa: E731
    modules = {re.search(r"tt.func public @(\w+)", m).group(1): m for m in verified_triton_modules(fn, *args)}
    searched = ["tree_sample_boundaries", "tree_sample_candidates", "tree_sample_floors"] if parallel_rows else []
    assert sorted(modules) == sorted(["tree_sample", "tree_sample_row_stats", "tree_sample_rows", *searched])
    reductions = ("tree_sample_row_stats", "tree_sample_rows", *searched[2:])
    assert all("tt.reduce" in modules[name] for name in reductions)
    scans = ("tree_sample", "tree_sample_rows", "tree_sample_candidates") if parallel_rows else ("tree_sample",)
    assert all("tt.scan" in modules[name] for name in scans)


def test_gpu_equality_script_sampling_checks_run_interpreted():
    """`experiments/check_kernels.py`'s sampling part (mixed parameters, candidate and pass searches,
    bf16 logits) on small vocabularies through the interpreter."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.check_kernels import check_sampling

    records = check_sampling(interpret=True, cases=[(8, 8, 700, "float32", 16), (8, 8, 700, "bfloat16", 2048)])
    assert [r["ok"] for r in records] == [True, True], records


def test_benchmark_launch_configs():
    """`experiments/bench_kernels.py --fused-configs`: stats_blocks, parallel_rows and capacity may be left out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_kernels import fused_config, fused_name

    assert fused_config("32768:8:1") == SamplerConfig(block_v=32768, num_warps=8, num_stages=1)
    assert fused_config("32768:8:1:4") == SamplerConfig(block_v=32768, num_warps=8, num_stages=1, stats_blocks=4)
    assert fused_config("32768:8:1").parallel_rows == PARALLEL_ROWS
    assert fused_name(fused_config("16384:16:1:8:0"), 2) == "fused_16384_16_1_8_0_2048"
    assert fused_config("32768:8:1:1:1024:256").capacity == 256
    for bad in ("32768:8", "1:2:3:4:5:6:7"):
        with pytest.raises(ValueError, match="block_v:num_warps:num_stages"):
            fused_config(bad)


# A previous kernel module with the old API, here the current kernels behind it, and with a knob it
# does not take (``capacity``: the benchmark passes only the knobs a baseline's signature names).
_OLD_API_MODULE = """
from ddtree_jax.verify import result_from_path
from pallas_kernels.tree_sampling import SamplerConfig, tree_sample as _tree_sample


def tree_sample(tree, logits, coins, final_coins, t, k, p, backend="triton", block_v=32768, num_warps=8,
                num_stages=1, stats_blocks=1, parallel_rows=1024):
    config = SamplerConfig(block_v=block_v, num_warps=num_warps, num_stages=num_stages, stats_blocks=stats_blocks,
                           parallel_rows=parallel_rows)
    path = _tree_sample(tree.tokens, tree.parents, logits, coins, final_coins, t, k, p, max_depth=tree.max_depth,
                        config=config, interpret=backend == "interpret")
    return result_from_path(*path, tree.tokens.shape[1])
"""


def test_benchmark_times_a_baseline_module_interleaved(tmp_path):
    """`bench_kernels.py sampling --baseline-module`: the module is loaded from its path, run with the
    configuration's knobs on the same inputs as the fused kernel, timed in the same rounds, and
    compared path for path (interpreted, tiny)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_kernels import bench_sampling, format_sampling_row, load_baseline

    path = tmp_path / "old_tree_sampling.py"
    path.write_text(_OLD_API_MODULE)
    baseline = load_baseline(str(path))
    assert baseline.__name__ == "tree_sampling_baseline"
    reports = []
    records = bench_sampling([(4, 1, "T0.7_k50_p0.9")], [SamplerConfig(block_v=64, capacity=16)], vocab=300,
                             peak_gbs=4800.0, budget_s=600.0, report=reports.append, baseline=baseline, repeats=2,
                             interpret=True)
    row, = records
    assert reports and reports[-1] is records
    assert set(row) >= {"fused", "baseline_fused", "jnp"}
    for name in ("fused", "baseline_fused", "jnp"):
        assert len(row[name]["rounds_ms"]) == 2 and row[name]["ms"] > 0, row[name]
    assert row["fused"]["vs_baseline"]["identical"] is True
    assert row["fused"]["identical"] and row["baseline_fused"]["identical"]  # both equal the jnp path
    assert "vs baseline" in format_sampling_row(row, ["fused", "baseline_fused", "jnp"])
