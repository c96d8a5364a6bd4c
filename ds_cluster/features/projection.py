"""Seeded random projections: the Kronecker-factored projection of an output-layer gradient (Gaussian), and the
count-sketch projections of the LoRA adapters' gradients (`layer_projection`).

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


@dataclass(frozen=True)
class SignSketch:
    """A seeded count sketch from n to d values: coordinate i is added, with sign sign[i], to value index[i]. Its
    (n x d) matrix S has one +-1 per row, so E[S S^T] = I and inner products are kept in expectation, as a Gaussian
    projection's are, from 12 bytes a coordinate instead of 4 d (a Gaussian one of an 8192-wide layer to 1024
    values is 32 MiB)."""

    index: torch.Tensor  # (n,) int64 in [0, d)
    sign: torch.Tensor  # (n,) float32, +1 or -1
    dim: int

    def apply(self, values: torch.Tensor) -> torch.Tensor:
        """(..., n) -> (..., d) float32: the sketch of each row."""
        out = torch.zeros(*values.shape[:-1], self.dim, dtype=torch.float32, device=values.device)
        return out.index_add_(-1, self.index, values.float() * self.sign)

    def to(self, device: torch.device | str) -> "SignSketch":
        return SignSketch(self.index.to(device), self.sign.to(device), self.dim)

    def dense(self) -> torch.Tensor:
        """The explicit (n x d) matrix, for tests on tiny layers only."""
        matrix = torch.zeros(self.index.numel(), self.dim, dtype=torch.float32)
        matrix[torch.arange(self.index.numel()), self.index] = self.sign
        return matrix


def sign_sketch(rows: int, cols: int, seed: int, tag: int) -> SignSketch:
    """The seeded sketch of `rows` values to `cols`, the same on every rank for the same seed and `tag`."""
    if rows < 1 or cols < 1:
        raise ValueError(f"sketch shape must be positive, got ({rows}, {cols})")
    state = np.random.SeedSequence([int(seed), int(tag)]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator(device="cpu").manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)
    index = torch.randint(0, cols, (rows,), generator=generator, dtype=torch.int64)
    sign = torch.randint(0, 2, (rows,), generator=generator).to(torch.float32).mul_(2).sub_(1)
    return SignSketch(index, sign, cols)


@dataclass(frozen=True)
class SketchProjection:
    """The projection of a (out x in) gradient to d_out * d_in values through two count sketches: G -> S_out^T G
    S_in, i.e. sum_t outer(S_out^T g_t, S_in^T a_t) for G = sum_t g_t a_t^T; S_out kron S_in is itself a sketch
    (its signs are pairwise independent), so inner products are kept in expectation."""

    out: SignSketch
    in_: SignSketch

    @property
    def dim(self) -> int:
        return self.out.dim * self.in_.dim

    def to(self, device: torch.device | str) -> "SketchProjection":
        return SketchProjection(self.out.to(device), self.in_.to(device))

    def dense(self) -> torch.Tensor:
        """The explicit (dim x out*in) matrix S_out^T kron S_in^T, for tests on tiny layers only."""
        return torch.kron(self.out.dense().T.contiguous(), self.in_.dense().T.contiguous())


def layer_projection(dim: int, out_features: int, in_features: int, seed: int, layer: int) -> SketchProjection:
    """The seeded projection of layer number `layer`'s (out_features x in_features) gradient to `dim` values,
    independent of every other layer's: the sum of the layers' projections is then a projection of all of their
    gradients together. `dim` may exceed the layer's gradient size. Count sketches, not Gaussian matrices: a model's
    adapters have hundreds of layers, and Gaussian projections of them to 1024 values would take 3.3 GB for a 1.7B
    Llama and 49 GB for a 70B one, on every rank."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    d_out, d_in = factor_dim(dim, out_features, in_features, larger=True)
    return SketchProjection(out=sign_sketch(out_features, d_out, seed, tag=2 + 2 * layer),
                            in_=sign_sketch(in_features, d_in, seed, tag=3 + 2 * layer))
