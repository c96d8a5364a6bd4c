#!/usr/bin/env bash
# The main job on real material, after set-up: two 2-rank DeepSpeed fine-tunes of a real pretrained model
# (stories260K, bench/real/stories260k) on real instruction data (the T0 slice, 7 task groups),
# at the same epochs, side by side:
#   1. ds_cluster's recommended preset keeping 30%: ONE launch computes per-sample gradient features
#      with its own engine, clusters them, plans a cluster-balanced subset and trains on it;
#   2. full data, through the same loader (one cluster, everything kept, no weights).
# Then an HTML report of the plan, and per run: kept fraction, time (selection included), held-out
# answer loss per task group (macro and worst group) and exact match on the groups whose answers are labels.
# Sized to take under 3 minutes after set-up on 2 CPU cores: a seeded 15% of the T0 train split (the same
# fraction of every group, so the groups keep their natural skew: about 1,350 records), 2 epochs, and 100 held-out
# records of every group. DEMO_TRAIN_FRACTION, DEMO_EPOCHS and DEMO_HELDOUT_PER_GROUP change the size.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
OUT=${DEMO_OUT:-runs/demo}
CONFIG=${DEMO_CONFIG:-ds_configs/recommended.json}
EPOCHS=${DEMO_EPOCHS:-2}
TRAIN_FRACTION=${DEMO_TRAIN_FRACTION:-0.15}      # of every group of the 9,000 T0 train records
HELDOUT_PER_GROUP=${DEMO_HELDOUT_PER_GROUP:-100} # a seeded 100 of the 150 held-out records of every group (0: all)
DATA_DIR=bench/real/data/t0
BASE=bench/real/stories260k
PORT=${DEMO_PORT:-29517}
# One torch thread per process: the two ranks share the two cores, and a second thread spin-waits whenever the
# other core is busy (measured on a shared 2-core machine: selection 10x and evaluation 3x slower with 2 threads).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
demo_start=$(date +%s%N)
# DeepSpeed's own INFO lines start with "[": hide them, keep everything else (errors included).
quiet() { grep --line-buffered -v '^\[' || true; }
since_start() { echo "$(( ($(date +%s%N) - demo_start) / 1000000000 )) s"; }
rm -rf "$OUT/recommended" "$OUT/full" "$OUT/analysis" "$OUT/full_analysis" "$OUT/report" "$OUT"/heldout_*.json
mkdir -p "$OUT"

echo "== 0/4 data: a seeded ${TRAIN_FRACTION} of every T0 group; full data's config [$(since_start)]"
# Writes $OUT/train.jsonl, $OUT/heldout.jsonl, $OUT/max_length (the smallest that keeps every record whole:
# a cut record would train and be scored on part of its answer), $OUT/full_data.json and its one-cluster labels.
python - "$CONFIG" "$OUT" "$DATA_DIR" "$BASE" "$TRAIN_FRACTION" "$HELDOUT_PER_GROUP" <<'PY'
import json, os, sys
from collections import Counter
import numpy as np
from transformers import AutoTokenizer
from ds_cluster.data.dataset import encode_example, read_records, write_jsonl
from ds_cluster.ds_config import read_ds_config
from ds_cluster.data.special_tokens import ensure_pad_token

config_path, out, data_dir, base, fraction, per_group = sys.argv[1:7]
rng = np.random.default_rng(0)
def seeded_part(records, take):  # the same seed, hence the same records, on every run
    groups = sorted({r["family"] for r in records})
    chosen = []
    for group in groups:
        members = [r for r in records if r["family"] == group]
        order = rng.permutation(len(members))
        chosen += [members[i] for i in sorted(order[:take(len(members))])]
    return chosen
train = seeded_part(read_records(f"{data_dir}/train.jsonl.gz"), lambda n: max(1, round(float(fraction) * n)))
heldout = read_records(f"{data_dir}/heldout.jsonl.gz")
if int(per_group):
    heldout = seeded_part(heldout, lambda n: min(n, int(per_group)))
tokenizer = AutoTokenizer.from_pretrained(base)
ensure_pad_token(tokenizer, rank=1)  # quietly: the training job says it once
max_length = max(len(encode_example(tokenizer, r, 10**9)[0]) for r in train + heldout)
write_jsonl(train, f"{out}/train.jsonl")
write_jsonl(heldout, f"{out}/heldout.jsonl")
open(f"{out}/max_length", "w").write(f"{max_length}\n")
counts = Counter(r["family"] for r in train)
print(f"train {len(train)} records: " + ", ".join(f"{g} {n}" for g, n in sorted(counts.items(), key=lambda x: -x[1])))
print(f"held-out {len(heldout)} records; max length {max_length} tokens (the longest record, prompt and answer, whole)")

config, _ = read_ds_config(config_path)
config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {
    "enabled": True, "budget_mode": "proportional", "budget_ratio": 1.0, "selection": "random",
    "weighting": "none", "loss_reduction": "token", "analysis_path": f"{out}/full_analysis"}
json.dump(config, open(f"{out}/full_data.json", "w"), indent=2)
os.makedirs(f"{out}/full_analysis")
np.save(f"{out}/full_analysis/labels.npy", np.zeros(len(train), dtype=np.int64))
PY
MAX_LENGTH=$(cat "$OUT/max_length")

run() {  # name config analysis port
  local start=$(date +%s%N)
  deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port "$4" --module ds_cluster.train \
    --deepspeed "$2" --model "$BASE" --data "$OUT/train.jsonl" --analysis "$3" --epochs "$EPOCHS" \
    --lr-schedule cosine --max-length "$MAX_LENGTH" --output-dir "$OUT/$1" --save-model "$OUT/$1/model" \
    --trace 2>&1 | quiet
  echo "$(( ($(date +%s%N) - start) / 1000000 ))" > "$OUT/$1/launch_ms"
}
echo "== 1/4 recommended preset, 30% kept: selection and fine-tune in one launch ($CONFIG, $EPOCHS epochs) [$(since_start)]"
run recommended "$CONFIG" "$OUT/analysis" "$PORT"
echo "== 2/4 full data, same epochs and learning-rate schedule [$(since_start)]"
run full "$OUT/full_data.json" "$OUT/full_analysis" "$((PORT + 1))"

echo "== 3/4 report: plots of the plan, the schedule and the features [$(since_start)]"
ds-cluster report --analysis "$OUT/analysis" --deepspeed "$CONFIG" --world-size 2 --out "$OUT/report"

echo "== 4/4 held-out answer loss per task group (and exact match on the label groups), side by side [$(since_start)]"
# The three models are evaluated at once, one process (one thread) each: the two cores are free by now.
pids=()
for name in base full recommended; do
  model="$OUT/$name/model"; [ "$name" = base ] && model="$BASE"
  TQDM_DISABLE=1 python -m ds_cluster.evaluate --model "$model" --data "$OUT/heldout.jsonl" \
    --max-length "$MAX_LENGTH" --out "$OUT/heldout_$name.json" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from ds_cluster.report.summary import format_run_summary, run_summary

out = Path(sys.argv[1])
rows = []
for run, name in (("base", "base model"), ("full", "full data"), ("recommended", "recommended")):
    (result,) = json.loads((out / f"heldout_{run}.json").read_text()).values()
    row = {"name": name, "loss": result["answer_loss_summary"], "exact": result["exact_match_summary"],
           "by_group": result["answer_loss"], "exact_by_group": result["exact_match"], "kept": 0.0,
           "seconds": 0.0, "selection": 0.0, "records": result["num_records"]}
    if run != "base":
        summary = run_summary(out / run)
        timings = json.loads((out / run / "summary_rank0.json").read_text()).get("analysis_timings") or {}
        row.update(kept=summary["num_kept"] / summary["num_samples"], selection=float(timings.get("wall", 0.0)),
                   seconds=int((out / run / "launch_ms").read_text()) / 1000)
        print(f"{name}: {format_run_summary(summary)}")
    rows.append(row)
full_seconds = rows[1]["seconds"]
groups, label_groups = sorted(rows[0]["by_group"]), sorted(rows[0]["exact_by_group"])
print(f"\n{rows[0]['records']} held-out records in {len(groups)} task groups; loss = mean NLL of each record's answer "
      f"tokens, macro = mean over groups; EM = greedy exact match on the groups whose answers are labels "
      f"({', '.join(label_groups)}); time = the whole launch, start-up and selection included")
print(f"{'run':<12} {'kept':>5} {'time s':>7} {'/ full':>6} {'selection s':>11} {'loss macro':>10} "
      f"{'loss worst (group)':>29} {'EM macro':>8} {'EM worst':>8}")
for r in rows:
    ratio = f"{r['seconds'] / full_seconds:.2f}" if r["seconds"] else "-"
    exact = r["exact"] or {"macro": float("nan"), "worst": float("nan")}
    print(f"{r['name']:<12} {r['kept']:>5.2f} {r['seconds']:>7.1f} {ratio:>6} {r['selection']:>11.1f} "
          f"{r['loss']['macro']:>10.4f} {r['loss']['worst']:>8.4f} {r['loss']['worst_group'][:20]:>20} "
          f"{exact['macro']:>8.3f} {exact['worst']:>8.3f}")
print("\nper task group: answer loss (exact match)")
print(f"{'group':<26} " + " ".join(f"{r['name']:>18}" for r in rows))
for group in groups:
    cells = [f"{r['by_group'][group]:.4f}" + (f" ({r['exact_by_group'][group]:.2f})" if group in label_groups else "")
             for r in rows]
    print(f"{group:<26} " + " ".join(f"{cell:>18}" for cell in cells))
print(f"\nreport: {(out / 'report' / 'index.html').resolve()}")
PY
echo "demo: $(since_start) after set-up"
