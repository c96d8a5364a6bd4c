"""The synthetic task mixture, the shipped default data, the tokenizer and the instruction dataset."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from ds_cluster.data.dataset import (
    IGNORE_INDEX,
    dataset_fingerprint,
    format_prompt,
    load_instruction_dataset,
    read_jsonl,
    read_records,
    trim_padding_collate,
    write_jsonl,
)
from bench.toy import pretraining, tasks
from ds_cluster.evaluate import check_answer
from bench.toy.tokenizer import build_tokenizer

DEFAULT_DIR = tasks.DEFAULT_DATA


@pytest.fixture(scope="module")
def mixture() -> tuple[list[dict], list[dict]]:
    return tasks.generate_mixture(seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_same_seed_same_records_other_seed_other_records(mixture):
    assert tasks.generate_mixture(seed=0) == mixture
    other_train, other_heldout = tasks.generate_mixture(seed=1)
    assert other_train != mixture[0]
    assert other_heldout != mixture[1]


def test_family_sizes_are_skewed_and_heldout_is_fixed_per_family(mixture):
    train, heldout = mixture
    sizes = Counter(r["family"] for r in train)
    assert set(sizes) == set(tasks.FAMILIES) and len(tasks.FAMILIES) >= 8
    assert len(train) == tasks.DEFAULT_TOTAL
    assert max(sizes.values()) >= 16 * min(sizes.values())
    assert min(sizes.values()) >= 40
    assert [f for f, _ in sizes.most_common()] == list(tasks.FAMILIES)
    assert Counter(r["family"] for r in heldout) == {f: tasks.DEFAULT_HELDOUT_PER_FAMILY for f in tasks.FAMILIES}


def test_family_sizes_add_up_exactly():
    for total, skew in [(100, 1.0), (1001, 7.5), (2400, 16.0)]:
        sizes = tasks.family_sizes(total, skew)
        assert sum(sizes.values()) == total
        assert list(sizes.values()) == sorted(sizes.values(), reverse=True)


def test_heldout_is_disjoint_from_train(mixture):
    train, heldout = mixture
    train_keys = {(r["instruction"], r["input"]) for r in train}
    assert not train_keys & {(r["instruction"], r["input"]) for r in heldout}
    assert len(train_keys) == len(train)


def test_records_are_short_and_well_formed(mixture):
    train, heldout = mixture
    for record in train + heldout:
        assert set(record) == {"instruction", "input", "output", "family"}
        assert all(isinstance(v, str) and v for v in record.values())
        assert len(record["instruction"]) + len(record["input"]) + len(record["output"]) <= 64


def test_check_answer_accepts_gold_and_rejects_wrong_for_every_family(mixture):
    _, heldout = mixture
    for family in tasks.FAMILIES:
        record = next(r for r in heldout if r["family"] == family)
        assert check_answer(record, record["output"])
        assert check_answer(record, f"  {record['output']}\n")
        assert not check_answer(record, record["output"] + "0")
        assert not check_answer(record, "")


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_gold_answers_are_correct(mixture, family):
    # Recompute each family's answer from its input a second, independent way.
    def solve(record: dict) -> str:
        text = record["input"]
        if family == "reverse":
            return "".join(reversed(text))
        if family == "rotate":
            return text[1:] + text[:1]
        if family == "swap_case":
            return "".join(c.lower() if c.isupper() else c.upper() for c in text)
        if family == "double":
            return "".join(c * 2 for c in text)
        if family == "first_last":
            return text[0] + text[-1]
        if family == "dashes":
            return "".join(c + "-" for c in text)[:-1]
        if family == "km_to_m":
            return f"{int(text.split()[0]) * 1000} m"
        year, month, day = text.split("-")
        return f"{day}/{month}/{year}"

    train, heldout = mixture
    for record in [r for r in train + heldout if r["family"] == family]:
        assert solve(record) == record["output"], record


def test_pretraining_corpus_is_deterministic_and_not_the_tasks(mixture):
    corpus, copied = pretraining.generate_pretraining_corpus(seed=0, count=300)
    assert (corpus, copied) == pretraining.generate_pretraining_corpus(seed=0, count=300)
    assert corpus != pretraining.generate_pretraining_corpus(seed=1, count=300)[0]
    instructions = {r["instruction"] for r in mixture[0]}
    assert not any(instruction in text for text in corpus for instruction in instructions)


def test_copy_probe_is_fresh_random_letters():
    _, copied = pretraining.generate_pretraining_corpus(seed=0, count=2000)
    probe = pretraining.copy_probe_records(count=100, seed=1000, exclude=copied)
    assert probe == pretraining.copy_probe_records(count=100, seed=1000, exclude=copied)
    assert len({r["input"] for r in probe}) == 100 and not {r["input"] for r in probe} & copied
    for record in probe:
        assert record["output"] == record["input"] and 3 <= len(record["input"]) <= 8
        assert record["input"].isalpha() and record["input"].islower() and record["family"] == "copy"


def test_other_orders_and_unknown_families(tmp_path):
    second = dict(tasks.SECOND_MIXTURE)
    train, heldout = tasks.generate_mixture(**second)
    sizes = Counter(r["family"] for r in train)
    assert [f for f, _ in sizes.most_common()] == list(second["families"]) and len(train) == second["total"]
    assert not {(r["family"], r["input"]) for r in train} & {(r["family"], r["input"]) for r in heldout}
    with pytest.raises(ValueError, match="unknown task families"):
        tasks.generate_mixture(families=("reverse", "count_letter"))


def test_jsonl_round_trip_is_atomic(tmp_path, mixture):
    path = tmp_path / "sub" / "train.jsonl"
    write_jsonl(mixture[1], path)
    assert read_jsonl(path) == mixture[1]
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"]  # no temp file left behind


def test_cli_writes_both_splits(tmp_path):
    tasks.main(["--out", str(tmp_path), "--seed", "3", "--total", "200", "--heldout-per-family", "5"])
    train, heldout = tasks.generate_mixture(seed=3, total=200, heldout_per_family=5)
    assert read_jsonl(tmp_path / "train.jsonl") == train
    assert read_jsonl(tmp_path / "heldout.jsonl") == heldout


def test_shipped_default_data_is_the_seed_0_mixture(tmp_path, mixture):
    write_jsonl(mixture[0], tmp_path / "train.jsonl")
    write_jsonl(mixture[1], tmp_path / "heldout.jsonl")
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (DEFAULT_DIR / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_tokenizer_round_trip_and_reload(tmp_path, tokenizer, mixture):
    from transformers import AutoTokenizer

    text = format_prompt(mixture[0][0]) + mixture[0][0]["output"] + " ~\t{x}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # One token per character, except the three template headers.
    assert len(ids) < len(text) and tokenizer.unk_token_id not in ids
    specials = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    assert specials == [0, 1, 2, 3]
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab()

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
    assert reloaded.decode(ids) == text
    assert reloaded.pad_token_id == tokenizer.pad_token_id and reloaded.eos_token_id == tokenizer.eos_token_id


def test_format_prompt_omits_empty_input():
    with_input = format_prompt({"instruction": "Do it.", "input": "x", "output": "y"})
    assert with_input == "### Instruction:\nDo it.\n\n### Input:\nx\n\n### Response:\n"
    assert format_prompt({"instruction": "Do it.", "input": "", "output": "y"}) == (
        "### Instruction:\nDo it.\n\n### Response:\n"
    )


def test_instruction_dataset_masks_the_prompt(tokenizer, mixture):
    records = mixture[1][:20]
    dataset = load_instruction_dataset(records, tokenizer, max_length=96)
    assert len(dataset) == 20 and dataset.categories == [r["family"] for r in records]
    for record, item in zip(records, dataset):
        assert set(item) == {"input_ids", "attention_mask", "labels"}
        assert all(t.dtype == torch.int64 and t.shape == (96,) for t in item.values())
        length = int(item["attention_mask"].sum())
        assert item["attention_mask"][:length].all() and not item["attention_mask"][length:].any()
        assert item["input_ids"][0] == tokenizer.bos_token_id
        assert item["input_ids"][length - 1] == tokenizer.eos_token_id
        assert (item["input_ids"][length:] == tokenizer.pad_token_id).all()
        labelled = item["labels"] != IGNORE_INDEX
        assert (item["labels"][labelled] == item["input_ids"][labelled]).all()
        response = item["input_ids"][labelled].tolist()
        assert tokenizer.decode(response[:-1]) == record["output"] and response[-1] == tokenizer.eos_token_id
        # The labelled tokens are exactly the tail of the real sequence.
        assert labelled.nonzero().flatten().tolist() == list(range(length - len(response), length))


def test_trimming_the_shared_padding_keeps_each_samples_loss(tokenizer, mixture):
    """The training script's collate cuts the columns no row attends to (to a multiple of 8): fewer columns, same
    per-sample loss."""
    from ds_cluster.loader.loss import token_loss_sums
    from bench.toy.models import tiny_model

    dataset = load_instruction_dataset(mixture[0][:6], tokenizer, max_length=96)
    items = [dataset[i] for i in range(len(dataset))]
    padded = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    trimmed = trim_padding_collate(items)
    longest = int(padded["attention_mask"].sum(dim=1).max())
    width = -(-longest // 8) * 8  # rounded up to a multiple of 8 (PAD_MULTIPLE)
    assert trimmed["input_ids"].shape == (6, width) and width < padded["input_ids"].shape[1]
    assert torch.equal(trimmed["labels"], padded["labels"][:, :width])
    model = tiny_model(seed=0)[0].eval()
    with torch.no_grad():
        losses = [token_loss_sums(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                  batch["labels"]) for batch in (padded, trimmed)]
    assert torch.allclose(losses[0][0], losses[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(losses[0][1], losses[1][1])
    # Left padding (the last column in use) keeps the full width.
    flipped = [{key: value.flip(0) for key, value in item.items()} for item in items]
    assert trim_padding_collate(flipped)["input_ids"].shape == padded["input_ids"].shape


def test_truncation_drops_the_prompt_first(tokenizer):
    record = {"instruction": "Say a long thing. " * 5, "input": "abc", "output": "answer", "family": "f"}
    item = load_instruction_dataset([record], tokenizer, max_length=24)[0]
    assert int(item["attention_mask"].sum()) == 24
    assert item["input_ids"][0] == tokenizer.bos_token_id
    labelled = item["labels"] != IGNORE_INDEX
    assert tokenizer.decode(item["input_ids"][labelled].tolist(), skip_special_tokens=True) == "answer"
    # Kept prompt is the end of the prompt, next to the response.
    assert tokenizer.decode(item["input_ids"][1:].tolist(), skip_special_tokens=True).endswith(
        "### Input:\nabc\n\n### Response:\nanswer"
    )
    # A response longer than the whole window keeps its start and is still labelled.
    long_answer = dict(record, output="x" * 40)
    item = load_instruction_dataset([long_answer], tokenizer, max_length=16)[0]
    assert (item["labels"][1:] == item["input_ids"][1:]).all() and item["labels"][0] == IGNORE_INDEX


def test_jsonl_and_save_to_disk_give_the_same_items(tmp_path, tokenizer, mixture):
    import datasets

    records = mixture[0][:50]
    write_jsonl(records, tmp_path / "train.jsonl")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))

    from_jsonl = load_instruction_dataset(tmp_path / "train.jsonl", tokenizer, max_length=80)
    from_disk = load_instruction_dataset(str(tmp_path / "hf"), tokenizer, max_length=80)
    assert from_disk.records == from_jsonl.records == records
    for a, b in zip(from_jsonl, from_disk):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert dataset_fingerprint(from_jsonl) == dataset_fingerprint(from_disk)
    batch = torch.utils.data.default_collate([from_disk[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 80)


def test_fingerprint_changes_with_the_data(tokenizer, mixture):
    records = mixture[0][:30]
    base = dataset_fingerprint(load_instruction_dataset(records, tokenizer))
    assert base == dataset_fingerprint(load_instruction_dataset(records, tokenizer))
    assert base != dataset_fingerprint(load_instruction_dataset(records[:29], tokenizer))
    assert base != dataset_fingerprint(load_instruction_dataset(records, tokenizer, max_length=64))
    changed = [dict(records[0], output=records[0]["output"] + "1")] + records[1:]
    assert base != dataset_fingerprint(load_instruction_dataset(changed, tokenizer))


def test_missing_source_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError):
        load_instruction_dataset(tmp_path / "nothing.jsonl", tokenizer)


def test_gzipped_jsonl_reads_like_plain_jsonl(tmp_path, mixture):
    import gzip

    records = mixture[1][:10]
    write_jsonl(records, tmp_path / "plain.jsonl")
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress((tmp_path / "plain.jsonl").read_bytes()))
    assert read_jsonl(tmp_path / "train.jsonl.gz") == read_records(str(tmp_path / "train.jsonl.gz")) == records
    # The content decides, not the suffix.
    (tmp_path / "named_plain.jsonl").write_bytes((tmp_path / "train.jsonl.gz").read_bytes())
    assert read_jsonl(tmp_path / "named_plain.jsonl") == records


def test_a_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3: not valid JSON"):
        read_jsonl(path)
    path.write_text('{"instruction": "a", "output": "b"}\n["a", "b"]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2: a record must be a JSON object, got list"):
        read_jsonl(path)


def test_categories_read_category_else_family(tokenizer):
    records = [{"instruction": "a", "output": "b", "category": "c1", "family": "f1"},
               {"instruction": "a", "output": "b", "family": "f2"},
               {"instruction": "a", "output": "b", "category": None, "family": "f3"},
               {"instruction": "a", "output": "b"}]
    dataset = load_instruction_dataset(records, tokenizer, max_length=32)
    assert dataset.categories == ["c1", "f2", "f3", ""]
