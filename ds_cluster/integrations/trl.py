"""TRL integration: `ClusterSFTTrainer` is `trl.SFTTrainer` training on the cluster plan with the weighted loss.

    from ds_cluster.integrations.trl import ClusterSFTTrainer
    args = SFTConfig(output_dir="runs/sft", deepspeed="ds_configs/zero3.json", bf16=False, ...)
    trainer = ClusterSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

It is `ClusterSamplingMixin` (docs/trainer.md) put before `SFTTrainer`: the
same plan, weights, `loss_reduction`, sampler state in every checkpoint and
resume as ClusterTrainer. What SFTTrainer needs besides (docs/trl.md):

- SFTTrainer tokenizes the dataset in `__init__` into rows of variable-length
  `input_ids` and `labels` (-100 off the completion when
  `completion_only_loss`, off the non-assistant turns when
  `assistant_only_loss`); its collator pads each batch. The plan's checks and
  an analysis computed in the job stack whole items, so they read
  `PaddedRowsView`, the same rows padded to one width; the training loader
  reads the rows themselves through SFTTrainer's collator.
- Options that change what a sample is (`packing`, `padding_free`), or a loss
  other than the token negative log-likelihood the weighted loss is
  (`loss_type="dft"`, `label_smoothing_factor`, `compute_loss_func`, a MoE
  router loss), are refused with an error naming the option, before any
  tokenization.
- The weighted loss needs the logits, so it does not use SFTTrainer's fused
  LM head; the `entropy`, `mean_token_accuracy` and `num_tokens` it logs are
  computed here from those logits instead.

Without an enabled `cluster_sampling` block it is a plain SFTTrainer.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping, Optional, Union

import datasets
import torch

try:
    from trl import SFTTrainer
except ImportError as err:  # an extra: a training job through the hook or ClusterTrainer does not need TRL
    raise ImportError("ClusterSFTTrainer needs TRL (trl>=1.16,<2), which is not installed: "
                      "pip install 'ds_cluster[trl]'") from err

from ds_cluster import distributed
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.data.dataset import IGNORE_INDEX, source_path
from ds_cluster.integrations.hf import ClusterSamplingMixin, resolve_cluster_config
# PaddedRowsView and ROW_COLUMNS lived here until 0.6.0; they are shared with the frontends' integrations now.
from ds_cluster.integrations.rows import ROW_COLUMNS, PaddedRowsView, RowsPlanMixin, missing_row_columns  # noqa: F401
from ds_cluster.loader.items import SAMPLE_WEIGHT

logger = logging.getLogger(__name__)

# Positions whose vocabulary distribution is formed at once for the entropy metric (bounds its extra memory).
METRIC_CHUNK_POSITIONS = 1024
def check_sft_options(args: Any, train_dataset: Any, compute_loss_func: Any) -> None:
    """Before SFTTrainer tokenizes anything: a ValueError naming any option cluster sampling cannot follow.

    `packing` joins several records into one row and `padding_free` one
    micro-batch into one sequence: a plan sample, its weight and its loss
    would no longer be one record. The weighted loss is the token negative
    log-likelihood, so another loss cannot be honoured silently.
    """
    if getattr(args, "packing", False):
        raise ValueError("cluster_sampling and SFTConfig.packing=True cannot be combined: packing joins several "
                         "records into one row, while the plan picks, weights and balances single records. Set "
                         "packing=False (or disable cluster_sampling)")
    if getattr(args, "padding_free", False):
        raise ValueError("cluster_sampling and SFTConfig.padding_free=True cannot be combined: padding-free training "
                         "flattens a micro-batch into one sequence, while the weighted loss needs one row per record. "
                         "Set padding_free=False (or disable cluster_sampling)")
    if getattr(args, "loss_type", "nll") != "nll":
        raise ValueError(f"cluster_sampling trains on its weighted token negative log-likelihood, so "
                         f"SFTConfig.loss_type={args.loss_type!r} would be ignored: use loss_type='nll' (or disable "
                         "cluster_sampling)")
    if getattr(args, "label_smoothing_factor", 0.0):
        raise ValueError("cluster_sampling's weighted loss has no label smoothing: set label_smoothing_factor=0 (or "
                         "disable cluster_sampling)")
    if compute_loss_func is not None:
        raise ValueError("cluster_sampling computes the loss itself (weighted per sample), so compute_loss_func would "
                         "be ignored: drop it (or disable cluster_sampling)")
    if isinstance(train_dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ValueError("cluster_sampling picks records by index, so train_dataset must be a map-style "
                         "datasets.Dataset, not an IterableDataset (streaming): materialise it first (or disable "
                         "cluster_sampling)")


class ClusterSFTTrainer(RowsPlanMixin, ClusterSamplingMixin, SFTTrainer):
    """A `trl.SFTTrainer` whose training batches and loss come from the cluster plan.

    Takes SFTTrainer's arguments, plus `cluster_config` (a ClusterSamplingConfig
    or a `cluster_sampling` dict) instead of the block in `args.deepspeed`.
    The dataset is a map-style `datasets.Dataset` in any form SFTTrainer
    tokenizes (text, prompt-completion, messages) or already tokenized with
    `input_ids` (and `labels`). Without an enabled block it is a plain SFTTrainer.
    """

    def __init__(self, *args: Any, cluster_config: Union[None, ClusterSamplingConfig, Mapping[str, Any]] = None,
                 **kwargs: Any):
        given = inspect.signature(SFTTrainer.__init__).bind(self, *args, **kwargs).arguments
        config = resolve_cluster_config(cluster_config, getattr(given.get("args"), "deepspeed", None))
        if config.enabled:
            check_sft_options(given.get("args"), given.get("train_dataset"), given.get("compute_loss_func"))
        # The user's records before SFTTrainer tokenizes them: what a report of the analysis reads.
        self._records_path = source_path(given.get("train_dataset")) if config.enabled else None
        super().__init__(*args, cluster_config=config, **kwargs)
        if config.enabled:
            self._check_prepared_rows()

    def _check_prepared_rows(self) -> None:
        """After SFTTrainer's preparation: token rows with labels, and a loss this trainer can weight."""
        columns = getattr(self.train_dataset, "column_names", None) or []
        if missing_row_columns(self.train_dataset):
            raise ValueError(
                f"cluster_sampling needs SFTTrainer's tokenized rows (columns {list(ROW_COLUMNS)}), but the prepared "
                f"train_dataset has columns {columns}: vision datasets (tokenized in the collator) are not "
                "supported, and with dataset_kwargs={'skip_prepare_dataset': True} the dataset must already hold "
                "input_ids and labels (-100 on tokens without loss)")
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError("cluster_sampling's weighted loss does not add a Mixture-of-Experts router loss: set "
                             "SFTConfig.router_aux_loss_coef=0.0 to train without it (or disable cluster_sampling)")

    # ------------------------------------------------------------------ plan
    def rows_source(self) -> Optional[str]:
        """The user's records file before SFTTrainer tokenized them (one row per record, in order)."""
        return self._records_path

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if SAMPLE_WEIGHT not in inputs:
            # Evaluation, or cluster sampling off: SFTTrainer's own loss and metrics.
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # As SFTTrainer does: no KV cache in training (gradient checkpointing would warn about it).
        loss, outputs = super().compute_loss(model, {**inputs, "use_cache": False}, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        self._record_token_metrics(outputs.logits, inputs)
        return (loss, outputs) if return_outputs else loss

    @torch.no_grad()
    def _record_token_metrics(self, logits: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> None:
        """SFTTrainer's training metrics (entropy, mean_token_accuracy, num_tokens) from the weighted path's logits.

        Over the labelled positions of every rank, as SFTTrainer computes them
        from its fused head; the vocabulary distributions are formed
        METRIC_CHUNK_POSITIONS at a time. Summed with one all-reduce of the
        process group, not Accelerate's gather: Accelerate counts one process
        for DeepSpeed on CPU, and its gather then fails.
        """
        metrics = getattr(self, "_metrics", None)
        if metrics is None:  # a TRL without SFTTrainer's metric store: nothing to add to
            return
        targets = inputs["labels"][:, 1:]
        positions = (targets != IGNORE_INDEX).nonzero()
        # labelled positions, entropy sum, correct top-1 predictions, attended tokens
        totals = torch.zeros(4, dtype=torch.float64, device=logits.device)
        totals[0] = positions.shape[0]
        for chunk in positions.split(METRIC_CHUNK_POSITIONS):
            # Position t predicts token t+1: the logits at t, the label at t+1.
            chunk_logits = logits[chunk[:, 0], chunk[:, 1]].float()
            log_probs = torch.log_softmax(chunk_logits, dim=-1)
            totals[1] += -(log_probs.exp() * log_probs).sum().double()
            totals[2] += (chunk_logits.argmax(dim=-1) == targets[chunk[:, 0], chunk[:, 1]]).sum().double()
        if "attention_mask" in inputs:
            totals[3] = inputs["attention_mask"].sum().double()
        if distributed.get_world_size() > 1:
            torch.distributed.all_reduce(totals)
        num_valid, entropy_sum, num_correct, tokens = totals.tolist()
        # Weighted batches come from the training loader only.
        metrics["train"]["entropy"].append(entropy_sum / num_valid if num_valid > 0 else 0.0)
        metrics["train"]["mean_token_accuracy"].append(num_correct / num_valid if num_valid > 0 else 0.0)
        self._total_train_tokens = getattr(self, "_total_train_tokens", 0) + int(tokens) // getattr(self, "_tp_size", 1)
        metrics["train"]["num_tokens"] = [self._total_train_tokens]
