"""The adaptive schedule in real 2-rank DeepSpeed jobs: the hook under the deepspeed launcher and mpirun, ZeRO-3,
ZeRO-2 (on chat records), ZeRO-1 (until ranks that disagree stop) and ZeRO-0 (the automatic budget), resume
mid-window after a real SIGKILL, ClusterTrainer (with resume) and ClusterSFTTrainer."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds_cluster.planning.plan import Plan
from ds_cluster.planning.shares import window_draws
from tests.launching import REPO, check, run_deepspeed, run_mpirun
from tests.test_bad_inputs import assert_failed_on_every_rank
from tests.training import TRAIN, read_trace, train_args
from tests.workers.fault_worker import KILL_AFTER_STEP_VAR, SKEW_FROM_WINDOW_VAR, SKEW_SHARES_VAR

pytestmark = pytest.mark.integration

WORKER = str(REPO / "tests" / "workers" / "fault_worker.py")
HF_WORKER = REPO / "tests" / "workers" / "hf_trainer_worker.py"
SFT_WORKER = REPO / "tests" / "workers" / "trl_trainer_worker.py"
ADAPT_EVERY, STEPS = 3, 9  # three windows of 3 optimizer steps
BLOCK = {"enabled": True, "schedule": "adaptive", "adaptive_rule": "loss", "adapt_every": ADAPT_EVERY,
         "probe_size": 2, "num_clusters": 4, "budget_mode": "proportional", "budget_ratio": 0.5,
         "selection": "random", "kmeans_n_init": 2, "allocation": "stratified"}


def adaptive_config(small_job: Path, folder: Path, stage: int, **keys) -> Path:
    config = json.loads((REPO / "ds_configs" / f"zero{stage}.json").read_text())
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {
        **BLOCK, "analysis_path": str(small_job / "analysis"), "schedule_log": str(folder / "schedule.jsonl"), **keys}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ds_config.json").write_text(json.dumps(config))
    return folder / "ds_config.json"


def hook_args(small_job: Path, out: Path, stage: int, *extra: str) -> list[str]:
    args = train_args(small_job, f"zero{stage}.json", out, "--max-steps", str(STEPS), *extra)
    args[args.index("--deepspeed") + 1] = str(adaptive_config(small_job, out, stage))
    return args


def log_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "schedule.jsonl").read_text().splitlines()]


def test_every_window_is_drawn_at_the_shares_the_window_before_gave(adaptive_run):
    plan = Plan.load(adaptive_run / "plan")
    log = log_of(adaptive_run)
    assert [line["window"] for line in log] == [0, 1]  # window 2 closes after the last step
    natural = plan.cluster_sizes / plan.cluster_sizes.sum()
    steps: dict[int, list[int]] = {}  # optimizer step (from 0) -> the indices both ranks trained in it
    for rank in range(2):
        for number, record in enumerate(read_trace(adaptive_run, rank)):
            steps.setdefault(number // plan.gradient_accumulation_steps, []).extend(record["indices"])
    assert sorted(steps) == list(range(STEPS))
    # Holding out the probe set makes a cluster's pool smaller, never its share: the draws are the shares'.
    for window, shares in enumerate([natural] + [np.array(line["shares"]) for line in log]):
        drawn = [index for step in range(window * ADAPT_EVERY, (window + 1) * ADAPT_EVERY) for index in steps[step]]
        counts = np.bincount(plan.labels[drawn], minlength=plan.num_clusters)
        assert counts.tolist() == window_draws(shares, ADAPT_EVERY * plan.global_batch_size).tolist(), window
    # The loss rule moves the shares towards the clusters whose losses are higher; the log says what it read.
    assert log[0]["shares"] != pytest.approx(natural.tolist()) and all(line["train_loss"] for line in log)
    assert all(line["probe_loss"] is not None for line in log)
    digests = {json.loads((adaptive_run / f"summary_rank{r}.json").read_text())["parameter_digest"] for r in (0, 1)}
    assert len(digests) == 1


def test_the_report_plots_the_adaptive_runs_shares_and_losses(adaptive_run, small_job, tmp_path):
    from ds_cluster.cli import main

    assert main(["report", "--analysis", str(small_job / "analysis"),
                 "--deepspeed", str(adaptive_run / "ds_config.json"),
                 "--world-size", "2", "--schedule-log", str(adaptive_run / "schedule.jsonl"),
                 "--out", str(tmp_path / "report"), "--no-text"]) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    last = log_of(adaptive_run)[-1]
    assert "Adaptive schedule" in page and f"2 windows closed, up to optimizer step {last['step']}" in page
    assert (tmp_path / "report" / "schedule.png").read_bytes()[:4] == b"\x89PNG"


def test_a_rank_killed_mid_window_resumes_to_the_same_shares_indices_and_losses(adaptive_run, small_job, tmp_path):
    parts = tmp_path / "parts"
    # Rank 1 dies (SIGKILL) right after step 5; the last checkpoint is step 4's, inside window 1 (steps 4 to 6).
    killed = run_deepspeed([WORKER, *hook_args(small_job, parts, 3, "--save-every", "2")[2:]], timeout=300,
                           env_extra={KILL_AFTER_STEP_VAR: "5"})
    assert killed.returncode != 0
    assert (parts / "checkpoints" / "latest").read_text().strip() == "global_step4"
    lines_before = {rank: len(read_trace(parts, rank)) for rank in range(2)}
    gas = Plan.load(parts / "plan").gradient_accumulation_steps
    # Relaunched through mpirun: the checkpoint, not the launcher, carries the schedule.
    check(run_mpirun(hook_args(small_job, parts, 3, "--save-every", "2", "--resume"), timeout=300))
    for rank in range(2):
        expected, trace = read_trace(adaptive_run, rank), read_trace(parts, rank)
        replayed = trace[:4 * gas] + trace[lines_before[rank]:]
        assert [r["indices"] for r in replayed] == [r["indices"] for r in expected], f"rank {rank}"
        assert np.allclose([r["loss"] for r in replayed], [r["loss"] for r in expected], rtol=0, atol=1e-6)
    assert log_of(parts) == log_of(adaptive_run)  # the same figures, the same shares


def test_a_zero1_bf16_run_trains_window_by_window_until_ranks_whose_shares_disagree_stop(small_job, tmp_path):
    """ZeRO-1, bf16, mpirun: window 0 is trained and closed and window 1 drawn at the shares window 0 logged; then
    rank 1's rule gives other shares than rank 0's (from window 1's close on) and every rank stops, naming it."""
    out = tmp_path / "zero1"
    result = run_mpirun([WORKER, *hook_args(small_job, out, 1, "--bf16")[2:]], timeout=180,
                        env_extra={SKEW_SHARES_VAR: "1", SKEW_FROM_WINDOW_VAR: "2"})
    assert_failed_on_every_rank(result, "ranks disagree on the adaptive schedule's shares after window 1", 1.0)
    log, plan = log_of(out), Plan.load(out / "plan")
    assert [line["window"] for line in log] == [0] and sum(log[0]["shares"]) == pytest.approx(1.0)
    window_1 = [index for rank in range(2) for record in read_trace(out, rank)
                [ADAPT_EVERY * plan.gradient_accumulation_steps:2 * ADAPT_EVERY * plan.gradient_accumulation_steps]
                for index in record["indices"]]
    counts = np.bincount(plan.labels[window_1], minlength=plan.num_clusters)
    assert counts.tolist() == window_draws(np.array(log[0]["shares"]), ADAPT_EVERY * plan.global_batch_size).tolist()


def _trainer(small_job: Path, folder: Path, out: Path, *extra: str):
    config = adaptive_config(small_job, folder, 3, schedule_log=str(out / "schedule.jsonl"))
    return run_mpirun([str(HF_WORKER), "--deepspeed", str(config), "--model", str(small_job / "model"),
                          "--data", str(small_job / "train.jsonl"), "--out", str(out), "--max-steps", str(STEPS),
                          "--save-steps", "4", *extra], timeout=300)


def _ranks_train_other_samples(out: Path) -> bool:
    """Every micro-step, the two ranks trained disjoint samples (a window draws without replacement): each rank
    its own part of the plan, not a plan of its own."""
    traces = [read_trace(out, rank) for rank in range(2)]
    return len(traces[0]) == len(traces[1]) > 0 and all(
        not set(first["indices"]) & set(second["indices"]) for first, second in zip(*traces))


def test_cluster_trainer_runs_the_adaptive_schedule_and_resumes_mid_window(small_job, tmp_path):
    whole = tmp_path / "whole"
    check(_trainer(small_job, tmp_path / "config", whole))
    assert [line["window"] for line in log_of(whole)] == [0, 1]
    assert _ranks_train_other_samples(whole)
    resumed = tmp_path / "resumed"
    check(_trainer(small_job, tmp_path / "config", resumed, "--resume", str(whole / "checkpoint-4")))
    gas = json.loads((REPO / "ds_configs" / "zero3.json").read_text())["gradient_accumulation_steps"]
    for rank in range(2):
        expected, got = read_trace(whole, rank)[4 * gas:], read_trace(resumed, rank)
        assert [r["indices"] for r in got] == [r["indices"] for r in expected], f"rank {rank}"
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], abs=1e-5)
    # The resumed run closes window 1 (steps 4 to 6) with the figures the uninterrupted run logged for it.
    assert log_of(resumed) == [line for line in log_of(whole) if line["window"] >= 1]


def test_cluster_sft_trainer_draws_its_windows_at_the_logged_shares(small_job, tmp_path):
    out = tmp_path / "sft"
    # SFTTrainer tokenizes the records itself: its rows are not the small job's, so the job analyses them.
    config = adaptive_config(small_job, tmp_path / "config", 3, schedule_log=str(out / "schedule.jsonl"),
                             analysis_path=str(tmp_path / "analysis"))
    check(run_mpirun([str(SFT_WORKER), "--deepspeed", str(config), "--model", str(small_job / "model"),
                         "--data", str(small_job / "train.jsonl"), "--out", str(out), "--max-steps", str(STEPS),
                         "--save-steps", "100"], timeout=300, env_extra={"HF_HUB_DISABLE_TELEMETRY": "1"}))
    log = log_of(out)
    assert [line["window"] for line in log] == [0, 1] and _ranks_train_other_samples(out)
    run = json.loads((out / "run.json").read_text())
    labels, natural = np.array(run["labels"]), np.array(run["cluster_sizes"]) / sum(run["cluster_sizes"])
    traces = [read_trace(out, rank) for rank in range(2)]
    per_step = len(traces[0]) // STEPS  # micro-batches per optimizer step on each rank
    for window, shares in enumerate([natural] + [np.array(line["shares"]) for line in log]):
        drawn = [index for trace in traces for record in trace[window * ADAPT_EVERY * per_step:
                                                               (window + 1) * ADAPT_EVERY * per_step]
                 for index in record["indices"]]
        counts = np.bincount(labels[drawn], minlength=BLOCK["num_clusters"])
        assert counts.tolist() == window_draws(shares, len(drawn)).tolist(), window
    assert all(line["train_loss"] for line in log) and all(line["probe_loss"] is not None for line in log)
    # The Trainer's log carries the per-cluster figures: samples trained so far (both ranks) at each logged step.
    logged = [entry for entry in run["log_history"] if "loss" in entry]
    assert logged, run["log_history"]
    for entry in logged:
        upto = [index for trace in traces for record in trace[:entry["step"] * per_step] for index in record["indices"]]
        counts = np.bincount(labels[upto], minlength=BLOCK["num_clusters"])
        assert [entry[f"cluster_{c}/samples"] for c in range(BLOCK["num_clusters"])] == counts.tolist()
        assert sum(entry[f"cluster_{c}/share"] for c in range(BLOCK["num_clusters"])) == pytest.approx(1.0)


def test_a_zero2_run_on_chat_records_draws_its_windows_at_the_logged_shares(tmp_path):
    """ZeRO-2 under mpirun, the analysis computed in the job, on gzipped chat and Alpaca records
    rendered by the tokenizer's chat template: the second window is drawn at the shares the first one logged."""
    import gzip

    from tests.fixtures.tokenizers import tiny_model_folder
    from tests.test_chat_data import STORIES_TEMPLATE

    folder = tiny_model_folder("stories260k", tmp_path, chat_template=STORIES_TEMPLATE)
    records = []
    for index in range(64):
        topic, answer = (("story", f"Tim had {index} red balls.") if index % 2 else
                         ("sum", f"{index} plus one is {index + 1}."))
        records.append({"messages": [{"role": "user", "content": f"Tell the {topic} number {index}."},
                                     {"role": "assistant", "content": answer}]} if index % 4 < 2 else
                       {"instruction": f"Tell the {topic} number {index}.", "input": "", "output": answer})
    with gzip.open(tmp_path / "train.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    out, steps, every = tmp_path / "out", 4, 2  # budget 0.5 of 64 records: 2 optimizer steps an epoch
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {
        **BLOCK, "adapt_every": every, "num_clusters": 2, "analysis_path": str(tmp_path / "analysis"),
        "schedule_log": str(out / "schedule.jsonl")}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    check(run_mpirun([*TRAIN, "--deepspeed", str(tmp_path / "ds_config.json"), "--model", str(folder),
                         "--data", str(tmp_path / "train.jsonl.gz"), "--output-dir", str(out), "--max-length", "48",
                         "--epochs", "2", "--max-steps", str(steps), "--trace"], timeout=300))
    plan, log = Plan.load(out / "plan"), log_of(out)
    assert [line["window"] for line in log] == [0] and sum(log[0]["shares"]) == pytest.approx(1.0)
    assert log[0]["train_loss"] and log[0]["probe_loss"] is not None
    drawn = [index for rank in range(2) for record in read_trace(out, rank)[every * plan.gradient_accumulation_steps:]
             for index in record["indices"]]
    counts = np.bincount(plan.labels[drawn], minlength=plan.num_clusters)
    assert counts.tolist() == window_draws(np.array(log[0]["shares"]), every * plan.global_batch_size).tolist()


def auto_args(small_job: Path, out: Path, *extra: str) -> list[str]:
    """A ZeRO-0 automatic budget in which every cluster stops after its second window (its learning curve, fitted
    to its two windows, never predicts 99% lower loss), then one window of cool-down (0.5 x 2): 9 of 30 steps."""
    args = train_args(small_job, "zero0.json", out, "--max-steps", "30", "--epochs", "20", "--lr-schedule", "cosine",
                      *extra)
    args[args.index("--deepspeed") + 1] = str(adaptive_config(
        small_job, out, 0, budget_ratio="auto", auto_signal="curve", auto_fit_windows=2, auto_remaining=0.99,
        auto_patience=1, auto_cooldown=0.5))
    return args


@pytest.fixture(scope="module")
def auto_run(small_job, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auto_whole")
    check(run_mpirun(auto_args(small_job, out), timeout=300))
    return out


def test_a_zero0_auto_run_cools_down_over_every_cluster_and_ends_at_a_zero_learning_rate(auto_run):
    out = auto_run
    log = log_of(out)
    assert [line["window"] for line in log] == [0, 1, 2]
    assert log[1]["stopped"] == [0, 1, 2, 3] and log[1]["cooldown"] == [6, 9]
    assert all(stop["step"] == 6 and stop["signal"] == "curve" and "learning curve predicts" in stop["why"]
               for stop in log[1]["stops"])
    assert set(np.flatnonzero(log[1]["shares"])) == {0, 1, 2, 3}  # the cool-down draws every cluster again
    assert log[2]["finished"]
    for rank in range(2):
        summary = json.loads((out / f"summary_rank{rank}.json").read_text())
        # Ended by the schedule (not the 30-step cap), with the learning rate decayed to 0 at its last step.
        assert summary["steps"] == 9 and summary["learning_rate"] == pytest.approx(0.0, abs=1e-12)


def test_an_auto_run_killed_inside_its_cool_down_resumes_to_the_same_indices_losses_and_end(auto_run, small_job,
                                                                                           tmp_path):
    """Rank 1 dies (SIGKILL) right after step 8: the last checkpoint is step 7's, in the middle of the cool-down's
    window (steps 6 to 9). The resumed run replays steps 8 and 9 on the same samples with the same losses, and the
    schedule ends at step 9 with the learning rate at 0, as the uninterrupted run did."""
    parts = tmp_path / "parts"
    killed = run_deepspeed([WORKER, *auto_args(small_job, parts, "--save-every", "1")[2:]], timeout=300,
                           env_extra={KILL_AFTER_STEP_VAR: "8"})
    assert killed.returncode != 0
    assert (parts / "checkpoints" / "latest").read_text().strip() == "global_step7"
    lines_before = {rank: len(read_trace(parts, rank)) for rank in range(2)}
    gas = Plan.load(parts / "plan").gradient_accumulation_steps
    check(run_mpirun(auto_args(small_job, parts, "--save-every", "1", "--resume"), timeout=300))
    for rank in range(2):
        expected, trace = read_trace(auto_run, rank), read_trace(parts, rank)
        replayed = trace[:7 * gas] + trace[lines_before[rank]:]
        assert [r["indices"] for r in replayed] == [r["indices"] for r in expected], f"rank {rank}"
        assert np.allclose([r["loss"] for r in replayed], [r["loss"] for r in expected], rtol=0, atol=1e-6)
        summary = json.loads((parts / f"summary_rank{rank}.json").read_text())
        assert summary["steps"] == 9 and summary["learning_rate"] == pytest.approx(0.0, abs=1e-12)
    assert log_of(parts) == log_of(auto_run)
