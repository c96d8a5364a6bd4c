"""The `lora` feature kind against a direct per-sample backward, its bad inputs, and its store."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_cluster.features.adapters import adapter_layers, adapter_projections
from ds_cluster.features.extract import run_extraction
from ds_cluster.features.store import FeatureStore
from tests.workers.feature_fixtures import tiny_lora_llama, tiny_llama, token_dataset

pytest.importorskip("peft")
DIM = 256


@pytest.fixture(scope="module")
def model():
    return tiny_lora_llama(seed=0, rank=4)


@pytest.fixture(scope="module")
def dataset():
    return token_dataset(10, seed=2, empty=[3])


def _direct_projected_gradient(model, sample: dict, seed: int) -> np.ndarray:
    """One sample alone: backward of its mean response-token loss, every adapter matrix's gradient flattened and
    projected by the explicit (dense) Kronecker matrix of its layer, summed over the layers."""
    layers = adapter_layers(model)
    labels = sample["labels"][None]
    logits = model(input_ids=sample["input_ids"][None], attention_mask=sample["attention_mask"][None]).logits
    targets = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
    gradients = torch.autograd.grad(loss, [layer.weight for _, layer in layers])
    total = torch.zeros(DIM, dtype=torch.float64)
    for projection, gradient in zip(adapter_projections(layers, DIM, seed), gradients):
        total += projection.dense().double() @ gradient.double().reshape(-1)
    return total.numpy()


def test_lora_features_are_each_samples_projected_adapter_gradient(model, dataset):
    result = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=4, seed=5, normalize=False,
                            show_progress=False)
    assert result.features.shape == (10, DIM) and result.empty_mask.nonzero()[0].tolist() == [3]
    assert not result.features[3].any()
    for index in (0, 1, 7):
        direct = _direct_projected_gradient(model, dataset[index], seed=5)
        feature = result.features[index].astype(np.float64)
        cosine = feature @ direct / (np.linalg.norm(feature) * np.linalg.norm(direct))
        assert cosine >= 0.99, (index, cosine)
        np.testing.assert_allclose(feature, direct, rtol=1e-3, atol=1e-5 * np.abs(direct).max())


def test_fresh_adapters_give_the_frozen_layers_gradient_seen_through_lora_a(dataset):
    """peft starts lora_B at zero: lora_A's gradient is then zero, and the features are lora_B's alone, still
    each sample's own gradient (not zero rows)."""
    from ds_cluster.data.models import with_lora

    fresh = with_lora(tiny_llama(seed=0), 4).eval()
    result = run_extraction(fresh, dataset, kind="lora", dim=DIM, batch_size=4, seed=5, normalize=False,
                            show_progress=False)
    direct = _direct_projected_gradient(fresh, dataset[0], seed=5)
    np.testing.assert_allclose(result.features[0], direct, rtol=1e-3, atol=1e-5 * np.abs(direct).max())
    assert (np.linalg.norm(result.features, axis=1) > 0).sum() == 9  # all but the sample without a response


def test_batch_width_and_chunking_do_not_change_the_features(model, dataset):
    one = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=1, seed=5, show_progress=False)
    many = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=5, seed=5, chunk_size=3,
                          show_progress=False)
    np.testing.assert_allclose(one.features, many.features, atol=2e-5, rtol=0)
    other_seed = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=5, seed=6, show_progress=False)
    assert np.abs(other_seed.features - many.features).max() > 0.1  # the projection follows the seed


def test_the_store_resumes_a_lora_pass_killed_between_shards(model, dataset, tmp_path):
    full = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=2, seed=5, show_progress=False)

    def crash(shard: int) -> None:
        if shard == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=2, seed=5, store=tmp_path, shard_size=4,
                       on_shard_done=crash, show_progress=False)
    resumed = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=2, seed=5, store=tmp_path,
                             shard_size=4, show_progress=False)
    assert resumed.reused_shards == [0, 1] and resumed.computed_shards == [2]
    np.testing.assert_allclose(resumed.features, full.features, atol=2e-5, rtol=0)
    assert FeatureStore(tmp_path).finished_shards(resumed.manifest) == [0, 1, 2]
    # Hooks are gone after a pass, also one that failed: the model computes as before.
    assert not any(module._forward_hooks for module in model.modules())


def test_a_model_without_trainable_adapters_is_refused_naming_the_fix(dataset):
    with pytest.raises(ValueError, match=r"no trainable ones.*get_peft_model.*lm_head"):
        run_extraction(tiny_llama(seed=0), dataset, kind="lora", show_progress=False)
    frozen = tiny_lora_llama(seed=0)
    for param in frozen.parameters():
        param.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable ones"):
        run_extraction(frozen, dataset, kind="lora", show_progress=False)


def test_the_lora_kind_is_a_feature_kind_of_the_config_and_the_cli():
    from ds_cluster.config import ClusterSamplingConfig
    from ds_cluster.features.kinds import FEATURE_KINDS

    assert "lora" in FEATURE_KINDS.names
    config = ClusterSamplingConfig.from_dict({"enabled": True, "feature_kind": "lora", "feature_dim": 512})
    assert config.stages().features.kind == "lora" and config.stages().features.dim == 512
    with pytest.raises(ValueError, match="feature_dim must be >= 1"):
        run_extraction(tiny_lora_llama(seed=0), token_dataset(2), kind="lora", dim=0, show_progress=False)


def test_adapter_projections_are_count_sketches_that_keep_inner_products_from_bytes_per_coordinate():
    from ds_cluster.features.projection import layer_projection

    wide = layer_projection(1024, 8, 8192, seed=0, layer=3)  # lora_A of an 8192-wide MLP layer
    assert wide.dim == 1024 and wide.out.index.numel() == 8 and wide.in_.index.numel() == 8192
    stored = sum(t.numel() * t.element_size() for t in (wide.out.index, wide.out.sign, wide.in_.index, wide.in_.sign))
    assert stored < 100_000  # a Gaussian pair to 1024 values would be 8192 x 1024 x 4 bytes = 32 MiB
    # S_out^T G S_in through the sketches is the dense projection of vec(G); inner products kept in expectation.
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(16, 32, generator=generator), torch.randn(16, 32, generator=generator)
    second = 0.6 * first + 0.8 * second
    products = []
    for seed in range(400):
        projection = layer_projection(64, 16, 32, seed=seed, layer=0)
        dense = projection.dense()
        through_sketches = projection.in_.apply(projection.out.apply(first.T).T)  # S_in^T applied to S_out^T G
        assert torch.allclose(dense @ first.reshape(-1), through_sketches.reshape(-1), atol=1e-5)
        products.append(float((dense @ first.reshape(-1)) @ (dense @ second.reshape(-1))))
    exact = float(first.reshape(-1) @ second.reshape(-1))
    assert abs(np.mean(products) - exact) < 0.1 * abs(exact), (np.mean(products), exact)
    assert layer_projection(64, 16, 32, seed=1, layer=0).in_.index.tolist() != \
        layer_projection(64, 16, 32, seed=1, layer=1).in_.index.tolist()  # each layer its own sketch


def test_a_store_of_gaussian_adapter_projections_is_not_resumed_with_sketched_rows(model, dataset, tmp_path):
    import json

    first = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=2, seed=5, store=tmp_path, shard_size=4,
                           show_progress=False)
    assert first.manifest.adapter_projection == "sign_sketch"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["adapter_projection"]  # as 0.6.0 wrote it
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"adapter_projection: stored 'gaussian', requested 'sign_sketch'"):
        run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=2, seed=5, store=tmp_path, shard_size=4,
                       show_progress=False)
