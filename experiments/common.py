"""Helpers shared by the experiment scripts: device report, optimiser, batching, plots, JSON, timing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from ddtree_jax import checks
from ddtree_jax.assets import TOKENIZER_PATH
from ddtree_jax.experiments.bench import median_ms  # noqa: F401  (re-exported for the bench scripts)
from ddtree_jax.tokenizer import Tokenizer


def print_device_info() -> None:
    """One line on the Python/JAX versions and the devices JAX sees."""
    devices = jax.devices()
    print(f"python {platform.python_version()}, jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{len(devices)} x {devices[0].device_kind}", flush=True)


def add_training_arguments(p: argparse.ArgumentParser, *, eval_every: int, eval_batches: int) -> None:
    """The flags every training script shares: schedule cap, regularisation, init, compute dtype,
    data subset, logging."""
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock cap of the whole run (start-up, data and compilation included); the "
                        "schedule ends annealed at the cap and the model and metrics are written")
    p.add_argument("--reserve-seconds", type=float, default=30.0,
                   help="of --max-minutes, kept for the final evaluation and writing the outputs")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-files", type=int, default=None, help="first N train files only")
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--eval-batches", type=int, default=eval_batches)
    p.add_argument("--log-every", type=int, default=20)


def parse_training_args(p: argparse.ArgumentParser, argv, tiny: dict, positive: tuple[str, ...]):
    """Parse ``argv`` (with ``--tiny``, ``tiny`` replaces the defaults) and require ``positive`` >= 1
    and ``0 <= --warmup < --steps``."""
    args = p.parse_args(argv)
    if args.tiny:
        p.set_defaults(**tiny)
        args = p.parse_args(argv)
    checks.flags(args, [(name, lambda v: v >= 1, ">= 1") for name in positive]
                 + [("max_minutes", lambda v: v is None or v > 0, "> 0")])
    Schedule(args.lr, args.steps, args.warmup)  # checks the warmup before any data is prepared
    return args


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Learning rate: linear warmup over ``warmup`` steps, then a cosine from ``lr`` to ``lr / 10``.

    The cosine's progress is the larger of the fraction of post-warmup steps done and the fraction of
    ``seconds`` (the loop's wall-clock budget) used, so a run that reaches its time cap before
    ``steps`` still ends annealed; `done` says when either is spent.
    """

    lr: float
    steps: int
    warmup: int
    seconds: float = math.inf

    def __post_init__(self):
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup must be in [0, --steps={self.steps}), got {self.warmup}")
        if not self.seconds > 0:
            raise ValueError(f"the training time budget must be > 0 s, got {self.seconds}")

    def progress(self, step: int, elapsed: float) -> float:
        """Fraction of the cosine done after ``step`` steps and ``elapsed`` seconds, in [0, 1]."""
        by_steps = max(step - self.warmup, 0) / (self.steps - self.warmup)
        return min(1.0, max(by_steps, elapsed / self.seconds))

    def __call__(self, step: int, elapsed: float) -> float:
        """The learning rate of step ``step`` (1-based) started ``elapsed`` seconds into the loop."""
        warm = min(1.0, step / self.warmup) if self.warmup else 1.0
        cosine = 0.5 * (1 + math.cos(math.pi * self.progress(step - 1, elapsed)))
        return self.lr * warm * (0.1 + 0.9 * cosine)

    def done(self, step: int, elapsed: float) -> bool:
        """Whether training stops after ``step`` steps and ``elapsed`` seconds."""
        return step >= self.steps or elapsed >= self.seconds


def loop_seconds(args, process_start: float) -> float:
    """The training loop's wall-clock budget: ``--max-minutes`` from ``process_start`` (a
    `time.perf_counter` value) minus the time already spent and ``--reserve-seconds``; inf without a cap."""
    if args.max_minutes is None:
        return math.inf
    left = args.max_minutes * 60 - (time.perf_counter() - process_start) - args.reserve_seconds
    if left <= 0:
        raise ValueError(f"--max-minutes={args.max_minutes} leaves no time to train after start-up and data "
                         f"preparation ({time.perf_counter() - process_start:.0f} s) and --reserve-seconds="
                         f"{args.reserve_seconds}")
    return left


def make_optimizer(weight_decay: float, clip: float = 1.0):
    """Global-norm clipping, then AdamW's direction (b2 = 0.95) without the learning rate: the train
    steps scale the update by ``-lr`` (`apply_update`), the rate being a `Schedule` value per step.

    Weight decay applies to matrices only (ndim >= 2), not to norm weights.
    """
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam(b1=0.9, b2=0.95),
                       optax.add_decayed_weights(weight_decay, mask=decay_mask))


def apply_update(optimizer, grads, opt_state, params, lr):
    """One optimiser step at learning rate ``lr`` (a traced scalar): ``(params, opt_state)``."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates)), opt_state


@dataclasses.dataclass
class LoopResult:
    """What `train_loop` returns: the kept params (the best held-out ones with ``keep_best``, else the
    last), the ``(steps, values)`` curves of train loss, held-out loss and learning rate, the extra
    fields of each evaluation, the steps run, the loop's seconds, the kept step and whether the time
    cap ended the run."""

    params: object
    train_curve: tuple[list, list]
    eval_curve: tuple[list, list]
    lr_curve: tuple[list, list]
    evals: list[dict]
    steps: int
    seconds: float
    kept_step: int
    capped: bool


def train_loop(params, opt_state, step_fn, next_batch, schedule: Schedule, evaluate, args, *, desc: str,
               keep_best: bool = False) -> LoopResult:
    """Run ``step_fn(params, opt_state, lr, *next_batch()) -> (params, opt_state, loss)`` (params and
    state donated) until ``schedule.done``; every ``args.eval_every`` steps and at the end call
    ``evaluate(params) -> (loss, fields)``; log the mean train loss every ``args.log_every`` steps."""
    train_curve, eval_curve, lr_curve, evals, pending = ([], []), ([], []), ([], []), [], []
    best = (math.inf, None, 0)
    t_start = time.perf_counter()
    bar = tqdm(total=schedule.steps, desc=desc, dynamic_ncols=True)
    step = 0

    def record_eval():
        nonlocal best
        loss, fields = evaluate(params)
        eval_curve[0].append(step)
        eval_curve[1].append(loss)
        evals.append({"step": step, **fields})
        if keep_best and loss < best[0]:
            best = (loss, jax.tree.map(jnp.copy, params), step)
        return loss, fields

    while True:
        lr = schedule(step + 1, time.perf_counter() - t_start)
        params, opt_state, loss = step_fn(params, opt_state, jnp.float32(lr), *next_batch())
        step += 1
        bar.update()
        pending.append(loss)
        stop = schedule.done(step, time.perf_counter() - t_start)
        if step % args.log_every == 0 or stop:
            train_curve[0].append(step)
            train_curve[1].append(float(np.mean(jax.device_get(pending))))
            lr_curve[0].append(step)
            lr_curve[1].append(lr)
            pending = []
            bar.set_postfix(loss=f"{train_curve[1][-1]:.3f}", lr=f"{lr:.2e}")
        if stop:
            break
        if step % args.eval_every == 0:
            loss, fields = record_eval()
            bar.write(f"step {step}: held-out loss {loss:.4f} " + " ".join(
                f"{k} {v:.3f}" for k, v in fields.items() if isinstance(v, float)))
    bar.close()
    seconds = time.perf_counter() - t_start
    record_eval()
    kept, kept_step = (best[1], best[2]) if keep_best else (params, step)
    return LoopResult(params=kept, train_curve=train_curve, eval_curve=eval_curve, lr_curve=lr_curve, evals=evals,
                      steps=step, seconds=seconds, kept_step=kept_step, capped=step < schedule.steps)


def cast_floats(tree, dtype):
    """Every floating leaf of `tree` cast to `dtype` (bf16 compute copies of fp32 master weights)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def batches(blocks: Iterator[np.ndarray], batch: int) -> Iterator[np.ndarray]:
    """Group a stream of equal-length 1-D blocks into int32 `[batch, len]` arrays (tail dropped)."""
    while True:
        chunk = [b for _, b in zip(range(batch), blocks)]
        if len(chunk) < batch:
            return
        yield np.stack(chunk).astype(np.int32)


def param_count(tree) -> int:
    """Number of scalars in the arrays of `tree`."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def save_loss_plot(path: Path, curves: dict[str, tuple[list, list]], title: str) -> None:
    """Line plot of named `(steps, values)` curves to a PNG (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=name, marker="o" if len(xs) < 30 else None)
    ax.set(xlabel="step", ylabel="loss (nats)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: Path, obj) -> None:
    """Indented, key-sorted JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_metrics(args, params, loop: LoopResult, **fields) -> dict:
    """Write ``args.out/metrics.json``: ``fields``, the loop's curves, evaluations, steps, seconds and
    kept step, the parameter count, device, JAX version and the run's arguments; return the dict."""
    metrics = {
        **fields,
        "train_curve": dict(zip(("step", "loss"), loop.train_curve)),
        "heldout_curve": dict(zip(("step", "loss"), loop.eval_curve)),
        "lr_curve": dict(zip(("step", "lr"), loop.lr_curve)),
        "evals": loop.evals, "steps_run": loop.steps, "capped_by_time": loop.capped, "kept_step": loop.kept_step,
        "train_seconds": loop.seconds,
        "params": param_count(params), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "args": {k: str(v) for k, v in vars(args).items()},
    }
    write_json(args.out / "metrics.json", metrics)
    print(f"wrote {args.out}", flush=True)
    return metrics


def copy_tokenizer(tokenizer_path: Path, out: Path) -> None:
    """Ship the tokenizer next to the weights (`out/tokenizer.json`)."""
    shutil.copyfile(tokenizer_path, out / "tokenizer.json")


def load_tokenizer(path: Path | None) -> tuple[Tokenizer, Path]:
    """The tokenizer at `path` (default: the packaged one) and the file it came from."""
    path = TOKENIZER_PATH if path is None else Path(path)
    return Tokenizer.from_file(path), path
