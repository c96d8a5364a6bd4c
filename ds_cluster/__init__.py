"""ds_cluster: CluSTER cluster-balanced sampling for DeepSpeed fine-tuning.

The public names are loaded lazily so that `import ds_cluster` stays cheap
(no torch, DeepSpeed, TRL or matplotlib import until a name that needs them is used).
The package is laid out in the pipeline's order (docs/design.md): data, features,
clustering, analysis, planning, loader, report, integrations, cli.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.7.0"

_PUBLIC = {
    "ClusterSamplingConfig": "ds_cluster.config",
    "Plan": "ds_cluster.planning.plan",
    "build_plan": "ds_cluster.planning.plan",
    "cluster_samples": "ds_cluster.clustering.samples",
    "PlanInputs": "ds_cluster.clustering.samples",
    "BatchShape": "ds_cluster.batching",
    "cluster_loader": "ds_cluster.loader.sampler",
    "LateLRSchedule": "ds_cluster.loader.lr_schedules",
    "weighted_lm_loss": "ds_cluster.loader.loss",
    "weighted_causal_lm_loss": "ds_cluster.loader.loss",
    "install": "ds_cluster.integrations.deepspeed",
    "uninstall": "ds_cluster.integrations.deepspeed",
    "initialize": "ds_cluster.integrations.deepspeed",
    "extract_features": "ds_cluster.features.extract",
    "analyze": "ds_cluster.analysis.compute",
    "AnalysisDir": "ds_cluster.analysis.folder",
    "ClusterTrainer": "ds_cluster.integrations.hf",
    "ClusterSFTTrainer": "ds_cluster.integrations.trl",
    "ClusterSetup": "ds_cluster.integrations.setup",
    "InstructionDataset": "ds_cluster.data.dataset",
    "load_instruction_dataset": "ds_cluster.data.dataset",
    "trim_padding_collate": "ds_cluster.data.dataset",
    "load_model_and_tokenizer": "ds_cluster.data.models",
    "evaluate_model": "ds_cluster.evaluate",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ds_cluster' has no attribute {name!r}")
