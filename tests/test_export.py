"""`ds-cluster export`: the kept records unchanged plus cluster and weight, the left-out complement, the
manifest, the datasets format, clear errors, and docs/export.md's plain Hugging Face Trainer run on an export."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest

from ds_cluster import ClusterSamplingConfig
from tests.planning import plan_of
from ds_cluster.cli import main
from ds_cluster.data.dataset import read_jsonl
from ds_cluster.report.export import export_subset, manifest_path
from tests.launching import REPO, job_env

CONFIG = REPO / "ds_configs" / "zero2.json"


@pytest.fixture(scope="module")
def plan_and_records():
    rng = np.random.default_rng(3)
    features = np.concatenate([rng.normal(0, 1, (60, 4)) + 5, rng.normal(0, 1, (40, 4)) - 5]).astype(np.float32)
    features[-3:] = 0.0  # three records with no response token: never kept
    records = [{"instruction": f"task {i}", "output": str(i), "nested": {"tags": [i % 3]}} for i in range(100)]
    config = ClusterSamplingConfig(enabled=True, num_clusters=2, budget_mode="proportional", budget_ratio=0.3,
                                   kmeans_n_init=2)
    plan = plan_of(features, config, world_size=2, micro_batch_size=2, gradient_accumulation_steps=1,
                      exclude=~np.any(features != 0, axis=1))
    return plan, records


def test_the_kept_records_are_written_unchanged_with_cluster_and_weight(plan_and_records, tmp_path):
    plan, records = plan_and_records
    manifest = export_subset(plan, records, tmp_path / "subset.jsonl", excluded=tmp_path / "left_out.jsonl")
    kept, left_out = read_jsonl(tmp_path / "subset.jsonl"), read_jsonl(tmp_path / "left_out.jsonl")
    assert len(kept) == plan.num_kept and len(kept) + len(left_out) == len(records)
    for row, index in zip(kept, plan.selected):
        assert {k: v for k, v in row.items() if k not in ("cluster", "weight")} == records[index]
        assert (row["cluster"], row["weight"]) == (int(plan.labels[index]), float(plan.weights[index]))
    left_indices = sorted(set(range(len(records))) - set(plan.selected.tolist()))
    assert [row["instruction"] for row in left_out] == [records[i]["instruction"] for i in left_indices]
    assert all(row["weight"] == 0.0 for row in left_out)
    assert [row["cluster"] for row in left_out[-3:]] == [-1, -1, -1]
    on_disk = json.loads(manifest_path(tmp_path / "subset.jsonl").read_text())
    assert on_disk == manifest and manifest["plan_fingerprint"] == plan.fingerprint()
    assert [(c["size"], c["kept"]) for c in manifest["clusters"]] == list(zip(plan.cluster_sizes.tolist(),
                                                                            plan.kept_sizes.tolist()))
    assert (manifest["num_kept"], manifest["num_excluded"]) == (len(kept), len(left_out))


def test_the_datasets_format_holds_the_same_rows(plan_and_records, tmp_path):
    plan, records = plan_and_records
    export_subset(plan, records, tmp_path / "jsonl.jsonl")
    export_subset(plan, records, tmp_path / "folder", export_format="datasets")
    assert datasets.load_from_disk(str(tmp_path / "folder")).to_list() == read_jsonl(tmp_path / "jsonl.jsonl")
    assert json.loads(manifest_path(tmp_path / "folder").read_text())["format"] == "datasets"


def test_bad_exports_are_refused_with_the_reason(plan_and_records, tmp_path):
    plan, records = plan_and_records
    with pytest.raises(ValueError, match="the data has 99 records but the plan 100 samples"):
        export_subset(plan, records[:99], tmp_path / "a.jsonl")
    clashing = [dict(record, weight=1) if i == int(plan.selected[0]) else record for i, record in enumerate(records)]
    with pytest.raises(ValueError, match=f"record {int(plan.selected[0])} already has a field named 'weight'"):
        export_subset(plan, clashing, tmp_path / "b.jsonl")
    with pytest.raises(ValueError, match="expected one of jsonl, datasets"):
        export_subset(plan, records, tmp_path / "c", export_format="parquet")
    assert not (tmp_path / "b.jsonl").exists()


@pytest.fixture(scope="module")
def exported(small_job: Path, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("export")
    assert main(["export", "--analysis", str(small_job / "analysis"), "--deepspeed", str(CONFIG),
                 "--world-size", "2", "--data", str(small_job / "train.jsonl"), "--out", str(out / "subset.jsonl"),
                 "--excluded", str(out / "left_out.jsonl")]) == 0
    return out


def test_the_command_exports_the_plan_report_and_plan_show(exported: Path, small_job: Path, capsys):
    assert main(["plan", "--analysis", str(small_job / "analysis"), "--deepspeed", str(CONFIG), "--world-size", "2",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    manifest = json.loads((exported / "subset.jsonl.manifest.json").read_text())
    assert manifest["plan_fingerprint"] == summary["fingerprint"] and manifest["num_kept"] == summary["num_kept"]
    assert len(read_jsonl(exported / "subset.jsonl")) == summary["num_kept"]
    assert len(read_jsonl(exported / "left_out.jsonl")) == summary["num_samples"] - summary["num_kept"]


def test_the_command_reports_bad_input_without_a_traceback(small_job: Path, tmp_path: Path, caplog):
    assert main(["export", "--analysis", str(small_job / "analysis"), "--deepspeed", str(CONFIG), "--world-size", "2",
                 "--data", str(REPO / "bench" / "real" / "data" / "t0" / "heldout.jsonl.gz"),
                 "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "export the data the analysis was computed on" in caplog.text


def test_the_documented_plain_trainer_trains_the_export(exported: Path, small_job: Path, tmp_path: Path):
    code = re.search(r"```python\n(.*?)```", (REPO / "docs" / "export.md").read_text(), re.S).group(1)
    values = f'MODEL, SUBSET, OUT = {str(small_job / "model")!r}, {str(exported / "subset.jsonl")!r}, ' \
             f'{str(tmp_path / "out")!r}'
    code = code.replace('MODEL, SUBSET, OUT = "path/to/model", "runs/demo/subset.jsonl", "runs/demo/plain_trainer"',
                        values)
    assert values in code and "num_train_epochs=2" in code
    code = code.replace("num_train_epochs=2", "max_steps=2, logging_steps=1, use_cpu=True")
    script = tmp_path / "plain_trainer.py"
    script.write_text(code.replace("WeightedTrainer(model=model, args=arguments, train_dataset=subset, "
                                   "data_collator=collate).train()",
                                   "trainer = WeightedTrainer(model=model, args=arguments, train_dataset=subset, "
                                   "data_collator=collate)\ntrainer.train()\nimport json\nprint('LOSSES', json.dumps("
                                   "[e['loss'] for e in trainer.state.log_history if 'loss' in e]))"))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env=job_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(result.stdout.split("LOSSES", 1)[1])
    assert len(losses) == 2 and all(np.isfinite(losses)) and losses[0] > 0
