"""Gradient features against brute-force autograd references, the projection, the store, and bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ds_cluster.data.dataset import dataset_fingerprint
from ds_cluster.features.extract import model_fingerprint, run_extraction
from ds_cluster.features.projection import factor_dim, gaussian_matrix, kronecker_projection
from ds_cluster.features.store import FeatureStore
from tests.workers.feature_fixtures import HIDDEN, VOCAB, tiny_llama, token_dataset

torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def dataset():
    return token_dataset(12, seed=1)


def _response_positions(sample: dict) -> list[tuple[int, int]]:
    """(position t, gold token y) pairs: the causal shift makes token t+1 the target of position t."""
    labels = sample["labels"]
    return [(t, int(labels[t + 1])) for t in range(len(labels) - 1) if labels[t + 1] != -100]


def _token_losses(model, sample: dict) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    logits = model(input_ids=sample["input_ids"][None], attention_mask=sample["attention_mask"][None]).logits[0]
    pairs = _response_positions(sample)
    losses = torch.stack([torch.nn.functional.cross_entropy(logits[t], torch.tensor(y)) for t, y in pairs])
    return losses, pairs


def _proxy_reference(model, sample: dict) -> np.ndarray:
    """g(x) = mean_t of the gold row y_t of d CE_t / d W_out, each token's gradient taken separately by autograd.

    The gradient of the *mean* loss w.r.t. row y also collects p_s(y) h_s from
    other positions s, so the reference must take per-token gradients: row y_t of
    d CE_t / d W is exactly (p_t - 1) h_t.
    """
    weight = model.lm_head.weight
    losses, pairs = _token_losses(model, sample)
    rows = []
    for index, (_, gold) in enumerate(pairs):
        (grad,) = torch.autograd.grad(losses[index], weight, retain_graph=True)
        rows.append(grad[gold])
    return torch.stack(rows).mean(0).detach().numpy()


def _lm_head_gradient(model, sample: dict) -> np.ndarray:
    """vec(d mean_t CE_t / d W_out) by autograd (V x H, row-major)."""
    losses, _ = _token_losses(model, sample)
    (grad,) = torch.autograd.grad(losses.mean(), model.lm_head.weight)
    return grad.reshape(-1).detach().numpy().astype(np.float64)


def test_proxy_equals_autograd_reference(model, dataset):
    result = run_extraction(model, dataset, kind="proxy", normalize=False, show_progress=False, batch_size=5)
    reference = np.stack([_proxy_reference(model, sample) for sample in dataset])
    assert result.features.dtype == np.float32 and result.features.shape == (len(dataset), HIDDEN)
    np.testing.assert_allclose(result.features, reference, atol=1e-5, rtol=0)
    # Normalised rows are the same directions with unit length.
    normalised = run_extraction(model, dataset, kind="proxy", show_progress=False).features
    np.testing.assert_allclose(normalised, reference / np.linalg.norm(reference, axis=1, keepdims=True), atol=1e-5)


def test_lm_head_equals_explicit_projection_of_autograd_gradient(model, dataset):
    dim, seed = 256, 7
    result = run_extraction(model, dataset, kind="lm_head", dim=dim, seed=seed, normalize=False,
                            show_progress=False, batch_size=4)
    gradients = np.stack([_lm_head_gradient(model, sample) for sample in dataset])
    dense = kronecker_projection(dim, VOCAB, HIDDEN, seed).dense().double().numpy()
    np.testing.assert_allclose(result.features, gradients @ dense.T, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["proxy", "lm_head"])
def test_chunked_softmax_gives_the_unchunked_features(model, dataset, kind):
    """Extraction takes the softmax a chunk of response positions at a time, so its memory is bounded by
    the chunk, not the answer length; any chunk size, down to one position, must give the features of the
    whole batch at once (chunk larger than every batch's response positions)."""
    options = dict(kind=kind, normalize=False, show_progress=False, batch_size=5)
    if kind == "lm_head":
        options.update(dim=256, seed=7)
    whole = run_extraction(model, dataset, chunk_size=10**6, **options).features
    assert np.abs(whole).max() > 0
    for chunk_size in (1, 3, 17):
        chunked = run_extraction(model, dataset, chunk_size=chunk_size, **options).features
        np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=0)


def _hidden_reference(model, sample: dict) -> np.ndarray:
    """RDS+'s representation computed directly: the last hidden layer (after the final norm, what the output layer
    reads) of the attended positions, weighted (i + 1) / sum_j (j + 1) by their place i, then L2-normalised."""
    attended = sample["attention_mask"].bool()
    states = model(input_ids=sample["input_ids"][None], attention_mask=sample["attention_mask"][None],
                   output_hidden_states=True).hidden_states[-1][0][attended].double()
    place = torch.arange(1, states.shape[0] + 1, dtype=torch.float64)
    pooled = (place[:, None] * states).sum(0) / place.sum()
    return (pooled / pooled.norm()).detach().numpy()


def test_hidden_is_the_position_weighted_mean_of_the_last_hidden_layer(model, dataset):
    result = run_extraction(model, dataset, kind="hidden", show_progress=False, batch_size=5)
    reference = np.stack([_hidden_reference(model, sample) for sample in dataset])
    assert result.features.shape == (len(dataset), HIDDEN) and result.dim == HIDDEN
    cosines = (result.features * reference).sum(axis=1) / np.linalg.norm(result.features, axis=1)
    assert cosines.min() >= 0.9999, cosines
    np.testing.assert_allclose(np.linalg.norm(result.features, axis=1), 1.0, atol=1e-5)
    # Not the plain mean: the weights rise with the position.
    plain = np.stack([model(input_ids=s["input_ids"][None], attention_mask=s["attention_mask"][None],
                            output_hidden_states=True).hidden_states[-1][0][s["attention_mask"].bool()].mean(0)
                      .detach().numpy() for s in dataset])
    assert not np.allclose(result.features, plain / np.linalg.norm(plain, axis=1, keepdims=True), atol=1e-3)
    with pytest.raises(ValueError, match="hidden size"):
        run_extraction(model, dataset, kind="hidden", dim=16, show_progress=False)


def test_lm_head_projection_preserves_inner_products(model):
    """Johnson-Lindenstrauss check at dim 1024 of the 64 x 32 = 2048-value gradient.

    For a Gaussian projection to k dimensions, the error of <Pa, Pb> has standard
    deviation sqrt((|a|^2 |b|^2 + <a,b>^2) / k) <= sqrt(2 / k) |a||b| = 0.044 |a||b|
    at k = 1024; the Kronecker-factored projection (32 x 32 factors) has heavier
    tails, up to a few times that variance. A tolerance of 0.25 |a||b| is then
    several standard deviations: we require it for at least 95% of pairs, and a
    mean error below 0.08 |a||b|.
    """
    samples = token_dataset(24, seed=5)
    projected = run_extraction(model, samples, kind="lm_head", dim=1024, seed=3, normalize=False,
                               show_progress=False).features.astype(np.float64)
    exact = np.stack([_lm_head_gradient(model, sample) for sample in samples])
    norms = np.linalg.norm(exact, axis=1)
    upper = np.triu_indices(len(samples))
    error = np.abs(projected @ projected.T - exact @ exact.T)[upper] / np.outer(norms, norms)[upper]
    assert np.mean(error <= 0.25) >= 0.95, error
    assert error.mean() <= 0.08, error.mean()


def test_projection_is_seeded_and_factored():
    assert factor_dim(1024, VOCAB, HIDDEN) in {(32, 32), (64, 16)}
    assert factor_dim(6, 64, 32) in {(2, 3), (3, 2)}
    first, again = gaussian_matrix(5000, 8, seed=11, tag=0), gaussian_matrix(5000, 8, seed=11, tag=0)
    assert torch.equal(first, again)
    assert not torch.equal(first, gaussian_matrix(5000, 8, seed=11, tag=1))
    assert abs(float(first.pow(2).sum(1).mean()) - 1.0) < 0.05  # rows have unit expected norm
    with pytest.raises(ValueError, match="larger than the gradient"):
        factor_dim(64 * 32 + 1, 64, 32)


def test_samples_without_response_tokens_get_zero_rows(model):
    samples = token_dataset(9, seed=2, empty=[0, 4])
    for kind in ("proxy", "lm_head", "hidden"):
        result = run_extraction(model, samples, kind=kind, dim=64 if kind == "lm_head" else None,
                                show_progress=False, batch_size=4)
        assert np.isfinite(result.features).all()
        assert result.num_empty == 2 and result.empty_mask.tolist() == [i in (0, 4) for i in range(9)]
        assert not result.features[[0, 4]].any()
        np.testing.assert_allclose(np.linalg.norm(result.features[~result.empty_mask], axis=1), 1.0, atol=1e-5)


def test_clear_errors_for_bad_models_and_dims(model, dataset):
    with pytest.raises(ValueError, match=r"get_output_embeddings\(\).*lm_head"):
        run_extraction(model.model, dataset, kind="proxy", show_progress=False)  # the base model has no head
    with pytest.raises(ValueError, match=r"dim=2049 is larger .* \(64 x 32 = 2048 values\)"):
        run_extraction(model, dataset, kind="lm_head", dim=VOCAB * HIDDEN + 1, show_progress=False)
    with pytest.raises(ValueError, match="hidden size"):
        run_extraction(model, dataset, kind="proxy", dim=16, show_progress=False)
    with pytest.raises(ValueError, match="unknown feature kind 'layers'; use 'proxy' .* or 'lm_head'"):
        run_extraction(model, dataset, kind="layers", show_progress=False)


def test_store_resumes_validates_and_rejects_mismatch(model, tmp_path):
    samples = token_dataset(20, seed=3, empty=[7])
    store_dir = tmp_path / "store"
    first = run_extraction(model, samples, kind="proxy", store=store_dir, shard_size=6, batch_size=4,
                           show_progress=False)
    assert first.computed_shards == [0, 1, 2, 3] and first.reused_shards == []
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert manifest["num_shards"] == 4 and manifest["num_samples"] == 20 and manifest["dim"] == HIDDEN
    assert json.loads((store_dir / "shards" / "shard-00001.done.json").read_text())["empty"] == [7]

    # A finished store is reused; a deleted and a corrupted shard are recomputed, nothing else.
    (store_dir / "shards" / "shard-00002.done.json").unlink()
    rows = np.load(store_dir / "shards" / "shard-00003.npy")
    np.save(store_dir / "shards" / "shard-00003.npy", rows + 1)
    again = run_extraction(model, samples, kind="proxy", store=store_dir, shard_size=6, show_progress=False)
    assert again.computed_shards == [2, 3] and again.reused_shards == [0, 1]
    np.testing.assert_array_equal(again.features, first.features)
    assert again.empty_mask.tolist() == first.empty_mask.tolist()

    # Other settings are a clear error naming the fields, or a recompute with overwrite.
    with pytest.raises(ValueError, match=r"\(kind, dim\)") as error:
        run_extraction(model, samples, kind="lm_head", dim=64, store=store_dir, shard_size=6, show_progress=False)
    assert "stored 'proxy', requested 'lm_head'" in str(error.value)
    with pytest.raises(ValueError, match=r"dataset_fingerprint, num_samples"):
        run_extraction(model, samples[:10], kind="proxy", store=store_dir, shard_size=6, show_progress=False)
    redone = run_extraction(model, samples, kind="lm_head", dim=64, store=store_dir, shard_size=6,
                            show_progress=False, overwrite=True)
    assert redone.computed_shards == [0, 1, 2, 3] and redone.features.shape == (20, 64)
    with pytest.raises(ValueError, match="corrupt"):
        store = FeatureStore(store_dir)
        np.save(store_dir / "shards" / "shard-00000.npy", np.zeros((6, 64), dtype=np.float64))
        store.read_shard(redone.manifest, 0)


def test_fingerprints_follow_weights_and_tokens(model, dataset):
    same = tiny_llama(seed=0)
    assert model_fingerprint(same) == model_fingerprint(model)
    with torch.no_grad():
        same.model.norm.weight[0] += 1e-3
    assert model_fingerprint(same) != model_fingerprint(model)
    changed = [dict(sample) for sample in dataset]
    changed[3] = dict(changed[3], labels=torch.full_like(changed[3]["labels"], -100))
    assert dataset_fingerprint(changed) != dataset_fingerprint(dataset)


def test_the_output_matrix_read_a_block_of_rows_at_a_time_gives_the_whole_matrix_figures():
    from ds_cluster.features.output_matrix import OutputMatrix

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 16, generator=generator).bfloat16()
    bias = torch.randn(1000, generator=generator).bfloat16()
    hidden = torch.randn(5, 16, generator=generator).bfloat16()
    blocked, whole = OutputMatrix(weight, bias, block_elements=16 * 7), OutputMatrix(weight, bias)
    assert len(blocked.blocks) == 143 and len(whole.blocks) == 1  # 7 rows a block, the last one 6
    reference = torch.nn.functional.linear(hidden.float(), weight.float(), bias.float())
    torch.testing.assert_close(blocked.logits(hidden), reference, rtol=1e-6, atol=1e-5)
    assert blocked.logits(hidden).dtype == torch.float32
    coefficients = torch.softmax(reference, dim=-1)
    torch.testing.assert_close(blocked.input_gradient(coefficients), coefficients @ weight.float(), rtol=1e-5,
                               atol=1e-6)
    # A float32 matrix is read in place: a block is a view of it, not a copy.
    weight32 = weight.float()
    assert OutputMatrix(weight32, block_elements=16 * 7).weight[0:7].float().data_ptr() == weight32.data_ptr()
