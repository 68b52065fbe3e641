"""Engine: lossless greedy decoding, exact sampling at sequence level, batch independence, errors."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ddtree_jax import engine, oracle
from ddtree_jax.engine import generate
from ddtree_jax.tree import build_tree
from ddtree_jax.models import (
    DFlashConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    init_drafter,
    init_target,
    target_logits,
    drafter_forward,
    with_draft_vocab,
)


def tiny_pair(vocab, seed=0, block_size=5, head_dim=8, moe=False):
    """A tiny fp32 target and drafter; a small vocabulary makes trees cover the likely continuations.
    ``moe``: a Qwen3-MoE target (layers 0 and 2 sparse, 8 experts, 2 per token; the drafter taps both)."""
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=head_dim, tie_word_embeddings=True)
    tc = (Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         norm_topk_prob=False, mlp_only_layers=(1,)) if moe else Qwen3Config(**shape))
    dc = DFlashConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, block_size=block_size,
                      target_layer_ids=(0, 2), mask_token_id=vocab - 1, num_target_layers=3)
    target = init_target(tc, jax.random.key(seed), jnp.float32, std=0.4)
    drafter = init_drafter(dc, jax.random.key(seed + 1), jnp.float32, std=0.4)
    return target, drafter


PROMPTS = [[1, 2, 3, 4, 5], [7, 1], [3, 3, 3, 2, 1, 0, 5, 6], [4]]
# The vocab-8 tests decode PROMPTS for 24 tokens and, where the tree does not matter, with DDTree
# budget 16 (cap 4): one shape and spec, so that they share the compiled prefill and rounds.
DDTREE = dict(method="ddtree", budget=16, topk_cap=4, max_new_tokens=24)


@functools.cache
def greedy_ar(moe=False):
    """AR greedy decoding of PROMPTS (24 tokens): the reference of the greedy tests."""
    target, drafter = tiny_pair(vocab=8, moe=moe)
    return generate(target, drafter, PROMPTS, method="ar", max_new_tokens=24)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("method,budget,cap", [("chain", 1, None), ("ddtree", 4, None), ("ddtree", 16, 4),
                                               ("ddtree", 48, None)])
def test_greedy_chain_and_ddtree_reproduce_ar(method, budget, cap, moe):
    target, drafter = tiny_pair(vocab=8, moe=moe)
    ar = greedy_ar(moe)
    spec = generate(target, drafter, PROMPTS, method=method, budget=budget, topk_cap=cap, max_new_tokens=24)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
    np.testing.assert_array_equal(spec.lengths, [24] * len(PROMPTS))
    if budget == 48:
        assert spec.tau > 1.8  # deep paths were accepted and committed
    assert spec.tau >= 1.0 and ar.tau == 1.0


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_matches_full_recomputation(moe):
    """AR greedy equals argmax decoding by recomputing the whole sequence each step (no cache): token i
    is the argmax of the no-cache logits of the prompt and tokens 0 .. i-1, so one causal forward over
    each prompt + its tokens (right-padded to one shape) gives every step's recomputation."""
    target, _ = tiny_pair(vocab=8, moe=moe)
    ar = greedy_ar(moe).tokens
    seqs = [prompt + row.tolist() for prompt, row in zip(PROMPTS, ar)]
    width = max(map(len, seqs))
    logits = np.asarray(target_logits(target, jnp.asarray([seq + [0] * (width - len(seq)) for seq in seqs])))
    for b, prompt in enumerate(PROMPTS):
        np.testing.assert_array_equal(logits[b, len(prompt) - 1 : len(prompt) + 23].argmax(-1), ar[b])


def exact_ar_law(target, prompt, t, k, p, length, vocab):
    """Law of the first ``length`` tokens under AR sampling, by enumerating every prefix."""
    law = {(): 1.0}
    for _ in range(length):
        prefixes = list(law)
        seqs = jnp.asarray([prompt + list(s) for s in prefixes])
        rows = np.asarray(target_logits(target, seqs))[:, -1]
        q = oracle.target_probs(rows, [t] * len(rows), [k] * len(rows), [p] * len(rows)).astype(np.float64)
        q /= q.sum(-1, keepdims=True)
        law = {s + (tok,): law[s] * q[i, tok] for i, s in enumerate(prefixes) for tok in range(vocab)}
    return law


def chi2_pvalue(samples, law):
    cells = sorted(law)
    expected = np.array([law[c] for c in cells]) * len(samples)
    index = {c: i for i, c in enumerate(cells)}
    observed = np.zeros(len(cells))
    for s in map(tuple, samples):
        if law.get(s, 0.0) == 0.0:
            return 0.0
        observed[index[s]] += 1
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("moe,seed", [(False, 3), (True, 4)])  # pairs whose random drafter gets drafts accepted
@pytest.mark.parametrize("t,k,p,budget,cap", [(1.0, 0, 1.0, 12, None), (0.7, 3, 0.9, 8, 2)])
def test_ddtree_sampling_has_the_ar_law_of_three_tokens(t, k, p, budget, cap, moe, seed):
    vocab, samples, prompt = 6, 6000, [1, 4, 2]
    target, drafter = tiny_pair(vocab=vocab, seed=seed, moe=moe)
    res = generate(target, drafter, [prompt] * samples, method="ddtree", budget=budget, topk_cap=cap,
                   temperature=t, top_k=k, top_p=p, max_new_tokens=3, key=jax.random.key(7), with_expected=False)
    assert res.tau > 1.2  # the law is produced by accepted drafts, not only by final draws
    first3 = res.tokens[:, :3]
    assert chi2_pvalue(first3, exact_ar_law(target, prompt, t, k, p, 3, vocab)) > 1e-3
    wrong = exact_ar_law(target, prompt, t * 1.5, k, p, 3, vocab)
    assert chi2_pvalue(first3, wrong) < 1e-6


def test_greedy_ddtree_with_a_draft_vocabulary_reproduces_ar():
    """Drafts from five of the eight tokens: the greedy output is still AR's."""
    target, drafter = tiny_pair(vocab=8)
    small = with_draft_vocab(drafter, target, [0, 2, 3, 5, 6])
    res = generate(target, small, PROMPTS, **DDTREE)
    np.testing.assert_array_equal(res.tokens, greedy_ar().tokens)
    assert res.tau > 1.0


def test_a_round_drafts_from_the_draft_vocabulary_only():
    """The round's tree over a draft vocabulary: its drafted tokens are the draft vocabulary's ids, the tree
    built from the drafter's W columns with those columns read as ids."""
    target, drafter = tiny_pair(vocab=8)
    ids = [0, 2, 3, 5, 6]
    small = with_draft_vocab(drafter, target, ids)
    spec = engine.make_spec(target, small, "ddtree", 12, None)
    prompts, lengths = engine._pad_prompts(PROMPTS, 8)
    state = engine.prefill(target, small, jnp.asarray(prompts), jnp.asarray(lengths), spec=spec, max_len=40,
                           max_new_tokens=8)
    tree, _ = engine._draft_tree(target, small, state, spec, 1.0, None)
    ctx = jnp.zeros(state.ctx_feats.shape[:2], jnp.int32)  # no context to append: ctx_count is 0
    draft_logits, _ = drafter_forward(small, target, state.drafter_cache, state.ctx_feats, ctx, state.ctx_count,
                                      state.root, state.target_cache.lengths)
    want = build_tree(draft_logits, jnp.zeros_like(state.root), budget=12)
    num = np.asarray(tree.num_nodes)
    np.testing.assert_array_equal(num, want.num_nodes)
    for b, n in enumerate(num):
        np.testing.assert_array_equal(tree.tokens[b, 1:n], np.asarray(ids)[np.asarray(want.tokens[b, 1:n])])
    assert num.min() > 1


@pytest.mark.slow
def test_sampling_with_a_draft_vocabulary_has_the_ar_law_of_three_tokens():
    """Drafts from four of the six tokens (the walk still emits the other two) at T = 1: the first three
    tokens have the AR law, and a wrong temperature's law fails."""
    vocab, samples, prompt = 6, 6000, [1, 4, 2]
    target, drafter = tiny_pair(vocab=vocab, seed=3)
    small = with_draft_vocab(drafter, target, [0, 1, 3, 4])
    res = generate(target, small, [prompt] * samples, method="ddtree", budget=12, temperature=1.0,
                   max_new_tokens=3, key=jax.random.key(7), with_expected=False)
    assert res.tau > 1.2
    first3 = res.tokens[:, :3]
    assert chi2_pvalue(first3, exact_ar_law(target, prompt, 1.0, 0, 1.0, 3, vocab)) > 1e-3
    assert chi2_pvalue(first3, exact_ar_law(target, prompt, 1.5, 0, 1.0, 3, vocab)) < 1e-6


@pytest.mark.parametrize("moe", [False, True])
def test_request_output_does_not_depend_on_the_batch(moe):
    target, drafter = tiny_pair(vocab=8, moe=moe)
    temps = np.array([1.0, 0.0, 1.3, 0.8], np.float32)  # row 1 greedy among sampled rows
    top_k = np.array([0, 0, 0, 2], np.int32)
    top_p = np.array([1.0, 1.0, 0.5, 1.0], np.float32)
    ids = np.arange(100, 104)
    kw = dict(DDTREE, key=jax.random.key(3))
    batch = generate(target, drafter, PROMPTS, temperature=temps, top_k=top_k, top_p=top_p, request_ids=ids, **kw)
    for b in (0, 2, 3):  # one cache size for the three (one compiled round), not the batch's (54 slots)
        alone = generate(target, drafter, [PROMPTS[b]], temperature=temps[b], top_k=top_k[b], top_p=top_p[b],
                         request_ids=ids[b : b + 1], max_len=64, **kw)
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b])


def test_stop_tokens_end_a_request():
    target, drafter = tiny_pair(vocab=8)
    free = generate(target, drafter, PROMPTS, **DDTREE)
    stop = int(free.tokens[0, 3])
    res = generate(target, drafter, PROMPTS, **DDTREE, stop_tokens=[stop])
    for b in range(len(PROMPTS)):
        row = free.tokens[b].tolist()
        end = row.index(stop) + 1 if stop in row else 24
        assert res.lengths[b] == end
        assert res.tokens[b, :end].tolist() == row[:end]
        assert np.all(res.tokens[b, end:] == -1)


@pytest.mark.parametrize("method,budget", [("chain", 1), ("ddtree", 2)])
def test_the_drafter_cache_of_the_default_size_holds_every_round(method, budget):
    """A round writes its context rows and then its block into the drafter's cache; with the default
    ``max_len`` and trees smaller than the block, the last rounds' drafts equal those of a roomier cache
    (a dropped write would change them, and with them the exact expected acceptance; attention over
    caches of two sizes sums in other orders, hence the float tolerance)."""
    target, drafter = tiny_pair(vocab=8, block_size=8)
    runs = [generate(target, drafter, PROMPTS, method=method, budget=budget, max_new_tokens=24, temperature=1.0,
                     max_len=max_len) for max_len in (None, 80)]
    assert len(runs[0].rounds) == len(runs[1].rounds) > 10
    for tight, roomy in zip(runs[0].rounds, runs[1].rounds):
        np.testing.assert_array_equal(tight.accepted, roomy.accepted)
        np.testing.assert_allclose(tight.expected, roomy.expected, rtol=1e-4, atol=1e-7)  # caches of two sizes


def test_statistics_are_consistent():
    target, drafter = tiny_pair(vocab=8)
    res = generate(target, drafter, PROMPTS, **DDTREE, temperature=1.0)
    summary = res.summary()
    assert summary["rounds"] == len(res.rounds) and summary["tokens"] == 24 * len(PROMPTS)
    live = np.stack([r.accepted >= 0 for r in res.rounds])
    assert summary["request_rounds"] == live.sum()
    assert summary["tau"] == pytest.approx(summary["tokens"] / live.sum())  # consistent with the tokens returned
    accepted = np.stack([r.accepted for r in res.rounds])
    assert summary["acceptance_length"] == pytest.approx(np.mean(accepted[live] + 1))
    assert summary["acceptance_length"] >= summary["tau"]  # the last round's tokens past the limit are cut
    assert 1.0 <= summary["tau"] <= drafter.config.block_size
    assert 0.0 <= summary["expected_accepted"] <= 16
    sizes = np.stack([r.tree_size for r in res.rounds])
    assert summary["mean_tree_size"] == pytest.approx(np.mean(sizes[live])) == 17
    emitted = np.stack([r.emitted for r in res.rounds])
    np.testing.assert_array_equal(emitted.sum(0), res.lengths)
    assert np.all(emitted[~live] == 0)
    for r in res.rounds:
        assert np.all(r.tree_size[r.accepted >= 0] == 17)  # cap^L >= budget: full trees


def round_by_round(target, drafter, prompts, *, method, budget, topk_cap, temperature, max_new_tokens, key):
    """The rounds one jitted call at a time, reading the state back after each (no device loop)."""
    spec = engine.make_spec(target, drafter, method, budget, topk_cap)
    drafter = None if method == "ar" else drafter
    batch, length = len(prompts), max(map(len, prompts))
    prompt_BT = jnp.asarray([p + [0] * (length - len(p)) for p in prompts], jnp.int32)
    lengths_B = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state = engine.prefill(target, drafter, prompt_BT, lengths_B, spec=spec,
                           max_len=length + max_new_tokens + spec.depth + spec.num_nodes + 1,
                           max_new_tokens=max_new_tokens)
    full = lambda v, dtype: jnp.full((batch,), v, dtype)  # noqa: E731
    args = (engine.SamplingParams(full(temperature, jnp.float32), full(0, jnp.int32), full(1.0, jnp.float32)), key,
            jnp.arange(batch, dtype=jnp.int32), jnp.float32(1.0), jnp.asarray([-2], jnp.int32))
    while not bool(np.asarray(state.done).all()):
        state, _ = engine.decode_round(target, drafter, state, *args, spec=spec, max_new_tokens=max_new_tokens)
    return np.asarray(state.tokens)[:, :max_new_tokens]


@pytest.mark.parametrize("method,temperature", [("ar", 1.0), ("ddtree", 0.0), ("ddtree", 1.0)])
def test_device_loop_gives_the_tokens_of_the_round_by_round_loop(method, temperature):
    target, drafter = tiny_pair(vocab=8)
    kw = dict(DDTREE, method=method, temperature=temperature, key=jax.random.key(5))
    want = round_by_round(target, drafter, PROMPTS, **kw)
    for chunk in (1, 3, 16):  # 16 (the default) > the rounds left after the first: the loop ends on done
        res = generate(target, drafter, PROMPTS, **kw, chunk_rounds=chunk)
        np.testing.assert_array_equal(res.tokens, want)


def test_streamed_tokens_are_the_returned_tokens_and_stop_at_max_new_tokens():
    target, drafter = tiny_pair(vocab=8)
    seen = []
    res = generate(target, drafter, PROMPTS, **DDTREE, temperature=0.0, chunk_rounds=3,
                   on_round=lambda tokens, generated, round_stats: seen.append((tokens.copy(), generated.copy(),
                                                                                round_stats)),
                   on_compile=lambda: seen.append("compiling"))
    assert seen.pop(0) == "compiling" and len(seen) == len(res.rounds)  # once, before the first round
    for (tokens, generated, round_stats), before in zip(seen, [np.zeros(len(PROMPTS), int)] + [g for _, g, _ in seen]):
        assert np.all(generated <= 24)
        np.testing.assert_array_equal(generated - before, round_stats.emitted)
        for b in range(len(PROMPTS)):
            assert tokens[b, :generated[b]].tolist() == res.tokens[b, :generated[b]].tolist()
            assert np.all(tokens[b, generated[b]:] == -1)
    np.testing.assert_array_equal(seen[-1][1], res.lengths)
    last = res.rounds[-1]  # the case this test is for: a round that accepted more than the limit left
    assert np.any((last.accepted >= 0) & (last.accepted + 1 > last.emitted))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt_ids=[[]]), "non-empty"),
        (dict(prompt_ids=[]), "non-empty"),
        (dict(prompt_ids=[[1, 99]]), "token ids"),
        (dict(method="beam"), "method"),
        (dict(budget=0), "budget"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(draft_temperature=0.0), "draft_temperature"),
        (dict(max_len=8), "max_len"),
        (dict(max_len=10**9), "max_len=1000000000 exceeds the .* slots a request can use"),
        (dict(max_new_tokens=10**6), "max_position_embeddings"),
        (dict(stop_tokens=[50]), "stop_tokens"),
        (dict(stop_tokens=5), "stop_tokens must be a sequence of integers"),
        (dict(stop_tokens="ab"), "stop_tokens must be a sequence of integers"),
        (dict(stop_tokens=[1.5]), "stop_tokens must hold integers"),
        (dict(chunk_rounds=0), "chunk_rounds"),
        (dict(max_len=64.5), "max_len must be an integer"),
        (dict(request_ids=[-1]), r"request_ids must be integers in \[0, 2147483648\)"),
        (dict(request_ids=[2**40]), "request_ids must be integers"),
        (dict(request_ids=[0.5]), "request_ids must hold integers"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(top_k="a"), "top_k must be a number"),
        (dict(on_round=5), "on_round must be a function or None"),
        (dict(with_expected="no"), "with_expected must be True or False"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, message):
    """... before anything compiles: ``on_compile`` is not called."""
    target, drafter = tiny_pair(vocab=8)
    args = dict(prompt_ids=[[1, 2, 3]], method="ddtree", budget=4, max_new_tokens=4)
    args.update(kwargs)
    compiled = []
    with pytest.raises(ValueError, match=message):
        generate(target, drafter, args.pop("prompt_ids"), **args, on_compile=lambda: compiled.append(1))
    assert compiled == []


def test_on_compile_must_be_callable():
    target, drafter = tiny_pair(vocab=8)
    with pytest.raises(ValueError, match="on_compile must be a function or None, got 'yes'"):
        generate(target, drafter, [[1, 2, 3]], budget=4, max_new_tokens=4, on_compile="yes")


def test_ddtree_needs_a_matching_drafter():
    target, _ = tiny_pair(vocab=8)
    _, other = tiny_pair(vocab=12)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [[1]], method="chain")
    with pytest.raises(ValueError, match="does not match the target"):
        generate(target, other, [[1]], method="ddtree")


def test_all_methods_share_one_round_function():
    """AR is the root-only tree through the same verify walk: at T > 0 it samples the target law."""
    target, _ = tiny_pair(vocab=6, seed=2)
    res = generate(target, None, [[1, 2]] * 4000, method="ar", temperature=1.0, max_new_tokens=2,
                   key=jax.random.key(1), with_expected=False)
    law = exact_ar_law(target, [1, 2], 1.0, 0, 1.0, 2, 6)
    assert chi2_pvalue(res.tokens[:, :2], law) > 1e-3
    assert set(itertools.chain.from_iterable(res.tokens.tolist())) <= set(range(6))


def test_pallas_kernels_behind_the_switches_give_the_same_tokens():
    """The Pallas attention, K/V write, tree build and fused sampler (interpreted on CPU) plug into the
    same round; so does the wide tree build of budgets past 64."""
    target, drafter = tiny_pair(vocab=8, head_dim=16)
    kw = dict(method="ddtree", budget=8, max_new_tokens=5, temperature=np.array([0.0, 1.0, 0.7, 1.0]),
              top_p=np.array([1.0, 1.0, 0.8, 1.0]), top_k=np.array([0, 0, 0, 3]), key=jax.random.key(4))
    xla = generate(target, drafter, PROMPTS, attention_impl="xla", sampler_impl="xla", build_impl="xla", **kw)
    kernels = generate(target, drafter, PROMPTS, attention_impl="interpret", sampler_impl="interpret",
                       build_impl="interpret", **kw)
    np.testing.assert_array_equal(kernels.tokens, xla.tokens)
    per_round = lambda res: [(r.accepted.tolist(), r.tree_size.tolist()) for r in res.rounds]  # noqa: E731
    assert per_round(kernels) == per_round(xla)
    with pytest.raises(ValueError, match="attention_impl"):
        generate(target, drafter, PROMPTS, attention_impl="cuda", **kw)
    wide = dict(kw, budget=80)  # past the one-program kernel's 64: the wide build
    np.testing.assert_array_equal(generate(target, drafter, PROMPTS, build_impl="interpret", **wide).tokens,
                                  generate(target, drafter, PROMPTS, build_impl="xla", **wide).tokens)
    with pytest.raises(ValueError, match="sampler_impl"):
        generate(target, drafter, PROMPTS, sampler_impl="fast", **kw)
    with pytest.raises(ValueError, match="build_impl"):
        generate(target, drafter, PROMPTS, build_impl="triton", **kw)

