"""Held-out loss and greedy exact match per family, on a fresh tiny model."""
from __future__ import annotations

import math

import pytest
import torch

from ds_cluster import evaluate
from ds_cluster.data.instructions import load_instruction_dataset
from ds_cluster.data.tasks import FAMILIES, generate_mixture
from ds_cluster.models import load_model_and_tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model_and_tokenizer("tiny", seed=0)


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    # Four records of every family, so every family is represented.
    _, heldout = generate_mixture(seed=0, total=200, heldout_per_family=4)
    return heldout


def test_heldout_loss_is_finite_for_every_family(model_and_tokenizer, heldout):
    model, tokenizer = model_and_tokenizer
    dataset = load_instruction_dataset(heldout, tokenizer, max_length=64)
    model.train()
    losses = evaluate.heldout_loss_by_family(model, dataset, batch_size=7)
    assert model.training  # the caller's mode is restored
    assert set(losses) == set(FAMILIES)
    # An untrained model is close to uniform over the vocabulary.
    assert all(math.isfinite(v) and abs(v - math.log(len(tokenizer))) < 1.5 for v in losses.values())
    # Batching does not change the numbers.
    per_sample = evaluate.per_sample_loss(model, dataset, batch_size=len(dataset))
    assert torch.allclose(per_sample, evaluate.per_sample_loss(model, dataset, batch_size=5), atol=1e-5)


def test_greedy_decoding_returns_strings_and_accuracy_in_unit_interval(model_and_tokenizer, heldout):
    model, tokenizer = model_and_tokenizer
    answers = evaluate.greedy_generate(model, tokenizer, heldout, max_new_tokens=5, batch_size=16)
    assert len(answers) == len(heldout) and all(isinstance(a, str) for a in answers)
    accuracy = evaluate.exact_match_by_family(model, tokenizer, heldout, max_new_tokens=5, batch_size=16)
    assert set(accuracy) == set(FAMILIES) and all(0.0 <= v <= 1.0 for v in accuracy.values())


def test_batched_left_padded_decoding_matches_one_at_a_time(model_and_tokenizer, heldout):
    model, tokenizer = model_and_tokenizer
    records = heldout[::3]  # prompts of different lengths in one batch
    batched = evaluate.greedy_generate(model, tokenizer, records, max_new_tokens=6, batch_size=len(records))
    single = evaluate.greedy_generate(model, tokenizer, records, max_new_tokens=6, batch_size=1)
    assert batched == single
    # Without early stopping (the ZeRO-3 mode) the answers are the same.
    assert evaluate.greedy_generate(model, tokenizer, records, max_new_tokens=6, early_stop=False) == batched


class _Echo(torch.nn.Module):
    """A stand-in 'model' that always predicts a fixed answer then </s>: makes accuracy checkable."""

    def __init__(self, answer_ids: list[int], eos_id: int, vocab_size: int):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.answer = answer_ids + [eos_id]
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, cache=None):
        step = 0 if cache is None else cache
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], self.vocab_size)
        logits[:, -1, self.answer[min(step, len(self.answer) - 1)]] = 1.0
        return type("Output", (), {"logits": logits, "cache": step + 1})()


def test_exact_match_counts_correct_answers(model_and_tokenizer, heldout):
    _, tokenizer = model_and_tokenizer
    target = next(r for r in heldout if r["family"] == "add")
    echo = _Echo(tokenizer(target["output"], add_special_tokens=False)["input_ids"],
                 tokenizer.eos_token_id, len(tokenizer))
    records = [r for r in heldout if r["family"] == "add"]
    accuracy = evaluate.exact_match_by_family(echo, tokenizer, records, max_new_tokens=8)
    expected = sum(r["output"] == target["output"] for r in records) / len(records)
    assert accuracy == {"add": pytest.approx(expected)} and expected > 0


def test_summarize_reports_macro_and_worst_family():
    summary = evaluate.summarize({"a": 1.0, "b": 0.5, "c": 0.0})
    assert summary["macro_avg"] == pytest.approx(0.5)
    assert (summary["worst_family"], summary["worst"]) == ("c", 0.0)
    assert (summary["best_family"], summary["best"]) == ("a", 1.0)
    with pytest.raises(ValueError):
        evaluate.summarize({})
