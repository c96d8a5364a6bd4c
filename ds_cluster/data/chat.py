"""Chat records: ``messages`` (role/content) and ShareGPT ``conversations`` (from/value), rendered with the
tokenizer's chat template, with a mask of the assistant tokens (the only ones the loss and features see).

The assistant tokens of a turn are what the template adds between the conversation before it, rendered
with the generation prompt (``<|im_start|>assistant\\n``), and the conversation up to and including it;
trailing whitespace after the turn's end token is not included (the model stops at the end token and never
generates it). Found in characters by rendering the conversation prefix by prefix, then mapped to tokens
through the tokenizer's offsets, so no template needs ``{% generation %}`` markers; a template that has
them is read through ``return_assistant_tokens_mask`` instead, which also serves templates that do not
render a conversation's prefixes as prefixes of the whole.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

# ShareGPT speaker names, as the role the chat templates know.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system"}
CHAT_FIELDS = ("messages", "conversations")
# A template that marks the assistant's text itself (``{% generation %}``, with or without whitespace control).
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
NO_TEMPLATE_FIX = ("set tokenizer.chat_template (a Jinja template, e.g. the model's own from its "
                   "tokenizer_config.json or chat_template.jinja) or convert the records to Alpaca fields "
                   "(instruction, input, output)")


def chat_field(record: Mapping[str, Any]) -> Optional[str]:
    """'messages' or 'conversations' for a chat record, None for any other (an Alpaca record)."""
    return next((field for field in CHAT_FIELDS if record.get(field) is not None), None)


def chat_messages(record: Mapping[str, Any], index: int) -> list[dict[str, str]]:
    """The record's turns as ``{"role", "content"}`` dicts; ValueError naming the record and field if malformed."""
    field = chat_field(record)
    turns = record.get(field) if field else None
    if not isinstance(turns, (list, tuple)) or not turns:
        raise ValueError(f"record {index}: field {field or 'messages'!r} must be a non-empty list of turns, "
                         f"got {turns!r:.80}")
    role_key, text_key = ("role", "content") if field == "messages" else ("from", "value")
    messages = []
    for turn_index, turn in enumerate(turns):
        where = f"record {index}: field {field!r}, turn {turn_index}"
        if not isinstance(turn, Mapping):
            raise ValueError(f"{where} must be an object with {role_key!r} and {text_key!r}, got {turn!r:.80}")
        role, text = turn.get(role_key), turn.get(text_key)
        if field == "conversations":
            if role not in SHAREGPT_ROLES:
                raise ValueError(f"{where}: {role_key!r} is {role!r}; expected one of {sorted(SHAREGPT_ROLES)}")
            role = SHAREGPT_ROLES[role]
        elif not isinstance(role, str) or not role:
            raise ValueError(f"{where}: {role_key!r} must be a role name such as 'user' or 'assistant', "
                             f"got {role!r}")
        if not isinstance(text, str):
            raise ValueError(f"{where}: {text_key!r} must be a string, got {type(text).__name__}")
        messages.append({"role": role, "content": text})
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"record {index}: field {field!r} has no assistant turn, so nothing to learn from")
    return messages


def check_chat_template(tokenizer: Any, record: Mapping[str, Any], index: int) -> None:
    """ValueError naming the fix when a chat record meets a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"record {index} has field {chat_field(record)!r}, but the tokenizer has no chat "
                         f"template: {NO_TEMPLATE_FIX}")


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], index: int,
                add_generation_prompt: bool = False) -> str:
    """The turns rendered as text with the tokenizer's chat template; ValueError naming the record if it fails."""
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:  # a template's own raise_exception, or a Jinja error: name the record
        raise ValueError(f"record {index}: the chat template could not render its turns "
                         f"({type(err).__name__}: {err})") from err


def _turn_start(tokenizer: Any, messages: Sequence[Mapping[str, str]], turn: int, text: str, index: int) -> int:
    """Where assistant turn ``turn``'s tokens start in ``text``: after the earlier turns and the generation prompt.

    When the conversation does not render that way (an assistant turn first: there is no earlier
    conversation to render; a template that puts a default system turn before the first message), the
    turn's content is looked up after the earlier turns instead.
    """
    earlier_end = 0
    if turn > 0:
        prompt = render_chat(tokenizer, messages[:turn], index, add_generation_prompt=True)
        if text.startswith(prompt):
            return len(prompt)
        earlier = render_chat(tokenizer, messages[:turn], index)
        earlier_end = len(earlier) if text.startswith(earlier) else 0
    content = messages[turn]["content"].strip()
    found = text.find(content, earlier_end) if content else -1
    if found < 0:
        raise ValueError(f"record {index}: the chat template's generation prompt before assistant turn {turn} is "
                         "not how the whole conversation renders there, so its tokens cannot be found by prefix; "
                         "mark them in the template with {% generation %} ... {% endgeneration %}")
    return found


def assistant_char_spans(tokenizer: Any, messages: Sequence[Mapping[str, str]], text: str,
                         index: int) -> list[tuple[int, int]]:
    """[start, end) in ``text`` (the whole rendered conversation) of each assistant turn's tokens."""
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _turn_start(tokenizer, messages, turn, text, index)
        through_turn = render_chat(tokenizer, messages[:turn + 1], index)
        if not text.startswith(through_turn):
            raise ValueError(f"record {index}: the chat template does not render turns 0..{turn} as the start "
                             "of the whole conversation, so the assistant tokens cannot be found by prefix; "
                             "mark them in the template with {% generation %} ... {% endgeneration %}")
        end = len(through_turn)
        while end > start and text[end - 1].isspace():
            end -= 1
        if end <= start:
            raise ValueError(f"record {index}: assistant turn {turn} renders to no text")
        spans.append((start, end))
    return spans


def _tokens_in_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], index: int
                     ) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` and which of them fall in ``spans`` (by offsets, or prefix lengths without them)."""
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        # A zero-width offset (whitespace trimmed away) counts as one character for the overlap test.
        inside = [any(start < span_end and max(end, start + 1) > span_start for span_start, span_end in spans)
                  for start, end in encoded["offset_mapping"]]
        return ids, inside
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    inside = [False] * len(ids)
    for span_start, span_end in spans:
        first, last = (_prefix_token_count(tokenizer, text, ids, at, index) for at in (span_start, span_end))
        inside[first:last] = [True] * (last - first)
    return ids, inside


def _prefix_token_count(tokenizer: Any, text: str, ids: Sequence[int], at: int, index: int) -> int:
    prefix = tokenizer(text[:at], add_special_tokens=False)["input_ids"]
    if list(ids[:len(prefix)]) != list(prefix):
        raise ValueError(f"record {index}: the tokens of the conversation up to character {at} are not a prefix "
                         "of the whole conversation's tokens; use a fast tokenizer (offsets) or a template with "
                         "{% generation %} markers")
    return len(prefix)


def _generation_marked_tokens(tokenizer: Any, messages: Sequence[Mapping[str, str]], index: int
                              ) -> tuple[list[int], list[bool]]:
    try:
        encoded = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
    except Exception as err:
        raise ValueError(f"record {index}: the chat template could not render its turns "
                         f"({type(err).__name__}: {err})") from err
    return list(encoded["input_ids"]), [bool(flag) for flag in encoded["assistant_masks"]]


def encode_conversation(tokenizer: Any, messages: Sequence[Mapping[str, str]], index: int
                        ) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is an assistant token."""
    template = tokenizer.chat_template
    if isinstance(template, Mapping):  # several named templates: apply_chat_template renders the default one
        template = template.get("default") or ""
    if GENERATION_MARKER.search(template):
        ids, assistant = _generation_marked_tokens(tokenizer, messages, index)
    else:
        text = render_chat(tokenizer, messages, index)
        ids, assistant = _tokens_in_spans(tokenizer, text, assistant_char_spans(tokenizer, messages, text, index),
                                          index)
    if not any(assistant):
        raise ValueError(f"record {index}: no token of the rendered conversation belongs to an assistant turn")
    return ids, assistant


def truncate_conversation(ids: list[int], assistant: list[bool], max_length: int, lead: int
                          ) -> tuple[list[int], list[bool]]:
    """At most ``max_length`` tokens: cut from the left (after ``lead`` kept tokens, the bos) but never past the
    first token of the last assistant turn, then from the right end."""
    overflow = len(ids) - max_length
    if overflow <= 0:
        return ids, assistant
    last_turn_start = max(position for position, flag in enumerate(assistant) if flag)
    while last_turn_start > 0 and assistant[last_turn_start - 1]:
        last_turn_start -= 1
    cut = min(overflow, max(last_turn_start - lead, 0))
    ids, assistant = ids[:lead] + ids[lead + cut:], assistant[:lead] + assistant[lead + cut:]
    return ids[:max_length], assistant[:max_length]


def last_assistant_turn(messages: Sequence[Mapping[str, str]]) -> int:
    """The index of the conversation's last assistant turn (chat_messages guarantees there is one)."""
    return max(turn for turn, message in enumerate(messages) if message["role"] == "assistant")


def encode_chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]], index: int) -> list[int]:
    """Token ids of the conversation before its last assistant turn, with the generation prompt: what a model is
    given to produce that turn."""
    last = last_assistant_turn(messages)
    text = render_chat(tokenizer, messages[:last], index, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
