"""The benchmark's instrument: the base model an arm fine-tunes, the data files of a mixture folder, and the
environment of the jobs it starts."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]


def default_base_model(settings: Any) -> Path:
    """The checkpoint every arm fine-tunes: `settings.base_model`, else the instrument's own."""
    if settings.base_model is not None:
        return Path(settings.base_model)
    if settings.instrument == "synthetic":
        from bench.toy.models import base_model_path

        return Path(base_model_path())
    from bench.real import STORIES260K_DIR

    return STORIES260K_DIR


def data_file(folder: Path, name: str) -> Path:
    """FOLDER/NAME.jsonl, else FOLDER/NAME.jsonl.gz (read_jsonl reads either by its bytes)."""
    for candidate in (folder / f"{name}.jsonl", folder / f"{name}.jsonl.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{folder}: neither {name}.jsonl nor {name}.jsonl.gz")


def job_env(extra: Optional[dict] = None) -> dict:
    """The environment of a benchmark job: one node on loopback, offline, this venv first on PATH.

    The accelerator is DeepSpeed's own choice (CUDA where a GPU is, else the CPU) unless DS_ACCELERATOR is set.
    """
    env = os.environ.copy()
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_extensions"),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(var, None)
    env.update(extra or {})
    return env
