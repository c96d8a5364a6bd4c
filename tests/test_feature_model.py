"""A separate feature model: its own tokenizer re-encodes the samples, its own forward-only engine makes the
features, and the plan then drives the training of another model (2 ranks, ZeRO-3, CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_cluster.data.dataset import IGNORE_INDEX, InstructionDataset, read_jsonl
from ds_cluster.features.feature_model import feature_dataset
from ds_cluster.data.models import load_model_and_tokenizer
from bench.toy.models import base_model_path
from tests.launching import REPO, check, run_mpirun, shm_buffers
from tests.training import TRAIN, assert_run_follows_plan

STORIES = REPO / "bench" / "real" / "stories260k"
RECORDS = [{"instruction": "Reverse the letters.", "input": "abc", "output": "cba", "family": "reverse"},
           {"instruction": "Double each letter.", "input": "xy", "output": "xxyy", "family": "double"}]


def _response_text(dataset: InstructionDataset, tokenizer, row: int) -> str:
    labels = dataset.labels[row]
    return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist(), skip_special_tokens=True)


def test_the_feature_tokenizer_scores_the_same_response_text():
    _, toy_tokenizer = load_model_and_tokenizer(base_model_path())
    _, stories_tokenizer = load_model_and_tokenizer(STORIES)
    trained = InstructionDataset(RECORDS, toy_tokenizer, max_length=48)
    for features_of in (feature_dataset(trained, stories_tokenizer),
                        feature_dataset(_token_only(trained, toy_tokenizer), stories_tokenizer)):
        assert len(features_of) == len(trained) and features_of.max_length == 48
        for row in range(len(RECORDS)):
            assert _response_text(features_of, stories_tokenizer, row).strip() == RECORDS[row]["output"]
            # Another tokenizer, another sequence of ids for the same text.
            assert features_of.input_ids[row].tolist() != trained.input_ids[row].tolist()


class _TokenOnly(torch.utils.data.Dataset):
    """A user's tokenized dataset: items only, and the tokenizer that made them."""

    def __init__(self, dataset: InstructionDataset, tokenizer) -> None:
        self.items, self.tokenizer, self.max_length = [dataset[i] for i in range(len(dataset))], tokenizer, 48

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def _token_only(dataset: InstructionDataset, tokenizer) -> _TokenOnly:
    return _TokenOnly(dataset, tokenizer)


def test_a_tokenized_dataset_without_its_tokenizer_gets_an_error_naming_the_fix():
    _, toy_tokenizer = load_model_and_tokenizer(base_model_path())
    bare = _TokenOnly(InstructionDataset(RECORDS, toy_tokenizer, max_length=48), toy_tokenizer)
    bare.tokenizer = None
    with pytest.raises(ValueError, match="dataset.tokenizer ="):
        feature_dataset(bare, toy_tokenizer)


def _lora_feature_model(folder: Path) -> Path:
    """stories260K with LoRA adapters of rank 4 (lora_B drawn at random, seeded), saved as a PEFT adapter folder
    naming stories260K as its base."""
    from ds_cluster.data.models import load_model, with_lora

    model = with_lora(load_model(STORIES), 4)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(folder)
    return folder


@pytest.mark.integration
@pytest.mark.parametrize("source", ["checkpoint", "lora_adapters"])
def test_a_feature_model_makes_the_features_and_the_plan_trains_another_model(small_job: Path,  # noqa: F811
                                                                              tmp_path: Path, source: str):
    """A separate feature model under ZeRO-3: a checkpoint (its proxy features), or a small LoRA model's adapter
    folder (its lora features) selecting for a larger model that trains its own LoRA adapters."""
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    analysis = tmp_path / "analysis"
    feature_model = STORIES if source == "checkpoint" else _lora_feature_model(tmp_path / "feature_lora")
    lora = {} if source == "checkpoint" else {"feature_kind": "lora", "feature_dim": 128}
    config["data_efficiency"]["data_sampling"]["cluster_sampling"].update(
        analysis_path=str(analysis), budget_ratio=0.2, num_clusters=4, kmeans_n_init=2,
        allocation="stratified", feature_model=str(feature_model), feature_max_length=128, **lora)
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    before = shm_buffers()
    check(run_mpirun([*TRAIN, "--deepspeed", str(tmp_path / "ds_config.json"), "--model",
                      str(small_job / "model"), "--data", str(small_job / "train.jsonl"), "--output-dir",
                      str(tmp_path / "out"), "--max-length", "64", "--trace", "--max-steps", "3",
                      *([] if source == "checkpoint" else ["--lora", "4"])], timeout=300))
    manifest = json.loads((analysis / "manifest.json").read_text())
    assert manifest["feature_model"] == str(feature_model) and manifest["zero_stage"] == 3
    # stories260K's hidden size (the proxy kind's dimension), not the trained model's (128): the features are the
    # feature model's; the lora kind's are its adapters', at the dimension asked for.
    features = np.load(analysis / "features.npy")
    assert manifest["kind"] == ("proxy" if source == "checkpoint" else "lora")
    assert features.shape == (len(read_jsonl(small_job / "train.jsonl")), 64 if source == "checkpoint" else 128)
    assert np.isfinite(features).all() and (np.linalg.norm(features, axis=1) > 0.99).all()
    assert_run_follows_plan(tmp_path / "out", loss_falls=False)  # 3 steps: too few to see the loss fall
    assert shm_buffers() - before == set()


def test_a_saved_adapter_folder_loads_as_its_base_with_trainable_adapters(tmp_path: Path):
    from ds_cluster.data.models import load_model, load_tokenizer
    from ds_cluster.features.extract import run_extraction

    folder = _lora_feature_model(tmp_path / "adapters")
    model = load_model(folder)
    assert type(model).__name__.startswith("PeftModel")
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    tokenizer = load_tokenizer(folder)  # saved without a tokenizer: the base model's
    dataset = InstructionDataset(RECORDS, tokenizer, max_length=48)
    again = run_extraction(load_model(folder), dataset, kind="lora", dim=64, show_progress=False).features
    np.testing.assert_array_equal(run_extraction(model, dataset, kind="lora", dim=64, show_progress=False).features,
                                  again)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="not a local checkpoint folder.*base_model_name_or_path"):
        load_model(folder)


def test_chat_records_reach_a_feature_model_without_a_chat_template_as_the_trained_models_text(tmp_path):
    from tests.fixtures.tokenizers import load_tokenizer

    smollm2 = load_tokenizer("smollm2", tmp_path)  # the trained model's tokenizer, with its chat template
    _, stories_tokenizer = load_model_and_tokenizer(STORIES)  # no chat template
    chat = [{"messages": [{"role": "user", "content": "Reverse the letters: abc"},
                          {"role": "assistant", "content": "cba"}], "family": "reverse"}, RECORDS[1]]
    trained = InstructionDataset(chat, smollm2, max_length=96)
    features_of = feature_dataset(trained, stories_tokenizer)
    assert features_of.records[0]["family"] == "reverse" and "messages" not in features_of.records[0]
    # The prompt the feature model reads is the trained model's rendered conversation, generation prompt included.
    assert features_of.records[0]["prompt"].endswith("<|im_start|>user\nReverse the letters: abc<|im_end|>\n"
                                                     "<|im_start|>assistant\n")
    assert _response_text(features_of, stories_tokenizer, 0).strip() == "cba"
    assert features_of.records[1] == trained.records[1]  # an Alpaca record as it was
