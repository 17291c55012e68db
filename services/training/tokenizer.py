"""Byte-level BPE tokenizer of the default pair, trained on the corpus's training split only."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from blockspec.services.training import corpus

logger = logging.getLogger(__name__)

VOCAB_SIZE = 4096
# eos ends every corpus file; it doubles as bos and pad (padding is always masked by attention_mask).
EOS_TOKEN = "<|endoftext|>"
# The drafter's mask token: one id, never produced by the BPE merges.
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)
# Pairs seen once are noise; a fixed minimum keeps the merges deterministic and stable.
MIN_FREQUENCY = 2


def _batches(texts: Iterator[str], size: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def train_bpe(files: list[corpus.CorpusFile], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE (no prefix space) with the special tokens at ids 0 and 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batches(corpus.iter_texts(files)), trainer=trainer, length=len(files))
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer with eos / bos / pad / mask set."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(out_dir: Path, files: list[corpus.CorpusFile] | None = None) -> PreTrainedTokenizerFast:
    """Train on the training split (or `files`), save with `save_pretrained(out_dir)`, and return it.

    An existing `out_dir/tokenizer.json` is loaded instead of retrained.
    """
    if (out_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    train = files if files is not None else corpus.split_files(corpus.all_files())[0]
    logger.info("training BPE (vocab %d) on %d files", VOCAB_SIZE, len(train))
    wrapped = wrap(train_bpe(train))
    ids = wrapped.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == [0, 1], f"special tokens must be ids 0 and 1, got {ids}"
    assert wrapped.mask_token_id == 1 and len(wrapped.encode(MASK_TOKEN)) == 1
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out_dir))
    return wrapped
