"""Near-duplicate removal, an arm of the quality benchmark: MinHash on the prompt, then a seeded fill.

    python bench/near_duplicates.py --data bench/real/data/t0      # the groups of a mixture, summarised

The rule (the benchmark's `neardup` arm keeps exactly the kept count of the other arms of its size):

1. A record's prompt is its ``instruction`` and ``input`` joined by a newline (the Alpaca template's
   headers left out: every record has them); the same for a ``prompt`` field.
2. Its shingles: the set of every SHINGLE_WORDS consecutive words of the lower-cased prompt (words:
   runs of letters, digits and underscores); a prompt of fewer words has one shingle, all of them.
3. MinHash signatures with NUM_PERMUTATIONS universal hashes (a x + b mod 2^31 - 1, seeded by
   MINHASH_SEED) over each shingle's 32-bit blake2b hash; LSH with BANDS bands of ROWS rows makes
   the candidate pairs (records sharing a whole band).
4. A candidate pair is a near duplicate when the exact Jaccard similarity of the two shingle sets is at
   least JACCARD_THRESHOLD (so the groups have no false positives; a pair at 0.8 is missed by the LSH
   with probability (1 - 0.8^4)^32, about 1e-6). Near-duplicate groups are the connected components
   of those pairs (union-find); a record with no near duplicate is a group of one.
5. For a kept count k and a seed: the records in a random order drawn with the seed; a record is its
   group's representative when it is the first of its group in that order. The kept records are the
   first k of (the representatives in that order, then the other records in that order): one
   representative per group while k allows, a uniform random subset of representatives when there are
   more groups than k, and a uniform random fill from the rest when there are fewer.

The groups do not depend on the seed; they are computed once per mixture and their cost is charged
to every near-duplicate arm. Numpy only: no new dependency.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ds_cluster.data.dataset import prompt_text

logger = logging.getLogger(__name__)

SHINGLE_WORDS = 3
NUM_PERMUTATIONS = 128
BANDS = 32
ROWS = NUM_PERMUTATIONS // BANDS  # 4: a pair at Jaccard 0.42 becomes a candidate with probability 1/2
JACCARD_THRESHOLD = 0.8
MINHASH_SEED = 20261201
_PRIME = (1 << 31) - 1  # a Mersenne prime: (a x + b) stays below 2^63 for a, b, x < 2^31
_WORD = re.compile(r"\w+")


def shingles(text: str, width: int = SHINGLE_WORDS) -> frozenset[str]:
    """Every `width` consecutive lower-cased words of `text`; one shingle of all words when there are fewer."""
    words = _WORD.findall(text.lower())
    if len(words) <= width:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[start:start + width]) for start in range(len(words) - width + 1))


def _shingle_hashes(items: frozenset[str]) -> np.ndarray:
    return np.array([int.from_bytes(hashlib.blake2b(item.encode("utf-8"), digest_size=4).digest(), "little")
                     % _PRIME for item in sorted(items)], dtype=np.uint64)


def minhash_signatures(shingle_sets: Sequence[frozenset[str]], num_permutations: int = NUM_PERMUTATIONS,
                       seed: int = MINHASH_SEED) -> np.ndarray:
    """(N, num_permutations) uint64 MinHash signatures of the shingle sets."""
    rng = np.random.default_rng(seed)
    slopes = rng.integers(1, _PRIME, size=num_permutations, dtype=np.uint64)[:, None]
    offsets = rng.integers(0, _PRIME, size=num_permutations, dtype=np.uint64)[:, None]
    signatures = np.empty((len(shingle_sets), num_permutations), dtype=np.uint64)
    for row, items in enumerate(shingle_sets):
        signatures[row] = ((slopes * _shingle_hashes(items)[None, :] + offsets) % _PRIME).min(axis=1)
    return signatures


def candidate_pairs(signatures: np.ndarray, bands: int = BANDS) -> set[tuple[int, int]]:
    """Pairs (i < j) of records that share every row of at least one band."""
    rows = signatures.shape[1] // bands
    pairs: set[tuple[int, int]] = set()
    for band in range(bands):
        buckets: dict[bytes, list[int]] = defaultdict(list)
        block = np.ascontiguousarray(signatures[:, band * rows:(band + 1) * rows])
        for index in range(block.shape[0]):
            buckets[block[index].tobytes()].append(index)
        for members in buckets.values():
            for position, first in enumerate(members):
                pairs.update((first, second) for second in members[position + 1:])
    return pairs


def jaccard(first: frozenset[str], second: frozenset[str]) -> float:
    return len(first & second) / max(len(first | second), 1)


def _root(parents: list[int], index: int) -> int:
    while parents[index] != index:
        parents[index] = parents[parents[index]]  # path halving keeps the trees flat
        index = parents[index]
    return index


def near_duplicate_groups(texts: Sequence[str], threshold: float = JACCARD_THRESHOLD) -> np.ndarray:
    """(N,) int64 group id of every text: the components of the pairs with shingle Jaccard >= threshold.

    Group ids are numbered by each group's first record (0, 1, ...), so they depend on the texts only.
    """
    shingle_sets = [shingles(text) for text in texts]
    pairs = candidate_pairs(minhash_signatures(shingle_sets)) if texts else set()
    parents = list(range(len(texts)))
    for first, second in sorted(pairs):
        if jaccard(shingle_sets[first], shingle_sets[second]) >= threshold:
            root_first, root_second = _root(parents, first), _root(parents, second)
            if root_first != root_second:
                parents[max(root_first, root_second)] = min(root_first, root_second)
    roots = [_root(parents, index) for index in range(len(texts))]
    numbering: dict[int, int] = {}
    return np.array([numbering.setdefault(root, len(numbering)) for root in roots], dtype=np.int64)


def keep_order(groups: np.ndarray, seed: int) -> np.ndarray:
    """Record indices in the order the rule keeps them (step 5): representatives first, then the rest."""
    order = np.random.default_rng(seed).permutation(groups.size)
    first_seen = np.zeros(groups.size, dtype=bool)
    _, first_positions = np.unique(groups[order], return_index=True)
    first_seen[first_positions] = True
    return np.concatenate([order[first_seen], order[~first_seen]])


def select_kept(groups: np.ndarray, kept: int, seed: int) -> np.ndarray:
    """Sorted indices of the `kept` records the near-duplicate arm trains on."""
    if not 0 < kept <= groups.size:
        raise ValueError(f"kept must be in 1..{groups.size}, got {kept}")
    return np.sort(keep_order(groups, seed)[:kept])


def group_summary(groups: np.ndarray, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How many groups, how many records sit in a group of two or more, and per family."""
    sizes = np.bincount(groups)
    in_shared = sizes[groups] > 1
    per_family: dict[str, dict[str, int]] = defaultdict(lambda: {"records": 0, "in_shared_group": 0})
    for record, shared in zip(records, in_shared):
        entry = per_family[str(record.get("family", ""))]
        entry["records"] += 1
        entry["in_shared_group"] += int(shared)
    return {"records": int(groups.size), "groups": int(sizes.size), "largest_group": int(sizes.max(initial=0)),
            "records_in_shared_groups": int(in_shared.sum()), "per_family": dict(sorted(per_family.items())),
            "rule": {"shingle_words": SHINGLE_WORDS, "num_permutations": NUM_PERMUTATIONS, "bands": BANDS,
                     "rows": ROWS, "jaccard_threshold": JACCARD_THRESHOLD, "minhash_seed": MINHASH_SEED}}


def compute_groups(records: Sequence[Mapping[str, Any]], out_dir: Path) -> dict[str, Any]:
    """The groups of `records` written to out_dir/groups.npy, their summary, and cost.json (one process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    groups = near_duplicate_groups([prompt_text(record) for record in records])
    cost = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "groups.npy", groups)
    summary = group_summary(groups, records)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "cost.json").write_text(json.dumps(cost))
    logger.info("near-duplicate groups: %d records in %d groups (%d in groups of two or more), %.1f s",
                summary["records"], summary["groups"], summary["records_in_shared_groups"], cost["wall"])
    return {"groups": groups, "summary": summary, "cost": cost}


def main(argv: Sequence[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.instrument import data_file
    from ds_cluster.data.dataset import read_jsonl

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="folder with train.jsonl[.gz]")
    parser.add_argument("--out", type=Path, default=None, help="write groups.npy, summary.json, cost.json here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    records = read_jsonl(data_file(args.data, "train"))
    if args.out:
        result = compute_groups(records, args.out)
        summary = result["summary"]
    else:
        summary = group_summary(near_duplicate_groups([prompt_text(r) for r in records]), records)
    json.dump(summary, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
