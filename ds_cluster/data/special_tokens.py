"""A tokenizer's special tokens as the data code needs them: a pad token for every tokenizer, bos when there is one.

Llama, Mistral and GPT-2 tokenizers ship without a pad token. Padding never reaches the loss or the
features here (attention masks and labels come from sequence lengths, never from comparing ids with
the pad id), so any token can fill the padded positions: pad falls back to eos, else unk.

Named ``special_tokens`` rather than ``tokenizers``: a module of that name inside the package would
shadow the Hugging Face ``tokenizers`` library for any script run by path from this folder.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)


def _rank_from_environment() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0  # a malformed RANK must not stop data loading; the line is then logged on every rank


def ensure_pad_token(tokenizer: Any, rank: Optional[int] = None) -> Optional[str]:
    """Give ``tokenizer`` a pad token if it has none (eos, else unk); returns the pad token now in use.

    The tokenizer is changed in place (``tokenizer.pad_token = ...``), so it is saved with the pad token
    and later calls find it set. One log line says so, on rank 0 only (``rank``, else the ``RANK``
    environment variable, else 0). Returns None, and changes nothing, when the tokenizer has neither
    pad, eos nor unk: padded positions then hold id 0, which is harmless because nothing reads them.
    """
    if tokenizer.pad_token is not None and tokenizer.pad_token_id is not None:
        return str(tokenizer.pad_token)
    for name in ("eos", "unk"):
        token = getattr(tokenizer, f"{name}_token", None)
        if token is not None and getattr(tokenizer, f"{name}_token_id", None) is not None:
            tokenizer.pad_token = token
            if (_rank_from_environment() if rank is None else rank) == 0:
                logger.warning("the tokenizer has no pad token: padding with its %s token %r (id %d); padding "
                               "is masked by length, so it never counts in the loss or the features",
                               name, str(token), tokenizer.pad_token_id)
            return str(token)
    return None


def pad_token_id_or_zero(tokenizer: Any) -> int:
    """The id that fills padded positions: the pad token's, or 0 for a tokenizer without pad, eos and unk."""
    pad_id = tokenizer.pad_token_id
    return 0 if pad_id is None else int(pad_id)


def bos_prefix(tokenizer: Any) -> list[int]:
    """``[bos_token_id]``, or ``[]`` for a tokenizer without a bos token (nothing is prepended then).

    GPT-2's bos is its end-of-text token, which is also its eos; it is prepended like any bos.
    """
    bos_id = getattr(tokenizer, "bos_token_id", None)
    return [] if bos_id is None else [int(bos_id)]
