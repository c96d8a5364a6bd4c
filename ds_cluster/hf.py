"""`from ds_cluster.hf import ClusterTrainer`: the Hugging Face Trainer integration (ds_cluster.integrations.hf)."""
from ds_cluster.integrations.hf import ClusterTrainer, PlanBatchSampler, PlanDataLoader, SAMPLER_STATE_FILE

__all__ = ["ClusterTrainer", "PlanBatchSampler", "PlanDataLoader", "SAMPLER_STATE_FILE"]
