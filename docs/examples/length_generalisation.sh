#!/usr/bin/env bash
# The worked example of docs/evaluation.md, "Length generalisation": three quickstart-sized
# models (full RoPE, 10% RoPE, NoPE; two seeds each) trained on CPU at 128 tokens, evaluated
# by position at 1x-8x their training length, without and with YaRN, and compared.
#
#   bash docs/examples/length_generalisation.sh            # about 40 minutes on 2 CPU cores
#   bash docs/examples/length_generalisation.sh train      # only the training
#   bash docs/examples/length_generalisation.sh eval       # only the evaluations and plots
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-500}
OUT=${OUT:-runs/lengthgen}
SEEDS=${SEEDS:-"1 2"}
declare -A FRACTION=([rope100]=1.0 [rope10]=0.1 [nope]=0.0)

what=${1:-all}
if [[ $what != eval ]]; then
  for name in rope100 rope10 nope; do
    for seed in $SEEDS; do
      # the quickstart model and data; only the RoPE fraction and the seed change
      "$PY" pretrain/main.py --config configs/quickstart.yaml \
        --set model.rope_fraction="${FRACTION[$name]}" --set train.seed="$seed" \
        --set train.train_iters="$STEPS" --set checkpoint.interval="$STEPS" \
        --set logging.sample_prompts=[] --set logging.run_dir="$OUT/${name}_s$seed"
    done
  done
fi
[[ $what == train ]] && exit 0

for run in "$OUT"/*_s*; do
  "$PY" tools/evaluate.py --run "$run" --tasks none --val --per-position --lengths 1x,2x,4x,8x \
    --val-samples 512
  "$PY" tools/evaluate.py --run "$run" --tasks none --val --per-position --lengths 1x,2x,4x,8x \
    --val-samples 512 --rope-scaling yarn:8
done
"$PY" tools/compare_runs.py "$OUT"/*_s* --baseline rope100 --positions \
  --positions-plot "$OUT/by_position.png" --per-octave 8 --markdown "$OUT/compare.md"
"$PY" tools/compare_runs.py "$OUT"/*_s* --baseline rope100 --positions --rope-scaling yarn:8 \
  --positions-plot "$OUT/by_position_yarn8.png" --per-octave 8 --markdown "$OUT/compare_yarn8.md"
