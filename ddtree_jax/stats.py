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
    numerator, denominator = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(numerator), size=(draws, len(numerator)))
    ratios = numerator[idx].sum(1) / denominator[idx].sum(1)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))
