"""Argument checks and array coercion shared by the oracle's modules."""

import numpy as np

from ddtree_jax.oracle.types import Tree


def require_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def require_rank(name, array, rank):
    if array.ndim != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {array.shape}")


def require_shape(name, array, shape):
    if array.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {array.shape}")


def per_request(name, value, batch, dtype):
    """A scalar or ``[batch]`` parameter as a ``[batch]`` array."""
    array = np.asarray(value, dtype=dtype)
    if array.ndim == 0:
        return np.full((batch,), array, dtype=dtype)
    require_shape(name, array, (batch,))
    return array


def tree_arrays(tree):
    """The tree's arrays as NumPy (accepts the oracle ``Tree`` or any object with its fields)."""
    return Tree(
        tokens=np.asarray(tree.tokens),
        parents=np.asarray(tree.parents),
        depths=np.asarray(tree.depths),
        logw=np.asarray(tree.logw),
        num_nodes=np.asarray(tree.num_nodes),
    )
