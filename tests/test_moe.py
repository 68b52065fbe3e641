"""The routed-experts MLP (ddtree_jax.models.moe) against the NumPy oracle, expert shards, routing,
and the grouped matmul it is built on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Var
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax import oracle
from ddtree_jax.models import moe
from ddtree_jax.models.layers import LayerShape

SHAPES = st.tuples(st.integers(1, 9), st.integers(2, 12), st.integers(1, 4), st.integers(1, 10))  # M, E, k, I


def operands(tokens, experts, width, seed, dim=8):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(tokens, dim)).astype(np.float32), rng.normal(size=(dim, experts)).astype(np.float32),
            (0.5 * rng.normal(size=(experts, dim, 2 * width))).astype(np.float32),
            (0.5 * rng.normal(size=(experts, width, dim))).astype(np.float32))


@functools.partial(jax.jit, static_argnames=("top_k", "normalize"))
def _routed(h, router, gate_up, down, first, *, top_k, normalize):
    weights, experts = moe.route(h, router, top_k, normalize)
    return moe.grouped_experts(h, weights, experts, gate_up, down, first)


def routed(h, router, gate_up, down, top_k, normalize, first=0):
    """The routed MLP as one jitted program (one compilation per shape, not one per op)."""
    return np.asarray(_routed(h, router, gate_up, down, first, top_k=top_k, normalize=normalize))


@settings(deadline=None, max_examples=40)
@given(SHAPES, st.booleans(), st.integers(0, 2**16))
def test_routed_mlp_matches_the_numpy_oracle(shape, normalize, seed):
    tokens, experts, top_k, width = shape
    top_k = min(top_k, experts)
    h, router, gate_up, down = operands(tokens, experts, width, seed)
    expected = oracle.routed_experts(h, router, gate_up, down, top_k=top_k, normalize=normalize)
    np.testing.assert_allclose(routed(h, router, gate_up, down, top_k, normalize), expected, atol=2e-5, rtol=2e-5)


@settings(deadline=None, max_examples=25)
@given(st.integers(1, 9), st.sampled_from([(8, 2), (8, 4), (6, 3), (4, 4)]), st.integers(1, 4), st.integers(0, 2**16))
def test_expert_shards_add_up_to_all_experts(tokens, experts_and_shards, top_k, seed):
    """What each expert-parallel device computes: the experts it holds, nothing for the others."""
    experts, shards = experts_and_shards
    top_k = min(top_k, experts)
    h, router, gate_up, down = operands(tokens, experts, 3, seed)
    per = experts // shards
    parts = [routed(h, router, gate_up[j * per:(j + 1) * per], down[j * per:(j + 1) * per], top_k, True, j * per)
             for j in range(shards)]
    np.testing.assert_allclose(np.sum(parts, 0), routed(h, router, gate_up, down, top_k, True), atol=1e-5, rtol=1e-5)
    weights, chosen = moe.route(jnp.asarray(h), jnp.asarray(router), top_k, True)
    for j, part in enumerate(parts):  # a shard no token is routed to contributes exactly nothing
        if not np.any((np.asarray(chosen) >= j * per) & (np.asarray(chosen) < (j + 1) * per)):
            assert not np.any(part)


def test_route_picks_the_most_probable_experts_in_order():
    h, router, _, _ = operands(6, 7, 1, seed=0)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(h) @ jnp.asarray(router), axis=-1))
    for normalize in (False, True):
        weights, experts = map(np.asarray, moe.route(jnp.asarray(h), jnp.asarray(router), 3, normalize))
        assert experts.dtype == np.int32 and weights.dtype == np.float32
        np.testing.assert_array_equal(experts, np.argsort(-probs, axis=-1, kind="stable")[:, :3])
        chosen = np.take_along_axis(probs, experts, -1)
        np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True) if normalize else chosen, rtol=1e-6)
        assert np.all(np.diff(weights, axis=-1) <= 0)
    # equal probabilities: ties go to the smaller expert id
    assert np.asarray(moe.route(jnp.ones((1, 4)), jnp.zeros((4, 5)), 2, False)[1]).tolist() == [[0, 1]]


def test_expert_weights_only_enter_two_grouped_matmuls():
    """No dense product over all experts: the stacked expert weights are operands of the two
    grouped matmuls (``ragged_dot``) and of nothing else."""
    shape = LayerShape(8, 16, 2, 1, 4, 1e-6, 1e4, 2, True)
    layer = moe.init_moe_layer(jax.random.key(0), shape, 6, 4, jnp.float32)
    jaxpr = jax.make_jaxpr(lambda lay, x: moe.moe_mlp(lay, x, shape))(layer, jnp.ones((1, 5, 8))).jaxpr
    expert_vars = set(jaxpr.invars[-3:-1])  # the layer's leaves end with router, experts_gate_up, experts_down
    assert [v.aval.shape for v in expert_vars] and {v.aval.shape for v in expert_vars} == {(6, 8, 8), (6, 4, 8)}
    users = [eqn.primitive.name for eqn in jaxpr.eqns
             if any(isinstance(v, Var) and v in expert_vars for v in eqn.invars)]
    assert users == ["ragged_dot_general", "ragged_dot_general"], users


def test_bf16_block_is_close_to_float32():
    shape = LayerShape(8, 16, 2, 1, 4, 1e-6, 1e4, 2, False)
    layer = moe.init_moe_layer(jax.random.key(2), shape, 6, 4, jnp.float32, std=0.5)
    x = jax.random.normal(jax.random.key(3), (2, 5, 8))
    full = moe.moe_mlp(layer, x, shape)
    half = moe.moe_mlp(jax.tree.map(lambda a: a.astype(jnp.bfloat16), layer), x.astype(jnp.bfloat16), shape)
    assert half.dtype == jnp.bfloat16
    assert np.abs(np.asarray(half, np.float32) - full).max() < 0.05 * np.abs(full).max()
    assert np.abs(full - x).max() > 0.1  # the experts changed the residual stream
