"""What the features pass costs beside a plain forward pass and a training step, before and after padding each
batch to its longest row: stories260K and SmolLM2-135M-Instruct on the same T0 records, side by side in one run.

    OMP_NUM_THREADS=1 python bench/feature_cost.py [--records 256] [--smollm2 .cache/smollm2-135m-instruct]

One process, one thread (the benchmark's ranks run one thread each). For every model, on the same records:

- a plain forward pass (eval, no autograd), batches of similar length padded to their longest row, fp32 and bf16;
- the lm_head features pass (dim 1024, `ds_cluster.features.extract.run_extraction`): at the dataset's full
  width in index order (the layout before 0.4.0), padded to the longest row in fp32, and padded in bf16 (the
  model's weights in bf16, the logits of the response positions in fp32), each split into the forward and the
  feature math;
- a training step (forward, backward, AdamW) at full width and padded to the longest row, fp32 and bf16
  autocast: real tokens per second;
- the features' agreement: padded against full width (max absolute difference; k-means labels at K = 8), bf16
  against fp32 (smallest cosine similarity of a row; k-means labels);
- with LoRA adapters of rank 8 on every projection (peft): the lora features pass (dim 1024, a forward and a
  backward to the adapters per batch) in fp32 and bf16, and a LoRA training step (only the adapters train) in fp32
  and bf16 autocast, beside the full fine-tuning step.

Writes bench/results/feature_cost.{json,md}. SmolLM2 is skipped, saying so, when its folder does not exist
(`python -m bench.real.smollm2`).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.real import STORIES260K_DIR, T0_DIR  # noqa: E402
from ds_cluster.clustering.kmeans import cluster_features  # noqa: E402
from ds_cluster.data.dataset import InstructionDataset, read_records, trim_padding  # noqa: E402
from ds_cluster.data.models import load_model_and_tokenizer, with_lora  # noqa: E402
from ds_cluster.features.extract import run_extraction  # noqa: E402

BATCH = 8
DIM = 1024
LORA_RANK = 8
TRAIN_STEPS = 6
MODELS = {"stories260K": (STORIES260K_DIR, 160),
          "SmolLM2-135M-Instruct": (REPO / ".cache" / "smollm2-135m-instruct", 136)}


def length_batches(dataset: InstructionDataset, trim: bool) -> list[dict[str, torch.Tensor]]:
    """Batches of BATCH records: sorted by length and padded to their longest row (`trim`), or in index order at
    full width."""
    lengths = dataset.attention_mask.sum(dim=1)
    order = torch.argsort(lengths, stable=True) if trim else torch.arange(len(dataset))
    batches = []
    for start in range(0, len(dataset), BATCH):
        rows = order[start:start + BATCH]
        batch = {"input_ids": dataset.input_ids[rows], "attention_mask": dataset.attention_mask[rows],
                 "labels": dataset.labels[rows]}
        batches.append(trim_padding(batch) if trim else batch)
    return batches


def timed(function) -> tuple[Any, float]:
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def forward_seconds(model: torch.nn.Module, batches: list[dict]) -> float:
    with torch.no_grad():
        model(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"])  # warm-up
        return timed(lambda: [model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
                              for b in batches])[1]


def train_tokens_per_s(model: torch.nn.Module, batches: list[dict], bf16: bool) -> float:
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-5)
    model.train()
    used = batches[1:TRAIN_STEPS + 1]

    def step(batch: dict) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step(batches[0])  # warm-up
    _, seconds = timed(lambda: [step(batch) for batch in used])
    model.eval()
    return float(sum(int(b["attention_mask"].sum()) for b in used) / seconds)


def labels_agree(a: np.ndarray, b: np.ndarray) -> bool:
    labels = [cluster_features(x, num_clusters=8, n_init=4, capacity_factor=None, seed=0).labels for x in (a, b)]
    return bool(np.array_equal(labels[0], labels[1]))


def measure(name: str, folder: Path, max_length: int, records: list[dict]) -> dict[str, Any]:
    model, tokenizer = load_model_and_tokenizer(folder, rank=0)
    model.eval()
    dataset = InstructionDataset(records, tokenizer, max_length=max_length, rank=0)
    padded, full = length_batches(dataset, trim=True), length_batches(dataset, trim=False)
    row: dict[str, Any] = {"model": name, "records": len(dataset), "max_length": max_length,
                           "real_tokens": int(dataset.attention_mask.sum()),
                           "padded_tokens": int(sum(b["attention_mask"].numel() for b in padded))}
    row["forward_fp32_s"] = forward_seconds(model, padded)
    passes = {}
    for label, trim in (("full_width_fp32", False), ("padded_fp32", True)):
        result = run_extraction(model, dataset, kind="lm_head", dim=DIM, batch_size=BATCH, shard_size=512,
                                show_progress=False, pad_to_longest=trim)
        passes[label] = result
    row["train_full_width_fp32_tok_s"] = train_tokens_per_s(model, full, bf16=False)
    row["train_padded_fp32_tok_s"] = train_tokens_per_s(model, padded, bf16=False)
    row["train_padded_bf16_autocast_tok_s"] = train_tokens_per_s(model, padded, bf16=True)
    model, _ = load_model_and_tokenizer(folder, rank=0, dtype=torch.bfloat16)  # fresh weights, in bf16
    model.eval()
    row["forward_bf16_s"] = forward_seconds(model, padded)
    passes["padded_bf16"] = run_extraction(model, dataset, kind="lm_head", dim=DIM, batch_size=BATCH,
                                           shard_size=512, show_progress=False)
    for label, result in passes.items():
        row[f"features_{label}_s"] = result.seconds
        row[f"features_{label}_forward_s"] = result.timings["forward"]
        row[f"features_{label}_math_s"] = result.timings["features"]
    full_rows, padded_rows = passes["full_width_fp32"].features, passes["padded_fp32"].features
    row["padded_vs_full_max_abs_diff"] = float(np.abs(padded_rows - full_rows).max())
    row["padded_vs_full_kmeans_identical"] = labels_agree(full_rows, padded_rows)
    bf16_rows = passes["padded_bf16"].features
    row["bf16_vs_fp32_min_cosine"] = float((bf16_rows * padded_rows).sum(axis=1).min())
    row["bf16_vs_fp32_kmeans_identical"] = labels_agree(padded_rows, bf16_rows)
    row["features_bf16_over_forward_bf16"] = row["features_padded_bf16_s"] / row["forward_bf16_s"]
    row["features_0_3_over_forward_bf16"] = row["features_full_width_fp32_s"] / row["forward_bf16_s"]
    row.update(measure_lora(folder, dataset, padded))
    return row


def measure_lora(folder: Path, dataset: InstructionDataset, padded: list[dict]) -> dict[str, Any]:
    """The lora features pass and a LoRA training step, fp32 and bf16, on fresh weights with rank-8 adapters."""
    row: dict[str, Any] = {"lora_rank": LORA_RANK}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = with_lora(load_model_and_tokenizer(folder, rank=0, dtype=dtype)[0], LORA_RANK).eval()
        row["lora_trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result = run_extraction(model, dataset, kind="lora", dim=DIM, batch_size=BATCH, shard_size=512,
                                show_progress=False)
        row[f"features_lora_{precision}_s"] = result.seconds
        row[f"features_lora_{precision}_forward_s"] = result.timings["forward"]
        row[f"features_lora_{precision}_math_s"] = result.timings["features"]
    model = with_lora(load_model_and_tokenizer(folder, rank=0)[0], LORA_RANK)
    row["train_lora_padded_fp32_tok_s"] = train_tokens_per_s(model, padded, bf16=False)
    row["train_lora_padded_bf16_autocast_tok_s"] = train_tokens_per_s(model, padded, bf16=True)
    return row


def markdown(rows: list[dict], command: str, skipped: list[str]) -> str:
    lines = ["# The features pass against a plain forward pass and a training step", "",
             f"`{command}`; {platform.node()}, {platform.processor() or platform.machine()}, one process, one thread, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Batches of {BATCH} records.", ""]
    for row in rows:
        lines += [f"## {row['model']}: {row['records']} T0 records, max length {row['max_length']}", "",
                  f"{row['real_tokens']} real tokens; padded to each batch's longest row (sorted by length): "
                  f"{row['padded_tokens']} ({row['padded_tokens'] / row['real_tokens']:.2f}x); at full width "
                  f"{row['records'] * row['max_length']} "
                  f"({row['records'] * row['max_length'] / row['real_tokens']:.2f}x).", "",
                  "| pass | seconds | forward | feature math | / plain bf16 forward |", "|---|---|---|---|---|",
                  f"| plain forward, fp32, padded | {row['forward_fp32_s']:.2f} | | | "
                  f"{row['forward_fp32_s'] / row['forward_bf16_s']:.2f} |",
                  f"| plain forward, bf16, padded | {row['forward_bf16_s']:.2f} | | | 1.00 |"]
        for label, title in (("full_width_fp32", "features, fp32, full width (0.3.0)"),
                             ("padded_fp32", "features, fp32, padded to the longest row"),
                             ("padded_bf16", "features, bf16, padded to the longest row")):
            seconds = row[f"features_{label}_s"]
            lines.append(f"| {title} | {seconds:.2f} | {row[f'features_{label}_forward_s']:.2f} | "
                         f"{row[f'features_{label}_math_s']:.2f} | {seconds / row['forward_bf16_s']:.2f} |")
        for precision in ("fp32", "bf16"):
            seconds = row[f"features_lora_{precision}_s"]
            lines.append(f"| lora features (rank {row['lora_rank']}), {precision}, padded | {seconds:.2f} | "
                         f"{row[f'features_lora_{precision}_forward_s']:.2f} | "
                         f"{row[f'features_lora_{precision}_math_s']:.2f} | {seconds / row['forward_bf16_s']:.2f} |")
        lines += ["", "The lora pass's \"feature math\" column is the backward to the adapters and the projection.",
                  "", "| training step | real tokens / s | / full fine-tuning, same precision |", "|---|---|---|",
                  f"| fp32, full width | {row['train_full_width_fp32_tok_s']:.0f} | |",
                  f"| fp32, padded to the longest row | {row['train_padded_fp32_tok_s']:.0f} | 1.00 |",
                  f"| bf16 autocast, padded | {row['train_padded_bf16_autocast_tok_s']:.0f} | 1.00 |",
                  f"| LoRA rank {row['lora_rank']} ({row['lora_trainable_parameters']} trainable), fp32, padded | "
                  f"{row['train_lora_padded_fp32_tok_s']:.0f} | "
                  f"{row['train_lora_padded_fp32_tok_s'] / row['train_padded_fp32_tok_s']:.2f} |",
                  f"| LoRA rank {row['lora_rank']}, bf16 autocast, padded | "
                  f"{row['train_lora_padded_bf16_autocast_tok_s']:.0f} | "
                  f"{row['train_lora_padded_bf16_autocast_tok_s'] / row['train_padded_bf16_autocast_tok_s']:.2f} |",
                  "",
                  "Features padded against full width: max absolute difference "
                  f"{row['padded_vs_full_max_abs_diff']:.2e}, "
                  f"k-means labels (K = 8) identical: {row['padded_vs_full_kmeans_identical']}. bf16 against fp32: "
                  f"smallest cosine of a row {row['bf16_vs_fp32_min_cosine']:.4f}, k-means labels identical: "
                  f"{row['bf16_vs_fp32_kmeans_identical']}.", ""]
    lines += [f"Skipped: {reason}" for reason in skipped]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--smollm2", default=str(MODELS["SmolLM2-135M-Instruct"][0]))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "feature_cost"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = read_records(T0_DIR / "train.jsonl.gz")
    records = [records[i] for i in np.random.default_rng(0).choice(len(records), args.records, replace=False)]
    rows, skipped = [], []
    for name, (folder, max_length) in MODELS.items():
        folder = Path(args.smollm2) if name.startswith("SmolLM2") else folder
        if not folder.is_dir():
            skipped.append(f"{name}: no folder at {folder} (python -m bench.real.smollm2)")
            continue
        rows.append(measure(name, folder, max_length, records))
        print(json.dumps(rows[-1], indent=1), flush=True)
    command = ("OMP_NUM_THREADS=1 python bench/feature_cost.py"
               + (f" --records {args.records}" if args.records != 256 else ""))
    Path(args.out).with_suffix(".json").write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))
    Path(args.out).with_suffix(".md").write_text(markdown(rows, command, skipped))


if __name__ == "__main__":
    main()
