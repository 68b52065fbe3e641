"""Train the embedded Qwen3 target on the train split of the stdlib corpus.

    python experiments/train_target.py --out runs/target            # defaults: about 1 min on an H200
    python experiments/train_target.py --tiny --out /tmp/target     # a few seconds on a CPU

Next-token cross-entropy on fixed-length token blocks, AdamW on a warmup-cosine schedule,
gradient clipping 1.0, fp32 master weights with bf16 compute. Writes to --out: the model in HF
format (bf16), tokenizer.json, metrics.json (held-out loss and perplexity, curves, timing) and
loss.png.

The train split is only about 9 M tokens (4096-token BPE). On an H200 the default 8.7 M-parameter
model runs about 1 M tokens/s, and it overfits after about two epochs: with batch 64 and a long
schedule the held-out loss is lowest near step 500 (2.7 nats) and then climbs while the train loss
keeps falling. The defaults therefore stop after about two epochs (600 steps); watch the
held-out curve in loss.png when changing the model size, batch or steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from ddtree_jax.checkpoint import save_target
from ddtree_jax.experiments import corpus
from ddtree_jax.models.qwen3 import (
    Qwen3Config,
    Target,
    init_target,
    target_forward_nocache,
)
from experiments import common

TINY = {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "mlp": 64, "seq_len": 32, "batch": 4,
            "steps": 12, "warmup": 2, "eval_every": 6, "eval_batches": 2, "max_files": 3, "log_every": 2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke-test settings: {TINY}")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (default: packaged)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="context length in tokens")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=40)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--untied", action="store_true", help="separate LM head (default: tied)")
    common.add_training_arguments(p, eval_every=100, eval_batches=16)
    args = common.parse_training_args(p, argv, TINY, ("steps", "batch", "seq_len", "eval_every", "eval_batches",
                                                      "log_every"))
    return args


def target_config(args, vocab_size: int, eot_id: int) -> Qwen3Config:
    """The `Qwen3Config` the flags describe."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.mlp,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=args.rope_theta,
        tie_word_embeddings=not args.untied, max_position_embeddings=args.seq_len,
        eos_token_id=eot_id)


def next_token_loss(params, config: Qwen3Config, tokens_BT, compute_dtype):
    """Mean cross-entropy of predicting `tokens[:, 1:]` from `tokens[:, :-1]` (float32 scalar)."""
    target = Target(config=config, params=common.cast_floats(params, compute_dtype))
    logits_BTV, _ = target_forward_nocache(target, tokens_BT[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:]).mean()


def make_train_step(config: Qwen3Config, optimizer, compute_dtype):
    """A jitted `(params, opt_state, tokens_BT) -> (params, opt_state, loss)` (state donated)."""

    def step(params, opt_state, tokens_BT):
        loss, grads = jax.value_and_grad(next_token_loss)(params, config, tokens_BT, compute_dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_loss(config: Qwen3Config, compute_dtype):
    """A jitted `(params, tokens_BT) -> loss` (the training loss, no update)."""
    return jax.jit(lambda params, tokens_BT: next_token_loss(params, config, tokens_BT, compute_dtype))


def heldout_batches(tokenizer, args) -> list[np.ndarray]:
    """The first `--eval-batches` batches of held-out blocks (fixed order, seed 0)."""
    blocks = corpus.token_blocks(tokenizer, "heldout", args.seq_len + 1, seed=0, repeat=False)
    return [b for _, b in zip(range(args.eval_batches), common.batches(blocks, args.batch))]


def main(argv=None) -> dict:
    args = parse_args(argv)
    common.print_device_info()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_path = common.load_tokenizer(args.tokenizer)
    config = target_config(args, tokenizer.vocab_size, tokenizer.eot_id)
    compute_dtype = jnp.dtype(args.compute_dtype)

    t0 = time.perf_counter()
    train = common.batches(corpus.token_blocks(tokenizer, "train", args.seq_len + 1, seed=args.seed,
                                               max_files=args.max_files), args.batch)
    heldout = heldout_batches(tokenizer, args)
    if not heldout:
        raise ValueError(f"the held-out split has fewer than --batch={args.batch} blocks of {args.seq_len + 1}")
    print(f"data ready in {time.perf_counter() - t0:.1f} s ({len(heldout)} held-out batches)", flush=True)

    params = init_target(config, jax.random.key(args.seed), jnp.float32, std=args.init_std).params
    print(f"target: {common.param_count(params) / 1e6:.2f} M params, {config}", flush=True)
    optimizer = common.make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    opt_state = optimizer.init(params)
    train_step = make_train_step(config, optimizer, compute_dtype)
    eval_loss = make_eval_loss(config, compute_dtype)

    def evaluate(params):
        return float(np.mean([eval_loss(params, jnp.asarray(b)) for b in heldout]))

    train_curve, eval_curve, pending = ([], []), ([], []), []
    t_start = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="target", dynamic_ncols=True)
    for step in bar:
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(next(train)))
        pending.append(loss)
        if step % args.log_every == 0 or step == args.steps:
            train_curve[0].append(step)
            train_curve[1].append(float(np.mean(jax.device_get(pending))))
            pending = []
            bar.set_postfix(loss=f"{train_curve[1][-1]:.3f}")
        if step % args.eval_every == 0 and step != args.steps:
            eval_curve[0].append(step)
            eval_curve[1].append(evaluate(params))
            bar.write(f"step {step}: held-out loss {eval_curve[1][-1]:.4f}")
    train_seconds = time.perf_counter() - t_start

    final = evaluate(params)
    eval_curve[0].append(args.steps)
    eval_curve[1].append(final)
    tokens = args.steps * args.batch * args.seq_len
    print(f"held-out loss {final:.4f}, perplexity {np.exp(final):.2f}; {args.steps} steps in "
          f"{train_seconds:.1f} s ({tokens / train_seconds:,.0f} tokens/s)", flush=True)

    save_target(args.out, Target(config=config, params=common.cast_floats(params, jnp.bfloat16)))
    common.copy_tokenizer(tokenizer_path, args.out)
    common.save_loss_plot(args.out / "loss.png", {"train": train_curve, "held-out": eval_curve},
                          f"target {common.param_count(params) / 1e6:.1f} M params")
    return common.write_metrics(args, params, train_curve, eval_curve, heldout_loss=final,
                                heldout_perplexity=float(np.exp(final)), train_seconds=train_seconds,
                                tokens_per_second=tokens / train_seconds)


if __name__ == "__main__":
    main()
