"""Read a SentencePiece ``.model`` file and rebuild it as a ``tokenizers`` BPE, without sentencepiece or protobuf.

``read_sentencepiece_model`` parses the few ModelProto fields a BPE tokenizer needs with a
minimal protobuf wire-format reader; ``build_fast_tokenizer`` makes a ``tokenizers.Tokenizer``
that encodes like ``SentencePieceProcessor.encode`` (checked on the stories260K vocabulary: see
``bench/real/stories260k/README.md``) and decodes like ``SentencePieceProcessor.decode``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

# SentencePiece ModelProto.SentencePiece.Type values
PIECE_NORMAL, PIECE_UNKNOWN, PIECE_CONTROL, PIECE_USER_DEFINED, PIECE_UNUSED, PIECE_BYTE = 1, 2, 3, 4, 5, 6


def _read_varint(buffer: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _protobuf_fields(buffer: bytes) -> list[tuple[int, int, int | float | bytes]]:
    """(field number, wire type, value) of every field of one protobuf message, in order."""
    fields: list[tuple[int, int, int | float | bytes]] = []
    position = 0
    while position < len(buffer):
        key, position = _read_varint(buffer, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _read_varint(buffer, position)
        elif wire_type == 1:
            value = buffer[position : position + 8]
            position += 8
        elif wire_type == 2:
            length, position = _read_varint(buffer, position)
            value = buffer[position : position + length]
            position += length
        elif wire_type == 5:
            value = struct.unpack_from("<f", buffer, position)[0]
            position += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        fields.append((number, wire_type, value))
    return fields


@dataclass(frozen=True)
class SentencePieceModel:
    """The parts of a SentencePiece ``ModelProto`` that a BPE tokenizer needs."""

    pieces: list[tuple[str, float, int]]  # (piece, score, type)
    model_type: int  # 1 unigram, 2 BPE
    byte_fallback: bool
    unk_id: int
    bos_id: int
    eos_id: int
    pad_id: int
    add_dummy_prefix: bool
    remove_extra_whitespaces: bool
    escape_whitespaces: bool
    precompiled_charsmap: bytes


def read_sentencepiece_model(path: Path) -> SentencePieceModel:
    """Parse a SentencePiece ``.model`` file (ModelProto) without the protobuf package.

    Fields read (sentencepiece_model.proto): ModelProto.pieces = 1 (piece = 1, score = 2, type = 3),
    trainer_spec = 2 (model_type = 3, byte_fallback = 35, unk_id = 40, bos_id = 41, eos_id = 42, pad_id = 43),
    normalizer_spec = 3 (precompiled_charsmap = 2, add_dummy_prefix = 3, remove_extra_whitespaces = 4,
    escape_whitespaces = 5). Defaults are the proto's.
    """
    pieces: list[tuple[str, float, int]] = []
    trainer: dict[int, int] = {}
    normalizer: dict[int, int | bytes] = {}
    for number, _, value in _protobuf_fields(Path(path).read_bytes()):
        if number == 1:
            piece, score, piece_type = "", 0.0, PIECE_NORMAL
            for sub_number, _, sub_value in _protobuf_fields(value):  # type: ignore[arg-type]
                if sub_number == 1:
                    piece = sub_value.decode("utf-8")  # type: ignore[union-attr]
                elif sub_number == 2:
                    score = float(sub_value)  # type: ignore[arg-type]
                elif sub_number == 3:
                    piece_type = int(sub_value)  # type: ignore[arg-type]
            pieces.append((piece, score, piece_type))
        elif number == 2:
            for sub_number, wire_type, sub_value in _protobuf_fields(value):  # type: ignore[arg-type]
                if wire_type == 0:
                    trainer[sub_number] = int(sub_value)  # type: ignore[arg-type]
        elif number == 3:
            for sub_number, _, sub_value in _protobuf_fields(value):  # type: ignore[arg-type]
                normalizer[sub_number] = sub_value  # type: ignore[assignment]

    def signed(value: int) -> int:  # int32 fields are sign-extended to 64-bit varints
        return value - (1 << 64) if value >= 1 << 63 else value

    return SentencePieceModel(
        pieces=pieces,
        model_type=trainer.get(3, 1),
        byte_fallback=bool(trainer.get(35, 0)),
        unk_id=signed(trainer.get(40, 0)),
        bos_id=signed(trainer.get(41, 1)),
        eos_id=signed(trainer.get(42, 2)),
        pad_id=signed(trainer.get(43, -1 & ((1 << 64) - 1))),
        add_dummy_prefix=bool(normalizer.get(3, 1)),
        remove_extra_whitespaces=bool(normalizer.get(4, 1)),
        escape_whitespaces=bool(normalizer.get(5, 1)),
        precompiled_charsmap=bytes(normalizer.get(2, b"")),  # type: ignore[arg-type]
    )


def build_fast_tokenizer(model: SentencePieceModel) -> Tokenizer:
    """A ``tokenizers`` BPE that encodes like ``SentencePieceProcessor.encode`` for a BPE SentencePiece model.

    Merges come from the vocabulary: a pair (left, right) whose concatenation is a normal piece is ranked by that
    piece's score (SentencePiece's BPE merges the highest-scoring piece first).
    """
    if model.model_type != 2:
        raise NotImplementedError(f"only BPE SentencePiece models are converted (model_type {model.model_type})")
    if model.precompiled_charsmap:
        raise NotImplementedError("SentencePiece models with a precompiled normalisation map are not converted")
    vocab = {piece: index for index, (piece, _, _) in enumerate(model.pieces)}
    normal = {piece: (score, index) for index, (piece, score, kind) in enumerate(model.pieces) if kind == PIECE_NORMAL}
    ranked: list[tuple[float, int, str, str]] = []
    for piece, (score, index) in normal.items():
        for split in range(1, len(piece)):
            left, right = piece[:split], piece[split:]
            if left in normal and right in normal:
                ranked.append((-score, index, left, right))
    merges = [(left, right) for _, _, left, right in sorted(ranked)]
    unk_piece = model.pieces[model.unk_id][0]
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk_piece, fuse_unk=True, byte_fallback=model.byte_fallback)
    )
    steps: list[normalizers.Normalizer] = []
    if model.remove_extra_whitespaces:  # SentencePiece strips and collapses spaces only, not newlines or tabs
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if model.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if model.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decoder_steps: list[decoders.Decoder] = [decoders.Replace("▁", " ")]
    if model.byte_fallback:
        decoder_steps.append(decoders.ByteFallback())
    decoder_steps.append(decoders.Fuse())
    if model.add_dummy_prefix:
        decoder_steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(decoder_steps)
    bos_piece = model.pieces[model.bos_id][0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_piece} $A", pair=f"{bos_piece} $A {bos_piece} $B", special_tokens=[(bos_piece, model.bos_id)]
    )
    return tokenizer
