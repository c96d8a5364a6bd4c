"""Real material for the benchmark: a small pretrained Llama and two real instruction mixtures.

Nothing in the core imports this package; it plays the part a user's own checkpoint and data play.

- ``STORIES260K_DIR``: karpathy's stories260K (llama2.c, MIT) converted to a transformers
  ``LlamaForCausalLM`` folder with its 512-piece tokenizer (``convert_llama2c``).
- ``T0_DIR``: a slice of the T0 training mixture as released by yizhongw/self-instruct
  (Apache-2.0), grouped into the T0 paper's task clusters (``t0``).
- ``FLAN_COT_DIR``: a slice of the FLAN v2 chain-of-thought training data (google-research/FLAN,
  Apache-2.0), grouped by source (``flan_cot``).

The two data folders hold ``train.jsonl.gz`` and ``heldout.jsonl.gz`` (Alpaca fields plus
``family``) and a README with their provenance.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR: Path = Path(__file__).resolve().parent
STORIES260K_DIR: Path = PACKAGE_DIR / "stories260k"
T0_DIR: Path = PACKAGE_DIR / "data" / "t0"
FLAN_COT_DIR: Path = PACKAGE_DIR / "data" / "flan_cot"

__all__ = ["FLAN_COT_DIR", "PACKAGE_DIR", "STORIES260K_DIR", "T0_DIR"]
