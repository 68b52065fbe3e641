"""The wide tree build (a grid of programs a depth, for large budgets) vs its jnp reference and the
library's XLA path (Pallas interpreter on CPU), its Triton lowering, and its bad input."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pallas_tree_build import assert_build_equals_reference_and_library, top_k_rows

from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.tree_build_wide import (
    GATHER_KEYS_MIN_PAIRS,
    MAX_PAIRS,
    WideBuildConfig,
    kernel_supports,
    padded_pairs,
    tree_nodes_wide,
    wide_build_config,
)

SMALL = WideBuildConfig(rows=8, cols=16, entries=16)
# (batch, depth, vocab, budget, k, launch): budgets 2 to 200, past the one-program kernel's 64 and between
# powers of two; k = budget and a cap (k = 1 a chain); depth 1 (no depth launch), 15 and 16; fewer
# candidate paths than the budget (vocab 3); rank tuples in one to five words; a program's candidates
# spanning one to all of a depth's (rows 8 to 64 of 64 to 2,048 padded pairs), steps of 8 candidates to all
# of them (cols past the padded pairs: one step) and order programs of 8 to 128 entries.
SHAPES = [(2, 15, 300, 16, 16, SMALL), (1, 1, 50, 4, 4, SMALL), (2, 3, 3, 5, 3, SMALL), (1, 2, 5, 2, 2, SMALL),
          (1, 7, 64, 16, 1, SMALL), (2, 16, 40, 64, 4, WideBuildConfig(rows=64, cols=64, entries=128)),
          (1, 9, 64, 100, 8, WideBuildConfig(rows=32, cols=128, entries=64, num_warps=8)),
          (1, 4, 300, 200, 200, WideBuildConfig(rows=64, cols=256, entries=128)),
          (2, 5, 40, 24, 24, WideBuildConfig(rows=16, cols=8, entries=8)),
          (1, 6, 40, 70, 4, WideBuildConfig(rows=16, cols=1024, entries=64)),
          (2, 15, 300, 16, 16, WideBuildConfig(rows=8, cols=16, entries=16, gather_keys=True)),
          (1, 9, 64, 100, 8, WideBuildConfig(rows=32, cols=128, entries=64, gather_keys=True))]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), ties=st.booleans(), certain=st.booleans())
def test_wide_build_equals_reference_and_library(shape, seed, ties, certain):
    assert_build_equals_reference_and_library(tree_nodes_wide, shape, seed, ties, certain)


@pytest.mark.parametrize("budget, k, depth, config", [
    (512, 512, 15, None), (128, 4, 15, None), (1024, 1024, 16, None), (512, 512, 15, WideBuildConfig(rows=64)),
    (512, 512, 15, WideBuildConfig(cols=128, num_warps=4)),
    (256, 4, 15, WideBuildConfig(rows=16, cols=256, entries=128, num_warps=8)), (16, 1, 1, None),
    (512, 512, 15, WideBuildConfig(gather_keys=True))])
def test_triton_lowering_verifies(budget, k, depth, config):
    shapes = [jax.ShapeDtypeStruct((2, depth, k), dtype) for dtype in (jnp.float32, jnp.int32)]
    modules = verified_triton_modules(
        lambda lp, ids: tree_nodes_wide(lp, ids, budget=budget, config=config), *shapes)
    # one module a launch kind: the depths' (absent at depth 1; one for all depths, the depth an operand) and
    # the order's; the depth's threads meet after storing the scratch keys that they read back, unless they
    # gather the keys at each step
    assert len(modules) == (1 if depth == 1 else 2)
    assert all("tt.reduce" in m for m in modules)
    gathered = (config or wide_build_config(budget, k)).gather_keys
    assert depth == 1 or ("gpu.barrier" in modules[0]) != gathered


def test_supported_shapes():
    assert kernel_supports(512, 512, 15) and kernel_supports(1024, 1024, 16) and kernel_supports(2, 1, 1)
    assert kernel_supports(100, 8, 9) and kernel_supports(2048, 4, 15)  # 4 ranks: 4,266 candidates
    assert not kernel_supports(2048, 2048, 15) and not kernel_supports(4096, 4, 15)  # over MAX_PAIRS once padded
    assert not kernel_supports(1, 1, 15) and not kernel_supports(16, 32, 15) and not kernel_supports(16, 16, 17)
    assert padded_pairs(512, 512, WideBuildConfig()) == 4096 <= MAX_PAIRS  # 3,280 candidates
    assert padded_pairs(2, 1, WideBuildConfig()) == 32  # at least a program's `rows`


def test_default_launch_gathers_keys_from_512_padded_candidates():
    assert GATHER_KEYS_MIN_PAIRS == 512
    assert wide_build_config(512, 512) == WideBuildConfig(gather_keys=True)  # 4,096 padded candidates
    assert wide_build_config(128, 4) == WideBuildConfig(gather_keys=True)  # 512
    assert wide_build_config(64, 4) == WideBuildConfig()  # 256: the stored keys measured faster
    with pytest.raises(ValueError, match="WideBuildConfig.gather_keys must be a bool"):
        WideBuildConfig(gather_keys=2)


def test_bad_input_raises_clear_errors():
    lp, ids = top_k_rows(0, 1, 3, 20, 4, False)
    with pytest.raises(ValueError, match="does not take budget 1 "):
        tree_nodes_wide(lp, ids, budget=1)
    with pytest.raises(ValueError, match="does not take budget 3.5"):
        tree_nodes_wide(lp, ids, budget=3.5)
    with pytest.raises(ValueError, match="tok_BLK must have the shape"):
        tree_nodes_wide(lp, ids[:, :2], budget=4)
    with pytest.raises(ValueError, match=r"lp_BLK must be \[batch, L, K\]"):
        tree_nodes_wide(lp[0], ids[0], budget=4)
    with pytest.raises(ValueError, match="config must be a WideBuildConfig"):
        tree_nodes_wide(lp, ids, budget=4, config=4)
    for field, value in [("rows", 12), ("cols", 4), ("entries", 2048), ("num_warps", 3)]:
        with pytest.raises(ValueError, match=f"WideBuildConfig.{field} must be"):
            WideBuildConfig(**{field: value})


def test_gpu_equality_script_runs_the_wide_build_interpreted(monkeypatch):
    """`experiments/check_kernels.py`'s tree_build part runs a `WideBuildConfig` case through the wide
    build, and a broken wide build fails it."""
    from experiments import check_kernels

    cases = [(1, 4, 300, 100, 8, True, SMALL)]
    assert [r["ok"] for r in check_kernels.check_tree_build(interpret=True, cases=cases)] == [True]

    def off_by_one(lp, ids, *, budget, config, interpret):
        tokens, parents, *rest = tree_nodes_wide(lp, ids, budget=budget, config=config, interpret=interpret)
        return tokens, parents + 1, *rest

    monkeypatch.setattr(check_kernels, "tree_nodes_wide", off_by_one)
    assert not any(r["ok"] for r in check_kernels.check_tree_build(interpret=True, cases=cases))
