"""The target law: temperature, top-k and top-p, per request."""

import numpy as np

from ddtree_jax.oracle._checks import per_request


def _descending_order(probs_V, top_k):
    """Token ids by descending probability, ties to the smaller id; only the first ``top_k``
    when ``top_k > 0`` (found without sorting the whole row)."""
    if 0 < top_k < probs_V.size:
        threshold = np.partition(probs_V, probs_V.size - top_k)[probs_V.size - top_k]
        candidates = np.flatnonzero(probs_V >= threshold)
        return candidates[np.argsort(-probs_V[candidates], kind="stable")][:top_k]
    return np.argsort(-probs_V, kind="stable")


def _filtered_row(logits_V, temperature, top_k, top_p):
    """Float64 target distribution of one logits row (see ``target_probs``)."""
    logits_V = np.asarray(logits_V, dtype=np.float64)
    if temperature == 0:
        probs_V = np.zeros_like(logits_V)
        probs_V[np.argmax(logits_V)] = 1.0
        return probs_V
    z = logits_V / temperature
    e = np.exp(z - z.max())
    probs_V = e / e.sum()
    if top_k == 0 and top_p >= 1:
        return probs_V
    order = _descending_order(probs_V, top_k)
    if top_k > 0:
        kept_V = np.zeros_like(probs_V)
        kept_V[order] = probs_V[order]
        probs_V = kept_V / kept_V.sum()
    if top_p < 1:
        sorted_probs = probs_V[order]
        mass_before = np.concatenate([[0.0], np.cumsum(sorted_probs)[:-1]])
        probs_V[order[mass_before >= top_p]] = 0.0
        probs_V /= probs_V.sum()
    return probs_V


def target_probs(logits, temperature, top_k, top_p):
    """Target distributions after temperature, top-k and top-p, per request.

    Args:
      logits: ``[batch, N, V]`` or ``[batch, V]``.
      temperature: ``[batch]`` or scalar, ``>= 0``; ``0`` is greedy (one-hot at the argmax,
        ties to the smallest token id).
      top_k: ``[batch]`` or scalar int ``>= 0``; ``0`` = off.
      top_p: ``[batch]`` or scalar in ``(0, 1]``; ``1`` = off.

    For ``T > 0``: ``p = softmax(logits / T)``; tokens are ordered by descending ``p`` (ties to
    the smaller token id); top-k keeps the first ``top_k`` and renormalises; top-p then keeps
    the tokens whose preceding mass in that order is ``< top_p`` and renormalises. Computed in
    float64, returned as float32 with the shape of ``logits``.
    """
    logits_array = np.asarray(logits)
    if logits_array.ndim not in (2, 3):
        raise ValueError(f"logits must be [batch, N, V] or [batch, V], got {logits_array.shape}")
    batch = logits_array.shape[0]
    logits_BNV = logits_array.reshape(batch, -1, logits_array.shape[-1])
    temperature_B = per_request("temperature", temperature, batch, np.float64)
    top_k_B = per_request("top_k", top_k, batch, np.int64)
    top_p_B = per_request("top_p", top_p, batch, np.float64)
    if not np.all(np.isfinite(temperature_B) & (temperature_B >= 0)):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
    if np.any(top_k_B < 0):
        raise ValueError(f"top_k must be >= 0, got {top_k!r}")
    if not np.all((top_p_B > 0) & (top_p_B <= 1)):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")

    probs_BNV = np.empty(logits_BNV.shape, dtype=np.float32)
    for b in range(batch):
        for n in range(logits_BNV.shape[1]):
            probs_BNV[b, n] = _filtered_row(
                logits_BNV[b, n], temperature_B[b], top_k_B[b], top_p_B[b]
            )
    return probs_BNV.reshape(logits_array.shape)
