#!/usr/bin/env bash
# The A/B of docs/training.md, "Document masking": the quickstart model trained on short
# documents (the paragraphs of the installed Python standard library, built here, no
# download) without and with data.document_mask + data.position_reset, two seeds each;
# loss curves, validation loss and step time compared.
#
#   bash docs/examples/document_masking.sh          # about 10 minutes on 2 CPU cores
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-500}
OUT=${OUT:-runs/docmask}
DATA=${DATA:-data/stdlib_paragraphs}
SEEDS=${SEEDS:-"1 2"}

if [[ ! -d $DATA ]]; then
  mkdir -p "$OUT"
  stdlib=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
  # One text file; paragraph mode makes each blank-line-separated block a document.
  cat "$stdlib"/*.py > "$OUT/stdlib.txt"
  "$PY" tools/prepare_data.py --input "$OUT/stdlib.txt" --txt-mode paragraph \
    --tokenizer bytes --output "$DATA" --valid-fraction 0.05 --workers 1
fi

for seed in $SEEDS; do
  for arm in plain masked; do
    switches=()
    if [[ $arm == masked ]]; then
      switches=(--set data.document_mask=true --set data.position_reset=true)
    fi
    "$PY" pretrain/main.py --config configs/quickstart.yaml \
      --set data.train="[$DATA]" --set data.valid="[$DATA]" --set data.recipe=null \
      --set train.seed="$seed" --set train.train_iters="$STEPS" \
      --set checkpoint.interval="$STEPS" --set logging.sample_prompts=[] \
      --set logging.run_dir="$OUT/${arm}_s$seed" "${switches[@]}"
  done
done
"$PY" tools/compare_runs.py "$OUT"/*_s* --baseline plain --plot "$OUT/losses.png" \
  --markdown "$OUT/compare.md"
# Step time: the median of perf/step_time_s over each run's logged steps past the first 50.
"$PY" - "$OUT" <<'PYEOF'
import json, statistics, sys
from pathlib import Path

for run in sorted(Path(sys.argv[1]).glob("*_s*")):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r and r["step"] > 50]
    print(f"{run.name}: median step time {1000 * statistics.median(times):.1f} ms")
PYEOF
# Forward + backward of the same batches, masked and not, alternating in one process (the
# ratio is what a shared machine cannot blur).
"$PY" - "$DATA" <<'PYEOF'
import statistics, sys, time

import torch

from pretrain.config import load_config
from pretrain.data.dataset import build_datasets, document_lengths
from pretrain.data.documents import DocumentSwitches, attended_fraction
from pretrain.model.transformer import Transformer

data = sys.argv[1]
sets = [f"data.train=[{data}]", f"data.valid=[{data}]", "data.recipe=null"]
cfg = load_config("configs/quickstart.yaml", sets)
print(f"attended pairs at 128: {attended_fraction(document_lengths([data]), 128):.3f}")
train, _ = build_datasets(cfg.data, 128, 1, 16 * 8, 0)
torch.manual_seed(0)
model = Transformer(cfg.model)
switches = DocumentSwitches(256, document_mask=True, position_reset=True)
batches = [torch.stack([train[i]["input_ids"] for i in range(b, b + 16)]) for b in range(0, 128, 16)]
times = {"plain": [], "masked": []}
for rep in range(40):
    for arm in ("plain", "masked") if rep % 2 else ("masked", "plain"):
        x = batches[rep % len(batches)]
        extra = switches.model_inputs(x) if arm == "masked" else {}
        start = time.perf_counter()
        model(x, x, **extra).loss.backward()
        model.zero_grad(set_to_none=True)
        times[arm].append(time.perf_counter() - start)
median = {arm: statistics.median(t[5:]) for arm, t in times.items()}
print(
    f"forward + backward, 16 x 128: plain {1000 * median['plain']:.1f} ms, masked "
    f"{1000 * median['masked']:.1f} ms, ratio {median['masked'] / median['plain']:.3f}"
)
PYEOF
