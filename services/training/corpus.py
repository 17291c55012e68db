"""Training corpus for the default pair: cleaned Python sources of the interpreter and pinned packages.

Files are listed in a fixed order, split into train and held-out by a stable hash of their path.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Path parts that never enter the corpus: caches, vendored trees, IDE code, codec tables.
SKIP_PARTS = ("__pycache__", "site-packages", "idlelib", "encodings")
# Stdlib test trees are skipped in "stdlib" and come back as their own source "stdlib-test".
TEST_PARTS = ("test", "tests")
# Generated tables and data dumps that look like code but teach nothing about it.
SKIP_FILES = (
    "pydoc_data/topics.py",
    "html/entities.py",
    "locale.py",
    "stringprep.py",
    "unicodedata.py",
    "_pydecimal.py",
    "test/test_unicodedata.py",
    "test/test_ucn.py",
    "test/test_codecmaps_cn.py",
    "test/cjkencodings_test.py",
    "test/test_locale.py",
)
# A file above this size, or whose lines are mostly bare literals, is treated as a table.
MAX_FILE_BYTES = 400_000
MAX_LITERAL_SHARE = 0.5
MIN_LINES_FOR_SHARE = 100
# About 2% of files are held out: hash(path) % 1000 < HELDOUT_PER_MILLE.
HELDOUT_PER_MILLE = 20


@dataclass(frozen=True)
class Source:
    """One tree of `.py` files: a name, its root, and the version that pins its contents."""

    name: str
    root: Path
    version: str
    include_tests: bool  # False: skip test/ and tests/ directories; True: keep only them


@dataclass(frozen=True)
class CorpusFile:
    """One corpus file: `key` ("source/relative/path") is stable across machines and drives the split."""

    key: str
    path: Path


def _package_root(package: str) -> Path:
    dist_files = importlib.metadata.files(package) or []
    init = next(f for f in dist_files if str(f) == f"{package}/__init__.py")
    return Path(init.locate()).parent


def default_sources() -> tuple[Source, ...]:
    """The fixed source list: stdlib, its test tree, and two large pinned packages."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    python = sysconfig.get_python_version()
    packages = ("transformers", "torch")
    return (
        Source("stdlib", stdlib, python, include_tests=False),
        Source("stdlib-test", stdlib / "test", python, include_tests=True),
        *(
            Source(p, _package_root(p), importlib.metadata.version(p), include_tests=False)
            for p in packages
        ),
    )


def _skipped_path(rel: str, include_tests: bool) -> bool:
    parts = rel.split("/")
    if any(part in SKIP_PARTS for part in parts[:-1]):
        return True
    if not include_tests and any(part in TEST_PARTS for part in parts[:-1]):
        return True
    return any(rel == s or rel.endswith("/" + s) for s in SKIP_FILES)


_NUMBER = re.compile(r"[-+]?(0[xob][0-9a-fA-F_]+|[0-9][0-9_]*\.?[0-9_]*([eE][-+]?[0-9]+)?[jJlL]?)")


def _is_literal_line(line: str) -> bool:
    s = line.strip()
    if not s:
        return False
    if s[0] in "\"'" or s[:2] in ("b'", 'b"', "u'", 'u"', "r'", 'r"'):
        return True
    cells = [c for c in re.split(r"[\s,:()\[\]{}]+", s) if c]
    return bool(cells) and all(_NUMBER.fullmatch(c) for c in cells)


def is_table_like(text: str) -> bool:
    """True for generated tables: very large files, or mostly string / number literal lines."""
    if len(text.encode("utf-8")) > MAX_FILE_BYTES:
        return True
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) < MIN_LINES_FOR_SHARE:
        return False
    return sum(map(_is_literal_line, lines)) / len(lines) > MAX_LITERAL_SHARE


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is not valid UTF-8 (such files are skipped everywhere)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def _source_files(source: Source) -> Iterator[CorpusFile]:
    for dirpath, dirnames, filenames in os.walk(source.root):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(source.root).as_posix()
            if not _skipped_path(rel, source.include_tests):
                yield CorpusFile(f"{source.name}/{rel}", path)


def all_files(sources: tuple[Source, ...] | None = None) -> list[CorpusFile]:
    """Clean, deduplicated corpus files in a fixed order (sources in order, paths sorted).

    A file is dropped when it is not UTF-8, is table-like, is empty, or repeats the exact
    content of an earlier file.
    """
    seen: set[str] = set()
    kept: list[CorpusFile] = []
    for source in sources or default_sources():
        for f in _source_files(source):
            text = read_text(f.path)
            if text is None or not text.strip() or is_table_like(text):
                continue
            digest = hashlib.sha1(text.encode("utf-8")).hexdigest()
            if digest not in seen:
                seen.add(digest)
                kept.append(f)
    logger.info("corpus: %d files", len(kept))
    return kept


def is_heldout(key: str) -> bool:
    """Stable split by file: the first 8 bytes of sha1(key) modulo 1000, below HELDOUT_PER_MILLE."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:16], 16) % 1000 < HELDOUT_PER_MILLE


def split_files(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, held-out) file lists, each keeping the corpus order."""
    return [f for f in files if not is_heldout(f.key)], [f for f in files if is_heldout(f.key)]


def iter_texts(files: list[CorpusFile]) -> Iterator[str]:
    """The text of each file in order; non-UTF-8 files (if any changed since listing) are skipped."""
    for f in files:
        text = read_text(f.path)
        if text is not None:
            yield text


def _prompt_from(text: str, lines: int, max_chars: int) -> str:
    body = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(body) if ln.startswith(("def ", "class "))), None)
    return "" if start is None else "".join(body[start : start + lines])[:max_chars]


def heldout_prompts(n: int, files: list[CorpusFile] | None = None, lines: int = 4, max_chars: int = 300) -> list[str]:
    """N deterministic prompts from held-out files only.

    Held-out files are ordered by sha1 of their key; each prompt is `lines` lines starting at the
    file's first top-level `def` / `class`, cut to `max_chars`; files without one are passed over.
    """
    heldout = split_files(files if files is not None else all_files())[1]
    ordered = sorted(heldout, key=lambda f: hashlib.sha1(f.key.encode("utf-8")).hexdigest())
    prompts: list[str] = []
    for text in iter_texts(ordered):
        prompt = _prompt_from(text, lines, max_chars)
        if prompt.strip():
            prompts.append(prompt)
        if len(prompts) == n:
            break
    return prompts


def manifest(files: list[CorpusFile], sources: tuple[Source, ...] | None = None) -> dict[str, object]:
    """What the corpus is made of: sources with versions, and file counts per source and split."""
    train, heldout = split_files(files)
    rows = []
    for s in sources or default_sources():
        prefix = s.name + "/"
        rows.append(
            {
                "name": s.name,
                "root": str(s.root),
                "version": s.version,
                "train_files": sum(f.key.startswith(prefix) for f in train),
                "heldout_files": sum(f.key.startswith(prefix) for f in heldout),
            }
        )
    return {"sources": rows, "train_files": len(train), "heldout_files": len(heldout),
            "heldout_per_mille": HELDOUT_PER_MILLE}
