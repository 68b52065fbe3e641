#!/usr/bin/env bash
# Reproduce the embedded default pair (the tokenizer is ddtree_jax/assets/tokenizer.json, made by
# train_tokenizer.py): the target, a drafter trained on the target's own samples, and the drafter's
# acceptance on held-out prompts. With COMPARE_DATA=1 a second drafter is trained on the corpus
# itself and measured the same way (the comparison that chose the generations).
#   bash experiments/train_embedded.sh runs/embedded
# then copy runs/embedded/target/{config.json,model.safetensors,tokenizer.json} and
# runs/embedded/drafter/{config.json,model.safetensors} into ddtree_jax/assets/{target,drafter}/.
set -euo pipefail
out=${1:-runs/embedded}
python3 experiments/train_target.py --out "$out/target" --steps 1200 --warmup 100
for data in generations ${COMPARE_DATA:+corpus}; do
  dir="$out/drafter"; [ "$data" = generations ] || dir="$out/drafter_$data"
  python3 experiments/train_drafter.py --target "$out/target" --out "$dir" --data "$data" \
    --gen-sequences 16384 --steps 6000 --layers 3
  python3 experiments/eval_acceptance.py --target "$out/target" --drafter "$dir" --prompts 32 \
    --methods chain,ddtree64 --temperatures 0 --out "$dir/select"
done
