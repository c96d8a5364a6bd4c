"""LLaMA-Factory integration: its SFT training, run on the cluster plan with the weighted loss.

    python -m ds_cluster.integrations.llamafactory cfg.yaml                       # one process
    torchrun --nproc_per_node 2 -m ds_cluster.integrations.llamafactory cfg.yaml  # several ranks (DeepSpeed)

in place of `llamafactory-cli train cfg.yaml` (key=value overrides after the
YAML work as there). LLaMA-Factory has no plugins on its training path and its
own launcher starts a fresh interpreter under torchrun, so this module is the
program torchrun starts: it reads the YAML, takes the block out, checks it,
puts `ClusterSeq2SeqTrainer` (`ClusterSamplingMixin` before LLaMA-Factory's
`CustomSeq2SeqTrainer`) where the SFT workflow reads its trainer class, and
runs LLaMA-Factory's `run_exp` (docs/llamafactory.md).

The block is the DeepSpeed JSON's (`deepspeed:`) or a top-level
`cluster_sampling:` key, taken out before LLaMA-Factory's parser (which refuses
keys it does not know) reads the YAML. LLaMA-Factory's parsed arguments are
checked before the model loads: stages other than SFT, packing, disabled
shuffling, streaming and the losses that replace the weighted loss are refused
by name. The workflow is checked to still read its trainer class from the
place the class is put, and any Hugging Face Trainer that is not ds_cluster's
stops before its first step: the run never trains plainly by mistake. This is
the only module that imports LLaMA-Factory.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

from llamafactory.hparams import get_ray_args, get_train_args, read_args
from llamafactory.train import tuner
from llamafactory.train.sft import workflow
from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
from transformers import Trainer

from ds_cluster.integrations.frontends import (BLOCK_KEY, FrontendBlock, FrontendRowsMixin, Refusal, bind_block,
                                               check_batch_size_not_auto_on_cpu, check_refusals, deepspeed_on_cpu,
                                               frontend_block, launched_world_size, require_cluster_trainer)
from ds_cluster.integrations.hf import ClusterSamplingMixin

logger = logging.getLogger(__name__)

FRONTEND = "LLaMA-Factory"
# The module global of llamafactory.train.sft.workflow that run_sft builds its trainer from (0.9.5).
TRAINER_NAME = "CustomSeq2SeqTrainer"

_PICKS = "while the plan picks, weights and orders single records"
_LOSS = "it replaces the loss, while cluster sampling trains on its per-record weighted token loss"
_ANOTHER_TRAINER = "it trains through another workflow, whose trainer ds_cluster does not replace"


def _on(value: Any) -> bool:
    return bool(value)


# LLaMA-Factory's parsed arguments that would take over the sampler, the batches or the loss from the plan.
LLAMAFACTORY_REFUSALS = (
    Refusal("stage", "ds_cluster trains LLaMA-Factory's SFT workflow; the other stages (pt, rm, ppo, dpo, kto) have "
            "losses and trainers of their own", "stage: sft", lambda stage: stage != "sft"),
    Refusal("packing", f"packing joins several records into one row, {_PICKS} (packing that respects the plan is not "
            "there yet)", "packing: false", _on),
    Refusal("neat_packing", f"packing joins several records into one row, {_PICKS}", "neat_packing: false", _on),
    Refusal("disable_shuffling", f"it asks for the dataset's own order (a sequential sampler), {_PICKS}",
            "disable_shuffling: false", _on),
    Refusal("streaming", "a streamed dataset is iterable, while the plan picks records by index", "streaming: false",
            _on),
    Refusal("use_dft_loss", _LOSS, "use_dft_loss: false", _on),
    Refusal("use_eaft_loss", _LOSS, "use_eaft_loss: false", _on),
    Refusal("use_asft_loss", _LOSS, "use_asft_loss: false", _on),
    Refusal("label_smoothing_factor", "the weighted loss has no label smoothing", "label_smoothing_factor: 0", _on),
    Refusal("use_mca", _ANOTHER_TRAINER, "use_mca: false", _on),
    Refusal("use_hyper_parallel", _ANOTHER_TRAINER, "use_hyper_parallel: false", _on),
    Refusal("use_kt", _ANOTHER_TRAINER, "use_kt: false", _on),
    Refusal("use_ray", _ANOTHER_TRAINER, "no USE_RAY=1 in the environment", _on),
)


class ClusterSeq2SeqTrainer(FrontendRowsMixin, ClusterSamplingMixin, CustomSeq2SeqTrainer):
    """LLaMA-Factory's `CustomSeq2SeqTrainer` training on the cluster plan with the weighted loss."""

    frontend = FRONTEND


def parsed_options(args: Mapping[str, Any]) -> dict[str, Any]:
    """LLaMA-Factory's own reading of the YAML (its defaults filled in, its checks run), as one flat dict."""
    parsed = (*get_train_args(dict(args)), get_ray_args(dict(args)))
    options: dict[str, Any] = {}
    for group in parsed:
        options.update(vars(group))
    return options


def check_llamafactory_args(args: Mapping[str, Any], top_level: Optional[Mapping[str, Any]]) -> FrontendBlock:
    """The run's block, checked with LLaMA-Factory's parsed arguments: ValueError for a missing, doubled or invalid
    block, an option that would override the plan, or `train_batch_size: "auto"` under DeepSpeed on CPU with several
    ranks."""
    block = frontend_block(top_level, args.get("deepspeed"), FRONTEND)
    if block.config.enabled:
        check_refusals(parsed_options(args), LLAMAFACTORY_REFUSALS, FRONTEND)
        check_batch_size_not_auto_on_cpu(block.ds_config, launched_world_size(), deepspeed_on_cpu(), FRONTEND)
    return block


def patch_sft_workflow(trainer_class: type) -> None:
    """Put `trainer_class` where LLaMA-Factory's SFT workflow reads its trainer class, or a RuntimeError when the
    workflow reads it from elsewhere now (a LLaMA-Factory other than the tested 0.9.5)."""
    run_sft = workflow.run_sft
    reads_global = TRAINER_NAME in getattr(getattr(run_sft, "__code__", None), "co_names", ())
    current = getattr(workflow, TRAINER_NAME, None)
    if not reads_global or not (isinstance(current, type) and issubclass(current, Trainer)):
        raise RuntimeError(f"{FRONTEND}: the SFT workflow ({workflow.__name__}.run_sft) no longer builds its trainer "
                           f"from {workflow.__name__}.{TRAINER_NAME}, where ds_cluster puts its trainer (tested with "
                           "llamafactory 0.9.5); stopping rather than training without the cluster plan")
    if tuner.run_sft is not run_sft:
        raise RuntimeError(f"{FRONTEND}: llamafactory.train.tuner runs another SFT workflow than {workflow.__name__}"
                           ".run_sft (tested with llamafactory 0.9.5); stopping rather than training without the "
                           "cluster plan")
    setattr(workflow, TRAINER_NAME, trainer_class)


def guard_plain_training() -> None:
    """Make any Hugging Face Trainer that is not ds_cluster's stop before it trains, in this process."""
    if getattr(Trainer.train, "_ds_cluster_guard", False):
        return
    plain_train: Callable = Trainer.train

    @functools.wraps(plain_train)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        require_cluster_trainer(self, FRONTEND, f"LLaMA-Factory built its trainer without reading {workflow.__name__}"
                                f".{TRAINER_NAME}, where ds_cluster put its own")
        return plain_train(self, *args, **kwargs)

    train._ds_cluster_guard = True  # type: ignore[attr-defined]
    Trainer.train = train  # type: ignore[method-assign]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Read the YAML (and key=value overrides) as LLaMA-Factory does, take the block out, check, patch, train."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = read_args(None)
    if not isinstance(args, dict):
        raise SystemExit("usage: python -m ds_cluster.integrations.llamafactory cfg.yaml [key=value ...] (or under "
                         "torchrun -m); the YAML is LLaMA-Factory's, with the cluster_sampling block in its DeepSpeed "
                         "JSON or as a top-level key")
    top_level = args.pop(BLOCK_KEY, None)
    block = check_llamafactory_args(args, top_level)
    patch_sft_workflow(bind_block(ClusterSeq2SeqTrainer, top_level if block.top_level else None))
    if block.config.enabled:
        guard_plain_training()
    tuner.run_exp(args)


if __name__ == "__main__":
    main()
