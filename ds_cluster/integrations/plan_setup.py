"""The plan set-up both integrations share: check the data, read the analysis, build the plan, agree on it.

Every rank builds the same plan from the same inputs and the ranks compare
fingerprints; a failure on any rank becomes an error on all of them (never a
rank left waiting in a collective).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from ds_cluster import distributed
from ds_cluster.analysis_dir import AnalysisDir, PlanInputs
from ds_cluster.batching import BatchShape
from ds_cluster.config import ClusterSamplingConfig
from ds_cluster.dataset import dataset_fingerprint
from ds_cluster.plan import Plan, build_plan

logger = logging.getLogger(__name__)


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
