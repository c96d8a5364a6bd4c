"""The loader over a Plan (no process group): order, batch fields, exact resume from a state."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_cluster import ClusterSamplingConfig
from tests.planning import plan_of
from ds_cluster.loader.loss import per_sample_lm_loss, weighted_lm_loss
from ds_cluster.loader.sampler import ClusterDataLoader


def make_plan(world: int = 2, micro: int = 2, gas: int = 2):
    labels = np.repeat(np.arange(3), [30, 12, 6])
    cfg = ClusterSamplingConfig(enabled=True, budget_mode="proportional", budget_ratio=0.75, selection="random",
                                weighting="cluster", loss_reduction="sample", seed=9)
    return plan_of(None, cfg, world_size=world, micro_batch_size=micro, gradient_accumulation_steps=gas,
                      labels=labels)


def dict_dataset(n: int = 48):
    return [{"x": torch.tensor([float(i)]), "labels": torch.tensor([i])} for i in range(n)]


def test_loader_gives_this_ranks_plan_indices_with_weights():
    plan = make_plan()
    loader = ClusterDataLoader(dict_dataset(), plan, rank=1)
    batches = list(loader)
    assert len(batches) == len(loader) == plan.steps_per_epoch * plan.gradient_accumulation_steps
    expected = plan.epoch_layout(0)[:, 1].reshape(-1, plan.micro_batch_size)
    for batch, indices in zip(batches, expected):
        assert batch["sample_index"].dtype == torch.int64 and batch["sample_weight"].dtype == torch.float32
        assert batch["sample_index"].tolist() == indices.tolist()
        assert batch["x"].squeeze(1).long().tolist() == indices.tolist()  # the user's fields are untouched
        assert np.allclose(batch["sample_weight"].numpy(), plan.weights[indices])
    assert loader.completed_epochs == 1
    second = [b["sample_index"].tolist() for b in loader]
    assert second == plan.epoch_layout(1)[:, 1].reshape(-1, plan.micro_batch_size).tolist()


def test_tuple_items_get_index_and_weight_appended():
    plan = make_plan()
    data = [(torch.tensor([float(i)]), torch.tensor(i % 2)) for i in range(48)]
    features, targets, index, weight = next(iter(ClusterDataLoader(data, plan, rank=0)))
    assert features.shape == (2, 1) and targets.shape == (2,)
    assert index.tolist() == plan.epoch_layout(0)[0, 0, 0].tolist()
    assert weight.dtype == torch.float32


def test_state_dict_resumes_exactly_mid_epoch():
    plan = make_plan()
    first = ClusterDataLoader(dict_dataset(), plan, rank=0)
    taken = []
    for batch in first:
        taken.append(batch["sample_index"].tolist())
        if len(taken) == 3:
            break
    state = first.state_dict()
    resumed = ClusterDataLoader(dict_dataset(), make_plan(), rank=0)
    resumed.load_state_dict(state)
    rest = [b["sample_index"].tolist() for b in resumed]
    whole = [b["sample_index"].tolist() for b in ClusterDataLoader(dict_dataset(), plan, rank=0)]
    assert taken + rest == whole


def test_state_from_another_plan_is_refused():
    loader = ClusterDataLoader(dict_dataset(), make_plan(), rank=0)
    other = ClusterDataLoader(dict_dataset(), make_plan(micro=1), rank=0)
    with pytest.raises(ValueError, match="resume with the same data"):
        other.load_state_dict(loader.state_dict())


def test_weighted_loss_by_hand():
    logits = torch.randn(3, 5, 7, requires_grad=True)
    labels = torch.tensor([[-100, 1, 2, -100, -100], [-100, -100, 3, 4, 5], [-100] * 5])
    weights = torch.tensor([2.0, 0.5, 1.0])
    per_sample = per_sample_lm_loss(logits, labels)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    by_hand = torch.stack([
        -(log_probs[0, 0, 1] + log_probs[0, 1, 2]) / 2,
        -(log_probs[1, 1, 3] + log_probs[1, 2, 4] + log_probs[1, 3, 5]) / 3,
        torch.tensor(0.0),
    ])
    assert torch.allclose(per_sample, by_hand, atol=1e-6)
    assert torch.allclose(weighted_lm_loss(logits, labels, weights), (by_hand * weights).mean(), atol=1e-6)
    weighted_lm_loss(logits, labels, weights).backward()
    assert torch.isfinite(logits.grad).all()
