"""A plan from features and/or labels in one call, as the tests build them: the clustering stage, then the plan."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ds_cluster.batching import BatchShape
from ds_cluster.clustering.samples import PlanInputs, cluster_samples
from ds_cluster.planning.plan import Plan, build_plan
from ds_cluster.settings import stages_of


def plan_of(features: Optional[np.ndarray], config: Any, *, world_size: int, micro_batch_size: int,
            gradient_accumulation_steps: int, labels: Optional[np.ndarray] = None,
            exclude: Optional[np.ndarray] = None, distances: Optional[np.ndarray] = None,
            centroids: Optional[np.ndarray] = None) -> Plan:
    """`cluster_samples` of these inputs with the config's clustering settings, then `build_plan`."""
    stages = stages_of(config)
    shape = BatchShape(world_size, micro_batch_size, gradient_accumulation_steps)  # checked first
    inputs = PlanInputs(features, labels, exclude, distances, centroids)
    return build_plan(cluster_samples(inputs, stages.clustering, world_size), stages, shape)


def plan_of_inputs(inputs: PlanInputs, config: Any, *, world_size: int, micro_batch_size: int,
                   gradient_accumulation_steps: int) -> Plan:
    """The plan of an analysis's inputs (`AnalysisDir.load_inputs`), as the set-up builds it."""
    stages = stages_of(config)
    shape = BatchShape(world_size, micro_batch_size, gradient_accumulation_steps)
    return build_plan(cluster_samples(inputs, stages.clustering, world_size), stages, shape)
