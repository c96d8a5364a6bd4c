"""Feature extraction's memory is bounded by a chunk of response positions, not by vocabulary x answer length.

    python bench/extraction_memory.py            # writes bench/results/extraction_memory.{json,md}

A one-layer Llama with a 128k vocabulary, one sample whose answer is 4,096 tokens, every feature kind (for
lora, with rank-8 adapters on every projection).
Each case runs in its own process (peak resident memory from getrusage) with the softmax taken
`chunk` positions at a time; chunk = the whole answer is the unchunked reference. The features of
every chunk size are compared with the reference.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, ANSWER, PROMPT = 131072, 64, 4096, 32


def one_case(kind: str, chunk: int, out: Path) -> None:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_cluster.features.extract import run_extraction
    from ds_cluster.features.kinds import feature_kind

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=PROMPT + ANSWER + 8,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    if feature_kind(kind).adapter_gradients:  # the lora kind reads adapters: rank 8 on every projection
        from ds_cluster.data.models import with_lora

        model = with_lora(model, 8).eval()
    length = PROMPT + ANSWER
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (length,), generator=generator)
    labels = input_ids.clone()
    labels[:PROMPT] = -100
    sample = {"input_ids": input_ids, "attention_mask": torch.ones(length, dtype=torch.int64), "labels": labels}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    result = run_extraction(model, [sample], kind=kind, dim=1024 if feature_kind(kind).projected else None,
                            batch_size=1, chunk_size=chunk, show_progress=False)
    seconds = time.perf_counter() - started
    np.save(out / f"{kind}_{chunk}.npy", result.features)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (out / f"{kind}_{chunk}.json").write_text(json.dumps({"kind": kind, "chunk": chunk, "peak_mb": peak / 1024,
                                                         "before_mb": before / 1024, "seconds": seconds}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", nargs=2, metavar=("KIND", "CHUNK"), help=argparse.SUPPRESS)
    parser.add_argument("--work", default=str(REPO / "runs" / "extraction_memory"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "extraction_memory"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.case:
        one_case(args.case[0], int(args.case[1]), work)
        return 0
    import numpy as np

    chunks = (64, 256, 1024, ANSWER)
    rows = []
    from ds_cluster.features.kinds import FEATURE_KINDS

    for kind in FEATURE_KINDS:
        for chunk in chunks:
            subprocess.run([sys.executable, __file__, "--case", kind, str(chunk), "--work", str(work)], check=True,
                           cwd=REPO)
            record = json.loads((work / f"{kind}_{chunk}.json").read_text())
            reference = np.load(work / f"{kind}_{ANSWER}.npy") if chunk == ANSWER else None
            rows.append(record)
        reference = np.load(work / f"{kind}_{ANSWER}.npy")
        for record in rows:
            if record["kind"] == kind:
                features = np.load(work / f"{kind}_{record['chunk']}.npy")
                record["max_abs_difference_to_unchunked"] = float(np.abs(features - reference).max())
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"vocab": VOCAB, "answer_tokens": ANSWER, "hidden": HIDDEN,
                                                    "cases": rows}, indent=2) + "\n")
    lines = [f"# Extraction memory: vocabulary {VOCAB:,}, one answer of {ANSWER:,} tokens, hidden {HIDDEN}", "",
             "`python bench/extraction_memory.py`; one process per case, peak resident memory (getrusage).", "",
             "| kind | chunk (positions per softmax) | peak MB | seconds | max abs difference to unchunked |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['chunk']}{' (unchunked)' if r['chunk'] == ANSWER else ''} | {r['peak_mb']:.0f} | "
              f"{r['seconds']:.1f} | {r['max_abs_difference_to_unchunked']:.2e} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
