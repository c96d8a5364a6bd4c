"""The quality benchmark's one DeepSpeed job: every arm trained and evaluated in one launch.

    deepspeed --num_gpus 2 bench/quality_job.py --spec WORK/spec.json      (bench/quality.py starts it)

One process start-up serves every arm (its cost is measured once and charged to each arm, as a real
run would pay one). First the base model is evaluated (WORK/base.json; the synthetic instrument also
runs its copy probe). Then the analyses: features are extracted once per feature model (the trained
model's own, with a forward-only engine; SmolLM2's through `feature_model`'s own engine and tokenizer),
and every k-means analysis clusters them with its own settings and seed; an arm is charged in full
for the extraction and the clustering it reads. Per arm: a fresh copy of the base model,
`ds_cluster.initialize` with the arm's cluster_sampling block (ZeRO-2, 2 ranks, torch AdamW), a
warmup + cosine learning rate that ends at the arm's own last step, validation answer loss after every
epoch (its time kept out of the training loop's), then answer-token loss per family and greedy exact
match on the label families, on the validation and held-out splits (records shared out over the ranks).
Each finished arm writes WORK/arms/NAME.json; a rerun skips finished arms. The calibration gate is
checked after its arms and the job stops, saying so, when it fails.
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
from typing import Any, Optional, Sequence

PROCESS_STARTED = time.time()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.quality_gate import calibration_gate  # noqa: E402
from ds_cluster import distributed  # noqa: E402
from ds_cluster.data.dataset import InstructionDataset, read_jsonl, trim_padding_collate  # noqa: E402
from ds_cluster.fileio import write_json_atomic  # noqa: E402
from ds_cluster.loader.lr_schedules import run_schedule  # noqa: E402
from ds_cluster.planning.selection import SELECTIONS  # noqa: E402

EVALUATION_BATCH = 32


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


def barrier() -> None:
    distributed.all_gather_object(None)


def exists_on_rank0(path: Path) -> bool:
    """Whether rank 0 sees `path` (collective): every rank then takes the same branch, even when rank 0
    writes the file before a slower rank has looked."""
    return bool(distributed.all_gather_object(path.exists() if distributed.get_rank() == 0 else None)[0])


# --------------------------------------------------------------------------- evaluation
def evaluate(model: torch.nn.Module, tokenizer: Any, records: list[dict], spec: dict,
             exact_match_families: Sequence[str]) -> dict[str, Any]:
    """Answer loss per family, and greedy exact match per family of `exact_match_families`, the records
    shared out over the ranks (collective). Generation runs to each batch's longest reference answer plus a
    margin (ds_cluster.evaluate.greedy_answers); under bf16 autocast when the arms train in it."""
    with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16,
                        enabled=spec.get("precision", "fp32") != "fp32"):  # as the arms train
        return _evaluate(model, tokenizer, records, spec, exact_match_families)


def _evaluate(model: torch.nn.Module, tokenizer: Any, records: list[dict], spec: dict,
              exact_match_families: Sequence[str]) -> dict[str, Any]:
    from ds_cluster.evaluate import answer_nll, greedy_answers, mean_by_group

    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = records[rank::world]
    losses = (answer_nll(model, InstructionDataset(mine, tokenizer, max_length=spec["max_length"], rank=rank),
                         batch_size=EVALUATION_BATCH).tolist() if mine else [])
    wanted = set(exact_match_families)
    scored = [r for r in mine if r["family"] in wanted]
    answers = greedy_answers(model, tokenizer, scored, batch_size=EVALUATION_BATCH) if scored else []
    gathered = distributed.all_gather_object(([r["family"] for r in mine], losses,
                                              [(r["family"], str(r["output"]).strip()) for r in scored], answers))
    families = [family for part in gathered for family in part[0]]
    result: dict[str, Any] = {"loss": mean_by_group([loss for part in gathered for loss in part[1]], families)}
    if wanted:
        references = [reference for part in gathered for reference in part[2]]
        correct = [float(answer.strip() == text) for (_, text), answer
                   in zip(references, [answer for part in gathered for answer in part[3]])]
        result["exact_match"] = mean_by_group(correct, [family for family, _ in references])
    return result


def copy_probe(model: torch.nn.Module, tokenizer: Any, spec: dict) -> float:
    """The synthetic base model's greedy exact match copying strings of 3 to 8 random letters (collective)."""
    from bench.toy.pretraining import copy_probe_records

    records = copy_probe_records(count=spec["copy_probe_records"], seed=spec["copy_probe_seed"])
    result = evaluate(model, tokenizer, [dict(r, family="copy") for r in records], spec, ["copy"])
    return result["exact_match"]["copy"]


# --------------------------------------------------------------------------- analyses
def ensure_features(analysis: dict, spec: dict, train: InstructionDataset) -> dict[str, float]:
    """Extract one feature model's features of the training data once (collective); its cost from its record."""
    import deepspeed

    from ds_cluster.analysis.compute import analyze
    from ds_cluster.ds_config import forward_only_config
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.data.models import load_model_and_tokenizer

    record = Path(analysis["path"]) / "cost.json"
    if not exists_on_rank0(record):
        clock = Clock()
        # The clustering of this folder is not used (every k-means analysis clusters these features itself).
        settings = ClusterSamplingConfig.from_dict({**analysis["cluster_sampling"], "num_clusters": 1,
                                                    "kmeans_n_init": 1, "enabled": True})
        if analysis["source"] == "own":
            config = forward_only_config(spec["ds_config"])
            model, _ = load_model_and_tokenizer(analysis["model"], ds_config=config)
            engine, *_ = deepspeed.initialize(model=model, config=config)
            features_of: Any = train
        else:
            from ds_cluster.features.feature_model import feature_dataset, feature_engine

            engine, feature_tokenizer = feature_engine(analysis["model"], spec["ds_config"])
            features_of = feature_dataset(train, feature_tokenizer, analysis.get("feature_max_length"))
        summary = analyze(engine, features_of, analysis["path"], settings, batch_size=16, show_progress=False,
                          provenance={"feature_model": analysis["model"]}, collectives=distributed.collectives(),
                          analysis_of=train)
        cost = summed(clock.read())
        cost.update(extract_wall=summary["timings_s"]["extract"], source=analysis["source"],
                    model=analysis["model"])
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine
        gc.collect()
        if distributed.get_rank() == 0:
            write_json_atomic(record, cost)
        barrier()
    return json.loads(record.read_text())


def ensure_clustering(analysis: dict, features: dict, spec: dict, train: InstructionDataset) -> dict[str, float]:
    """k-means of a feature analysis with this analysis's settings and seed, on rank 0; its cost is the
    extraction's plus its own (collective)."""
    from ds_cluster.analysis.folder import AnalysisDir
    from ds_cluster.clustering.kmeans import category_counts, cluster_by_config, purity, spread_to_all
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.data.dataset import dataset_fingerprint

    record = Path(analysis["path"]) / "cost.json"
    if not exists_on_rank0(record):
        error: Optional[BaseException] = None
        if distributed.get_rank() == 0:
            try:
                clock = Clock()
                settings = ClusterSamplingConfig.from_dict({**analysis["cluster_sampling"], "enabled": True})
                source = Path(features["path"])
                points = np.load(source / "features.npy")
                empty = np.load(source / "empty_mask.npy")
                rows = np.flatnonzero(~empty)
                world = distributed.get_world_size()
                clusters = cluster_by_config(points[rows], settings, world)
                labels, distances = spread_to_all(clusters, rows, len(train))
                num_clusters = settings.resolved_num_clusters(world)
                names, counts = category_counts(labels, train.categories, num_clusters)
                arrays = {"labels.npy": labels, "distances.npy": distances, "empty_mask.npy": empty,
                          "centroids.npy": np.asarray(clusters.centroids, dtype=np.float32)}
                if analysis.get("keep_features") or SELECTIONS[settings.selection].reads_features:
                    arrays["features.npy"] = points
                own = clock.read()
                summary = {"num_samples": len(train), "num_clusters": num_clusters,
                           "cluster_sizes": np.bincount(clusters.labels, minlength=num_clusters).tolist(),
                           "purity": purity(counts), "cluster_categories": [
                               {name: int(count) for name, count in zip(names, row) if count} for row in counts],
                           "timings_s": {"cluster": own["wall"]}, "features": features["source"]}
                manifest = {"dataset_fingerprint": dataset_fingerprint(train), "features": str(source),
                            "feature_model": features.get("model"), "cluster_sampling": settings.model_dump()}
                AnalysisDir(analysis["path"]).write(arrays, manifest, summary)
                write_json_atomic(record, {
                    "wall": features["wall"] + own["wall"], "cpu": features["cpu"] + own["cpu"],
                    "extract_wall": features["extract_wall"], "extract_cpu": features["cpu"],
                    "cluster_wall": own["wall"], "cluster_cpu": own["cpu"], "source": features["source"]})
            except (ValueError, OSError, RuntimeError) as err:
                error = err
        distributed.agree_on_error(error, f"clustering {analysis['path']}")
    return json.loads(record.read_text())


def materialize_near_duplicates(analysis: dict, kept: int, num_samples: int) -> None:
    """The near-duplicate arm's subset as labels (0 kept, -1 left out), written once by rank 0 (collective)."""
    from bench.near_duplicates import select_kept

    folder = Path(analysis["path"])
    if not exists_on_rank0(folder / "labels.npy"):
        error: Optional[BaseException] = None
        if distributed.get_rank() == 0:
            try:
                groups = np.load(Path(analysis["near_duplicates"]) / "groups.npy")
                if groups.size != num_samples:
                    raise ValueError(f"{analysis['near_duplicates']}: {groups.size} groups for {num_samples} samples")
                labels = np.full(num_samples, -1, dtype=np.int64)
                labels[select_kept(groups, kept, analysis["seed"])] = 0
                folder.mkdir(parents=True, exist_ok=True)
                # The groups' cost (computed once per mixture) is charged to every near-duplicate arm.
                write_json_atomic(folder / "cost.json", json.loads(
                    (Path(analysis["near_duplicates"]) / "cost.json").read_text()))
                np.save(folder / "labels.npy", labels)
            except (ValueError, OSError) as err:
                error = err
        distributed.agree_on_error(error, f"the near-duplicate subset {folder}")


# --------------------------------------------------------------------------- one arm
def resolve_arm(arm: dict, spec: dict) -> tuple[dict, Optional[int], Optional[int]]:
    """The arm's cluster_sampling block with its budget matched to the paper arm's kept size, its fixed step
    count (None: its epochs), and the kept size.

    The paper arm keeps floor(r x smallest cluster) per cluster; r is set so that it keeps about the
    arm's fraction of the data, and every other arm of that fraction keeps exactly as many samples.
    """
    block, steps, kept = dict(arm["cluster_sampling"]), arm.get("steps"), None
    match = arm.get("match")
    global_batch = (spec["ds_config"]["train_micro_batch_size_per_gpu"] * distributed.get_world_size()
                    * spec["ds_config"].get("gradient_accumulation_steps", 1))
    if match:
        summary = json.loads((Path(spec["analyses"][match["analysis"]]["path"]) / "summary.json").read_text())
        sizes = summary["cluster_sizes"]
        if "budget_ratio" in match:  # r itself, as budget_mode "min" keeps it: floor(r x smallest cluster) each
            per_cluster = math.floor(match["budget_ratio"] * min(sizes) + 1e-9)
        else:
            per_cluster = min(min(sizes), round(match["fraction"] * sum(sizes)) // len(sizes))
        kept = per_cluster * len(sizes)
        if arm["method"] == "paper":
            block["budget_ratio"] = per_cluster / min(sizes)
        elif arm.get("cut"):
            steps = arm["epochs"] * (kept // global_batch)
        else:
            block["budget_samples"] = kept
    if arm.get("stretch"):
        steps = arm["epochs"] * (spec["num_train"] // global_batch)  # full data's step count
    return block, steps, kept


def run_arm(arm: dict, spec: dict, train: InstructionDataset, tokenizer: Any, splits: dict[str, list[dict]]
            ) -> dict[str, Any]:
    """Train one arm from the base model and evaluate it (collective)."""
    import ds_cluster
    from ds_cluster.data.models import load_model_and_tokenizer

    load_before = os.getloadavg()
    torch.manual_seed(arm["seed"])
    model, _ = load_model_and_tokenizer(spec["base_model"])
    config = json.loads(json.dumps(spec["ds_config"]))
    config["optimizer"]["params"]["lr"] = spec["learning_rate"]
    block, fixed_steps, kept = resolve_arm(arm, spec)
    analysis = spec["analyses"][arm["analysis"]]
    if "near_duplicates" in analysis:
        materialize_near_duplicates(analysis, kept, len(train))
    block["analysis_path"] = analysis["path"]
    if block.get("schedule") == "adaptive":
        block["schedule_log"] = str(Path(spec["work_dir"]) / "arms" / f"{arm['name']}.schedule.jsonl")
    config["data_efficiency"]["data_sampling"]["cluster_sampling"] = {**block, "enabled": True}
    steps = {"total": 0}
    made: dict[str, Any] = {}  # the loader, once ds_cluster.initialize has built it
    schedule = run_schedule(block, lambda: steps["total"], spec["warmup_fraction"], lambda: made.get("loader"))
    clock = Clock()
    engine, _, loader, _ = ds_cluster.initialize(
        model=model, model_parameters=model.parameters(), training_data=train, config=config,
        collate_fn=trim_padding_collate, lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
    plan, made["loader"] = loader.plan, loader
    steps["total"] = fixed_steps or arm["epochs"] * plan.steps_per_epoch
    set_up = clock.read()
    losses, learning_rates, curve = [], {}, []
    evaluating = {"wall": 0.0, "cpu": 0.0}  # validation during training: evaluation, not training

    def loop_so_far() -> dict[str, float]:
        now = loop_clock.read()
        return summed({kind: now[kind] - evaluating[kind] for kind in ("wall", "cpu")})

    loop_clock = Clock()
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
        if getattr(loader, "finished", False):
            break  # the auto budget: every cluster has stopped improving
        if engine.global_steps < steps["total"] and loader.position >= loader.micro_batches_per_epoch:
            during = Clock()
            validation = evaluate(engine.module, tokenizer, splits["validation"], spec, [])["loss"]
            spent = during.read()
            evaluating = {kind: evaluating[kind] + spent[kind] for kind in ("wall", "cpu")}
            curve.append({"epoch": engine.global_steps / plan.steps_per_epoch, "step": engine.global_steps,
                          "loop": loop_so_far(), "loss": validation})
            engine.train()
    loop = loop_so_far()
    clock = Clock()
    evaluation = {split: evaluate(engine.module, tokenizer, records, spec, spec["exact_match_families"])
                  for split, records in splits.items()}
    evaluated = clock.read()
    curve.append({"epoch": engine.global_steps / plan.steps_per_epoch, "step": engine.global_steps, "loop": loop,
                  "loss": evaluation["validation"]["loss"]})
    # The adaptive schedule keeps what it drew (a sample counts once); the static plan what it selected.
    kept = int(loader.consumed().sum()) if hasattr(loader, "consumed") else plan.num_kept
    result = {
        "arm": arm, "cluster_sampling": block, "steps": engine.global_steps, "num_kept": kept,
        "num_samples": plan.num_samples, "kept_fraction": kept / plan.num_samples,
        "kept_sizes": plan.kept_sizes.tolist(), "steps_per_epoch": plan.steps_per_epoch, "plan": plan.fingerprint(),
        "time": {"setup": summed(set_up), "loop": loop, "evaluation": summed(evaluated),
                 "validation_during_training": summed(evaluating),
                 "loader_wall": max(distributed.all_gather_object(fetching))},
        "first_losses": losses[:4], "last_losses": losses[-4:], "validation_curve": curve,
        "validation_loss_per_epoch": [point["loss"] for point in curve],
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
    from ds_cluster.data.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(spec["base_model"], rank=rank)
    train = InstructionDataset(read_jsonl(spec["train"]), tokenizer, max_length=spec["max_length"], rank=rank)
    # Choosing (bench/quality.py --choose) never evaluates held-out.
    splits = {name: read_jsonl(spec[name]) for name in spec["evaluate_splits"]}
    startup = summed({"wall": time.time() - spec["launched_at"], "cpu": time.process_time()})
    if rank == 0:
        write_json_atomic(work / "startup.json", {**startup, "process_started": PROCESS_STARTED})
    base_path = work / "base.json"
    if not exists_on_rank0(base_path):
        clock = Clock()
        base = {split: evaluate(model, tokenizer, records, spec, spec["exact_match_families"])
                for split, records in splits.items()}
        base["time"] = summed(clock.read())
        if spec["instrument"] == "synthetic":
            base["copy_probe"] = {"exact_match": copy_probe(model, tokenizer, spec),
                                  "records": spec["copy_probe_records"]}
        if rank == 0:
            write_json_atomic(base_path, base)
            print(f"base model: validation macro answer loss "
                  f"{np.mean(list(base['validation']['loss'].values())):.4f}", flush=True)
        barrier()
    del model
    skipped = spec.get("skipped") or []
    for reason in skipped:
        if rank == 0:
            print(f"skipped: {reason}", flush=True)
    for number, arm in enumerate(spec["arms"], start=1):
        path = work / "arms" / f"{arm['name']}.json"
        if not exists_on_rank0(path):
            # Analyses are computed when an arm first needs them: the gate's arms run before SmolLM2's extraction.
            for name in (arm.get("match") or {}).get("analysis"), arm["analysis"]:
                analysis = spec["analyses"].get(name) or {}
                if analysis.get("features"):
                    features = spec["analyses"][analysis["features"]]
                    ensure_clustering(analysis, {**features, **ensure_features(features, spec, train)}, spec, train)
            # The start-up of the job that trained the arm: a resumed run charges each arm its own job's.
            result = {**run_arm(arm, spec, train, tokenizer, splits), "startup": startup}
            if rank == 0:
                write_json_atomic(path, result)
                validation = result["validation"]["loss"]
                print(f"[{number}/{len(spec['arms'])}] {arm['name']}: kept {result['kept_fraction']:.3f}, "
                      f"{result['steps']} steps, loop {result['time']['loop']['wall']:.0f} s wall "
                      f"({result['time']['loop']['cpu']:.0f} CPU s), validation macro answer loss "
                      f"{sum(validation.values()) / len(validation):.4f}", flush=True)
            barrier()
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
