"""Stages 4-6 of the shipped drafter (`default_pair.SAMPLED_STAGES`, models/base/drafter-sampled) on this machine:
from models/base/drafter, on the shipped target's continuations of random windows of its training corpus, greedy and
sampled at T 0.7 and 1.0 in turn, with the soft terms on the target's distribution; stage 5 adds a second layer, stage
6 widens the path selector. The corpus is the target's training files (services/training/corpus.py) encoded with its
tokenizer, cached; the continuations are cached as `build-default`'s are; each stage saves its training state every
250 steps (rerun from the interrupted stage, FIRST = 0, 1 or 2, to resume it).

    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-drafter/train.py OUT_DIR [FIRST]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from blockspec.services.training import corpus
from blockspec.services.training.default_pair import distill_sampled

ROOT = Path(__file__).resolve().parents[3]


def train_ids(target: Path) -> np.ndarray:
    cache = Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec")) / "base-train-ids.npy"
    if cache.is_file():
        return np.load(cache, mmap_mode="r")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    train, _ = corpus.split_files(corpus.all_files())
    texts = list(corpus.iter_texts(train))
    ids = [np.asarray(e.ids + [tok.eos_token_id], dtype=np.uint16)
           for start in range(0, len(texts), 256)
           for e in tok.backend_tokenizer.encode_batch(texts[start : start + 256], add_special_tokens=False)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, np.concatenate(ids))
    return np.load(cache, mmap_mode="r")


def main() -> None:
    out, first = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
    target, drafter = ROOT / "models" / "base" / "target", ROOT / "models" / "base" / "drafter"
    distill_sampled(target, drafter, out, train_ids(target), first)
    print(f"drafter: {out}")


if __name__ == "__main__":
    main()
