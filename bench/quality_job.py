"""The quality benchmark's one DeepSpeed job: every arm trained and evaluated in one launch.

    deepspeed --num_gpus 2 bench/quality_job.py --spec WORK/spec.json      (bench/quality.py starts it)

One process start-up serves every arm (its cost is measured once and charged to each arm, as a real
run would pay one). Per arm: a fresh copy of the base model, `ds_cluster.initialize` with the arm's
cluster_sampling block (ZeRO-2, 2 ranks, torch AdamW), a warmup + cosine learning rate that ends at
the arm's own last step, then answer-token loss and greedy exact match per family on the validation
and held-out splits (records shared out over the ranks). Analyses with features are computed here
first, with a forward-only engine, and their cost is charged to every arm that uses them. Each
finished arm writes WORK/arms/NAME.json; a rerun skips finished arms. The calibration gate is
checked after its arms and the job stops, saying so, when it fails.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

PROCESS_STARTED = time.time()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.quality_gate import calibration_gate  # noqa: E402
from ds_cluster import distributed  # noqa: E402
from ds_cluster.dataset import InstructionDataset, read_jsonl, trim_padding_collate  # noqa: E402
from ds_cluster.fileio import write_json_atomic  # noqa: E402
from ds_cluster.schedules import warmup_cosine  # noqa: E402


class Clock:
    """Wall seconds and this process's CPU seconds since it was made."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> dict[str, float]:
        return {"wall": time.perf_counter() - self.wall, "cpu": time.process_time() - self.cpu}


def summed(timing: dict[str, float]) -> dict[str, float]:
    """Over the ranks: wall is the slowest rank's, CPU the sum of every rank's (collective)."""
    every = distributed.all_gather_object(timing)
    return {"wall": max(t["wall"] for t in every), "cpu": sum(t["cpu"] for t in every)}


# --------------------------------------------------------------------------- evaluation
def evaluate(model: torch.nn.Module, tokenizer: Any, records: list[dict], spec: dict, with_exact_match: bool
             ) -> dict[str, Any]:
    """Answer loss (and greedy exact match) per family, the records shared out over the ranks (collective)."""
    from ds_cluster.toy.evaluate import answer_loss, greedy_answers, mean_by_family, score_answers

    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = records[rank::world]
    dataset = InstructionDataset(mine, tokenizer, max_length=spec["max_length"])
    losses = answer_loss(model, dataset, batch_size=64).tolist() if mine else []
    answers = (greedy_answers(model, tokenizer, mine, max_new_tokens=spec["max_new_tokens"], batch_size=64)
               if with_exact_match and mine else [])
    gathered = distributed.all_gather_object((mine, losses, answers))
    all_records = [r for part in gathered for r in part[0]]
    all_losses = [loss for part in gathered for loss in part[1]]
    result: dict[str, Any] = {"loss": mean_by_family(all_losses, [r["family"] for r in all_records])}
    if with_exact_match:
        result["exact_match"] = score_answers(all_records, [a for part in gathered for a in part[2]])
    return result


def copy_probe(model: torch.nn.Module, tokenizer: Any, spec: dict) -> float:
    """Greedy exact match of the base model copying strings of 3 to 8 random letters (collective)."""
    from ds_cluster.toy.pretraining import copy_probe_records

    records = copy_probe_records(count=spec["copy_probe_records"], seed=spec["copy_probe_seed"])
    result = evaluate(model, tokenizer, [dict(r, family="copy") for r in records], spec, with_exact_match=True)
    return result["exact_match"]["copy"]


# --------------------------------------------------------------------------- analyses
def ensure_analysis(name: str, analysis: dict, spec: dict, train: InstructionDataset) -> dict[str, float]:
    """Compute a feature analysis once (forward-only engine, the base model); its cost from its record."""
    import deepspeed

    from ds_cluster.analysis import analyze, forward_only_config
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.models import load_model_and_tokenizer

    record = Path(analysis["path"]) / "cost.json"
    if not record.exists():
        clock = Clock()
        config = forward_only_config(spec["ds_config"])
        model, _ = load_model_and_tokenizer(spec["base_model"], ds_config=config)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        settings = ClusterSamplingConfig.from_dict({**analysis["cluster_sampling"], "enabled": True})
        summary = analyze(engine, train, analysis["path"], settings, batch_size=16, show_progress=False)
        cost = summed(clock.read())
        cost.update(extract_wall=summary["timings_s"]["extract"], cluster_wall=summary["timings_s"]["cluster"])
        del engine, model
        gc.collect()
        if distributed.get_rank() == 0:
            write_json_atomic(record, cost)
        distributed.all_gather_object(None)
    return json.loads(record.read_text())


# --------------------------------------------------------------------------- one arm
def resolve_arm(arm: dict, spec: dict) -> tuple[dict, int | None]:
    """The arm's cluster_sampling block with its budget matched to the paper arm's kept size, and its step count.

    The paper arm keeps floor(r x smallest cluster) per cluster; r is set so that it keeps about the
    arm's fraction of the data, and every other arm of that fraction keeps exactly as many samples.
    """
    block, steps = dict(arm["cluster_sampling"]), arm.get("steps")
    match = arm.get("match")
    if match:
        summary = json.loads((Path(spec["analyses"][match["analysis"]]["path"]) / "summary.json").read_text())
        sizes = summary["cluster_sizes"]
        per_cluster = min(min(sizes), round(match["fraction"] * sum(sizes)) // len(sizes))
        kept = per_cluster * len(sizes)
        if arm["method"] == "paper":
            block["budget_ratio"] = per_cluster / min(sizes)
        elif arm.get("cut"):
            global_batch = spec["ds_config"]["train_micro_batch_size_per_gpu"] * distributed.get_world_size()
            steps = arm["epochs"] * (kept // global_batch)
        else:
            block["budget_samples"] = kept
    return block, steps


def run_arm(arm: dict, spec: dict, train: InstructionDataset, tokenizer: Any, splits: dict[str, list[dict]]
            ) -> dict[str, Any]:
    """Train one arm from the base model and evaluate it (collective)."""
    import ds_cluster
    from ds_cluster.models import load_model_and_tokenizer

    load_before = os.getloadavg()
    torch.manual_seed(arm["seed"])
    model, _ = load_model_and_tokenizer(spec["base_model"])
    config = json.loads(json.dumps(spec["ds_config"]))
    config["optimizer"]["params"]["lr"] = spec["learning_rate"]
    block, fixed_steps = resolve_arm(arm, spec)
    block["analysis_path"] = spec["analyses"][arm["analysis"]]["path"]
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {**block, "enabled": True}
    steps = {"total": 0}
    schedule = warmup_cosine(lambda: steps["total"], spec["warmup_fraction"])
    clock = Clock()
    engine, _, loader, _ = ds_cluster.initialize(
        model=model, model_parameters=model.parameters(), training_data=train, config=config,
        collate_fn=trim_padding_collate, lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
    plan = loader.plan
    steps["total"] = fixed_steps or arm["epochs"] * plan.steps_per_epoch
    set_up = clock.read()
    epoch_losses, losses, eval_during, learning_rates = [], [], 0.0, {}
    clock = Clock()
    engine.train()
    fetching = 0.0  # time in the cluster loader (plan lookup, per-epoch set-up, collate): the hook's overhead
    while engine.global_steps < steps["total"]:
        batches = iter(loader)
        while True:
            started = time.perf_counter()
            batch = next(batches, None)
            fetching += time.perf_counter() - started
            if batch is None:
                break
            outputs = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            loss = ds_cluster.weighted_causal_lm_loss(outputs, batch)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if engine.global_steps in (1, steps["total"] // 2, steps["total"] - 1, steps["total"]):
                learning_rates[engine.global_steps] = engine.get_lr()[0]
            if engine.global_steps >= steps["total"]:
                break
        if arm.get("per_epoch_validation") and loader.position >= loader.micro_batches_per_epoch:
            started = time.perf_counter()
            epoch_losses.append(evaluate(engine.module, tokenizer, splits["validation"], spec, False)["loss"])
            eval_during += time.perf_counter() - started
            engine.train()
    loop = clock.read()
    loop["wall"] -= eval_during  # per-epoch validation is evaluation, not training
    clock = Clock()
    evaluation = {split: evaluate(engine.module, tokenizer, records, spec, with_exact_match=True)
                  for split, records in splits.items()}
    evaluated = clock.read()
    result = {
        "arm": arm, "cluster_sampling": block, "steps": engine.global_steps, "num_kept": plan.num_kept, "num_samples": plan.num_samples,
        "kept_fraction": plan.num_kept / plan.num_samples, "kept_sizes": plan.kept_sizes.tolist(),
        "steps_per_epoch": plan.steps_per_epoch, "plan": plan.fingerprint(),
        "time": {"setup": summed(set_up), "loop": summed(loop), "evaluation": summed(evaluated),
                 "loader_wall": max(distributed.all_gather_object(fetching))},
        "first_losses": losses[:4], "last_losses": losses[-4:], "validation_loss_per_epoch": epoch_losses,
        "learning_rate_at_step": learning_rates,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        **evaluation,
    }
    del engine, loader, model
    gc.collect()
    return result


# --------------------------------------------------------------------------- the job
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    work = Path(spec["work_dir"])
    distributed.init_distributed()
    rank = distributed.get_rank()
    random.seed(0)
    from ds_cluster.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(spec["base_model"])
    train = InstructionDataset(read_jsonl(spec["train"]), tokenizer, max_length=spec["max_length"])
    # Choosing (bench/quality.py --choose) never evaluates held-out.
    splits = {name: read_jsonl(spec[name]) for name in spec["evaluate_splits"]}
    startup = summed({"wall": time.time() - spec["launched_at"], "cpu": time.process_time()})
    if rank == 0:
        write_json_atomic(work / "startup.json", {**startup, "process_started": PROCESS_STARTED})
    probe_path = work / "copy_probe.json"
    if not probe_path.exists():
        probe = {"exact_match": copy_probe(model, tokenizer, spec), "records": spec["copy_probe_records"]}
        if rank == 0:
            write_json_atomic(probe_path, probe)
    del model
    for name, analysis in spec["analyses"].items():
        if analysis.get("cluster_sampling"):
            ensure_analysis(name, analysis, spec, train)
    for number, arm in enumerate(spec["arms"], start=1):
        path = work / "arms" / f"{arm['name']}.json"
        if not path.exists():
            result = run_arm(arm, spec, train, tokenizer, splits)
            if rank == 0:
                write_json_atomic(path, result)
                print(f"[{number}/{len(spec['arms'])}] {arm['name']}: kept {result['kept_fraction']:.3f}, "
                      f"{result['steps']} steps, loop {result['time']['loop']['wall']:.0f} s wall, validation "
                      f"macro EM {sum(result['validation']['exact_match'].values()) / len(result['validation']['exact_match']):.3f}",
                      flush=True)
            distributed.all_gather_object(None)
        if arm["name"] == spec.get("gate_after"):
            gate = calibration_gate(work, spec)
            if rank == 0:
                write_json_atomic(work / "gate.json", gate)
                print(gate["text"], flush=True)
            if not gate["passed"]:
                break
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
