"""What runs inside the quality benchmark's one DeepSpeed job (bench/quality_job.py): every arm trained and
evaluated in one launch.

One process start-up serves every arm (its cost is measured once and charged to each arm, as a real
run would pay one). First the base model is evaluated (WORK/base.json; the synthetic instrument also
runs its copy probe). Then the analyses: features are extracted once per feature model (the trained
model's own, with a forward-only engine; a separate feature model's through `feature_model`, re-encoding the
data with its tokenizer: `ds_cluster.features.source.feature_source`), and every k-means analysis clusters them
with its own settings and seed; an arm is charged in full for the extraction and the clustering it reads. Per arm:
a fresh copy of the base model, `ds_cluster.initialize` with the arm's cluster_sampling block (ZeRO-2, 2 ranks,
torch AdamW), a warmup + cosine learning rate that ends at the arm's own last step (`run_lr_schedule`), the
library's training loop (`train_loop`) with validation answer loss after every epoch (its time kept out of the
training loop's), then answer-token loss per family and greedy exact match on the label families, on the
validation and held-out splits (records shared out over the ranks). Each finished arm writes WORK/arms/NAME.json;
a rerun skips finished arms. The calibration gate is checked after its arms and the job stops, saying so, when it
fails.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from bench.harness.arms import Analysis, Arm, Method
from bench.harness.evaluation import Clock, barrier, copy_probe, evaluate, exists_on_rank0, summed
from bench.harness.gate import calibration_gate
from bench.harness.lora import ensure_feature_adapters
from bench.harness.report import gate_text
from bench.harness.spec import JobSpec
from bench.harness.targets import TARGET_FIELD
from ds_cluster import distributed
from ds_cluster.loader.sampler import cluster_loader
from ds_cluster.data.dataset import InstructionDataset, read_jsonl, trim_padding_collate
from ds_cluster.fileio import write_json_atomic
from ds_cluster.planning.selection import SELECTIONS


# --------------------------------------------------------------------------- analyses
def ensure_features(analysis: Analysis, spec: JobSpec, train: InstructionDataset) -> dict[str, Any]:
    """Extract one feature model's features of the training data once (collective); its cost from its record."""
    from ds_cluster.analysis.compute import AnalysedData, AnalysisOptions, analyze
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.features.source import feature_source

    record = Path(analysis.path) / "cost.json"
    if not exists_on_rank0(record):
        clock = Clock()
        # The clustering of this folder is not used (every k-means analysis clusters these features itself).
        block = {**(analysis.cluster_sampling or {}), "num_clusters": 1, "kmeans_n_init": 1, "enabled": True}
        if analysis.source == "lora":  # the trained model with adapters: the training data as it is
            if distributed.get_rank() == 0:
                ensure_feature_adapters(analysis.model, spec.base_model, spec.lora_rank)
            barrier()
        elif analysis.source != "own":  # a separate feature model: the source re-encodes the data with its tokenizer
            block.update(feature_model=analysis.model, feature_max_length=analysis.feature_max_length)
        stages = ClusterSamplingConfig.from_dict(block).stages()
        with feature_source(stages.features, train, ds_config=spec.ds_config, model=analysis.model) as source:
            options = AnalysisOptions(batch_size=16, show_progress=False, provenance={"feature_model": analysis.model},
                                      of_data=AnalysedData(train))
            result = analyze(source.engine, source.dataset, analysis.path, stages, options, distributed.collectives())
            cost = summed(clock.read())  # the engine's tear-down is not the extraction's
        cost.update(extract_wall=result.timings.extract, source=analysis.source, model=analysis.model)
        if distributed.get_rank() == 0:
            write_json_atomic(record, cost)
        barrier()
    return json.loads(record.read_text())


def _target_folder(features: Analysis, target_path: str) -> Path:
    return Path(features.path) / "targets" / Path(target_path).stem


def ensure_target_features(name: str, spec: JobSpec, train: InstructionDataset, cost: dict[str, Any]
                           ) -> dict[str, Any]:
    """The features of every target file that an analysis of feature analysis `name` reads, in one session of its
    feature engine (collective); each is written beside the pool's features (targets/NAME/), and its cost is added to
    what every arm reading it is charged."""
    from ds_cluster.analysis.target import extract_target
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.data.target import read_target
    from ds_cluster.features.source import feature_source

    features = spec.analyses[name]
    wanted = sorted({a.target for a in spec.analyses.values() if a.features == name and a.target})
    missing = [path for path in wanted if not exists_on_rank0(_target_folder(features, path) / "target.json")]
    if missing:
        block = {**(features.cluster_sampling or {}), "num_clusters": 1, "enabled": True}
        if features.source not in ("own", "lora"):
            block.update(feature_model=features.model, feature_max_length=features.feature_max_length)
        stages = ClusterSamplingConfig.from_dict(block).stages()
        with feature_source(stages.features, train, ds_config=spec.ds_config, model=features.model) as source:
            for path in missing:
                clock = Clock()
                examples = read_target(path, train.tokenizer, spec.max_length, group_field=TARGET_FIELD)
                target = extract_target(source.engine, examples.encoded_with(source.encode), stages.features,
                                        distributed.collectives())
                spent = summed(clock.read())
                if distributed.get_rank() == 0:
                    folder = _target_folder(features, path)
                    folder.mkdir(parents=True, exist_ok=True)
                    np.save(folder / "features.npy", target.features)
                    write_json_atomic(folder / "cost.json", spent)
                    write_json_atomic(folder / "target.json", target.to_json())
                barrier()
    extra = [json.loads((_target_folder(features, path) / "cost.json").read_text()) for path in wanted]
    return {**cost, "target_wall": sum(e["wall"] for e in extra) / max(len(extra), 1),
            "target_cpu": sum(e["cpu"] for e in extra) / max(len(extra), 1)}


def _load_target(features: Mapping[str, Any], target_path: str) -> Any:
    """A target file's features as extract_target gave them (written by ensure_target_features)."""
    from ds_cluster.analysis.folder import AnalysedTarget

    folder = Path(features["path"]) / "targets" / Path(target_path).stem
    document = json.loads((folder / "target.json").read_text())
    return AnalysedTarget(features=np.load(folder / "features.npy"), groups=np.asarray(document["groups"]),
                          group_names=tuple(document["group_names"]), fingerprint=document["fingerprint"],
                          source=document.get("source"), prompts=tuple(document.get("prompts") or ()))


def ensure_clustering(analysis: Analysis, features: Mapping[str, Any], train: InstructionDataset) -> dict[str, Any]:
    """k-means of a feature analysis with this analysis's settings and seed, on rank 0; its cost is the
    extraction's plus its own (collective). `features`: the feature analysis's entry and cost."""
    record = Path(analysis.path) / "cost.json"
    if not exists_on_rank0(record):
        error: Optional[BaseException] = None
        if distributed.get_rank() == 0:
            try:
                _cluster(analysis, features, train, record)
            except (ValueError, OSError, RuntimeError) as err:
                error = err
        distributed.agree_on_error(error, f"clustering {analysis.path}")
    return json.loads(record.read_text())


def _cluster(analysis: Analysis, features: Mapping[str, Any], train: InstructionDataset, record: Path) -> None:
    """Rank 0's k-means of `features` into the analysis folder (the library's writer), and its cost record; a
    targeted analysis holds its target examples' features too, and leaves its `leave_out` groups out of the pool."""
    from ds_cluster.analysis.compute import AnalysedData, AnalysedFeatures, write_analysis
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.data.dataset import task_group

    clock = Clock()
    stages = ClusterSamplingConfig.from_dict({**(analysis.cluster_sampling or {}), "enabled": True}).stages()
    source = Path(features["path"])
    summary = json.loads((source / "summary.json").read_text())
    points = np.load(source / "features.npy")
    empty = np.load(source / "empty_mask.npy")
    if analysis.leave_out:  # a transfer target's groups: out of k-means and the plan, as samples without features
        empty = empty | np.array([task_group(record) in analysis.leave_out for record in train.records])
    keep = analysis.keep_features or SELECTIONS[stages.selection.selection].reads_features
    target = _load_target(features, analysis.target) if analysis.target else None
    write_analysis(analysis.path, AnalysedFeatures(points, empty, summary["kind"], summary["dim"], keep_features=keep),
                   stages, AnalysedData(train), distributed.get_world_size(), target=target,
                   provenance={"features": str(source), "feature_model": features.get("model"),
                               "feature_source": features["source"]})
    own = clock.read()
    target_cost = {"wall": features.get("target_wall", 0.0), "cpu": features.get("target_cpu", 0.0)}
    write_json_atomic(record, {
        "wall": features["wall"] + own["wall"] + target_cost["wall"],
        "cpu": features["cpu"] + own["cpu"] + target_cost["cpu"],
        "extract_wall": features["extract_wall"], "extract_cpu": features["cpu"],
        "cluster_wall": own["wall"], "cluster_cpu": own["cpu"], "target_wall": target_cost["wall"],
        "target_cpu": target_cost["cpu"], "source": features["source"]})


def materialize_near_duplicates(analysis: Analysis, kept: int, num_samples: int) -> None:
    """The near-duplicate arm's subset as labels (0 kept, -1 left out), written once by rank 0 (collective)."""
    from bench.near_duplicates import select_kept

    folder = Path(analysis.path)
    if not exists_on_rank0(folder / "labels.npy"):
        error: Optional[BaseException] = None
        if distributed.get_rank() == 0:
            try:
                groups_folder = Path(str(analysis.near_duplicates))
                groups = np.load(groups_folder / "groups.npy")
                if groups.size != num_samples:
                    raise ValueError(f"{analysis.near_duplicates}: {groups.size} groups for {num_samples} samples")
                labels = np.full(num_samples, -1, dtype=np.int64)
                labels[select_kept(groups, kept, analysis.seed)] = 0
                folder.mkdir(parents=True, exist_ok=True)
                # The groups' cost (computed once per mixture) is charged to every near-duplicate arm.
                write_json_atomic(folder / "cost.json", json.loads((groups_folder / "cost.json").read_text()))
                np.save(folder / "labels.npy", labels)
            except (ValueError, OSError) as err:
                error = err
        distributed.agree_on_error(error, f"the near-duplicate subset {folder}")


def ensure_analyses(arm: Arm, spec: JobSpec, train: InstructionDataset) -> None:
    """The features and clusterings an arm reads (its match's and its own), computed when an arm first needs them:
    the gate's arms run before a feature model's extraction."""
    for name in (arm.match.analysis if arm.match else None), arm.analysis:
        if name not in spec.analyses:
            continue
        analysis = spec.analyses[name]
        if analysis.features:
            features = spec.analyses[analysis.features]
            cost = ensure_features(features, spec, train)
            if analysis.target:  # the targeted instrument: the target examples' features, with the same engine
                cost = ensure_target_features(analysis.features, spec, train, cost)
            ensure_clustering(analysis, {**features.to_json(), **cost}, train)


# --------------------------------------------------------------------------- one arm
def resolve_arm(arm: Arm, spec: JobSpec) -> tuple[dict, Optional[int], Optional[int]]:
    """The arm's cluster_sampling block with its budget matched to the paper arm's kept size, its fixed step
    count (None: its epochs), and the kept size.

    The paper arm keeps floor(r x smallest cluster) per cluster; r is set so that it keeps about the
    arm's fraction of the data, and every other arm of that fraction keeps exactly as many samples.
    """
    block, steps, kept = dict(arm.cluster_sampling), arm.steps, None
    global_batch = spec.global_batch
    if arm.match:
        summary = json.loads((Path(spec.analyses[arm.match.analysis].path) / "summary.json").read_text())
        sizes = summary["cluster_sizes"]
        if arm.match.budget_ratio is not None:  # r itself, as budget_mode "min" keeps it: floor(r x smallest) each
            per_cluster = math.floor(arm.match.budget_ratio * min(sizes) + 1e-9)
        else:
            per_cluster = min(min(sizes), round(arm.match.fraction * sum(sizes)) // len(sizes))
        kept = per_cluster * len(sizes)
        if arm.method == Method.PAPER:
            block["budget_ratio"] = per_cluster / min(sizes)
        elif arm.cut:
            steps = arm.epochs * (kept // global_batch)
        else:
            block["budget_samples"] = kept
    if arm.stretch:
        steps = arm.epochs * (spec.num_train // global_batch)  # full data's step count
    return block, steps, kept


class _Training:
    """What the training loop's hooks record: the learning rate at a few steps, and the validation loss after every
    epoch the run goes on from, its time kept out of the loop's."""

    def __init__(self, engine: Any, loader: Any, total_steps: int, tokenizer: Any, spec: JobSpec,
                 validation: list[dict]) -> None:
        self.engine, self.loader, self.total_steps = engine, loader, total_steps
        self.tokenizer, self.spec, self.validation = tokenizer, spec, validation
        self.learning_rates: dict[int, float] = {}
        self.curve: list[dict[str, Any]] = []
        self.evaluating = {"wall": 0.0, "cpu": 0.0}  # validation during training: evaluation, not training
        self.clock = Clock()

    def loop_so_far(self) -> dict[str, float]:
        """The loop's time so far over the ranks, validation left out (collective)."""
        now = self.clock.read()
        return summed({kind: now[kind] - self.evaluating[kind] for kind in ("wall", "cpu")})

    def after_step(self, step: int) -> None:
        if step in (1, self.total_steps // 2, self.total_steps - 1, self.total_steps):
            self.learning_rates[step] = self.engine.get_lr()[0]

    def after_epoch(self, step: int) -> None:
        during = Clock()
        loss = evaluate(self.engine.module, self.tokenizer, self.validation, self.spec, [])["loss"]
        spent = during.read()
        self.evaluating = {kind: self.evaluating[kind] + spent[kind] for kind in ("wall", "cpu")}
        self.curve.append({"epoch": step / steps_per_epoch(self.engine, self.loader), "step": step,
                           "loop": self.loop_so_far(), "loss": loss})
        self.engine.train()

    def run(self) -> Any:
        """The library's loop to the step cap, or until the auto budget ends the run (`loader.finished`)."""
        from ds_cluster.integrations.loop import LoopHooks, train_loop

        self.clock = Clock()
        self.engine.train()
        return train_loop(self.engine, self.loader, epochs=sys.maxsize, max_steps=self.total_steps,
                          # The targeted instrument reads each arm at its end only (its arms' steps are fixed).
                          hooks=LoopHooks(after_step=self.after_step,
                                          after_epoch=None if self.spec.per_record else self.after_epoch))


def _initialize(arm: Arm, spec: JobSpec, train: InstructionDataset) -> tuple[Any, Any, dict, int, dict]:
    """A fresh copy of the base model under `ds_cluster.initialize` with the arm's resolved block (or, for an arm
    whose block says `"enabled": false`, DeepSpeed's own loader: plain DeepSpeed): (engine, loader, block, total
    steps, set-up time)."""
    import ds_cluster
    from ds_cluster.data.models import load_model_and_tokenizer
    from ds_cluster.loader.lr_schedules import LateLRSchedule

    torch.manual_seed(arm.seed)
    model, _ = load_model_and_tokenizer(spec.base_model)
    if spec.peft == "lora":
        from ds_cluster.data.models import with_lora

        model = with_lora(model, spec.lora_rank, seed=arm.seed)
    config = json.loads(json.dumps(spec.ds_config))
    config["optimizer"]["params"]["lr"] = spec.learning_rate
    block, fixed_steps, kept = resolve_arm(arm, spec)
    plain = block.get("enabled") is False
    analysis = spec.analyses[arm.analysis]
    if analysis.near_duplicates and not plain:
        materialize_near_duplicates(analysis, kept, len(train))
    block["analysis_path"] = analysis.path
    if block.get("schedule") == "adaptive":
        block["schedule_log"] = str(spec.work / "arms" / f"{arm.name}.schedule.jsonl")
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {**block, "enabled": not plain}
    late_lr = LateLRSchedule(spec.warmup_fraction)  # its length is the plan's, known once initialize returns
    clock = Clock()
    engine, _, loader, _ = ds_cluster.initialize(
        model=model, model_parameters=model.parameters(), training_data=train, config=config,
        collate_fn=trim_padding_collate, lr_scheduler=late_lr.scheduler)
    total_steps = fixed_steps or arm.epochs * steps_per_epoch(engine, loader)
    late_lr.start(loader, total_steps)
    return engine, loader, block, total_steps, clock.read()


def steps_per_epoch(engine: Any, loader: Any) -> int:
    """Optimizer steps in one of the loader's epochs: the plan's, or DeepSpeed's own loader's."""
    planned = cluster_loader(loader)
    return planned.plan.steps_per_epoch if planned is not None else len(loader) // engine.gradient_accumulation_steps()


def run_arm(arm: Arm, spec: JobSpec, train: InstructionDataset, tokenizer: Any,
            splits: dict[str, list[dict]]) -> dict[str, Any]:
    """Train one arm from the base model and evaluate it (collective)."""
    load_before = os.getloadavg()
    engine, loader, block, total_steps, set_up = _initialize(arm, spec, train)
    planned = cluster_loader(loader)
    epoch_steps = steps_per_epoch(engine, loader)
    training = _Training(engine, loader, total_steps, tokenizer, spec, splits["validation"])
    looped = training.run()
    loop = training.loop_so_far()
    clock = Clock()
    evaluation = {split: evaluate(engine.module, tokenizer, records, spec, scored_families(spec, split))
                  for split, records in splits.items()}
    evaluated = clock.read()
    curve = training.curve + [{"epoch": engine.global_steps / epoch_steps, "step": engine.global_steps,
                               "loop": loop, "loss": evaluation["validation"]["loss"]}]
    # The adaptive schedule keeps what it drew (a sample counts once); the static plan what it selected; plain
    # DeepSpeed every record.
    kept = int(planned.consumed().sum()) if planned is not None else len(train)
    result = {
        "arm": arm.to_json(), "cluster_sampling": block, "steps": engine.global_steps, "num_kept": kept,
        "num_samples": len(train), "kept_fraction": kept / len(train),
        "kept_sizes": planned.plan.kept_sizes.tolist() if planned is not None else [len(train)],
        "steps_per_epoch": epoch_steps, "plan": planned.plan.fingerprint() if planned is not None else None,
        "time": {"setup": summed(set_up), "loop": loop, "evaluation": summed(evaluated),
                 "validation_during_training": summed(training.evaluating),
                 "loader_wall": max(distributed.all_gather_object(looped.loader_wall))},
        "first_losses": looped.losses[:4], "last_losses": looped.losses[-4:], "validation_curve": curve,
        "validation_loss_per_epoch": [point["loss"] for point in curve],
        "learning_rate_at_step": training.learning_rates,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        **evaluation,
    }
    if spec.per_record and planned is not None:  # the targeted instrument reads what each arm trained on
        result["selected"] = planned.plan.selected.tolist()
    del engine, loader, planned, training
    gc.collect()
    return result


def scored_families(spec: JobSpec, split: str) -> list:
    """The families greedy exact match is scored on in `split`: the label families; the targeted instrument chooses
    by the answer loss on validation, so it generates on held-out only."""
    return [] if spec.per_record and split == "validation" else spec.exact_match_families


# --------------------------------------------------------------------------- the job
def checked_gate(work: Path, spec: JobSpec) -> dict[str, Any]:
    """The calibration gate's decision and its text, as WORK/gate.json holds them."""
    decision = calibration_gate(work, spec.gate)
    return {**decision, "text": gate_text(decision)}


def _evaluate_base(model: Any, tokenizer: Any, splits: dict[str, list[dict]], spec: JobSpec,
                   work: Path) -> None:
    """WORK/base.json: the base model on every split (and the synthetic copy probe), once (collective)."""
    base_path = work / "base.json"
    if exists_on_rank0(base_path):
        return
    clock = Clock()
    base = {split: evaluate(model, tokenizer, records, spec, scored_families(spec, split))
            for split, records in splits.items()}
    base["time"] = summed(clock.read())
    if spec.instrument == "synthetic":
        base["copy_probe"] = {"exact_match": copy_probe(model, tokenizer, spec), "records": spec.copy_probe_records}
    if distributed.get_rank() == 0:
        write_json_atomic(base_path, base)
        print(f"base model: validation macro answer loss "
              f"{np.mean(list(base['validation']['loss'].values())):.4f}", flush=True)
    barrier()


def _run_arms(spec: JobSpec, train: InstructionDataset, tokenizer: Any, splits: dict[str, list[dict]],
              startup: dict[str, float]) -> None:
    """Every arm not finished yet, in the spec's order; the gate after its arms (a failed gate stops the job)."""
    work, rank = spec.work, distributed.get_rank()
    arms = spec.arms
    for number, arm in enumerate(arms, start=1):
        path = work / "arms" / f"{arm.name}.json"
        if not exists_on_rank0(path):
            ensure_analyses(arm, spec, train)
            # The start-up of the job that trained the arm: a resumed run charges each arm its own job's.
            result = {**run_arm(arm, spec, train, tokenizer, splits), "startup": startup}
            if rank == 0:
                write_json_atomic(path, result)
                validation = result["validation"]["loss"]
                print(f"[{number}/{len(arms)}] {arm.name}: kept {result['kept_fraction']:.3f}, "
                      f"{result['steps']} steps, loop {result['time']['loop']['wall']:.0f} s wall "
                      f"({result['time']['loop']['cpu']:.0f} CPU s), validation macro answer loss "
                      f"{sum(validation.values()) / len(validation):.4f}", flush=True)
            barrier()
        if arm.name == spec.gate_after:
            gate = checked_gate(work, spec)
            if rank == 0:
                write_json_atomic(work / "gate.json", gate)
                print(gate["text"], flush=True)
            if not gate["passed"]:
                break


def main(process_started: float) -> int:
    """The job: `deepspeed --num_gpus 2 bench/quality_job.py --spec WORK/spec.json`; `process_started`: when the
    launched script started (the start-up it is charged)."""
    from ds_cluster.data.models import load_model_and_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    spec = JobSpec.read(Path(args.spec))
    work = spec.work
    distributed.init_distributed()
    rank = distributed.get_rank()
    random.seed(0)
    model, tokenizer = load_model_and_tokenizer(spec.base_model, rank=rank)
    train = InstructionDataset(read_jsonl(spec.path("train")), tokenizer, max_length=spec.max_length, rank=rank)
    if spec.per_record and rank == 0:  # each record's tokens, for the selections' lengths
        np.save(Path(spec.path("train")).parent / "train_tokens.npy", train.attention_mask.sum(dim=1).numpy())
    # Choosing (bench/quality.py --choose) never evaluates held-out.
    splits = {name: read_jsonl(spec.path(name)) for name in spec.evaluate_splits}
    startup = summed({"wall": time.time() - spec.launched_at, "cpu": time.process_time()})
    if rank == 0:
        write_json_atomic(work / "startup.json", {**startup, "process_started": process_started})
    _evaluate_base(model, tokenizer, splits, spec, work)
    del model
    for reason in spec.skipped:
        if rank == 0:
            print(f"skipped: {reason}", flush=True)
    _run_arms(spec, train, tokenizer, splits, startup)
    distributed.shutdown()
    return 0
