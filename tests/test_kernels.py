"""The dispatch module: which implementation each switch picks, on the CPU and on a (pretended) GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import kernels
from pallas_kernels import configs
from pallas_kernels.tree_attention_reference import tree_attention_reference
from test_pallas_tree_attention import make_inputs


def _args(head_dim=16, dtype=jnp.float32):
    return make_inputs(1, batch=1, num_q=4, heads=2, kv_heads=1, head_dim=head_dim, slots=20, lengths=[8],
                       dtype=dtype)


@pytest.fixture
def hopper(monkeypatch):
    """Pretend to be on an sm_90 GPU; the Triton kernel records its config instead of running."""
    calls = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))

    def fake_kernel(*args, config=None, interpret=False, **kw):
        calls.append((config, interpret))
        return "triton"

    monkeypatch.setattr(kernels, "tree_attention", fake_kernel)
    return calls


def test_auto_attention_is_the_reference_on_cpu():
    assert kernels.attention_fn("auto") is tree_attention_reference
    assert kernels.attention_fn("xla") is tree_attention_reference
    assert not kernels.pallas_gpu()


def test_auto_attention_on_hopper_is_the_triton_kernel_with_the_sm90_config(hopper):
    assert kernels.pallas_gpu()
    assert kernels.attention_fn("auto")(*_args(), scale=0.2) == "triton"
    assert hopper == [(configs.TREE_ATTENTION_CONFIGS[(9, 0)], False)]


def test_auto_attention_falls_back_where_the_kernel_does_not_apply(hopper):
    args = _args(head_dim=24)
    out = kernels.attention_fn("auto")(*args, scale=0.2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tree_attention_reference(*args, scale=0.2)))
    assert hopper == []


def test_interpret_uses_the_portable_config(hopper):
    assert kernels.attention_fn("interpret")(*_args(), scale=0.2) == "triton"
    assert hopper == [(configs.TREE_ATTENTION_CONFIGS[(8, 0)], True)]


def test_interpreted_kernel_equals_the_reference():
    args = _args()
    out = kernels.attention_fn("interpret")(*args, scale=0.2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(tree_attention_reference(*args, scale=0.2)), atol=2e-5)


@pytest.mark.parametrize("impl", ["cuda", "triton", "", None])
def test_unknown_impl_names_the_switch(impl):
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        kernels.attention_fn(impl)


def test_auto_matmul_is_xla_with_few_rows_padded_on_hopper(hopper, monkeypatch):
    from ddtree_jax.sharding import make_mesh
    from pallas_kernels.matmul_reference import matmul_reference

    assert kernels.matmul_fn("xla") is matmul_reference
    assert kernels.matmul_fn("auto", make_mesh(1, 1)) is matmul_reference  # a mesh: XLA partitions it as it is
    shapes = []
    monkeypatch.setattr(kernels, "matmul_reference", lambda x, w, **kw: shapes.append(x.shape) or x @ w)
    product = kernels.matmul_fn("auto")
    x, w = jnp.ones((1, 8)), jnp.ones((8, 3))
    assert product(x, w).shape == (1, 3) and shapes == [(kernels.XLA_MIN_ROWS[(9, 0)], 8)]
    monkeypatch.setattr(configs, "device_capability", lambda: (8, 0))  # no measured padding: as it is
    shapes.clear()
    kernels.matmul_fn("auto")(x, w)
    assert shapes == [(1, 8)]


@pytest.mark.parametrize("m", [1, 5, 16, 23])
@pytest.mark.parametrize("norm, gated, residual, columns", [(False, False, False, None), (True, True, False, None),
                                                            (True, False, True, (4, 20)), (False, True, True, None)])
def test_rows_padded_gives_the_products_of_the_rows(m, norm, gated, residual, columns):
    """Zero rows appended before the product and cut after it change none of the real rows (up to float32
    rounding: the CPU code of a 16-row product may sum in another order than that of one row)."""
    from pallas_kernels.matmul_reference import matmul_reference

    keys = jax.random.split(jax.random.key(m), 4)
    k, n = 24, 32
    n_out = (n if columns is None else columns[1] - columns[0]) // (2 if gated else 1)
    kwargs = dict(gated=gated, columns=columns, norm_K=1 + 0.1 * jax.random.normal(keys[2], (k,)) if norm else None,
                  residual_MN=jax.random.normal(keys[3], (m, n_out)) if residual else None)
    x, w = jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (k, n))
    want = np.asarray(matmul_reference(x, w, **kwargs))
    got = np.asarray(kernels.rows_padded(matmul_reference, 16)(x, w, **kwargs))
    assert got.shape == want.shape == (m, n_out)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_matmul_kernel_refuses_a_mesh():
    from ddtree_jax.sharding import make_mesh

    with pytest.raises(ValueError, match="does not run under a mesh"):
        kernels.matmul_fn("pallas", make_mesh(1, 1))
    with pytest.raises(ValueError, match="matmul_impl must be one of"):
        kernels.matmul_fn("triton")


def test_auto_sampler_is_the_fused_kernel_only_on_a_gpu_without_a_mesh(monkeypatch):
    from ddtree_jax.sharding import make_mesh
    from ddtree_jax.verify import verify_from_coins

    assert kernels.sampler_fn("xla") is verify_from_coins
    assert kernels.sampler_fn("auto") is verify_from_coins  # off a CUDA GPU
    assert kernels.sampler_fn("pallas") is not verify_from_coins
    assert kernels.sampler_fn("interpret") is not verify_from_coins
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))
    assert kernels.sampler_fn("auto") is not verify_from_coins
    assert kernels.sampler_fn("auto", make_mesh(tp=1, dp=1)) is verify_from_coins
    with pytest.raises(ValueError, match="sampler_impl must be one of"):
        kernels.sampler_fn("triton")


def _rope_args(head_dim=16):
    from pallas_kernels.qk_norm_rope_reference import rope_tables
    qkv = jax.random.normal(jax.random.key(0), (2, 3, 8 * head_dim))
    tables = rope_tables(jnp.arange(6).reshape(2, 3), head_dim, 10000.0)
    return (qkv, 1.0 + jnp.arange(head_dim) / head_dim, 1.0 - jnp.arange(head_dim) / (2 * head_dim), *tables)


def test_qk_norm_rope_follows_the_attention_switch(monkeypatch):
    from pallas_kernels.qk_norm_rope_reference import qk_norm_rope_reference
    assert kernels.qk_norm_rope_fn("auto") is qk_norm_rope_reference
    assert kernels.qk_norm_rope_fn("xla") is qk_norm_rope_reference
    from ddtree_jax.sharding import make_mesh
    assert kernels.qk_norm_rope_fn("interpret", make_mesh(1, 1)) is qk_norm_rope_reference
    calls = []
    monkeypatch.setattr(kernels, "qk_norm_rope", lambda *a, interpret, **kw: calls.append(interpret) or "triton")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))
    kwargs = dict(heads=4, kv_heads=2, eps=1e-6)
    assert kernels.qk_norm_rope_fn("auto") is qk_norm_rope_reference  # measured: not faster on an H200
    assert kernels.qk_norm_rope_fn("pallas")(*_rope_args(), **kwargs) == "triton"
    assert calls == [False]
    args = _rope_args(head_dim=24)  # head_dim / 2 = 12: not a power of two, so the reference
    out = kernels.qk_norm_rope_fn("pallas")(*args, **kwargs)
    for got, want in zip(out, qk_norm_rope_reference(*args, **kwargs), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert calls == [False]
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        kernels.qk_norm_rope_fn("cuda")


def test_interpreted_qk_norm_rope_equals_the_reference():
    from pallas_kernels.qk_norm_rope_reference import qk_norm_rope_reference
    kwargs = dict(heads=4, kv_heads=2, eps=1e-6)
    for got, want in zip(kernels.qk_norm_rope_fn("interpret")(*_rope_args(), **kwargs),
                         qk_norm_rope_reference(*_rope_args(), **kwargs), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_qk_norm_rope_write_follows_the_attention_switch(monkeypatch):
    """Off a GPU (and for ``xla``, or under a mesh) the norms and RoPE then the K/V write of the same
    switch, equal to the reference; the fused kernel for ``pallas``/``interpret`` and ``auto`` on a GPU,
    where both kernels apply."""
    from ddtree_jax.sharding import make_mesh
    from pallas_kernels.qk_norm_rope_reference import qk_norm_rope_write_reference
    caches = [jnp.zeros((2, 2, 2, 6, 16)), jnp.ones((2, 2, 2, 6, 16))]
    args = (*_rope_args(), *caches, jnp.asarray([4, 0], jnp.int32))
    kwargs = dict(layer=1, heads=4, kv_heads=2, eps=1e-6)
    want = qk_norm_rope_write_reference(*args, **kwargs)
    for impl, mesh in (("auto", None), ("xla", None), ("interpret", make_mesh(1, 1)), ("interpret", None)):
        for got, ref in zip(kernels.qk_norm_rope_write_fn(impl, mesh)(*args, **kwargs), want, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=2e-6)
    calls = []
    monkeypatch.setattr(kernels, "qk_norm_rope_write", lambda *a, interpret, **kw: calls.append(interpret) or "fused")
    assert kernels.qk_norm_rope_write_fn("interpret")(*args, **kwargs) == "fused"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))
    assert kernels.qk_norm_rope_write_fn("auto")(*args, **kwargs) == "fused"
    assert calls == [True, False]
    odd = (*_rope_args(head_dim=24), *(jnp.zeros((2, 2, 2, 6, 24)) for _ in range(2)), jnp.asarray([4, 0], jnp.int32))
    assert kernels.qk_norm_rope_write_fn("pallas")(*odd, **kwargs) != "fused"  # head_dim / 2 = 12: separately
    assert calls == [True, False]


def _draft_logits(batch=3, depth=5, vocab=40, seed=0):
    """Draft logits with exact ties (values on a coarse grid) and a certain depth (one huge logit)."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(-3, 3, (batch, depth, vocab)).astype(np.float32)
    logits[:, 1, :] = -50.0
    logits[:, 1, 7] = 50.0  # probability 1 in float32: entries of different depths tie
    return jnp.asarray(logits), jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)


@pytest.mark.parametrize("budget, topk_cap", [(8, None), (16, 4), (4, 1), (2, None), (64, None), (100, 8)])
def test_interpreted_tree_build_equals_the_xla_build(budget, topk_cap):
    """The kernels' tree (the wide build's past budget 64), the root prepended by `tree.tree_from_nodes`, is
    the XLA build's, leaf for leaf."""
    from ddtree_jax.tree import build_tree_unchecked
    logits, roots = _draft_logits()
    want = build_tree_unchecked(logits, roots, 0.7, budget=budget, topk_cap=topk_cap)
    got = kernels.tree_build_fn("interpret")(logits, roots, 0.7, budget=budget, topk_cap=topk_cap)
    assert got.max_depth == want.max_depth
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tree_build_dispatch(monkeypatch):
    """XLA off a GPU, for ``xla`` and under a mesh; on a GPU the one-program kernel up to budget 32 and
    the wide build beyond, for ``interpret``/``pallas``, and for ``auto`` at batch 1; ``auto`` for batches
    of several requests: the wide build up to budget 128, XLA beyond."""
    from ddtree_jax.sharding import make_mesh
    from ddtree_jax.tree import build_tree_unchecked
    assert kernels.tree_build_fn("auto") is build_tree_unchecked
    assert kernels.tree_build_fn("xla") is build_tree_unchecked
    assert kernels.tree_build_fn("interpret", make_mesh(1, 1)) is build_tree_unchecked
    with pytest.raises(ValueError, match="build_impl"):
        kernels.tree_build_fn("cuda")
    calls = []

    wide_calls = []

    def fake(log):
        def nodes(lp_BLK, tok_BLK, *, budget, interpret):  # empty trees
            log.append((budget, lp_BLK.shape[2], interpret))
            batch = lp_BLK.shape[0]
            return (jnp.zeros((batch, budget), jnp.int32), jnp.full((batch, budget), -1, jnp.int32),
                    jnp.zeros((batch, budget), jnp.int32), jnp.full((batch, budget), -jnp.inf))
        return nodes

    monkeypatch.setattr(kernels, "tree_nodes", fake(calls))
    monkeypatch.setattr(kernels, "tree_nodes_wide", fake(wide_calls))
    logits, roots = _draft_logits()
    assert logits.shape[0] > 1
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))
    auto, pallas = kernels.tree_build_fn("auto"), kernels.tree_build_fn("pallas")
    tree = auto(logits, roots, 1.0, budget=16, topk_cap=4)
    assert calls == [(16, 4, False)]
    np.testing.assert_array_equal(np.asarray(tree.num_nodes), 1)  # the fake's empty trees, the root prepended
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 0]), np.asarray(roots))
    for build in (auto, pallas):
        jax.block_until_ready(build(logits, roots, 1.0, budget=1, topk_cap=None))  # one draft: XLA
    assert len(calls) == 1 and not wide_calls
    auto(logits, roots, 1.0, budget=64, topk_cap=4)  # a batch past 32: the wide build up to 128
    auto(logits, roots, 1.0, budget=128, topk_cap=4)
    assert wide_calls == [(64, 4, False), (128, 4, False)]
    jax.block_until_ready(auto(logits, roots, 1.0, budget=129, topk_cap=4))  # a batch past 128: XLA
    assert len(wide_calls) == 2 and len(calls) == 1
    pallas(logits, roots, 1.0, budget=129, topk_cap=4)  # pallas: the wide build at any batch
    assert wide_calls[-1] == (129, 4, False)
    auto(logits[:1], roots[:1], 1.0, budget=512, topk_cap=None)  # one request: the wide build at any budget
    assert wide_calls[-1] == (512, 40, False) and len(calls) == 1
    pallas(logits, roots, 1.0, budget=15, topk_cap=4)
    assert calls[-1] == (15, 4, False)
    for build in (auto, pallas):  # budget 32: the one-program kernel at any batch
        build(logits, roots, 1.0, budget=32, topk_cap=4)
    assert calls[-2:] == [(32, 4, False)] * 2 and len(wide_calls) == 4
    auto(logits[:1], roots[:1], 1.0, budget=33, topk_cap=4)  # past 32: the wide build
    assert wide_calls[-1] == (33, 4, False) and len(calls) == 4
