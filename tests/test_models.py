"""The tiny Llama, model loading, and the cached pretrained base model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_cluster.data.dataset import load_instruction_dataset
from ds_cluster.data.models import load_model_and_tokenizer
from bench.toy import models
from bench.toy.tasks import generate_mixture


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_tiny_model_forward_gives_a_finite_loss():
    model, tokenizer = models.tiny_model(seed=0)
    assert model.config.vocab_size == len(tokenizer)
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 5_000_000
    dataset = load_instruction_dataset(generate_mixture(seed=0)[1][:8], tokenizer, max_length=64)
    batch = torch.utils.data.default_collate([dataset[i] for i in range(8)])
    out = model(**batch)
    assert out.logits.shape == (8, 64, len(tokenizer))
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_tiny_init_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first, _ = models.tiny_model(seed=7)
    assert torch.equal(torch.rand(3), expected_draw)
    again = _parameters(models.tiny_model(seed=7)[0])
    other = _parameters(models.tiny_model(seed=8)[0])
    assert all(torch.equal(p, again[name]) for name, p in _parameters(first).items())
    assert not all(torch.equal(p, other[name]) for name, p in _parameters(first).items())


def test_the_shipped_base_model_copies_and_matches_the_recipe():
    from ds_cluster.evaluate import greedy_answers, score_answers
    from bench.toy.pretraining import copy_probe_records

    path = Path(models.base_model_path())
    manifest = json.loads((path / models.MANIFEST_NAME).read_text())
    recipe = models._recipe(seed=0, steps=models.PRETRAIN_STEPS)
    assert {key: manifest[key] for key in recipe} == recipe
    model, tokenizer = load_model_and_tokenizer(str(path))
    assert tokenizer.get_vocab() == models.build_tokenizer().get_vocab()
    # Fresh strings (another probe seed than the manifest's): the copy skill, not a memorised list.
    probe = copy_probe_records(count=100, seed=7)
    answers = greedy_answers(model, tokenizer, probe, max_new_tokens=12)
    assert score_answers(probe, answers)["copy"] >= 0.95


def test_unknown_model_name_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model_and_tokenizer(str(tmp_path / "missing"))


def test_pretraining_attends_to_the_real_eos_when_padding_with_it():
    # A tokenizer without a pad token pads with eos; the mask must come from the lengths, not the id.
    _, tokenizer = models.tiny_model(0)
    tokenizer.pad_token = tokenizer.eos_token
    texts = ["12 + 3", "7 + 100 + 4"]
    input_ids, attention_mask, labels = next(models._pretraining_batches(texts, tokenizer))
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 2 for t in texts]
    assert attention_mask.sum(dim=1).tolist() == lengths
    short = lengths.index(min(lengths))
    assert input_ids[short, lengths[short] - 1] == tokenizer.eos_token_id
    assert attention_mask[short, lengths[short] - 1] == 1  # the real eos, attended
    assert attention_mask[short, lengths[short]:].sum() == 0 and (labels[short, lengths[short]:] == -100).all()


@pytest.fixture(scope="module")
def base_model_path(tmp_path_factory) -> str:
    # Two steps: enough to exercise pretraining, saving and the manifest, fast on a busy CPU.
    return models.ensure_base_model(cache_dir=tmp_path_factory.mktemp("cache"), seed=0, steps=2)


def test_ensure_base_model_pretrains_once_then_reuses_the_cache(base_model_path):
    path = Path(base_model_path)
    root = path.parent
    manifest = json.loads((path / models.MANIFEST_NAME).read_text())
    assert path.name == "base_model_seed0_steps2"
    assert manifest["seed"] == 0 and manifest["steps"] == 2
    assert manifest["final_loss"] == manifest["final_loss"] and manifest["final_loss"] > 0
    assert not [p for p in root.iterdir() if p.name.startswith(".base_model") and p.is_dir()]

    weights = next(path.glob("*.safetensors"))
    mtime = weights.stat().st_mtime_ns
    assert models.ensure_base_model(cache_dir=root, seed=0, steps=2) == base_model_path
    assert weights.stat().st_mtime_ns == mtime  # served from the cache, not rebuilt

    # The checkpoint loads back as a plain Hugging Face folder, tokenizer included.
    model, tokenizer = load_model_and_tokenizer(base_model_path)
    assert model.config.hidden_size == models.tiny_llama_config(len(tokenizer)).hidden_size
    assert tokenizer.decode(tokenizer("12 + 3", add_special_tokens=False)["input_ids"]) == "12 + 3"


def test_an_incomplete_cache_folder_is_rebuilt_identically(tmp_path, base_model_path):
    broken = tmp_path / "base_model_seed0_steps2"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    path = models.ensure_base_model(cache_dir=tmp_path, seed=0, steps=2)
    assert path == str(broken) and (broken / models.MANIFEST_NAME).is_file()
    # Same seed and recipe, same weights: pretraining is deterministic.
    load = lambda p: _parameters(load_model_and_tokenizer(p)[0])  # noqa: E731
    rebuilt, original = load(path), load(base_model_path)
    assert all(torch.equal(rebuilt[name], original[name]) for name in original)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_CLUSTER_CACHE", str(tmp_path))
    assert models.default_cache_root() == tmp_path


# Runs in its own process: ZeRO-3 needs a process group, and transformers' ZeRO-3
# switch is process-wide state that must not leak into other tests.
_ZERO3_SCRIPT = """
import gc, sys, torch, deepspeed
from ds_cluster.data.models import load_model_and_tokenizer
path = sys.argv[1]
plain, tokenizer = load_model_and_tokenizer(path)
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
deepspeed.init_distributed(dist_backend="gloo")
model, _ = load_model_and_tokenizer(path, ds_config=config)
assert model._hf_ds_config_ref is not None
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
expected = dict(plain.named_parameters())
for name, param in engine.module.named_parameters():
    with deepspeed.zero.GatheredParameters([param]):
        assert torch.equal(param.data, expected[name].data), name
ids = torch.tensor([tokenizer("12 + 3", add_special_tokens=False)["input_ids"]] * 2)
loss = engine(input_ids=ids, labels=ids).loss
assert torch.isfinite(loss)
engine.backward(loss)
engine.step()
del engine, model
gc.collect()
torch.distributed.destroy_process_group()
print("ZERO3 OK")
"""


@pytest.mark.integration
def test_zero3_loading_keeps_the_checkpoint_weights(base_model_path):
    from tests.launching import check, run_single

    result = check(run_single(["-c", _ZERO3_SCRIPT, base_model_path], timeout=240))
    assert "ZERO3 OK" in result.stdout
