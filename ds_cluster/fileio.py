"""Atomic writes: the one place that puts a file or a folder on disk so that a crash leaves old or new, never half.

Files are written to a unique temporary name next to the target, flushed and
fsync'ed, then renamed over it. They get the permissions the umask gives
(not mkstemp's private 0600): analyses, plans and stores are meant to be
read by every rank and by other users of a shared filesystem.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Union

import numpy as np

PathLike = Union[str, os.PathLike]


def write_atomic(path: PathLike, write: Callable[[Any], Any]) -> None:
    """Call write(binary file object) on a temporary file next to `path`, fsync it, and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "xb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: PathLike, document: Any, indent: int = 2) -> None:
    """A JSON document (keys sorted), written atomically."""
    text = json.dumps(document, indent=indent, sort_keys=True, default=str) + "\n"
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def write_text_atomic(path: PathLike, text: str) -> None:
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def write_npy_atomic(path: PathLike, array: np.ndarray) -> None:
    write_atomic(path, lambda handle: np.save(handle, array, allow_pickle=False))


def write_jsonl_atomic(path: PathLike, records: Iterable[Any]) -> None:
    """One JSON object per line, written atomically."""
    def write(handle: Any) -> None:
        for record in records:
            handle.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))

    write_atomic(path, write)


def staging_dir(target: PathLike) -> Path:
    """A new empty hidden folder next to `target`, with the umask's permissions, to build a replacement in."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


def replace_dir(staging: PathLike, target: PathLike) -> None:
    """Swap a fully written `staging` folder in for `target`.

    The old folder is moved aside, not deleted, until the new one is in
    place: a crash in between leaves a complete folder (old or new) plus a
    hidden leftover, never none. Every file in `staging` must already be
    written (and synced) by the caller.
    """
    staging, target = Path(staging), Path(target)
    _fsync_dir(staging)
    backup = None
    if target.exists():
        backup = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(target, backup)
    try:
        os.replace(staging, target)
    except BaseException:
        if backup is not None:
            os.replace(backup, target)
        raise
    _fsync_dir(target.parent)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    # The renames themselves are durable only once the folder holding them is synced.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
