"""Tree-attention kernel vs the jnp reference (interpret mode on CPU) and its Triton lowering."""

import dataclasses
import functools
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import configs
from pallas_kernels.configs import TreeAttentionConfig
from pallas_kernels.lowering import verified_triton_modules
from pallas_kernels.tree_attention_reference import tree_attention_reference
from pallas_kernels.tree_attention import _plan, _split_blocks, _tree_attention_pallas, tree_attention
from pallas_kernels.split_k import merge_normalized_splits, merge_splits, split_count
from pallas_kernels.tree_attention_mgpu import tree_attention_mgpu

# Small tiles so that CPU-sized problems exercise several splits, row blocks and tree blocks.
SMALL = TreeAttentionConfig(block_m=16, block_k=16, min_programs=64, min_chunk=16)
BY_LENGTH = dataclasses.replace(SMALL, split_by_length=True)
CAPPED = dataclasses.replace(BY_LENGTH, max_splits=2)


def random_tree_mask(rng, num_nodes, num_real):
    """Ancestor mask of a random tree with ``num_real`` real nodes then padding nodes.

    Real node i > 0 has a random parent < i; padding nodes see only themselves.
    """
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, num_real)]
    mask = np.eye(num_nodes, dtype=bool)
    for i in range(1, num_real):
        mask[i] |= mask[parents[i]]
    return mask


def make_inputs(seed, *, batch, num_q, heads, kv_heads, head_dim, slots, lengths, dtype,
                num_new=None, padding=0):
    rng = np.random.default_rng(seed)
    num_new = num_q if num_new is None else num_new
    q = rng.standard_normal((batch, num_q, heads, head_dim))
    k = rng.standard_normal((batch, kv_heads, slots, head_dim))
    v = rng.standard_normal((batch, kv_heads, slots, head_dim))
    if num_new == num_q:
        mask = np.stack([random_tree_mask(rng, num_q, num_q - padding) for _ in range(batch)])
    else:
        mask = rng.random((batch, num_q, num_new)) < 0.5
        mask[:, :, 0] = True
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(mask))


def assert_close(out, ref, dtype):
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    assert out.dtype == ref.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=tol)


# (batch, N, H, K, head_dim, S, lengths, padding nodes, dtype)
CASES = [
    (1, 1, 1, 1, 16, 1, [0], 0, jnp.float32),  # decode-like, empty prefix
    (1, 1, 4, 1, 32, 40, [39], 0, jnp.float32),  # one query, group 4
    (2, 5, 4, 2, 16, 80, [10, 70], 0, jnp.float32),
    (3, 17, 4, 4, 32, 300, [0, 283, 131], 3, jnp.float32),  # ragged, padding nodes
    (2, 40, 8, 2, 64, 300, [260, 17], 5, jnp.float32),  # group 4, several row blocks
    (3, 9, 2, 2, 64, 120, [111, 0, 64], 2, jnp.bfloat16),
    (1, 40, 4, 2, 16, 300, [260], 0, jnp.bfloat16),
    (2, 16, 8, 4, 32, 48, [32, 7], 4, jnp.bfloat16),
]


@pytest.mark.parametrize("config", [SMALL, BY_LENGTH, CAPPED, configs.TREE_ATTENTION_CONFIGS[(9, 0)]],
                         ids=["small", "small_by_length", "small_two_splits", "sm90"])
@pytest.mark.parametrize("seed", range(len(CASES)),
                         ids=[f"B{c[0]}N{c[1]}H{c[2]}K{c[3]}D{c[4]}S{c[5]}" for c in CASES])
def test_interpret_matches_reference(seed, config):
    batch, num_q, heads, kv_heads, head_dim, slots, lengths, padding, dtype = CASES[seed]
    args = make_inputs(seed, batch=batch, num_q=num_q, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim, slots=slots, lengths=lengths,
                       dtype=dtype, padding=padding)
    scale = head_dim ** -0.5
    out = tree_attention(*args, scale=scale, interpret=True, config=config)
    assert_close(out, tree_attention_reference(*args, scale=scale), dtype)


def test_more_new_keys_than_queries_and_under_jit():
    args = make_inputs(7, batch=2, num_q=3, heads=4, kv_heads=2, head_dim=16, slots=64,
                       lengths=[20, 50], dtype=jnp.float32, num_new=11)
    fn = jax.jit(lambda *a: tree_attention(*a, scale=0.3, interpret=True, config=SMALL))
    assert_close(fn(*args), tree_attention_reference(*args, scale=0.3), jnp.float32)


@pytest.mark.parametrize("attend", [
    functools.partial(tree_attention, interpret=True, config=SMALL),
    functools.partial(tree_attention_mgpu, interpret=True),
], ids=["triton", "mosaic"])
def test_layer_of_a_stacked_cache_equals_that_layer_alone(attend):
    """``layer=i`` over ``[L, B, K, S, D]`` caches attends layer i exactly as its slice would."""
    dtype = jnp.float32 if attend.func is tree_attention else jnp.bfloat16
    q, k, v, lengths, mask = make_inputs(4, batch=2, num_q=5, heads=4, kv_heads=2, head_dim=64,
                                         slots=128, lengths=[9, 70], dtype=dtype)
    k_L, v_L = jnp.stack([k * 0.5, k, -k]), jnp.stack([v + 1.0, v, v * 2.0])
    for layer in range(3):
        out = attend(q, k_L, v_L, lengths, mask, scale=0.3, layer=layer)
        alone = attend(q, k_L[layer], v_L[layer], lengths, mask, scale=0.3)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))
    with pytest.raises(ValueError, match="layer=3"):
        attend(q, k_L, v_L, lengths, mask, scale=0.3, layer=3)
    with pytest.raises(ValueError, match="layer=0"):
        attend(q, k, v, lengths, mask, scale=0.3, layer=0)
    with pytest.raises(ValueError, match="layer must be an int"):
        attend(q, k_L, v_L, lengths, mask, scale=0.3, layer=jnp.int32(1))
    out = attend(q, k_L, v_L, lengths, mask, scale=0.3, layer=np.int64(2))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))


def test_layer_of_a_stacked_cache_in_the_reference():
    q, k, v, lengths, mask = make_inputs(4, batch=2, num_q=5, heads=4, kv_heads=2, head_dim=16,
                                         slots=48, lengths=[9, 30], dtype=jnp.float32)
    k_L, v_L = jnp.stack([k * 0.5, k, -k]), jnp.stack([v + 1.0, v, v * 2.0])
    out = tree_attention_reference(q, k_L, v_L, lengths, mask, scale=0.3, layer=1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tree_attention_reference(q, k, v, lengths, mask,
                                                                                        scale=0.3)))


def test_gpu_equality_script_attention_checks_run_interpreted():
    """`experiments/check_kernels.py`'s attention part, small cases through the interpreter: a plain
    case and the same case as the last layer of a stacked cache."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.check_kernels import check_attention

    cases = [(2, 5, 4, 2, 16, [30, 7], 1, "float32")]
    records = check_attention(("interpret",), cases=cases, stacked=[(3, 0)])
    assert [(r["layers"], r["ok"]) for r in records] == [(None, True), (3, True)], records


def test_gpu_equality_script_backends_name_their_configs():
    """`check_kernels.py --backends triton_by_length` checks the local entry with the prefix split by length."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.check_kernels import attention_kernel

    plain, by_length = attention_kernel("triton"), attention_kernel("triton_by_length")
    assert plain.func is by_length.func is tree_attention
    assert by_length.keywords["config"] == dataclasses.replace(plain.keywords["config"], split_by_length=True)
    assert plain.keywords["config"] == configs.tree_attention_config()


def test_stale_cache_slots_are_ignored():
    """Slots past ``lengths + M`` must not change the output."""
    q, k, v, lengths, mask = make_inputs(3, batch=2, num_q=6, heads=2, kv_heads=1, head_dim=16,
                                         slots=96, lengths=[30, 70], dtype=jnp.float32)
    base = tree_attention(q, k, v, lengths, mask, scale=0.25, interpret=True, config=SMALL)
    stale = jnp.arange(96)[None, None, :, None] >= lengths[:, None, None, None] + 6
    k2, v2 = jnp.where(stale, 1e4, k), jnp.where(stale, -1e4, v)
    out = tree_attention(q, k2, v2, lengths, mask, scale=0.25, interpret=True, config=SMALL)
    np.testing.assert_allclose(np.asarray(out), np.asarray(base), atol=2e-5)


def test_query_seeing_nothing_gets_zeros():
    q, k, v, _, mask = make_inputs(5, batch=1, num_q=4, heads=2, kv_heads=2, head_dim=16,
                                   slots=32, lengths=[0], dtype=jnp.float32)
    mask = mask.at[0, 2, :].set(False)
    out = tree_attention(q, k, v, jnp.zeros(1, jnp.int32), mask, scale=0.25, interpret=True,
                         config=SMALL)
    ref = tree_attention_reference(q, k, v, jnp.zeros(1, jnp.int32), mask, scale=0.25)
    np.testing.assert_array_equal(np.asarray(out[0, 2]), 0.0)
    np.testing.assert_allclose(np.asarray(out[0, [0, 1, 3]]), np.asarray(ref[0, [0, 1, 3]]),
                               atol=2e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale=jnp.float32(0.1)), "scale"),
    (dict(head_dim=24, interpret=True), "head_dim"),
    (dict(heads=3), "multiple of kv heads"),
    (dict(lengths=[1, 2]), "lengths"),
])
def test_invalid_arguments(kwargs, match):
    shape = dict(batch=1, num_q=4, heads=kwargs.pop("heads", 2), kv_heads=2,
                 head_dim=kwargs.pop("head_dim", 16), slots=20, lengths=[8], dtype=jnp.float32)
    q, k, v, lengths, mask = make_inputs(0, **shape)
    lengths = jnp.asarray(kwargs.pop("lengths", lengths))
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, lengths, mask, **{"scale": 0.1, **kwargs})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("config", [*configs.TREE_ATTENTION_CONFIGS.values(), SMALL,
                                    dataclasses.replace(configs.TREE_ATTENTION_CONFIGS[(9, 0)], split_by_length=True)])
def test_lowers_to_valid_triton_ir(dtype, config):
    """Each kernel variant lowers to Triton IR that the MLIR verifier accepts (no GPU needed)."""
    for num_q, slots in ((16, 4096), (40, 300)):
        shapes = [((2, num_q, 32, 128), dtype), ((36, 2, 8, slots, 128), dtype),  # a stacked cache
                  ((36, 2, 8, slots, 128), dtype), ((2,), jnp.int32), ((2, num_q, num_q), jnp.bool_)]
        args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
        fn = lambda *a: _tree_attention_pallas(*a, scale=0.1, layer=35, config=config, interpret=False)  # noqa: E731
        [module] = verified_triton_modules(fn, *args)
        assert "tt.dot" in module


def test_stacked_cache_past_4gb_lowers_with_64_bit_offsets():
    """A Qwen3-8B stacked cache at batch 8 and 8k slots (4.9 GB per K or V): the kernel reads its
    last layer with 64-bit offsets (32-bit ones would wrap past 2**32 bytes)."""
    shapes = [((8, 64, 32, 128), jnp.bfloat16), ((36, 8, 8, 8320, 128), jnp.bfloat16),
              ((36, 8, 8, 8320, 128), jnp.bfloat16), ((8,), jnp.int32), ((8, 64, 64), jnp.bool_)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    fn = lambda *a: _tree_attention_pallas(*a, scale=0.1, layer=35, config=configs.TREE_ATTENTION_CONFIGS[(9, 0)],  # noqa: E731
                                           interpret=False)
    [module] = verified_triton_modules(fn, *args)
    assert "tensor<64x128xi64>" in module


@pytest.mark.parametrize("batch, rows, slots", [(1, 64, 65536), (16, 1024, 1024), (3, 20, 300)])
def test_plan_covers_the_cache(batch, rows, slots):
    plan = _plan(batch, 8, rows, 16, slots, configs.tree_attention_config((9, 0)))
    assert plan.num_splits * plan.chunk >= slots > (plan.num_splits - 1) * plan.chunk
    assert plan.rows_pad % plan.block_m == 0 and plan.rows_pad >= rows


def split_ranges(plan, length, split_by_length, block_k=64):
    """Each split's key blocks ``[lo, hi)`` (`_split_blocks`) as Python ints."""
    prefix = jnp.int32(-(-length // block_k))
    return [tuple(int(x) for x in _split_blocks(jnp.int32(j), prefix, plan, block_k, split_by_length))
            for j in range(plan.num_splits)]


def busy(ranges):
    """(most blocks a split, splits with a block)."""
    sizes = [max(hi - lo, 0) for lo, hi in ranges]
    return max(sizes), sum(size > 0 for size in sizes)


@pytest.mark.parametrize("length, most, filled", [(0, 1, 1), (1, 1, 2), (64, 1, 2), (65, 1, 3), (1000, 1, 17),
                                                  (1024, 1, 17), (4000, 3, 22), (5122, 4, 21)])
def test_splits_by_length(length, most, filled):
    """Without a bound on the splits, a 5,122-slot cache at batch 1 is cut into 27 splits; cut by length, a 1k
    prefix's 16 key blocks and the tree's one fill 17 splits of one block, and a full cache's 81 + 1 blocks
    21 splits of at most four."""
    unbounded = dataclasses.replace(configs.TREE_ATTENTION_CONFIGS[(9, 0)], max_splits=None)
    plan = _plan(1, 8, 4, 16, 5122, unbounded)
    assert (plan.num_splits, plan.chunk) == (27, 192)
    assert busy(split_ranges(plan, length, True)) == (most, filled)


@given(length=st.integers(0, 700), num_new=st.integers(1, 80), slots_over=st.integers(0, 300),
       splits=st.integers(1, 12), by_length=st.booleans())
@settings(max_examples=200, deadline=None)
def test_split_blocks_cover_the_prefix_then_the_tree(length, num_new, slots_over, splits, by_length):
    """The splits' ranges tile the prefix's blocks then the tree's, in order; by length none holds more
    than its share, by capacity each holds its chunk of the prefix and one of them the whole tree."""
    config = TreeAttentionConfig(block_m=16, block_k=64, min_programs=8 * splits, min_chunk=64)
    plan = _plan(1, 1, 4, num_new, length + num_new + slots_over, config)
    ranges = split_ranges(plan, min(length, length + num_new + slots_over), by_length)
    prefix, tree = -(-length // 64), plan.new_pad // plan.block_t
    total = prefix + tree
    tiles = [(lo, hi) for lo, hi in ranges if hi > lo]
    assert tiles[0][0] == 0 and tiles[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    if by_length:
        assert busy(ranges)[0] == -(-total // plan.num_splits)
    else:
        per = plan.chunk // 64
        assert [(lo, min(hi, prefix)) for lo, hi in tiles] == [
            (j * per, min(j * per + per, prefix)) for j in range(len(tiles))] or prefix == 0
        assert sum(hi > prefix for _, hi in tiles) == 1


@pytest.mark.parametrize("batch, rows, length, splits, most",
                         [(1, 4, 1000, 8, 3), (1, 4, 5122, 8, 11), (1, 4, 64, 8, 1), (8, 4, 1000, 8, 3),
                          (1, 260, 1000, 8, 3), (32, 260, 1000, 1, 17)])
def test_sm90_splits_are_bounded(batch, rows, length, splits, most):
    """The sm_90 entry: at most 8 splits of a 5,122-slot cache, so a 1k prefix and the tree fill 8 splits of
    at most three key blocks at batch 1 as at batch 8, and a batch with enough programs is not split."""
    plan = _plan(batch, 8, rows, 16, 5122, configs.TREE_ATTENTION_CONFIGS[(9, 0)])
    assert plan.num_splits == splits
    assert busy(split_ranges(plan, length, True))[0] == most


def test_split_count_bounds():
    config = TreeAttentionConfig(min_programs=512, min_chunk=128)
    assert split_count(8, 5122, config) == 40 and split_count(600, 5122, config) == 1
    assert split_count(8, 5122, dataclasses.replace(config, max_splits=8)) == 8
    assert split_count(8, 100, dataclasses.replace(config, max_splits=8)) == 1
    with pytest.raises(ValueError, match="max_splits"):
        TreeAttentionConfig(max_splits=0)


@pytest.mark.parametrize("programs, multiprocessors, splits", [
    (8, 132, 8), (16, 132, 8), (24, 132, 5), (64, 132, 8), (192, 132, 2), (16, 114, 7), (24, 114, 8),
    (24, None, 8)])
def test_split_count_in_whole_waves(programs, multiprocessors, splits):
    """Against a brute force over the split counts the other bounds allow: 24 programs (65 tree nodes
    at batch 1) take 5 splits on 132 multiprocessors, one wave of 120 programs rather than two of 192,
    and keep 8 on 114, where 8 and 4 splits both need a quarter wave per split; ``None``
    (multiprocessors unknown) changes nothing."""
    config = TreeAttentionConfig(min_programs=512, min_chunk=128, max_splits=8, whole_waves=True)
    assert split_count(programs, 5122, config, multiprocessors) == splits
    if multiprocessors is not None:
        most = split_count(programs, 5122, dataclasses.replace(config, whole_waves=False))
        costs = {s: -(-programs * s // multiprocessors) / s for s in range(1, most + 1)}
        assert costs[splits] == min(costs.values())
        assert all(costs[s] > costs[splits] for s in range(splits + 1, most + 1))


def test_whole_waves_in_the_sm90_plan():
    """The sm_90 entry: a B = 64 round's verify (65 nodes x 4 query heads, three row blocks) takes 5
    splits on 132 multiprocessors; 64 nodes and one node keep 8."""
    config = configs.TREE_ATTENTION_CONFIGS[(9, 0)]
    assert config.whole_waves
    assert [_plan(1, 8, 4 * n, n, 5122, config, 132).num_splits for n in (1, 64, 65)] == [8, 8, 5]
    assert _plan(1, 8, 4 * 65, 65, 5122, config).num_splits == 8
    assert configs.device_multiprocessors() is None or jax.default_backend() == "gpu"


@pytest.mark.parametrize("platform, count, expected", [("gpu", 132, 132), ("gpu", None, None), ("gpu", 0, None),
                                                       ("gpu", "132", None), ("cpu", 8, None)])
def test_device_multiprocessors_reads_a_gpus_core_count(monkeypatch, platform, count, expected):
    """A CUDA device's ``core_count`` (its SMs) when it is an int >= 1; ``None`` otherwise and off CUDA."""
    device = types.SimpleNamespace(platform=platform, **({} if count is None else {"core_count": count}))
    monkeypatch.setattr(jax, "local_devices", lambda: [device])
    assert configs.device_multiprocessors() == expected


def test_config_lookup():
    assert configs.tree_attention_config((9, 0)) is configs.TREE_ATTENTION_CONFIGS[(9, 0)]
    assert configs.tree_attention_config((8, 9)) is configs.TREE_ATTENTION_CONFIGS[(8, 0)]
    assert configs.tree_attention_config((12, 1)) is configs.TREE_ATTENTION_CONFIGS[(12, 0)]
    assert not configs.TREE_ATTENTION_CONFIGS[(10, 0)].measured
    hopper = configs.TREE_ATTENTION_CONFIGS[(9, 0)]
    assert hopper.launch_warps(hopper.block_m) == hopper.num_warps
    assert hopper.launch_warps(16) == 4
    with pytest.raises(ValueError, match="block_k"):
        TreeAttentionConfig(block_k=48)


def test_launch_stages_fit_shared_memory():
    hopper = configs.TREE_ATTENTION_CONFIGS[(9, 0)]
    # bf16 at the full tiling fits; float32 at 128 rows and head_dim 128 needs 262 KB at 3
    # stages (the H200 refused 246 KB) and fits at 2.
    assert hopper.launch_stages(128, 128, 2) == hopper.num_stages == 3
    assert hopper.launch_stages(128, 128, 4) == 2
    assert hopper.launch_stages(64, 64, 4) == 3
    small = TreeAttentionConfig(block_m=64, block_k=64, num_stages=4, smem_bytes=1)
    assert small.launch_stages(64, 128, 4) == 1


def test_benchmark_sweep_configs():
    """`experiments/bench_kernels.py --sweep-configs`: left-out fields keep the table entry's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_kernels import SWEEP_CONFIGS, sweep_config

    base = configs.tree_attention_config()
    assert sweep_config("m64k128w4s2c1024") == TreeAttentionConfig(
        block_m=64, block_k=128, num_warps=4, num_stages=2, min_programs=base.min_programs,
        min_chunk=1024, smem_bytes=base.smem_bytes, measured=base.measured)
    assert sweep_config("p528").min_programs == 528 and sweep_config("j4").max_splits == 4
    assert sweep_config("m128l1").split_by_length is True and sweep_config("l0").split_by_length is False
    assert sweep_config("j8v1").whole_waves is True and sweep_config("v0").whole_waves is False
    assert all(isinstance(sweep_config(name), TreeAttentionConfig) for name in SWEEP_CONFIGS)
    for bad in ("m64x3", "fast", "", "l2", "v3"):
        with pytest.raises(SystemExit, match="sweep-configs"):
            sweep_config(bad)
    with pytest.raises(ValueError, match="block_m"):
        sweep_config("m48")


def test_benchmark_times_every_implementation_in_each_round():
    """`bench_kernels.py attention` on a tiny shape through the interpreter: a row per shape with
    both paths' times, one per round, and the median ratio against the XLA path."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_kernels import bench_attention

    impls = {"pallas": lambda *a: tree_attention(*a, scale=0.1, interpret=True, config=SMALL),
             "xla": lambda *a: tree_attention_reference(*a, scale=0.1)}
    [row] = bench_attention([(1, 4, 16, 48)], impls, peak_gbs=1.0, budget_s=60.0, report=lambda r: None,
                            chain=2, repeats=3)
    assert all(len(row[name]["rounds_ms"]) == 3 and row[name]["ms"] > 0 for name in impls)
    assert (row["slots"], row["bytes"]) == (48, 2 * 8 * 20 * 128 * 2 + 2 * 4 * 32 * 128 * 2)
    ratios = np.divide(row["xla"]["rounds_ms"], row["pallas"]["rounds_ms"])
    assert row["pallas_speedup"] == pytest.approx(float(np.median(ratios)))
    assert "xla_speedup" not in row


def test_benchmark_times_a_baseline_attention_module(tmp_path):
    """`bench_kernels.py attention --baseline-module`: that file's ``tree_attention`` joins the implementations
    as ``baseline`` with the local table entry, and is timed in the same rounds (interpreted, tiny)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments.bench_kernels import attention_impls, bench_attention

    path = tmp_path / "old_tree_attention.py"
    path.write_text(Path(tree_attention.__code__.co_filename).read_text())
    args = types.SimpleNamespace(impls=["xla"], sweep_configs="m64k64w4s3", baseline_module=str(path))
    for part, names in (("attention", {"xla", "baseline"}), ("sweep", {"m64k64w4s3", "baseline"})):
        impls = attention_impls(part, args, 0.1)
        assert set(impls) == names
        assert impls["baseline"].func.__module__ == "tree_attention_baseline"
        assert impls["baseline"].keywords == dict(scale=0.1, config=configs.tree_attention_config())
    baseline = impls["baseline"].func
    impls = {"baseline": lambda *a: baseline(*a, scale=0.1, interpret=True, config=SMALL),
             "xla": lambda *a: tree_attention_reference(*a, scale=0.1)}
    [row] = bench_attention([(1, 4, 16, 48)], impls, peak_gbs=1.0, budget_s=60.0, report=lambda r: None,
                            chain=2, repeats=2)
    assert all(len(row[name]["rounds_ms"]) == 2 for name in impls)


def test_merge_of_normalized_splits_equals_the_merge_of_raw_ones():
    """Outputs divided by their own sums (0 for a split that saw no key), merged with their maxima and sums,
    equal `merge_splits` of the raw outputs; in bfloat16 within its rounding."""
    keys = jax.random.split(jax.random.key(0), 3)
    o = jax.random.normal(keys[0], (2, 5, 3, 8))
    m = (jax.random.normal(keys[1], (2, 5, 3)) * 4).at[:, 2].set(-1e30)  # an empty split
    l_ = (jax.random.uniform(keys[2], (2, 5, 3)) * 9 + 0.5).at[:, 2].set(0.0)
    o = o.at[:, 2].set(0.0)
    normalized = o / jnp.where(l_ > 0, l_, 1.0)[..., None]
    want = np.asarray(merge_splits(o, m, l_))
    np.testing.assert_allclose(np.asarray(merge_normalized_splits(normalized, m, l_)), want, rtol=1e-5, atol=1e-6)
    half = merge_normalized_splits(normalized.astype(jnp.bfloat16), m, l_)
    assert half.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(half), want, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(merge_normalized_splits(normalized, m.at[:].set(-1e30),
                                                                     jnp.zeros_like(l_))), 0.0)
