"""The routed-experts MLP of a Qwen3-MoE layer, token by token."""

import numpy as np


def routed_experts(h_MD, router_DE, gate_up_EDJ, down_EID, *, top_k, normalize):
    """Float64 ``[M, D]``: the routed-experts MLP of a Qwen3-MoE layer, token by token (no
    residual). Router softmax over ``h @ router``; the ``top_k`` most probable experts, ties to
    the smaller id; their probabilities, renormalised to sum 1 when ``normalize``; the output is
    ``sum_e p_e * (silu(g) * u) @ down[e]`` with ``[g | u] = h @ gate_up[e]``."""
    h_MD, router_DE = np.asarray(h_MD, np.float64), np.asarray(router_DE, np.float64)
    gate_up_EDJ, down_EID = np.asarray(gate_up_EDJ, np.float64), np.asarray(down_EID, np.float64)
    out_MD = np.zeros_like(h_MD)
    for m, h_D in enumerate(h_MD):
        logits_E = h_D @ router_DE
        probs_E = np.exp(logits_E - logits_E.max())
        probs_E /= probs_E.sum()
        chosen = sorted(range(len(probs_E)), key=lambda e: (-probs_E[e], e))[:top_k]
        weights = probs_E[chosen] / (probs_E[chosen].sum() if normalize else 1.0)
        for e, weight in zip(chosen, weights):
            gate, up = np.split(h_D @ gate_up_EDJ[e], 2)
            out_MD[m] += weight * ((gate / (1.0 + np.exp(-gate)) * up) @ down_EID[e])
    return out_MD
