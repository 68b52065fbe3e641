"""Argument checks of the public API that need no model run: `expected_acceptance`'s inputs, and the
prompt batch and key of `generate` (each a ValueError naming the argument, before anything runs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dd
from ddtree_jax import checks
from ddtree_jax.models import Qwen3Config, init_target

VOCAB = 7


@pytest.fixture(scope="module")
def case():
    """A batch of two trees over a vocabulary of 7 and a target law after every node."""
    rng = np.random.default_rng(0)
    tree = dd.build_tree(rng.normal(size=(2, 3, VOCAB)).astype(np.float32), np.array([1, 2]), budget=5)
    probs = dd.target_probs(rng.normal(size=(2, 6, VOCAB)).astype(np.float32), 1.0, 0, 1.0)
    return tree, np.asarray(probs)


def test_expected_acceptance_accepts_a_law_eagerly_and_under_jit(case):
    tree, probs = case
    eager = np.asarray(dd.expected_acceptance(tree, probs))
    assert eager.shape == (2,) and np.all(eager > 0)
    np.testing.assert_array_equal(np.asarray(jax.jit(dd.expected_acceptance)(tree, probs)), eager)


@pytest.mark.parametrize("change,message", [
    (lambda t, p: (t, p[0]), r"probs must have rank 3, got shape \(6, 7\)"),
    (lambda t, p: (t, p[:, :4]), r"probs has shape \(2, 4, 7\), expected leading dimensions \(2, 6\)"),
    (lambda t, p: (t, p.astype(np.int32)), "probs must have a floating dtype"),
    (lambda t, p: (t, p[:, :, :3] / p[:, :, :3].sum(-1, keepdims=True)),
     r"tree.tokens must hold token ids in \[0, 3\)"),
    (lambda t, p: (t, np.full_like(p, np.nan)), "probs contains non-finite values"),
    (lambda t, p: (t, p - 0.5), r"probs must be probabilities in \[0, 1\]"),
    (lambda t, p: (t, p / 2), "every row of probs must be a distribution summing to 1"),
    (lambda t, p: (t.tokens, p), r"tree must be a DraftTree \(build_tree\), got ArrayImpl"),
])
def test_expected_acceptance_names_bad_input(case, change, message):
    with pytest.raises(ValueError, match=message):
        dd.expected_acceptance(*change(*case))


@pytest.fixture(scope="module")
def target():
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return init_target(config, jax.random.key(0), jnp.float32)


@pytest.mark.parametrize("prompt_ids,message", [
    ("def f():", "prompt_ids must be a batch of token id sequences .* got the string 'def f\\(\\):'"),
    ([1, 2, 3], r"prompt_ids must be a batch of token id sequences, got one flat sequence of ids \[1, 2, 3\]: "
                r"pass \[ids\]"),
    (np.arange(3), "got one flat sequence of ids"),
    (["def f():"], r"prompt_ids\[0\] is a string, not token ids"),
])
def test_generate_wants_a_batch_of_id_sequences(target, prompt_ids, message):
    with pytest.raises(ValueError, match=message):
        dd.generate(target, None, prompt_ids, method="ar", max_new_tokens=2)


@pytest.mark.parametrize("key,message", [
    (0, "key must be one jax.random key such as jax.random.key\\(0\\), got 0"),
    (np.zeros(3, np.uint32), r"got an array of shape \(3,\) and dtype uint32"),
    (jax.random.split(jax.random.key(0)), r"got an array of shape \(2,\) and dtype key<fry>"),
])
def test_generate_wants_one_random_key(target, key, message):
    with pytest.raises(ValueError, match=message):
        dd.generate(target, None, [[1, 2]], method="ar", max_new_tokens=2, key=key)


def test_random_key_accepts_typed_and_raw_keys():
    for key in (None, jax.random.key(3), jax.random.PRNGKey(3)):
        checks.random_key("key", key)


def test_int_ids_reads_sequences_of_integers_in_range():
    assert checks.int_ids("ids", (3, 0), low=0, high=4).tolist() == [3, 0]
    assert checks.int_ids("ids", np.array([], np.int32), low=0, high=4).tolist() == []
    assert checks.int_ids("ids", [], low=0, high=4).tolist() == []
    for bad, message in [(3, "be a sequence of integers, got 3"), ("ab", "be a sequence of integers"),
                         ([[1]], "be a sequence of integers"), ([1.0], "hold integers"), ([True], "hold integers"),
                         ([4], r"be integers in \[0, 4\), got \[4\]"), ([-1, 2], r"be integers .* got \[-1\]")]:
        with pytest.raises(ValueError, match="ids must " + message):
            checks.int_ids("ids", bad, low=0, high=4)


def test_boolean_callback_and_as_array():
    assert checks.boolean("flag", np.bool_(True)) is True
    with pytest.raises(ValueError, match="flag must be True or False, got 1"):
        checks.boolean("flag", 1)
    checks.callback("fn", None)
    checks.callback("fn", print)
    with pytest.raises(ValueError, match="fn must be a function or None"):
        checks.callback("fn", "print")
    x = jnp.zeros(2)
    assert checks.as_array(x) is x and checks.as_array([[1, 2]]).shape == (1, 2)


def test_non_negative_names_the_entries_below_zero():
    checks.non_negative("lengths", np.array([0, 3]))
    jax.jit(lambda x: checks.non_negative("lengths", x))(np.array([-1]))  # a tracer: nothing to read
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got \[-2, -1\]"):
        checks.non_negative("lengths", np.array([[1, -2], [-1, 0]]))
    with pytest.raises(ValueError, match="ids must be token ids >= 0, got -5"):
        checks.non_negative("ids", np.int32(-5), "token ids >= 0")


def test_token_range_names_up_to_four_ids_outside_the_vocabulary():
    checks.token_range("ids", [0, 4], 5)
    checks.token_range("ids", np.zeros((0,), np.int32), 5)
    jax.jit(lambda x: checks.token_range("ids", x, 5))(np.array([9]))  # a tracer: nothing to read
    with pytest.raises(ValueError, match=r"ids must hold token ids in \[0, 5\), got \[-1, 5, 6, 7\]$"):
        checks.token_range("ids", np.array([[-1, 2, 5], [6, 7, 8]]), 5)
    with pytest.raises(ValueError, match=r"root must hold token ids in \[0, 5\), got 9$"):
        checks.token_range("root", np.int32(9), 5)
