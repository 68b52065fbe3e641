"""Train the embedded Qwen3 target on the train split of the stdlib corpus.

    python experiments/train_target.py --out runs/target --max-minutes 6.5   # the embedded recipe's settings
    python experiments/train_target.py --tiny --out /tmp/target              # a few seconds on a CPU

Next-token cross-entropy on fixed-length token blocks with dropout on every layer's attention
output and MLP branch, AdamW on a warmup-cosine schedule (`common.Schedule`: with --max-minutes the
cosine ends at the time cap if that comes before --steps), gradient clipping 1.0, fp32 master
weights with bf16 compute. The held-out loss is measured every --eval-every steps and the weights
with the lowest one are kept (--keep-last: the last ones). Writes to --out: the model in HF format
(bf16), tokenizer.json, metrics.json (held-out loss and perplexity, curves, timing) and loss.png.

The train split is only about 9 M tokens (4096-token BPE). Without dropout the 8.7 M-parameter
model overfits after about two epochs (batch 64 x 512: held-out loss lowest near step 500 at 2.78
nats, then climbing while the train loss keeps falling); dropout lets more epochs help, and keeping
the best held-out weights guards against the rest.
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

from ddtree_jax import kernels
from ddtree_jax.checkpoint import save_target
from ddtree_jax.experiments import corpus
from ddtree_jax.models import layers as L
from ddtree_jax.models.qwen3 import (
    Qwen3Config,
    Target,
    init_target,
    run_layers,
    target_forward_nocache,
)
from experiments import common

TINY = {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "mlp": 64, "seq_len": 32, "batch": 4,
            "steps": 12, "warmup": 2, "eval_every": 6, "eval_batches": 2, "max_files": 3, "log_every": 2,
        "dropout": 0.1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke-test settings: {TINY}")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (default: packaged)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2400)
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
    p.add_argument("--dropout", type=float, default=0.1, help="on attention outputs and MLP branches")
    p.add_argument("--keep-last", action="store_true", help="save the last weights, not the best held-out ones")
    common.add_training_arguments(p, eval_every=100, eval_batches=16)
    args = common.parse_training_args(p, argv, TINY, ("steps", "batch", "seq_len", "eval_every", "eval_batches",
                                                      "log_every"))
    if not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def target_config(args, vocab_size: int, eot_id: int) -> Qwen3Config:
    """The `Qwen3Config` the flags describe."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.mlp,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=args.rope_theta,
        tie_word_embeddings=not args.untied, max_position_embeddings=args.seq_len,
        eos_token_id=eot_id)


def dropout(key, x, rate: float):
    """Inverted dropout: each entry of ``x`` zeroed with probability ``rate``, the rest divided by ``1 - rate``."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def dropout_logits(target: Target, tokens_BT, key, rate: float):
    """Causal logits ``[B, T, V]`` (float32) of the training forward: `target_forward_nocache` with
    dropout ``rate`` on each layer's attention output (before ``wo``) and on its MLP branch (before
    the residual add). ``rate = 0`` gives `target_forward_nocache`'s logits."""
    cfg = target.config
    batch, num = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    causal_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((num, num), bool)), (batch, num, num))
    no_prefix_B = jnp.zeros((batch,), jnp.int32)
    attention = kernels.attention_fn("xla")
    key_attn, key_mlp = jax.random.split(key)
    mlp_keys = iter(jax.random.split(key_mlp, cfg.num_hidden_layers))  # layers run in order, once each

    def attend(i, inputs, state):
        q_BTHD, k_BTKD, v_BTKD = inputs.split()
        out_BTHD = attention(q_BTHD, k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3), no_prefix_B,
                             causal_BTT, scale=cfg.head_dim ** -0.5)
        return dropout(jax.random.fold_in(key_attn, i), out_BTHD, rate), state

    def mlp(layer, x_BTD, shape, matmul, h_BTD=None, then_norm_D=None):
        """`layers.dense_mlp` with dropout before its residual add; its norm is its own product's prologue, and
        the next layer's input norm is left to that layer (reference products give no normalised rows)."""
        del h_BTD, then_norm_D
        h_BTI = L.project(matmul, x_BTD, layer.w_gate_up, norm_K=layer.post_norm, eps=shape.rms_norm_eps, gated=True)
        return x_BTD + dropout(next(mlp_keys), L.project(matmul, h_BTI, layer.w_down), rate), None

    logits_BTV, _, _ = run_layers(target, tokens_BT, positions_BT, attend, None, (), mlp=mlp)
    return logits_BTV


def next_token_loss(params, config: Qwen3Config, tokens_BT, compute_dtype, key=None, rate: float = 0.0):
    """Mean cross-entropy of predicting `tokens[:, 1:]` from `tokens[:, :-1]` (float32 scalar); with
    ``key``, through `dropout_logits` at ``rate``."""
    target = Target(config=config, params=common.cast_floats(params, compute_dtype))
    if key is None:
        logits_BTV, _ = target_forward_nocache(target, tokens_BT[:, :-1])
    else:
        logits_BTV = dropout_logits(target, tokens_BT[:, :-1], key, rate)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:]).mean()


def make_train_step(config: Qwen3Config, optimizer, compute_dtype, rate: float = 0.0):
    """A jitted `(params, opt_state, lr, tokens_BT, key) -> (params, opt_state, loss)` (state donated;
    ``optimizer`` from `common.make_optimizer`, ``rate`` the dropout rate)."""

    def step(params, opt_state, lr, tokens_BT, key):
        loss, grads = jax.value_and_grad(next_token_loss)(params, config, tokens_BT, compute_dtype, key, rate)
        params, opt_state = common.apply_update(optimizer, grads, opt_state, params, lr)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_loss(config: Qwen3Config, compute_dtype):
    """A jitted `(params, tokens_BT) -> loss` (the training loss without dropout, no update)."""
    return jax.jit(lambda params, tokens_BT: next_token_loss(params, config, tokens_BT, compute_dtype))


def heldout_batches(tokenizer, args) -> list[np.ndarray]:
    """The first `--eval-batches` batches of held-out blocks (fixed order, seed 0)."""
    blocks = corpus.token_blocks(tokenizer, "heldout", args.seq_len + 1, seed=0, repeat=False)
    return [b for _, b in zip(range(args.eval_batches), common.batches(blocks, args.batch))]


def main(argv=None) -> dict:
    process_start = time.perf_counter()
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
    optimizer = common.make_optimizer(args.weight_decay, args.clip)
    train_step = make_train_step(config, optimizer, compute_dtype, args.dropout)
    eval_loss = make_eval_loss(config, compute_dtype)
    dropout_key, counter = jax.random.key(args.seed + 1), iter(range(1 << 62))

    def next_batch():
        return jnp.asarray(next(train)), jax.random.fold_in(dropout_key, next(counter))

    def evaluate(params):
        loss = float(np.mean([eval_loss(params, jnp.asarray(b)) for b in heldout]))
        return loss, {"perplexity": float(np.exp(loss))}

    schedule = common.Schedule(args.lr, args.steps, args.warmup, common.loop_seconds(args, process_start))
    loop = common.train_loop(params, optimizer.init(params), train_step, next_batch, schedule, evaluate, args,
                             desc="target", keep_best=not args.keep_last)
    kept = loop.eval_curve[1][loop.eval_curve[0].index(loop.kept_step)]
    tokens = loop.steps * args.batch * args.seq_len
    print(f"kept step {loop.kept_step}: held-out loss {kept:.4f}, perplexity {np.exp(kept):.2f}; {loop.steps} steps "
          f"in {loop.seconds:.1f} s ({tokens / loop.seconds:,.0f} tokens/s)"
          + (" (stopped by --max-minutes)" if loop.capped else ""), flush=True)

    save_target(args.out, Target(config=config, params=common.cast_floats(loop.params, jnp.bfloat16)))
    common.copy_tokenizer(tokenizer_path, args.out)
    common.save_loss_plot(args.out / "loss.png", {"train": loop.train_curve, "held-out": loop.eval_curve},
                          f"target {common.param_count(loop.params) / 1e6:.1f} M params, dropout {args.dropout:g}")
    return common.write_metrics(args, loop.params, loop, heldout_loss=kept, heldout_perplexity=float(np.exp(kept)),
                                tokens_per_second=tokens / loop.seconds,
                                wall_seconds=time.perf_counter() - process_start)


if __name__ == "__main__":
    main()
