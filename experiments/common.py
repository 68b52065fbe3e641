"""Helpers shared by the experiment scripts: device report, optimiser, batching, plots, JSON, timing."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddtree_jax.assets import TOKENIZER_PATH
from ddtree_jax.experiments.bench import median_ms  # noqa: F401  (re-exported for the bench scripts)
from ddtree_jax.tokenizer import Tokenizer


def print_device_info() -> None:
    """One line on the Python/JAX versions and the devices JAX sees."""
    devices = jax.devices()
    print(f"python {platform.python_version()}, jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{len(devices)} x {devices[0].device_kind}", flush=True)


def add_training_arguments(p: argparse.ArgumentParser, *, eval_every: int, eval_batches: int) -> None:
    """The flags every training script shares: regularisation, init, compute dtype, data subset, logging."""
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-files", type=int, default=None, help="first N train files only")
    p.add_argument("--eval-every", type=int, default=eval_every)
    p.add_argument("--eval-batches", type=int, default=eval_batches)
    p.add_argument("--log-every", type=int, default=20)


def parse_training_args(p: argparse.ArgumentParser, argv, tiny: dict, positive: tuple[str, ...]):
    """Parse ``argv`` (with ``--tiny``, ``tiny`` replaces the defaults) and require ``positive`` >= 1."""
    args = p.parse_args(argv)
    if args.tiny:
        p.set_defaults(**tiny)
        args = p.parse_args(argv)
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float = 1.0):
    """AdamW (b2 = 0.95) on a linear-warmup cosine schedule (to lr / 10), global-norm clipping.

    Weight decay applies to matrices only (ndim >= 2), not to norm weights.
    """
    if not 0 <= warmup < steps:
        raise ValueError(f"--warmup must be in [0, --steps={steps}), got {warmup}")
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 10)
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))


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


def write_metrics(args, params, train_curve, eval_curve, **fields) -> dict:
    """Write ``args.out/metrics.json``: ``fields`` plus the loss curves, parameter count, device, JAX
    version and the run's arguments; return the dict."""
    metrics = {
        **fields,
        "train_curve": dict(zip(("step", "loss"), train_curve)),
        "heldout_curve": dict(zip(("step", "loss"), eval_curve)),
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
