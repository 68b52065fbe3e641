"""Where a DDTree round's time goes, side by side with plain decoding and the HBM roofline.

Part 1 (``--shapes qwen3-8b``): a Qwen3-8B-shaped target and a 5-layer DFlash-shaped drafter with
random bf16 weights, per batch and context: one AR decode step (the engine's AR round), one whole
DDTree round per budget, and each part of the round run alone under jit (drafter forward, tree build
+ encoding, verify forward, verification/sampling, commit). Caches are zero-filled with the given
context length: the cost of a round does not depend on the cached values.
Part 2 (``--embedded``): tokens/s and tau of AR, chain and DDTree on the embedded pair, with the
speedup over AR measured in the same process.

    python experiments/bench_e2e.py --out experiments/results/bench_e2e.json
    python experiments/bench_e2e.py --shapes tiny --contexts 64 --budgets 4,8 --repeats 2   # CPU check
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax import engine  # noqa: E402
from ddtree_jax.models import (  # noqa: E402
    DFlashConfig, KVCache, Qwen3Config, commit, drafter_forward, init_cache, init_drafter, init_target,
    target_forward,
)
from ddtree_jax.sampling import coins_from_keys, request_keys  # noqa: E402
from ddtree_jax.tree import build_tree_unchecked, tree_attention_mask, tree_positions  # noqa: E402
from ddtree_jax.verify import verify_from_coins  # noqa: E402
from experiments.common import median_ms  # noqa: E402

SHAPES = {
    "qwen3-8b": dict(
        target=dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072),
        drafter=dict(num_hidden_layers=5, block_size=16, target_layer_ids=(1, 9, 17, 25, 33))),
    "tiny": dict(
        target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192),
        drafter=dict(num_hidden_layers=1, block_size=8, target_layer_ids=(0, 3))),
}


def weight_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def make_models(shapes: str):
    s = SHAPES[shapes]
    tc = Qwen3Config(**s["target"])
    t = s["target"]
    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim")
    dc = DFlashConfig(**{k: t[k] for k in shared}, mask_token_id=t["vocab_size"] - 1,
                      num_target_layers=t["num_hidden_layers"], **s["drafter"])
    return init_target(tc, jax.random.key(0)), init_drafter(dc, jax.random.key(1))


def make_state(target, drafter, spec, batch, context, max_new=4096) -> engine.DecodeState:
    """A decode state whose caches hold ``context`` committed (zero) slots per request."""
    tc, dc = target.config, drafter.config
    max_len = context + max_new + spec.num_nodes + spec.depth + 1

    def cache(cfg, layers):
        c = init_cache(layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim, jnp.bfloat16)
        return KVCache(c.k, c.v, jnp.full((batch,), context, jnp.int32))

    feats = len(dc.target_layer_ids) * tc.hidden_size
    return engine.DecodeState(
        target_cache=cache(tc, tc.num_hidden_layers),
        drafter_cache=cache(dc, dc.num_hidden_layers) if spec.method != "ar" else None,
        root=jnp.zeros((batch,), jnp.int32),
        ctx_feats=jnp.zeros((batch, spec.depth + 1, feats if spec.method != "ar" else 0), jnp.bfloat16),
        ctx_count=jnp.full((batch,), min(4, spec.depth + 1), jnp.int32),
        tokens=jnp.full((batch, max_new + spec.depth + 1), -1, jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        round=jnp.zeros((), jnp.int32),
    )


def time_round(target, drafter, spec, state, temperature, repeats):
    """Median ms of the engine's whole round (state threaded through, as generate does)."""
    batch = state.root.shape[0]
    sampling = engine.SamplingParams(jnp.full((batch,), temperature), jnp.zeros((batch,), jnp.int32),
                                     jnp.ones((batch,)))
    args = (sampling, jax.random.key(0), jnp.arange(batch, dtype=jnp.int32), jnp.float32(1.0),
            jnp.array([-2], jnp.int32))
    step = functools.partial(engine.decode_round, spec=spec, max_new_tokens=10**6, with_expected=False)
    box = [state]

    def run():
        box[0], out = step(target, drafter if spec.method != "ar" else None, box[0], *args)
        return out

    return median_ms(run, repeats)


def time_parts(target, drafter, spec, state, temperature, repeats) -> dict[str, float]:
    """Each step of a DDTree round alone, under jit, on the same inputs."""
    batch = state.root.shape[0]
    lengths = state.target_cache.lengths
    c = state.ctx_feats.shape[1]
    ctx_pos = (lengths - state.ctx_count)[:, None] + jnp.arange(c)[None, :]
    draft = jax.jit(drafter_forward)
    draft_logits, _ = draft(drafter, target, state.drafter_cache, state.ctx_feats, ctx_pos, state.ctx_count,
                            state.root, lengths)

    @jax.jit
    def build(draft_logits, root):
        tree = build_tree_unchecked(draft_logits, root, jnp.float32(1.0), budget=spec.budget, topk_cap=spec.topk_cap)
        return tree, tree_attention_mask(tree), tree_positions(tree, lengths)

    tree, mask, positions = build(draft_logits, state.root)
    fwd = jax.jit(functools.partial(target_forward, tap_layers=spec.tap_layers))
    logits, taps, cache = fwd(target, tree.tokens, positions, mask, state.target_cache)

    @jax.jit
    def sample(tree, logits):
        coins, final = coins_from_keys(request_keys(jax.random.key(0), jnp.arange(batch), 0), logits.shape[1])
        t = jnp.full((batch,), temperature)
        return verify_from_coins(tree, logits, coins, final, t, jnp.zeros((batch,), jnp.int32), jnp.ones((batch,)))

    res = sample(tree, logits)

    @jax.jit
    def keep(cache, taps, accept_index, num_accepted):
        rows = jnp.arange(taps.shape[0])[:, None]
        return commit(cache, accept_index, num_accepted + 1), taps[rows, jnp.maximum(accept_index, 0)]

    return dict(
        drafter_ms=median_ms(lambda: draft(drafter, target, state.drafter_cache, state.ctx_feats, ctx_pos,
                                           state.ctx_count, state.root, lengths)[0], repeats),
        tree_ms=median_ms(lambda: build(draft_logits, state.root), repeats),
        verify_forward_ms=median_ms(lambda: fwd(target, tree.tokens, positions, mask, state.target_cache)[0],
                                    repeats),
        sampling_ms=median_ms(lambda: sample(tree, logits), repeats),
        commit_ms=median_ms(lambda: keep(cache, taps, res.accept_index, res.num_accepted), repeats),
    )


def bench_shapes(args) -> list[dict]:
    target, drafter = make_models(args.shapes)
    hbm = args.hbm_tbps * 1e12
    lm_head = target.params.get("lm_head", target.params["embed"])
    target_bytes = weight_bytes({k: v for k, v in target.params.items() if k != "embed"})
    if target.config.tie_word_embeddings:
        target_bytes += weight_bytes(lm_head)
    decode_floor = 1e3 * target_bytes / hbm
    round_floor = 1e3 * (target_bytes + weight_bytes(drafter.params) + weight_bytes(lm_head)) / hbm
    print(f"decode roofline {decode_floor:.2f} ms, DDTree round floor {round_floor:.2f} ms")
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            ar = engine.make_spec(target, None, "ar", 1, None)
            decode_ms = time_round(target, drafter, ar, make_state(target, drafter, ar, batch, context),
                                   args.temperature, args.repeats)
            print(f"batch {batch} context {context}: decode step {decode_ms:.2f} ms "
                  f"({decode_ms / decode_floor:.2f}x roofline)", flush=True)
            for budget in map(int, args.budgets.split(",")):
                spec = engine.make_spec(target, drafter, "ddtree", budget, args.topk_cap or None)
                state = make_state(target, drafter, spec, batch, context)
                parts = time_parts(target, drafter, spec, state, args.temperature, args.repeats)
                round_ms = time_round(target, drafter, spec, state, args.temperature, args.repeats)
                row = dict(batch=batch, context=context, budget=budget, decode_ms=decode_ms, round_ms=round_ms,
                           decode_roofline_ms=decode_floor, round_floor_ms=round_floor, **parts)
                row["round_over_decode"] = round_ms / decode_ms  # = the break-even tau
                row["core_share"] = (parts["tree_ms"] + parts["sampling_ms"]) / round_ms
                rows.append(row)
                print(f"  B={budget:4d}: round {round_ms:7.2f} ms = {row['round_over_decode']:.2f} decode steps | "
                      + " ".join(f"{k[:-3]} {v:.2f}" for k, v in parts.items())
                      + f" | build+sampling {100 * row['core_share']:.1f}% of the round", flush=True)
    return rows


def bench_embedded(args) -> list[dict]:
    from ddtree_jax import corpus
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.cli import DEFAULT_DRAFTER, DEFAULT_TARGET
    from ddtree_jax.tokenizer import Tokenizer

    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    target, drafter = load_target(DEFAULT_TARGET, dtype), load_drafter(DEFAULT_DRAFTER, dtype)
    prompts = corpus.heldout_prompts(Tokenizer.from_file(DEFAULT_TARGET / "tokenizer.json"), 8, 64, seed=0)
    rows = []
    for batch in (1, 8):
        for temperature in (0.0, 1.0):
            base = None
            for method, budget in (("ar", 1), ("chain", 1), ("ddtree", 64)):
                kw = dict(method=method, budget=budget, topk_cap=None, temperature=temperature,
                          max_new_tokens=args.new_tokens, with_expected=False)
                generate = functools.partial(engine.generate, target, drafter, prompts[:batch], **kw)
                generate(max_new_tokens=8)  # compile outside the timed call
                res = generate()
                base = base or res.tokens_per_s
                rows.append(dict(batch=batch, temperature=temperature, method=method, budget=budget, tau=res.tau,
                                 tokens_per_s=res.tokens_per_s, speedup_over_ar=res.tokens_per_s / base))
                print(f"embedded batch {batch} T={temperature:g} {method:>6}: tau {res.tau:.2f}, "
                      f"{res.tokens_per_s:,.0f} tokens/s, {res.tokens_per_s / base:.2f}x AR", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--budgets", default="16,64,256,512")
    ap.add_argument("--topk-cap", type=int, default=0, help="0 = none")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--embedded", action="store_true", help="also run part 2 on the embedded pair")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/bench_e2e.json"))
    args = ap.parse_args(argv)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    result = dict(meta=dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                            command=" ".join(sys.argv)),
                  shapes=bench_shapes(args), embedded=bench_embedded(args) if args.embedded else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
