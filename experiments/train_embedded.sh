#!/usr/bin/env bash
# Reproduce the embedded default pair (tokenizer already in ddtree_jax/assets): train the target,
# train one drafter on the target's corpus and one on its own generations, and measure each
# drafter's chain acceptance on held-out prompts so the better one can be shipped.
#   bash experiments/train_embedded.sh runs/embedded
set -euo pipefail
out=${1:-runs/embedded}
target_steps=${TARGET_STEPS:-4000}
drafter_steps=${DRAFTER_STEPS:-2000}
python3 experiments/train_target.py --out "$out/target" --steps "$target_steps"
for data in corpus generations; do
  python3 experiments/train_drafter.py --target "$out/target" --out "$out/drafter_$data" --data "$data" \
    --steps "$drafter_steps"
  python3 experiments/eval_acceptance.py --target "$out/target" --drafter "$out/drafter_$data" --prompts 32 \
    --methods chain,ddtree64 --temperatures 0 --out "$out/select_$data"
done
