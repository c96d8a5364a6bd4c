"""A projection, not a measurement: each phase's memory per GPU and the features pass's time against one training
epoch, for Llama-2-7B and Llama-2-70B on 8 GPUs of 80 GB and on 2 nodes of 8, from the terms
bench/zero3_memory.py measures on CPU ranks (docs/gpu.md, section 5, states the formulas and the inputs).

    python bench/gpu_projection.py            # prints the tables of docs/gpu.md, section 5
    python bench/gpu_projection.py --check bench/results/zero3_memory.json   # the formulas against the CPU jobs

Memory per GPU, bytes, W GPUs, P parameters in bf16 (2 bytes), a micro batch of B samples of T tokens:
- shard S = 2 P / W;
- DeepSpeed's window of gathered parameters D = 2 min(P, stage3_max_live_parameters) (default 1e9 parameters: what
  its prefetch and reuse keep gathered in any forward, a training step's included);
- largest layer Lg = 2 max(V H, one decoder layer's parameters) (the output matrix the features gather, or a layer);
- features activations Af = B T (4 H + 3 I) 4 (one layer's forward in float32) + 3 c V 4 (c = 256 response
  positions' logits, log-softmax and probabilities in float32) + 64 MiB (a block of the output matrix in float32);
- the lora kind's autograd graph Ag = L B T (26 H + 4 I) 2 (every layer's saved activations in bf16: the pass
  runs the model in eval mode, where Hugging Face models do not checkpoint activations);
- training's activations with checkpointing (how 7B and 70B models are trained) Ac = L B T H 2 + B T (26 H + 4 I) 2
  (each layer's input kept, one layer's graph at a time);
- fixed overhead O = 2 GiB (CUDA context, NCCL and DeepSpeed buffers: an assumption, not measured here).
Phases: features (proxy, lm_head) S + D + Lg + Af + O; features (lora) the same + Ag; k-means N d 4 on rank 0
(N x d / W each with sharded_clustering) on top of S + O; LoRA training (DeepSpeed's) S + D + Ac + O; full
fine-tuning 16 P / W + D + Ac + O (bf16 weights and gradients, float32 master weights and Adam's two moments);
--save-model S + Lg + O, and rank 0 one 512 MiB file twice more while it is serialised. The lora kind's tokens per
micro-batch that fit: (80 GB - (S + D + Lg + O)) / (L (26 H + 4 I) 2).

Time: a forward is 2 P FLOPs a token, a backward to the activations 2 P more, to the weights 2 P more. Features
passes: proxy and lm_head one forward (2 P), lora a forward and the backward to the adapters' outputs (4 P); a
LoRA training step 4 P, a full one 6 P; ZeRO-3 all-gathers the whole model once per forward and once per
backward on every GPU ((W - 1) / W of 2 P bytes each), full fine-tuning also reduce-scatters the gradients. Per
micro-batch the time is taken as the larger of compute (B T FLOPs-per-token / (peak x MFU)) and communication
(bytes / bandwidth per GPU). Epoch: N samples over W GPUs.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

GIB = 1 << 30


@dataclass(frozen=True)
class Llama:
    name: str
    hidden: int
    inner: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False  # input and output embeddings one matrix (SmolLM2), not two (Llama-2)

    @property
    def layer_parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return attention + 3 * self.hidden * self.inner + 2 * self.hidden

    @property
    def parameters(self) -> int:
        return self.layers * self.layer_parameters + (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden


# The published configurations (config.json of meta-llama/Llama-2-7b-hf and Llama-2-70b-hf).
MODELS = (Llama("Llama-2-7B", 4096, 11008, 32, 32, 32, 32000), Llama("Llama-2-70B", 8192, 28672, 80, 64, 8, 32000))
LIVE_PARAMETERS = 1e9  # DeepSpeed's stage3_max_live_parameters default
OVERHEAD = 2 * GIB
CHUNK = 256
# Time inputs (assumptions): H100 SXM bf16 dense peak, the fraction of it reached, all-gather bandwidth per GPU
# inside a node (NVLink) and across nodes (400 Gb/s InfiniBand per node, shared by its 8 GPUs).
PEAK_FLOPS, MFU = 989e12, 0.4
NVLINK_BYTES_S, IB_NODE_BYTES_S = 300e9, 50e9


@dataclass(frozen=True)
class Terms:
    """The memory terms of the module's docstring, bytes per GPU (the fixed overhead O left to the caller)."""

    shard: float         # S
    window: float        # D
    layer: float         # Lg
    forward: float       # Af
    graph: float         # Ag
    checkpointed: float  # Ac
    graph_per_token: float  # one token's bytes of every layer's graph (what the lora kind's pass adds a token)


def terms(model: Llama, gpus: int, batch: int, tokens: int, live_parameters: float = LIVE_PARAMETERS) -> Terms:
    """S, D, Lg, Af, Ag and Ac for `model` on `gpus` ranks at a micro batch of `batch` x `tokens`."""
    positions = min(CHUNK, batch * tokens)  # the logits of at most CHUNK response positions at once
    per_token = 26 * model.hidden + 4 * model.inner  # bf16 values one layer's graph saves per token
    return Terms(shard=2 * model.parameters / gpus, window=2 * min(model.parameters, live_parameters),
                 layer=2 * max(model.vocab * model.hidden, model.layer_parameters),
                 forward=(batch * tokens * (4 * model.hidden + 3 * model.inner) * 4 + 3 * positions * model.vocab * 4
                          + 64 * (1 << 20)),
                 graph=model.layers * batch * tokens * per_token * 2,
                 checkpointed=model.layers * batch * tokens * model.hidden * 2 + batch * tokens * per_token * 2,
                 graph_per_token=model.layers * per_token * 2)


def memory(model: Llama, gpus: int, batch: int, tokens: int, samples: int, dim: int,
           live_parameters: float = LIVE_PARAMETERS, overhead: float = OVERHEAD) -> dict[str, float]:
    """Each phase's bytes per GPU (rank 0's for k-means and the save)."""
    t = terms(model, gpus, batch, tokens, live_parameters)
    features = t.shard + t.window + t.layer + t.forward + overhead
    return {"features proxy / lm_head": features, "features lora": features + t.graph,
            "k-means (rank 0)": t.shard + overhead + samples * dim * 4,
            "LoRA training (checkpointed)": t.shard + t.window + t.checkpointed + overhead,
            "full fine-tuning (checkpointed)": 16 * model.parameters / gpus + t.window + t.checkpointed + overhead,
            "save (rank 0)": t.shard + t.layer + overhead + 2 * 512 * (1 << 20),
            "lora kind: tokens a micro-batch may hold in 80 GB":
                max(0.0, 80e9 - (t.shard + t.window + t.layer + overhead)) / t.graph_per_token}


def seconds_per_micro_batch(model: Llama, gpus: int, batch: int, tokens: int, flops_per_token: float,
                            gathers: int) -> float:
    """max(compute, communication) of one micro-batch on one GPU."""
    compute = batch * tokens * flops_per_token * model.parameters / (PEAK_FLOPS * MFU)
    bandwidth = NVLINK_BYTES_S if gpus <= 8 else IB_NODE_BYTES_S / 8
    communication = gathers * 2 * model.parameters * (gpus - 1) / gpus / bandwidth
    return max(compute, communication)


def times(model: Llama, gpus: int, batch: int, tokens: int, samples: int) -> dict[str, float]:
    """Hours of each features pass and of one epoch, N samples over the GPUs."""
    steps = samples / (gpus * batch)
    hours = {name: steps * seconds_per_micro_batch(model, gpus, batch, tokens, flops, gathers) / 3600
             for name, flops, gathers in (("features proxy / lm_head", 2, 1), ("features lora", 4, 2),
                                          ("LoRA epoch", 4, 2), ("full fine-tuning epoch", 6, 3))}
    return hours


def check(results: dict[str, Any]) -> list[str]:
    """The memory formulas applied to the CPU jobs of bench/zero3_memory.py, beside what each rank measured: its
    model, 2 ranks, its micro batch and length, its window; the fixed overhead O is the tiny job's peak in the same
    phase on the same rank (what a job costs a rank with next to no model). The CPU jobs do not checkpoint
    activations, so training's activations are every layer's graph (Ag), not Ac."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import zero3_memory as measured

    lines = ["| job | phase | rank | formula, GB | measured peak RSS, GB | measured / formula |",
             "|---|---|---|---|---|---|"]
    for job in results["jobs"]:
        spec = job["spec"]
        if spec["mode"] != "block":
            continue
        config = measured.MODELS[spec["model"]]
        model = Llama(spec["model"], config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                      config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"],
                      tied=config.get("tie_word_embeddings", False))
        t = terms(model, measured.WORLD, measured.MICRO, measured.MAX_LENGTH,
                  results.get("window") or LIVE_PARAMETERS)
        features = t.shard + t.window + t.layer + t.forward
        formulas: dict[str, Optional[float]] = {
            "features lm_head": features, "features proxy": features, "features lora": features + t.graph,
            # the CPU jobs do not checkpoint activations: training keeps every layer's graph
            "train": (t.shard + t.window + t.graph) if spec["train"] == "lora" else None}
        for rank, report in enumerate(job["ranks"]):
            peaks = measured.peaks_by_phase(report)
            tiny = measured.peaks_by_phase(results["tiny"]["ranks"][rank])
            for phase, formula in formulas.items():
                if formula is None or phase not in peaks or phase not in tiny:
                    continue
                bound = formula + tiny[phase]["rss"]  # O: what the job costs this rank with next to no model
                lines.append(f"| {spec['model']}, {spec['train']}, {spec['zero']} | {phase} | {rank} | "
                             f"{bound / 1e9:.2f} | {peaks[phase]['rss'] / 1e9:.2f} | "
                             f"{peaks[phase]['rss'] / bound:.2f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="micro batch per GPU (the features pass's too)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=1024, help="feature_dim")
    parser.add_argument("--check", type=Path, default=None, metavar="ZERO3_MEMORY_JSON",
                        help="print the memory formulas against the CPU jobs of bench/zero3_memory.py instead")
    args = parser.parse_args()
    if args.check:
        print("\n".join(check(json.loads(args.check.read_text()))))
        return 0
    setups = [(model, gpus) for model in MODELS for gpus in (8, 16)]
    print(f"Memory per GPU, GB (projection; micro batch {args.batch} x {args.tokens} tokens, {args.samples:,} "
          f"samples, feature_dim {args.dim}):\n")
    print("| phase | " + " | ".join(f"{model.name}, {gpus} GPUs" for model, gpus in setups) + " |")
    print("|---|" + "---|" * len(setups))
    tables = [memory(model, gpus, args.batch, args.tokens, args.samples, args.dim) for model, gpus in setups]
    for phase in tables[0]:
        scale, form = (1, "{:,.0f}") if phase.startswith("lora kind") else (1e9, "{:.1f}")
        print(f"| {phase} | " + " | ".join(form.format(table[phase] / scale) for table in tables) + " |")
    print(f"\nHours for {args.samples:,} samples (projection):\n")
    print("| | " + " | ".join(f"{model.name}, {gpus} GPUs" for model, gpus in setups) + " |")
    print("|---|" + "---|" * len(setups))
    timed = [times(model, gpus, args.batch, args.tokens, args.samples) for model, gpus in setups]
    for phase in timed[0]:
        print(f"| {phase} | " + " | ".join(f"{table[phase]:.2f}" for table in timed) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
