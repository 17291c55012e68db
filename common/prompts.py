"""A prompts file: one prompt a line, or (.jsonl) one JSON string a line for prompts that hold newlines."""

from __future__ import annotations

import json
from pathlib import Path

from blockspec.common.errors import InvalidArgument


def read_prompts_file(path: str | Path, field: str) -> list[str]:
    """The prompts of the file at `path`; a file that cannot give one is an InvalidArgument naming `field`."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(field, f"{path} is not a file")
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise InvalidArgument(field, f"{path}: not UTF-8 text (byte {e.start})") from None
    if path.suffix == ".jsonl":  # one JSON string per line: prompts that contain newlines
        try:
            prompts = [json.loads(line) for line in lines]
        except json.JSONDecodeError as e:
            raise InvalidArgument(field, f"{path}: not JSON lines ({e})") from None
        except RecursionError:
            raise InvalidArgument(field, f"{path}: a line nests too deep to be one JSON string") from None
        if not all(isinstance(p, str) for p in prompts):
            raise InvalidArgument(field, f"{path}: every line must be a JSON string")
    else:
        prompts = lines
    if not prompts:
        raise InvalidArgument(field, f"{path} holds no prompt")
    return prompts
