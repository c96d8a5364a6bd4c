"""Seeded random projections, and the Kronecker-factored projection of an output-layer gradient.

The per-sample gradient of the output matrix is G = mean_t e_t h_t^T (V x H),
e_t = softmax_t - onehot_t. Projecting vec(G) by (P_out^T kron P_in^T) equals
vec(P_out^T G P_in) = mean_t vec(outer(P_out^T e_t, P_in^T h_t)), so only the
two factors are ever projected and G is never formed (the LoGra trick).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# Rows are drawn in fixed-size chunks: the random stream then depends only on
# the seed and this constant, never on memory limits or the device.
_CHUNK_ROWS = 4096


def gaussian_matrix(rows: int, cols: int, seed: int, tag: int) -> torch.Tensor:
    """A (rows x cols) float32 matrix of N(0, 1/cols) entries, the same on every rank for the same seed.

    `tag` separates independent matrices drawn from one user seed.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"projection matrix shape must be positive, got ({rows}, {cols})")
    # SeedSequence mixes (seed, tag) into a well-spread 63-bit generator seed.
    state = np.random.SeedSequence([int(seed), int(tag)]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator(device="cpu").manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)
    out = torch.empty(rows, cols, dtype=torch.float32)
    for start in range(0, rows, _CHUNK_ROWS):
        stop = min(rows, start + _CHUNK_ROWS)
        out[start:stop] = torch.randn(stop - start, cols, generator=generator, dtype=torch.float32)
    return out.mul_(1.0 / math.sqrt(cols))


def factor_dim(dim: int, out_features: int, in_features: int, larger: bool = False) -> tuple[int, int]:
    """Split `dim` into d_out * d_in for a (out_features x in_features) gradient.

    Among the divisor pairs, prefer those with d_out <= out_features and
    d_in <= in_features, and among them the pair that compresses both sides
    by the most similar ratio. `larger`: `dim` may exceed the gradient's size
    (a layer's projection that is summed with other layers', as the adapters' are).
    """
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    full = out_features * in_features
    if dim > full and not larger:
        raise ValueError(
            f"dim={dim} is larger than the gradient it projects: the output layer is "
            f"{out_features} x {in_features} = {full} values; choose dim <= {full}"
        )
    best: tuple[float, int, int] | None = None
    for d_out in range(1, dim + 1):
        if dim % d_out:
            continue
        d_in = dim // d_out
        overshoot = max(0, d_out - out_features) + max(0, d_in - in_features)
        imbalance = abs(math.log(d_out / out_features) - math.log(d_in / in_features))
        key = (overshoot, imbalance)
        if best is None or key < best[0]:
            best = (key, d_out, d_in)
    assert best is not None
    return best[1], best[2]


@dataclass(frozen=True)
class KroneckerProjection:
    """P_out (V x d_out) and P_in (H x d_in), entries N(0, 1/d) so inner products are preserved in expectation."""

    p_out: torch.Tensor
    p_in: torch.Tensor

    @property
    def dim(self) -> int:
        return self.p_out.shape[1] * self.p_in.shape[1]

    def to(self, device: torch.device | str) -> "KroneckerProjection":
        return KroneckerProjection(self.p_out.to(device), self.p_in.to(device))

    def dense(self) -> torch.Tensor:
        """The explicit (dim x V*H) matrix P_out^T kron P_in^T, for tests on tiny layers only."""
        return torch.kron(self.p_out.T.contiguous(), self.p_in.T.contiguous())


def kronecker_projection(dim: int, out_features: int, in_features: int, seed: int) -> KroneckerProjection:
    """The seeded projection of a (out_features x in_features) gradient to `dim` values."""
    d_out, d_in = factor_dim(dim, out_features, in_features)
    return KroneckerProjection(
        p_out=gaussian_matrix(out_features, d_out, seed, tag=0),
        p_in=gaussian_matrix(in_features, d_in, seed, tag=1),
    )


def layer_projection(dim: int, out_features: int, in_features: int, seed: int, layer: int) -> KroneckerProjection:
    """The seeded projection of layer number `layer`'s (out_features x in_features) gradient to `dim` values,
    independent of every other layer's (and of `kronecker_projection`'s): the sum of the layers' projections is
    then a random projection of all of their gradients together. `dim` may exceed the layer's gradient size."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    d_out, d_in = factor_dim(dim, out_features, in_features, larger=True)
    return KroneckerProjection(
        p_out=gaussian_matrix(out_features, d_out, seed, tag=2 + 2 * layer),
        p_in=gaussian_matrix(in_features, d_in, seed, tag=3 + 2 * layer),
    )
