"""The output layer's matrix read in float32 a block of vocabulary rows at a time.

The features take their logits, and the lora kind its gradient at the output layer's input, in float32 whatever the
model's precision: the softmax of a large vocabulary is where bf16 would lose the most. Casting the whole
(vocabulary x hidden) matrix would be a second copy of the largest layer, twice its bf16 bytes (0.4 GB for
SmolLM2-1.7B, 4.2 GB for a 128k-vocabulary 70B model, on every rank); a block of `BLOCK_ELEMENTS` at a time is
64 MiB. A float32 matrix is read in place (a block is then a view, not a copy).
"""
from __future__ import annotations

from typing import Optional

import torch

BLOCK_ELEMENTS = 1 << 24  # float32 values of one block of vocabulary rows: 64 MiB


class OutputMatrix:
    """W (V x H) and its bias (V,) in any dtype; logits and input gradients in float32, a block of rows at a time."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 block_elements: int = BLOCK_ELEMENTS) -> None:
        self.weight, self.bias = weight, bias
        vocab, hidden = weight.shape
        rows = max(1, block_elements // max(1, hidden))
        self.blocks = [slice(start, min(vocab, start + rows)) for start in range(0, vocab, rows)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 logits of n hidden states (n, H)."""
        hidden = hidden.float()
        if len(self.blocks) == 1:
            return torch.nn.functional.linear(hidden, self.weight.float(),
                                              None if self.bias is None else self.bias.float())
        out = torch.empty(hidden.shape[0], self.weight.shape[0], dtype=torch.float32, device=hidden.device)
        for block in self.blocks:
            bias = None if self.bias is None else self.bias[block].float()
            out[:, block] = torch.nn.functional.linear(hidden, self.weight[block].float(), bias)
        return out

    def input_gradient(self, coefficients: torch.Tensor) -> torch.Tensor:
        """(n, H) float32: coefficients (n, V) times W, the gradient at the layer's input of a loss whose gradient at
        the logits is `coefficients`."""
        if len(self.blocks) == 1:
            return coefficients @ self.weight.float()
        out = torch.zeros(coefficients.shape[0], self.weight.shape[1], dtype=torch.float32,
                          device=coefficients.device)
        for block in self.blocks:
            out += coefficients[:, block] @ self.weight[block].float()
        return out
