#!/usr/bin/env bash
# Reproduce the embedded default pair (the tokenizer is ddtree_jax/assets/tokenizer.json, made by
# train_tokenizer.py) on one GPU, in two stages that each stay under 10 minutes of wall time:
#   bash experiments/train_embedded.sh OUT target    # the target (OUT/target), capped at 6.5 minutes
#   bash experiments/train_embedded.sh OUT drafter   # the drafter (OUT/drafter) distilled from the
#                                                    # target on its own greedy and T = 1 text (capped
#                                                    # at 7 minutes), then its acceptance on 32
#                                                    # held-out prompts (OUT/drafter/acceptance.*)
#   bash experiments/train_embedded.sh OUT           # both
# TARGET=DIR takes the drafter stage's target from DIR instead of OUT/target; PYTHON picks the
# interpreter (default python3); TINY=1 runs every step at CPU smoke-test size. With
# COMPARE_DATA=1 the drafter stage also trains a drafter on the corpus itself (OUT/drafter_corpus)
# and measures it the same way.
# Then copy OUT/target/{config.json,model.safetensors,tokenizer.json} and
# OUT/drafter/{config.json,model.safetensors} into ddtree_jax/assets/{target,drafter}/.
set -euo pipefail
out=${1:-runs/embedded}
stage=${2:-all}
target=${TARGET:-$out/target}
py=${PYTHON:-python3}
case "$stage" in target|drafter|all) ;; *) echo "stage must be target, drafter or all, got $stage" >&2; exit 2 ;; esac
if [ -n "${TINY:-}" ]; then
  tiny=(--tiny) eval_size=(--prompts 2 --prompt-tokens 16 --new-tokens 8) eval_timeout=600
else
  tiny=() eval_size=(--prompts 32 --new-tokens 128) eval_timeout=${EVAL_TIMEOUT:-150}
fi
if [ "$stage" != drafter ]; then
  "$py" experiments/train_target.py "${tiny[@]}" --out "$target" --max-minutes 6.5
fi
if [ "$stage" != target ]; then
  for data in generations ${COMPARE_DATA:+corpus}; do
    dir="$out/drafter"; [ "$data" = generations ] || dir="$out/drafter_$data"
    "$py" experiments/train_drafter.py "${tiny[@]}" --target "$target" --out "$dir" --data "$data" \
      --max-minutes 7
    # The cells write their rows as they finish: a timeout keeps the ones done.
    timeout "$eval_timeout" "$py" experiments/eval_acceptance.py --target "$target" --drafter "$dir" \
      "${eval_size[@]}" --methods chain,ddtree64,ddtree16cap4 --temperatures 0,1 \
      --out "$dir/acceptance" || echo "eval_acceptance stopped (status $?); $dir/acceptance.json has the finished cells"
  done
fi
