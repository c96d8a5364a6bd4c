"""Reference implementations the tests compare the fast paths against."""
from __future__ import annotations

import torch

from ds_cluster.data.dataset import encode_prompt


def greedy_by_hand(model, tokenizer, record: dict, max_new_tokens: int) -> str:
    """Greedy decoding the slow way: the whole sequence again for every token, no padding, no cache."""
    ids = encode_prompt(tokenizer, record)
    answer: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids + answer])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            answer.append(token)
    return tokenizer.decode(answer, skip_special_tokens=True)
