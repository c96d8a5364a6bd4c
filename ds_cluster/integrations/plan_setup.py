"""One set-up of the plan and its loader for every trainer: the DeepSpeed hook, ClusterTrainer, ClusterSFTTrainer.

An integration passes only what differs between trainers: its data-parallel
rank and group, its batch shape, and an engine (or a way to build a
forward-only one) for computing a missing analysis. Everything else happens
here, once, the same for all of them:

1. DeepSpeed's CPU shared-memory buffers are released first, so a job that
   fails below leaves nothing in /dev/shm;
2. the checks: analysis_path on a filesystem every rank sees, curriculum
   learning off, the batch arithmetic, a map-style dataset, the same data on
   every rank, the analysis (when there is one) made for this data;
3. the analysis computed in the job when analysis_path holds none yet
   (features from the given engine before the first step, written
   atomically, resumed after a kill through its feature store);
4. the plan, the same on every rank (fingerprints compared), and the loader.

Every rank builds the same plan from the same inputs; a failure on any rank
becomes an error on all of them (never a rank left waiting in a collective).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch

from ds_cluster import distributed
from ds_cluster.analysis_dir import AnalysisDir, PlanInputs
from ds_cluster.batching import BatchShape, check_batch_arithmetic
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.dataset import dataset_fingerprint
from ds_cluster.plan import Plan, build_plan
from ds_cluster.sampler import ClusterDataLoader

logger = logging.getLogger(__name__)

# An engine whose forward computes the features, or a function that builds a forward-only one on demand
# (destroyed once the analysis is written).
EngineOrFactory = Union[Any, Callable[[], Any]]


@dataclass(frozen=True)
class SetupCheck:
    """What the checks found: the analysis's plan inputs, or None when the job must compute them."""

    inputs: Optional[PlanInputs]


def release_shared_memory() -> None:
    """Collective: unlink DeepSpeed's CPU shm all-reduce buffers (the one call every trainer makes)."""
    distributed.release_shared_memory_buffer()


def check_cluster_setup(config: ClusterSamplingConfig, training_data: Any, *, ds_config: Optional[Mapping] = None,
                        source: str = "the DeepSpeed config", world_size: Optional[int] = None) -> SetupCheck:
    """Collective: every check that needs no engine, an error on every rank if any fails.

    `world_size`: the data-parallel size the batch arithmetic of `ds_config` is
    checked against (None: not checked, e.g. with model parallelism or "auto"
    batch values that the trainer fills in itself).
    """
    release_shared_memory()
    if config.analysis_path:
        Path(config.analysis_path).absolute().parent.mkdir(parents=True, exist_ok=True)
        # Ranks on other hosts read the analysis through a shared filesystem: a rank that cannot see
        # it fails the start on every rank, naming its host, instead of training on something else.
        distributed.check_shared_path(Path(config.analysis_path).absolute().parent,
                                      "folder holding cluster_sampling.analysis_path")
    error: Optional[BaseException] = None
    inputs = None
    try:
        if ds_config is not None:
            check_no_curriculum(ds_config, source)
            if world_size is not None:
                check_batch_arithmetic(ds_config, source, world_size)
        check_training_data(training_data)
        if analysis_of(config).exists():
            inputs = read_plan_inputs(config, training_data)
    except (ValueError, FileNotFoundError) as err:
        error = err
    distributed.agree_on_error(error, "cluster_sampling set-up")
    check_same_training_data(training_data)
    # Every rank must agree on whether the analysis exists (a shared folder), or one would wait for the others.
    distributed.check_agreement(inputs is None, "whether cluster_sampling.analysis_path holds an analysis")
    return SetupCheck(inputs)


def setup_cluster_loader(config: ClusterSamplingConfig, training_data: Any, *, rank: int, group: Any,
                         shape: BatchShape, engine: EngineOrFactory, collate_fn: Optional[Callable] = None,
                         loader_dataset: Any = None, ds_config: Optional[Mapping] = None,
                         source: str = "the DeepSpeed config", world_size: Optional[int] = None,
                         checked: Optional[SetupCheck] = None,
                         computed_by: str = "the training job") -> ClusterDataLoader:
    """Collective: the cluster-balanced loader of this data-parallel rank, for every trainer.

    rank, group: the data-parallel rank and process group (None: every rank);
    shape: (data-parallel size, micro batch, accumulation steps); engine: what
    computes the features when analysis_path holds no analysis yet (an engine,
    or a zero-argument function building a forward-only one). `loader_dataset`:
    what the loader reads, when not `training_data` itself (the same samples
    with some columns dropped, say); the plan is always of `training_data`.
    `ds_config` (read from `source`): the job's DeepSpeed config, for the
    checks and for a `feature_model`'s engine; `world_size`: the data-parallel
    size its batch arithmetic is checked against (None: not checked).
    `checked`: the result of `check_cluster_setup` when the integration ran it
    earlier (the hook does, before building the engine). The loader's
    `analysis_timings` say what computing the analysis in the job cost (empty
    when it was read).
    """
    release_shared_memory()  # again: the engine may have started DeepSpeed's communication just now
    if checked is None:
        checked = check_cluster_setup(config, training_data, ds_config=ds_config, source=source,
                                      world_size=world_size)
    collectives = distributed.collectives(group)
    inputs, timings = checked.inputs, {}
    if inputs is None:
        inputs, timings = analyze_in_job(engine, training_data, config, shape.micro_batch_size, computed_by,
                                         ds_config=ds_config)
    plan = agreed_plan(config, training_data, shape, inputs)
    loader = ClusterDataLoader(training_data if loader_dataset is None else loader_dataset, plan, rank,
                               collate_fn=collate_fn, sum_over_ranks=collectives.sum)
    loader.analysis_timings = timings
    return loader


def analyze_in_job(engine: EngineOrFactory, training_data: Any, config: ClusterSamplingConfig, batch_size: int,
                   computed_by: str, ds_config: Optional[Mapping] = None) -> tuple[PlanInputs, dict[str, float]]:
    """Selection in the training job itself: features by the job's engine, k-means, the analysis folder written.

    With `config.feature_model` the features come from that checkpoint instead,
    in its own forward-only engine under `ds_config`'s ZeRO stage, on the
    samples re-encoded with its tokenizer. Collective over every rank (feature
    extraction shares the work over all of them). The feature store inside the
    folder makes a crashed job's rerun resume the extraction. Returns the plan
    inputs and the timings (seconds).
    """
    from ds_cluster.analysis import analyze

    started, cpu_started = time.perf_counter(), time.process_time()
    provenance = {"computed_by": computed_by, "feature_model": config.feature_model}
    features_of = training_data
    if config.feature_model:
        from ds_cluster.features.feature_model import feature_dataset, feature_engine

        feature_model, feature_tokenizer = feature_engine(config.feature_model, ds_config)
        features_of = feature_dataset(training_data, feature_tokenizer, config.feature_max_length)
        built = True
    else:
        built = callable(engine) and not isinstance(engine, torch.nn.Module)
        feature_model = engine() if built else engine
    everyone = distributed.collectives()
    try:
        summary = analyze(feature_model, features_of, config.analysis_path, config, batch_size=batch_size,
                          show_progress=everyone.rank == 0, provenance=provenance, collectives=everyone,
                          analysis_of=training_data)
    finally:
        if built and hasattr(feature_model, "destroy"):
            feature_model.destroy()  # removes its ZeRO-3 hooks: the trainer's own engine comes next
    error: Optional[BaseException] = None
    inputs = None
    try:
        inputs = read_plan_inputs(config, training_data)
    except (ValueError, FileNotFoundError) as err:
        error = err
    everyone.agree_on_error(error, "reading the analysis just computed")
    assert inputs is not None
    timings = {name: float(value) for name, value in summary.get("timings_s", {}).items()}
    timings.update(wall=time.perf_counter() - started, cpu=time.process_time() - cpu_started)
    logger.info("ds_cluster: analysis computed in the training job in %.1f s (extraction %.1f s, clustering "
                "%.1f s): %s", timings["wall"], timings.get("extract", 0.0), timings.get("cluster", 0.0),
                config.analysis_path)
    return inputs, timings


def check_training_data(training_data: Any) -> None:
    """Cluster sampling picks samples by index: a non-empty map-style dataset, or a ValueError."""
    if training_data is None:
        raise ValueError("cluster_sampling is enabled but training_data is None")
    if not (hasattr(training_data, "__len__") and hasattr(training_data, "__getitem__")):
        raise ValueError(f"cluster_sampling picks samples by index, so training_data must be a map-style dataset "
                         f"(with len() and [i]); got {type(training_data).__name__}. Materialise an iterable "
                         "dataset first, or disable cluster_sampling")
    if len(training_data) == 0:
        raise ValueError("cluster_sampling is enabled but training_data is empty (0 samples): "
                         "pass the dataset to train on")


def check_no_curriculum(config_dict: Mapping, source: str) -> None:
    """Cluster sampling replaces the curriculum sampler; both at once is an error."""
    efficiency = config_dict.get("data_efficiency", {}) or {}
    sampling = efficiency.get("data_sampling", {}) or {}
    curriculum = sampling.get("curriculum_learning", {}) or {}
    legacy = config_dict.get("curriculum_learning", {}) or {}
    if curriculum.get("enabled") or legacy.get("enabled"):
        where = ("data_efficiency.data_sampling.curriculum_learning" if curriculum.get("enabled")
                 else "curriculum_learning")
        raise ValueError(
            f"{source}: {where} and cluster_sampling are both enabled; cluster sampling takes the curriculum "
            f"sampler's place, so set {where}.enabled to false (or disable cluster_sampling)"
        )


def analysis_of(config: ClusterSamplingConfig) -> AnalysisDir:
    if not config.analysis_path:
        raise ValueError("cluster_sampling.analysis_path is not set: point it at the analysis folder written by "
                         "`ds-cluster analyze` (features.npy and/or labels.npy), or at a folder for the training "
                         "job to write one into")
    return AnalysisDir(config.analysis_path)


def read_plan_inputs(config: ClusterSamplingConfig, training_data: Any) -> PlanInputs:
    """The analysis's features/labels, checked against the training data (length and fingerprint)."""
    return analysis_of(config).load_inputs(len(training_data), dataset_fingerprint(training_data))


def agreed_plan(config: ClusterSamplingConfig, training_data: Any, shape: BatchShape,
                inputs: Optional[PlanInputs] = None) -> Plan:
    """Collective: the plan for this batch shape, the same on every rank, or an error on every rank.

    `inputs` may be read beforehand (`read_plan_inputs`); otherwise they are read here.
    """
    error: Optional[BaseException] = None
    plan = None
    try:
        inputs = inputs if inputs is not None else read_plan_inputs(config, training_data)
        plan = build_plan(config=config, world_size=shape.world_size,
                          micro_batch_size=shape.micro_batch_size,
                          gradient_accumulation_steps=shape.gradient_accumulation_steps,
                          **inputs.plan_arguments())
    except (ValueError, FileNotFoundError) as err:
        error = err
    distributed.agree_on_error(error, "building the cluster plan")
    assert plan is not None
    distributed.check_agreement(plan.fingerprint(), "cluster plan fingerprint")
    if distributed.get_rank() == 0:
        summary = plan.summary()
        logger.info("ds_cluster: kept %d of %d samples in %d clusters; %d steps per epoch; plan %s",
                    summary["num_kept"], summary["num_samples"], summary["num_clusters"],
                    summary["steps_per_epoch"], summary["fingerprint"])
    return plan


def check_same_training_data(training_data: Any) -> None:
    """Collective: every rank was given the same data (length and content fingerprint), or an error on all.

    The plan depends only on the analysis, so a rank handed other data of the
    same length would build the same plan and silently train on other samples.
    """
    distributed.check_agreement((len(training_data), dataset_fingerprint(training_data)),
                                "training data (number of samples, content fingerprint)")
