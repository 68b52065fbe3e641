"""The list flags of the benchmark scripts: parsed and checked by `ddtree_jax.experiments.flags` before
anything runs, a bad value named with its flag."""

import argparse
import importlib
import sys
from pathlib import Path

import pytest

from ddtree_jax.experiments.flags import (
    float_list,
    int_list,
    int_list_or_empty,
    name_list,
    non_negative_int_list,
    positive_float_list,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.mark.parametrize("text, want", [("1", [1]), ("1,8", [1, 8]), (" 16, 64 ", [16, 64]), ("4,", [4])])
def test_int_list_reads_comma_separated_positive_ints(text, want):
    assert int_list(text) == want


@pytest.mark.parametrize("text", ["", ",", "0", "1,-2", "a", "1.5", "1;2"])
def test_int_list_rejects_what_is_not_a_list_of_positive_ints(text):
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers >= 1"):
        int_list(text)


def test_int_list_bounds_and_empty():
    assert int_list("64", maximum=64) == [64]
    with pytest.raises(argparse.ArgumentTypeError, match=r"in \[1, 64\], got '16,65'"):
        int_list("16,65", maximum=64)
    assert int_list_or_empty("") == [] and int_list_or_empty("2") == [2]
    with pytest.raises(argparse.ArgumentTypeError, match="or nothing"):
        int_list_or_empty("0")


def test_float_lists_and_a_lower_bound_of_zero():
    assert float_list("0,1.5") == [0.0, 1.5] and positive_float_list("0.5") == [0.5]
    for text in ("", "a", "1,-1", "nan", "inf", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite numbers >= 0"):
            float_list(text)
    with pytest.raises(argparse.ArgumentTypeError, match="finite numbers > 0"):
        positive_float_list("1,0")
    assert int_list("0,3", minimum=0) == [0, 3] == non_negative_int_list("0,3")
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0, got '-1'"):
        int_list("-1", minimum=0)


def test_name_list_takes_names_of_its_choices_only():
    names = name_list(("xla", "pallas"))
    assert names("pallas,xla") == ["pallas", "xla"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown: cuda"):
        names("xla,cuda")
    with pytest.raises(argparse.ArgumentTypeError, match="out of xla, pallas"):
        names("")
    assert name_list(("a",), empty=True)("") == []


# (script, arguments, the flag its error must name): each fails in parsing, before any model or kernel.
BAD = [
    ("bench_core", ["--budgets", "16,0"], "--budgets"),
    ("bench_core", ["--batches", "one"], "--batches"),
    ("bench_kernels", ["attention", "--nodes", "0"], "--nodes"),
    ("bench_kernels", ["sampling", "--sampling-params", "T1,T9"], "--sampling-params"),
    ("bench_kernels", ["attention", "--impls", "cuda"], "--impls"),
    ("bench_matmul", ["--rows", "1,x"], "--rows"),
    ("bench_matmul", ["--shapes", "wq"], "--shapes"),
    ("bench_models", ["--contexts", "-1"], "--contexts"),
    ("bench_models", ["--matmul-impls", "cublas"], "--matmul-impls"),
    ("bench_models", ["--variants", "default,fastest"], "--variants"),
    ("bench_tree_build", ["--budgets", ""], "--budgets"),
    ("bench_attention_merge", ["--budgets", "0"], "--budgets"),
    ("bench_tp", ["--tps", "1,two"], "--tps"),
    ("bench_tp", ["--shapes", "qwen3-9b"], "--shapes"),
    ("bench_moe", ["--budgets", "0"], "--budgets"),
    ("check_kernels", ["--parts", "attention,everything"], "--parts"),
    ("check_kernels", ["--backends", "cuda"], "--backends"),
    ("eval_acceptance", ["--temperatures", "0,-1"], "--temperatures"),
    ("eval_acceptance", ["--draft-vocabs", "-2"], "--draft-vocabs"),
    ("train_drafter", ["--target", "t", "--out", "o", "--taps", "1,a"], "--taps"),
    ("train_drafter", ["--target", "t", "--out", "o", "--gen-temperatures", "nan"], "--gen-temperatures"),
]


@pytest.mark.parametrize("script, argv, flag", BAD)
def test_scripts_name_a_bad_list_flag_before_running(script, argv, flag, capsys):
    main = importlib.import_module(f"experiments.{script}").main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and f"argument {flag}: expected comma-separated" in err
