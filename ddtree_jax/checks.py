"""Argument validation for the public API.

Every public function validates what it can *before* tracing: ranks, shapes, dtypes and scalar
ranges always; data-dependent properties (finite logits, token ids in range, ...) only when the
arrays are concrete (an eager call), because a traced value has no data yet. Under an outer
``jax.jit`` the data checks are therefore skipped; the engine runs its own checks around its jitted
round instead. Every failure is a ``ValueError`` that names the argument and the offending value.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True when ``x`` holds data (a NumPy/JAX array or a Python number), not a tracer."""
    return not isinstance(x, jax.core.Tracer)


def array(name: str, x, *, ndim: int, kind: str) -> jax.Array | np.ndarray:
    """Check rank and dtype kind (``"int"`` or ``"float"``) of an array argument."""
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(x.shape)}")
    if kind == "int" and not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")
    if kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    return x


def same_leading(name: str, x, expected: tuple[int, ...]) -> None:
    """Check that ``x.shape`` starts with ``expected``."""
    if tuple(x.shape[: len(expected)]) != tuple(expected):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, expected leading dimensions {tuple(expected)}"
        )


def positive_int(name: str, value, *, minimum: int = 1, maximum: int | None = None) -> int:
    """A Python integer ``>= minimum`` (and ``<= maximum``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def draft_temperature(value) -> None:
    """Raise unless ``value`` is a finite scalar ``> 0`` (the drafter's temperature)."""
    if not (np.ndim(value) == 0 and np.isfinite(value) and value > 0):
        raise ValueError(f"draft_temperature must be a finite number > 0, got {value!r}")


def per_request(name: str, value, batch: int, dtype) -> jax.Array:
    """Broadcast a scalar or ``[batch]`` sampling parameter to a ``[batch]`` array of ``dtype``."""
    shape = np.shape(value)
    if shape not in ((), (batch,)):
        raise ValueError(f"{name} must be a scalar or have shape ({batch},), got shape {shape}")
    if is_concrete(value):
        host = np.asarray(value)
        if jnp.issubdtype(dtype, jnp.integer) and not np.all(np.equal(np.mod(host, 1), 0)):
            raise ValueError(f"{name} must hold integers, got {host.tolist()}")
    return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def _bad(name: str, host: np.ndarray, ok: np.ndarray, rule: str) -> None:
    if not np.all(ok):
        bad = host[~ok].ravel()[:4].tolist()
        raise ValueError(f"{name} must be {rule}, got {bad[0] if host.ndim == 0 else bad}")


def sampling_params(temperature, top_k, top_p, batch: int) -> tuple[jax.Array, ...]:
    """Validate and broadcast ``temperature >= 0``, ``top_k >= 0``, ``0 < top_p <= 1``."""
    t = per_request("temperature", temperature, batch, jnp.float32)
    k = per_request("top_k", top_k, batch, jnp.int32)
    p = per_request("top_p", top_p, batch, jnp.float32)
    if is_concrete(temperature):
        host = np.asarray(temperature, np.float64)
        _bad("temperature", host, np.isfinite(host) & (host >= 0), "finite and >= 0")
    if is_concrete(top_k):
        host = np.asarray(top_k)
        _bad("top_k", host, host >= 0, ">= 0")
    if is_concrete(top_p):
        host = np.asarray(top_p, np.float64)
        _bad("top_p", host, (host > 0) & (host <= 1), "in (0, 1]")
    return t, k, p


def finite(name: str, x) -> None:
    """Raise when a concrete floating array holds NaN or infinity."""
    if is_concrete(x) and not bool(jnp.all(jnp.isfinite(x))):
        raise ValueError(f"{name} contains non-finite values (NaN or infinity)")


def token_range(name: str, x, vocab: int) -> None:
    """Raise when a concrete integer array holds ids outside ``[0, vocab)``."""
    if is_concrete(x):
        host = np.asarray(x)
        if host.size and (host.min() < 0 or host.max() >= vocab):
            bad = host[(host < 0) | (host >= vocab)].ravel()[:4].tolist()
            raise ValueError(f"{name} must hold token ids in [0, {vocab}), got {bad}")
