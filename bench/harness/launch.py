"""The parent's side of the job: its spec (WORK/spec.json: the instrument, the data, the DeepSpeed config, every
analysis and arm) and its one 2-rank deepspeed launch of bench/quality_job.py."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.harness.arms import Analysis, Arm
from bench.harness.spec import GateSpec, JobSpec
from bench.harness.data import PreparedData
from bench.harness.instrument import REPO, WORLD_SIZE, Settings, default_base_model, job_env
from ds_cluster.distributed import free_port


def ds_config(settings: Settings) -> dict[str, Any]:
    """ds_configs/zero{N}.json with the recipe's batch, precision and AdamW settings."""
    config = json.loads((REPO / "ds_configs" / f"zero{settings.zero_stage}.json").read_text())
    config.update(train_micro_batch_size_per_gpu=settings.micro_batch_size,
                  gradient_accumulation_steps=settings.gradient_accumulation_steps, steps_per_print=10 ** 9)
    if settings.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif settings.precision == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    config.pop("train_batch_size", None)
    config["optimizer"]["params"].update(betas=[0.9, 0.95], weight_decay=0.0, eps=settings.adam_eps)
    return config


def write_spec(settings: Settings, data: PreparedData, arms: Sequence[Arm], analyses: Mapping[str, Analysis]) -> Path:
    """WORK/spec.json, what the job reads; the gate is checked once its two arms (full data, random 30% of the first
    seed) have finished. The targeted instrument has no gate to stop at (its report reads the oracle's lead over
    random per target: where there is none, no selector can show one) and keeps every record's loss."""
    targeted = settings.targeted is not None
    gate = (GateSpec("targeted", arms[0].name, arms[1].name, []) if targeted
            else GateSpec.of(settings.instrument, arms, data.small_families, settings.seeds[0]))
    spec = JobSpec(
        instrument=settings.instrument, work_dir=str(settings.work_dir),
        base_model=str(default_base_model(settings)), paths={name: str(path) for name, path in data.paths.items()},
        num_train=data.num_train, exact_match_families=data.exact_match_families, ds_config=ds_config(settings),
        learning_rate=settings.learning_rate, warmup_fraction=settings.warmup_fraction,
        max_length=settings.max_length, precision=settings.precision,
        copy_probe_records=settings.copy_probe_records, copy_probe_seed=12345, peft=settings.peft,
        lora_rank=settings.lora_rank,
        evaluate_splits=["validation"] if settings.candidates or settings.validation_only
        else ["validation", "heldout"],
        analyses=dict(analyses), arms=list(arms), launched_at=time.time(), skipped=list(settings.skipped),
        gate=gate, gate_after="" if targeted else gate.after(arms), per_record=targeted)
    return spec.write(settings.work_dir / "spec.json")


def run_job(settings: Settings, spec_path: Path) -> int:
    """The one 2-rank deepspeed launch; its output goes to the console and WORK/job.log."""
    launcher = Path(sys.executable).parent / "deepspeed"
    command = [str(launcher), "--num_gpus", str(WORLD_SIZE), "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), str(REPO / "bench" / "quality_job.py"), "--spec", str(spec_path)]
    replace(JobSpec.read(spec_path), launched_at=time.time()).write(spec_path)
    env = job_env({"OMP_NUM_THREADS": "1"})
    with open(settings.work_dir / "job.log", "a", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if not line.startswith("[") or line.startswith("[rank") or "/" in line[:8]:
                sys.stdout.write(line)  # the job's own progress lines, not DeepSpeed's log
        return process.wait(timeout=settings.job_timeout_s)
