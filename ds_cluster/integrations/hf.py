"""Hugging Face Trainer integration: `ClusterTrainer` trains on the cluster plan with the weighted loss.

    from ds_cluster.integrations.hf import ClusterTrainer
    args = TrainingArguments(output_dir="runs/hf", deepspeed="ds_configs/zero3.json", ...)
    trainer = ClusterTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

The `cluster_sampling` block is read from the same DeepSpeed config
(`args.deepspeed`), or given as `cluster_config=`. Without an enabled block
ClusterTrainer is a plain Trainer. Do not call `ds_cluster.install()` in a
Trainer script: Trainer starts DeepSpeed itself, without training data.

Why a Trainer subclass and not a callback: a callback cannot choose the
batches. Why the data loader is built here and never given to
`accelerator.prepare`: Accelerate wraps the batch sampler of a prepared
loader in `BatchSamplerShard`, which would split this rank's plan batches
again across ranks; the plan already says what every rank trains on.

Resume: Trainer itself skips the micro-batches already trained in the
resumed epoch (`skip_first_batches` wraps our batch sampler in a
`SkipBatchSampler` and calls our `set_epoch`). So the sampler always starts
an epoch at its first batch and exactly one mechanism skips; the sampler
state saved in each checkpoint folder is checked on resume against the plan
(same data, analysis, config and world size) and against Trainer's own
resume point, so a resumed run cannot silently train on another sequence.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
from torch.utils.data import DataLoader, Sampler
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils import is_datasets_available

from ds_cluster import distributed
from ds_cluster.batching import BatchShape
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.data.dataset import trim_padding
from ds_cluster.fileio import write_json_atomic
from ds_cluster.integrations.setup import ClusterSetup, TrainerAdapter
from ds_cluster.loader.figures import figure_logs
from ds_cluster.loader.loss import LOSS_NORMALIZER, SAMPLE_LOSSES, probe_losses, weighted_causal_lm_loss
from ds_cluster.planning.plan import Plan
from ds_cluster.loader.items import SAMPLE_INDEX, SAMPLE_WEIGHT
from ds_cluster.loader.sampler import ClusterDataLoader
from ds_cluster.data.special_tokens import ensure_pad_token

logger = logging.getLogger(__name__)

SAMPLER_STATE_FILE = "ds_cluster_sampler.json"


class _ReleaseSharedMemory(TrainerCallback):
    """Unlinks DeepSpeed's CPU shm all-reduce buffer once Trainer has built its engine.

    The set-up releases what exists when the loader is built; Trainer's engine,
    built after it, may start DeepSpeed's communication anew.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ClusterSetup.release_shared_memory()


class PlanBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of the current epoch, in plan order; `set_epoch` picks the epoch."""

    def __init__(self, loader: ClusterDataLoader):
        super().__init__()
        self.loader = loader

    def __len__(self) -> int:
        return self.loader.micro_batches_per_epoch

    def set_epoch(self, epoch: int) -> None:
        # Called by Trainer at the start of every epoch, also a resumed one (whose first batches
        # Trainer skips itself): an epoch always starts at its first micro-batch here.
        self.loader.start_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.loader.trainer_batches()


class PlanDataLoader(DataLoader):
    """A DataLoader over a PlanBatchSampler with `set_epoch`, which Trainer calls on loaders that have it."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]

    def __iter__(self) -> Any:
        # The epoch's weights and loss normalisers are set before worker processes copy the dataset (an adaptive
        # schedule sets them window by window, in this process: it runs without workers).
        self.batch_sampler.loader.prepare_iteration()  # type: ignore[union-attr]
        return super().__iter__()


def resolve_cluster_config(config: Union[None, ClusterSamplingConfig, Mapping[str, Any]], ds_config: Any
                           ) -> ClusterSamplingConfig:
    """The block a trainer uses: `cluster_config=` when given, else the one in the DeepSpeed config (off without)."""
    if isinstance(config, ClusterSamplingConfig):
        return config
    if config is not None:
        return ClusterSamplingConfig.from_dict(config)
    if ds_config is None:
        return ClusterSamplingConfig(enabled=False)
    return ClusterSamplingConfig.from_ds_config(ds_config)


# The key of Trainer's training-loss log entries (evaluation logs "eval_loss", the run's end "train_loss").
TRAINING_LOSS_LOG = "loss"


class ClusterSamplingMixin:
    """Cluster-balanced batches and the weighted loss for a `transformers.Trainer` subclass.

    Put it before the trainer class: `class MyTrainer(ClusterSamplingMixin, Trainer)`
    (ClusterTrainer, and ClusterSFTTrainer for TRL, are exactly that). Every
    rank gets exactly its part of each global batch of the plan (`world_size` x
    `per_device_train_batch_size` x `gradient_accumulation_steps`), and the
    loss is `weighted_causal_lm_loss` with the block's `loss_reduction`:
    "token" (the default) sums w_i x (sample i's summed response-token losses)
    over the global batch and divides by its response tokens; "sample" is
    mean_i w_i x loss_i, loss_i sample i's mean response-token loss.
    Checkpoints carry the sampler state (`ds_cluster_sampler.json` in each
    checkpoint folder). Extra keyword: `cluster_config` (a ClusterSamplingConfig
    or a `cluster_sampling` dict) instead of the block in `args.deepspeed`.
    When `analysis_path` holds no analysis yet, the job computes it before the
    first step (a forward-only DeepSpeed engine of the model under the job's
    ZeRO stage, or the model itself without DeepSpeed).
    """

    # Our loss (either reduction) is made to be divided by the accumulation steps, as DeepSpeed does for the hook.
    loss_is_scaled_for_ga = False

    def __init__(self, *args: Any, cluster_config: Union[None, ClusterSamplingConfig, Mapping[str, Any]] = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        if getattr(self, "processing_class", None) is not None and hasattr(self.processing_class, "pad_token"):
            # Llama, Mistral and GPT-2 tokenizers ship without pad: Trainer's padding collator needs one.
            ensure_pad_token(self.processing_class, distributed.get_rank())
        self.cluster_config = resolve_cluster_config(cluster_config, self.args.deepspeed)
        self.plan: Optional[Plan] = None
        self.cluster_setup: Optional[ClusterSetup] = None
        self.cluster_loader: Optional[ClusterDataLoader] = None
        self._sum_over_ranks: Optional[Callable[[Any], Any]] = None
        self._resume_checkpoint: Optional[str] = None
        if self.args.deepspeed:
            self.add_callback(_ReleaseSharedMemory())
        if self.cluster_config.enabled:
            # The weighted loss is not normalised by a token count: no need to count tokens across ranks.
            self.model_accepts_loss_kwargs = False

    # ------------------------------------------------------------------ plan
    def build_cluster_plan(self, collate_fn: Optional[Any] = None, loader_dataset: Any = None) -> Plan:
        """Collective: the plan for this run's batch shape, and this rank's loader over it (`self.cluster_loader`).

        The one set-up every trainer shares (`ClusterSetup`), given this trainer's adapter
        (`trainer_adapter`).
        """
        ds_config = _without_auto(self.args.hf_deepspeed_config.config) if self.args.deepspeed else None
        adapter = self.trainer_adapter(collate_fn, loader_dataset)
        # Target examples are tokenized like the training data: with the trainer's tokenizer, at SFTConfig.max_length
        # (TRL), else at the data's own max length or width.
        self.cluster_setup = ClusterSetup(self.cluster_config, self.cluster_plan_dataset(),
                                          everyone=adapter.data_parallel, ds_config=ds_config,
                                          source=str(self.args.deepspeed) if self.args.deepspeed else "cluster_config",
                                          tokenizer=getattr(self, "processing_class", None),
                                          max_length=getattr(self.args, "max_length", None))
        self.cluster_setup.check_model(self.model)
        self.cluster_loader = self.cluster_setup.build_loader(adapter, check_world_size=adapter.shape.world_size)
        self._sum_over_ranks = adapter.data_parallel.sum
        self.plan = self.cluster_loader.plan
        return self.plan

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's `log`, with the per-cluster figures since the last training log added to the training loss's
        entry: `cluster_<c>/train_loss` (the clusters trained since), `cluster_<c>/samples` (trained so far) and,
        with the adaptive schedule, `cluster_<c>/share`; every `report_to` integration receives them."""
        if self.cluster_loader is not None and TRAINING_LOSS_LOG in logs:
            # Trainer logs the training loss on every rank (after gathering it): the figures' sum is collective too.
            figures = self.cluster_loader.figures.report(self._sum_over_ranks)
            logs = {**logs, **figure_logs(figures, self.cluster_loader.current_shares())}
        super().log(logs, *args, **kwargs)

    def trainer_adapter(self, collate_fn: Optional[Any] = None, loader_dataset: Any = None) -> TrainerAdapter:
        """The Trainer's place among the trainers: every rank is a data-parallel rank (checked), the batch is
        `per_device_train_batch_size` x `gradient_accumulation_steps` per rank, and a forward-only engine of
        the model under the job's ZeRO stage (the model itself without DeepSpeed) computes a missing analysis.

        Rank and world size come from torch.distributed, not from `args.process_index`/`world_size`:
        Accelerate reports one process for DeepSpeed on CPU although DeepSpeed trains on all of them.
        """
        check_data_parallel_is_the_world(self.args)
        if distributed.launched_by_mpi() and not distributed.is_initialized():
            # Under a bare mpirun nothing sets RANK or WORLD_SIZE, so Trainer (Accelerate) leaves the process group
            # down until DeepSpeed's engine: every rank would plan as if it were alone and train the same batches.
            distributed.init_distributed()
        everyone = distributed.collectives()
        shape = BatchShape(everyone.world_size, self._train_batch_size, self.args.gradient_accumulation_steps)
        if self.cluster_config.stages().schedule.adaptive and self.args.dataloader_num_workers:
            raise ValueError("the adaptive schedule draws each window from the losses of the one before, in the "
                             "training process: set dataloader_num_workers=0 (or schedule 'static')")
        return TrainerAdapter(name=f"the training job ({type(self).__name__})", data_parallel=everyone, shape=shape,
                              model=self.model, collate_fn=collate_fn, loader_dataset=loader_dataset,
                              probe_losses=lambda batch: probe_losses(self.model_wrapped, batch))

    def cluster_plan_dataset(self) -> Any:
        """What the plan is of: the samples fingerprinted and, for a missing analysis, the features' input.

        `train_dataset` itself (items of same-width `input_ids`, `attention_mask`, `labels`). A subclass whose
        rows are other items (ClusterSFTTrainer: TRL's variable-length rows) returns a same-length view of them;
        the loader still reads `train_dataset`.
        """
        return self.train_dataset

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        if not self.cluster_config.enabled:
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset.")
        dataset = self.train_dataset
        if is_datasets_available() and isinstance(dataset, __import__("datasets").Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
            user_collate = self.data_collator
        else:
            # Trainer's column filter knows nothing of sample_index/sample_weight: apply it to the
            # user's fields only, inside the collate that adds the two back.
            user_collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        if _is_trainers_default_collator(self.data_collator):
            # Trainer's own collators pad to the widest item, the full max_length of pre-padded items: cut
            # each micro-batch to its longest attended row instead (a user's own collator is left as it is).
            user_collate = _TrimmedCollate(user_collate)
        plan = self.build_cluster_plan(collate_fn=user_collate, loader_dataset=dataset)
        assert self.cluster_loader is not None
        if self._resume_checkpoint is not None:
            self._check_sampler_state(self._resume_checkpoint, plan)
        return PlanDataLoader(self.cluster_loader.dataset, batch_sampler=PlanBatchSampler(self.cluster_loader),
                              collate_fn=self.cluster_loader.collate_fn,
                              num_workers=self.args.dataloader_num_workers,
                              pin_memory=self.args.dataloader_pin_memory)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if SAMPLE_WEIGHT not in inputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # Labels stay out of the forward: the model would compute an unweighted loss we do not use.
        model_inputs = {k: v for k, v in inputs.items()
                        if k not in (SAMPLE_INDEX, SAMPLE_WEIGHT, LOSS_NORMALIZER, "labels")}
        outputs = model(**model_inputs)
        loss = weighted_causal_lm_loss(outputs, inputs)
        if model.training and self.cluster_loader is not None:
            self.cluster_loader.record_losses(*getattr(loss, SAMPLE_LOSSES))  # what the adaptive schedule reads
        return (loss, outputs) if return_outputs else loss

    # ----------------------------------------------------------- checkpoints
    def _save_rng_state(self, output_dir: str) -> None:
        # Under DeepSpeed on a CPU, Accelerate counts one process, so Trainer has every rank write the same
        # rng_state.pth at once: with states that differ between ranks the file can come out corrupt, and the resume
        # then fails reading it. The first rank writes it alone (every rank reads it back on resume, as before).
        if self.args.world_size <= 1 and distributed.get_world_size() > 1 and distributed.get_rank() != 0:
            return
        super()._save_rng_state(output_dir)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._resume_checkpoint = resume_from_checkpoint or None
        try:
            return super().train(resume_from_checkpoint or None, *args, **kwargs)
        finally:
            self._resume_checkpoint = None

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.cluster_loader is None:
            return
        # The position from the optimizer step, not from what the loader has read ahead (workers prefetch);
        # collective for the adaptive schedule.
        state = self.cluster_loader.state_dict(self.state.global_step)
        if distributed.get_rank() != 0:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        write_json_atomic(folder / SAMPLER_STATE_FILE, state)

    def _check_sampler_state(self, checkpoint: str, plan: Plan) -> None:
        """Collective: the checkpoint was trained on this plan and stopped where Trainer will resume."""
        assert self.cluster_loader is not None and self.cluster_setup is not None
        state_path = Path(checkpoint) / SAMPLER_STATE_FILE

        def read() -> Optional[tuple[dict, int]]:
            if not state_path.exists():
                return None
            global_step = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json")).global_step
            return json.loads(state_path.read_text()), global_step

        everyone = self.cluster_setup.everyone
        found = everyone.run_agreed("reading the cluster sampler state", read, errors=(ValueError, OSError))
        everyone.check_agreement(found is None, f"whether {state_path} exists")
        if found is None:
            logger.warning("%s holds no %s: resuming without checking the plan", checkpoint, SAMPLER_STATE_FILE)
        else:
            self.cluster_setup.restore_sampler(self.cluster_loader, found[0], found[1], where=str(state_path))
        # Trainer skips the resumed epoch's first micro-batches itself.
        self.cluster_loader.trainer_resumes()
        # It skips them through a plain DataLoader of its own (Accelerate's skip_first_batches) whose iteration
        # bypasses PlanDataLoader's: the resumed epoch's weights and loss normalisers are set now, before its
        # worker processes copy the dataset (with dataloader_num_workers > 0 they would train without them).
        self.cluster_loader.prepare_iteration()


def check_data_parallel_is_the_world(args: Any) -> None:
    """ValueError when the Trainer is asked for model, context or sequence parallelism: the cluster plan would
    be dealt over every rank, while only the data-parallel ranks take different batches."""
    parallelism = getattr(args, "parallelism_config", None)
    others = int(getattr(parallelism, "non_data_parallel_size", 1) or 1) if parallelism is not None else 1
    ds_config = args.hf_deepspeed_config.config if getattr(args, "deepspeed", None) else {}
    sequence_parallel = ds_config.get("sequence_parallel_size", 1)
    sequence_parallel = sequence_parallel if isinstance(sequence_parallel, int) else 1
    if others > 1 or sequence_parallel > 1:
        raise ValueError(
            "cluster_sampling with the Hugging Face Trainer (ClusterTrainer, ClusterSFTTrainer) deals the plan over "
            f"every rank, so every rank must be a data-parallel rank; this run asks for {others * sequence_parallel} "
            "ranks of model, context or sequence parallelism per data-parallel rank (parallelism_config or the "
            "DeepSpeed config's sequence_parallel_size). Train without them, or use the DeepSpeed hook "
            "(ds_cluster.install()) with "
            "an mpu that gives the data-parallel group")


class ClusterTrainer(ClusterSamplingMixin, Trainer):
    """A `transformers.Trainer` whose training batches and loss come from the cluster plan.

    See `ClusterSamplingMixin` for what it adds; without an enabled block it is a plain Trainer.
    """


def _is_trainers_default_collator(collator: Any) -> bool:
    """Whether `collator` is one Trainer picks when the user gives none (`default_data_collator`, or padding
    with the tokenizer)."""
    from transformers.data.data_collator import DataCollatorWithPadding, default_data_collator

    return collator is default_data_collator or isinstance(collator, DataCollatorWithPadding)


class _TrimmedCollate:
    """A collate function followed by `trim_padding` (a class, not a closure: DataLoader workers pickle it)."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, items: list) -> Any:
        batch = self.collate(items)
        return trim_padding(batch) if isinstance(batch, dict) else batch


def _without_auto(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a DeepSpeed config without the "auto" values Trainer has not filled in yet (DeepSpeed's defaults)."""
    return {key: (_without_auto(value) if isinstance(value, Mapping) else value)
            for key, value in config.items() if value != "auto"}
