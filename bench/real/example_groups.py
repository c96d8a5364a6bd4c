"""Example groups: the records of one dataset that render the same underlying example.

T0 renders one row of a dataset under several promptsource templates; FLAN rewords some problems.
A slice must keep such records on one side of its train/held-out split, so ``example_group_ids``
links them (same prompt; a content key each template holds once; near-duplicate example 8-grams)
and returns each record's group id (``"<dataset>:<n>"``). The rule, written out for the READMEs,
is ``EXAMPLE_GROUP_RULE_MARKDOWN``.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Sequence

from tqdm import tqdm

from bench.real.records import SourceRecord

PUNCTUATION = re.compile(r"[^\w\s]+")
KEY_WORDS = 4  # a content key is a word 4-gram, or a shorter whole text (a short answer, a short template slot)
MIN_ANSWER_KEY_WORDS = 2  # an answer of at least this many words is also looked for inside other records
MIN_SAME_ANSWER_WORDS = 3  # rule 3: the same answer counts when it has at least this many words ...
MAX_SAME_ANSWER_RECORDS = 20  # ... and at most this many records of the dataset have it (labels have more)
MIN_SLOT_TEMPLATE_PROMPTS = 3  # a template's slot (what its prompts do not share) needs this many prompts
SHINGLE_WORDS = 8  # the near-duplicate test compares word 8-grams ...
MAX_SHINGLE_RECORDS = 50  # ... that occur in at most this many records of the dataset ...
MIN_SHARED_SHINGLES = 3  # ... of which two records must share at least this many ...
MIN_SHINGLE_JACCARD = 0.3  # ... making this share of their union (or one, with the same rare answer of 3+ words)
REPEATED = -1
ANSWER_KEY = "<answer>"  # key markers; "<" and ">" never survive normalized_words
SHORT_KEY = "<short>"


def normalized_words(text: str) -> tuple[str, ...]:
    """The words of ``text``: lower-cased, punctuation replaced by spaces."""
    return tuple(PUNCTUATION.sub(" ", text.lower()).split())


def word_ngrams(words: Sequence[str], length: int) -> set[tuple[str, ...]]:
    """The distinct ``length``-word runs of ``words``."""
    return {tuple(words[i : i + length]) for i in range(len(words) - length + 1)}


class UnionFind:
    """Disjoint sets over ``0 .. size - 1``."""

    def __init__(self, size: int) -> None:
        self.parent = list(range(size))

    def find(self, item: int) -> int:
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, first: int, second: int) -> None:
        self.parent[self.find(first)] = self.find(second)


def example_group_ids(records: Sequence[SourceRecord]) -> list[str]:
    """``"<dataset>:<n>"`` for every record: records of one dataset that render the same example share it.

    ``n`` numbers a dataset's groups in the order of their first record, so the ids are stable for
    the same records in the same order. Two records of a dataset are linked (and groups are the
    connected sets of links) when

    1. they have the same prompt (as ``normalized_words``);
    2. they share a content key that each of their templates holds in only one distinct prompt.
       Keys are the word 4-grams of the prompt and of the completion (``normalized_words``); a
       completion of 2+ words found as a word run inside the other record; and short texts of
       1 to 3 words: a whole completion, or a template's slot (a prompt less the words all the
       template's prompts begin and end with). Template wording and formulas such as "What will
       Kendall want to do next?" recur in several prompts of one template; an example's own
       content is rendered once per template;
    3. they share an example 8-gram and have the same completion of 3+ words that at most 20
       records of the dataset have (not a label), or they share at least 3 example 8-grams that make
       at least 30% of their example 8-grams (near-duplicate source examples, whose content recurs
       inside each template and so fails rule 2). An example 8-gram occurs in at most 50 records of
       the dataset and is not a template phrase (one in at least two and more than half of the
       distinct prompts of a template).
    """
    by_dataset: dict[str, list[int]] = defaultdict(list)
    for index, record in enumerate(records):
        by_dataset[record.dataset].append(index)
    example_ids = [""] * len(records)
    for dataset, indices in tqdm(sorted(by_dataset.items()), desc="example groups", disable=len(records) < 5000):
        roots = _dataset_example_roots([records[i] for i in indices])
        numbers: dict[int, int] = {}
        for index, root in zip(indices, roots):
            example_ids[index] = f"{dataset}:{numbers.setdefault(root, len(numbers))}"
    return example_ids


def _dataset_example_roots(records: Sequence[SourceRecord]) -> list[int]:
    """The union-find root of every record of one dataset under the three rules of ``example_group_ids``."""
    prompt_words = [normalized_words(r.prompt) for r in records]
    answer_words = [normalized_words(r.completion) for r in records]
    prompt_ids: dict[tuple[str, ...], int] = {}
    prompt_of = [prompt_ids.setdefault(words, len(prompt_ids)) for words in prompt_words]
    links = UnionFind(len(records))
    first_with_prompt: dict[int, int] = {}
    for index, prompt_id in enumerate(prompt_of):
        links.union(index, first_with_prompt.setdefault(prompt_id, index))
    _link_by_content_keys(records, prompt_words, answer_words, prompt_of, links)
    _link_near_duplicates(records, prompt_words, answer_words, prompt_of, links)
    return [links.find(i) for i in range(len(records))]


def _content_keys(records: Sequence[SourceRecord], prompt_words: list[tuple[str, ...]],
                  answer_words: list[tuple[str, ...]]) -> list[set[tuple[str, ...]]]:
    """Every record's content keys (rule 2 of ``example_group_ids``)."""
    keys = [word_ngrams(p, KEY_WORDS) | word_ngrams(a, KEY_WORDS) for p, a in zip(prompt_words, answer_words)]
    answers_by_start: dict[tuple[str, ...], set[tuple[str, ...]]] = defaultdict(set)
    for answer in answer_words:
        if len(answer) >= MIN_ANSWER_KEY_WORDS:
            answers_by_start[answer[:MIN_ANSWER_KEY_WORDS]].add(answer)
    for record_keys, prompt, answer in zip(keys, prompt_words, answer_words):
        if 1 <= len(answer) < KEY_WORDS:
            record_keys.add((SHORT_KEY,) + answer)
        for words in (prompt, answer):
            for start in range(len(words) - MIN_ANSWER_KEY_WORDS + 1):
                for candidate in answers_by_start.get(words[start : start + MIN_ANSWER_KEY_WORDS], ()):
                    if words[start : start + len(candidate)] == candidate:
                        record_keys.add((ANSWER_KEY,) + candidate)
    by_template: dict[str, list[int]] = defaultdict(list)
    for index, record in enumerate(records):
        by_template[record.template].append(index)
    for indices in by_template.values():
        prompts = sorted({prompt_words[i] for i in indices})
        if len(prompts) < MIN_SLOT_TEMPLATE_PROMPTS:
            continue
        prefix = _common_prefix_length(prompts)
        suffix = _common_prefix_length([p[prefix:][::-1] for p in prompts])
        for index in indices:
            slot = prompt_words[index][prefix : len(prompt_words[index]) - suffix]
            if 1 <= len(slot) < KEY_WORDS:
                keys[index].add((SHORT_KEY,) + slot)
    return keys


def _common_prefix_length(sequences: Sequence[tuple[str, ...]]) -> int:
    """How many leading words all ``sequences`` share."""
    length = min(len(s) for s in sequences)
    for position in range(length):
        if any(s[position] != sequences[0][position] for s in sequences):
            return position
    return length


def _link_by_content_keys(records: Sequence[SourceRecord], prompt_words: list[tuple[str, ...]],
                          answer_words: list[tuple[str, ...]], prompt_of: list[int], links: UnionFind) -> None:
    """Rule 2: link records sharing a content key that none of their templates holds in two distinct prompts."""
    keys = _content_keys(records, prompt_words, answer_words)
    holder: dict[tuple[tuple[str, ...], str], int] = {}  # (key, template) -> the one prompt holding it, or REPEATED
    for index, record_keys in enumerate(keys):
        template = records[index].template
        for key in record_keys:
            held_by = holder.setdefault((key, template), prompt_of[index])
            if held_by != prompt_of[index]:
                holder[(key, template)] = REPEATED
    first_with_key: dict[tuple[str, ...], int] = {}
    for index, record_keys in enumerate(keys):
        template = records[index].template
        for key in record_keys:
            if holder[(key, template)] != REPEATED:
                links.union(index, first_with_key.setdefault(key, index))


def _link_near_duplicates(records: Sequence[SourceRecord], prompt_words: list[tuple[str, ...]],
                          answer_words: list[tuple[str, ...]], prompt_of: list[int], links: UnionFind) -> None:
    """Rule 3: link records that share enough example 8-grams (see ``example_group_ids``)."""
    shingles = [word_ngrams(p, SHINGLE_WORDS) | word_ngrams(a, SHINGLE_WORDS)
                for p, a in zip(prompt_words, answer_words)]
    record_counts = Counter(s for record_shingles in shingles for s in record_shingles)
    template_prompts: dict[str, set[int]] = defaultdict(set)
    shingle_prompts: dict[tuple[tuple[str, ...], str], set[int]] = defaultdict(set)
    for index, record_shingles in enumerate(shingles):
        template = records[index].template
        template_prompts[template].add(prompt_of[index])
        for shingle in record_shingles:
            if record_counts[shingle] <= MAX_SHINGLE_RECORDS:
                shingle_prompts[(shingle, template)].add(prompt_of[index])
    template_phrases = {
        shingle for (shingle, template), prompts in shingle_prompts.items()
        if len(prompts) >= 2 and 2 * len(prompts) > len(template_prompts[template])
    }
    example_shingles = [
        {s for s in record_shingles if record_counts[s] <= MAX_SHINGLE_RECORDS and s not in template_phrases}
        for record_shingles in shingles
    ]
    holders: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for index, record_shingles in enumerate(example_shingles):
        for shingle in record_shingles:
            holders[shingle].append(index)
    shared = Counter(
        (first, second) for indices in holders.values() for n, first in enumerate(indices)
        for second in indices[n + 1:]
    )
    answer_records = Counter(answer_words)
    for (first, second), count in shared.items():
        answer = answer_words[first]
        same_rare_answer = (answer == answer_words[second] and len(answer) >= MIN_SAME_ANSWER_WORDS
                            and answer_records[answer] <= MAX_SAME_ANSWER_RECORDS)
        union_size = len(example_shingles[first]) + len(example_shingles[second]) - count
        if same_rare_answer or (count >= MIN_SHARED_SHINGLES and count >= MIN_SHINGLE_JACCARD * union_size):
            links.union(first, second)


EXAMPLE_GROUP_RULE_MARKDOWN = f"""\
Every record carries `example_id` (`"<dataset>:<n>"`): the records of one dataset that render
the same underlying example share it, and no example group is on both sides of the split. Carve any
further split out of train (e.g. validation) by `example_id` too. Groups are built per dataset
(`bench.real.example_groups.example_group_ids`) over the records left after the filter, on
`normalized_words` (lower-cased, punctuation replaced by spaces), as the connected sets of these links:

1. **Same prompt**: two records with the same (normalized) prompt are one example (e.g. several
   reference answers to one prompt).
2. **Shared content key that no template repeats**: the keys of a record are the word
   {KEY_WORDS}-grams of its prompt and of its completion, its completion when that has at least
   {MIN_ANSWER_KEY_WORDS} words and occurs as a word run in the other record, and short texts of 1 to
   {KEY_WORDS - 1} words (a whole completion, or a template's *slot*: a prompt less the words that all
   prompts of its template, {MIN_SLOT_TEMPLATE_PROMPTS} or more, begin and end with). Two records are
   linked by a key that each of their templates holds in **one distinct prompt only** (a per-template
   document frequency of 1): template wording, and formulas such as "What will Kendall want to do
   next?", recur in many prompts of one template, while an example's own content is rendered once
   per template.
3. **Near-duplicate examples**: two records that share an *example {SHINGLE_WORDS}-gram* and have the
   same completion of {MIN_SAME_ANSWER_WORDS}+ words, one that at most {MAX_SAME_ANSWER_RECORDS} records of the
   dataset have (so not a label such as "Science and technology"); or two records that share at least
   {MIN_SHARED_SHINGLES} example {SHINGLE_WORDS}-grams making at least {MIN_SHINGLE_JACCARD:.0%} of their
   example {SHINGLE_WORDS}-grams (Jaccard). An example {SHINGLE_WORDS}-gram occurs in at most
   {MAX_SHINGLE_RECORDS} records of the dataset (its document frequency) and is not a template phrase (one
   held by at least two and by more than half of a template's distinct prompts).
   This catches source examples that are near copies of each other (the same wire story twice, the
   same math problem with other options), whose content recurs inside every template and so fails rule 2.
"""
