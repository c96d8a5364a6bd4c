"""--save-model's writer (`integrations.saving`): the folder from_pretrained reads, in files of a bounded size, each
parameter copied once. Under ZeRO-3 on 2 ranks it is run by tests/test_cli.py (a whole model) and tests/test_peft.py
(adapters)."""
from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ds_cluster.integrations.saving import INDEX_NAME, WEIGHTS_NAME, save_gathered_model
from tests.workers.feature_fixtures import tiny_llama


class _Tokenizer:
    """What the writer asks of a tokenizer: save_pretrained into the folder."""

    def save_pretrained(self, folder) -> None:
        (folder / "tokenizer_config.json").write_text("{}")


def _same_weights(saved_folder, model) -> None:
    reloaded = AutoModelForCausalLM.from_pretrained(saved_folder, local_files_only=True, dtype=torch.float32)
    expected, got = model.state_dict(), reloaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_model_over_the_file_size_is_written_in_files_with_their_index(tmp_path):
    model = tiny_llama(seed=0)
    largest = max(param.numel() * param.element_size() for param in model.parameters())
    save_gathered_model(model, _Tokenizer(), tmp_path / "model", rank=0, shard_bytes=3 * largest)
    folder = tmp_path / "model"
    index = json.loads((folder / INDEX_NAME).read_text())
    files = sorted(path.name for path in folder.glob("model-*.safetensors"))
    assert len(files) > 1 and files == sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in model.parameters())
    for path in folder.glob("model-*.safetensors"):
        assert path.stat().st_size <= 3 * largest + 4096  # the header's few kilobytes
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (folder / "tokenizer_config.json").is_file()
    _same_weights(folder, model)


def test_a_tied_output_matrix_is_written_once_under_the_embeddings_name(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    save_gathered_model(model, _Tokenizer(), tmp_path / "model", rank=0)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model" / WEIGHTS_NAME), framework="pt") as handle:
        names = set(handle.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    _same_weights(tmp_path / "model", model)


def test_a_rank_other_than_0_writes_nothing(tmp_path):
    save_gathered_model(tiny_llama(seed=0), _Tokenizer(), tmp_path / "model", rank=1)
    assert list(tmp_path.iterdir()) == []
