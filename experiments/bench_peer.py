"""Our target forward against the best outside alternative, in one process on one GPU.

The alternative is the same Qwen3 forward written plainly in PyTorch (random bf16 weights of the
same shapes, a static KV cache per layer, masked ``scaled_dot_product_attention`` over each KV head),
compiled with ``torch.compile`` in each of ``--torch-modes`` (``max-autotune-no-cudagraphs``:
autotuned Triton/cuBLAS matmuls; ``default``: cuBLAS) and captured whole in one CUDA graph that is
replayed; the fastest mode is the peer. Ours is ``target_forward`` as the engine runs it (``auto``
kernels, the cache donated). Each case is M new tokens per request (M = 1 is the decode step, M > 1
a tree verify with a chain mask, which costs what any tree mask of M nodes costs) at a batch and a
context. Both sides are timed by wall clock in two ways: one call then a synchronize (ours pays a
jit dispatch, theirs a graph launch), and ``--steps`` steps back to back (ours in a ``lax.fori_loop``
of greedy steps in one call, as `generate` runs its rounds; theirs as queued graph replays). The
device's streaming bandwidth is measured in the same run (a device-to-device copy, bytes read and
written) and gives the floor: the weight bytes over it. Prints a line per case, writes JSON.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python experiments/bench_peer.py --cases 1:1,1:16,1:64,8:1
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from ddtree_jax.experiments.bench import make_models, median_ms, streamed_bytes
from ddtree_jax.experiments.provenance import command_line
from ddtree_jax.models import KVCache, init_cache, target_forward


def random_weights(cfg, device, dtype=torch.bfloat16) -> dict:
    """Random Qwen3 weights in PyTorch's ``[out, in]`` layout (``nn.Linear``'s), q/k/v and gate/up fused."""
    d, dh, hq, hkv, inter = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.intermediate_size)
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def norm(size):
        return (1.0 + torch.randn(size, generator=gen, device=device) * 0.1).to(dtype)

    return dict(embed=weight(cfg.vocab_size, d), final_norm=norm(d), lm_head=weight(cfg.vocab_size, d),
                layers=[dict(input_norm=norm(d), wqkv=weight((hq + 2 * hkv) * dh, d), q_norm=norm(dh),
                             k_norm=norm(dh), wo=weight(d, hq * dh), post_norm=norm(d),
                             w_gate_up=weight(2 * inter, d), w_down=weight(d, inter))
                        for _ in range(cfg.num_hidden_layers)])


def weights_from(target) -> dict:
    """Our target's weights (untied) in the ``[out, in]`` layout of `random_weights`, on the CPU."""
    def t(x, transpose=True):
        array = torch.from_numpy(np.array(x, np.float32))  # a writable copy: a view of a jax array is read-only
        return array.T.contiguous() if transpose else array

    p = target.params
    return dict(embed=t(p.embed, False), final_norm=t(p.final_norm, False), lm_head=t(p.lm_head),
                layers=[dict(input_norm=t(layer.input_norm, False), wqkv=t(layer.wqkv), q_norm=t(layer.q_norm, False),
                             k_norm=t(layer.k_norm, False), wo=t(layer.wo), post_norm=t(layer.post_norm, False),
                             w_gate_up=t(layer.w_gate_up), w_down=t(layer.w_down)) for layer in p.layers])


class TorchQwen3(torch.nn.Module):
    """A Qwen3 decoder stack with a static KV cache per layer (``[B, Hkv, S, Dh]`` buffers, as gpt-fast
    keeps them): ``forward(tokens [B, M], start)`` writes the M new keys/values at slots
    ``[start, start + M)`` and returns the float32 logits of the M tokens (prefix visible, new tokens
    causal among themselves). Grouped-query attention runs as plain attention over each KV head with
    its G query heads stacked as ``G * M`` rows, so the fused masked SDPA kernels apply."""

    def __init__(self, cfg, weights: dict, batch: int, slots: int):
        super().__init__()
        self.cfg = cfg
        self.embed, self.final_norm, self.lm_head = weights["embed"], weights["final_norm"], weights["lm_head"]
        self.layers = weights["layers"]
        shape = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
        for i in range(cfg.num_hidden_layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, device=self.embed.device, dtype=self.embed.dtype))
            self.register_buffer(f"v{i}", torch.zeros(shape, device=self.embed.device, dtype=self.embed.dtype))
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=self.embed.device, dtype=torch.float32)
                                                  * 2 / cfg.head_dim))

    def _norm(self, x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype)

    @staticmethod
    def _rope(x, cos, sin):
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def forward(self, tokens, start):
        cfg = self.cfg
        batch, num = tokens.shape
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        group = hq // hkv
        slots = self.k0.shape[2]
        positions = start + torch.arange(num, device=tokens.device)
        angle = positions.float()[:, None] * self.inv_freq  # [M, Dh/2], shared by every layer
        cos, sin = angle.cos(), angle.sin()
        key_pos = torch.arange(slots, device=tokens.device)
        mask = (key_pos[None, :] <= positions[:, None]).repeat(group, 1)  # [G * M, S]: prefix + causal new
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            qkv = self._norm(x, layer["input_norm"]) @ layer["wqkv"].T
            q, k, v = qkv.split([hq * dh, hkv * dh, hkv * dh], dim=-1)
            q = self._rope(self._norm(q.view(batch, num, hq, dh), layer["q_norm"]), cos[:, None], sin[:, None])
            k = self._rope(self._norm(k.view(batch, num, hkv, dh), layer["k_norm"]), cos[:, None], sin[:, None])
            k_cache.index_copy_(2, positions, k.transpose(1, 2))
            v_cache.index_copy_(2, positions, v.view(batch, num, hkv, dh).transpose(1, 2))
            q = q.view(batch, num, hkv, group, dh).permute(0, 2, 3, 1, 4).reshape(batch, hkv, group * num, dh)
            attn = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
            attn = attn.view(batch, hkv, group, num, dh).permute(0, 3, 1, 2, 4).reshape(batch, num, hq * dh)
            x = x + attn @ layer["wo"].T
            gate, up = (self._norm(x, layer["post_norm"]) @ layer["w_gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w_down"].T
        return (self._norm(x, self.final_norm) @ self.lm_head.T).float()


def _replay_ms(graph, count: int) -> float:
    """Wall ms a replay of ``count`` replays of ``graph`` queued back to back, then a synchronize."""
    begin = time.perf_counter()
    for _ in range(count):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) * 1e3 / count


def torch_step_ms(cfg, batch, num, context, repeats, mode, steps):
    """The compiled PyTorch forward captured in one CUDA graph: median ms of one replay + synchronize
    from Python, median ms a step of ``steps`` replays back to back, and the first calls' seconds."""
    device = torch.device("cuda")
    slots = -(-(context + num) // 64) * 64  # a multiple of 64: the fused masked SDPA wants aligned rows
    model = TorchQwen3(cfg, random_weights(cfg, device), batch, slots)
    tokens = torch.zeros(batch, num, dtype=torch.long, device=device)
    start = torch.tensor(context, device=device)
    started = time.perf_counter()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            compiled(tokens, start)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(tokens, start)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            compiled(tokens, start)
        call = [_replay_ms(graph, 1) for _ in range(repeats + 3)][3:]
        looped = [_replay_ms(graph, steps) for _ in range(5)]
    del graph, compiled, model
    torch.cuda.empty_cache()
    return float(np.median(call)), float(np.median(looped)), first_s


def jax_step_ms(target, batch, num, context, repeats, steps):
    """Our jitted target forward (``auto`` kernels, the cache donated as in the engine): median ms of
    one call, median ms a step of a ``lax.fori_loop`` of ``steps`` greedy steps in one call (each
    step's tokens the previous step's argmax, as `generate`'s device loop runs rounds), first call s."""
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, context + num + 1, cfg.head_dim,
                       target.dtype)
    box = [KVCache(cache.k, cache.v, jnp.full((batch,), context, jnp.int32))]
    tokens = jnp.zeros((batch, num), jnp.int32)
    positions = context + jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((num, num), bool)), (batch, num, num))

    def forward(t, tokens_BM, c):
        return target_forward(t, tokens_BM, positions, mask, c, attention_impl="auto", matmul_impl="auto")[::2]

    step = jax.jit(lambda t, c: forward(t, tokens, c), donate_argnums=1)

    @functools.partial(jax.jit, donate_argnums=1)
    def loop(t, c):
        def body(_, carry):
            logits, c = forward(t, *carry)
            return jnp.argmax(logits, -1).astype(jnp.int32), c
        return jax.lax.fori_loop(0, steps, body, (tokens, c))

    def run():
        logits, box[0] = step(target, box[0])
        return logits

    def run_loop():
        out, box[0] = loop(target, box[0])
        return out

    started = time.perf_counter()
    jax.block_until_ready(run())
    first_s = time.perf_counter() - started
    call = median_ms(run, repeats)
    return call, median_ms(run_loop, 5) / steps, first_s


def copy_tbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written) of 4 GiB, the device's streaming ceiling."""
    x = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    del x, y
    torch.cuda.empty_cache()
    return 2 * (1 << 32) / (np.median(times) * 1e-3) / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="1:1,1:16,1:64,8:1", help="comma-separated BATCH:M pairs (default: %(default)s)")
    p.add_argument("--context", type=int, default=1024, help="committed tokens in the cache (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=30, help="timed single calls per case (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20,
                   help="steps per call in the back-to-back measure (default: %(default)s)")
    p.add_argument("--torch-modes", default="max-autotune-no-cudagraphs,default",
                   help="comma-separated torch.compile modes, each timed; the fastest is the peer "
                        "(default: %(default)s)")
    p.add_argument("--skip-torch", action="store_true", help="time only our forward")
    p.add_argument("--out", type=Path, default=Path("bench_peer.json"), help="JSON output (default: %(default)s)")
    args = p.parse_args(argv)
    modes = [] if args.skip_torch else args.torch_modes.split(",")
    target, _ = make_models("qwen3-8b")
    weight_gb = streamed_bytes(target) / 1e9
    tbps = copy_tbps()
    floor_ms = weight_gb / tbps
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}; "
          f"copy bandwidth {tbps:.2f} TB/s, weights {weight_gb:.2f} GB, floor {floor_ms:.2f} ms", flush=True)
    print("ms a step: one call (dispatch + synchronize) / back to back (steps in one call or queued replays)")
    rows = []
    for case in args.cases.split(","):
        batch, num = (int(v) for v in case.split(":"))
        call, looped, first = jax_step_ms(target, batch, num, args.context, args.repeats, args.steps)
        row = dict(batch=batch, m=num, context=args.context, floor_ms=floor_ms,
                   ours=dict(call_ms=call, back_to_back_ms=looped, first_call_s=first), torch={})
        line = f"batch {batch} M {num:3d}: ours {call:5.2f} / {looped:5.2f} ({looped / floor_ms:.2f}x floor)"
        for mode in modes:
            t_call, t_looped, t_first = torch_step_ms(target.config, batch, num, args.context, args.repeats,
                                                      mode, args.steps)
            row["torch"][mode] = dict(call_ms=t_call, back_to_back_ms=t_looped, first_call_s=t_first)
            line += f" | torch {mode} {t_call:5.2f} / {t_looped:5.2f} (first call {t_first:.0f} s)"
        if modes:
            best = min(row["torch"].values(), key=lambda r: r["back_to_back_ms"])
            row["peer_over_ours"] = dict(call=best["call_ms"] / call, back_to_back=best["back_to_back_ms"] / looped)
            line += f" | best peer / ours {row['peer_over_ours']['back_to_back']:.2f}x back to back"
        rows.append(row)
        print(line, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                                                      torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                                                      command=command_line(), copy_tbps=tbps,
                                                      weight_gb=weight_gb), rows=rows), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
