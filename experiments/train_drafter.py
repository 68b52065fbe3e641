"""Train a DFlash drafter against a frozen target (the DFlash recipe, docs/design.md "Training the drafter").

    python experiments/train_drafter.py --target runs/target --out runs/drafter --max-minutes 7
    python experiments/train_drafter.py --tiny --target /tmp/target --out /tmp/drafter

Per training sequence x (length S), A anchors a are drawn in [1, S - block_size]; anchor a gives
the block [x[a], MASK x (block_size - 1)] at positions a .. a + block_size - 1. All blocks of a
sequence run at once under one mask: a block slot sees the target taps of context positions
c < a (strictly: the anchor's own features are not context) and the slots of its own block.
Slot k (1 <= k < block_size) is trained, with weight exp(-(k - 1) / gamma), to match the target's
own distribution of x[a + k] given x[:a + k] (KL from the target's logits, computed by the same
frozen target forward that gives the taps), mixed with the cross-entropy of x[a + k] itself by
--soft-weight. The target (and its embedding and LM head, shared by the drafter) is frozen.
Data (--data): the target's training corpus, or (the default) text the target writes itself: each
sequence a --gen-prompt-len prefix of the train split followed by the target's continuation at one
of --gen-temperatures (0 = greedy), in equal shares (generation stops at a third of --max-minutes).
Held-out metrics are measured the same way on continuations of held-out prompts, with anchors in the
generated part: per slot, how often the drafter's top-1 equals the target's argmax, and the mean run
of agreeing slots from slot 1 (on greedy continuations that run is the number of drafts a T = 0
chain round accepts).
Writes to --out: the drafter in HF format (bf16), tokenizer.json, metrics.json (curves, per-slot
agreement, timing) and loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ddtree_jax.checkpoint import load_target, save_drafter
from ddtree_jax.experiments import corpus
from ddtree_jax.experiments.flags import float_list, non_negative_int_list
from ddtree_jax.models.cache import commit, init_cache
from ddtree_jax.models.dflash import (
    DFlashConfig,
    Drafter,
    drafter_head,
    drafter_hidden,
    init_drafter,
)
from ddtree_jax.models.qwen3 import Target, target_forward, target_forward_nocache
from experiments import common

TINY = {"layers": 1, "block_size": 4, "taps": "0,1", "seq_len": 32, "anchors": 4, "batch": 4, "steps": 8, "warmup": 2,
            "eval_every": 4, "eval_batches": 2, "max_files": 3, "log_every": 2, "gen_sequences": 8, "gen_batch": 4,
            "gen_prompt_len": 8}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target directory (train_target.py --out)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke-test settings: {TINY}")
    p.add_argument("--data", choices=["corpus", "generations"], default="generations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=12000)
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of slot k")
    p.add_argument("--soft-weight", type=float, default=1.0,
                   help="loss = w * KL(target || drafter) + (1 - w) * cross-entropy of the sequence's token")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--mlp", type=int, default=None, help="drafter MLP width (default: the target's)")
    p.add_argument("--taps", type=non_negative_int_list, default="1,3,5", help="comma-separated target layer ids")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gen-sequences", type=int, default=131072, help="--data generations: sequences to sample")
    p.add_argument("--gen-batch", type=int, default=2048)
    p.add_argument("--gen-prompt-len", type=int, default=64, help="corpus tokens that start each generation")
    p.add_argument("--gen-temperatures", type=float_list, default="0,1", help="comma-separated; 0 = greedy")
    common.add_training_arguments(p, eval_every=1000, eval_batches=4)
    args = common.parse_training_args(p, argv, TINY, ("steps", "batch", "anchors", "eval_every", "eval_batches",
                                                      "log_every", "gen_sequences", "gen_batch", "gen_prompt_len"))
    args.taps, args.gen_temperatures = tuple(args.taps), tuple(args.gen_temperatures)
    if not 0 <= args.soft_weight <= 1:
        raise ValueError(f"--soft-weight must be in [0, 1], got {args.soft_weight}")
    if args.data == "generations" and not 0 < args.gen_prompt_len < args.seq_len:
        raise ValueError(f"--gen-prompt-len must be in (0, --seq-len={args.seq_len}), got {args.gen_prompt_len}")
    room = args.seq_len - args.block_size - (args.gen_prompt_len - 2 if args.data == "generations" else 0)
    if room < args.anchors:
        raise ValueError(f"--anchors={args.anchors} needs {room} >= {args.anchors} anchor positions (--seq-len - "
                         f"--block-size, less --gen-prompt-len - 2 for --data generations)")
    return args


def drafter_config(args, target: Target, mask_token_id: int) -> DFlashConfig:
    """A drafter with the target's width, heads and RoPE, and the flags' depth, block and taps."""
    t = target.config
    return DFlashConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=args.mlp or t.intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim, block_size=args.block_size, target_layer_ids=args.taps,
        mask_token_id=mask_token_id, num_target_layers=t.num_hidden_layers,
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
        max_position_embeddings=t.max_position_embeddings)


# ----- the training batch: many anchor blocks per sequence under one mask -----

@dataclasses.dataclass(frozen=True)
class BlockBatch:
    """Drafter inputs and labels for A anchor blocks of size Q per sequence (S tokens).

    ``block_tokens [B, A*Q]`` (``[x[a], MASK, ...]`` per block), ``block_positions [B, A*Q]``
    (``a + slot``), ``mask [B, A*Q, S + A*Q]`` (context c visible iff ``c < a``; block slots
    visible iff in the same block), ``labels [B, A, Q-1]`` (``x[a + k]`` for slot k >= 1).
    """

    block_tokens: jax.Array
    block_positions: jax.Array
    mask: jax.Array
    labels: jax.Array


def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, num_anchors: int,
                   block_size: int, low: int = 1) -> np.ndarray:
    """``[batch, num_anchors]`` distinct sorted anchors per row, uniform in ``[low, seq_len - block_size]``
    (with ``low >= 1`` every anchor has a context token and all its labels inside the sequence)."""
    choices = np.arange(low, seq_len - block_size + 1)
    return np.sort(np.stack([rng.choice(choices, num_anchors, replace=False) for _ in range(batch)]), axis=1)


def block_batch(tokens_BS, anchors_BA, block_size: int, mask_token_id: int) -> BlockBatch:
    """Build the `BlockBatch` of sequences ``tokens [B, S]`` and anchors ``[B, A]`` (jnp, jit-able)."""
    batch, seq_len = tokens_BS.shape
    num_anchors = anchors_BA.shape[1]
    slot_Q = jnp.arange(block_size)
    pos_BAQ = anchors_BA[:, :, None] + slot_Q
    tokens_BAQ = jnp.where(slot_Q == 0, jnp.take_along_axis(tokens_BS, anchors_BA, axis=1)[:, :, None],
                           mask_token_id).astype(jnp.int32)
    labels_BAL = jnp.take_along_axis(tokens_BS[:, None, :], pos_BAQ[:, :, 1:], axis=2)
    ctx_BAS = jnp.arange(seq_len) < anchors_BA[:, :, None]
    same_block_AA = jnp.eye(num_anchors, dtype=bool)
    ctx_mask_BAQS = jnp.broadcast_to(ctx_BAS[:, :, None, :], (batch, num_anchors, block_size, seq_len))
    blk_mask_BAQAQ = jnp.broadcast_to(same_block_AA[None, :, None, :, None],
                                      (batch, num_anchors, block_size, num_anchors, block_size))
    mask = jnp.concatenate([ctx_mask_BAQS.reshape(batch, num_anchors * block_size, seq_len),
                            blk_mask_BAQAQ.reshape(batch, num_anchors * block_size, -1)], axis=-1)
    return BlockBatch(block_tokens=tokens_BAQ.reshape(batch, -1),
                      block_positions=pos_BAQ.reshape(batch, -1).astype(jnp.int32),
                      mask=mask, labels=labels_BAL.astype(jnp.int32))


def slot_weights(block_size: int, gamma: float) -> np.ndarray:
    """Loss weight ``exp(-(k - 1) / gamma)`` of slots k = 1 .. block_size - 1, float32 ``[block_size - 1]``."""
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


def draft_logits(drafter: Drafter, target: Target, tokens_BS, anchors_BA):
    """Logits of the drafted slots ``[B, A, Q-1, V]``, their labels ``[B, A, Q-1]`` (the sequence's
    tokens) and the target's logits for those tokens given the sequence before them ``[B, A, Q-1, V]``.

    One frozen target forward over the whole sequence gives both the context features (taps) and
    the target's logits (no gradient through either).
    """
    cfg = drafter.config
    batch, seq_len = tokens_BS.shape
    target_BSV, taps_BSF = jax.lax.stop_gradient(
        target_forward_nocache(target, tokens_BS, tap_layers=cfg.target_layer_ids))
    blocks = block_batch(tokens_BS, anchors_BA, cfg.block_size, cfg.mask_token_id)
    ctx_positions_BS = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    hidden_BKD = drafter_hidden(drafter, target, taps_BSF, ctx_positions_BS, blocks.block_tokens,
                                blocks.block_positions, blocks.mask)
    hidden_BAQD = hidden_BKD.reshape(batch, anchors_BA.shape[1], cfg.block_size, -1)
    logits_BALV = drafter_head(drafter, target, hidden_BAQD[:, :, 1:].reshape(batch, -1, cfg.hidden_size)).reshape(
        *blocks.labels.shape, -1)
    # Slot k's token sits at a + k; the target predicts it from position a + k - 1.
    before_BAL = anchors_BA[:, :, None] + jnp.arange(cfg.block_size - 1)
    return logits_BALV, blocks.labels, jax.vmap(lambda t_SV, i_AL: t_SV[i_AL])(target_BSV, before_BAL)


def drafter_loss(params, config: DFlashConfig, target: Target, tokens_BS, anchors_BA, weights_L, soft_weight,
                 compute_dtype):
    """Position-weighted loss ``sum_k w_k l_k / sum_k w_k`` averaged over blocks, with
    ``l_k = soft_weight * KL(target || drafter) + (1 - soft_weight) * CE(label)`` at slot k, and
    ``(correct, agree) [B, A, Q-1]``: whether the drafter's top-1 at slot k equals the label, and
    the target's argmax."""
    drafter = Drafter(config=config, params=common.cast_floats(params, compute_dtype))
    logits_BALV, labels_BAL, target_BALV = draft_logits(drafter, target, tokens_BS, anchors_BA)
    logq_BALV = jax.nn.log_softmax(logits_BALV.astype(jnp.float32))
    logp_BALV = jax.nn.log_softmax(target_BALV.astype(jnp.float32))
    kl_BAL = (jnp.exp(logp_BALV) * (logp_BALV - logq_BALV)).sum(-1)
    ce_BAL = -jnp.take_along_axis(logq_BALV, labels_BAL[..., None], axis=-1)[..., 0]
    loss_BAL = soft_weight * kl_BAL + (1 - soft_weight) * ce_BAL
    loss = (loss_BAL * weights_L).sum(-1).mean() / weights_L.sum()
    top1_BAL = jnp.argmax(logits_BALV, -1)
    return loss, (top1_BAL == labels_BAL, top1_BAL == jnp.argmax(target_BALV, -1))


def make_train_step(config: DFlashConfig, optimizer, weights_L, soft_weight: float, compute_dtype):
    """A jitted `(params, opt_state, lr, target, tokens_BS, anchors_BA) -> (params, opt_state, loss)`
    (state donated; ``optimizer`` from `common.make_optimizer`)."""

    def step(params, opt_state, lr, target, tokens_BS, anchors_BA):
        (loss, _), grads = jax.value_and_grad(drafter_loss, has_aux=True)(
            params, config, target, tokens_BS, anchors_BA, weights_L, soft_weight, compute_dtype)
        params, opt_state = common.apply_update(optimizer, grads, opt_state, params, lr)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval(config: DFlashConfig, weights_L, soft_weight: float, compute_dtype):
    """A jitted `(params, target, tokens_BS, anchors_BA) -> (loss, (correct, agree))` (see `drafter_loss`)."""
    return jax.jit(lambda params, target, tokens_BS, anchors_BA: drafter_loss(
        params, config, target, tokens_BS, anchors_BA, weights_L, soft_weight, compute_dtype))


def acceptance_proxy(agree_NL: np.ndarray) -> dict:
    """Per-slot rate of ``agree [blocks, L]`` and the mean run of agreeing slots from slot 1 (with
    agreement with the target's argmax on its greedy text: the drafts a T = 0 chain round accepts)."""
    return {"agree_per_slot": agree_NL.mean(0).tolist(),
            "mean_agree_prefix": float(np.cumprod(agree_NL, axis=1).sum(1).mean())}


# ----- data -----

@functools.partial(jax.jit, static_argnames="num_new")
def sample_continuations(target: Target, prompts_BP, key, num_new: int, temperature=1.0):
    """``num_new`` tokens per prompt from the target (KV-cached), int32 ``[B, num_new]``: sampled at
    ``temperature`` (a scalar, traced), or the argmax where it is 0."""
    cfg = target.config
    batch, prompt_len = prompts_BP.shape
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, prompt_len + num_new,
                       cfg.head_dim, target.dtype)
    positions_BP = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    causal_BPP = jnp.broadcast_to(jnp.tril(jnp.ones((prompt_len, prompt_len), bool)), (batch, prompt_len, prompt_len))
    logits_BPV, _, cache = target_forward(target, prompts_BP, positions_BP, causal_BPP, cache)
    cache = commit(cache, positions_BP, jnp.full((batch,), prompt_len, jnp.int32))
    one_B11 = jnp.ones((batch, 1, 1), bool)
    greedy = temperature == 0

    def decode(carry, key_t):
        logits_BV, cache = carry
        sampled_B = jax.random.categorical(key_t, logits_BV / jnp.where(greedy, 1.0, temperature))
        token_B = jnp.where(greedy, jnp.argmax(logits_BV, -1), sampled_B).astype(jnp.int32)
        logits_B1V, _, cache = target_forward(target, token_B[:, None], cache.lengths[:, None], one_B11, cache)
        cache = commit(cache, jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch,), jnp.int32))
        return (logits_B1V[:, 0], cache), token_B

    _, tokens_NB = jax.lax.scan(decode, (logits_BPV[:, -1], cache), jax.random.split(key, num_new))
    return tokens_NB.T


def generated_sequences(target: Target, prompts: Iterator[np.ndarray], count: int, temperatures, args,
                        seed: int, deadline: float = math.inf) -> np.ndarray:
    """Up to ``count`` sequences ``[N, seq_len]``: a prompt from ``prompts`` (``--gen-prompt-len``
    tokens each) and the target's continuation, in batches of ``--gen-batch`` that take the
    ``temperatures`` in turn. Generation stops early once `time.perf_counter` passes ``deadline``
    (after one batch per temperature at least)."""
    key, out, done = jax.random.key(seed), [], 0
    with tqdm(total=count, desc="generate", dynamic_ncols=True) as bar:
        while done < count and (len(out) < len(temperatures) or time.perf_counter() < deadline):
            temperature = temperatures[len(out) % len(temperatures)]
            batch = min(args.gen_batch, count - done)
            prompts_BP = np.stack([next(prompts) for _ in range(batch)])
            new_BN = sample_continuations(target, jnp.asarray(prompts_BP), jax.random.fold_in(key, len(out)),
                                          args.seq_len - args.gen_prompt_len, jnp.float32(temperature))
            out.append(np.concatenate([prompts_BP, np.asarray(new_BN)], axis=1))
            done += batch
            bar.update(batch)
    if done < count:
        print(f"generation stopped at its deadline: {done} of {count} sequences", flush=True)
    return np.concatenate(out).astype(np.int32)


def pool_blocks(pool_NS: np.ndarray, seed: int):
    """Endless rows of ``pool`` in a fresh seeded permutation per epoch."""
    epoch = 0
    while True:
        yield from pool_NS[np.random.default_rng([seed, epoch]).permutation(len(pool_NS))]
        epoch += 1


def training_data(target: Target, tokenizer, args, deadline: float = math.inf) -> Iterator[np.ndarray]:
    """Endless training sequences ``[seq_len]`` of ``--data`` (``target`` writes the generations, until
    ``deadline`` at the latest)."""
    if args.data == "corpus":
        return corpus.token_blocks(tokenizer, "train", args.seq_len, seed=args.seed, max_files=args.max_files)
    prompts = corpus.token_blocks(tokenizer, "train", args.gen_prompt_len, seed=args.seed + 1,
                                  max_files=args.max_files)
    pool_NS = generated_sequences(target, prompts, args.gen_sequences, args.gen_temperatures, args, args.seed + 1,
                                  deadline)
    return pool_blocks(pool_NS, args.seed)


def heldout_sets(target: Target, tokenizer, args) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Named held-out sets of ``--eval-batches`` ``(tokens [B, S], anchors [B, A])`` batches: the
    corpus blocks (anchors from 1), or per temperature the target's continuations of held-out
    prompts (anchors from the last prompt token on)."""
    rng = np.random.default_rng(12345)
    n = args.eval_batches * args.batch
    if args.data == "corpus":
        blocks = corpus.token_blocks(tokenizer, "heldout", args.seq_len, seed=0, repeat=False)
        sets, low = {"corpus": [b for _, b in zip(range(n), blocks)]}, 1
    else:
        prompts = corpus.token_blocks(tokenizer, "heldout", args.gen_prompt_len, seed=0, repeat=False)
        sets, low = {}, args.gen_prompt_len - 1
        for t in args.gen_temperatures:
            sets[f"T{t:g}"] = list(generated_sequences(target, prompts, n, (t,), args, seed=999))
    out = {}
    for name, rows in sets.items():
        if len(rows) < n:
            raise ValueError(f"held-out set {name}: {len(rows)} sequences, fewer than --eval-batches x --batch = {n}")
        out[name] = [(b, sample_anchors(rng, args.batch, args.seq_len, args.anchors, args.block_size, low))
                     for b in common.batches(iter(rows), args.batch)]
    return out


def main(argv=None) -> dict:
    process_start = time.perf_counter()
    args = parse_args(argv)
    common.print_device_info()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_path = common.load_tokenizer(args.target / "tokenizer.json")
    target = load_target(args.target, dtype=jnp.bfloat16)
    config = drafter_config(args, target, tokenizer.mask_id)
    compute_dtype = jnp.dtype(args.compute_dtype)
    weights_L = jnp.asarray(slot_weights(args.block_size, args.gamma))
    rng = np.random.default_rng(args.seed)

    t0 = time.perf_counter()
    writer = load_target(args.target, dtype=jnp.float32)  # generations follow the float32 argmax, as the CPU does
    # The training generations get at most a third of --max-minutes.
    deadline = process_start + (args.max_minutes or math.inf) * 60 / 3
    train = common.batches(training_data(writer, tokenizer, args, deadline), args.batch)
    heldout = heldout_sets(writer, tokenizer, args)
    data_seconds = time.perf_counter() - t0
    print(f"data ({args.data}) ready in {data_seconds:.1f} s", flush=True)

    params = init_drafter(config, jax.random.key(args.seed), jnp.float32, std=args.init_std).params
    print(f"drafter: {common.param_count(params) / 1e6:.2f} M params, {config}", flush=True)
    optimizer = common.make_optimizer(args.weight_decay, args.clip)
    train_step = make_train_step(config, optimizer, weights_L, args.soft_weight, compute_dtype)
    eval_fn = make_eval(config, weights_L, args.soft_weight, compute_dtype)

    def next_batch():
        anchors_BA = sample_anchors(rng, args.batch, args.seq_len, args.anchors, args.block_size)
        return target, jnp.asarray(next(train)), jnp.asarray(anchors_BA)

    def evaluate(params):
        """Mean loss over the held-out sets; per set its loss, top-1 = label rate and agreement proxy."""
        fields = {}
        for name, batches in heldout.items():
            results = [eval_fn(params, target, jnp.asarray(x), jnp.asarray(a)) for x, a in batches]
            correct_NL, agree_NL = (np.concatenate([np.asarray(r[1][i]).reshape(-1, args.block_size - 1)
                                                    for r in results]) for i in (0, 1))
            fields[name] = {"loss": float(np.mean([float(r[0]) for r in results])),
                            "top1_per_slot": correct_NL.mean(0).tolist(), **acceptance_proxy(agree_NL)}
            fields[f"{name}_agree_prefix"] = fields[name]["mean_agree_prefix"]
        return float(np.mean([fields[n]["loss"] for n in heldout])), fields

    schedule = common.Schedule(args.lr, args.steps, args.warmup, common.loop_seconds(args, process_start))
    loop = common.train_loop(params, optimizer.init(params), train_step, next_batch, schedule, evaluate, args,
                             desc="drafter")
    final = loop.evals[-1]
    for name in heldout:
        print(f"held-out {name}: loss {final[name]['loss']:.4f}; agreement with the target's argmax per slot: "
              + " ".join(f"{a:.3f}" for a in final[name]["agree_per_slot"])
              + f"; mean agreeing prefix {final[name]['mean_agree_prefix']:.3f}", flush=True)
    print(f"{loop.steps} steps in {loop.seconds:.1f} s" + (" (stopped by --max-minutes)" if loop.capped else ""),
          flush=True)

    save_drafter(args.out, Drafter(config=config, params=common.cast_floats(loop.params, jnp.bfloat16)))
    common.copy_tokenizer(tokenizer_path, args.out)
    common.save_loss_plot(args.out / "loss.png", {"train": loop.train_curve, "held-out": loop.eval_curve},
                          f"drafter ({args.data}) {common.param_count(loop.params) / 1e6:.1f} M params")
    return common.write_metrics(args, loop.params, loop, heldout_loss=loop.eval_curve[1][-1],
                                heldout=dict((n, final[n]) for n in heldout), data=args.data,
                                data_seconds=data_seconds, wall_seconds=time.perf_counter() - process_start)


if __name__ == "__main__":
    main()
