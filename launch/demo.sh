#!/usr/bin/env bash
# The main job on the embedded default, after set-up: two 2-rank DeepSpeed fine-tunes of the shipped
# base model at the same epochs, side by side.
#   1. ds_cluster's recommended preset keeping 30%: ONE launch computes per-sample gradient features
#      with its own engine, clusters them, plans a cluster-balanced subset and trains on it;
#   2. full data, through the same loader (one cluster, everything kept, no weights).
# Then an HTML report of the plan, and per run: kept fraction, time (selection included), held-out
# answer loss (macro and worst family) and exact match.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
OUT=${DEMO_OUT:-runs/demo}
CONFIG=${DEMO_CONFIG:-ds_configs/recommended.json}
EPOCHS=${DEMO_EPOCHS:-8}
DATA=ds_cluster/toy/data/default/train.jsonl
BASE=ds_cluster/toy/base_model
PORT=${DEMO_PORT:-29517}
# DeepSpeed's own INFO lines start with "[": hide them, keep everything else (errors included).
quiet() { grep --line-buffered -v '^\[' || true; }
rm -rf "$OUT/recommended" "$OUT/full" "$OUT/analysis" "$OUT/full_analysis"
mkdir -p "$OUT"

# Full data: the same loader with one cluster, every sample kept, weight 1.
python - "$CONFIG" "$OUT" "$DATA" <<'PY'
import json, sys
import numpy as np
from ds_cluster.dataset import read_jsonl
from ds_cluster.ds_config import read_ds_config
config, _ = read_ds_config(sys.argv[1])
out, count = sys.argv[2], len(read_jsonl(sys.argv[3]))
config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {
    "enabled": True, "budget_mode": "proportional", "budget_ratio": 1.0, "selection": "random",
    "weighting": "none", "loss_reduction": "token", "analysis_path": f"{out}/full_analysis"}
json.dump(config, open(f"{out}/full_data.json", "w"), indent=2)
__import__("os").makedirs(f"{out}/full_analysis")
np.save(f"{out}/full_analysis/labels.npy", np.zeros(count, dtype=np.int64))
PY

run() {  # name config analysis port
  local start=$(date +%s)
  deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$4" --module ds_cluster.train \
    --deepspeed "$2" --model "$BASE" --data "$DATA" --analysis "$3" --epochs "$EPOCHS" --lr-schedule cosine \
    --max-length 96 --output-dir "$OUT/$1" --save-model "$OUT/$1/model" --trace 2>&1 | quiet
  echo $(( $(date +%s) - start )) > "$OUT/$1/launch_seconds"
}
echo "== 1/4 recommended preset, 30% kept: selection and fine-tune in one launch ($CONFIG, $EPOCHS epochs)"
run recommended "$CONFIG" "$OUT/analysis" "$PORT"
echo "== 2/4 full data, same epochs and learning-rate schedule"
run full "$OUT/full_data.json" "$OUT/full_analysis" "$((PORT + 1))"

echo "== 3/4 report: plots of the plan, the schedule and the features"
ds-cluster report --analysis "$OUT/analysis" --deepspeed "$CONFIG" --world-size 2 --out "$OUT/report"

echo "== 4/4 held-out answer loss and exact match per family, side by side"
python - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

import transformers

from ds_cluster.dataset import InstructionDataset, read_jsonl
from ds_cluster.models import load_model_and_tokenizer
from ds_cluster.report import format_run_summary, run_summary
from ds_cluster.toy.evaluate import answer_loss_by_family, exact_match_by_family, summarize
from ds_cluster.toy.models import base_model_path
from ds_cluster.toy.tasks import DEFAULT_DATA

out = Path(sys.argv[1])
transformers.utils.logging.disable_progress_bar()
heldout = read_jsonl(DEFAULT_DATA / "heldout.jsonl")
rows = []
for name, source in (("base model", base_model_path()), ("full data", out / "full" / "model"),
                     ("recommended", out / "recommended" / "model")):
    model, tokenizer = load_model_and_tokenizer(str(source))
    loss = summarize(answer_loss_by_family(model, InstructionDataset(heldout, tokenizer, max_length=96)),
                     higher_is_better=False)
    exact = summarize(exact_match_by_family(model, tokenizer, heldout, max_new_tokens=20))
    run = {"name": name, "loss": loss, "exact": exact, "kept": 0.0, "seconds": 0.0, "selection": 0.0}
    folder = {"full data": out / "full", "recommended": out / "recommended"}.get(name)
    if folder is not None:
        summary = run_summary(folder)
        selection = json.loads((folder / "summary_rank0.json").read_text()).get("selection", {})
        run.update(kept=summary["num_kept"] / summary["num_samples"],
                   seconds=float((folder / "launch_seconds").read_text()),
                   selection=float(selection.get("wall", 0.0)))
        print(f"{name}: {format_run_summary(summary)}")
    rows.append(run)
full_seconds = rows[1]["seconds"]
print(f"\n{len(heldout)} held-out records (100 per family); time = the whole launch, start-up and selection included")
print(f"{'run':<12} {'kept':>5} {'time s':>7} {'/ full':>6} {'selection s':>11} {'loss macro':>10} "
      f"{'loss worst':>22} {'EM macro':>8} {'EM worst':>20}")
for r in rows:
    ratio = f"{r['seconds'] / full_seconds:.2f}" if r["seconds"] else "-"
    print(f"{r['name']:<12} {r['kept']:>5.2f} {r['seconds']:>7.0f} {ratio:>6} {r['selection']:>11.1f} "
          f"{r['loss']['macro']:>10.4f} {r['loss']['worst']:>13.4f} {r['loss']['worst_family'][:8]:>8} "
          f"{r['exact']['macro']:>8.3f} {r['exact']['worst']:>11.3f} {r['exact']['worst_family'][:8]:>8}")
print(f"\nreport: {(out / 'report' / 'index.html').resolve()}")
PY
