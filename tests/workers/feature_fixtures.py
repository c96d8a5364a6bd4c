"""Tiny models and token datasets shared by the feature tests and the workers they launch."""
from __future__ import annotations

from typing import Optional

import torch

VOCAB, HIDDEN, SEQ_LEN = 64, 32, 16


def tiny_llama(seed: int = 0, vocab: int = VOCAB, hidden: int = HIDDEN) -> torch.nn.Module:
    """A 2-layer Llama-architecture causal LM with untied output matrix, deterministic weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger output weights than the default init, so probabilities are far from uniform.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model.float().eval()


def token_dataset(num_samples: int, seed: int = 0, seq_len: int = SEQ_LEN, vocab: int = VOCAB,
                  empty: Optional[list[int]] = None) -> list[dict]:
    """Random prompt+response samples: the prompt masked with -100, right padding with mask 0 and -100.

    Samples listed in `empty` have no response token at all.
    """
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(num_samples):
        length = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=generator))
        prompt = int(torch.randint(1, length - 1, (1,), generator=generator))
        input_ids = torch.zeros(seq_len, dtype=torch.int64)
        input_ids[:length] = torch.randint(1, vocab, (length,), generator=generator)
        attention_mask = torch.zeros(seq_len, dtype=torch.int64)
        attention_mask[:length] = 1
        labels = torch.full((seq_len,), -100, dtype=torch.int64)
        if index not in (empty or []):
            labels[prompt:length] = input_ids[prompt:length]
        samples.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return samples


def tiny_lora_llama(seed: int = 0, rank: int = 4) -> torch.nn.Module:
    """`tiny_llama` with LoRA adapters of rank `rank` on every projection (peft), its lora_B matrices drawn at
    random (seeded) instead of peft's zeros, so both adapter matrices have non-zero gradients."""
    from ds_cluster.data.models import with_lora

    model = with_lora(tiny_llama(seed), rank)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()
