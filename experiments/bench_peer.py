"""Our target forward against the best outside alternative, in one process on one GPU.

The alternative is the same Qwen3 forward written plainly in PyTorch (random bf16 weights of the
same shapes, a static KV cache, ``scaled_dot_product_attention`` with a boolean mask), compiled with
``torch.compile(mode="max-autotune-no-cudagraphs")`` (Triton-generated matmuls) and captured whole
in one CUDA graph that is replayed. Ours is ``target_forward`` as the engine runs it (``auto``
kernels). Each case is M new tokens per request (M = 1 is the decode step, M > 1 a tree verify with
a chain mask, which costs what any tree mask of M nodes costs) at a batch and a context; the
device's streaming bandwidth is measured in the same run (a device-to-device copy, bytes read and
written) and gives the floor: the weight bytes over it. Medians of ``--repeats`` timed calls after
warm-up; CUDA events for PyTorch, ``block_until_ready`` wall time for JAX. Prints a table, writes JSON.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python experiments/bench_peer.py --cases 1:1,1:16,1:64,8:1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from ddtree_jax.experiments.bench import make_models, median_ms, streamed_bytes
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
        array = torch.from_numpy(np.asarray(x, np.float32))
        return array.T.contiguous() if transpose else array

    p = target.params
    return dict(embed=t(p.embed, False), final_norm=t(p.final_norm, False), lm_head=t(p.lm_head),
                layers=[dict(input_norm=t(layer.input_norm, False), wqkv=t(layer.wqkv), q_norm=t(layer.q_norm, False),
                             k_norm=t(layer.k_norm, False), wo=t(layer.wo), post_norm=t(layer.post_norm, False),
                             w_gate_up=t(layer.w_gate_up), w_down=t(layer.w_down)) for layer in p.layers])


class TorchQwen3(torch.nn.Module):
    """A Qwen3 decoder stack with a static KV cache ``[layers, 2, B, Hkv, S, Dh]``: ``forward(tokens
    [B, M], start)`` writes the M new keys/values at slots ``[start, start + M)`` and returns the
    float32 logits of the M tokens (prefix visible, new tokens causal among themselves)."""

    def __init__(self, cfg, weights: dict, batch: int, slots: int):
        super().__init__()
        self.cfg = cfg
        self.embed, self.final_norm, self.lm_head = weights["embed"], weights["final_norm"], weights["lm_head"]
        self.layers = weights["layers"]
        self.cache = torch.zeros(cfg.num_hidden_layers, 2, batch, cfg.num_key_value_heads, slots, cfg.head_dim,
                                 device=self.embed.device, dtype=self.embed.dtype)
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=self.embed.device, dtype=torch.float32)
                                                  * 2 / cfg.head_dim))

    def _norm(self, x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype)

    def _rope(self, x, positions):
        angle = positions.float()[..., None] * self.inv_freq  # [B, M, Dh/2]
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def forward(self, tokens, start):
        cfg = self.cfg
        batch, num = tokens.shape
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        slots = self.cache.shape[4]
        positions = start + torch.arange(num, device=tokens.device)[None, :].expand(batch, num)
        key_pos = torch.arange(slots, device=tokens.device)
        mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # prefix and causal new tokens
        new_slots = start + torch.arange(num, device=tokens.device)
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer["input_norm"])
            qkv = h @ layer["wqkv"].T
            q, k, v = qkv.split([hq * dh, hkv * dh, hkv * dh], dim=-1)
            q = self._rope(self._norm(q.view(batch, num, hq, dh), layer["q_norm"]).transpose(1, 2), positions)
            k = self._rope(self._norm(k.view(batch, num, hkv, dh), layer["k_norm"]).transpose(1, 2), positions)
            self.cache[i, 0].index_copy_(2, new_slots, k)
            self.cache[i, 1].index_copy_(2, new_slots, v.view(batch, num, hkv, dh).transpose(1, 2))
            attn = F.scaled_dot_product_attention(q, self.cache[i, 0], self.cache[i, 1], attn_mask=mask,
                                                  enable_gqa=True)
            x = x + attn.transpose(1, 2).reshape(batch, num, hq * dh) @ layer["wo"].T
            gate, up = (self._norm(x, layer["post_norm"]) @ layer["w_gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w_down"].T
        return (self._norm(x, self.final_norm) @ self.lm_head.T).float()


def torch_step_ms(cfg, batch, num, context, repeats):
    """Median ms of one replay of the compiled, graph-captured PyTorch forward, and its first-call s."""
    device = torch.device("cuda")
    model = TorchQwen3(cfg, random_weights(cfg, device), batch, context + num + 1)
    tokens = torch.zeros(batch, num, dtype=torch.long, device=device)
    start = torch.tensor(context, device=device)
    started = time.perf_counter()
    compiled = torch.compile(model, mode="max-autotune-no-cudagraphs", fullgraph=True)
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
        times = []
        for _ in range(repeats + 3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
    del graph, compiled, model
    torch.cuda.empty_cache()
    return float(np.median(times[3:])), first_s


def jax_step_ms(target, batch, num, context, repeats):
    """Median ms of our jitted target forward (``auto`` kernels, the cache donated as in the engine)."""
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, context + num + 1, cfg.head_dim,
                       target.dtype)
    box = [KVCache(cache.k, cache.v, jnp.full((batch,), context, jnp.int32))]
    tokens = jnp.zeros((batch, num), jnp.int32)
    positions = context + jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((num, num), bool)), (batch, num, num))
    step = jax.jit(lambda t, c: target_forward(t, tokens, positions, mask, c, attention_impl="auto",
                                               matmul_impl="auto")[::2], donate_argnums=1)

    def run():
        logits, box[0] = step(target, box[0])
        return logits

    started = time.perf_counter()
    jax.block_until_ready(run())
    first_s = time.perf_counter() - started
    return median_ms(run, repeats), first_s


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
    p.add_argument("--cases", default="1:1,1:16,1:64,8:1", help="comma-separated BATCH:M pairs")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench_peer.json"))
    args = p.parse_args(argv)
    target, _ = make_models("qwen3-8b")
    weight_gb = streamed_bytes(target) / 1e9
    tbps = copy_tbps()
    floor_ms = weight_gb / tbps
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}; "
          f"copy bandwidth {tbps:.2f} TB/s, weights {weight_gb:.2f} GB, floor {floor_ms:.2f} ms", flush=True)
    rows = []
    for case in args.cases.split(","):
        batch, num = (int(v) for v in case.split(":"))
        ours, ours_first = jax_step_ms(target, batch, num, args.context, args.repeats)
        row = dict(batch=batch, m=num, context=args.context, ours_ms=ours, ours_first_call_s=ours_first,
                   floor_ms=floor_ms, ours_over_floor=ours / floor_ms)
        if not args.skip_torch:
            theirs, theirs_first = torch_step_ms(target.config, batch, num, args.context, args.repeats)
            row.update(torch_ms=theirs, torch_first_call_s=theirs_first, torch_over_ours=theirs / ours)
        rows.append(row)
        print(f"batch {batch} M {num:3d}: ours {ours:6.2f} ms ({ours / floor_ms:.2f}x floor)"
              + (f" | torch.compile + CUDA graph {row['torch_ms']:6.2f} ms ({row['torch_ms'] / floor_ms:.2f}x floor;"
                 f" ours {row['torch_over_ours']:.2f}x faster) | first calls {ours_first:.0f} s / {theirs_first:.0f} s"
                 if "torch_ms" in row else ""), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                                                      torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                                                      command=" ".join(sys.argv), copy_tbps=tbps,
                                                      weight_gb=weight_gb), rows=rows), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
