"""A draft vocabulary: the drafter's LM head restricted to the tokens the target's text uses most.

The DFlash drafter scores its draft slots with the target's LM head, [vocab, H]. On a small pair that head
is a large part of a proposal: on the default pair it is a quarter of the target's weights, read once per
speculative step for up to 7 slots. Most of its rows are tokens the target almost never emits. A draft
vocabulary keeps the rows of the `size` most frequent tokens of a corpus (frequency-ranked drafting, as in
FR-Spec; EAGLE-3's reduced draft vocabulary is the same idea), so the drafter reads and scores only those.

It changes only what the drafter proposes, never the output: the target verifies every draft token over its
full vocabulary, and a token outside the draft vocabulary is still committed when the target chooses it (it
only cannot be drafted). The file sits in the drafter's directory (`draft_vocab.json`): the token ids in
increasing order, and how they were chosen. `blockspec draft-vocab` writes it; BLOCKSPEC_DRAFT_VOCAB=0 makes
a proposer ignore it (the ablation).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from blockspec.common.errors import ModelLoadError

FILE = "draft_vocab.json"
ENV = "BLOCKSPEC_DRAFT_VOCAB"  # "0": proposers ignore a shipped draft vocabulary (the whole LM head)
ROWS_MULTIPLE = 64  # the packed LM head's panel height: the CPU proposal needs whole panels


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def check_size(size: int, vocab_size: int) -> None:
    if size % ROWS_MULTIPLE or not 0 < size <= vocab_size:
        raise ValueError(f"a draft vocabulary size must be a multiple of {ROWS_MULTIPLE} in 1..{vocab_size}, got {size}")


def choose(token_streams: Iterable[Sequence[int]], size: int, vocab_size: int,
           always: Sequence[int] = ()) -> tuple[list[int], dict]:
    """The `size` most frequent token ids of the streams (ties: the lower id; ids the streams never use come
    last, lowest first), with the `always` ids among them (end-of-sequence tokens: a draft may end the
    text), sorted -> (ids, {corpus_tokens, distinct_tokens, coverage}); coverage: the share of the streams'
    tokens the ids cover."""
    check_size(size, vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for stream in token_streams:
        ids = np.asarray(stream, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    forced = {t for t in always if 0 <= t < vocab_size}
    ranked = sorted(range(vocab_size), key=lambda t: (t not in forced, -counts[t], t))  # forced first
    ids = sorted(ranked[:size])
    total = int(counts.sum())
    stats = {"corpus_tokens": total, "distinct_tokens": int((counts > 0).sum()),
             "coverage": float(counts[ids].sum() / total) if total else 0.0}
    return ids, stats


def write(drafter_dir: str | Path, ids: Sequence[int], source: dict) -> Path:
    """draft_vocab.json: how the ids were chosen (`source`), then the ids."""
    path = Path(drafter_dir) / FILE
    path.write_text(json.dumps({**source, "token_ids": list(ids)}) + "\n")
    return path


def build(drafter_dir: str | Path, vocab_size: int, eos_ids: Sequence[int], token_streams: Iterable[Sequence[int]],
          size: int | None, source: str) -> dict:
    """Choose and write the draft vocabulary of the drafter in `drafter_dir` (size: default half the
    vocabulary, rounded down to whole panels) -> what was written, less the ids."""
    size = size if size is not None else max(ROWS_MULTIPLE, vocab_size // 2 // ROWS_MULTIPLE * ROWS_MULTIPLE)
    ids, stats = choose(token_streams, size, vocab_size, eos_ids)
    info = {"source": source, **stats}
    write(drafter_dir, ids, info)
    return {"size": len(ids), **info}


def read(drafter_dir: str | Path) -> dict | None:
    """The drafter's draft_vocab.json as written (ids and how they were chosen), None where it has none."""
    path = Path(drafter_dir) / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(str(path), f"unreadable draft vocabulary: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(str(path), "unreadable draft vocabulary: not a JSON object")
    return data


def load(drafter_dir: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The drafter's draft vocabulary (int64 token ids, increasing), or None where it ships none."""
    data = read(drafter_dir)
    if data is None:
        return None
    token_ids = data.get("token_ids")
    ok = isinstance(token_ids, list) and all(type(t) is int for t in token_ids)
    if ok:
        try:
            check_size(len(token_ids), vocab_size)
        except ValueError:
            ok = False
    ids = torch.tensor(token_ids, dtype=torch.int64) if ok else None
    if ids is None or not (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < vocab_size):
        raise ModelLoadError(str(Path(drafter_dir) / FILE), f"a draft vocabulary must be increasing integer token "
                             f"ids in 0..{vocab_size - 1}, a multiple of {ROWS_MULTIPLE} of them")
    return ids
