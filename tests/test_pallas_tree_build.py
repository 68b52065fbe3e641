"""Tree-build kernel (beam + global order) vs its jnp reference and the library's XLA path (Pallas
interpreter on CPU), its Triton lowering, and its bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_jax import tree
from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.tree_build import (
    MAX_BUDGET,
    TreeBuildConfig,
    candidate_chunks,
    kernel_supports,
    tree_build_config,
    tree_nodes,
)
from pallas_kernels.tree_build_reference import tree_nodes_reference


def top_k_rows(seed, batch, depth, vocab, k, ties, certain=False):
    """Each depth's top-k draft log-probabilities and ids, as the build takes them; with ``ties`` many
    exact duplicates; with ``certain`` every other depth from the second has one token of log-probability
    exactly 0 (a path through it ties with its parent, so nodes of different depths tie and only the
    rank tuples order them); with ``vocab < k`` the rows end in ``-inf`` entries."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, depth, vocab)).astype(np.float32) * rng.uniform(0.5, 4)
    if ties:
        pool = x[..., : max(1, vocab // 3)]
        x = np.take_along_axis(pool, rng.integers(0, pool.shape[-1], size=x.shape), axis=-1)
    if certain:  # exp(-200) underflows: the row's top token has probability 1, the others ~e^-200
        x[:, 1::2] = -200.0
        x[:, 1::2, 0] = 0.0
    x = np.pad(x, [(0, 0), (0, 0), (0, max(0, k - vocab))], constant_values=-np.inf)
    lp, ids = jax.lax.top_k(tree.draft_log_probs(jnp.asarray(x), 1.0), k)
    return lp, ids.astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=2)
def library_nodes(lp, ids, budget):
    """The XLA path's nodes 1..budget (``tree.tree_from_top_k``, vmapped), without the root."""
    build = jax.vmap(functools.partial(tree.tree_from_top_k, budget=budget))
    tokens, parents, depths, logw, _ = build(lp, ids, jnp.zeros(lp.shape[0], jnp.int32))
    return tokens[:, 1:], parents[:, 1:], depths[:, 1:], logw[:, 1:]


def assert_equal_nodes(got, want):
    for name, g, w in zip(("tokens", "parents", "depths", "logw"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


ONE_TILE = TreeBuildConfig(chunk=0)
CHUNK_8 = TreeBuildConfig(chunk=8)
CHUNK_64 = TreeBuildConfig(num_warps=16, chunk=64)
# (batch, depth, vocab, budget, k, launch; None: `tree_build_config`'s): compiled once each. Budgets 2
# to 64 with k = budget and below it (a per-depth cap, k = 1 a chain), depth 1, the embedded drafter's
# 15 and the most, 16; rank tuples in one word (k = 1) and in several (k = 16, 32, 64: three, four and
# four words at depth 15); fewer candidate paths than the budget (vocab 3: padding nodes, -inf entries
# in the rows); one count tile and chunks of 8 to 64 candidates (a last chunk part padding); budgets
# between powers of two (3, 5, 15, 24, 63: built as the first nodes of the next power of two's tree).
SHAPES = [(2, 15, 300, 16, 16, None), (1, 15, 300, 16, 4, None), (3, 5, 17, 8, 8, None), (2, 3, 3, 16, 3, None),
          (1, 1, 50, 4, 4, None), (2, 16, 100, 32, 4, None), (1, 7, 64, 16, 1, None), (2, 9, 64, 32, 32, None),
          (1, 2, 5, 2, 2, None), (2, 15, 300, 64, 64, None),
          (2, 15, 300, 15, 15, None), (1, 15, 300, 63, 4, None), (2, 3, 3, 5, 3, None),
          (1, 16, 40, 64, 4, CHUNK_64), (2, 15, 300, 64, 64, CHUNK_64), (2, 15, 300, 16, 16, CHUNK_8),
          (2, 3, 3, 16, 3, CHUNK_8), (1, 1, 50, 4, 4, CHUNK_8), (1, 2, 5, 2, 2, CHUNK_8), (1, 4, 40, 3, 2, CHUNK_8),
          (2, 15, 300, 16, 16, ONE_TILE), (2, 3, 3, 16, 3, ONE_TILE), (2, 9, 64, 32, 4, ONE_TILE),
          (2, 9, 64, 24, 8, ONE_TILE)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), ties=st.booleans(), certain=st.booleans())
def test_kernel_equals_reference_and_library(shape, seed, ties, certain):
    assert_build_equals_reference_and_library(tree_nodes, shape, seed, ties, certain)


def assert_build_equals_reference_and_library(build, shape, seed, ties, certain):
    """``build(lp, ids, budget=, config=, interpret=True)`` (a kernel's nodes) on the top-k rows of
    ``shape = (batch, depth, vocab, budget, k, config)`` (`top_k_rows`) equals the reference and the XLA
    path."""
    batch, depth, vocab, budget, k, config = shape
    lp, ids = top_k_rows(seed, batch, depth, vocab, k, ties, certain)
    got = build(lp, ids, budget=budget, config=config, interpret=True)
    assert_equal_nodes(got, tree_nodes_reference(lp, ids, budget=budget))
    assert_equal_nodes(got, library_nodes(lp, ids, budget))


@pytest.mark.parametrize("budget, k", [(24, 24), (128, 8)])
def test_reference_equals_library_beyond_the_kernel(budget, k):
    """The reference takes any budget: at budgets the kernel does not, it equals the XLA path too."""
    lp, ids = top_k_rows(3, 2, 6, 40, k, True)
    assert_equal_nodes(tree_nodes_reference(lp, ids, budget=budget), library_nodes(lp, ids, budget))


@pytest.mark.parametrize("budget, k, depth, config", [
    (16, 16, 15, None), (16, 4, 15, None), (32, 32, 15, None), (64, 64, 15, None), (63, 4, 15, None),
    (64, 4, 15, None), (64, 64, 16, None), (32, 32, 15, TreeBuildConfig(num_warps=16)),
    (2, 1, 1, TreeBuildConfig(num_warps=1)), (16, 16, 15, ONE_TILE), (16, 16, 15, TreeBuildConfig(chunk=16)),
    (64, 64, 15, CHUNK_64)])
def test_triton_lowering_verifies(budget, k, depth, config):
    shapes = [jax.ShapeDtypeStruct((2, depth, k), dtype) for dtype in (jnp.float32, jnp.int32)]
    (module,) = verified_triton_modules(lambda lp, ids: tree_nodes(lp, ids, budget=budget, config=config), *shapes)
    # the count's reductions; the threads meet after each depth's stores, which the next depth and the order load
    assert "tt.reduce" in module and "gpu.barrier" in module


def test_kernel_supports_budgets_up_to_64():
    assert kernel_supports(16, 16, 15) and kernel_supports(64, 64, 16) and kernel_supports(2, 1, 1)
    assert kernel_supports(24, 8, 15) and kernel_supports(63, 4, 15)  # beams 32 and 64 wide
    assert not kernel_supports(1, 1, 15) and not kernel_supports(MAX_BUDGET + 1, 4, 15)
    assert not kernel_supports(16, 32, 15)  # k > budget
    assert not kernel_supports(16, 16, 17)  # deeper than MAX_DEPTH


def test_launches_and_the_shapes_they_take():
    """The measured launches: chunks of 32, 8 warps, 16 at B = 64 (one tile of B = 64's 280 candidates
    would be 512 wide). Each default takes every width its budget allows."""
    assert candidate_chunks(16, 16, 0) == (64, 1) and candidate_chunks(64, 64, 32) == (32, 9)
    assert tree_build_config(16, 16) == tree_build_config(2, 1) == tree_build_config(32, 32) == TreeBuildConfig()
    assert tree_build_config(64, 4) == tree_build_config(64, 64) == TreeBuildConfig(num_warps=16, chunk=32)
    assert all(tree_build_config(b, k).supports(b, k) for b in (2, 4, 8, 16, 32, 64) for k in range(1, b + 1))
    assert not ONE_TILE.supports(64, 64)  # a 512-wide tile
    assert not CHUNK_8.supports(64, 64)  # 35 chunks: 35^2 tiles unrolled
    assert CHUNK_8.supports(16, 16) and ONE_TILE.supports(32, 4)


def test_bad_input_raises_clear_errors():
    lp, ids = top_k_rows(0, 1, 3, 20, 4, False)
    with pytest.raises(ValueError, match="does not take budget 65"):
        tree_nodes(lp, ids, budget=65)
    with pytest.raises(ValueError, match="tok_BLK must have the shape"):
        tree_nodes(lp, ids[:, :2], budget=4)
    with pytest.raises(ValueError, match=r"lp_BLK must be \[batch, L, K\]"):
        tree_nodes(lp[0], ids[0], budget=4)
    with pytest.raises(ValueError, match=r"does not take budget 64 \(beams 64 wide\) with k 4"):
        tree_nodes(*top_k_rows(0, 1, 3, 20, 4, False), budget=64, config=TreeBuildConfig(chunk=8))
    with pytest.raises(ValueError, match="config 4 does not take"):
        tree_nodes(lp, ids, budget=4, config=4)
    for field, value, message in [("num_warps", 3, "num_warps must be one of"), ("chunk", 12, "chunk must be 0 or"),
                                  ("chunk", 256, "chunk must be 0 or")]:
        with pytest.raises(ValueError, match=message):
            TreeBuildConfig(**{field: value})


def test_gpu_equality_script_tree_build_part_runs_interpreted(monkeypatch):
    """`experiments/check_kernels.py`'s tree_build part on small cases through the interpreter, and a
    broken kernel fails it."""
    from experiments import check_kernels

    cases = [(2, 5, 300, 16, 4, True, None), (1, 3, 40, 8, 8, False, CHUNK_8)]
    assert [r["ok"] for r in check_kernels.check_tree_build(interpret=True, cases=cases)] == [True, True]

    def off_by_one(lp, ids, *, budget, config, interpret):
        tokens, *rest = tree_nodes(lp, ids, budget=budget, config=config, interpret=interpret)
        return tokens + 1, *rest

    monkeypatch.setattr(check_kernels, "tree_nodes", off_by_one)
    assert not any(r["ok"] for r in check_kernels.check_tree_build(interpret=True, cases=cases))
