"""The `ds-cluster` subcommands: help, plan, report, train (dry runs and one real 2-rank run)."""
from __future__ import annotations

import hashlib
import html
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from ds_cluster.batching import BatchShape, batch_shape_from_config
from ds_cluster.cli import main
from ds_cluster.cli.common import BATCH_FLAGS
from ds_cluster.planning.plan import Plan
from tests.launching import REPO, check, job_env

CONFIG = REPO / "ds_configs" / "zero2.json"


@pytest.fixture(scope="module")
def analysis(small_job: Path) -> Path:  # noqa: F811
    """small_job's analysis with a manifest naming its data, as `ds-cluster analyze` writes one."""
    folder = small_job / "analysis"
    (folder / "manifest.json").write_text(json.dumps({"data": str(small_job / "train.jsonl")}))
    return folder


@pytest.mark.parametrize("command", ["analyze", "plan", "report", "train"])
def test_every_subcommand_explains_itself(command: str, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and f"ds-cluster {command}" in text.replace("$(which ds-cluster) ", "ds-cluster ")
    assert "--deepspeed" in text


def resolve_batch_shape(config: dict, world: Optional[int], micro: Optional[int], accumulation: Optional[int]):
    shape = batch_shape_from_config(config, "CONFIG", world_size=world, micro_batch_size=micro,
                                    gradient_accumulation_steps=accumulation, flags=BATCH_FLAGS)
    return shape.world_size, shape.micro_batch_size, shape.gradient_accumulation_steps


def test_batch_shape_comes_from_flags_then_config_then_deepspeeds_rules():
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    assert resolve_batch_shape(config, None, None, None) == (4, 4, 2)
    assert resolve_batch_shape(config, 8, 1, None) == (8, 1, 2)
    assert resolve_batch_shape({"train_micro_batch_size_per_gpu": 4}, None, None, None) == (1, 4, 1)
    # DeepSpeed derives what is missing from train_batch_size.
    assert resolve_batch_shape({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, None, None) == (4, 4, 2)
    with pytest.raises(ValueError, match="pass --world-size"):
        resolve_batch_shape({**config, "train_batch_size": 33}, None, None, None)
    assert BatchShape(2, 4, 2).global_batch_size == 16


@pytest.mark.parametrize("key,flag", [("train_micro_batch_size_per_gpu", "--micro-batch-size"),
                                      ("gradient_accumulation_steps", "--gradient-accumulation-steps"),
                                      ("train_batch_size", "--world-size")])
def test_auto_in_the_config_asks_for_the_flag_by_name(key: str, flag: str):
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              key: "auto"}
    with pytest.raises(ValueError, match=f"^{key} is 'auto' in CONFIG: pass {flag}$"):
        resolve_batch_shape(config, None, None, None)
    given = {"world_size": 2, "micro_batch_size": 4, "gradient_accumulation_steps": 2}
    flag_of = {"--world-size": "world_size", "--micro-batch-size": "micro_batch_size",
               "--gradient-accumulation-steps": "gradient_accumulation_steps"}
    values = {name: (given[name] if flag_of[flag] == name else None) for name in given}
    assert resolve_batch_shape(config, values["world_size"], values["micro_batch_size"],
                               values["gradient_accumulation_steps"]) == (2, 4, 2)


def test_plan_command_with_auto_batch_names_the_flag(analysis: Path, tmp_path: Path, caplog):
    config = json.loads(CONFIG.read_text())
    config.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--analysis", str(analysis), "--deepspeed", str(path), "--world-size", "2"]) == 2
    assert f"train_micro_batch_size_per_gpu is 'auto' in {path}: pass --micro-batch-size" in caplog.text
    assert main(["plan", "--analysis", str(analysis), "--deepspeed", str(path), "--world-size", "2",
                 "--micro-batch-size", "4", "--gradient-accumulation-steps", "2"]) == 0


def test_plan_prints_the_summary_and_coverage(analysis: Path, tmp_path: Path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--analysis", str(analysis), "--deepspeed", str(CONFIG), "--world-size", "2",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    saved = Plan.load(out)
    assert saved.world_size == 2 and saved.micro_batch_size == 4 and saved.gradient_accumulation_steps == 2
    assert f"plan {saved.fingerprint()}" in text
    assert "clusters per global step min" in text and "per rank and step min" in text
    for cluster in range(saved.num_clusters):
        assert f"{int(saved.cluster_sizes[cluster]):>8} {int(saved.kept_sizes[cluster]):>8}" in text


def test_plan_json_matches_the_plan(analysis: Path, capsys):
    assert main(["plan", "--analysis", str(analysis), "--deepspeed", str(CONFIG), "--world-size", "2",
                 "--micro-batch-size", "2", "--gradient-accumulation-steps", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["summary"]["global_batch_size"] == 4
    assert printed["coverage"]["steps"] == printed["summary"]["steps_per_epoch"]
    # The paper preset: K = world size, one cluster per rank in every step.
    assert printed["summary"]["num_clusters"] == 2 and printed["coverage"]["clusters_per_rank_step_mean"] == 1.0


def test_plan_of_a_missing_analysis_is_an_error_message(tmp_path: Path, caplog):
    assert main(["plan", "--analysis", str(tmp_path / "nowhere"), "--deepspeed", str(CONFIG)]) == 2
    assert "nowhere does not exist" in caplog.text


def test_report_writes_the_page_with_a_family_table(analysis: Path, tmp_path: Path, capsys):
    assert main(["report", "--analysis", str(analysis), "--deepspeed", str(CONFIG), "--world-size", "2",
                 "--out", str(tmp_path / "report")]) == 0
    index = tmp_path / "report" / "index.html"
    assert f"report: {index}" in capsys.readouterr().out
    page = index.read_text()
    assert "Purity" in page and "categories.png" in page and "projection.png" in page
    assert (tmp_path / "report" / "categories.png").stat().st_size > 0
    # What each cluster holds, from the manifest's records: the prompts nearest each centre, as the user wrote them.
    records = [json.loads(line) for line in (analysis.parent / "train.jsonl").read_text().splitlines()]
    shown = [record["instruction"] for record in records if html.escape(" ".join(record["instruction"].split())[:40])
             in page]
    assert len(shown) >= 3, "no example prompt of the records in the page"
    assert main(["report", "--analysis", str(analysis), "--deepspeed", str(CONFIG), "--world-size", "2",
                 "--out", str(tmp_path / "hidden"), "--no-text"]) == 0
    hidden = (tmp_path / "hidden" / "index.html").read_text()
    assert "Purity" in hidden and not any(html.escape(" ".join(text.split())[:40]) in hidden for text in shown)


def test_report_reads_the_records_the_analysis_was_made_of_and_says_why_when_it_cannot(small_job: Path,  # noqa: F811
                                                                                     tmp_path: Path, caplog):
    """An analysis records the file its records came from (path and content fingerprint); `ds-cluster report`
    without --data reads them from there while the file is unchanged, and otherwise names the file and why."""
    import shutil

    from ds_cluster import ClusterSamplingConfig, analyze
    from ds_cluster.analysis.compute import AnalysisOptions
    from ds_cluster.data.dataset import load_instruction_dataset, source_fingerprint
    from ds_cluster.data.models import load_model_and_tokenizer

    data = tmp_path / "train.jsonl"
    shutil.copy(small_job / "train.jsonl", data)
    model, tokenizer = load_model_and_tokenizer(small_job / "model")
    config = ClusterSamplingConfig(enabled=True, num_clusters=4, kmeans_n_init=1, feature_kind="proxy")
    analyze(model, load_instruction_dataset(data, tokenizer, max_length=64), tmp_path / "analysis", config,
            AnalysisOptions(batch_size=64, show_progress=False))
    manifest = json.loads((tmp_path / "analysis" / "manifest.json").read_text())
    assert manifest["data_source"] == {"path": str(data), "fingerprint": source_fingerprint(data)}

    def page(name: str, *extra: str) -> str:
        assert main(["report", "--analysis", str(tmp_path / "analysis"), "--deepspeed",
                     str(REPO / "ds_configs" / "recommended.json"), "--world-size", "2", "--out", str(tmp_path / name),
                     *extra]) == 0
        return (tmp_path / name / "index.html").read_text()

    first = json.loads(data.read_text().splitlines()[0])
    read = page("read")
    assert "Purity" in read and "No records" not in read and str(data) in read  # the records' file, an input
    assert "<ol><li>" in read  # example prompts, read from the file
    hidden = page("hidden", "--no-text")
    assert "Purity" in hidden and "left out of this report (--no-text)" in hidden
    data.write_text(data.read_text().replace(first["instruction"], first["instruction"] + " (edited)", 1))
    changed = page("changed")
    assert f"{data} has changed since" in html.unescape(changed) and "Purity" not in changed
    assert f"{data} has changed since" in caplog.text
    data.unlink()
    gone = page("gone")
    assert f"was made of {data}, which is not there any more" in html.unescape(gone)


def dry_run(capsys, *args: str) -> str:
    assert main(["train", "--deepspeed", "cfg.json", *args, "--dry-run", "--", "--model", "m"]) == 0
    return capsys.readouterr().out


def test_train_dry_run_commands(capsys):
    deepspeed = dry_run(capsys, "--nproc", "3", "--master-port", "29999")
    assert "MASTER_ADDR=127.0.0.1" in deepspeed and "GLOO_SOCKET_IFNAME=lo" in deepspeed
    assert "deepspeed --num_gpus 3 --master_addr 127.0.0.1 --master_port 29999" in deepspeed
    assert deepspeed.rstrip().endswith("--module ds_cluster.train --deepspeed cfg.json --model m")

    mpirun = dry_run(capsys, "--launcher", "mpirun")
    assert "mpirun -np 2 --oversubscribe --mca btl self,vader --mca oob_tcp_if_include lo" in mpirun
    assert "-x MASTER_ADDR" in mpirun and "-x GLOO_SOCKET_IFNAME" in mpirun
    assert mpirun.rstrip().endswith(f"{sys.executable} -m ds_cluster.train --deepspeed cfg.json --model m")

    single = dry_run(capsys, "--launcher", "none")
    assert "RANK=0" in single and "WORLD_SIZE=1" in single and "deepspeed --num_gpus" not in single

    hosts = dry_run(capsys, "--hostfile", "hosts.txt")
    assert "--hostfile hosts.txt --launcher openmpi --master_port 29500" in hosts
    assert "127.0.0.1" not in hosts and "GLOO_SOCKET_IFNAME" not in hosts


@pytest.mark.integration
def test_train_runs_two_ranks_with_the_deepspeed_launcher(small_job: Path, tmp_path: Path):  # noqa: F811
    """A real ZeRO-3 run through `ds-cluster train`, and its --save-model folder holds the trained weights."""
    out, config = tmp_path / "run", REPO / "ds_configs" / "zero3.json"
    command = [sys.executable, "-m", "ds_cluster.cli", "train", "--deepspeed", str(config), "--nproc", "2", "--",
               "--model", str(small_job / "model"), "--data", str(small_job / "train.jsonl"),
               "--analysis", str(small_job / "analysis"),
               "--output-dir", str(out), "--max-length", "64", "--max-steps", "2", "--save-model", str(out / "model"),
               "--lr-schedule", "cosine"]
    result = check(subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300))
    # The printed command runs the packaged training script.
    printed = result.stdout.splitlines()[0]
    assert f"--module ds_cluster.train --deepspeed {config} --model {small_job / 'model'}" in printed
    summaries = [json.loads((out / f"summary_rank{rank}.json").read_text()) for rank in range(2)]
    assert [s["steps"] for s in summaries] == [2, 2]
    assert summaries[0]["parameter_digest"] == summaries[1]["parameter_digest"]
    # The cosine schedule ends at the run's own last step (here --max-steps): the rate is 0 after it.
    assert [s["learning_rate"] for s in summaries] == [0.0, 0.0]

    from ds_cluster.data.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(out / "model"))
    digest = hashlib.sha256()
    for param in model.parameters():  # as ds_cluster.train's parameter_digest
        digest.update(param.detach().float().cpu().numpy().round(5).tobytes())
    assert digest.hexdigest()[:16] == summaries[0]["parameter_digest"], "saved weights are not the trained ones"


def test_a_jobs_master_port_is_free_and_outside_the_range_outgoing_connections_take():
    # A port the kernel may also hand to an outgoing socket (mpirun's daemons, gloo) can be taken between the
    # check and the rendezvous: the job then fails with EADDRINUSE (seen on a clean-clone run of the suite).
    import socket

    from ds_cluster.distributed import _ephemeral_port_low, free_port

    low = _ephemeral_port_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
