"""Held-out answer loss and greedy exact match per family (the toy world's evaluation), on a fresh tiny model."""
from __future__ import annotations

import math

import pytest
import torch

from ds_cluster.dataset import IGNORE_INDEX, encode_prompt, load_instruction_dataset
from ds_cluster.toy import evaluate
from ds_cluster.toy.models import tiny_model
from ds_cluster.toy.tasks import FAMILIES, generate_mixture


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    # Four records of every family, so every family is represented.
    _, heldout = generate_mixture(seed=0, total=200, heldout_per_family=4)
    return heldout


def test_answer_loss_is_finite_for_every_family_and_leaves_out_the_end_token(model_and_tokenizer, heldout):
    model, tokenizer = model_and_tokenizer
    dataset = load_instruction_dataset(heldout, tokenizer, max_length=64)
    model.train()
    losses = evaluate.answer_loss_by_family(model, dataset, batch_size=7)
    assert model.training  # the caller's mode is restored
    assert set(losses) == set(FAMILIES)
    # An untrained model is close to uniform over the vocabulary.
    assert all(math.isfinite(v) and abs(v - math.log(len(tokenizer))) < 1.5 for v in losses.values())
    # Batching does not change the numbers.
    per_sample = evaluate.answer_loss(model, dataset, batch_size=len(dataset))
    assert torch.allclose(per_sample, evaluate.answer_loss(model, dataset, batch_size=5), atol=1e-5)
    # Without the end token: the mean over the answer tokens only, by hand for one sample.
    with torch.no_grad():
        logits = model(input_ids=dataset.input_ids[:1], attention_mask=dataset.attention_mask[:1]).logits[0, :-1]
    targets = dataset.labels[0, 1:]
    positions = torch.nonzero(targets != IGNORE_INDEX).squeeze(1)[:-1]  # the last one is </s>
    by_hand = torch.nn.functional.cross_entropy(logits[positions], targets[positions])
    assert per_sample[0].item() == pytest.approx(by_hand.item(), rel=1e-5)
    with_eos = evaluate.answer_loss(model, dataset, batch_size=8, include_eos=True)
    assert not torch.allclose(with_eos, per_sample)


def _greedy_by_hand(model, tokenizer, record, max_new_tokens: int) -> str:
    """Greedy decoding the slow way: the whole sequence again for every token, no padding, no cache."""
    ids = encode_prompt(tokenizer, record)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
    return tokenizer.decode(out, skip_special_tokens=True)


def test_batched_left_padded_generation_matches_greedy_by_hand(model_and_tokenizer, heldout):
    model, tokenizer = model_and_tokenizer
    records = heldout[::3]  # prompts of different lengths in one batch
    batched = evaluate.greedy_answers(model, tokenizer, records, max_new_tokens=6, batch_size=len(records))
    assert batched == [_greedy_by_hand(model, tokenizer, record, 6) for record in records]
    assert evaluate.greedy_answers(model, tokenizer, records, max_new_tokens=6, batch_size=1) == batched


def test_exact_match_counts_correct_answers(heldout):
    records = [r for r in heldout if r["family"] in ("rotate", "reverse")]
    answers = [r["output"] if i % 2 == 0 else r["output"] + "x" for i, r in enumerate(records)]
    answers[0] = f"  {records[0]['output']}\n"  # surrounding whitespace does not count
    scores = evaluate.score_answers(records, answers)
    expected = {family: sum(1 for i, r in enumerate(records) if r["family"] == family and i % 2 == 0)
                / sum(1 for r in records if r["family"] == family) for family in ("rotate", "reverse")}
    assert scores == pytest.approx(expected)


def test_summarize_reports_macro_and_worst_family():
    summary = evaluate.summarize({"a": 1.0, "b": 0.5, "c": 0.0})
    assert summary["macro"] == pytest.approx(0.5)
    assert (summary["worst_family"], summary["worst"]) == ("c", 0.0)
    losses = evaluate.summarize({"a": 0.1, "b": 2.0}, higher_is_better=False)
    assert (losses["worst_family"], losses["worst"]) == ("b", 2.0)
    with pytest.raises(ValueError):
        evaluate.summarize({})
