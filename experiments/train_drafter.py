"""Train a DFlash drafter against a frozen target (the DFlash recipe, docs/design.md "Training the drafter").

    python experiments/train_drafter.py --target runs/target --out runs/drafter [--data corpus|generations]
    python experiments/train_drafter.py --tiny --target /tmp/target --out /tmp/drafter

Per training sequence x (length S), A anchors a are drawn in [1, S - block_size]; anchor a gives
the block [x[a], MASK x (block_size - 1)] at positions a .. a + block_size - 1. All blocks of a
sequence run at once under one mask: a block slot sees the target taps of context positions
c < a (strictly: the anchor's own features are not context) and the slots of its own block.
Slot k (1 <= k < block_size) is trained to predict x[a + k] with cross-entropy weighted by
exp(-(k - 1) / gamma). The target (and its embedding and LM head, shared by the drafter) is
frozen. Data: the target's training corpus, or text the target samples itself at T = 1.
Writes to --out: the drafter in HF format (bf16), tokenizer.json, metrics.json (per-slot
held-out top-1 accuracy, curves, timing) and loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from ddtree_jax.checkpoint import load_target, save_drafter
from ddtree_jax.experiments import corpus
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
            "eval_every": 4, "eval_batches": 2, "max_files": 3, "log_every": 2, "gen_sequences": 8, "gen_batch": 8,
            "gen_prompt_len": 8}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target directory (train_target.py --out)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke-test settings: {TINY}")
    p.add_argument("--data", choices=["corpus", "generations"], default="corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of slot k")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mlp", type=int, default=None, help="drafter MLP width (default: the target's)")
    p.add_argument("--taps", default="1,3,5", help="comma-separated target layer ids")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gen-sequences", type=int, default=16384, help="--data generations: sequences to sample")
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--gen-prompt-len", type=int, default=32, help="corpus tokens that start each generation")
    common.add_training_arguments(p, eval_every=500, eval_batches=8)
    args = common.parse_training_args(p, argv, TINY, ("steps", "batch", "anchors", "eval_every", "eval_batches",
                                                      "log_every", "gen_sequences", "gen_batch", "gen_prompt_len"))
    args.taps = tuple(int(t) for t in str(args.taps).split(","))
    if args.seq_len - args.block_size < args.anchors:
        raise ValueError(f"--anchors={args.anchors} needs --seq-len - --block-size >= {args.anchors}, got "
                         f"{args.seq_len} - {args.block_size}")
    if not 0 < args.gen_prompt_len < args.seq_len:
        raise ValueError(f"--gen-prompt-len must be in (0, --seq-len={args.seq_len}), got {args.gen_prompt_len}")
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
                   block_size: int) -> np.ndarray:
    """``[batch, num_anchors]`` distinct sorted anchors per row, uniform in ``[1, seq_len - block_size]``
    (every anchor has at least one context token and all its labels inside the sequence)."""
    choices = np.arange(1, seq_len - block_size + 1)
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
    """Logits of the drafted slots ``[B, A, Q-1, V]`` and their labels ``[B, A, Q-1]``.

    The frozen target's taps of the whole sequence are the context features (no gradient).
    """
    cfg = drafter.config
    batch, seq_len = tokens_BS.shape
    _, taps_BSF = target_forward_nocache(target, tokens_BS, tap_layers=cfg.target_layer_ids)
    taps_BSF = jax.lax.stop_gradient(taps_BSF)
    blocks = block_batch(tokens_BS, anchors_BA, cfg.block_size, cfg.mask_token_id)
    ctx_positions_BS = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    hidden_BKD = drafter_hidden(drafter, target, taps_BSF, ctx_positions_BS, blocks.block_tokens,
                                blocks.block_positions, blocks.mask)
    hidden_BAQD = hidden_BKD.reshape(batch, anchors_BA.shape[1], cfg.block_size, -1)
    return drafter_head(drafter, target, hidden_BAQD[:, :, 1:].reshape(batch, -1, cfg.hidden_size)).reshape(
        *blocks.labels.shape, -1), blocks.labels


def drafter_loss(params, config: DFlashConfig, target: Target, tokens_BS, anchors_BA, weights_L, compute_dtype):
    """Position-weighted cross-entropy ``sum_k w_k CE_k / sum_k w_k`` averaged over blocks, and
    ``correct [B, A, Q-1]``: whether the drafter's top-1 at slot k equals the label."""
    drafter = Drafter(config=config, params=common.cast_floats(params, compute_dtype))
    logits_BALV, labels_BAL = draft_logits(drafter, target, tokens_BS, anchors_BA)
    ce_BAL = optax.softmax_cross_entropy_with_integer_labels(logits_BALV, labels_BAL)
    loss = (ce_BAL * weights_L).sum(-1).mean() / weights_L.sum()
    return loss, jnp.argmax(logits_BALV, -1) == labels_BAL


def make_train_step(config: DFlashConfig, optimizer, weights_L, compute_dtype):
    """A jitted `(params, opt_state, target, tokens_BS, anchors_BA) -> (params, opt_state, loss)`."""

    def step(params, opt_state, target, tokens_BS, anchors_BA):
        (loss, _), grads = jax.value_and_grad(drafter_loss, has_aux=True)(
            params, config, target, tokens_BS, anchors_BA, weights_L, compute_dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval(config: DFlashConfig, weights_L, compute_dtype):
    """A jitted `(params, target, tokens_BS, anchors_BA) -> (loss, correct)` (see `drafter_loss`)."""
    return jax.jit(lambda params, target, tokens_BS, anchors_BA: drafter_loss(
        params, config, target, tokens_BS, anchors_BA, weights_L, compute_dtype))


def acceptance_proxy(correct_NL: np.ndarray) -> dict:
    """Per-slot top-1 accuracy and the mean run of correct slots from slot 1 (the length a greedy
    chain would accept if the target agreed with the data)."""
    return {"top1_per_slot": correct_NL.mean(0).tolist(),
            "mean_correct_prefix": float(np.cumprod(correct_NL, axis=1).sum(1).mean())}


# ----- data -----

@functools.partial(jax.jit, static_argnames="num_new")
def sample_continuations(target: Target, prompts_BP, key, num_new: int):
    """``num_new`` tokens per prompt sampled from the target at T = 1 (KV-cached), int32 ``[B, num_new]``."""
    cfg = target.config
    batch, prompt_len = prompts_BP.shape
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, prompt_len + num_new,
                       cfg.head_dim, target.dtype)
    positions_BP = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    causal_BPP = jnp.broadcast_to(jnp.tril(jnp.ones((prompt_len, prompt_len), bool)), (batch, prompt_len, prompt_len))
    logits_BPV, _, cache = target_forward(target, prompts_BP, positions_BP, causal_BPP, cache)
    cache = commit(cache, positions_BP, jnp.full((batch,), prompt_len, jnp.int32))
    one_B11 = jnp.ones((batch, 1, 1), bool)

    def decode(carry, key_t):
        logits_BV, cache = carry
        token_B = jax.random.categorical(key_t, logits_BV).astype(jnp.int32)
        logits_B1V, _, cache = target_forward(target, token_B[:, None], cache.lengths[:, None], one_B11, cache)
        cache = commit(cache, jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch,), jnp.int32))
        return (logits_B1V[:, 0], cache), token_B

    _, tokens_NB = jax.lax.scan(decode, (logits_BPV[:, -1], cache), jax.random.split(key, num_new))
    return tokens_NB.T


def generated_sequences(target: Target, tokenizer, args) -> np.ndarray:
    """``--gen-sequences`` sequences ``[N, seq_len]``: a ``--gen-prompt-len`` prefix of a train block
    followed by the target's own T = 1 continuation."""
    blocks = corpus.token_blocks(tokenizer, "train", args.seq_len, seed=args.seed + 1, max_files=args.max_files)
    key = jax.random.key(args.seed + 1)
    out = []
    for start in tqdm(range(0, args.gen_sequences, args.gen_batch), desc="generate", dynamic_ncols=True):
        batch = min(args.gen_batch, args.gen_sequences - start)
        prompts_BP = np.stack([next(blocks)[: args.gen_prompt_len] for _ in range(batch)])
        new_BN = sample_continuations(target, jnp.asarray(prompts_BP), jax.random.fold_in(key, start),
                                      args.seq_len - args.gen_prompt_len)
        out.append(np.concatenate([prompts_BP, np.asarray(new_BN)], axis=1))
    return np.concatenate(out).astype(np.int32)


def pool_blocks(pool_NS: np.ndarray, seed: int):
    """Endless rows of ``pool`` in a fresh seeded permutation per epoch."""
    epoch = 0
    while True:
        yield from pool_NS[np.random.default_rng([seed, epoch]).permutation(len(pool_NS))]
        epoch += 1


def main(argv=None) -> dict:
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
    if args.data == "generations":
        sequences = pool_blocks(generated_sequences(target, tokenizer, args), args.seed)
    else:
        sequences = corpus.token_blocks(tokenizer, "train", args.seq_len, seed=args.seed, max_files=args.max_files)
    train = common.batches(sequences, args.batch)
    heldout_blocks = corpus.token_blocks(tokenizer, "heldout", args.seq_len, seed=0, repeat=False)
    eval_rng = np.random.default_rng(12345)
    heldout = [(b, sample_anchors(eval_rng, args.batch, args.seq_len, args.anchors, args.block_size))
               for _, b in zip(range(args.eval_batches), common.batches(heldout_blocks, args.batch))]
    if not heldout:
        raise ValueError(f"the held-out split has fewer than --batch={args.batch} blocks of {args.seq_len}")
    data_seconds = time.perf_counter() - t0
    print(f"data ({args.data}) ready in {data_seconds:.1f} s", flush=True)

    params = init_drafter(config, jax.random.key(args.seed), jnp.float32, std=args.init_std).params
    print(f"drafter: {common.param_count(params) / 1e6:.2f} M params, {config}", flush=True)
    optimizer = common.make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    opt_state = optimizer.init(params)
    train_step = make_train_step(config, optimizer, weights_L, compute_dtype)
    eval_fn = make_eval(config, weights_L, compute_dtype)

    def evaluate(params):
        results = [eval_fn(params, target, jnp.asarray(x), jnp.asarray(a)) for x, a in heldout]
        correct_NL = np.concatenate([np.asarray(c).reshape(-1, args.block_size - 1) for _, c in results])
        return float(np.mean([float(loss) for loss, _ in results])), acceptance_proxy(correct_NL)

    train_curve, eval_curve, pending = ([], []), ([], []), []
    t_start = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="drafter", dynamic_ncols=True)
    for step in bar:
        anchors_BA = sample_anchors(rng, args.batch, args.seq_len, args.anchors, args.block_size)
        params, opt_state, loss = train_step(params, opt_state, target, jnp.asarray(next(train)),
                                             jnp.asarray(anchors_BA))
        pending.append(loss)
        if step % args.log_every == 0 or step == args.steps:
            train_curve[0].append(step)
            train_curve[1].append(float(np.mean(jax.device_get(pending))))
            pending = []
            bar.set_postfix(loss=f"{train_curve[1][-1]:.3f}")
        if step % args.eval_every == 0 and step != args.steps:
            loss, proxy = evaluate(params)
            eval_curve[0].append(step)
            eval_curve[1].append(loss)
            bar.write(f"step {step}: held-out loss {loss:.4f}, correct prefix {proxy['mean_correct_prefix']:.3f}")
    train_seconds = time.perf_counter() - t_start

    final_loss, proxy = evaluate(params)
    eval_curve[0].append(args.steps)
    eval_curve[1].append(final_loss)
    print(f"held-out loss {final_loss:.4f}; top-1 accuracy per slot: "
          + " ".join(f"{a:.3f}" for a in proxy["top1_per_slot"])
          + f"; mean correct prefix {proxy['mean_correct_prefix']:.3f}; {args.steps} steps in {train_seconds:.1f} s",
          flush=True)

    save_drafter(args.out, Drafter(config=config, params=common.cast_floats(params, jnp.bfloat16)))
    common.copy_tokenizer(tokenizer_path, args.out)
    common.save_loss_plot(args.out / "loss.png", {"train": train_curve, "held-out": eval_curve},
                          f"drafter ({args.data}) {common.param_count(params) / 1e6:.1f} M params")
    return common.write_metrics(args, params, train_curve, eval_curve, heldout_loss=final_loss, **proxy,
                                data=args.data, data_seconds=data_seconds, train_seconds=train_seconds)


if __name__ == "__main__":
    main()
