"""Device-op profiles (ddtree_jax.experiments.profiling): kinds, per-line sums, and a real trace on the CPU."""

import collections

import jax
import jax.numpy as jnp
import pytest

from ddtree_jax.experiments import profiling


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "matmul"), ("nvjet_hsh_128x64", "matmul"),
    ("tree_attention", "tree attention kernel"), ("tree_sample", "fused sampler"),
    ("dynamic-update-slice.3", "data movement"), ("input_reduce_fusion_12", "other"),
    ("residual_norm__1", "residual + RMSNorm kernel"), ("tree_build_wide_depth", "tree build kernels"),
    ("top_k_select", "tree build kernels"), ("kv_write", "data movement"),
    ("qk_norm_rope_write", "q/k norm + RoPE kernel"),
])
def test_op_kinds(name, kind):
    assert profiling.op_kind(name) == kind


EVENTS = [("Stream #1", "gemm_a", 2_000_000, ""), ("Stream #1", "gemm_a", 2_000_000, ""),
          ("Stream #1", "loop_fusion", 1_000_000, "fusion.7"), ("Stream #1", "gemm_a", 3_000_000, ""),
          ("XLA Ops", "dot.1", 6_000_000, "")]


def test_summarize_sums_per_line_and_call():
    summary = profiling.summarize(EVENTS, calls=2, top=1)
    stream = summary["Stream #1"]
    assert stream["ms_per_call"] == pytest.approx(4.0)
    assert stream["kind_share"] == pytest.approx({"matmul": 3.5 / 4, "other": 0.5 / 4})
    assert stream["top_ops"] == [dict(name="gemm_a", kind="matmul", ms_per_call=pytest.approx(3.5),
                                      count_per_call=1.5)]
    assert summary["XLA Ops"]["ms_per_call"] == pytest.approx(3.0) and "parts" not in stream
    text = profiling.format_summary(summary)
    assert "[Stream #1] 4.00 ms per call: matmul 88%, other 12%" in text and "gemm_a" in text
    assert "by part" not in text


def test_summarize_by_part_looks_up_the_hlo_op_then_the_name():
    # "loop_fusion" is no key: its event counts by its hlo_op; "dot.1" has no part at all
    parts = {"gemm_a": "draft", "fusion.7": "verify", "loop_fusion": "draft"}
    summary = profiling.summarize(EVENTS, calls=2, parts=parts)
    assert summary["Stream #1"]["parts"] == {
        "draft": dict(ms_per_call=pytest.approx(3.5), kind_share={"matmul": pytest.approx(1.0)}),
        "verify": dict(ms_per_call=pytest.approx(0.5), kind_share={"other": pytest.approx(1.0)})}
    assert list(summary["XLA Ops"]["parts"]) == [profiling.UNATTRIBUTED]
    assert "by part: draft 3.500, verify 0.500 ms" in profiling.format_summary(summary)
    # 0.5 ms of verify in 4 + 3 ms over both lines
    assert profiling.part_share(summary, ("verify", "sample")) == pytest.approx(0.5 / 7)
    assert profiling.part_share(profiling.summarize(EVENTS, calls=2), ("verify",)) is None
    assert profiling.part_share({}, ("verify",)) is None
    assert profiling.part_ms(summary, ("verify", "sample")) == pytest.approx(0.5)
    assert profiling.part_ms(summary) == pytest.approx(7.0) and profiling.part_ms({}) is None


def test_an_event_without_a_part_takes_the_part_of_the_event_before_it():
    # a library kernel (cuBLAS's "nvjet_...") names no HLO op: it runs between its part's ops
    events = [("S", "nvjet_a", 1_000_000, ""), ("S", "fusion_1", 2_000_000, ""), ("S", "nvjet_b", 4_000_000, ""),
              ("S", "fusion_2", 1_000_000, ""), ("S", "nvjet_c", 8_000_000, ""), ("T", "nvjet_d", 1_000_000, "")]
    summary = profiling.summarize(events, calls=1, parts={"fusion_1": "verify", "fusion_2": "sample"})
    assert {p: v["ms_per_call"] for p, v in summary["S"]["parts"].items()} == pytest.approx(
        {"verify": 6.0, "sample": 9.0, profiling.UNATTRIBUTED: 1.0})
    assert summary["S"]["by_neighbour_ms"] == pytest.approx(12.0)
    assert summary["T"]["parts"].keys() == {profiling.UNATTRIBUTED} and summary["T"]["by_neighbour_ms"] == 0
    assert "(12.000 ms of these matched no op and took the part of the op before)" in profiling.format_summary(summary)


def triton_call(name, operand, scope, config, root=False):
    """One line of HLO text: a Pallas (Triton) custom call traced in ``scope``, backend config ``config``."""
    return (f'  {"ROOT " if root else ""}%{name} = f32[4]{{0}} custom-call(%{operand}), '
            f'custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(round)/{scope}/pallas_call"}}, '
            f'backend_config={config}')


PALLAS_HLO = "\n".join([
    "HloModule jit_round", "",
    "%body (p: f32[4]) -> f32[4] {", "  %p = f32[4]{0} parameter(0)",
    triton_call("custom-call.5", "p", "while/body/draft", '{ir = "x", name = "attend", num_warps = 4 : i32}', True),
    "}", "",
    "%cond (c: f32[4]) -> pred[] {", "  %c = f32[4]{0} parameter(0)", "  ROOT %constant.1 = pred[] constant(false)",
    "}", "",
    "ENTRY %main (x: f32[4]) -> f32[4] {", "  %x = f32[4]{0} parameter(0)",
    triton_call("custom-call.1", "x", "build", '{ir = "y", name = "attend", num_warps = 4 : i32}'),
    "  %while.1 = f32[4]{0} while(%custom-call.1), condition=%cond, body=%body",
    triton_call("custom-call.7", "while.1", "verify", '{ir = "z", name = "attend", num_warps = 4 : i32}'),
    triton_call("custom-call.8", "custom-call.7", "sample", '"{\\"ir\\":\\"w\\",\\"name\\":\\"walk\\"}"', True),
    "}", ""])


def test_pallas_launches_are_named_in_emission_order():
    """XLA names the n-th launch of a Pallas kernel ``name__n``, in the order it emits them: the entry
    computation's instructions in turn, a while loop's body where the loop stands."""
    parts = profiling.scope_parts(PALLAS_HLO, ("build", "draft", "verify", "sample"))
    assert (parts["attend"], parts["attend__1"], parts["attend__2"], parts["walk"]) == (
        "build", "draft", "verify", "sample")
    assert "walk__1" not in parts and "attend__3" not in parts


@pytest.mark.parametrize("stats, op", [
    ([("hlo_op", "fusion.3"), ("hlo_module", "jit_f")], "fusion.3"),
    ([("correlation_id", 7), ("kernel_annotation", "XlaModule:#hlo_module=jit_f#::Thunk:#name=draft/dot,"
                                                   "hlo_op=gemm_fusion_dot.21,unique_hlo_op_id=5#")],
     "gemm_fusion_dot.21"),
    ([("kernel_details", "regs:32 grid:1,1,1")], ""), ([], ""),
])
def test_event_hlo_op_from_a_stat_or_an_annotation(stats, op):
    assert profiling.event_hlo_op(stats) == op


HLO = """HloModule jit_round, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation.2 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %tanh.0 = f32[4]{0} tanh(%param_0), metadata={op_name="jit(round)/while/body/draft/layer_0/tanh"}
  ROOT %sin.0 = f32[4]{0} sine(%tanh.0), metadata={op_name="jit(round)/while/body/draft/layer_0/sin"}
}

%body (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %loop_fusion.2 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_computation.2
  %cosine.1 = f32[4]{0} cosine(%loop_fusion.2), metadata={op_name="jit(round)/while/body/draft/cos"}
  ROOT %custom-call.9 = f32[4]{0} custom-call(%cosine.1), metadata={op_name="jit(round)/drafter/verify/pallas_call"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="x"}
  %iota.1 = s32[4]{0} iota(), iota_dimension=0, metadata={op_name="jit(round)/verify/encode/iota"}
  %copy.1 = f32[4]{0} copy(%x)
  %while.1 = f32[4]{0} while(%copy.1), condition=%cond, body=%body
  ROOT %copy.2 = f32[4]{0} copy(%while.1)
}
"""


def test_scope_parts_reads_op_names_and_fused_computations():
    parts = profiling.scope_parts(HLO, ("draft", "verify"))
    # a whole path component names the part ("drafter" is not "draft"); a fusion without metadata takes
    # its fused computation's; kernels are also found by the name XLA gives them
    assert parts["custom-call.9"] == parts["custom_call_9"] == "verify"
    assert parts["tanh.0"] == parts["loop_fusion.2"] == parts["loop_fusion_2"] == "draft"
    assert parts["while.1"] == "draft"  # two of its body's three ops are draft ones
    # copies without metadata: the part of their operand, else of their user
    assert parts["copy.2"] == parts["copy.1"] == "draft"
    assert "x" not in parts and "param_0" not in parts
    # the innermost part of a path names it
    assert parts["iota.1"] == "verify" and profiling.scope_parts(HLO, ("verify", "encode"))["iota.1"] == "encode"
    assert profiling.kernel_name("gemm_fusion_dot.21") == "gemm_fusion_dot_21"


def test_a_trace_sums_by_named_scope():
    """On the CPU the runtime's thunk events (host plane) carry their HLO ops: a real trace summed by part."""
    @jax.jit
    def f(x):
        with jax.named_scope("first"):
            y = jnp.tanh(x @ x)
        with jax.named_scope("second"):
            return jnp.sin(y @ y @ y)

    x = jnp.ones((128, 128))
    parts = profiling.scope_parts(f.lower(x).compile().as_text(), ("first", "second"))
    assert set(parts.values()) == {"first", "second"}
    summary = profiling.device_op_times(lambda: f(x), calls=2, parts=parts, planes="/host:CPU")
    timed = collections.Counter()
    for line in summary.values():
        timed.update({part: p["ms_per_call"] for part, p in line["parts"].items()})
    assert timed["first"] > 0 and timed["second"] > 0


@pytest.mark.parametrize("calls", [0, 1.5])
def test_calls_must_be_a_positive_int(calls):
    with pytest.raises(ValueError, match="calls must be an int >= 1"):
        profiling.summarize([], calls)
    with pytest.raises(ValueError, match="calls must be an int >= 1"):
        profiling.device_op_times(lambda: jnp.ones(1), calls)


def test_device_op_times_traces_without_a_device_plane_on_cpu():
    x = jnp.ones((64, 64))
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    assert profiling.device_op_times(lambda: f(x), calls=2) == {}
    assert profiling.format_summary({}) == "    (no device trace on this backend)"
