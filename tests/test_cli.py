"""The ddtree command line on the embedded pair."""

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import ddtree_jax
from ddtree_jax.assets import TARGET_DIR
from ddtree_jax.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


# The generations below share one prompt length (3 tokens) and --max-new-tokens 10, so that each method's
# round is compiled once for the whole module.
PROMPT_IDS = "606,542,200"  # "import os\n"


def test_generate_json_on_the_embedded_pair(capsys):
    assert main(["generate", "--prompt", "import os\n", "--max-new-tokens", "10", "--json", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out) >= {"text", "token_ids", "stats"} and out["prompt_ids"] == [606, 542, 200]
    assert 1 <= len(out["token_ids"]) <= 10
    assert out["stats"]["rounds"] >= 1 and out["stats"]["tau"] >= 1.0 and out["stats"]["tokens_per_s"] > 0
    assert "compiling" not in captured.err


def test_generate_streams_text_and_statistics(capsys):
    assert main(["generate", "--prompt", "import os\n", "--max-new-tokens", "10", "--method", "chain"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("import os\n") and "[chain] tau" in out
    # one line on stderr says that compilation comes first; --json prints none
    assert [line for line in err.splitlines() if "compiling" in line] == [
        f"ddtree: compiling the prefill and the chain round for {jax.default_backend()} before the first token "
        "(about half a minute on a small CPU)"]


def test_streamed_text_is_the_returned_text_and_tau_matches_the_counts(capsys):
    """The stream stops at --max-new-tokens exactly (the last round may emit more) and the printed tau is
    the printed tokens over the printed rounds."""
    args = ["generate", "--prompt-ids", PROMPT_IDS, "--method", "chain", "--temperature", "0", "--max-new-tokens",
            "10", "--no-stop"]
    assert main(args + ["--json"]) == 0
    returned = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    streamed, stats_line = capsys.readouterr().out.rsplit("\n\n[chain] ", 1)
    from ddtree_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(TARGET_DIR / "tokenizer.json")
    assert streamed == tokenizer.decode([606, 542, 200]) + returned["text"]
    tau, tokens, rounds = (float(stats_line.split()[1]), int(stats_line.split("|")[1].split()[0]),
                           int(stats_line.split("|")[1].split()[3]))
    assert tokens == 10 == len(returned["token_ids"])
    assert tau == pytest.approx(tokens / rounds, abs=0.005)
    assert "acceptance length" in stats_line


def test_greedy_methods_agree_through_the_cli(capsys):
    ids = []
    for method in ("ar", "ddtree"):
        main(["generate", "--prompt-ids", PROMPT_IDS, "--method", method, "--temperature", "0",
              "--max-new-tokens", "10", "--json", "--no-stop"])
        ids.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert ids[0] == ids[1] and len(ids[0]) == 10


def test_a_draft_vocabulary_keeps_the_greedy_tokens(capsys):
    """``--draft-vocab`` drafts from the most frequent tokens only: the output is AR's, and the statistics
    name it."""
    outs = []
    for flags in (["--method", "ar"], ["--draft-vocab", "1024"]):
        main(["generate", "--prompt-ids", PROMPT_IDS, "--temperature", "0", "--max-new-tokens", "10", "--json",
              "--no-stop", *flags])
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[1]["stats"]["draft_vocab"] == 1024


def one_line_error(argv, capsys) -> str:
    """The message a bad ``ddtree`` command exits with: one line (a string code is exit status 1),
    with nothing printed before it, on stdout or stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message and message.startswith(f"ddtree {argv[0]}: ")
    assert capsys.readouterr() == ("", "")
    return message


@pytest.mark.parametrize("argv,message", [
    (["--budget", "0"], "--budget must be >= 1, got 0"),
    (["--budget", "40000"], "--budget must be <= 32768 with --budget-policy fixed, got 40000"),
    (["--budget", "9000", "--budget-policy", "batch"], "--budget must be <= 8192 with --budget-policy batch, got 9000"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--temperature", "-1"], "--temperature must be finite and >= 0"),
    (["--draft-temperature", "0"], "--draft-temperature must be finite and > 0"),
    (["--topk-cap", "-1"], "--topk-cap must be >= 0"),
    (["--seed", "-1"], "--seed must be in [0, 4294967296), got -1"),
    (["--top-k", "100000"], "--top-k must be <= the vocabulary size 4096 (0 = off), got 100000"),
    (["--prompt", ""], "--prompt must be non-empty text"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers, got '1,x'"),
    (["--prompt-ids", "1,,2"], "--prompt-ids must be comma-separated integers, got '1,,2'"),
    (["--prompt-ids=-1,2"], "--prompt-ids must hold token ids in [0, 4096), got [-1]"),
    (["--prompt-ids", "99999"], "--prompt-ids must hold token ids in [0, 4096), got [99999]"),
    (["--target", "/nonexistent"], "--target /nonexistent is not an HF-format model directory"),
    (["--drafter", "/nonexistent"], "--drafter /nonexistent is not an HF-format model directory"),
    (["--max-new-tokens", "600"], "exceeds the target's max_position_embeddings=512"),
    (["--draft-vocab", "-1"], "--draft-vocab must be >= 0 (0 = the whole vocabulary), got -1"),
    (["--draft-vocab", "5000"], "--draft-vocab must be <= the vocabulary size 4096 (0 = all of it), got 5000"),
    (["--draft-vocab", "8", "--method", "ar"], "--draft-vocab needs a drafter"),
])
def test_bad_flags_exit_with_one_line_naming_the_flag(argv, message, capsys):
    assert message in one_line_error(["generate", "--max-new-tokens", "4", *argv], capsys)


def broken_target(tmp_path, edit) -> Path:
    """A copy of the embedded target whose config.json text is ``edit(text)``."""
    out = tmp_path / "target"
    out.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (out / name).symlink_to(TARGET_DIR / name)
    (out / "config.json").write_text(edit((TARGET_DIR / "config.json").read_text()))
    return out


@pytest.mark.parametrize("edit,message", [
    (lambda text: text[: len(text) // 2], "config.json is not valid JSON"),
    (lambda text: json.dumps({**json.loads(text), "hidden_size": 256}),
     "tensor 'model.embed_tokens.weight' has shape (4096, 320), expected (4096, 256) by "),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "vocab_size"}),
     "config.json: missing fields ['vocab_size']"),
])
def test_broken_model_files_exit_with_one_line_naming_the_file(tmp_path, edit, message, capsys):
    target = broken_target(tmp_path, edit)
    error = one_line_error(["generate", "--target", str(target), "--max-new-tokens", "4"], capsys)
    assert message in error and str(target / "config.json") in error


def test_a_draft_vocabulary_needs_token_counts(tmp_path, capsys):
    target = broken_target(tmp_path, lambda text: text)
    error = one_line_error(["generate", "--target", str(target), "--draft-vocab", "8", "--max-new-tokens", "4"], capsys)
    assert f"no token counts at {target / 'token_counts.npy'}: write them with experiments/count_tokens.py" in error


def test_ar_needs_no_drafter(capsys):
    argv = ["generate", "--method", "ar", "--drafter", "/nonexistent", "--prompt-ids", PROMPT_IDS,
            "--max-new-tokens", "10", "--json", "--no-stop"]
    assert main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 10


def test_a_bad_flag_is_exit_status_1_with_one_line_on_stderr():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "ddtree_jax.cli", "generate", "--prompt-ids=-1,2"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "ddtree generate: --prompt-ids must hold token ids in [0, 4096), got [-1]\n"


def test_help_states_every_flag_and_its_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"generate", "sweep", "bench"}
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.dest == "help":
                continue
            text = formatter._get_help_string(action)
            assert text and "default" in text, (name, action.dest, text)


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
