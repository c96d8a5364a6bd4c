"""The quality benchmark end to end on a tiny mixture: one 2-rank DeepSpeed job, the gate, the report.

One epoch cannot pass the calibration gate, so this also checks the rule that matters most: a run
that misses the gate says so and stops before any method comparison.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_cluster.toy.tasks import write_mixture

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_a_run_that_misses_the_gate_says_so_and_stops(tmp_path):
    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    command = [sys.executable, str(REPO / "bench" / "quality.py"), "--data", str(tmp_path / "data"),
               "--work-dir", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results"),
               "--name", "tiny", "--seeds", "1", "--test-epochs", "1"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "calibration gate: FAILED" in result.stdout
    gate = json.loads((tmp_path / "work" / "gate.json").read_text())
    assert not gate["passed"] and set(gate["checks"]) == {
        "copy_probe", "full_every_family", "full_plateau", "random30_loses_on_a_small_family"}
    assert gate["checks"]["copy_probe"]["passed"]  # the shipped base model copies
    # Only the two gate arms ran: no method was compared on an instrument that failed its gate.
    assert sorted(p.stem for p in (tmp_path / "work" / "arms").iterdir()) == ["full_s0", "random_f0.3_s0"]
    report = (tmp_path / "results" / "tiny.md").read_text()
    assert "calibration gate: FAILED" in report
    assert (tmp_path / "results" / "tiny.png").stat().st_size > 0
    validation = json.loads((tmp_path / "work" / "data" / "validation.jsonl").read_text().splitlines()[0])
    train = (tmp_path / "work" / "data" / "train.jsonl").read_text()
    assert json.dumps(validation) not in train  # validation is carved out of train


def test_base_model_flag_reaches_the_job_spec(tmp_path):
    """--base-model DIR is the checkpoint every arm loads; without it, the shipped base model."""
    from bench import quality
    from ds_cluster.toy.models import base_model_path

    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    for flags, expected in ((["--base-model", str(tmp_path / "other")], str(tmp_path / "other")),
                            ([], base_model_path())):
        argv = ["--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work"), "--gate-only", *flags]
        settings = quality.settings_from_args(quality.parse_args(argv), argv)
        settings.work_dir.mkdir(parents=True, exist_ok=True)
        data = quality.prepare_data(settings)
        arms, analyses = quality.build_arms(settings, data)
        job_spec = json.loads(Path(quality.write_spec(settings, data, arms, analyses)).read_text())
        assert job_spec["base_model"] == expected


def test_arms_flag_runs_only_the_named_arms_beside_full_data(tmp_path):
    """--arms random,recommended --no-ablations: full data and those arms on every seed and fraction, nothing else."""
    from bench import quality

    write_mixture(tmp_path / "data", seed=5, total=240, heldout_per_family=3)
    argv = ["--data", str(tmp_path / "data"), "--work-dir", str(tmp_path / "work"),
            "--arms", "random,recommended", "--no-ablations"]
    settings = quality.settings_from_args(quality.parse_args(argv), argv)
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    arms, _ = quality.build_arms(settings, quality.prepare_data(settings))
    assert {arm["method"] for arm in arms} == {"full", "random", "recommended"}
    assert len([arm for arm in arms if arm["method"] == "recommended"]) == len(settings.seeds) * len(settings.fractions)
    with pytest.raises(SystemExit, match="oracel"):
        quality.settings_from_args(quality.parse_args(["--arms", "random,oracel"]), [])
