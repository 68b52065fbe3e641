from pathlib import Path

import numpy as np
import pytest

from ddtree_jax.experiments import corpus
from ddtree_jax.tokenizer import Tokenizer

# Computed once from the rule (sha256 of the relative path, first 8 bytes mod 1000 < 20);
# any change to the rule must fail here.
EXPECTED_SPLITS = {
    "socket.py": "heldout",
    "statistics.py": "heldout",
    "turtle.py": "heldout",
    "asyncio/runners.py": "heldout",
    "email/charset.py": "heldout",
    "os.py": "train",
    "json/decoder.py": "train",
    "typing.py": "train",
    "asyncio/tasks.py": "train",
    "collections/__init__.py": "train",
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


@pytest.mark.parametrize("relpath,split", sorted(EXPECTED_SPLITS.items()))
def test_split_is_stable(relpath, split):
    assert corpus.split_of(relpath) == split


def test_about_two_percent_held_out():
    synthetic = [f"pkg{i % 97}/module_{i}.py" for i in range(20_000)]
    frac = np.mean([corpus.split_of(p) == "heldout" for p in synthetic])
    assert 0.017 < frac < 0.023
    held, train = corpus.list_files("heldout"), corpus.list_files("train")
    assert 0.01 < len(held) / (len(held) + len(train)) < 0.04


def test_stdlib_listing_sorted_disjoint_and_without_site_packages():
    root = corpus.stdlib_root()
    held, train = corpus.list_files("heldout"), corpus.list_files("train")
    assert not set(held) & set(train)
    for files in (held, train):
        rel = [p.relative_to(root).as_posix() for p in files]
        assert rel == sorted(rel)
        assert all(r.endswith(".py") and "site-packages" not in r.split("/") for r in rel)
    assert root / "os.py" in train and root / "socket.py" in held


def _fake_root(tmp_path: Path) -> Path:
    for rel in ["b.py", "a.py", "pkg/z.py", "pkg/readme.txt", "site-packages/numpy/x.py",
                "pkg/site-packages/y.py", "socket.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\nvalue = {len(rel)}\n" * 20)
    return tmp_path


def test_list_files_on_a_tree(tmp_path):
    root = _fake_root(tmp_path)
    assert corpus.list_files("train", root) == [root / "a.py", root / "b.py", root / "pkg/z.py"]
    assert corpus.list_files("heldout", root) == [root / "socket.py"]
    with pytest.raises(ValueError, match="split"):
        corpus.list_files("valid", root)
    with pytest.raises(ValueError, match="not a directory"):
        corpus.list_files("train", root / "missing")


def test_read_text_replaces_bad_bytes_and_keeps_crlf(tmp_path):
    path = tmp_path / "f.py"
    path.write_bytes(b"x = 1\r\ny = '\xff\xfe'\n")
    assert corpus.read_text(path) == "x = 1\r\ny = '\ufffd\ufffd'\n"


def test_token_blocks_deterministic_and_complete(tok, tmp_path):
    root = _fake_root(tmp_path)

    def take(seed, n):
        it = corpus.token_blocks(tok, "train", 16, seed=seed, root=root)
        return np.stack([next(it) for _ in range(n)])

    a = take(0, 40)
    assert a.shape == (40, 16) and a.dtype == np.int32
    np.testing.assert_array_equal(a, take(0, 40))
    assert not np.array_equal(a, take(1, 40))

    docs = [tok.encode(corpus.read_text(p)) + [tok.eot_id] for p in corpus.list_files("train", root)]
    total = sum(len(d) for d in docs)
    epoch = np.stack(list(corpus.token_blocks(tok, "train", 16, seed=3, root=root, repeat=False)))
    assert epoch.shape == (total // 16, 16)
    # One epoch is the documents' concatenation in some order, cut into blocks (tail dropped).
    assert (epoch == tok.eot_id).sum() >= len(docs) - 1
    counts = np.bincount(np.concatenate(docs), minlength=tok.vocab_size)
    assert np.all(np.bincount(epoch.ravel(), minlength=tok.vocab_size) <= counts)
    assert counts.sum() - epoch.size == total % 16


def test_token_blocks_bad_args(tok, tmp_path):
    root = _fake_root(tmp_path)
    with pytest.raises(ValueError, match="block_len"):
        corpus.token_blocks(tok, "train", 0, seed=0, root=root)
    with pytest.raises(ValueError, match="exceeds"):
        corpus.token_blocks(tok, "heldout", 10_000, seed=0, root=root)


def test_heldout_prompts(tok):
    prompts = corpus.heldout_prompts(tok, 60, 32, seed=0)
    assert prompts.shape == (60, 32) and prompts.dtype == np.int32
    np.testing.assert_array_equal(prompts, corpus.heldout_prompts(tok, 60, 32, seed=0))
    assert not np.array_equal(prompts, corpus.heldout_prompts(tok, 60, 32, seed=1))
    assert not (prompts == tok.eot_id).any()
    held = [tok.encode(corpus.read_text(p)) for p in corpus.list_files("heldout")]
    for prompt in prompts[:10]:
        text = tok.decode(prompt)
        assert any(text in tok.decode(doc) for doc in held)
    with pytest.raises(ValueError, match="prompt_tokens"):
        corpus.heldout_prompts(tok, 1, 10**9, seed=0)
