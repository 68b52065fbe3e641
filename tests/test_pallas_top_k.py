"""The radix-selection top-k kernel against ``lax.top_k`` (Pallas interpreter on CPU), its Triton lowering,
its segment policy and its bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.top_k import MAX_K, TopKConfig, segment_count, top_k
from pallas_kernels.top_k_reference import top_k_reference


def rows(seed, n, v, ties):
    """Random rows; with ``ties``, values on a coarse grid with ``-inf``, ``-0.0`` and ``0.0`` entries."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, v)).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2
        x[:, rng.integers(0, v, size=max(1, v // 9))] = -np.inf
        x[:, rng.integers(0, v, size=max(1, v // 13))] = -0.0
    return jnp.asarray(x)


def assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.signbit(got[0]), np.signbit(want[0]))  # -0.0 stays


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3), v=st.integers(1, 700), k_frac=st.floats(0, 1),
       ties=st.booleans(), segments=st.sampled_from([0, 1, 2, 5]), block=st.sampled_from([128, 256]))
def test_equals_lax_top_k(seed, n, v, k_frac, ties, segments, block):
    """Any row length (ragged last blocks, segments past the row's end), any k up to the row, ties."""
    k = max(1, round(k_frac * min(v, 64)))
    x = rows(seed, n, v, ties)
    got = top_k(x, k, config=TopKConfig(block=block, segments=segments), interpret=True)
    assert got[0].shape == got[1].shape == (n, k) and got[1].dtype == jnp.int32
    assert_same(got, top_k_reference(x, k))


@pytest.mark.parametrize("n, v, k, segments", [(2, 5000, 300, 4), (1, 4096, 1024, 0), (3, 3000, 1, 8)])
def test_large_k_and_long_rows(n, v, k, segments):
    x = rows(n + v + k, n, v, ties=True)
    assert_same(top_k(x, k, config=TopKConfig(block=512, segments=segments), interpret=True), top_k_reference(x, k))


def test_all_equal_and_all_minus_inf_rows():
    """Every entry tied: the k lowest indices, whichever segment they lie in."""
    x = jnp.stack([jnp.full((900,), -jnp.inf), jnp.full((900,), 0.5), jnp.zeros((900,)).at[::2].set(-0.0)])
    got = top_k(x, 40, config=TopKConfig(block=128, segments=3), interpret=True)
    assert_same(got, top_k_reference(x, 40))
    np.testing.assert_array_equal(got[1], np.broadcast_to(np.arange(40), (3, 40)))


def test_a_wrong_selection_is_caught():
    """The comparison tells a kernel that drops the last tied entry from one where it is kept."""
    x = rows(7, 2, 600, ties=True)
    got = top_k(x, 50, config=TopKConfig(block=128, segments=2), interpret=True)
    want = top_k_reference(x, 51)
    with pytest.raises(AssertionError):
        assert_same((got[0], got[1]), (want[0][:, 1:], want[1][:, 1:]))


@pytest.mark.parametrize("n, v, k, config", [(15, 151_936, 512, TopKConfig()), (120, 151_936, 4, TopKConfig()),
                                             (1, 32_768, 1024, TopKConfig(block=256, num_warps=4, segments=3))])
def test_triton_lowering_verifies(n, v, k, config):
    modules = verified_triton_modules(lambda x: top_k(x, k, config=config), jax.ShapeDtypeStruct((n, v), jnp.float32))
    segments = config.segments or segment_count(n, v, k, config.block, 132)
    assert len(modules) == (2 if segments > 1 else 1)  # the segments' selection, then the merge
    assert all("tt.scan" in m and "tt.reduce" in m for m in modules)  # cumulative sums, histogram sums


def test_segment_policy():
    assert segment_count(15, 151_936, 512, 1024, 132) == 9  # 135 programs, segments of 16,896 entries
    assert segment_count(120, 151_936, 512, 1024, 132) == 2  # one draft of eight requests: 240 programs
    assert segment_count(1, 32_768, 1024, 1024, 132) == 8  # segments no shorter than 4 k
    assert segment_count(15, 3000, 4, 1024, 132) == 1  # a row shorter than 8 blocks


@pytest.mark.parametrize("x, k, kwargs, match", [
    (jnp.zeros((2, 10), jnp.bfloat16), 3, {}, "float32"),
    (jnp.zeros((10,), jnp.float32), 3, {}, r"\[N, V\]"),
    (jnp.zeros((2, 10), jnp.float32), 11, {}, r"k must be an int in \[1, min\(V = 10"),
    (jnp.zeros((2, 2000), jnp.float32), MAX_K + 1, {}, "k must be an int"),
    (jnp.zeros((2, 10), jnp.float32), 0, {}, "k must be an int"),
    (jnp.zeros((2, 10), jnp.float32), 3, {"config": 5}, "config must be a TopKConfig"),
])
def test_bad_input_raises_clear_errors(x, k, kwargs, match):
    with pytest.raises(ValueError, match=match):
        top_k(x, k, interpret=True, **kwargs)


@pytest.mark.parametrize("field, value", [("block", 100), ("block", 64), ("num_warps", 3), ("segments", -1)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=f"TopKConfig.{field} must be"):
        TopKConfig(**{field: value})


def test_gpu_equality_script_top_k_part_runs_interpreted(monkeypatch):
    """`experiments/check_kernels.py`'s top_k part on small cases through the interpreter, and a broken
    kernel fails it."""
    from experiments import check_kernels

    cases = [(3, 2000, 16, True, TopKConfig(block=128)), (2, 1000, 4, False, TopKConfig(block=256, segments=2))]
    assert [r["ok"] for r in check_kernels.check_top_k(interpret=True, cases=cases)] == [True, True]
    monkeypatch.setattr(check_kernels, "top_k", lambda x, k, config, interpret: top_k_reference(x[:, ::-1], k))
    assert [r["ok"] for r in check_kernels.check_top_k(interpret=True, cases=cases[:1])] == [False]
