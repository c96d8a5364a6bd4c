#!/usr/bin/env bash
# The main job on the embedded default: set-up, the tiny pretrained base model (cached), gradient
# features by the DeepSpeed engine (2 ranks, ZeRO-3), then a 2-rank ZeRO-3 fine-tune with
# cluster-balanced sampling on the shipped data, an HTML report of the plan, and what it kept,
# covered, took and reached (exact-match accuracy per task family on the held-out split).
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
OUT=${DEMO_OUT:-runs/demo}
CONFIG=${DEMO_CONFIG:-ds_configs/zero3.json}
DATA=ds_cluster/data/default/train.jsonl
PORT=${DEMO_PORT:-29517}
mkdir -p "$OUT"
# DeepSpeed's own INFO lines start with "[": hide them, keep everything else (errors included).
quiet() { grep --line-buffered -v '^\[' || true; }

echo "== 1/5 base model (tiny Llama pretrained on a generic split; cached in .cache/)"
python -m ds_cluster.models --seed 0

echo "== 2/5 analysis: per-sample gradient features (2 ranks, ZeRO-3) and k-means"
start=$(date +%s)
deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$PORT" "$(command -v ds-cluster)" analyze \
  --deepspeed "$CONFIG" --model tiny-base --data "$DATA" --out "$OUT/analysis" 2>&1 | quiet
analysis_s=$(( $(date +%s) - start ))

echo "== 3/5 fine-tune: 2 ranks, ZeRO-3, cluster-balanced sampling ($CONFIG)"
rm -rf "$OUT/train"
start=$(date +%s)
deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$((PORT + 1))" launch/train.py \
  --deepspeed "$CONFIG" --model tiny-base --data "$DATA" --analysis "$OUT/analysis" \
  --output-dir "$OUT/train" --epochs 1 --trace --save-model "$OUT/model" 2>&1 | quiet
train_s=$(( $(date +%s) - start ))

echo "== 4/5 report: plots of the plan, the schedule and the features"
start=$(date +%s)
ds-cluster report --analysis "$OUT/analysis" --deepspeed "$CONFIG" --world-size 2 --out "$OUT/report"
report_s=$(( $(date +%s) - start ))

echo "== 5/5 summary and held-out exact match per family (base model against the fine-tuned one)"
python - "$OUT" "$analysis_s" "$train_s" "$report_s" <<'PY'
import sys
import time
from pathlib import Path

import transformers

from ds_cluster.data.tasks import read_jsonl
from ds_cluster.evaluate import exact_match_by_family, summarize
from ds_cluster.models import load_model_and_tokenizer
from ds_cluster.plan import Plan
from ds_cluster.report import format_run_summary, plan_table, run_summary

out, analysis_s, train_s, report_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print(plan_table(Plan.load(f"{out}/train/plan")))
print(format_run_summary(run_summary(f"{out}/train")))
transformers.utils.logging.disable_progress_bar()
heldout = read_jsonl("ds_cluster/data/default/heldout.jsonl")
rows = []
for name, source in (("base (tiny-base)", "tiny-base"), ("fine-tuned", f"{out}/model")):
    model, tokenizer = load_model_and_tokenizer(source)
    # Room for the longest reference answer and its </s>: a model that never stops costs no more.
    max_new_tokens = max(len(tokenizer(r["output"], add_special_tokens=False)["input_ids"]) for r in heldout) + 1
    start = time.perf_counter()
    scores = exact_match_by_family(model, tokenizer, heldout, max_new_tokens=max_new_tokens)
    rows.append((name, time.perf_counter() - start, scores, summarize(scores)))
families = sorted(rows[0][2])
print(f"\nexact match on {len(heldout)} held-out records:")
print(f"{'model':<18} {'eval s':>6} {'macro':>6} {'worst':>16} " + " ".join(f"{f[:8]:>8}" for f in families))
for name, seconds, scores, summary in rows:
    worst = f"{summary['worst_family']} {summary['worst']:.2f}"
    print(f"{name:<18} {seconds:>6.1f} {summary['macro_avg']:>6.3f} {worst:>16} "
          + " ".join(f"{scores[f]:>8.3f}" for f in families))
print(f"\nwall time: analysis {analysis_s} s, fine-tune {train_s} s, report {report_s} s "
      "(each includes process start-up)")
print(f"report: {Path(out).resolve()}/report/index.html")
PY
