"""The `lora` features: per-sample gradients of a PEFT model's LoRA adapters, projected, from one forward and one
backward per batch.

Every adapter matrix (a `lora_A` or `lora_B` linear layer) maps y = W a; the gradient of sample i's loss L_i (the
mean over its response tokens) is G_i = sum_t g_t a_t^T with g_t = dL_i/dy_t. Its projection through the layer's
seeded pair of count sketches (S_out, S_in) is sum_t outer(S_out^T g_t, S_in^T a_t), so G_i is never formed, on any
rank, under any ZeRO stage (the LoGra factorisation, as the lm_head kind's). Every layer draws its own independent
pair (`projection.layer_projection`), so the sum over layers is one random projection of all the adapters'
gradients together, to `dim` values. Sketches, not the Gaussian matrices of 0.6.0 and before: they take 12 bytes a
coordinate, where Gaussian projections of every adapter took as much memory as a 1.7B model's weights (3.3 GB on
every rank; a store of those rows is not resumed with these, `StoreManifest.adapter_projection`).

One backward of sum_i L_i gives every g_t at once (the samples of a causal LM batch do not interact). It starts at
the output layer's input h: dL_i/dh_t = (softmax_t - onehot_t) W / |R_i| at the response positions, computed a
chunk of positions at a time as the lm_head kind's logits are, so no (batch x length x vocabulary) tensor exists.
The backward (`torch.autograd.grad`) asks for the adapters' outputs only: no parameter gradient is made, so the
engine's gradient hooks (ZeRO's reductions) never run, and under ZeRO-3 the engine's module hooks gather each
layer's weights for the backward as they do for a training step.

With a fresh adapter (lora_B all zeros, as peft initialises it) lora_A's gradient is zero and lora_B's is
delta_t (A a_t)^T: the frozen layer's own gradient seen through the random lora_A, itself a projection of the full
layer's gradient.
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_cluster.data.dataset import IGNORE_INDEX
from ds_cluster.features.output_matrix import OutputMatrix
from ds_cluster.features.projection import SketchProjection, layer_projection

ADAPTER_MATRICES = ("lora_A", "lora_B")


def adapter_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The model's trainable LoRA matrices, in module order (the same on every rank of one model): the linear
    layers peft keeps under `lora_A` / `lora_B` whose weight trains (an inactive adapter's does not). ValueError
    naming the fix for a model without any."""
    layers = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if (len(parts) >= 2 and parts[-2] in ADAPTER_MATRICES and isinstance(module, torch.nn.Linear)
                and module.weight.requires_grad):
            layers.append((name, module))
    if not layers:
        raise ValueError(f"feature_kind 'lora' reads the per-sample gradients of LoRA adapters, and "
                         f"{type(model).__name__} has no trainable ones (no lora_A / lora_B layer whose weight "
                         "trains): wrap the model with peft (get_peft_model(model, LoraConfig(...)), or "
                         "ds_cluster.data.models.with_lora), or use feature_kind 'lm_head'")
    return layers


def adapter_projections(layers: list[tuple[str, torch.nn.Linear]], dim: int, seed: int
                        ) -> list[SketchProjection]:
    """Each layer's seeded projection of its (out x in) gradient to `dim` values (ZeRO-3's full shapes)."""
    projections = []
    for index, (_, layer) in enumerate(layers):
        out_features, in_features = tuple(getattr(layer.weight, "ds_shape", layer.weight.shape))
        projections.append(layer_projection(dim, int(out_features), int(in_features), seed, index))
    return projections


class AdapterCapture:
    """Forward hooks keeping each adapter layer's input (detached) and output (in the graph) of the last forward."""

    def __init__(self, layers: list[tuple[str, torch.nn.Linear]]) -> None:
        self.inputs: list[Optional[torch.Tensor]] = [None] * len(layers)
        self.outputs: list[Optional[torch.Tensor]] = [None] * len(layers)
        self._handles = [layer.register_forward_hook(self._keeper(index)) for index, (_, layer) in enumerate(layers)]

    def _keeper(self, index: int):
        def keep(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            self.inputs[index] = inputs[0].detach()
            self.outputs[index] = output
        return keep

    def clear(self) -> None:
        self.inputs = [None] * len(self.inputs)
        self.outputs = [None] * len(self.outputs)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.clear()


def loss_gradient_at_hidden(hidden: torch.Tensor, labels: torch.Tensor, output: OutputMatrix, chunk_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """d(sum_i L_i)/dh (B, T, H) float32, and the response-token counts (B,): at each response position t of sample
    i, (softmax_t - onehot_t) W / |R_i| (W the output matrix, read in float32 a block at a time), computed
    `chunk_size` positions at a time."""
    targets = labels[:, 1:].to(hidden.device)
    response = targets != IGNORE_INDEX
    counts = response.sum(dim=1)
    samples, positions = response.nonzero(as_tuple=True)
    weights = 1.0 / counts[samples].float()
    gold = targets[samples, positions]
    gradient = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, samples.numel(), chunk_size):
        part = slice(start, start + chunk_size)
        b, t = samples[part], positions[part]
        with torch.no_grad():
            probs = torch.softmax(output.logits(hidden[b, t]), dim=-1)
            probs[torch.arange(probs.shape[0], device=probs.device), gold[part]] -= 1.0
            gradient[b, t] = output.input_gradient(probs.mul_(weights[part, None]))
    return gradient, counts


def adapter_rows(hidden: torch.Tensor, hidden_gradient: torch.Tensor, capture: AdapterCapture,
                 projections: list[SketchProjection]) -> torch.Tensor:
    """(B, dim) float32: the projected per-sample adapter gradients, from one backward of `hidden_gradient`
    through the graph of the last forward (which must have run with autograd on)."""
    if not hidden.requires_grad:
        raise RuntimeError("the output layer's input does not depend on any LoRA adapter: the forward ran without "
                           "autograd, or no adapter lies before the output layer")
    present = [index for index, output in enumerate(capture.outputs) if output is not None]
    gradients = torch.autograd.grad(hidden, [capture.outputs[index] for index in present],
                                    grad_outputs=hidden_gradient.to(hidden.dtype), allow_unused=True)
    rows = torch.zeros(hidden.shape[0], projections[0].dim, dtype=torch.float32, device=hidden.device)
    for index, gradient in zip(present, gradients):
        if gradient is None:  # an adapter the loss does not reach
            continue
        projection = projections[index]
        out_factor = projection.out.apply(gradient)  # (B, T, d_out)
        in_factor = projection.in_.apply(capture.inputs[index])  # (B, T, d_in)
        rows += torch.einsum("btp,btq->bpq", out_factor, in_factor).flatten(1)
    capture.clear()
    return rows


class Adapters:
    """The lora kind's adapter layers and their projections; inside `with`, the hooks capturing the layers'
    inputs and outputs (`capture`), removed on leaving, also after an error."""

    def __init__(self, layers: list[tuple[str, torch.nn.Linear]], projections: list[SketchProjection]) -> None:
        self.layers = layers
        self.projections = projections
        self.capture: Optional[AdapterCapture] = None

    @classmethod
    def of(cls, model: torch.nn.Module, dim: int, seed: int, device: torch.device) -> "Adapters":
        """The model's adapters (ValueError naming the fix when it has none) and their projections on `device`."""
        layers = adapter_layers(model)
        return cls(layers, [projection.to(device) for projection in adapter_projections(layers, dim, seed)])

    def __enter__(self) -> "Adapters":
        self.capture = AdapterCapture(self.layers)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.capture is not None:
            self.capture.close()
        self.capture = None
