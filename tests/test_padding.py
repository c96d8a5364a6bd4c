"""No compute spent on padding: the features pass, the hook's default collate and ClusterTrainer pad each batch to
its longest row (rounded up to a multiple of 8), and nothing a user relies on changes: the loss, the features
(up to float rounding), the clusters, the plan."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.real import STORIES260K_DIR, T0_DIR
from ds_cluster import ClusterSamplingConfig
from tests.planning import plan_of
from ds_cluster.clustering.kmeans import cluster_features
from ds_cluster.data.dataset import InstructionDataset, PAD_MULTIPLE, read_records, trim_padding_collate
from ds_cluster.data.models import load_model_and_tokenizer
from ds_cluster.features.batches import _batches_of, _collate, sample_lengths
from ds_cluster.features.extract import run_extraction
from ds_cluster.features.store import FeatureStore
from ds_cluster.loader.loss import weighted_causal_lm_loss, weighted_lm_loss
from ds_cluster.loader.sampler import ClusterDataLoader

MAX_LENGTH = 272  # every T0 record whole in stories260K's tokens


@pytest.fixture(scope="module")
def stories_on_t0():
    """stories260K (a real pretrained model) and 96 T0 held-out records of every length, padded to 272 tokens."""
    model, tokenizer = load_model_and_tokenizer(STORIES260K_DIR, rank=0)
    records = read_records(T0_DIR / "heldout.jsonl.gz")[::10][:96]
    return model.eval(), InstructionDataset(records, tokenizer, max_length=MAX_LENGTH, rank=0)


def test_a_trimmed_batch_has_the_loss_of_the_full_width_one(stories_on_t0):
    model, dataset = stories_on_t0
    items = [dataset[i] for i in range(16)]
    full = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    trimmed = trim_padding_collate(items)
    width = trimmed["input_ids"].shape[1]
    assert width % PAD_MULTIPLE == 0 and width < MAX_LENGTH
    assert width - PAD_MULTIPLE < int(full["attention_mask"].sum(dim=1).max()) <= width
    weights = torch.linspace(0.5, 1.5, 16)
    with torch.no_grad():
        logits_full = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits
        logits_trimmed = model(input_ids=trimmed["input_ids"], attention_mask=trimmed["attention_mask"]).logits
    for normalizer in (None, torch.full((16,), 37.0)):
        loss_full = weighted_lm_loss(logits_full, full["labels"], weights, normalizer)
        loss_trimmed = weighted_lm_loss(logits_trimmed, trimmed["labels"], weights, normalizer)
        assert float(loss_trimmed) == pytest.approx(float(loss_full), rel=1e-5)


def test_the_features_pass_pads_to_the_longest_row_and_changes_no_cluster(stories_on_t0, tmp_path):
    model, dataset = stories_on_t0
    by_kind = {}
    for kind, dim in (("proxy", None), ("lm_head", 256)):
        full = run_extraction(model, dataset, kind=kind, dim=dim, batch_size=8, shard_size=40, show_progress=False,
                              pad_to_longest=False).features
        padded = run_extraction(model, dataset, kind=kind, dim=dim, batch_size=8, shard_size=40,
                                show_progress=False, store=tmp_path / kind).features
        np.testing.assert_allclose(padded, full, rtol=0, atol=1e-5)  # float rounding only
        by_kind[kind] = (full, padded)
    full, padded = by_kind["lm_head"]
    labels = [cluster_features(features, num_clusters=4, n_init=4, capacity_factor=None, seed=1).labels
              for features in (full, padded)]
    np.testing.assert_array_equal(labels[0], labels[1])
    config = ClusterSamplingConfig(enabled=True, num_clusters=4, budget_ratio=0.5, kmeans_n_init=4)
    plans = [plan_of(features, config, world_size=2, micro_batch_size=4, gradient_accumulation_steps=1)
             for features in (full, padded)]
    assert plans[0].selected.tolist() == plans[1].selected.tolist()


def test_feature_batches_are_fixed_in_advance_by_length_within_a_shard(stories_on_t0):
    _, dataset = stories_on_t0
    lengths = sample_lengths(dataset)
    assert lengths.tolist() == dataset.attention_mask.sum(dim=1).tolist()  # right padding
    bounds = [(0, 40), (40, 80), (80, 96)]
    batches = _batches_of([0, 1, 2], lambda shard: bounds[shard], 8, lengths)
    again = _batches_of([2, 0, 1], lambda shard: bounds[shard], 8, lengths)
    # A shard's batches do not depend on which other shards are pending (a resumed run has fewer).
    assert {shard: [b.tolist() for s, b in again if s == shard] for shard in range(3)} == \
        {shard: [b.tolist() for s, b in batches if s == shard] for shard in range(3)}
    for shard, (start, stop) in enumerate(bounds):
        members = np.concatenate([b for s, b in batches if s == shard])
        assert sorted(members.tolist()) == list(range(start, stop))
        assert (np.diff(lengths[members]) >= 0).all()  # in order of length: little padding per batch
    widths = [_collate(dataset, indices)["input_ids"].shape[1] for _, indices in batches]
    assert all(width % PAD_MULTIPLE == 0 or width == MAX_LENGTH for width in widths)
    assert sum(widths) * 8 < 0.8 * len(dataset) * MAX_LENGTH


def test_a_store_computed_at_full_width_is_not_mixed_with_padded_rows(stories_on_t0, tmp_path):
    model, dataset = stories_on_t0
    run_extraction(model, dataset, kind="proxy", batch_size=8, shard_size=48, show_progress=False,
                   store=tmp_path / "store", pad_to_longest=False)
    with pytest.raises(ValueError, match="different settings \\(batching\\)"):
        run_extraction(model, dataset, kind="proxy", batch_size=8, shard_size=48, show_progress=False,
                       store=tmp_path / "store")
    assert FeatureStore(tmp_path / "store").read_manifest().batching == "full_width"


def test_the_hooks_loader_without_a_collate_fn_pads_each_micro_batch_to_its_longest_row(stories_on_t0):
    _, dataset = stories_on_t0
    config = ClusterSamplingConfig(enabled=True, num_clusters=2, budget_mode="proportional", budget_ratio=0.5,
                                   selection="random", loss_reduction="sample")
    plan = plan_of(None, config, world_size=1, micro_batch_size=8, gradient_accumulation_steps=1,
                      labels=np.arange(len(dataset)) % 2)
    for batch in ClusterDataLoader(dataset, plan, 0):
        longest = int(batch["attention_mask"].sum(dim=1).max())
        width = batch["input_ids"].shape[1]
        assert width == min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, MAX_LENGTH)
        assert batch["labels"].shape == batch["input_ids"].shape and batch["sample_weight"].shape == (8,)
        assert torch.equal(batch["input_ids"], dataset.input_ids[batch["sample_index"], :width])
        assert float(weighted_causal_lm_loss(type("Out", (), {"logits": torch.zeros(8, width, 512)})(), batch)) > 0
