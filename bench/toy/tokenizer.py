"""A deterministic character-level tokenizer for the tiny model.

One token per printable ASCII character (plus newline and tab), four special
tokens, and one token for each header of the prompt template, so a prompt
costs a handful of tokens more than its text (the headers alone are ~45
characters). Built in code with the ``tokenizers`` library: nothing is
downloaded, and the same vocabulary comes out every time.
"""
from __future__ import annotations

import string

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ds_cluster.data.dataset import INPUT_HEADER, INSTRUCTION_HEADER, RESPONSE_HEADER

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)

# The Alpaca template's headers are one token each: a prompt costs a few tokens more than its text.
TEMPLATE_TOKENS: tuple[str, ...] = (INSTRUCTION_HEADER, INPUT_HEADER, RESPONSE_HEADER)

# Printable ASCII in code-point order, then newline and tab; \r, \x0b, \x0c are left to <unk>.
CHARACTERS: tuple[str, ...] = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")


def _vocabulary() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token in SPECIAL_TOKENS + TEMPLATE_TOKENS + CHARACTERS:
        vocab.setdefault(token, len(vocab))
    return vocab


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer; ``save_pretrained`` and ``AutoTokenizer`` reload it offline.

    It adds no special tokens by itself: callers place ``<s>`` and ``</s>``
    where they want them (ds_cluster.data.dataset does).
    """
    assert set(string.printable) - set(CHARACTERS) == {"\r", "\x0b", "\x0c"}
    backend = Tokenizer(models.WordLevel(vocab=_vocabulary(), unk_token=UNK))
    # Every character is its own piece; [\s\S] also matches newlines.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # Template headers are matched before the character split, as whole tokens.
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEMPLATE_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="right",
        # Spaces are characters here; the default clean-up would delete some of them.
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
