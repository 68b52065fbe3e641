"""The ddtree command line on the embedded pair."""

import ast
import json
from pathlib import Path

import pytest

import ddtree_jax
from ddtree_jax.cli import main


def test_generate_json_on_the_embedded_pair(capsys):
    assert main(["generate", "--prompt", "import os\n", "--max-new-tokens", "12", "--json", "--temperature", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert 1 <= len(out["token_ids"]) <= 12
    assert out["stats"]["rounds"] >= 1 and out["stats"]["tau"] >= 1.0 and out["stats"]["tokens_per_s"] > 0


def test_generate_streams_text_and_statistics(capsys):
    assert main(["generate", "--prompt", "class Stack:", "--max-new-tokens", "8", "--method", "chain"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("class Stack:") and "[chain] tau" in out


def test_greedy_methods_agree_through_the_cli(capsys):
    ids = []
    for method in ("ar", "ddtree"):
        main(["generate", "--prompt-ids", "534,1246,67", "--method", method, "--temperature", "0",
              "--max-new-tokens", "10", "--json", "--no-stop"])
        ids.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert ids[0] == ids[1] and len(ids[0]) == 10


@pytest.mark.parametrize("argv,message", [
    (["--budget", "0"], "budget"),
    (["--top-p", "1.5"], "top_p"),
    (["--prompt-ids", "1,x"], "prompt-ids"),
    (["--prompt-ids", "99999"], "token ids"),
    (["--target", "/nonexistent"], "not an HF-format model directory"),
])
def test_bad_flags_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--max-new-tokens", "4", *argv])


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_the_runtime_does_not_import_the_experiment_drivers():
    """Nothing imports the CLI (the default asset paths live in ``ddtree_jax.assets``), and the runtime
    never imports ``ddtree_jax.experiments`` at import time (the CLI does, inside ``main``)."""
    root = Path(ddtree_jax.__file__).parent
    for path in root.rglob("*.py"):
        imports = _top_level_imports(path)
        assert not any(n.startswith("ddtree_jax.cli") for n in imports), path
        if "experiments" not in path.relative_to(root).parts:
            assert not any(n.startswith("ddtree_jax.experiments") for n in imports), path
