"""ds_cluster: CluSTER cluster-balanced sampling for DeepSpeed fine-tuning.

The public names are loaded lazily so that `import ds_cluster` stays cheap
(no torch or DeepSpeed import until a name that needs them is used).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_PUBLIC = {
    "ClusterSamplingConfig": "ds_cluster.config",
    "Plan": "ds_cluster.plan",
    "build_plan": "ds_cluster.plan",
    "weighted_lm_loss": "ds_cluster.loss",
    "weighted_causal_lm_loss": "ds_cluster.loss",
    "install": "ds_cluster.integrations.deepspeed",
    "uninstall": "ds_cluster.integrations.deepspeed",
    "initialize": "ds_cluster.integrations.deepspeed",
    "extract_features": "ds_cluster.features.extract",
    "analyze": "ds_cluster.analysis",
    "AnalysisDir": "ds_cluster.analysis_dir",
    "ClusterTrainer": "ds_cluster.integrations.hf",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ds_cluster' has no attribute {name!r}")
