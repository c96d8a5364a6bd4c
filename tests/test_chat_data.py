"""Chat records (``messages``, ShareGPT ``conversations``) rendered with SmolLM2's chat template: the loss covers the
assistant tokens only, checked token by token; the sources they come from; their errors and truncation."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from ds_cluster.data.dataset import (IGNORE_INDEX, InstructionDataset, dataset_fingerprint, encode_example,
                                     encode_prompt, load_instruction_dataset, read_records, write_jsonl)
from tests.fixtures.tokenizers import load_tokenizer, tiny_model_folder
from tests.launching import REPO, check, run_single
from tests.training import TRAIN

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
MULTI_TURN = {"messages": [
    {"role": "system", "content": "You answer in lists."},
    {"role": "user", "content": "What do I need for pancakes?"},
    {"role": "assistant", "content": "Sure!\n\n1. Eggs\n2. Milk 250 ml\n3. Flour"},
    {"role": "user", "content": "And for 4 people?"},
    {"role": "assistant", "content": "Double it: 2 eggs per person."},
], "category": "cooking"}
SHAREGPT = {"conversations": [{"from": "system", "value": "You answer in lists."},
                              {"from": "human", "value": "What do I need for pancakes?"},
                              {"from": "gpt", "value": "Sure!\n\n1. Eggs\n2. Milk 250 ml\n3. Flour"},
                              {"from": "human", "value": "And for 4 people?"},
                              {"from": "gpt", "value": "Double it: 2 eggs per person."}], "family": "cooking"}
# SmolLM2's one assistant-turn expression, and the same turn with its text marked for return_assistant_tokens_mask.
SMOLLM2_TURN = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
MARKED_TURN = ("{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
               "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}" + SMOLLM2_TURN
               + "{% endif %}")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return load_tokenizer("smollm2", tmp_path_factory.mktemp("smollm2"))


def _chatml_expected(tokenizer, turns: list[tuple[str, str]]) -> tuple[list[int], list[bool]]:
    """ChatML written out by hand, turn by turn: ids, and which ids are an assistant's content or its <|im_end|>."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids: list[int] = []
    labelled: list[bool] = []
    for role, content in turns:
        def tokens(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        header, body, newline = [start] + tokens(f"{role}\n"), tokens(content) + [end], tokens("\n")
        ids += header + body + newline
        labelled += [False] * len(header) + [role == "assistant"] * len(body) + [False] * len(newline)
    return ids, labelled


def _labelled_runs(tokenizer, item: dict) -> list[str]:
    runs, run = [], []
    for token, label in zip(item["input_ids"].tolist(), item["labels"].tolist()):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs + ([tokenizer.decode(run)] if run else [])


def test_multi_turn_labels_are_the_assistant_tokens_token_by_token(smollm2):
    dataset = InstructionDataset([MULTI_TURN], smollm2, max_length=160)
    item = dataset[0]
    length = int(item["attention_mask"].sum())
    expected_ids, expected_labelled = _chatml_expected(smollm2, [(m["role"], m["content"])
                                                                  for m in MULTI_TURN["messages"]])
    assert item["input_ids"][:length].tolist() == expected_ids
    labels = item["labels"][:length].tolist()
    for position, (token, labelled) in enumerate(zip(expected_ids, expected_labelled)):
        assert labels[position] == (token if labelled else IGNORE_INDEX), (position, smollm2.decode([token]))
    assert _labelled_runs(smollm2, item) == [MULTI_TURN["messages"][2]["content"] + "<|im_end|>",
                                             MULTI_TURN["messages"][4]["content"] + "<|im_end|>"]
    # pad is eos (<|im_end|>) here, and every <|im_end|> of the conversation is attended: mask from the length.
    assert smollm2.pad_token_id == smollm2.eos_token_id
    assert item["attention_mask"][:length].all() and not item["attention_mask"][length:].any()
    assert (item["input_ids"][length:] == smollm2.pad_token_id).all() and (item["labels"][length:] == -100).all()
    assert dataset.categories == ["cooking"]


def test_the_template_default_system_turn_is_not_labelled(smollm2):
    record = {"messages": MULTI_TURN["messages"][1:3]}
    item = InstructionDataset([record], smollm2, max_length=128)[0]
    length = int(item["attention_mask"].sum())
    expected_ids, expected_labelled = _chatml_expected(
        smollm2, [("system", DEFAULT_SYSTEM)] + [(m["role"], m["content"]) for m in record["messages"]])
    assert item["input_ids"][:length].tolist() == expected_ids
    assert (item["labels"][:length] != IGNORE_INDEX).tolist() == expected_labelled


def test_a_conversation_that_opens_with_the_assistant(smollm2):
    record = {"messages": [{"role": "assistant", "content": "Hi, I am here."}, {"role": "user", "content": "ok"},
                           {"role": "assistant", "content": "Good."}]}
    item = InstructionDataset([record], smollm2, max_length=128)[0]
    assert _labelled_runs(smollm2, item) == ["Hi, I am here.<|im_end|>", "Good.<|im_end|>"]


def test_sharegpt_conversations_give_the_same_items_as_messages(smollm2):
    from_messages = InstructionDataset([MULTI_TURN], smollm2, max_length=160)
    from_sharegpt = InstructionDataset([SHAREGPT], smollm2, max_length=160)
    assert all(torch.equal(from_messages[0][key], from_sharegpt[0][key]) for key in from_messages[0])
    assert from_sharegpt.categories == ["cooking"]


def test_a_template_with_generation_markers_marks_the_same_tokens(tmp_path):
    plain = load_tokenizer("smollm2", tmp_path / "plain")
    marked = load_tokenizer("smollm2", tmp_path / "marked")
    assert SMOLLM2_TURN in marked.chat_template
    marked.chat_template = marked.chat_template.replace(SMOLLM2_TURN, MARKED_TURN)
    records = [MULTI_TURN, {"messages": MULTI_TURN["messages"][1:]}]
    for a, b in zip(InstructionDataset(records, plain, max_length=160), InstructionDataset(records, marked,
                                                                                            max_length=160)):
        assert all(torch.equal(a[key], b[key]) for key in a)


class _WithoutOffsets:
    """A tokenizer as a slow (Python) one looks to the chat code: no offsets, so token counts of text prefixes."""

    is_fast = False

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, text, **kwargs):
        assert "return_offsets_mapping" not in kwargs
        return self._tokenizer(text, **kwargs)


def test_a_tokenizer_without_offsets_marks_the_same_tokens(smollm2):
    records = [MULTI_TURN, {"messages": MULTI_TURN["messages"][1:3]}]
    for record in records:
        assert encode_example(_WithoutOffsets(smollm2), record, 160) == encode_example(smollm2, record, 160)


def test_mixed_alpaca_and_chat_records_in_one_dataset(smollm2):
    alpaca = {"instruction": "Say yes.", "input": "", "output": "yes", "category": "plain"}
    dataset = InstructionDataset([alpaca, MULTI_TURN], smollm2, max_length=160)
    ids, labels = encode_example(smollm2, alpaca, 160)
    assert dataset[0]["input_ids"][:len(ids)].tolist() == ids and dataset[0]["labels"][:len(ids)].tolist() == labels
    assert dataset.categories == ["plain", "cooking"]


def test_prompt_completion_records_use_the_prompt_as_it_is(smollm2):
    record = {"prompt": "Q: What is 2+2?\nA:", "completion": " 4", "category": "math"}
    ids, labels = encode_example(smollm2, record, 64)
    prompt = smollm2(record["prompt"], add_special_tokens=False)["input_ids"]
    answer = smollm2(record["completion"], add_special_tokens=False)["input_ids"] + [smollm2.eos_token_id]
    assert encode_prompt(smollm2, record) == [smollm2.bos_token_id] + prompt
    assert ids == [smollm2.bos_token_id] + prompt + answer
    assert labels == [IGNORE_INDEX] * (1 + len(prompt)) + answer


def test_the_generation_prompt_is_the_conversation_before_the_last_answer(smollm2):
    prompt = encode_prompt(smollm2, MULTI_TURN)
    ids, labels = encode_example(smollm2, MULTI_TURN, 512)
    last_answer_start = max(i for i in range(len(labels)) if labels[i] != IGNORE_INDEX and
                            labels[i - 1] == IGNORE_INDEX)
    assert prompt == ids[:last_answer_start]
    assert smollm2.decode(prompt).endswith("<|im_start|>assistant\n")


def test_truncation_cuts_the_start_but_keeps_the_last_answers_start(smollm2):
    ids, labels = encode_example(smollm2, MULTI_TURN, 512)
    last_answer_start = max(i for i in range(len(labels)) if labels[i] != IGNORE_INDEX and
                            labels[i - 1] == IGNORE_INDEX)
    # A little too long: the oldest tokens after the bos (<|im_start|>) go.
    short_ids, short_labels = encode_example(smollm2, MULTI_TURN, len(ids) - 5)
    assert short_ids == ids[:1] + ids[6:] and short_labels == labels[:1] + labels[6:]
    # Far too long: everything before the last answer goes, then the answer loses its end.
    short_ids, short_labels = encode_example(smollm2, MULTI_TURN, 4)
    assert short_ids == ids[:1] + ids[last_answer_start:last_answer_start + 3]
    assert short_labels == [IGNORE_INDEX] + short_ids[1:]
    item = InstructionDataset([MULTI_TURN], smollm2, max_length=12)[0]
    assert int(item["attention_mask"].sum()) == 12 and item["input_ids"][0] == smollm2.bos_token_id


BAD_RECORDS = [
    ({"messages": "hello"}, r"record 1: field 'messages' must be a non-empty list of turns"),
    ({"messages": []}, r"record 1: field 'messages' must be a non-empty list of turns"),
    ({"messages": [{"role": "user", "text": "hi"}]}, r"record 1: field 'messages', turn 0: 'content' must be a "
                                                     r"string, got NoneType"),
    ({"messages": [{"content": "hi"}]}, r"record 1: field 'messages', turn 0: 'role' must be a role name"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"record 1: field 'messages' has no assistant turn"),
    ({"messages": ["hi"]}, r"record 1: field 'messages', turn 0 must be an object with 'role' and 'content'"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]},
     r"record 1: field 'conversations', turn 1: 'from' is 'bot'; expected one of"),
    ({"instruction": "Do it."}, r"record 1: field 'output' is missing \(a record needs 'instruction' and 'output', "
                                r"or 'prompt' and 'completion', or 'messages', or 'conversations'\)"),
    ({"prompt": "Q: 2+2?\nA:"}, r"record 1: field 'completion' is missing"),
    ({"instruction": "Do it.", "output": 3}, r"record 1: field 'output' must be a string, got int"),
    ({"instruction": "Do it.", "input": 3, "output": "x"}, r"record 1: field 'input' must be a string, got int"),
    (["instruction", "output"], r"record 1 must be an object of fields \(a dict\), got list"),
]


@pytest.mark.parametrize("bad,message", BAD_RECORDS, ids=[str(i) for i in range(len(BAD_RECORDS))])
def test_a_bad_record_is_named_by_index_and_field(smollm2, bad, message):
    with pytest.raises(ValueError, match=message):
        InstructionDataset([MULTI_TURN, bad], smollm2, max_length=64)


def test_a_tokenizer_without_a_chat_template_names_the_fix(tmp_path):
    gpt2 = load_tokenizer("gpt2", tmp_path)
    with pytest.raises(ValueError, match=r"record 0 has field 'messages', but the tokenizer has no chat template: "
                                         r"set tokenizer.chat_template .* or convert the records to Alpaca fields"):
        InstructionDataset([MULTI_TURN], gpt2, max_length=64)


def test_a_template_that_fails_on_a_record_names_the_record(tmp_path):
    strict = load_tokenizer("smollm2", tmp_path)
    strict.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    with pytest.raises(ValueError, match=r"record 0: the chat template could not render its turns .*user first"):
        InstructionDataset([MULTI_TURN], strict, max_length=64)


def test_jsonl_gzip_dataset_object_and_folder_give_the_same_items(smollm2, tmp_path):
    import datasets

    records = [MULTI_TURN, {"messages": MULTI_TURN["messages"][1:3], "category": "short"}]
    write_jsonl(records, tmp_path / "chat.jsonl")
    with gzip.open(tmp_path / "chat.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    hf = datasets.Dataset.from_list(records)
    hf.save_to_disk(str(tmp_path / "hf"))
    sources = [tmp_path / "chat.jsonl", tmp_path / "chat.jsonl.gz", hf, datasets.DatasetDict({"train": hf}),
               str(tmp_path / "hf"), records]
    loaded = [load_instruction_dataset(source, smollm2, max_length=128) for source in sources]
    assert len({dataset_fingerprint(dataset) for dataset in loaded}) == 1
    assert all(dataset.categories == ["cooking", "short"] for dataset in loaded)
    assert read_records(hf) == read_records(tmp_path / "chat.jsonl.gz") == records
    with pytest.raises(ValueError, match=r"holds splits \['a', 'b'\]; pass one split"):
        read_records(datasets.DatasetDict({"a": hf, "b": hf}))


# A ChatML-like template for llama2.c's tokenizer (no pad, no template of its own).
STORIES_TEMPLATE = ("{% for message in messages %}"
                    "{{ bos_token + message['role'] + ': ' + message['content'] + eos_token }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ bos_token + 'assistant: ' }}{% endif %}")


@pytest.mark.integration
def test_training_on_gzipped_chat_and_alpaca_with_a_pad_less_tokenizer(tmp_path):
    """python -m ds_cluster.train, one process: the model's tokenizer has no pad, the data is gzipped JSONL of
    chat and Alpaca records; the hook computes the analysis in the job and trains on the plan."""
    folder = tiny_model_folder("stories260k", tmp_path, chat_template=STORIES_TEMPLATE)
    records = []
    for index in range(24):
        story = f"Tim had {index} red balls and a big dog."
        records.append({"messages": [{"role": "user", "content": f"Tell story {index}."},
                                     {"role": "assistant", "content": story}]} if index % 2 else
                       {"instruction": f"Tell story {index}.", "input": "", "output": story})
    with gzip.open(tmp_path / "train.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    config = json.loads((REPO / "ds_configs" / "zero0.json").read_text())
    block = config["data_efficiency"]["data_sampling"]["cluster_sampling"]
    block.update(num_clusters=2, allocation="stratified", analysis_path=str(tmp_path / "analysis"))
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    result = check(run_single([*TRAIN, "--deepspeed", str(tmp_path / "ds_config.json"), "--model", str(folder),
                               "--data", str(tmp_path / "train.jsonl.gz"), "--output-dir", str(tmp_path / "out"),
                               "--max-length", "48", "--max-steps", "2"], timeout=300))
    output = result.stdout + result.stderr
    assert "done: 2 steps" in output and "the tokenizer has no pad token: padding with its eos token" in output
    assert (tmp_path / "analysis" / "labels.npy").exists()
