"""Acceptance statistics over prompts: per-request tau and bootstrap intervals of pooled ratios."""

from __future__ import annotations

import numpy as np


def per_request_tau(result) -> tuple[np.ndarray, np.ndarray]:
    """Emitted tokens and rounds per request of a ``GenerateResult``, int ``[batch]`` each.

    A request's tau is their ratio: accepted drafts + the bonus token per round it was live.
    """
    accepted = np.stack([r.accepted for r in result.rounds])  # [rounds, B], -1 once finished
    live = accepted >= 0
    return np.where(live, accepted + 1, 0).sum(0), live.sum(0)


def bootstrap_ci(numerator, denominator, *, draws=2000, seed=0) -> tuple[float, float]:
    """95% percentile interval of the pooled ratio ``sum(numerator) / sum(denominator)``.

    ``numerator`` and ``denominator`` are ``[prompts]`` (e.g. emitted tokens and rounds, whose
    pooled ratio is tau); prompts are resampled with replacement ``draws`` times.
    """
    num, den = _resampled_sums([np.asarray(x, np.float64) for x in (numerator, denominator)], draws, seed)
    return _interval(num / den)


def _resampled_sums(arrays: list[np.ndarray], draws: int, seed: int) -> list[np.ndarray]:
    """``[draws]`` sums of each ``[prompts]`` array over the same prompts resampled with replacement."""
    idx = np.random.default_rng(seed).integers(0, len(arrays[0]), size=(draws, len(arrays[0])))
    return [x[idx].sum(1) for x in arrays]


def _interval(values: np.ndarray) -> tuple[float, float]:
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def paired_bootstrap_diff(num_a, den_a, num_b, den_b, *, draws=2000, seed=0) -> tuple[float, float, float]:
    """Difference of pooled ratios ``A - B`` measured on the same prompts, and its 95% interval.

    All four arrays are ``[prompts]``, prompt ``i`` of ``A`` paired with prompt ``i`` of ``B`` (same
    prompt, same coins); the bootstrap resamples prompts jointly, so the shared prompt-to-prompt
    variation cancels. Returns ``(difference, lo, hi)``.
    """
    arrays = _paired(num_a, den_a, num_b, den_b)
    na, da, nb, db = _resampled_sums(arrays, draws, seed)
    diff = arrays[0].sum() / arrays[1].sum() - arrays[2].sum() / arrays[3].sum()
    return (float(diff), *_interval(na / da - nb / db))


def paired_bootstrap_change(num_a, den_a, num_b, den_b, *, draws=2000, seed=0) -> tuple[float, float, float]:
    """Relative change of pooled ratios ``(A / B) - 1`` measured on the same units (prompts, or calls
    of a batch), and its 95% interval, the units resampled jointly as in `paired_bootstrap_diff`."""
    arrays = _paired(num_a, den_a, num_b, den_b)
    na, da, nb, db = _resampled_sums(arrays, draws, seed)
    change = (arrays[0].sum() / arrays[1].sum()) / (arrays[2].sum() / arrays[3].sum()) - 1
    return (float(change), *_interval((na / da) / (nb / db) - 1))


def _paired(*arrays) -> list[np.ndarray]:
    arrays = [np.asarray(x, np.float64) for x in arrays]
    if len({x.shape for x in arrays}) != 1 or arrays[0].ndim != 1:
        raise ValueError(f"need four [prompts] arrays of one shape, got {[x.shape for x in arrays]}")
    return arrays
