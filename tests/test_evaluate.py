"""Held-out answer loss and greedy exact match per group (ds_cluster.evaluate), on the toy world's fresh tiny model."""
from __future__ import annotations

import math

import pytest
import torch

from bench.toy.models import tiny_model
from bench.toy.tasks import FAMILIES, generate_mixture
from ds_cluster import evaluate
from ds_cluster.data.dataset import IGNORE_INDEX, encode_prompt, load_instruction_dataset
from tests.reference import greedy_by_hand


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
    losses = evaluate.answer_loss_by_group(model, dataset, batch_size=7)
    assert model.training  # the caller's mode is restored
    assert set(losses) == set(FAMILIES)
    # An untrained model is close to uniform over the vocabulary.
    assert all(math.isfinite(v) and abs(v - math.log(len(tokenizer))) < 1.5 for v in losses.values())
    # Batching does not change the numbers.
    per_sample = evaluate.answer_nll(model, dataset, batch_size=len(dataset))
    assert torch.allclose(per_sample, evaluate.answer_nll(model, dataset, batch_size=5), atol=1e-5)
    # Without the end token: the mean over the answer tokens only, by hand for one sample.
    with torch.no_grad():
        logits = model(input_ids=dataset.input_ids[:1], attention_mask=dataset.attention_mask[:1]).logits[0, :-1]
    targets = dataset.labels[0, 1:]
    positions = torch.nonzero(targets != IGNORE_INDEX).squeeze(1)[:-1]  # the last one is </s>
    by_hand = torch.nn.functional.cross_entropy(logits[positions], targets[positions])
    assert per_sample[0].item() == pytest.approx(by_hand.item(), rel=1e-5)
    with_eos = evaluate.answer_nll(model, dataset, batch_size=8, include_eos=True)
    assert not torch.allclose(with_eos, per_sample)


def test_batched_left_padded_generation_matchesgreedy_by_hand(model_and_tokenizer, heldout):
    model, tokenizer = model_and_tokenizer
    # Prompts of different lengths in one batch; short answers, so the floor of 6 new tokens holds.
    records = [dict(record, output=record["output"][:2]) for record in heldout[::3]]
    assert evaluate.generation_budget(tokenizer, records, max_new_tokens=6) == 6
    batched = evaluate.greedy_answers(model, tokenizer, records, max_new_tokens=6, batch_size=len(records))
    assert batched == [greedy_by_hand(model, tokenizer, record, 6) for record in records]
    assert evaluate.greedy_answers(model, tokenizer, records, max_new_tokens=6, batch_size=1) == batched


LONG_ANSWER = "abcdefghij-klmnopqrst-uv"  # 24 characters, 24 tokens: past the old fixed cut of 16


def test_generation_runs_to_the_longest_reference_answer_of_the_batch_plus_a_margin(model_and_tokenizer, heldout):
    model, tokenizer = model_and_tokenizer
    records = [dict(heldout[0], output=LONG_ANSWER), dict(heldout[1], output="ab")]
    assert evaluate.answer_token_count(tokenizer, records[0]) == len(LONG_ANSWER) > 16
    budget = len(LONG_ANSWER) + evaluate.ANSWER_MARGIN_TOKENS
    assert evaluate.generation_budget(tokenizer, records) == budget
    assert evaluate.generation_budget(tokenizer, records, max_new_tokens=40) == 40  # a floor, never a cut
    assert evaluate.generation_budget(tokenizer, records, max_new_tokens=16) == budget
    # The real model and generate: both records get the batch's budget, as greedy decoding by hand does.
    answers = evaluate.greedy_answers(model, tokenizer, records, batch_size=2)
    assert answers == [greedy_by_hand(model, tokenizer, record, budget) for record in records]
    assert max(len(tokenizer(answer, add_special_tokens=False)["input_ids"]) for answer in answers) > 16
    # Alone, the short record's batch gets only its own budget.
    assert evaluate.greedy_answers(model, tokenizer, records[1:], batch_size=1) == [
        greedy_by_hand(model, tokenizer, records[1], 2 + evaluate.ANSWER_MARGIN_TOKENS)]


class _AnswerKeyModel(torch.nn.Module):
    """A model whose greedy output is known: it answers every prompt with its record's reference, then </s>.

    It honours generate's max_new_tokens as Hugging Face does (the end token
    counts as a new token), and records the budget of every call.
    """

    def __init__(self, tokenizer, records):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the evaluation reads the device from a parameter
        self.tokenizer = tokenizer
        self.answer_of = {tuple(encode_prompt(tokenizer, r)): tokenizer(r["output"], add_special_tokens=False)
                          ["input_ids"] + [tokenizer.eos_token_id] for r in records}
        self.budgets: list[int] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **_):
        self.budgets.append(max_new_tokens)
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = tuple(token for token, keep in zip(ids, mask) if keep)
            rows.append(ids + self.answer_of[prompt][:max_new_tokens])
        width = max(len(row) for row in rows)
        return torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows])


def test_exact_match_scores_answers_longer_than_16_tokens(model_and_tokenizer, heldout):
    _, tokenizer = model_and_tokenizer
    records = [dict(record, output=LONG_ANSWER[:18 + i % 7]) for i, record in enumerate(heldout[:12])]
    model = _AnswerKeyModel(tokenizer, records)
    # The old fixed cut of 16 new tokens scored every one of these right answers wrong.
    cut = [tokenizer.decode(model.answer_of[tuple(encode_prompt(tokenizer, r))][:16]) for r in records]
    assert all(value == 0.0 for value in evaluate.score_answers(records, cut).values())
    scores = evaluate.exact_match_by_group(model, tokenizer, records, groups=FAMILIES, batch_size=5)
    assert scores and all(value == 1.0 for value in scores.values())
    # One budget per batch: the longest answer among the batch's records (sorted by prompt length) + the margin.
    order = sorted(range(len(records)), key=lambda i: len(encode_prompt(tokenizer, records[i])))
    expected = [max(len(records[i]["output"]) for i in order[start:start + 5]) + evaluate.ANSWER_MARGIN_TOKENS
                for start in range(0, len(records), 5)]
    assert model.budgets == expected


def test_exact_match_counts_correct_answers(heldout):
    records = [r for r in heldout if r["family"] in ("rotate", "reverse")]
    answers = [r["output"] if i % 2 == 0 else r["output"] + "x" for i, r in enumerate(records)]
    answers[0] = f"  {records[0]['output']}\n"  # surrounding whitespace does not count
    scores = evaluate.score_answers(records, answers)
    expected = {family: sum(1 for i, r in enumerate(records) if r["family"] == family and i % 2 == 0)
                / sum(1 for r in records if r["family"] == family) for family in ("rotate", "reverse")}
    assert scores == pytest.approx(expected)


def test_summarize_reports_macro_and_worst_group():
    summary = evaluate.summarize({"a": 1.0, "b": 0.5, "c": 0.0}, higher_is_better=True)
    assert summary["macro"] == pytest.approx(0.5)
    assert (summary["worst_group"], summary["worst"]) == ("c", 0.0)
    losses = evaluate.summarize({"a": 0.1, "b": 2.0})  # a loss by default: higher is worse
    assert (losses["worst_group"], losses["worst"]) == ("b", 2.0)
    with pytest.raises(ValueError):
        evaluate.summarize({})
