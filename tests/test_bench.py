"""`ddtree bench` (ddtree_jax.experiments.bench) end to end on tiny shapes and the embedded pair, and its bad input."""

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import cli, engine
from ddtree_jax.experiments import bench, profiling

PART_KEYS = {"drafter_ms", "tree_ms", "verify_forward_ms", "sampling_ms", "commit_ms"}


def test_profile_programs_puts_the_verify_forward_over_the_decode_step(monkeypatch, tmp_path, capsys):
    # a device's traces, made up: the decode step 4 ms (3.9 of it its forward), the round's verify 4.6 ms
    def summary(parts):
        return {"Stream #1": dict(ms_per_call=sum(parts.values()), kind_share={}, top_ops=[], by_neighbour_ms=0.0,
                                  parts={k: dict(ms_per_call=v, kind_share={}) for k, v in parts.items()})}
    traces = {"decode": summary({"verify": 3.9, "sample": 0.1}), "round": summary({"draft": 1.0, "verify": 4.6})}

    class Runner:
        def __init__(self, name):
            self.name = name

        def hlo(self):
            return self.name

    monkeypatch.setattr(profiling, "scope_parts", lambda hlo, parts: {})
    monkeypatch.setattr(profiling, "device_op_times", lambda runner, **kw: traces[runner.name])
    args = argparse.Namespace(profile_ops=4, hlo=False, out=tmp_path / "b.json")
    first, second = {}, {}
    decode_ms = bench.profile_programs(args, first, [("decode", Runner("decode")), ("round", Runner("round"))], "B4")
    assert decode_ms == pytest.approx(4.0)
    assert first["verify_over_decode_device"] == pytest.approx(4.6 / 4.0)
    assert first["decode_device_ms"] == pytest.approx(4.0) and first["verify_device_ms"] == pytest.approx(4.6)
    # a later budget's round against the decode step traced with the first
    assert bench.profile_programs(args, second, [("round", Runner("round"))], "B8", decode_ms) == decode_ms
    assert second["verify_over_decode_device"] == pytest.approx(1.15)
    assert "verify forward: 4.600 ms of device time = 1.150x the decode step's 4.000 ms" in capsys.readouterr().out
    # no decode step traced: no ratio
    third = {}
    assert bench.profile_programs(args, third, [("round", Runner("round"))], "B16") is None
    assert "verify_over_decode_device" not in third and third["profiled_core_share"] == 0.0


def test_bench_tiny_shapes_and_embedded(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # XLA attention (what auto picks on a CPU) lets --mesh-check reuse the round compiled for B=4
    argv = ["bench", "--shapes", "tiny", "--batches", "2", "--contexts", "16", "--budgets", "4,8", "--repeats", "1",
            "--mesh-check", "--build-check", "--profile", "--profile-ops", "4", "--hlo", "--with-expected",
            "--embedded", "--embedded-batches", "1", "--new-tokens", "6",
            "--top-k", "5", "--attention-impl", "xla", "--draft-temperature", "0.7", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    # progress before every row; no HBM roofline on a CPU
    assert "[1/2] B=4: compiling" in printed and "[2/2] B=8: compiling" in printed
    assert "roofline n/a on a CPU" in printed and "x roofline" not in printed and "floor" not in printed
    result = json.loads(out.read_text())
    rows = result["shapes"]
    assert [(r["batch"], r["context"], r["budget"]) for r in rows] == [(2, 16, 4), (2, 16, 8)]
    for row in rows:
        assert PART_KEYS <= set(row) and all(row[k] > 0 for k in PART_KEYS | {"round_ms", "decode_ms"})
        assert row["round_over_decode"] == pytest.approx(row["round_ms"] / row["decode_ms"])
        assert row["parts_sum_ms"] == pytest.approx(sum(row[k] for k in PART_KEYS))
        loop_keys = ("decode_back_to_back_ms", "round_back_to_back_ms", "drafter_in_loop_ms", "tree_in_loop_ms",
                     "sampling_in_loop_ms")
        assert all(row[k] > 0 for k in loop_keys)
        assert row["core_share"] == pytest.approx(
            (row["tree_in_loop_ms"] + row["sampling_in_loop_ms"]) / row["round_back_to_back_ms"])
        assert row["decode_roofline_ms"] is None and row["round_floor_ms"] is None
        # first calls compile: far slower than the warm median
        assert row["round_first_call_s"] * 1e3 > 2 * row["round_ms"]
        assert row["decode_first_call_s"] * 1e3 > 2 * row["decode_ms"]
    assert all(r["build_impl"] == "auto" and r["round_xla_build_back_to_back_ms"] > 0 for r in rows)
    assert rows[0]["round_mesh1_ms"] > 0 and rows[0]["round_xla_ms"] > 0 and "round_mesh1_ms" not in rows[1]
    # the CPU records no device plane: the profiles are there and empty; the decode step's once
    assert rows[0]["profile_round"] == rows[0]["profile_decode"] == rows[1]["profile_round"] == {}
    assert "profile_decode" not in rows[1] and "profiled_core_share" not in rows[0]
    round_hlo = (tmp_path / "bench_round_b2_c16_B4.hlo.txt").read_text()
    decode_hlo = (tmp_path / "bench_decode_b2_c16_B4.hlo.txt").read_text()
    assert (tmp_path / "bench_round_b2_c16_B8.hlo.txt").is_file()
    assert "fusion" in round_hlo and "ENTRY" in decode_hlo
    # every step of the compiled round (--with-expected: the expected acceptance too) keeps its named scope,
    # which a device profile sums by
    steps = set(engine.ROUND_PARTS)
    assert set(profiling.scope_parts(round_hlo, steps).values()) == steps
    # (an AR round has no drafts: its expected acceptance, 0, compiles to no op)
    assert set(profiling.scope_parts(decode_hlo, steps).values()) == {"encode", "verify", "sample", "commit"}
    embedded = result["embedded"]
    assert [(r["temperature"], r["method"]) for r in embedded] == [
        (t, m) for t in (0.0, 1.0) for m in ("ar", "chain", "ddtree")]
    assert all(r["tau"] >= 1 and r["tokens_per_s"] > 0 for r in embedded)
    assert all(r["tau"] == 1 for r in embedded if r["method"] == "ar")
    assert all(r["draft_temperature"] == 0.7 for r in embedded)
    assert result["meta"]["settings"]["budgets"] == [4, 8] and result["meta"]["settings"]["top_k"] == 5
    assert result["meta"]["settings"]["with_expected"] is True


def test_generate_and_prefill_parts_on_tiny_shapes(tmp_path, capsys):
    """Part 3 times generate() per round next to the jitted round; part 4 the prefill, its FLOP rate
    from `prefill_flops` (no roofline on a CPU)."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "tiny", "--skip-shapes", "--generate", "--prefill", "--profile", "--contexts", "16,24",
            "--budgets", "4", "--new-tokens", "5", "--repeats", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["shapes"] == [] and result["embedded"] == []
    rows = result["generate"]
    assert [(r["context"], r["method"], r["budget"]) for r in rows] == [
        (c, m, b) for c in (16, 24) for m, b in (("ar", 1), ("chain", 1), ("ddtree", 4))]
    for row in rows:
        assert row["batch"] == 1 and 1 <= row["rounds"] <= 5
        assert row["overhead"] == pytest.approx(row["generate_round_ms"] / row["jitted_round_ms"])
        assert row["tokens_per_s"] > 0 and row["first_token_ms"] > 0
    target, _ = bench.make_models("tiny")
    prefill = result["prefill"]
    assert [(r["batch"], r["context"]) for r in prefill] == [(1, 16), (1, 24)]
    for row in prefill:
        assert row["tflop"] == pytest.approx(bench.prefill_flops(target, 1, row["context"]) / 1e12)
        assert row["tflops"] == pytest.approx(1e3 * row["tflop"] / row["prefill_ms"])
        assert row["roofline_ms"] is None and row["over_roofline"] is None
        # the layer's widest matrix (gate and up: 64 x 256) over the prompt's rows
        assert row["gemm_shape"] == [row["context"], 64, 256] and row["gemm_tflops"] > 0
        assert row["over_gemm"] == pytest.approx(row["gemm_tflops"] / row["tflops"])
        assert row["profile"] == {}  # traced; a CPU records no device plane
    assert "batch 1 context 24: prefill" in printed and "roofline n/a on a CPU" in printed


@pytest.mark.parametrize("shapes", ["tiny", "tiny-moe"])
def test_prefill_flops_count_the_products_a_token_goes_through(shapes):
    target, _ = bench.make_models(shapes)
    c = target.config
    d, dh, hq, hkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    attention_block = d * (hq + 2 * hkv) * dh + hq * dh * d
    per_token = 0
    for i in range(c.num_hidden_layers):
        if shapes == "tiny" or i in c.mlp_only_layers:
            per_token += attention_block + 3 * d * c.intermediate_size
        else:  # the router and the experts a token is routed to
            per_token += attention_block + d * c.num_experts + c.num_experts_per_tok * 3 * d * c.moe_intermediate_size
    length, batch = 24, 3
    scores_and_values = c.num_hidden_layers * 2 * (2 * hq * dh * length * length) / 2
    expected = batch * (2 * per_token * length + scores_and_values)
    assert bench.prefill_flops(target, batch, length) == pytest.approx(expected, rel=1e-12)


def test_rooflines_read_the_weights_and_the_kv_caches_of_the_batch_and_context():
    """The floor of a step grows with the KV cache it reads: 2 (keys, values) x batch x context x layers x
    KV heads x head_dim elements of the cache dtype, for the target and, in the round, the drafter."""
    target, drafter = bench.make_models("tiny")
    tc, dc, hbm = target.config, drafter.config, 1e12
    decode0, round0 = bench.rooflines(target, drafter, hbm, batch=1, context=0)
    assert decode0 == pytest.approx(1e3 * bench.streamed_bytes(target) / hbm) and round0 > decode0
    decode, round_ = bench.rooflines(target, drafter, hbm, batch=3, context=40)
    itemsize = np.dtype(target.dtype).itemsize
    target_kv = 2 * 3 * 40 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * itemsize
    drafter_kv = 2 * 3 * 40 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim * itemsize
    assert decode - decode0 == pytest.approx(1e3 * target_kv / hbm)
    assert round_ - round0 == pytest.approx(1e3 * (target_kv + drafter_kv) / hbm)


def test_a_draft_vocabulary_streams_its_own_head_in_the_round(tmp_path):
    """With ``--draft-vocab W`` the round's floor reads the drafter's W-column head instead of a second pass
    over the LM head, and the rows are timed and say W."""
    target, drafter = bench.make_models("tiny")
    _, small = bench.make_models("tiny", draft_vocab=64)
    assert small.params.draft_ids.tolist() == list(range(64))
    head = bench.weight_bytes(target.params.embed if target.params.lm_head is None else target.params.lm_head)
    (_, full), (_, pruned) = (bench.rooflines(target, d, 1e12, batch=1, context=8) for d in (drafter, small))
    own = bench.weight_bytes((small.params.draft_head, small.params.draft_ids))
    assert full - pruned == pytest.approx(1e3 * (head - own) / 1e12)
    out = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "tiny", "--batches", "1", "--contexts", "16", "--budgets", "4", "--repeats", "1",
            "--draft-vocab", "64", "--out", str(out)]
    assert cli.main(argv) == 0
    (row,) = json.loads(out.read_text())["shapes"]
    assert row["draft_vocab"] == 64 and row["round_ms"] > 0 and row["drafter_ms"] > 0
    assert row["round_full_vocab_back_to_back_ms"] > 0  # the whole vocabulary's round, timed beside it


def _ops_in_while_body(hlo: str, op: str) -> int:
    """How many ``op`` instructions of a compiled module run inside its while loop's body, fusions and
    calls followed."""
    computations, name = {}, None
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")):
            name = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            computations[name] = []
        elif name and line.startswith(" "):
            computations[name].append(line)
    (body,) = [re.search(r"body=%([\w.\-]+)", line).group(1) for lines in computations.values() for line in lines
               if " while(" in line]
    seen, todo, count = set(), [body], 0
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        count += sum(f" {op}(" in line for line in computations[name])
        todo += [c for line in computations[name] for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)]
    return count


def test_a_nudged_input_keeps_the_work_in_the_loop_without_copies():
    """A loop over `bench.nudge`d inputs threaded through its carry computes inside the loop body what
    XLA hoists out of a loop over the same loop-invariant input, and copies no array inside the loop."""
    x = jax.random.normal(jax.random.key(0), (65, 300))

    def nudged(i, carry):
        acc, v = carry
        v = bench.nudge(v)
        return acc + jnp.exp(v).sum(), v

    def invariant(i, carry):
        return carry[0] + jnp.exp(carry[1]).sum(), carry[1]

    hlos = [jax.jit(lambda x, body=body: jax.lax.fori_loop(0, 4, body, (jnp.float32(0), x))[0]).lower(x).compile()
            .as_text() for body in (nudged, invariant)]
    assert _ops_in_while_body(hlos[0], "exponential") == 1 and _ops_in_while_body(hlos[1], "exponential") == 0
    assert _ops_in_while_body(hlos[0], "copy") == 0
    np.testing.assert_array_equal(bench.nudge(x)[0, 0], x[0, 0] + 1)
    np.testing.assert_array_equal(bench.nudge(x)[1:], x[1:])


def test_back_to_back_queues_the_calls_and_blocks_once():
    """`bench.back_to_back_ms` calls ``fn`` ``steps`` times per timed repeat (plus a warm repeat) and
    divides by ``steps``."""
    calls = []
    ms = bench.back_to_back_ms(lambda: calls.append(1) or np.zeros(()), repeats=3, steps=4)
    assert len(calls) == 4 * (1 + 3) and ms >= 0


def test_tiny_shapes_make_every_knob_tiny(tmp_path):
    """``--shapes tiny`` alone is a run of seconds on a CPU: every knob takes the tiny preset, a flag given
    still wins."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--shapes", "tiny", "--skip-shapes", "--repeats", "2", "--out", str(out)]) == 0
    settings = json.loads(out.read_text())["meta"]["settings"]
    assert {k: settings[k] for k in bench.TINY} == dict(bench.TINY, repeats=2)
    assert bench.TINY["batches"] == [1] and max(bench.TINY["contexts"]) <= 64 and max(bench.TINY["budgets"]) <= 8
    assert bench.TINY["repeats"] <= 3 and bench.TINY["embedded_batches"] == [1] and bench.TINY["new_tokens"] <= 16
    assert cli.main(["bench", "--skip-shapes", "--out", str(out)]) == 0
    settings = json.loads(out.read_text())["meta"]["settings"]
    assert {k: settings[k] for k in bench.FULL} == bench.FULL


@pytest.mark.parametrize("flag, value, message", [
    ("--repeats", "0", "--repeats must be >= 1"), ("--top-p", "0", "--top-p must be in"),
    ("--temperature", "-1", "--temperature must be >= 0"), ("--topk-cap", "-2", "--topk-cap must be >= 0"),
    ("--top-k", "-1", "--top-k must be >= 0"), ("--draft-temperature", "0", "--draft-temperature must be finite"),
    ("--peak-tflops", "0", "--peak-tflops must be > 0"),
])
def test_bench_rejects_bad_flags(tmp_path, flag, value, message):
    with pytest.raises(SystemExit, match=message) as exit_info:
        cli.main(["bench", "--shapes", "tiny", flag, value, "--out", str(tmp_path / "b.json")])
    assert exit_info.value.code.startswith("ddtree bench: --")


@pytest.mark.parametrize("flag, value", [("--budgets", "16,0"), ("--budgets", "16,40000"),
                                         ("--embedded-budgets", "40000"), ("--contexts", "0,64")])
def test_bench_rejects_bad_lists(flag, value, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", flag, value])
    assert f"argument {flag}: expected comma-separated integers" in capsys.readouterr().err
