"""The L2 prefetch kernel vs its jnp reference and a NumPy oracle (Pallas interpreter on CPU), its Triton
lowering, and the dispatch that ties a product's input to it without changing a forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax import kernels
from ddtree_jax.models import Qwen3Config, init_cache, init_target, qwen3
from ddtree_jax.models import layers as L
from pallas_kernels.l2_prefetch import _l2_prefetch, l2_prefetch, l2_prefetch_rows
from pallas_kernels.l2_prefetch_reference import l2_prefetch_reference, tile_count
from pallas_kernels.lowering import verified_triton_modules


def numpy_prefetch(w, tiles, programs, block_rows, cols):
    """Program p's maximum over tiles p, p + programs, ... of the flat matrix, -inf where it reads none."""
    flat = np.asarray(w, np.float32).reshape(-1)
    size = block_rows * cols
    out = np.full(programs, -np.inf, np.float32)
    for t in range(tiles):
        out[t % programs] = max(out[t % programs], flat[t * size:(t + 1) * size].max())
    return out


@settings(max_examples=20, deadline=None)
@given(log_rows=st.integers(0, 2), log_cols=st.integers(3, 6), programs=st.integers(1, 9), total=st.integers(1, 12),
       fraction=st.floats(0, 1), dtype=st.sampled_from(["bfloat16", "float32"]), seed=st.integers(0, 2**16))
def test_interpret_equals_reference_and_numpy(log_rows, log_cols, programs, total, fraction, dtype, seed):
    block_rows, cols = 1 << log_rows, 1 << log_cols
    w = jax.random.normal(jax.random.key(seed), (total * block_rows, cols), dtype)
    tiles = int(fraction * total)
    args = dict(tiles=tiles, programs=programs, block_rows=block_rows, cols=cols)
    want = numpy_prefetch(w, **args)
    np.testing.assert_array_equal(l2_prefetch_reference(w, **args), want)
    np.testing.assert_array_equal(l2_prefetch(w, w[:2], **args, interpret=True), want)


def test_tiles_are_read_from_the_matrix_in_row_major_order():
    """A [6, 16] matrix read as rows of 8: tile t is elements [16 t, 16 t + 16), so only the tiles read count."""
    w = jnp.arange(96, dtype=jnp.float32).reshape(6, 16)
    assert tile_count(w, block_rows=2, cols=8) == 6
    np.testing.assert_array_equal(l2_prefetch(w, tiles=4, programs=3, block_rows=2, cols=8, interpret=True),
                                  [63.0, 31.0, 47.0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(w=jnp.ones((4, 4), jnp.int32)), "floating matrix"),
    (dict(w=jnp.ones((16,))), "floating matrix"),
    (dict(programs=0), "programs"),
    (dict(block_rows=0), "block_rows"),
    (dict(cols=3), "whole tiles"),
    (dict(tiles=5), r"tiles must be an int in \[0, 4\]"),
    (dict(tiles=-1), "tiles"),
])
def test_bad_operands_are_named(kwargs, match):
    args = dict(w=jnp.ones((8, 8)), tiles=2, programs=2, block_rows=2, cols=8) | kwargs
    with pytest.raises(ValueError, match=match):
        l2_prefetch_reference(**args)
    with pytest.raises(ValueError, match=match):
        l2_prefetch(**args, interpret=True)


def test_kernel_needs_power_of_two_tiles():
    with pytest.raises(ValueError, match="powers of two"):
        l2_prefetch(jnp.ones((6, 6)), tiles=1, programs=1, block_rows=3, cols=6, interpret=True)


def test_lowers_to_valid_triton_at_qwen3_8b_shapes():
    """The attention output matrix of Qwen3-8B read by 64 programs: the module loads [64, 512] tiles."""
    [module] = verified_triton_modules(
        functools.partial(_l2_prefetch, tiles=256, programs=64, block_rows=64, cols=512, num_warps=8,
                          interpret=False),
        jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4, 16, 6144), jnp.float32))
    assert "tensor<64x512xbf16>" in module and "evict_last" in module


def test_config_fields_are_checked():
    for kwargs, match in ((dict(wo=1.5), "wo"), (dict(wo=-0.1), "wo"), (dict(programs=0), "programs"),
                          (dict(num_warps=3), "num_warps")):
        with pytest.raises(ValueError, match=match):
            kernels.L2Prefetch(**kwargs)


def test_nothing_is_read_ahead_by_xla_under_a_mesh_or_without_a_config():
    config = kernels.L2Prefetch(wo=1.0)
    assert kernels.prefetch_fn("xla", config=config) is None
    assert kernels.prefetch_fn("auto") is None  # no GPU here
    assert kernels.prefetch_fn("interpret") is None
    assert kernels.prefetch_fn("interpret", mesh=jax.make_mesh((1, 1), ("dp", "tp")), config=config) is None
    with pytest.raises(ValueError, match="matmul_impl"):
        kernels.prefetch_fn("fast")


def small_target():
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return init_target(cfg, jax.random.key(0), jnp.float32)


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_a_forward_reading_ahead_equals_the_forward_without(fraction):
    """The decoder with the interpreted kernel ahead of each attention output product gives the same logits,
    and its compiled program still holds the kernel's maxima (the tie keeps XLA from removing it)."""
    target = small_target()
    cache = init_cache(2, 1, 2, 16, 16, jnp.float32)
    tokens, positions = jnp.array([[3, 5, 7]]), jnp.arange(3)[None]
    mask = jnp.tril(jnp.ones((3, 3), bool))[None]
    ahead = kernels.prefetch_fn("interpret", config=kernels.L2Prefetch(wo=fraction, programs=3, block_rows=4, cols=64))

    def forward(prefetch):
        attend = L.cached_attend(mask, 16 ** -0.5, "xla")
        return qwen3.run_layers(target, tokens, positions, attend, cache, (), prefetch=prefetch)[0]

    np.testing.assert_array_equal(jax.jit(forward, static_argnums=0)(ahead), jax.jit(forward, static_argnums=0)(None))
    maxima = [jax.jit(forward, static_argnums=0).lower(p).compile().as_text().count("maximum(") for p in (ahead, None)]
    assert maxima[0] > maxima[1]


def recorded_launches(monkeypatch) -> list[dict]:
    """The keywords of every launch the dispatch makes of the kernel from now on (it still runs)."""
    launches, rows = [], kernels.l2_prefetch_rows
    monkeypatch.setattr(kernels, "l2_prefetch_rows", lambda *a, **k: launches.append(k) or rows(*a, **k))
    return launches


def test_check_kernels_part_through_the_interpreter(monkeypatch):
    """`experiments/check_kernels.py`'s l2_prefetch part on small cases and a small forward, interpreted: every
    case passes, and the forwards launched the kernel (two layers, two forwards)."""
    from experiments import check_kernels

    launches = recorded_launches(monkeypatch)
    shapes = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
    records = check_kernels.check_l2_prefetch(
        interpret=True, cases=[(128, 512, 0.5, 3, "bfloat16")], forwards=[(1, 8), (5, 8)], shapes=shapes,
        config=kernels.L2Prefetch(wo=0.5, programs=3, block_rows=8, cols=64))
    assert [(r["part"], r["ok"]) for r in records] == [("l2_prefetch", True)] + [("l2_prefetch_forward", True)] * 2
    assert [k["tiles"] for k in launches] == [8] * 4


def test_the_gpu_program_launches_the_kernel_on_a_second_stream_each_layer():
    """Lowered for CUDA (no GPU needed), a decoder with ``"pallas"`` read-ahead holds one l2_prefetch custom call
    a layer, each carrying the stream attribute XLA wraps in an async pair, and none without read-ahead."""
    target = small_target()
    cache = init_cache(2, 1, 2, 16, 16, jnp.bfloat16)
    target = jax.tree.map(lambda a: a.astype(jnp.bfloat16), target)
    tokens, positions = jnp.array([[3, 5, 7]]), jnp.arange(3)[None]
    mask = jnp.tril(jnp.ones((3, 3), bool))[None]
    ahead = kernels.prefetch_fn("pallas", config=kernels.L2Prefetch(wo=1.0, programs=2, block_rows=16, cols=64))

    def calls(prefetch):
        def forward(target, cache):
            attend = L.cached_attend(mask, 16 ** -0.5, "xla")
            return qwen3.run_layers(target, tokens, positions, attend, cache, (), prefetch=prefetch)[0]
        text = jax.jit(forward).trace(target, cache).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]

    launched = calls(ahead)
    assert len(launched) == 2 and all('_xla_stream_annotation = "1"' in line for line in launched)
    assert calls(None) == []


def test_a_drafter_pass_reading_ahead_equals_the_pass_without(monkeypatch):
    """The drafter's block layers take the forward's read-ahead (`kernels.prefetch_fn`, here the interpreted
    kernel for any implementation): the draft logits and the committed cache equal the pass without, and the
    kernel ran once a drafter layer."""
    from test_dflash import make_pair

    from ddtree_jax.models import drafter_forward

    drafter, target = make_pair()
    prefetch_fn = kernels.prefetch_fn
    launches = recorded_launches(monkeypatch)
    config = kernels.L2Prefetch(wo=1.0, programs=3, block_rows=4, cols=64)
    taps = jax.random.normal(jax.random.key(1), (2, 4, drafter.config.num_features))
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    args = (taps, positions, jnp.array([4, 2], jnp.int32), jnp.array([3, 5], jnp.int32), jnp.array([4, 2], jnp.int32))

    def draft():
        return drafter_forward(drafter, target, init_cache(2, 2, 1, 20, 8, jnp.float32), *args, matmul_impl="xla")

    without = draft()
    monkeypatch.setattr(kernels, "prefetch_fn", lambda impl, mesh=None: prefetch_fn("interpret", mesh, config))
    jax.clear_caches()  # the jitted pass is traced again, now with the read-ahead
    with_ahead = draft()
    for a, b in zip(jax.tree.leaves(with_ahead), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)
    jax.clear_caches()  # no later test gets the pass traced with the patched dispatch
    assert [k["tiles"] for k in launches] == [4] * drafter.config.num_hidden_layers


def test_the_launch_on_rows_checks_its_operands_and_equals_the_reference():
    """`l2_prefetch_rows` (the dispatch's launch) names bad operands like `l2_prefetch` and reads the same tiles."""
    w = jax.random.normal(jax.random.key(3), (16, 64), jnp.float32)
    launch = dict(tiles=6, programs=4, block_rows=2, num_warps=4)
    np.testing.assert_array_equal(l2_prefetch_rows(w, w[:1], **launch, interpret=True),
                                  l2_prefetch_reference(w, tiles=6, programs=4, block_rows=2, cols=64))
    with pytest.raises(ValueError, match=r"tiles must be an int in \[0, 8\]"):
        l2_prefetch_rows(w, w[:1], **(launch | dict(tiles=9)), interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        l2_prefetch_rows(w[:, :48], w[:1], **(launch | dict(tiles=1)), interpret=True)
