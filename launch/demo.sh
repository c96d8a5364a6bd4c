#!/usr/bin/env bash
# The main job on the embedded default: set-up, the tiny pretrained base model (cached), gradient
# features by the DeepSpeed engine (2 ranks, ZeRO-3), then a 2-rank ZeRO-3 fine-tune with
# cluster-balanced sampling on the shipped data, and what it kept, covered, took and reached.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
OUT=${DEMO_OUT:-runs/demo}
CONFIG=${DEMO_CONFIG:-ds_configs/zero3.json}
DATA=ds_cluster/data/default/train.jsonl
PORT=${DEMO_PORT:-29517}
mkdir -p "$OUT"
# DeepSpeed's own INFO lines start with "[": hide them, keep everything else (errors included).
quiet() { grep --line-buffered -v '^\[' || true; }

echo "== 1/4 base model (tiny Llama pretrained on a generic split; cached in .cache/)"
python -m ds_cluster.models --seed 0

echo "== 2/4 analysis: per-sample gradient features (2 ranks, ZeRO-3) and k-means"
start=$(date +%s)
deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$PORT" "$(command -v ds-cluster)" analyze \
  --deepspeed "$CONFIG" --model tiny-base --data "$DATA" --out "$OUT/analysis" 2>&1 | quiet
analysis_s=$(( $(date +%s) - start ))

echo "== 3/4 fine-tune: 2 ranks, ZeRO-3, cluster-balanced sampling ($CONFIG)"
rm -rf "$OUT/train"
start=$(date +%s)
deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$((PORT + 1))" launch/train.py \
  --deepspeed "$CONFIG" --model tiny-base --data "$DATA" --analysis "$OUT/analysis" \
  --output-dir "$OUT/train" --epochs 1 --trace 2>&1 | quiet
train_s=$(( $(date +%s) - start ))

echo "== 4/4 summary"
python - "$OUT" "$analysis_s" "$train_s" <<'PY'
import sys
from ds_cluster.plan import Plan
from ds_cluster.report import format_run_summary, plan_table, run_summary
out, analysis_s, train_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(plan_table(Plan.load(f"{out}/train/plan")))
print(format_run_summary(run_summary(f"{out}/train")))
print(f"wall time: analysis {analysis_s} s, fine-tune {train_s} s (both include process start-up)")
PY
