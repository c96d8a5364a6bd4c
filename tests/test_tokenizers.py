"""Tokenizers without a pad token (llama2.c's SentencePiece, GPT-2's BPE) and without bos, in every data path."""
from __future__ import annotations

import hashlib
import logging
import lzma
from pathlib import Path

import pytest
import torch

from ds_cluster.data.dataset import IGNORE_INDEX, encode_example, encode_prompt, format_prompt, load_instruction_dataset
from ds_cluster.data.special_tokens import bos_prefix, ensure_pad_token
from tests.fixtures.tokenizers import FIXTURES, load_tokenizer, tiny_model_folder

RECORD = {"instruction": "Tell a short story.", "input": "a cat", "output": "Once upon a time, a cat sat.",
          "category": "story"}
PAD_LOG = "the tokenizer has no pad token"


@pytest.fixture
def stories(tmp_path):
    return load_tokenizer("stories260k", tmp_path / "stories260k")


@pytest.fixture
def gpt2(tmp_path):
    return load_tokenizer("gpt2", tmp_path / "gpt2")


def _pad_log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ds_cluster.data.special_tokens"]


def test_fixture_tokenizers_are_what_the_readme_says(stories, gpt2, tmp_path):
    # GPT-2's files are OpenAI's, byte for byte (the SHA-256 OpenAI publishes and tiktoken pins).
    digests = {name: hashlib.sha256(lzma.decompress((FIXTURES / "gpt2" / f"{name}.xz").read_bytes())).hexdigest()
               for name in ("vocab.json", "merges.txt")}
    assert digests == {"vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
                       "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}
    assert len(gpt2) == 50257 and gpt2.pad_token is None
    assert gpt2.bos_token == gpt2.eos_token == "<|endoftext|>" and gpt2.eos_token_id == 50256
    assert gpt2("Hello world!", add_special_tokens=False)["input_ids"] == [15496, 995, 0]
    assert len(stories) == 512 and stories.pad_token is None
    assert (stories.bos_token_id, stories.eos_token_id, stories.unk_token_id) == (1, 2, 0)
    smollm2 = load_tokenizer("smollm2", tmp_path / "smollm2")
    assert len(smollm2) == 49152 and smollm2.pad_token_id == smollm2.eos_token_id == 2
    assert "<|im_start|>" in smollm2.chat_template
    assert sum(path.stat().st_size for path in FIXTURES.rglob("*") if path.is_file()) < 1_000_000


@pytest.mark.parametrize("name,expected", [("stories260k", "</s>"), ("gpt2", "<|endoftext|>")])
def test_pad_falls_back_to_eos_with_one_log_line_on_rank_0(name, expected, tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    tokenizer = load_tokenizer(name, tmp_path)
    with caplog.at_level(logging.INFO, logger="ds_cluster.data.special_tokens"):
        assert ensure_pad_token(tokenizer) == expected
        assert ensure_pad_token(tokenizer) == expected  # already set: nothing more to say
        load_instruction_dataset([RECORD], tokenizer, max_length=64)
    assert tokenizer.pad_token == expected and tokenizer.pad_token_id == tokenizer.eos_token_id
    lines = _pad_log_lines(caplog)
    assert len(lines) == 1 and f"eos token {expected!r}" in lines[0]


def test_the_pad_line_is_logged_on_rank_0_only(tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="ds_cluster.data.special_tokens"):
        monkeypatch.setenv("RANK", "1")
        assert ensure_pad_token(load_tokenizer("gpt2", tmp_path / "a")) == "<|endoftext|>"
        assert ensure_pad_token(load_tokenizer("gpt2", tmp_path / "b"), rank=1) == "<|endoftext|>"
        assert _pad_log_lines(caplog) == []
        ensure_pad_token(load_tokenizer("gpt2", tmp_path / "c"), rank=0)  # the argument wins over RANK
    assert len(_pad_log_lines(caplog)) == 1


def test_pad_falls_back_to_unk_then_to_nothing(stories):
    stories.eos_token = None
    assert ensure_pad_token(stories, rank=1) == "<unk>" and stories.pad_token_id == 0
    stories.pad_token = stories.unk_token = None
    assert ensure_pad_token(stories, rank=1) is None and stories.pad_token is None


def test_a_tokenizer_with_pad_is_left_alone(tmp_path, caplog):
    smollm2 = load_tokenizer("smollm2", tmp_path)
    with caplog.at_level(logging.INFO, logger="ds_cluster.data.special_tokens"):
        assert ensure_pad_token(smollm2) == "<|im_end|>"
    assert _pad_log_lines(caplog) == []


@pytest.mark.parametrize("name", ["stories260k", "gpt2"])
def test_mask_and_labels_come_from_lengths_when_pad_is_eos(name, tmp_path):
    """pad == eos here: the closing eos is attended and labelled, the padding after it is not, and GPT-2's bos
    (also its eos and pad) at position 0 is attended."""
    tokenizer = load_tokenizer(name, tmp_path)
    records = [RECORD, dict(RECORD, output="Yes.", input="")]
    dataset = load_instruction_dataset(records, tokenizer, max_length=80)
    eos = tokenizer.eos_token_id
    for record, item in zip(records, dataset):
        length = int(item["attention_mask"].sum())
        assert item["attention_mask"][:length].all() and not item["attention_mask"][length:].any()
        assert item["input_ids"][0] == tokenizer.bos_token_id and item["input_ids"][length - 1] == eos
        assert item["labels"][length - 1] == eos and (item["labels"][length:] == IGNORE_INDEX).all()
        assert (item["input_ids"][length:] == eos).all()  # the padding: the same id as the labelled eos
        labelled = (item["labels"] != IGNORE_INDEX).nonzero().flatten().tolist()
        response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [eos]
        assert labelled == list(range(length - len(response), length))
        assert item["labels"][labelled].tolist() == response
    assert dataset.categories == ["story", "story"]


def test_no_bos_is_prepended_for_a_tokenizer_without_one(stories):
    prompt_ids = stories(format_prompt(RECORD), add_special_tokens=False)["input_ids"]
    assert encode_prompt(stories, RECORD) == [stories.bos_token_id] + prompt_ids
    stories.bos_token = None
    assert bos_prefix(stories) == [] and encode_prompt(stories, RECORD) == prompt_ids
    ids, labels = encode_example(stories, RECORD, max_length=200)
    assert ids[:len(prompt_ids)] == prompt_ids and labels[:len(prompt_ids)] == [IGNORE_INDEX] * len(prompt_ids)
    # Truncated: the prompt loses its start (no bos to keep), then the response its end.
    ids, labels = encode_example(stories, RECORD, max_length=10)
    response = stories(RECORD["output"], add_special_tokens=False)["input_ids"]
    assert ids == response[:10] and labels == response[:10]


def test_an_alpaca_record_needs_an_eos_token(stories):
    stories.eos_token = None
    with pytest.raises(ValueError, match=r"record 0: .*has none: set tokenizer.eos_token"):
        encode_example(stories, RECORD, max_length=64)


def test_load_model_and_tokenizer_gives_a_pad_token_and_padding_never_counts(tmp_path, caplog, monkeypatch):
    """The shared loader of train, the CLI and the benchmarks: a pad-less checkpoint loads with pad = eos; a
    batch's per-sample losses and labelled-token counts are those of each sample alone, unpadded."""
    from ds_cluster.data.dataset import trim_padding_collate
    from ds_cluster.loader.loss import token_loss_sums
    from ds_cluster.data.models import load_model_and_tokenizer

    monkeypatch.delenv("RANK", raising=False)
    folder = tiny_model_folder("stories260k", tmp_path)
    with caplog.at_level(logging.INFO, logger="ds_cluster.data.special_tokens"):
        model, tokenizer = load_model_and_tokenizer(folder)
    assert tokenizer.pad_token == "</s>" and model.generation_config.pad_token_id == tokenizer.eos_token_id
    assert len(_pad_log_lines(caplog)) == 1
    records = [RECORD, dict(RECORD, output="No."), dict(RECORD, instruction="Go.", output="A dog ran far away.")]
    dataset = load_instruction_dataset(records, tokenizer, max_length=96)
    assert len(_pad_log_lines(caplog)) == 1  # the loader already set pad: the dataset says nothing more
    model.eval()
    batch = trim_padding_collate([dataset[i] for i in range(len(dataset))])
    with torch.no_grad():
        sums, counts = token_loss_sums(model(input_ids=batch["input_ids"],
                                             attention_mask=batch["attention_mask"]).logits, batch["labels"])
        for row in range(len(dataset)):
            length = int(dataset[row]["attention_mask"].sum())
            alone = {key: value[:length].unsqueeze(0) for key, value in dataset[row].items()}
            alone_sum, alone_count = token_loss_sums(model(input_ids=alone["input_ids"]).logits, alone["labels"])
            assert torch.allclose(sums[row], alone_sum[0], rtol=1e-5, atol=1e-5)
            assert counts[row] == alone_count[0] == (dataset[row]["labels"] != IGNORE_INDEX).sum()


def test_the_pad_fallback_is_saved_with_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from ds_cluster.data.models import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer(tiny_model_folder("gpt2", tmp_path), rank=1)
    tokenizer.save_pretrained(tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True).pad_token == "<|endoftext|>"


def test_fixture_folders_hold_only_the_documented_files():
    listed = {path.relative_to(FIXTURES).as_posix() for path in FIXTURES.rglob("*")
              if path.is_file() and "__pycache__" not in path.parts}
    readme = (FIXTURES / "README.md").read_text()
    for name in sorted(listed - {"README.md", "__init__.py", "make_fixtures.py"}):
        folder, file = Path(name).parts
        assert f"`{folder}/`" in readme and (file == "LICENSE" or f"`{file}`" in readme), name
