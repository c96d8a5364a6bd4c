"""axolotl integration: `ClusterSamplingPlugin` trains an `axolotl train` run on the cluster plan, weighted.

    plugins:
      - ds_cluster.integrations.axolotl.ClusterSamplingPlugin
    deepspeed: ds_zero3.json     # holding the cluster_sampling block, or instead a top-level key:
    cluster_sampling: {enabled: true, preset: recommended, budget_ratio: 0.3, analysis_path: runs/analysis}

The plugin gives axolotl its trainer class (`get_trainer_cls`):
`ClusterSamplingMixin` before `AxolotlTrainer`, with the plan over axolotl's
tokenized rows (docs/axolotl.md). Every rank trains exactly its part of each
global batch of the plan, with the plan's per-sample weights, the per-cluster
figures in axolotl's logs, the sampler state in axolotl's checkpoints and an
analysis computed in the job when `analysis_path` holds none yet.

The block is read and checked when axolotl registers the plugin, before the
config is validated, and again with the validated config before the datasets
and the model load; the options that would override the plan are refused by
name there. Once the trainer exists the plugin checks it is ds_cluster's:
another plugin listed before it may have given axolotl its own trainer class.
This is the only module that imports axolotl.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from axolotl.core.trainers.base import AxolotlTrainer
from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel

from ds_cluster.integrations.frontends import (BLOCK_KEY, FrontendBlock, FrontendRowsMixin, Refusal, bind_block,
                                               check_batch_size_not_auto_on_cpu, check_refusals, deepspeed_on_cpu,
                                               frontend_block, launched_world_size, require_cluster_trainer)
from ds_cluster.integrations.hf import ClusterSamplingMixin

logger = logging.getLogger(__name__)

FRONTEND = "axolotl"


def _set(value: Any) -> bool:
    """An option is on: set to anything but off (`auto` is axolotl's to resolve; the validated config says)."""
    return value not in (None, False, 0, "", "auto", "false", "False")


def _above_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 1


_PICKS = "while the plan picks, weights and orders single records"
_SFT = "supervised fine-tuning with the weighted token loss (no `rl:`)"
_LOSS = ("the weighted loss is computed from the logits by ds_cluster, per record, so another cross-entropy "
         "would be ignored or leave no logits")
# The axolotl options that would take over the sampler, the batches or the loss from the plan.
AXOLOTL_REFUSALS = (
    Refusal("sample_packing", f"packing joins several records into one row and sets the batches itself "
            f"(MultipackBatchSampler), {_PICKS} (packing that respects the plan is not there yet)",
            "sample_packing: false", _set),
    Refusal("batch_flattening", f"flattening joins a micro-batch into one sequence, {_PICKS} and the weighted loss "
            "needs one row per record", "batch_flattening: false", _set),
    Refusal("curriculum_sampling", f"it trains the records in the dataset's order (a sequential sampler), {_PICKS}",
            "curriculum_sampling: false", _set),
    Refusal("group_by_length", f"it batches records of similar length together (a sampler of its own), {_PICKS}",
            "group_by_length: false", _set),
    Refusal("balance_labels", f"label balancing draws the records by label (a sampler of its own), {_PICKS}",
            "balance_labels: false", _set),
    Refusal("rl", f"a preference or RL trainer (DPO, KTO, ORPO, GRPO...) has a loss of its own; ds_cluster needs "
            f"{_SFT}", "no `rl:`", _set),
    Refusal("reward_model", f"a reward model trains another loss; ds_cluster needs {_SFT}", "reward_model: false",
            _set),
    Refusal("process_reward_model", f"a process reward model trains another loss; ds_cluster needs {_SFT}",
            "process_reward_model: false", _set),
    Refusal("orpo_alpha", "ORPO adds an odds-ratio term to the loss, which the weighted loss does not have",
            "no orpo_alpha", _set),
    Refusal("use_eaft", "EAFT replaces the loss (compute_loss_func), which the weighted loss would ignore",
            "use_eaft: false", _set),
    Refusal("cut_cross_entropy", _LOSS, "cut_cross_entropy: false", _set),
    Refusal("chunked_cross_entropy", _LOSS, "chunked_cross_entropy: false", _set),
    Refusal("liger_cross_entropy", _LOSS, "liger_cross_entropy: false", _set),
    Refusal("liger_fused_linear_cross_entropy", _LOSS, "liger_fused_linear_cross_entropy: false", _set),
    Refusal("pretraining_dataset", "it streams the data (an iterable dataset), while the plan picks records by "
            "index", "`datasets:` instead", _set),
    Refusal("streaming", "a streamed dataset is iterable, while the plan picks records by index", "streaming: false",
            _set),
    Refusal("auto_find_batch_size", "it changes the micro batch during the run, while the plan is made for one batch "
            "shape", "auto_find_batch_size: false", _set),
    Refusal("trainer_cls", "ds_cluster's plugin gives axolotl the trainer class, so this one would be ignored",
            "no trainer_cls (put ClusterSamplingMixin before your class in a plugin of your own instead)", _set),
    Refusal("sequence_parallel_degree", "the plan deals batches over every rank, so every rank must be a "
            "data-parallel rank", "sequence_parallel_degree: 1", _above_one),
    Refusal("context_parallel_size", "the plan deals batches over every rank, so every rank must be a data-parallel "
            "rank", "context_parallel_size: 1", _above_one),
    Refusal("tensor_parallel_size", "the plan deals batches over every rank, so every rank must be a data-parallel "
            "rank", "tensor_parallel_size: 1", _above_one),
)


class ClusterSamplingArgs(BaseModel):
    """The YAML's top-level `cluster_sampling:` key (axolotl merges a plugin's input arguments into its config);
    checked by the plugin as the same block as the DeepSpeed JSON's."""

    cluster_sampling: Optional[dict[str, Any]] = None


class ClusterAxolotlTrainer(FrontendRowsMixin, ClusterSamplingMixin, AxolotlTrainer):
    """`AxolotlTrainer` training on the cluster plan with the weighted loss (what the plugin gives axolotl)."""

    frontend = FRONTEND


def check_axolotl_config(cfg: Any) -> FrontendBlock:
    """The run's block, checked: ValueError for a missing, doubled or invalid block, an option that would override
    the plan, or `train_batch_size: "auto"` under DeepSpeed on CPU with several ranks."""
    block = frontend_block(cfg.get(BLOCK_KEY), cfg.get("deepspeed"), FRONTEND)
    if block.config.enabled:
        check_refusals(cfg, AXOLOTL_REFUSALS, FRONTEND)
        check_batch_size_not_auto_on_cpu(block.ds_config, launched_world_size(), deepspeed_on_cpu(), FRONTEND)
    return block


class ClusterSamplingPlugin(BasePlugin):
    """axolotl plugin: `plugins: [ds_cluster.integrations.axolotl.ClusterSamplingPlugin]`."""

    def get_input_args(self) -> str:
        return f"{__name__}.{ClusterSamplingArgs.__name__}"

    def register(self, cfg: Any) -> None:
        # The YAML as written, before axolotl validates it: the earliest point.
        check_axolotl_config(cfg)

    def load_datasets(self, cfg: Any, preprocess: bool = False) -> None:
        # The validated config (axolotl's "auto" values resolved), before the datasets are tokenized.
        check_axolotl_config(cfg)
        return None  # axolotl loads the datasets itself

    def pre_model_load(self, cfg: Any) -> None:
        check_axolotl_config(cfg)

    def get_trainer_cls(self, cfg: Any) -> type:
        block = check_axolotl_config(cfg)
        return bind_block(ClusterAxolotlTrainer, cfg.get(BLOCK_KEY) if block.top_level else None)

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        if check_axolotl_config(cfg).config.enabled:
            require_cluster_trainer(trainer, FRONTEND, "a plugin listed before ds_cluster's gave axolotl its trainer "
                                    "class: list ds_cluster's first, or drop the other")
            logger.info("ds_cluster: axolotl trains with %s on the cluster plan", type(trainer).__name__)
