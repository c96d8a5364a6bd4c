"""One set-up of the plan and its loader for every trainer: the DeepSpeed hook, ClusterTrainer, ClusterSFTTrainer.

A trainer supplies only a small `TrainerAdapter`: its data-parallel ranks
(rank, size and the sum over them), its batch shape, and an engine (or a
way to build a forward-only one) for computing a missing analysis.
Everything else is `ClusterSetup`'s, once, the same for all three:

1. DeepSpeed's CPU shared-memory buffers are released (`release_shared_memory`,
   the one place), at the start, so a job that fails below leaves nothing in
   /dev/shm, and again once the trainer's engine exists;
2. the checks: analysis_path on a filesystem every rank sees, curriculum
   learning off, the batch arithmetic, a map-style dataset, the same data on
   every rank, the analysis (when there is one) made for this data;
3. the analysis computed in the job when analysis_path holds none yet
   (features from the given engine before the first step, written
   atomically, resumed after a kill through its feature store);
4. the plan, the same on every rank (fingerprints compared), and the loader;
5. resume: one sampler state (the same dict in DeepSpeed's `client_state` and
   in a Trainer checkpoint's JSON file) and one restore with the same errors.

The dataset's fingerprint is computed once per start-up. A failure on any
rank becomes an error on all of them (never a rank left waiting in a
collective).
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

from ds_cluster import distributed
from ds_cluster.analysis.folder import AnalysisDir
from ds_cluster.clustering.samples import PlanInputs, cluster_samples
from ds_cluster.batching import BatchShape, check_batch_arithmetic
from ds_cluster.collectives import Collectives
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.data.dataset import dataset_fingerprint
from ds_cluster.data.target import TargetExamples, read_target, target_encoding
from ds_cluster.features.source import FeatureSource, feature_source
from ds_cluster.loader.adaptive import AdaptiveSchedule
from ds_cluster.analysis.folder import InJobAnalysis
from ds_cluster.loader.items import batch_reader
from ds_cluster.loader.sampler import ClusterDataLoader
from ds_cluster.loader.schedule import Schedule, StaticSchedule
from ds_cluster.phases import phase
from ds_cluster.planning.budget import budget_total
from ds_cluster.planning.plan import Plan, build_plan
from ds_cluster.planning.targeted import check_budget_covers_targets

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class TrainerAdapter:
    """What differs between trainers: where this process sits among the data-parallel ranks, the batch
    shape, what computes a missing analysis, and what the loader reads and collates."""

    name: str  # says who computed an analysis, in its manifest and in messages
    data_parallel: Collectives  # this rank among the data-parallel ranks (rank, size, the sum over them)
    shape: BatchShape
    engine: Any = None  # the job's own engine, whose forward computes a missing analysis (the hook's)
    # Or the model: a forward-only engine of it under the set-up's DeepSpeed config computes the analysis (a
    # Trainer's; without a DeepSpeed config, the model itself).
    model: Any = None
    collate_fn: Optional[Callable] = None
    loader_dataset: Any = None  # what the loader reads, when not the training data itself
    # The adaptive schedule's probe losses with the model being trained (`loss.probe_losses` on the engine).
    probe_losses: Optional[Callable[[dict], Any]] = None


class ClusterSetup:
    """The checks, the in-job analysis, the plan, the loader and resume, for one trainer's start-up.

    `everyone`: every rank of the job (the checks and the in-job analysis span
    them all); the plan is over the data-parallel ranks the adapter gives.
    """

    def __init__(self, config: ClusterSamplingConfig, training_data: Any, *, everyone: Collectives,
                 ds_config: Optional[Mapping] = None, source: str = "the DeepSpeed config", tokenizer: Any = None,
                 max_length: Optional[int] = None):
        self.config = config
        # What target examples are tokenized with (`data.target.target_encoding`): else the training data's own.
        self.tokenizer, self.max_length = tokenizer, max_length
        self.target: Optional[TargetExamples] = None
        self.stages = config.stages()  # every stage's settings, derived once
        self.training_data = training_data
        self.everyone = everyone
        self.ds_config = ds_config
        self.source = source
        self._fingerprint: Optional[str] = None
        self._checked = False
        self._inputs: Optional[PlanInputs] = None

    # ------------------------------------------------------------------ checks
    @property
    def data_fingerprint(self) -> str:
        """The training data's content fingerprint, computed once."""
        if self._fingerprint is None:
            self._fingerprint = dataset_fingerprint(self.training_data)
        return self._fingerprint

    @staticmethod
    def release_shared_memory() -> None:
        """Collective: unlink DeepSpeed's CPU shm all-reduce buffers (the one call every trainer makes)."""
        distributed.release_shared_memory_buffer()

    def check(self, world_size: Optional[int] = None) -> None:
        """Collective: every check that needs no engine, an error on every rank if any fails.

        `world_size`: the data-parallel size the batch arithmetic of the DeepSpeed
        config is checked against (None: not checked, e.g. with model parallelism
        or "auto" batch values that the trainer fills in itself).
        """
        self.release_shared_memory()
        if self.config.analysis_path:
            folder = Path(self.config.analysis_path).absolute().parent
            folder.mkdir(parents=True, exist_ok=True)
            # Ranks on other hosts read the analysis through a shared filesystem: a rank that cannot see
            # it fails the start on every rank, naming its host, instead of training on something else.
            distributed.check_shared_path(folder, "folder holding cluster_sampling.analysis_path", ranks=self.everyone)

        def local_checks() -> Optional[PlanInputs]:
            if self.ds_config is not None:
                check_no_curriculum(self.ds_config, self.source)
                if world_size is not None:
                    check_batch_arithmetic(self.ds_config, self.source, world_size)
            check_training_data(self.training_data)
            self.target = self.read_target()
            return self.read_inputs() if self.analysis.exists() else None

        self._inputs = self.everyone.run_agreed("cluster_sampling set-up", local_checks,
                                                errors=(ValueError, FileNotFoundError))
        self.everyone.check_agreement(self.target.fingerprint if self.target is not None else None,
                                      "target examples (content fingerprint)")
        # The plan depends only on the analysis, so a rank handed other data of the same length would
        # build the same plan and silently train on other samples.
        self.everyone.check_agreement((len(self.training_data), self.data_fingerprint),
                                      "training data (number of samples, content fingerprint)")
        # Every rank must agree on whether the analysis exists (a shared folder), or one would wait for the others.
        self.everyone.check_agreement(self._inputs is None,
                                      "whether cluster_sampling.analysis_path holds an analysis")
        self._checked = True

    def check_model(self, model: Any) -> None:
        """Collective: the model has parameters to train, and every rank trains the same ones (their names and
        shapes, and a PEFT model's adapter configuration), or an error on every rank."""
        def trainable() -> None:
            if not any(param.requires_grad for param in model.parameters()):
                raise ValueError(f"{type(model).__name__} has no trainable parameters (every one has requires_grad "
                                 "False; a PEFT model whose adapters are frozen?): there is nothing to train. Give "
                                 "the adapters requires_grad, or train another model")

        self.everyone.run_agreed("checking the model's trainable parameters", trainable)
        self.everyone.check_agreement(trainable_signature(model),
                                      "trainable parameters (names and shapes) and adapter configuration",
                                      "Every rank must build and wrap the model the same way (the same model, the "
                                      "same peft config and target modules, the same layers frozen).")

    @property
    def analysis(self) -> AnalysisDir:
        if not self.config.analysis_path:
            raise ValueError("cluster_sampling.analysis_path is not set: point it at the analysis folder written by "
                             "`ds-cluster analyze` (features.npy and/or labels.npy), or at a folder for the training "
                             "job to write one into")
        return AnalysisDir(self.config.analysis_path)

    def read_target(self) -> Optional[TargetExamples]:
        """The configured target examples (`cluster_sampling.target`), read and tokenized like the training data and
        checked (`data.target.read_target`); None without a target."""
        target = self.stages.selection.target
        if target is None:
            return None
        tokenizer, max_length = target_encoding(self.training_data, self.tokenizer, self.max_length)
        examples = read_target(target.data, tokenizer, max_length, group_field=target.group_field,
                               min_examples=target.min_examples, groups=target.groups)
        # Before any features are computed: a budget that cannot give every target a record.
        selection = self.stages.selection
        check_budget_covers_targets(budget_total(np.array([len(self.training_data)]), selection.planned_ratio,
                                                 selection.budget_samples), examples)
        return examples

    def read_inputs(self) -> PlanInputs:
        """The analysis's features/labels, checked against the training data (length and fingerprint)."""
        return self.analysis.load_inputs(len(self.training_data), self.data_fingerprint)

    # ------------------------------------------------------------------ plan and loader
    def build_loader(self, adapter: TrainerAdapter, check_world_size: Optional[int] = None) -> ClusterDataLoader:
        """Collective: this data-parallel rank's cluster-balanced loader.

        Runs `check` first unless the trainer already did (the hook does, before
        building its engine); `check_world_size` is what that check compares the
        batch arithmetic with. The loader's `analysis` says what computing the
        analysis in the job cost (None when it was read).
        """
        if adapter.shape.world_size != adapter.data_parallel.world_size:
            raise ValueError(f"{adapter.name}: the batch shape has {adapter.shape.world_size} data-parallel ranks but "
                             f"the data-parallel group has {adapter.data_parallel.world_size}")
        self.release_shared_memory()  # again: the engine may have started DeepSpeed's communication just now
        if not self._checked:
            self.check(check_world_size)
        inputs, in_job = self._inputs, None
        if inputs is None:
            inputs, in_job = self.analyze_in_job(adapter)
        elif self.target is not None and self.analysis.target_fingerprint() != self.target.fingerprint:
            self.retarget_in_job(adapter)  # a changed target set makes a new selection, never a stale one
        with phase("plan"):  # and the loader
            plan = self.agreed_plan(adapter.shape, inputs)
            dataset = self.training_data if adapter.loader_dataset is None else adapter.loader_dataset
            rank = adapter.data_parallel.rank
            schedule: Schedule = StaticSchedule(plan, rank)
            if self.stages.schedule.adaptive:
                probe = None
                if adapter.probe_losses is not None:
                    read, losses_of = batch_reader(dataset, adapter.collate_fn), adapter.probe_losses
                    probe = lambda indices: losses_of(read(indices))  # noqa: E731
                schedule = AdaptiveSchedule(plan, rank, self.stages.schedule, collectives=adapter.data_parallel,
                                            probe_losses=probe)
            return ClusterDataLoader(dataset, plan, rank, schedule=schedule, loss=self.stages.loss,
                                     collectives=adapter.data_parallel, collate_fn=adapter.collate_fn, analysis=in_job)

    def analyze_in_job(self, adapter: TrainerAdapter) -> tuple[PlanInputs, InJobAnalysis]:
        """Collective: selection in the training job itself, features by the job's engine, k-means, the folder.

        With `config.feature_model` the features come from that checkpoint instead,
        in its own forward-only engine under the job's ZeRO stage, on the samples
        re-encoded with its tokenizer. Feature extraction is shared over every rank;
        the feature store inside the folder makes a crashed job's rerun resume it.
        Returns the plan inputs and what the analysis cost.
        """
        from ds_cluster.analysis.compute import AnalysedData, AnalysisOptions, analyze

        started, cpu_started = time.perf_counter(), time.process_time()
        provenance = {"computed_by": adapter.name, "feature_model": self.stages.features.model}
        with self._feature_source(adapter) as source:
            target = self.target.encoded_with(source.encode) if self.target is not None else None
            options = AnalysisOptions(batch_size=adapter.shape.micro_batch_size,
                                      show_progress=self.everyone.rank == 0, provenance=provenance,
                                      of_data=AnalysedData(self.training_data, self.data_fingerprint), target=target,
                                      kmeans_in_child=True)  # this rank goes on to train
            result = analyze(source.engine, source.dataset, self.config.analysis_path, self.stages, options,
                             self.everyone)
        inputs = self.everyone.run_agreed("reading the analysis just computed", self.read_inputs,
                                          errors=(ValueError, FileNotFoundError))
        assert inputs is not None
        in_job = InJobAnalysis(result.timings, wall=time.perf_counter() - started,
                               cpu=time.process_time() - cpu_started)
        logger.info("ds_cluster: analysis computed in the training job in %.1f s (extraction %.1f s, clustering "
                    "%.1f s): %s", in_job.wall, in_job.timings.extract, in_job.timings.cluster,
                    self.config.analysis_path)
        return inputs, in_job

    @contextlib.contextmanager
    def _feature_source(self, adapter: TrainerAdapter) -> Iterator[FeatureSource]:
        """Collective: the job's engine (the hook), else a forward-only one of the model (a Trainer), else the
        feature model's, with the data it reads (`features.source.feature_source`)."""
        engine, built = adapter.engine, False
        if callable(engine) and not hasattr(engine, "forward"):  # 0.5.0's adapters gave a function that builds one
            warnings.warn("TrainerAdapter(engine=<a function building an engine>) is TrainerAdapter(model=...) "
                          "since 0.6.0", DeprecationWarning, stacklevel=3)
            engine, built = engine(), True
        try:
            with feature_source(self.stages.features, self.training_data, ds_config=self.ds_config,
                                engine=engine, model=adapter.model) as source:
                yield source
        finally:
            if built and hasattr(engine, "destroy"):
                engine.destroy()

    def retarget_in_job(self, adapter: TrainerAdapter) -> None:
        """Collective: the analysis was made with another target set (or none): the configured target's features,
        with the analysis's own feature settings and the job's model, written into it; its records' features and
        clusters are kept (`analysis.target.retarget`, which refuses an analysis of another model)."""
        from ds_cluster.analysis.target import retarget

        assert self.target is not None
        with self._feature_source(adapter) as source:
            retarget(source.engine, self.analysis, self.target.encoded_with(source.encode), self.everyone,
                     adapter.shape.micro_batch_size)

    def agreed_plan(self, shape: BatchShape, inputs: Optional[PlanInputs] = None) -> Plan:
        """Collective: the plan for this batch shape, the same on every rank, or an error on every rank. A targeted
        selection reads the analysis's target, which must be the configured one."""
        def build() -> Plan:
            given = inputs if inputs is not None else self.read_inputs()
            target = None
            if self.target is not None:
                target = self.analysis.load_target()
                check_target_is_current(self.analysis, target, self.target.fingerprint)
            # This rank goes on to train: scikit-learn's k-means in a child keeps its imports out of the rank.
            clusters = cluster_samples(given, self.stages.clustering, shape.world_size, kmeans_in_child=True)
            return build_plan(clusters, self.stages, shape, target=target)

        plan = self.everyone.run_agreed("building the cluster plan", build, errors=(ValueError, FileNotFoundError))
        assert plan is not None
        self.everyone.check_agreement(plan.fingerprint(), "cluster plan fingerprint")
        if self.everyone.rank == 0:
            summary = plan.summary()
            logger.info("ds_cluster: kept %d of %d samples in %d clusters; %d steps per epoch; plan %s",
                        summary["num_kept"], summary["num_samples"], summary["num_clusters"],
                        summary["steps_per_epoch"], summary["fingerprint"])
        return plan

    # ------------------------------------------------------------------ resume
    def restore_sampler(self, loader: ClusterDataLoader, state: Mapping[str, Any], global_step: Optional[int],
                        where: str) -> None:
        """Collective: put the loader where a checkpoint's sampler state says, or an error on every rank.

        The state must be of this plan (same data, analysis, config and world
        size) and, when it records its optimizer step, saved at the checkpoint's
        own step (`global_step`) and at that step's place in the plan. `where`
        names the checkpoint in messages.
        """
        def restore() -> None:
            try:
                loader.load_state_dict(dict(state))  # the version and the plan fingerprint
                saved_step = state.get("global_step")
                if saved_step is None or global_step is None:
                    return  # a state written before the step was recorded
                expected = loader.resume_point(global_step)
                if int(saved_step) != int(global_step) or (state["epoch"], state["position"]) != expected:
                    raise ValueError(
                        f"sampler at epoch {state['epoch']} micro-batch {state['position']} (step {saved_step}) but "
                        f"the checkpoint is at step {global_step}, i.e. epoch {expected[0]} micro-batch "
                        f"{expected[1]}")
            except KeyError as err:
                raise ValueError(f"the sampler state has no {err}") from None
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None

        self.everyone.run_agreed("restoring the cluster sampler state", restore)


def trainable_signature(model: Any) -> str:
    """A short hash of what trains: every trainable parameter's name and full shape (ZeRO-3's too), and a PEFT
    model's adapter configurations; the same on every rank of a sound job."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if param.requires_grad:
            digest.update(f"{name}:{tuple(getattr(param, 'ds_shape', param.shape))};".encode())
    adapters = getattr(model, "peft_config", None)
    if isinstance(adapters, Mapping):
        for adapter, config in sorted(adapters.items()):
            values = config.to_dict() if hasattr(config, "to_dict") else vars(config)
            digest.update(f"{adapter}={json.dumps(values, sort_keys=True, default=_ordered)}".encode())
    return digest.hexdigest()[:16]


def _ordered(value: Any) -> Any:
    """JSON for what json cannot write: a set in sorted order (peft keeps target_modules as a set, whose order
    follows each process's string hashing), anything else as its text."""
    return sorted(map(str, value)) if isinstance(value, (set, frozenset)) else str(value)


def check_target_is_current(analysis: AnalysisDir, target: Any, fingerprint: str) -> None:
    """The analysis's target is the configured one (`fingerprint`), or a ValueError: never a stale selection."""
    if target is None or target.fingerprint != fingerprint:
        held = "no target" if target is None else f"the target set {target.fingerprint}"
        raise ValueError(f"{analysis.path} holds {held}, not the configured cluster_sampling.target ({fingerprint}): "
                         "compute its target features again (`ds-cluster analyze --target`, or let the training "
                         "job do it)")


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
