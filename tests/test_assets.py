"""The shipped embedded pair loads and reproduces stored reference outputs."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dd
from ddtree_jax.assets import DRAFTER_DIR, TARGET_DIR
from ddtree_jax.tokenizer import Tokenizer

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
PROMPT_IDS = [534, 1246, 67, 272, 712, 656, 9, 79, 290, 279, 363, 326, 691, 456, 27, 263, 391, 326, 200]
# Computed once from the shipped weights (fp32 on a CPU).
TARGET_LAST_LOGITS_0_6 = [8.0555, -9.5693, -1.2891, -0.2021, 6.7750, 1.4196]
TARGET_TOP5 = [200, 79, 593, 0, 70]
DRAFTER_ARGMAX_0_8 = [200, 534, 430, 64, 64, 9, 200, 200]
DRAFTER_SLOT0_LOGITS_0_4 = [9.4297, -9.3337, 2.4075, 1.5014]


@pytest.fixture(scope="module")
def pair():
    return dd.load_target(TARGET_DIR, jnp.float32), dd.load_drafter(DRAFTER_DIR, jnp.float32)


def test_assets_are_small_and_complete():
    files = [p for p in Path(TARGET_DIR).parent.rglob("*") if p.is_file()]
    names = {p.relative_to(Path(TARGET_DIR).parent).as_posix() for p in files}
    assert {"target/config.json", "target/model.safetensors", "target/tokenizer.json",
            "drafter/config.json", "drafter/model.safetensors"} <= names
    assert sum(p.stat().st_size for p in files) <= 40 * 10**6


def test_tokenizer_encodes_the_reference_prompt():
    assert Tokenizer.from_file(Path(TARGET_DIR) / "tokenizer.json").encode(PROMPT) == PROMPT_IDS


def test_target_reproduces_reference_logits(pair):
    target, _ = pair
    logits = np.asarray(dd.target_logits(target, jnp.asarray([PROMPT_IDS])))[0, -1]
    np.testing.assert_allclose(logits[:6], TARGET_LAST_LOGITS_0_6, atol=2e-3)
    assert np.argsort(-logits)[:5].tolist() == TARGET_TOP5


def test_drafter_reproduces_reference_logits(pair):
    target, drafter = pair
    logits = np.asarray(dd.drafter_logits(drafter, target, jnp.asarray([PROMPT_IDS])))[0]
    assert logits.shape == (drafter.config.block_size - 1, target.config.vocab_size)
    assert logits.argmax(-1)[:8].tolist() == DRAFTER_ARGMAX_0_8
    np.testing.assert_allclose(logits[0, :4], DRAFTER_SLOT0_LOGITS_0_4, atol=2e-3)
