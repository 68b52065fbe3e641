"""The ``ddtree`` command line.

``ddtree generate`` runs AR, DFlash chain or DDTree generation on the embedded stdlib model (or any
HF-format target/drafter directories), streaming the text per round and printing the statistics.
``ddtree sweep`` and ``ddtree bench`` run the experiment drivers of `ddtree_jax.experiments`.

Bad input ends the command with one line on stderr naming the flag or the file, and exit code 1,
before anything is printed on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ddtree_jax import checks
from ddtree_jax.assets import DRAFTER_DIR, TARGET_DIR

SEED_LIMIT = 2**32  # jax.random.key(seed) wraps larger seeds around


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, except where its help text already states it."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_generate(sub) -> None:
    from ddtree_jax import costs
    from ddtree_jax.budget import POLICIES

    p = sub.add_parser("generate", help="generate text with AR, chain or DDTree decoding",
                       description="Generate with AR, DFlash chain or DDTree decoding, streaming the text per round.",
                       formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="def fibonacci(n):", help="prompt text (encoded with the target's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, instead of --prompt (default: none)")
    p.add_argument("--method", choices=["ddtree", "chain", "ar"], default="ddtree",
                   help="DDTree, the DFlash chain (the drafter's argmax per slot) or plain autoregressive decoding")
    p.add_argument("--budget", type=int, default=16, help="DDTree node budget (non-root nodes)")
    p.add_argument("--topk-cap", type=int, default=4, help="DDTree per-depth rank cap; 0 = none")
    p.add_argument("--budget-policy", choices=POLICIES, default="fixed",
                   help="which tree nodes a DDTree round verifies: fixed = all --budget; adaptive = per request "
                        "and round the prefix of its tree with the most expected tokens per modelled round time "
                        "(--budget the most, --cost-table the model); batch = --budget per request in total, "
                        "given to the most probable prefixes of the whole batch (not with --dp > 1)")
    p.add_argument("--cost-table",
                   help="round-time model of --budget-policy adaptive: a JSON written by ddtree bench or a shipped "
                        f"table ({', '.join(costs.shipped())}) (default: the device's own; none on a CPU: a flat "
                        "cost, which keeps every node)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="draft from the N most frequent tokens only (counts: <target>/token_counts.npy, written by "
                        "experiments/count_tokens.py); the output law is unchanged. 0 = the whole vocabulary")
    p.add_argument("--draft-temperature", type=float, default=1.0,
                   help="temperature of the drafter's marginals that the tree is built from (> 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="target sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="target top-k; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="target top-p in (0, 1]; 1 = off")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--seed", type=int, default=0, help=f"seed of the sampling key, in [0, {SEED_LIMIT})")
    p.add_argument("--tp", type=int, default=1, help="devices the target is tensor-parallel over")
    p.add_argument("--dp", type=int, default=1, help="devices the batch of requests is split over")
    p.add_argument("--attention-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="tree-verify attention: the Pallas kernel on a supported GPU (auto; per device "
                        "with --tp/--dp) or XLA")
    p.add_argument("--sampler-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="tree sampling: the fused Pallas kernel on a supported GPU without --tp/--dp (auto) "
                        "or the jnp path")
    p.add_argument("--build-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="the tree build's beam and global order: the Pallas kernel for the budgets it is measured "
                        "faster at, on a supported GPU without --tp/--dp (auto), or XLA")
    p.add_argument("--target", type=Path, default=TARGET_DIR,
                   help="HF-format target directory (default: the embedded one)")
    p.add_argument("--drafter", type=Path, default=DRAFTER_DIR,
                   help="HF-format DFlash drafter directory, unused by --method ar (default: the embedded one)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype; auto = float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")


GENERATE_RULES = (
    ("budget", lambda v: v >= 1, ">= 1"),
    ("topk_cap", lambda v: v >= 0, ">= 0 (0 = no cap)"),
    ("draft_vocab", lambda v: v >= 0, ">= 0 (0 = the whole vocabulary)"),
    ("draft_temperature", lambda v: math.isfinite(v) and v > 0, "finite and > 0"),
    ("temperature", lambda v: math.isfinite(v) and v >= 0, "finite and >= 0 (0 = greedy)"),
    ("top_k", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("seed", lambda v: 0 <= v < SEED_LIMIT, f"in [0, {SEED_LIMIT})"),
    ("tp", lambda v: v >= 1, ">= 1"),
    ("dp", lambda v: v >= 1, ">= 1"),
    ("prompt", lambda v: v != "", "non-empty text"),
)


def _load(args):
    """Target, drafter (None for AR) and the target directory's tokenizer (None if it has none)."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.tokenizer import Tokenizer

    for name, path in [("target", args.target)] + ([] if args.method == "ar" else [("drafter", args.drafter)]):
        if not (path / "config.json").is_file():
            raise ValueError(f"--{name} {path} is not an HF-format model directory (no config.json)")
    if args.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(args.dtype)
    target = load_target(args.target, dtype=dtype)
    drafter = None if args.method == "ar" else load_drafter(args.drafter, dtype=dtype)
    tok_path = args.target / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_path) if tok_path.is_file() else None
    return target, drafter, tokenizer


def _prompt_ids(args, tokenizer, vocab: int) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        checks.token_range("--prompt-ids", ids, vocab)
        return ids
    if tokenizer is None:
        raise ValueError(f"--target {args.target} has no tokenizer.json; pass --prompt-ids")
    return tokenizer.encode(args.prompt)


def _mesh(args, target):
    """The ``("dp", "tp")`` mesh of ``--tp``/``--dp`` (None for one device); ``ValueError`` when tp does
    not divide the target's heads or the mesh needs more devices than there are."""
    if (args.tp, args.dp) == (1, 1):
        return None
    from ddtree_jax import sharding

    sharding.check_tp(target.config, args.tp)
    return sharding.make_mesh(args.tp, args.dp)


def cmd_generate(args) -> int:
    """Validate every flag and file, then stream the prompt and its continuation (or print JSON)."""
    import jax

    from ddtree_jax import costs
    from ddtree_jax.engine import generate, max_budget

    checks.flags(args, GENERATE_RULES)
    limit = max_budget(args.budget_policy)
    checks.flags(args, [("budget", lambda v: v <= limit, f"<= {limit} with --budget-policy {args.budget_policy}")])
    if args.budget_policy != "fixed" and args.method != "ddtree":
        raise ValueError(f"--budget-policy {args.budget_policy} needs --method ddtree, got --method {args.method}")
    if args.cost_table is not None and args.budget_policy != "adaptive":
        raise ValueError(f"--cost-table is the model of --budget-policy adaptive, got --budget-policy "
                         f"{args.budget_policy}")
    cost_table = None if args.cost_table is None else costs.load(args.cost_table)
    if args.draft_vocab and args.method == "ar":
        raise ValueError("--draft-vocab needs a drafter: --method ddtree or chain, got --method ar")
    target, drafter, tokenizer = _load(args)
    vocab = target.config.vocab_size
    checks.flags(args, [("top_k", lambda v: v <= vocab, f"<= the vocabulary size {vocab} (0 = off)"),
                        ("draft_vocab", lambda v: v <= vocab, f"<= the vocabulary size {vocab} (0 = all of it)")])
    if args.draft_vocab:
        from ddtree_jax.draft_vocab import with_frequent_tokens

        drafter = with_frequent_tokens(drafter, target, args.target, args.draft_vocab)
    prompt = _prompt_ids(args, tokenizer, vocab)
    mesh = _mesh(args, target)
    stop = [] if args.no_stop or tokenizer is None else [tokenizer.eot_id]
    streaming = not args.json and tokenizer is not None
    shown = [None]  # characters of the decoded continuation printed so far; None until the prompt is

    def stream(tokens, num_generated, _stats):
        if not streaming:
            return
        if shown[0] is None:  # generate has validated its arguments: the first round is done
            sys.stdout.write(tokenizer.decode(prompt))
            shown[0] = 0
        n = int(num_generated[0])
        ids = [int(t) for t in tokens[0, :n] if t >= 0 and t != tokenizer.eot_id]
        text = tokenizer.decode(ids)
        sys.stdout.write(text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(text)

    def compiling():
        if not args.json:
            print(f"ddtree: compiling the prefill and the {args.method} round for {jax.default_backend()} before "
                  "the first token (about half a minute on a small CPU)", file=sys.stderr, flush=True)

    res = generate(target, drafter, [prompt], method=args.method, budget=args.budget,
                   topk_cap=args.topk_cap or None, draft_temperature=args.draft_temperature,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   max_new_tokens=args.max_new_tokens, key=jax.random.key(args.seed), stop_tokens=stop,
                   on_round=stream, mesh=mesh, attention_impl=args.attention_impl, sampler_impl=args.sampler_impl,
                   build_impl=args.build_impl, budget_policy=args.budget_policy, cost_table=cost_table,
                   on_compile=compiling)
    ids = [int(t) for t in res.tokens[0, : res.lengths[0]]]
    stats = res.summary()
    stats.update(method=args.method, budget=args.budget, topk_cap=args.topk_cap, budget_policy=args.budget_policy,
                 draft_vocab=args.draft_vocab,
                 temperature=args.temperature, backend=jax.default_backend())
    if args.json:
        text = tokenizer.decode(ids) if tokenizer is not None else None
        print(json.dumps({"text": text, "prompt_ids": prompt, "token_ids": ids, "stats": stats}))
    else:
        if tokenizer is None:
            print(" ".join(map(str, ids)))
        policy = "" if args.budget_policy == "fixed" else f", {args.budget_policy} budget"
        print(f"\n\n[{args.method}{policy}] tau {stats['tau']:.2f} (acceptance length "
              f"{stats['acceptance_length']:.2f}, "
              f"expected accepted {stats['expected_accepted']:.2f}; {stats['mean_tree_size']:.1f} nodes a tree) | "
              f"{stats['tokens']} tokens in {stats['rounds']} rounds | {stats['tokens_per_s']:.1f} tokens/s "
              f"({stats['backend']})")
    return 0


def cmd_sweep(args) -> int:
    """``ddtree sweep``: run the grid, then draw its table and figures unless ``--no-plot``."""
    from ddtree_jax.experiments import plot, sweep

    out = sweep.run_from_args(args)
    if args.plot:
        for path in plot.plot_csv(out):
            print(f"wrote {path}")
    return 0


def cmd_bench(args) -> int:
    """``ddtree bench`` (`ddtree_jax.experiments.bench`)."""
    from ddtree_jax.experiments import bench

    return bench.run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``ddtree`` parser with its three subcommands."""
    from ddtree_jax.experiments import bench, sweep

    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    sweep.add_arguments(sub.add_parser("sweep", help="sweep AR, chain and DDTree over a grid of settings to CSV",
                                       description=sweep.__doc__.splitlines()[0], formatter_class=HelpFormatter))
    bench.add_arguments(sub.add_parser("bench", help="time a DDTree round's parts against decoding and the roofline",
                                       description=bench.__doc__.splitlines()[0], formatter_class=HelpFormatter))
    return parser


COMMANDS = {"generate": cmd_generate, "sweep": cmd_sweep, "bench": cmd_bench}


def main(argv=None) -> int:
    """Run ``ddtree ARGS``; a ``ValueError`` (bad flag, file or model) ends it with one line and exit code 1."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ValueError as err:
        raise SystemExit(f"ddtree {args.command}: {err}") from None


if __name__ == "__main__":
    raise SystemExit(main())
