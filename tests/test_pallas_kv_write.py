"""The K/V cache-write kernel vs its jnp reference and a NumPy loop (Pallas interpreter on CPU), its
Triton lowering, and the dispatch that picks it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax import kernels
from pallas_kernels import configs
from pallas_kernels.kv_write import _kv_write, kv_write
from pallas_kernels.kv_write_reference import kv_write_reference
from pallas_kernels.lowering import verified_triton_modules


def numpy_write(cache_LBKSD, layer, new_BNKD, lengths_B):
    """The contract, one token at a time."""
    out = np.array(cache_LBKSD, np.float32)
    for b, length in enumerate(lengths_B):
        for n in range(new_BNKD.shape[1]):
            if length + n < out.shape[3]:
                out[layer, b, :, length + n] = new_BNKD[b, n]
    return out


def operands(seed, layers, batch, num, kv_heads, slots, head_dim, lengths, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(seed), 4)
    caches = [jax.random.normal(key, (layers, batch, kv_heads, slots, head_dim), dtype) for key in k[:2]]
    new = [jax.random.normal(key, (batch, num, kv_heads, head_dim), jnp.float32) for key in k[2:]]
    return (*caches, *new, jnp.asarray(lengths, jnp.int32))


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 3), batch=st.integers(1, 3), num=st.integers(1, 6), log_kv=st.integers(0, 2),
       log_dim=st.integers(1, 4), slots=st.integers(1, 12), seed=st.integers(0, 2**16), data=st.data())
def test_interpret_equals_reference_and_numpy(layers, batch, num, log_kv, log_dim, slots, seed, data):
    """Every slot the kernel writes is the reference's, bit for bit, including the slots past the end
    of the cache (lengths up to ``slots + 2``), which are dropped."""
    lengths = data.draw(st.lists(st.integers(0, slots + 2), min_size=batch, max_size=batch))
    layer = data.draw(st.integers(0, layers - 1))
    args = operands(seed, layers, batch, num, 1 << log_kv, slots, 2 << log_dim, lengths)
    outs = kv_write(*args, layer=layer, interpret=True)
    refs = kv_write_reference(*args, layer=layer)
    for out, ref, cache, new in zip(outs, refs, args[:2], args[2:4], strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype == cache.dtype
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
        want = numpy_write(cache, layer, np.asarray(new.astype(cache.dtype), np.float32), lengths)
        np.testing.assert_array_equal(np.asarray(out, np.float32), want)


def test_jitted_with_the_caches_donated():
    """Inside a jitted forward the caches are updated in place (the outputs alias the donated inputs)."""
    args = operands(3, 2, 2, 3, 2, 9, 8, [1, 7])
    want = kv_write_reference(*args, layer=1)
    write = jax.jit(functools.partial(kv_write, layer=1, interpret=True), donate_argnums=(0, 1))
    for out, ref in zip(write(*args), want, strict=True):
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_bad_operands_are_named():
    args = operands(0, 2, 1, 1, 2, 4, 8, [0])
    with pytest.raises(ValueError, match="layer must be in"):
        kv_write(*args, layer=2, interpret=True)
    with pytest.raises(ValueError, match="k_BNKD must be"):
        kv_write(*args[:2], args[2][:, :, :1], *args[3:], layer=0, interpret=True)
    with pytest.raises(ValueError, match="lengths_B must be"):
        kv_write(*args[:4], jnp.zeros((2,), jnp.int32), layer=0, interpret=True)
    odd = operands(0, 1, 1, 1, 3, 4, 8, [0])  # three key/value heads
    with pytest.raises(ValueError, match="powers of two"):
        kv_write(*odd, layer=0, interpret=True)


def test_triton_lowering_uses_64_bit_offsets_for_large_caches():
    """At Qwen3-8B heads with 8 requests of 8,400 slots the stacked caches hold more than 2**31
    elements each: the lowered module verifies and addresses them with 64-bit offsets."""
    sds = jax.ShapeDtypeStruct
    big, new = sds((36, 8, 8, 8400, 128), jnp.bfloat16), sds((8, 17, 8, 128), jnp.bfloat16)
    [module] = verified_triton_modules(functools.partial(_kv_write, layer=35, interpret=False), big, big, new, new,
                                       sds((8,), jnp.int32))
    assert "tensor<8x128xi64>" in module


def test_dispatch_follows_the_attention_switch(monkeypatch):
    """``auto`` is the reference off a GPU; the kernel runs for ``pallas``/``interpret`` where it applies,
    never under a mesh."""
    from ddtree_jax.sharding import make_mesh
    assert kernels.kv_write_fn("auto") is kv_write_reference
    assert kernels.kv_write_fn("xla") is kv_write_reference
    assert kernels.kv_write_fn("interpret", make_mesh(1, 1)) is kv_write_reference
    calls = []
    monkeypatch.setattr(kernels, "kv_write", lambda *a, interpret, layer: calls.append((interpret, layer)) or "triton")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))
    args = operands(1, 2, 1, 2, 2, 6, 8, [3])
    assert kernels.kv_write_fn("auto")(*args, layer=1) == "triton"
    assert kernels.kv_write_fn("interpret")(*args, layer=0) == "triton"
    assert calls == [(False, 1), (True, 0)]
    odd = operands(1, 2, 1, 2, 3, 6, 8, [3])  # three key/value heads: the reference
    for got, want in zip(kernels.kv_write_fn("pallas")(*odd, layer=1), kv_write_reference(*odd, layer=1), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        kernels.kv_write_fn("cuda")


def test_gpu_equality_script_runs_interpreted(monkeypatch):
    """`experiments/check_kernels.py`'s kv_write part on small cases through the interpreter, and a
    wrong kernel fails it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from experiments import check_kernels

    cases = [(2, 2, 3, 2, 16, 8, [0, 6], "bfloat16"), (1, 1, 1, 1, 8, 4, [2], "float32")]
    assert [r["ok"] for r in check_kernels.check_kv_write(interpret=True, cases=cases)] == [True, True]

    def one_slot_late(k, v, k_new, v_new, lengths_B, *, layer):
        return kv_write_reference(k, v, k_new, v_new, lengths_B + 1, layer=layer)

    monkeypatch.setattr(kernels, "kv_write_fn", lambda impl: one_slot_late)
    assert not any(r["ok"] for r in check_kernels.check_kv_write(interpret=True, cases=cases))
