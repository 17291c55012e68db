"""The identity of a prompt's full KV blocks: a chain of hashes, each over its parent's hash, a salt and the block's
tokens. The verifier's prefix cache keys blocks by it; the router routes by it (the same blocks, the same hashes)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_TOKENS = 16  # tokens per KV block (model.kv_block_size's default)


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_TOKENS, salt: str = "",
                 limit: int | None = None) -> list[int]:
    """The hash of every full block of token_ids (at most `limit` blocks), in order: block i's covers the salt and
    tokens [0, (i + 1) * block_size), so equal hashes mean equal prefixes (up to a 64-bit collision). A salt (the
    tenant) keeps one tenant's blocks from matching another's."""
    return extend_hashes([], token_ids, block_size, salt, limit)


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int = BLOCK_TOKENS, salt: str = "",
                  limit: int | None = None) -> list[int]:
    """`hashes` (the first blocks' of token_ids, as `block_hashes` gives them) continued in place up to `limit` blocks
    (every full one where None), each block hashed once however often a sequence's hashes are asked for as it
    grows. Returns hashes."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    parent = (hashes[-1].to_bytes(8, "little") if hashes
              else hashlib.blake2b(salt.encode(), digest_size=8).digest())
    for i in range(len(hashes), n):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        parent = h.digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes
