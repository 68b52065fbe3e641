"""Argument validation for the public API.

Every public function validates what it can *before* tracing: ranks, shapes, dtypes and scalar
ranges always; data-dependent properties (finite logits, token ids in range, ...) only when the
arrays are concrete (an eager call), because a traced value has no data yet. Under an outer
``jax.jit`` the data checks are therefore skipped; the engine runs its own checks around its jitted
round instead. Every failure is a ``ValueError`` that names the argument and the offending value.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True when ``x`` holds data (a NumPy/JAX array or a Python number), not a tracer."""
    return not isinstance(x, jax.core.Tracer)


def as_array(x):
    """``x`` itself if it is an array (NumPy, JAX or a tracer), else ``np.asarray(x)`` (nested lists of
    numbers): what the checks read shapes and dtypes of, and what a jitted function can take."""
    return x if hasattr(x, "dtype") and hasattr(x, "shape") else np.asarray(x)


def array(name: str, x, *, ndim: int, kind: str) -> jax.Array | np.ndarray:
    """Check rank and dtype kind (``"int"`` or ``"float"``) of an array argument."""
    x = as_array(x)
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
    try:
        ok = np.ndim(value) == 0 and bool(np.isfinite(value)) and value > 0
    except TypeError:  # not a number
        ok = False
    if not ok:
        raise ValueError(f"draft_temperature must be a finite number > 0, got {value!r}")


def per_request(name: str, value, batch: int, dtype) -> jax.Array:
    """Broadcast a scalar or ``[batch]`` sampling parameter to a ``[batch]`` array of ``dtype``."""
    shape = np.shape(value)
    if shape not in ((), (batch,)):
        raise ValueError(f"{name} must be a scalar or have shape ({batch},), got shape {shape}")
    if is_concrete(value):
        host = np.asarray(value)
        if host.dtype.kind not in "biuf":
            raise ValueError(f"{name} must be a number or numbers, got {value!r}")
        if jnp.issubdtype(dtype, jnp.integer) and not np.all(np.equal(np.mod(host, 1), 0)):
            raise ValueError(f"{name} must hold integers, got {host.tolist()}")
    return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def _bad(name: str, host: np.ndarray, ok: np.ndarray, rule: str, verb: str = "be") -> None:
    if not np.all(ok):
        bad = host[~ok].ravel()[:4].tolist()
        raise ValueError(f"{name} must {verb} {rule}, got {bad[0] if host.ndim == 0 else bad}")


def non_negative(name: str, x, rule: str = ">= 0") -> None:
    """Raise, naming ``name`` and up to four of its entries below zero, when a concrete array has one."""
    if is_concrete(x):
        host = np.asarray(x)
        _bad(name, host, host >= 0, rule)


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
    """Raise, naming ``name`` and up to four of the ids, when a concrete integer array holds ids outside
    ``[0, vocab)``."""
    if is_concrete(x):
        host = np.asarray(x)
        _bad(name, host, (host >= 0) & (host < vocab), f"token ids in [0, {vocab})", verb="hold")


def distributions(name: str, x, *, atol: float = 1e-3) -> None:
    """Raise when a concrete ``[..., V]`` array has a row that is not a probability distribution
    (non-finite or outside ``[0, 1]`` entries, or a sum more than ``atol`` away from 1)."""
    if not is_concrete(x):
        return
    host = np.asarray(x, np.float64)
    finite(name, host)
    _bad(name, host, (host >= 0) & (host <= 1), "probabilities in [0, 1]")
    sums = host.sum(-1)
    _bad(f"every row of {name}", sums, np.abs(sums - 1) <= atol, f"a distribution summing to 1 (+- {atol:g})")


def prompt_batch(name: str, prompts) -> None:
    """Raise unless ``prompts`` looks like a batch of token id sequences (``[batch, T]`` or a list of
    lists), naming the usual mistakes: a string, or one flat sequence of ids."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"{name} must be a batch of token id sequences (e.g. [tokenizer.encode(text)]), "
                         f"got the string {prompts[:40]!r}")
    if isinstance(prompts, (np.ndarray, jax.Array)):
        flat = prompts.ndim == 1
    else:
        flat = (isinstance(prompts, Sequence) and len(prompts) > 0
                and all(isinstance(p, numbers.Integral) for p in prompts))
    strings = [i for i, p in enumerate(prompts) if isinstance(p, (str, bytes))] if isinstance(prompts, Sequence) else []
    if strings:
        raise ValueError(f"{name}[{strings[0]}] is a string, not token ids: encode it first (tokenizer.encode)")
    if flat:
        raise ValueError(f"{name} must be a batch of token id sequences, got one flat sequence of ids "
                         f"{[int(p) for p in prompts[:8]]}{' ...' if len(prompts) > 8 else ''}: "
                         "pass [ids] for a single prompt")


def random_key(name: str, key) -> None:
    """Raise unless ``key`` is ``None`` or one ``jax.random`` key: a typed key of shape ``()``
    (``jax.random.key``) or a raw ``uint32[2]`` key (``jax.random.PRNGKey``)."""
    if key is None:
        return
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    raw = isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.shape == (2,)
    if not (typed or raw):
        got = f"an array of shape {tuple(key.shape)} and dtype {key.dtype}" if hasattr(key, "shape") else repr(key)
        raise ValueError(f"{name} must be one jax.random key such as jax.random.key(0), got {got}")


def callback(name: str, fn) -> None:
    """Raise unless ``fn`` is ``None`` or callable."""
    if fn is not None and not callable(fn):
        raise ValueError(f"{name} must be a function or None, got {fn!r}")


def boolean(name: str, value) -> bool:
    """``value`` if it is a bool (NumPy's included), else a ``ValueError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def int_ids(name: str, values, *, low: int, high: int) -> np.ndarray:
    """A sequence or 1-D array of integers in ``[low, high)`` as an int64 ``np.ndarray`` (``[]`` allowed);
    a ``ValueError`` naming ``name`` for a string, a scalar, non-integers or an id out of range."""
    if isinstance(values, (str, bytes)) or np.ndim(values) != 1:
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}")
    host = np.asarray(values)
    if host.size and host.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got {host.tolist()[:8]}")
    host = host.astype(np.int64)
    _bad(name, host, (host >= low) & (host < high), f"integers in [{low}, {high})")
    return host


def flags(args, rules) -> None:
    """Command-line flags: raise naming the first ``--flag`` whose value breaks its rule; ``rules`` holds
    ``(dest, ok(value), rule)`` triples for the attributes of the parsed ``args``."""
    for dest, ok, rule in rules:
        value = getattr(args, dest)
        if not ok(value):
            raise ValueError(f"--{dest.replace('_', '-')} must be {rule}, got {value!r}")
