"""Convert a llama2.c checkpoint and its SentencePiece vocabulary to a transformers Llama folder.

Run once to build the shipped ``stories260k`` folder::

    python -m bench.real.convert_llama2c \\
        --checkpoint stories260K.bin --tokenizer tok512.model --out bench/real/stories260k

The checkpoint is llama2.c's legacy (version 0) export: a header of seven int32
(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
vocab_size means the classifier is stored separately) followed by float32
tensors in PyTorch's (out, in) layout: token embeddings, attention RMSNorm
weights, wq, wk, wv, wo, FFN RMSNorm weights, w1, w2, w3, the final RMSNorm
weight, the RoPE tables (seq_len x head_size/2, twice; not needed), and the
classifier when it is not shared with the embeddings.

Two things differ from transformers' Llama:

* RoPE pairing. llama2.c (like Meta's reference code) rotates interleaved pairs
  (0, 1), (2, 3), ... of every head; transformers' ``rotate_half`` rotates
  (j, j + head_size/2). The rows of wq and wk are permuted within every head so
  that the two give the same attention scores (wv and wo are untouched, because
  the scores, not the vectors, are what the rotation feeds).
* The tokenizer. The SentencePiece model is parsed without the
  ``sentencepiece``/``protobuf`` packages (``sentencepiece_model``: a minimal
  protobuf wire-format reader for the fields needed) and rebuilt as a ``tokenizers`` BPE with byte fallback
  whose normaliser mirrors SentencePiece's (strip and collapse runs of spaces
  when the model asks for it, the dummy-prefix "▁", spaces escaped to "▁"), so
  loading the folder needs only ``tokenizers``. The vocabulary has no pad
  token and none is added.
"""
from __future__ import annotations

import argparse
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.real.sentencepiece_model import build_fast_tokenizer, read_sentencepiece_model

logger = logging.getLogger(__name__)

LEGACY_HEADER_FORMAT = "<7i"
LEGACY_HEADER_BYTES = struct.calcsize(LEGACY_HEADER_FORMAT)
ROPE_THETA = 10000.0  # llama2.c's precompute_freqs_cis default
RMS_NORM_EPS = 1e-5  # llama2.c's RMSNorm epsilon (run.c and model.py)


@dataclass(frozen=True)
class Llama2cConfig:
    """The seven numbers of a llama2.c legacy header."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size


def read_llama2c_checkpoint(path: Path) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Read a legacy llama2.c ``.bin``: its header and its float32 tensors, named as in llama2.c's run.c."""
    raw = Path(path).read_bytes()
    if raw[:4] == b"42ka":  # uint32 0x616b3432 little-endian: the versioned export, not the legacy one
        raise NotImplementedError(f"{path}: versioned llama2.c export (magic 'ak42'); only the legacy format is read")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = struct.unpack_from(LEGACY_HEADER_FORMAT, raw)
    config = Llama2cConfig(
        dim=dim,
        hidden_dim=hidden_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=abs(vocab_size),
        seq_len=seq_len,
        shared_classifier=vocab_size > 0,
    )
    if dim <= 0 or n_heads <= 0 or dim % n_heads or n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ValueError(f"{path}: implausible llama2.c header {config}")
    values = np.frombuffer(raw, dtype="<f4", offset=LEGACY_HEADER_BYTES)
    c = config
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("token_embedding_table", (c.vocab_size, c.dim)),
        ("rms_att_weight", (c.n_layers, c.dim)),
        ("wq", (c.n_layers, c.dim, c.dim)),
        ("wk", (c.n_layers, c.kv_dim, c.dim)),
        ("wv", (c.n_layers, c.kv_dim, c.dim)),
        ("wo", (c.n_layers, c.dim, c.dim)),
        ("rms_ffn_weight", (c.n_layers, c.dim)),
        ("w1", (c.n_layers, c.hidden_dim, c.dim)),
        ("w2", (c.n_layers, c.dim, c.hidden_dim)),
        ("w3", (c.n_layers, c.hidden_dim, c.dim)),
        ("rms_final_weight", (c.dim,)),
        ("freq_cis_real", (c.seq_len, c.head_size // 2)),
        ("freq_cis_imag", (c.seq_len, c.head_size // 2)),
    ]
    if not c.shared_classifier:
        shapes.append(("wcls", (c.vocab_size, c.dim)))
    expected = sum(int(np.prod(shape)) for _, shape in shapes)
    if values.size != expected:
        raise ValueError(f"{path}: {values.size} float32 after the header, the header implies {expected}")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        tensors[name] = values[offset : offset + size].reshape(shape).copy()
        offset += size
    if c.shared_classifier:
        tensors["wcls"] = tensors["token_embedding_table"]
    return config, tensors


def interleaved_to_rotate_half(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Permute the output rows of a q/k projection from interleaved RoPE pairs to ``rotate_half`` halves.

    Within every head, row 2i (the first of pair i) goes to position i and row 2i+1 to i + head_size/2.
    """
    out_features, in_features = weight.shape
    head_size = out_features // n_heads
    return (
        weight.reshape(n_heads, head_size // 2, 2, in_features)
        .transpose(0, 2, 1, 3)
        .reshape(out_features, in_features)
    )


def hf_config_dict(config: Llama2cConfig) -> dict:
    """The ``LlamaConfig`` keyword arguments equivalent to a llama2.c header."""
    return {
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "hidden_act": "silu",
        "tie_word_embeddings": config.shared_classifier,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "attention_bias": False,
        "mlp_bias": False,
    }


def hf_state_dict(config: Llama2cConfig, tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Map llama2.c tensors to ``LlamaForCausalLM`` parameter names, permuting wq/wk for ``rotate_half``."""
    state: dict[str, np.ndarray] = {"model.embed_tokens.weight": tensors["token_embedding_table"]}
    for layer in range(config.n_layers):
        prefix = f"model.layers.{layer}."
        state[prefix + "input_layernorm.weight"] = tensors["rms_att_weight"][layer]
        state[prefix + "self_attn.q_proj.weight"] = interleaved_to_rotate_half(tensors["wq"][layer], config.n_heads)
        state[prefix + "self_attn.k_proj.weight"] = interleaved_to_rotate_half(tensors["wk"][layer], config.n_kv_heads)
        state[prefix + "self_attn.v_proj.weight"] = tensors["wv"][layer]
        state[prefix + "self_attn.o_proj.weight"] = tensors["wo"][layer]
        state[prefix + "post_attention_layernorm.weight"] = tensors["rms_ffn_weight"][layer]
        state[prefix + "mlp.gate_proj.weight"] = tensors["w1"][layer]
        state[prefix + "mlp.down_proj.weight"] = tensors["w2"][layer]
        state[prefix + "mlp.up_proj.weight"] = tensors["w3"][layer]
    state["model.norm.weight"] = tensors["rms_final_weight"]
    if not config.shared_classifier:
        state["lm_head.weight"] = tensors["wcls"]
    return {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in state.items()}


def convert_model(checkpoint: Path, out_dir: Path) -> Path:
    """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` for a llama2.c checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config, tensors = read_llama2c_checkpoint(checkpoint)
    logger.info("llama2.c checkpoint %s: %s", checkpoint, config)
    hf_config = LlamaConfig(**hf_config_dict(config))
    model = LlamaForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(hf_state_dict(config, tensors), strict=False)
    allowed_missing = {"lm_head.weight"} if config.shared_classifier else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.shared_classifier:
        model.tie_weights()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def convert_tokenizer(sentencepiece_file: Path, out_dir: Path, model_max_length: int) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``: a fast tokenizer with BOS added, no pad token."""
    from transformers import PreTrainedTokenizerFast

    model = read_sentencepiece_model(sentencepiece_file)
    if model.pad_id >= 0:
        logger.warning("the SentencePiece model has a pad id (%d); it is kept as an ordinary piece", model.pad_id)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_fast_tokenizer(model),
        bos_token=model.pieces[model.bos_id][0],
        eos_token=model.pieces[model.eos_id][0],
        unk_token=model.pieces[model.unk_id][0],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    # The generic fast class keeps tokenizer.json's pipeline as written (transformers 5's LlamaTokenizer would
    # rebuild its own, without the whitespace normaliser), and the name loads under transformers 4 and 5 alike.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Command line: convert a llama2.c checkpoint and SentencePiece model into one transformers folder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="llama2.c legacy .bin")
    parser.add_argument("--tokenizer", type=Path, required=True, help="SentencePiece .model")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config, _ = read_llama2c_checkpoint(args.checkpoint)
    convert_model(args.checkpoint, args.out)
    convert_tokenizer(args.tokenizer, args.out, model_max_length=config.seq_len)
    logger.info("wrote %s: %s", args.out, sorted(p.name for p in Path(args.out).iterdir()))


if __name__ == "__main__":
    main()
