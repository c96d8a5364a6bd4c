"""The real material of ``bench.real``: the stories260K folder, the converter, and the two shipped slices.

Fast and offline: the shipped files are checked for the properties their READMEs state, the
converter against a plain numpy llama2.c forward on a tiny random checkpoint written here, and the
rebuild commands on tiny fixtures in the source formats, made of shipped records. Set
``DS_CLUSTER_T0_SOURCE`` / ``DS_CLUSTER_FLAN_COT_SOURCE`` to the fetched source folders and run
with ``-m slow`` to also check that a full rebuild gives the shipped bytes (about a minute).
"""
from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.real import FLAN_COT_DIR, STORIES260K_DIR, T0_DIR
from bench.real import convert_llama2c, flan_cot, t0
from bench.real.example_groups import normalized_words, word_ngrams
from bench.real.slice_output import read_jsonl_gz
from bench.real.slicing import HELDOUT_FILE, TRAIN_FILE

FIELDS = ["instruction", "input", "output", "family", "dataset", "template", "example_id"]
T0_COMMIT = "0b26ccaa415992100fa32df62d41b994cf928e23"
FLAN_COMMIT = "e9e4ec6e2701182c7a91af176f705310da541277"
MAX_PROMPT_TOKENS, MAX_COMPLETION_TOKENS = 200, 40


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STORIES260K_DIR)


@pytest.fixture(scope="module")
def slices() -> dict[str, tuple[list[dict], list[dict]]]:
    return {
        name: (read_jsonl_gz(folder / TRAIN_FILE), read_jsonl_gz(folder / HELDOUT_FILE))
        for name, folder in (("t0", T0_DIR), ("flan_cot", FLAN_COT_DIR))
    }


# --- shipped slices -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t0", "flan_cot"])
def test_slice_groups_sizes_and_skew(slices, name):
    train, heldout = slices[name]
    train_counts = Counter(r["family"] for r in train)
    heldout_counts = Counter(r["family"] for r in heldout)
    assert set(train_counts) == set(heldout_counts)
    assert len(train_counts) >= 6
    assert max(train_counts.values()) >= 5 * min(train_counts.values())
    assert 6000 <= len(train) <= 10000
    assert min(heldout_counts.values()) >= 50
    if name == "t0":
        assert set(train_counts) <= set(t0.FAMILY_DATASETS)
        assert all(t0.DATASET_FAMILIES[r["dataset"]] == r["family"] for r in train + heldout)
    else:
        assert set(train_counts) <= {source for source, _, _ in flan_cot.FLAN_COT_SOURCES}
        assert all(r["dataset"] == r["family"] for r in train + heldout)


@pytest.mark.parametrize("name", ["t0", "flan_cot"])
def test_slice_records_distinct_and_fields(slices, name):
    train, heldout = slices[name]
    extra = ["rationale"] if name == "flan_cot" else []
    for record in train + heldout:
        assert list(record) == FIELDS + extra
        assert all(isinstance(record[key], str) for key in record)
        assert record["input"] == ""
        assert record["instruction"] and record["instruction"] == record["instruction"].strip()
        assert record["output"] and record["output"] == record["output"].strip()
        assert "<|endoftext|>" not in record["output"]
        dataset, number = record["example_id"].rsplit(":", 1)
        assert dataset == record["dataset"] and number.isdigit()
    pairs = [(r["instruction"], r["output"]) for r in train + heldout]
    assert len(pairs) == len(set(pairs))
    assert not {r["instruction"] for r in heldout} & {r["instruction"] for r in train}


# The leak checks below work on the shipped records alone, independently of the rebuild's rule:
# an "example 8-gram" is a word 8-gram of a prompt that at most EXAMPLE_SHINGLE_RECORDS records of
# its dataset hold and that is not template text.
EXAMPLE_SHINGLE_RECORDS = 20


def _prompt_shingles(record: dict) -> set[tuple[str, ...]]:
    return word_ngrams(normalized_words(record["instruction"]), 8)


def _example_shingles(records: list[dict], template_text: str) -> list[set[tuple[str, ...]]]:
    """Per record, its prompt 8-grams that few records of its dataset hold and that are not template text.

    ``template_text``: "repeated" (held by two prompts of one template: template wording and the
    words next to it recur across a template's prompts, an example's content is rendered once per
    template) or "majority" (held by at least two and more than half of a template's prompts; what a
    slice with one template per dataset, FLAN CoT, needs to compare questions inside a template).
    """
    shingles = [_prompt_shingles(r) for r in records]
    counts: dict[str, Counter] = {}
    template_prompts: dict[tuple[str, str], set[str]] = {}
    prompts_holding: dict[tuple[str, str, tuple[str, ...]], set[str]] = {}
    for record, record_shingles in zip(records, shingles):
        counts.setdefault(record["dataset"], Counter()).update(record_shingles)
        template_prompts.setdefault((record["dataset"], record["template"]), set()).add(record["instruction"])
        for shingle in record_shingles:
            prompts_holding.setdefault((record["dataset"], record["template"], shingle), set()).add(
                record["instruction"])
    excluded = {
        (dataset, shingle)
        for (dataset, template, shingle), prompts in prompts_holding.items()
        if len(prompts) >= 2
        and (template_text == "repeated" or 2 * len(prompts) > len(template_prompts[(dataset, template)]))
    }
    return [
        {s for s in record_shingles
         if counts[r["dataset"]][s] <= EXAMPLE_SHINGLE_RECORDS and (r["dataset"], s) not in excluded}
        for r, record_shingles in zip(records, shingles)
    ]


@pytest.mark.parametrize("name", ["t0", "flan_cot"])
def test_slice_no_example_group_on_both_sides(slices, name):
    train, heldout = slices[name]
    assert not {r["example_id"] for r in heldout} & {r["example_id"] for r in train}
    groups: dict[str, set[tuple[str, str]]] = {}
    for record in train + heldout:
        groups.setdefault(record["example_id"], set()).add((record["dataset"], record["family"]))
    assert all(len(origins) == 1 for origins in groups.values())


@pytest.mark.parametrize("name", ["t0", "flan_cot"])
def test_slice_heldout_answers_not_leaked_with_shared_content(slices, name):
    """No held-out answer of 3+ words is a train answer of its family whose prompt shares an example 8-gram.

    The split by prompt had 220 such held-out records in T0 (one example under other templates). The
    same answer alone still recurs across different examples: labels ("They loved it", "Science and
    technology", "None of the above choices .", "Not at all"), formulas ("How would you describe
    Jordan?", "do a good job") and one gigaword title given to two wire stories with no 8-gram in common.
    """
    train, heldout = slices[name]
    example_shingles = _example_shingles(train + heldout, "repeated")[len(train):]
    train_by_answer: dict[tuple[str, str], list[dict]] = {}
    for record in train:
        train_by_answer.setdefault((record["family"], record["output"]), []).append(record)
    leaks = [
        (record["example_id"], record["output"], match["example_id"])
        for record, shingles in zip(heldout, example_shingles)
        if len(record["output"].split()) >= 3
        for match in train_by_answer.get((record["family"], record["output"]), [])
        if shingles & _prompt_shingles(match)
    ]
    assert leaks == []


@pytest.mark.parametrize("name", ["t0", "flan_cot"])
def test_slice_heldout_prompts_not_near_duplicates_of_train(slices, name):
    """No held-out prompt shares half of its example 8-grams (Jaccard, 3 at least) with a train prompt of its dataset.

    The split by prompt had 468 in T0 (one example under other templates) and 23 aqua questions in
    FLAN CoT (one problem with other numbers or options); the split by example group has none above 0.3.
    """
    train, heldout = slices[name]
    shingles = _example_shingles(train + heldout, "majority")
    train_shingles, heldout_shingles = shingles[: len(train)], shingles[len(train):]
    holders: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for index, (record, record_shingles) in enumerate(zip(train, train_shingles)):
        for shingle in record_shingles:
            holders.setdefault((record["dataset"], shingle), []).append(index)
    near_duplicates = []
    for record, record_shingles in zip(heldout, heldout_shingles):
        shared = Counter(i for s in record_shingles for i in holders.get((record["dataset"], s), []))
        for index, count in shared.items():
            if count >= 3 and count >= 0.5 * len(record_shingles | train_shingles[index]):
                near_duplicates.append((record["example_id"], train[index]["example_id"]))
    assert near_duplicates == []


@pytest.mark.parametrize("name", ["t0", "flan_cot"])
def test_slice_token_lengths(slices, tokenizer, name):
    train, heldout = slices[name]
    records = train + heldout
    prompts = tokenizer([r["instruction"] for r in records], add_special_tokens=False, verbose=False)["input_ids"]
    outputs = tokenizer([r["output"] for r in records], add_special_tokens=False, verbose=False)["input_ids"]
    assert max(len(ids) for ids in prompts) <= MAX_PROMPT_TOKENS
    assert max(len(ids) for ids in outputs) <= MAX_COMPLETION_TOKENS


@pytest.mark.parametrize(("folder", "commit"), [(T0_DIR, T0_COMMIT), (FLAN_COT_DIR, FLAN_COMMIT)])
def test_slice_folder_size_and_readme(folder, commit):
    assert sum(p.stat().st_size for p in folder.iterdir()) < 5 * 2**20
    readme = (folder / "README.md").read_text(encoding="utf-8")
    assert commit in readme and "Apache-2.0" in readme and "python -m bench.real." in readme


# --- stories260K ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES260K_DIR).eval()


def test_stories260k_folder(tokenizer, stories_model):
    assert sum(p.stat().st_size for p in STORIES260K_DIR.iterdir()) < 1.5 * 2**20
    assert (STORIES260K_DIR / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    config = stories_model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (5, 64, 512)
    assert type(stories_model).__name__ == "LlamaForCausalLM"
    assert tokenizer.pad_token is None and tokenizer.pad_token_id is None
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer("Once upon a time")["input_ids"][0] == 1


def test_stories260k_tells_stories(tokenizer, stories_model):
    with torch.no_grad():
        logits = stories_model(**tokenizer("Once upon a", return_tensors="pt")).logits[0, -1]
    assert tokenizer.decode([int(logits.argmax())]) == "time"
    encoded = tokenizer("Once upon a time", return_tensors="pt")
    generated = stories_model.generate(**encoded, max_new_tokens=12, do_sample=False, pad_token_id=2)
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little")


def test_stories260k_tokenizer_follows_sentencepiece(tokenizer):
    # SentencePiece (remove_extra_whitespaces) strips and collapses spaces; newlines fall back to bytes
    plain = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    assert tokenizer("  hello   there ", add_special_tokens=False)["input_ids"] == plain
    assert "<0x0A>" in tokenizer.convert_ids_to_tokens(tokenizer("a\nb", add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(tokenizer("Lily saw a dog.\nIt ran!")["input_ids"], skip_special_tokens=True) == (
        "Lily saw a dog.\nIt ran!"
    )


# --- converter ------------------------------------------------------------------------------------------------------


def llama2c_forward(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """Logits of every position, following llama2.c's run.c (interleaved RoPE pairs), in float64 numpy."""
    config, w = convert_llama2c.read_llama2c_checkpoint(checkpoint)
    x = w["token_embedding_table"][tokens].astype(np.float64)
    length, head = len(tokens), config.head_size

    def rmsnorm(v: np.ndarray, gain: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5) * gain

    angles = np.arange(length)[:, None] / 10000.0 ** (np.arange(0, head, 2) / head)[None]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(v: np.ndarray, heads: int) -> np.ndarray:
        pairs = v.reshape(length, heads, head // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(length, heads * head)

    mask = np.triu(np.full((length, length), -np.inf), 1)
    group = config.n_heads // config.n_kv_heads
    for layer in range(config.n_layers):
        h = rmsnorm(x, w["rms_att_weight"][layer])
        q = rope(h @ w["wq"][layer].T, config.n_heads)
        k = rope(h @ w["wk"][layer].T, config.n_kv_heads)
        v = h @ w["wv"][layer].T
        attended = np.zeros((length, config.dim))
        for i in range(config.n_heads):
            qs, ks = slice(i * head, (i + 1) * head), slice((i // group) * head, (i // group + 1) * head)
            scores = q[:, qs] @ k[:, ks].T / np.sqrt(head) + mask
            p = np.exp(scores - scores.max(-1, keepdims=True))
            attended[:, qs] = (p / p.sum(-1, keepdims=True)) @ v[:, ks]
        x = x + attended @ w["wo"][layer].T
        h = rmsnorm(x, w["rms_ffn_weight"][layer])
        gate = h @ w["w1"][layer].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w["w3"][layer].T)) @ w["w2"][layer].T
    return rmsnorm(x, w["rms_final_weight"]) @ w["wcls"].T


def write_random_llama2c(path: Path, shared: bool, seed: int) -> None:
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = 16, 40, 2, 4, 2, 37, 24
    head, kv_dim = dim // heads, kv_heads * dim // heads
    rng = np.random.default_rng(seed)
    sizes = [vocab * dim, layers * dim, layers * dim * dim, 2 * layers * kv_dim * dim, layers * dim * dim,
             layers * dim, 3 * layers * hidden * dim, dim, seq_len * head]  # the last: both RoPE tables
    weights = [rng.normal(0, 0.5, n) for n in sizes]
    weights[1] = 1 + 0.1 * weights[1]  # RMSNorm gains near 1
    weights[5] = 1 + 0.1 * weights[5]
    if not shared:
        weights.append(rng.normal(0, 0.5, vocab * dim))
    header = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab if shared else -vocab, seq_len)
    path.write_bytes(header + np.concatenate(weights).astype("<f4").tobytes())


@pytest.mark.parametrize("shared", [True, False])
def test_converter_matches_llama2c_forward(tmp_path, shared):
    from transformers import AutoModelForCausalLM

    checkpoint = tmp_path / "tiny.bin"
    write_random_llama2c(checkpoint, shared, seed=int(shared))
    convert_llama2c.convert_model(checkpoint, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.tie_word_embeddings is shared
    tokens = [1, 5, 9, 33, 2, 17, 17, 4, 30, 11, 6, 36]
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double().numpy()
    reference = llama2c_forward(checkpoint, tokens)
    assert np.abs(logits - reference).max() < 1e-4 * max(1.0, np.abs(reference).max())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | int | float) -> bytes:
    if isinstance(payload, bytes):
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload
    if isinstance(payload, float):
        return _varint(number << 3 | 5) + struct.pack("<f", payload)
    return _varint(number << 3) + _varint(payload)


def test_converter_tokenizer_from_sentencepiece_model(tmp_path):
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), ("he", -1.0, 1), ("ll", -2.0, 1),
              ("▁he", -3.0, 1), ("llo", -4.0, 1), ("▁hello", -5.0, 1)]
    pieces += [(c, -10.0 - i, 1) for i, c in enumerate("▁helowrd")]
    proto = b"".join(_field(1, _field(1, p.encode()) + _field(2, s) + _field(3, t)) for p, s, t in pieces)
    proto += _field(2, _field(3, 2) + _field(40, 0) + _field(41, 1) + _field(42, 2) + _field(43, (1 << 64) - 1))
    proto += _field(3, _field(1, b"identity") + _field(3, 1) + _field(4, 1) + _field(5, 1))
    (tmp_path / "tok.model").write_bytes(proto)
    parsed = convert_llama2c.read_sentencepiece_model(tmp_path / "tok.model")
    assert (parsed.model_type, parsed.unk_id, parsed.bos_id, parsed.eos_id, parsed.pad_id) == (2, 0, 1, 2, -1)
    convert_llama2c.convert_tokenizer(tmp_path / "tok.model", tmp_path / "tok", model_max_length=64)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.pad_token is None
    tokens = tok.convert_ids_to_tokens(tok("  hello  world")["input_ids"])
    assert tokens == ["<s>", "▁hello", "▁", "w", "o", "r", "l", "d"]
    assert tok.decode(tok("hello world")["input_ids"], skip_special_tokens=True) == "hello world"


# --- rebuild commands on tiny fixtures ------------------------------------------------------------------------------


def _pick(records: list[dict], per_family: int, ok=lambda r: True) -> list[dict]:
    """The first ``per_family`` records of every family that pass ``ok``, one per prompt and per example group."""
    taken: Counter = Counter()
    prompts: set[str] = set()
    groups: set[str] = set()
    picked = []
    for record in records:
        if (ok(record) and taken[record["family"]] < per_family and record["instruction"] not in prompts
                and record["example_id"] not in groups):
            taken[record["family"]] += 1
            prompts.add(record["instruction"])
            groups.add(record["example_id"])
            picked.append(record)
    return picked


def _without_example_id(record: dict) -> str:
    """The record as sorted JSON, less its ``example_id`` (a rebuild from a fixture numbers groups anew)."""
    return json.dumps({key: value for key, value in record.items() if key != "example_id"}, sort_keys=True)


def _check_rebuild(out_a: Path, out_b: Path, shipped: list[dict], fixture: list[dict], families: int) -> None:
    for name in (TRAIN_FILE, HELDOUT_FILE):
        assert (out_a / name).read_bytes() == (out_b / name).read_bytes(), f"{name} differs between two rebuilds"
    readme_a = (out_a / "README.md").read_text(encoding="utf-8").replace(str(out_a), "OUT")
    assert readme_a == (out_b / "README.md").read_text(encoding="utf-8").replace(str(out_b), "OUT")
    train, heldout = read_jsonl_gz(out_a / TRAIN_FILE), read_jsonl_gz(out_a / HELDOUT_FILE)
    shipped_keys = {_without_example_id(r) for r in shipped}
    assert all(_without_example_id(r) in shipped_keys for r in train + heldout)
    # A fixture this small has one or two records a template, so template text passes for content and
    # links some records of different shipped groups; those held out give up their other records.
    dropped = re.search(r"the other records of held-out groups, dropped: (\d+)", readme_a)
    assert dropped and len(train) + len(heldout) + int(dropped.group(1)) == len(fixture)
    assert Counter(r["family"] for r in heldout) == {f: 3 for f in {r["family"] for r in fixture}}
    assert len({r["family"] for r in train}) == families
    assert not {r["instruction"] for r in heldout} & {r["instruction"] for r in train}
    assert not {r["example_id"] for r in heldout} & {r["example_id"] for r in train}
    assert all(r["example_id"].startswith(r["dataset"] + ":") for r in train + heldout)


def test_t0_rebuild_from_fixture(tmp_path, slices):
    train, heldout = slices["t0"]
    fixture = _pick(train + heldout, 8)
    source = tmp_path / "data_per_template"
    source.mkdir()
    lines: dict[str, list[str]] = {}
    for record in fixture:
        row = {"prompt": record["instruction"] + "\n", "completion": record["output"] + "<|endoftext|>"}
        lines.setdefault(f"{record['dataset']}_{record['template']}.jsonl", []).append(json.dumps(row))
    first = next(iter(lines))
    lines[first].append(lines[first][0])  # an exact duplicate: dropped
    lines["trec_trec1.jsonl"] = [json.dumps({"prompt": "What is this?\n", "completion": "<|endoftext|>"})]
    long_prompt = {"prompt": "word " * 300, "completion": "yes<|endoftext|>"}
    lines["xsum_DOC_tldr.jsonl"] = [json.dumps(long_prompt)]  # too long; summarization keeps its 8 others
    lines["ropes_prompt_mix.jsonl"] = [json.dumps({"prompt": "Which?\n", "completion": "A<|endoftext|>"})]
    for file_name, file_lines in lines.items():
        (source / file_name).write_text("\n".join(file_lines) + "\n", encoding="utf-8")
    options = ["--heldout-per-family", "3", "--train-size", "1000", "--min-family-records", "4"]
    for out in ("a", "b"):
        t0.main(["--source", str(tmp_path), "--out", str(tmp_path / out), "--source-commit", T0_COMMIT, *options])
    _check_rebuild(tmp_path / "a", tmp_path / "b", train + heldout, fixture, len(t0.FAMILY_DATASETS) - 1)
    readme = (tmp_path / "a" / "README.md").read_text(encoding="utf-8")
    assert "extractive_qa (1 left)" in readme and T0_COMMIT in readme


def test_flan_cot_rebuild_from_fixture(tmp_path, slices):
    train, heldout = slices["flan_cot"]
    fixture = _pick(train + heldout, 8, ok=lambda r: "\\" not in r["instruction"] + r["rationale"])
    source = tmp_path / "flan" / "v2" / "cot_data"
    source.mkdir(parents=True)
    lines: dict[str, list[str]] = {}
    for record in fixture:
        fields = (record["instruction"], record["output"], record["rationale"])
        lines.setdefault(record["family"], []).append("\t".join(f.replace("\n", "\\n") for f in fields))
    for family, family_lines in lines.items():
        (source / f"{family}_train.tsv").write_text("\n".join(family_lines) + "\n", encoding="utf-8")
    options = ["--heldout-per-family", "3", "--train-size", "1000", "--min-family-records", "4"]
    for out in ("a", "b"):
        flan_cot.main(["--source", str(tmp_path), "--out", str(tmp_path / out), *options])
    _check_rebuild(tmp_path / "a", tmp_path / "b", train + heldout, fixture, len(lines))
    readme = (tmp_path / "a" / "README.md").read_text(encoding="utf-8")
    assert "`esnli_train.tsv`" in readme and "`qed_train.tsv`" in readme


# --- full rebuilds (slow; only with the fetched sources) ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "variable", "folder", "commit"),
    [
        (t0, "DS_CLUSTER_T0_SOURCE", T0_DIR, T0_COMMIT),
        (flan_cot, "DS_CLUSTER_FLAN_COT_SOURCE", FLAN_COT_DIR, FLAN_COMMIT),
    ],
)
def test_full_rebuild_gives_shipped_bytes(tmp_path, module, variable, folder, commit):
    source = os.environ.get(variable)
    if not source:
        pytest.skip(f"set {variable} to the fetched source folder to rebuild the shipped slice")
    module.main(["--source", source, "--out", str(tmp_path), "--source-commit", commit])
    for name in (TRAIN_FILE, HELDOUT_FILE):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes()
