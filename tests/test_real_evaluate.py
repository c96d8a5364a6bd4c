"""ds_cluster.evaluate against the slow way of computing the same numbers, with stories260K on T0 records."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ds_cluster.data.dataset import (IGNORE_INDEX, InstructionDataset, encode_example, read_records,
                                write_jsonl)
from ds_cluster.data.models import load_model_and_tokenizer
from bench.real import STORIES260K_DIR, T0_DIR
from ds_cluster import evaluate
from tests.reference import greedy_by_hand

MAX_LENGTH = 272  # the longest T0 record, prompt and answer, is 265 stories260K tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here: on a shared 2-core machine a second thread spin-waits for a busy core, and these
    small forwards took 10x longer (40 s against 3 s for the module, measured with the other core busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model_and_tokenizer(STORIES260K_DIR, rank=1)


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    return read_records(T0_DIR / "heldout.jsonl.gz")


@pytest.fixture(scope="module")
def few(heldout) -> list[dict]:
    """Two records of every group, of different lengths, so batches mix lengths."""
    groups = sorted({r["family"] for r in heldout})
    return [r for group in groups for r in [r for r in heldout if r["family"] == group][:2]]


def _answer_nll_one_by_one(model, tokenizer, record: dict, include_eos: bool) -> float:
    """One record, unpadded, its own forward: the mean NLL of its answer tokens (and of eos when asked)."""
    ids, labels = encode_example(tokenizer, record, MAX_LENGTH)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    targets = torch.tensor(labels[1:])
    keep = targets != IGNORE_INDEX
    if not include_eos:
        keep[keep.nonzero().max()] = False  # the last labelled token is the end token
    nll = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="none")
    return float(nll.mean())


@pytest.mark.parametrize("include_eos", [False, True])
def test_answer_nll_is_each_records_own_mean_answer_nll(model_and_tokenizer, few, include_eos):
    model, tokenizer = model_and_tokenizer
    dataset = InstructionDataset(few, tokenizer, max_length=MAX_LENGTH, rank=1)
    batched = evaluate.answer_nll(model, dataset, batch_size=3, include_eos=include_eos)
    expected = [_answer_nll_one_by_one(model, tokenizer, record, include_eos) for record in few]
    assert batched.shape == (len(few),)
    assert torch.allclose(batched, torch.tensor(expected), atol=1e-4), (batched, expected)


def test_answer_loss_by_group_is_the_mean_of_its_records(model_and_tokenizer, few):
    model, tokenizer = model_and_tokenizer
    dataset = InstructionDataset(few, tokenizer, max_length=MAX_LENGTH, rank=1)
    per_record = evaluate.answer_nll(model, dataset).tolist()
    by_group = evaluate.answer_loss_by_group(model, dataset)
    assert list(by_group) == sorted({r["family"] for r in few})
    for group, value in by_group.items():
        mine = [loss for loss, record in zip(per_record, few) if record["family"] == group]
        assert value == pytest.approx(sum(mine) / len(mine))


def test_mean_by_group_leaves_records_without_answer_out():
    means = evaluate.mean_by_group([1.0, float("nan"), 3.0, float("nan")], ["a", "a", "b", "c"])
    assert means == {"a": 1.0, "b": 3.0}


def test_the_label_groups_of_t0_are_the_ones_with_few_distinct_answers(heldout):
    assert evaluate.categorical_groups(heldout) == ["paraphrase_identification", "sentiment", "topic_classification"]


def test_greedy_answers_of_left_padded_batches_are_the_unpadded_ones(model_and_tokenizer, few):
    model, tokenizer = model_and_tokenizer
    records = [dict(r, output="one two") for r in few[:5]]  # a short reference: few new tokens to compare
    budget = len(tokenizer("one two", add_special_tokens=False)["input_ids"]) + evaluate.ANSWER_MARGIN_TOKENS
    batched = evaluate.greedy_answers(model, tokenizer, records, batch_size=4)
    assert batched == [greedy_by_hand(model, tokenizer, record, budget) for record in records]


def test_exact_match_scores_the_greedy_answers_of_the_named_groups_only(model_and_tokenizer, few, monkeypatch):
    model, tokenizer = model_and_tokenizer
    asked: list[list[str]] = []

    def answers(_model, _tokenizer, records, batch_size=32, max_new_tokens=None, synced_gpus=False):
        # The reference answer itself, except for closed-book QA.
        asked.append([r["family"] for r in records])
        return [f"  {r['output']} " if r["family"] != "closed_book_qa" else "no" for r in records]

    monkeypatch.setattr(evaluate, "greedy_answers", answers)
    scores = evaluate.exact_match_by_group(model, tokenizer, few, ["closed_book_qa", "sentiment"])
    assert scores == {"closed_book_qa": 0.0, "sentiment": 1.0}  # surrounding spaces ignored
    assert sorted(asked[0]) == ["closed_book_qa"] * 2 + ["sentiment"] * 2  # only the named groups generated


def test_summaries_pick_the_worst_group_in_the_right_direction():
    losses = evaluate.summarize({"a": 1.0, "b": 3.0})
    assert (losses["macro"], losses["worst"], losses["worst_group"], losses["num_groups"]) == (2.0, 3.0, "b", 2)
    exact = evaluate.summarize({"a": 0.5, "b": 0.9}, higher_is_better=True)
    assert (exact["worst"], exact["worst_group"]) == (0.5, "a")
    with pytest.raises(ValueError, match="no groups"):
        evaluate.summarize({})


def test_evaluate_model_scores_every_group_and_exact_match_on_the_label_groups(model_and_tokenizer, few):
    model, tokenizer = model_and_tokenizer
    result = evaluate.evaluate_model(model, tokenizer, few, MAX_LENGTH, exact_match_groups=["sentiment"])
    assert set(result["answer_loss"]) == {r["family"] for r in few} and result["num_records"] == len(few)
    assert all(math.isfinite(value) and value > 0 for value in result["answer_loss"].values())
    assert list(result["exact_match"]) == ["sentiment"]
    assert result["answer_loss_summary"]["worst"] == max(result["answer_loss"].values())


def test_the_command_line_writes_every_models_results(few, tmp_path):
    write_jsonl(few, tmp_path / "heldout.jsonl")
    assert evaluate.main(["--model", str(STORIES260K_DIR), "--data", str(tmp_path / "heldout.jsonl"),
                          "--max-length", str(MAX_LENGTH), "--out", str(tmp_path / "results.json")]) == 0
    (result,) = json.loads((tmp_path / "results.json").read_text()).values()
    assert set(result["answer_loss"]) == {r["family"] for r in few}
    assert set(result["exact_match"]) <= set(result["answer_loss"])
