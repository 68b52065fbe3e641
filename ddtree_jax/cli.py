"""The ``ddtree`` command line.

``ddtree generate`` runs AR, DFlash chain or DDTree generation on the embedded stdlib model (or any
HF-format target/drafter directories), streaming the text per round and printing the statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree_jax.assets import DRAFTER_DIR, TARGET_DIR


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with AR, chain or DDTree decoding",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="def fibonacci(n):", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids (instead of --prompt)")
    p.add_argument("--method", choices=["ddtree", "chain", "ar"], default="ddtree")
    p.add_argument("--budget", type=int, default=16, help="DDTree node budget (non-root nodes)")
    p.add_argument("--topk-cap", type=int, default=4, help="per-depth rank cap; 0 = none")
    p.add_argument("--draft-temperature", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="devices the target is tensor-parallel over")
    p.add_argument("--dp", type=int, default=1, help="devices the batch of requests is split over")
    p.add_argument("--attention-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="tree-verify attention: the Pallas kernel on a supported GPU (auto; per device "
                        "with --tp/--dp) or XLA")
    p.add_argument("--sampler-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="tree sampling: the fused Pallas kernel on a supported GPU without --tp/--dp (auto) "
                        "or the jnp path")
    p.add_argument("--target", type=Path, default=TARGET_DIR, help="HF-format target directory")
    p.add_argument("--drafter", type=Path, default=DRAFTER_DIR, help="HF-format DFlash drafter directory")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype; auto = float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")


def _load(args):
    import jax
    import jax.numpy as jnp

    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.tokenizer import Tokenizer

    for name in ("target", "drafter"):
        path = getattr(args, name)
        if not (path / "config.json").is_file():
            raise SystemExit(f"ddtree: --{name} {path} is not an HF-format model directory (no config.json)")
    if args.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(args.dtype)
    target = load_target(args.target, dtype=dtype)
    drafter = None if args.method == "ar" else load_drafter(args.drafter, dtype=dtype)
    tok_path = args.target / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_path) if tok_path.is_file() else None
    return target, drafter, tokenizer


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            msg = f"ddtree: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            raise SystemExit(msg) from None
    if tokenizer is None:
        raise SystemExit("ddtree: the target directory has no tokenizer.json; pass --prompt-ids")
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
    import jax

    from ddtree_jax.engine import generate

    target, drafter, tokenizer = _load(args)
    prompt = _prompt_ids(args, tokenizer)
    stop = [] if args.no_stop or tokenizer is None else [tokenizer.eot_id]
    shown = [0]

    def stream(tokens, num_generated, _stats):
        if args.json or tokenizer is None:
            return
        n = int(num_generated[0])
        ids = [int(t) for t in tokens[0, :n] if t >= 0 and t != tokenizer.eot_id]
        text = tokenizer.decode(ids)
        sys.stdout.write(text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(text)

    if not args.json and tokenizer is not None:
        sys.stdout.write(tokenizer.decode(prompt))
    try:
        mesh = _mesh(args, target)
        res = generate(target, drafter, [prompt], method=args.method, budget=args.budget,
                       topk_cap=args.topk_cap or None, draft_temperature=args.draft_temperature,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       max_new_tokens=args.max_new_tokens, key=jax.random.key(args.seed), stop_tokens=stop,
                       on_round=stream, mesh=mesh, attention_impl=args.attention_impl,
                       sampler_impl=args.sampler_impl)
    except ValueError as err:
        raise SystemExit(f"ddtree: {err}") from None
    ids = [int(t) for t in res.tokens[0, : res.lengths[0]]]
    stats = res.summary()
    stats.update(method=args.method, budget=args.budget, topk_cap=args.topk_cap, temperature=args.temperature,
                 backend=jax.default_backend())
    if args.json:
        text = tokenizer.decode(ids) if tokenizer is not None else None
        print(json.dumps({"text": text, "prompt_ids": prompt, "token_ids": ids, "stats": stats}))
    else:
        if tokenizer is None:
            print(" ".join(map(str, ids)))
        print(f"\n\n[{args.method}] tau {stats['tau']:.2f} (expected accepted {stats['expected_accepted']:.2f}) | "
              f"{stats['tokens']} tokens in {stats['rounds']} rounds | {stats['tokens_per_s']:.1f} tokens/s "
              f"({stats['backend']})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from ddtree_jax.experiments import bench, sweep

    sweep.add_arguments(sub.add_parser("sweep", help="sweep AR, chain and DDTree over a grid of settings to CSV",
                                       description=sweep.__doc__.splitlines()[0]))
    bench.add_arguments(sub.add_parser("bench", help="time a DDTree round's parts against decoding and the roofline",
                                       description=bench.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return {"generate": cmd_generate, "sweep": sweep.run_from_args, "bench": bench.run_from_args}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
