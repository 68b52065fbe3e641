"""Statistical exactness of ``verify``: the first two emitted tokens follow the target law.

A synthetic target assigns every prefix its own logits (seeded by the prefix), so the target law of
the first two tokens after the root is ``q(root)(t1) * q(root, t1)(t2)``. Each sample is one request
of a large batch (distinct request ids give independent coins). When a round emits a single token
(the first draft was rejected), the second token is drawn from the target row directly, which is
what the next round would do. A chi-square test compares the counts with the law; the same counts
compared with a deliberately wrong law (another temperature) must be rejected, so the test has
power.
"""

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ddtree_jax import oracle
from ddtree_jax.tree import build_tree
from ddtree_jax.verify import verify

V, L, ROOT, SAMPLES = 5, 3, 2, 20000


def prefix_logits(prefix: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(repr(prefix).encode()))
    return (1.5 * rng.normal(size=V)).astype(np.float32)


def row(prefix, t, k, p) -> np.ndarray:
    q = oracle.target_probs(prefix_logits(prefix)[None], [t], [k], [p])[0].astype(np.float64)
    return q / q.sum()


def path_of(tree, node: int) -> tuple[int, ...]:
    path = []
    while node >= 0:
        path.append(int(tree.tokens[0, node]))
        node = int(tree.parents[0, node])
    return tuple(reversed(path))


def sample_pairs(t, k, p, *, budget, topk_cap, seed):
    draft = np.random.default_rng(seed).normal(size=(1, L, V)).astype(np.float32)
    tree = build_tree(draft, np.array([ROOT]), budget=budget, topk_cap=topk_cap)
    n = tree.tokens.shape[1]
    logits = np.stack([prefix_logits(path_of(tree, j)) for j in range(n)])[None]
    batch = lambda x: jnp.broadcast_to(x, (SAMPLES, *x.shape[1:]))  # noqa: E731
    big = jax.tree_util.tree_map(batch, tree)
    res = verify(big, batch(jnp.asarray(logits)), key=jax.random.key(seed), temperature=t, top_k=k, top_p=p)
    emitted = np.asarray(res.emitted)
    first, second = emitted[:, 0], emitted[:, 1].copy()
    rng = np.random.default_rng(seed + 1)
    for a in np.unique(first[second < 0]):  # all draws after the same first token at once
        redraw = np.flatnonzero((second < 0) & (first == a))
        second[redraw] = rng.choice(V, size=redraw.size, p=row((ROOT, int(a)), t, k, p))
    return first, second


def joint_law(t, k, p) -> np.ndarray:
    q0 = row((ROOT,), t, k, p)
    return np.array([[q0[a] * row((ROOT, a), t, k, p)[b] for b in range(V)] for a in range(V)])


def chi2_pvalue(first, second, law) -> float:
    counts = np.zeros((V, V))
    np.add.at(counts, (first, second), 1)
    expected = law.ravel() * len(first)
    observed = counts.ravel()
    if np.any(observed[expected == 0] > 0):
        return 0.0
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if keep.sum() == 1:  # a degenerate law (e.g. top_k = 1): every sample is in its only cell
        return 1.0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


CONFIGS = [
    # (temperature, top_k, top_p, budget, topk_cap)
    (1.0, 0, 1.0, 8, None),
    (0.5, 0, 1.0, 6, 2),
    (2.0, 0, 1.0, 10, None),
    (1.0, 1, 1.0, 6, 3),
    (1.0, 2, 1.0, 8, 2),
    (1.0, 0, 0.4, 8, None),
    (0.8, 3, 0.7, 12, 4),
    (1.5, 0, 0.9, 4, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("t,k,p,budget,cap", CONFIGS)
def test_first_two_tokens_follow_target_law(t, k, p, budget, cap):
    seed = CONFIGS.index((t, k, p, budget, cap))
    first, second = sample_pairs(t, k, p, budget=budget, topk_cap=cap, seed=seed)
    assert chi2_pvalue(first, second, joint_law(t, k, p)) > 1e-3
    wrong = joint_law(t * 1.6, 0, 1.0)  # another temperature, no filtering
    assert chi2_pvalue(first, second, wrong) < 1e-6


def test_greedy_rows_emit_the_argmax_path():
    first, second = sample_pairs(0.0, 0, 1.0, budget=8, topk_cap=None, seed=11)
    a = int(np.argmax(prefix_logits((ROOT,))))
    b = int(np.argmax(prefix_logits((ROOT, a))))
    assert set(zip(first.tolist(), second.tolist())) == {(a, b)}


def test_joint_law_is_a_distribution():
    for t, k, p in itertools.product([0.5, 1.0], [0, 2], [1.0, 0.5]):
        assert joint_law(t, k, p).sum() == pytest.approx(1.0, abs=1e-9)
