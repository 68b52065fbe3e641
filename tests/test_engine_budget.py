"""Budget policies in generate(): lossless greedy decoding, the target law when sampling, fixed
behaviour where the policies must reduce to it, the coin streams, and bad input."""

import jax
import numpy as np
import pytest
from test_engine import DDTREE, PROMPTS, chi2_pvalue, exact_ar_law, greedy_ar, tiny_pair

from ddtree_jax import costs
from ddtree_jax.budget import BATCH_SPREAD
from ddtree_jax.engine import generate

# A steep cost (every draft adds 6% to a round) so that "adaptive" drops nodes on these tiny pairs.
STEEP = costs.CostTable("test", (costs.CostCurve(batch=1, context=1, nodes=(0, 100), round_ms=(1.0, 7.0)),))
# Milder (1.3% per draft): the sampled-law test's pair keeps 9 of 13 nodes for one prompt, all for the other.
MILD = costs.CostTable("test", (costs.CostCurve(batch=1, context=1, nodes=(0, 100), round_ms=(1.0, 2.3)),))


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("policy,budget,cap", [("adaptive", 16, None), ("adaptive", 8, 2), ("batch", 4, None),
                                               ("batch", 16, 4)])
def test_greedy_reproduces_ar_under_every_policy(policy, budget, cap, moe):
    target, drafter = tiny_pair(vocab=8, moe=moe)
    ar = greedy_ar(moe)
    res = generate(target, drafter, PROMPTS, budget=budget, topk_cap=cap, max_new_tokens=24, budget_policy=policy,
                   cost_table=STEEP)
    np.testing.assert_array_equal(res.tokens, ar.tokens)
    sizes = np.stack([r.tree_size for r in res.rounds])
    live = np.stack([r.accepted for r in res.rounds]) >= 0
    if policy == "adaptive":
        assert sizes.max() <= budget + 1 and sizes[live].mean() < budget + 1  # the steep cost dropped nodes
    else:  # one total of `budget` drafts per live request, shared unevenly
        assert np.all(np.where(live, sizes - 1, 0).sum(1) <= budget * live.sum(1))
        assert sizes.max() > budget + 1 and sizes.max() <= BATCH_SPREAD * budget + 1


def test_adaptive_with_the_flat_cost_of_a_cpu_is_fixed():
    """No cost table for this device: the flat cost keeps every node, so adaptive = fixed (the same
    tokens, greedy and sampled, and the same trees)."""
    assert costs.resolve(None).flat
    target, drafter = tiny_pair(vocab=8)
    kw = dict(DDTREE, key=jax.random.key(2), temperature=np.array([0.0, 1.0, 0.7, 1.3]),
              top_p=np.array([1.0, 1.0, 0.8, 1.0]))
    fixed = generate(target, drafter, PROMPTS, **kw)
    adaptive = generate(target, drafter, PROMPTS, budget_policy="adaptive", **kw)
    np.testing.assert_array_equal(adaptive.tokens, fixed.tokens)
    np.testing.assert_array_equal(np.stack([r.tree_size for r in adaptive.rounds]),
                                  np.stack([r.tree_size for r in fixed.rounds]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch_policy_alone_is_fixed_with_the_same_coins(temperature):
    """A request alone takes the whole total: the first `budget` nodes of its larger tree, which are the
    fixed tree; its coins are those of the fixed policy (node k's coin does not depend on the number of
    slots), so even sampled tokens are equal."""
    target, drafter = tiny_pair(vocab=8, seed=3)
    for b, prompt in enumerate(PROMPTS):
        kw = dict(budget=6, topk_cap=None, max_new_tokens=14, temperature=temperature, key=jax.random.key(9),
                  request_ids=[40 + b], max_len=64)
        fixed = generate(target, drafter, [prompt], **kw)
        alone = generate(target, drafter, [prompt], budget_policy="batch", **kw)
        np.testing.assert_array_equal(alone.tokens, fixed.tokens)


def test_adaptive_request_does_not_depend_on_the_batch():
    target, drafter = tiny_pair(vocab=8)
    kw = dict(budget=8, topk_cap=2, max_new_tokens=24, key=jax.random.key(3), budget_policy="adaptive",
              cost_table=STEEP)  # the greedy test's program
    temps = np.array([1.0, 0.0, 0.5, 1.3], np.float32)
    batch = generate(target, drafter, PROMPTS, temperature=temps, request_ids=np.arange(4) + 7, **kw)
    for b in (0, 3):  # one cache size for both (one compiled round), not the batch's (46 slots)
        alone = generate(target, drafter, [PROMPTS[b]], temperature=temps[b], request_ids=[7 + b], max_len=64, **kw)
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b])


@pytest.mark.slow
@pytest.mark.parametrize("policy,budget", [("adaptive", 12), ("batch", 8)])  # "batch": trees of 4 x 8 slots
def test_sampling_has_the_ar_law_of_three_tokens_under_each_policy(policy, budget):
    """As the fixed policy's test in test_engine.py; "batch" mixes two prompts so that the allotment
    differs between requests, and each prompt's samples are tested against its own law."""
    vocab, samples, prompts, t = 6, 8000, ([1, 4, 2], [2, 5]), 1.0
    target, drafter = tiny_pair(vocab=vocab, seed=3)
    batch = [prompts[i % 2] for i in range(samples)]
    res = generate(target, drafter, batch, method="ddtree", budget=budget, topk_cap=None, temperature=t,
                   max_new_tokens=3, key=jax.random.key(7), with_expected=False, budget_policy=policy,
                   cost_table=MILD)
    assert res.tau > 1.2  # drafts were accepted
    sizes = np.stack([r.tree_size for r in res.rounds])
    assert (sizes.max() > budget + 1) if policy == "batch" else (sizes[0].mean() < budget + 1)
    for i, prompt in enumerate(prompts):
        first3 = res.tokens[i::2, :3]
        assert chi2_pvalue(first3, exact_ar_law(target, prompt, t, 0, 1.0, 3, vocab)) > 1e-3
        assert chi2_pvalue(first3, exact_ar_law(target, prompt, t * 1.5, 0, 1.0, 3, vocab)) < 1e-6


@pytest.mark.parametrize("kwargs,message", [
    (dict(budget_policy="global"), "budget_policy must be one of"),
    (dict(budget_policy="adaptive", method="chain"), "needs method 'ddtree'"),
    (dict(budget_policy="batch", method="ar"), "needs method 'ddtree'"),
    (dict(budget_policy="batch", budget=32768 // BATCH_SPREAD + 1), "budget"),
    (dict(budget_policy="adaptive", cost_table="/nonexistent.json"), "neither a file nor a shipped table"),
    (dict(cost_table="/nonexistent.json"), "neither a file nor a shipped table"),  # unused by "fixed", still checked
    # A falling last segment extrapolates to negative round times past its last point.
    (dict(budget_policy="adaptive", cost_table=costs.CostTable("test", (costs.CostCurve(1, 1, (1, 2), (5.0, 1.0)),))),
     r"cost_ms must be 5 finite times > 0"),
])
def test_bad_policy_arguments_get_a_clear_error(kwargs, message):
    target, drafter = tiny_pair(vocab=8)
    args = dict(method="ddtree", budget=4, max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(target, drafter, [[1, 2, 3]], **args)
