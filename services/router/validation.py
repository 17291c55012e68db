"""Checks on one generation request, shared by the CLI and the gRPC API; errors name the field."""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.common.errors import InvalidArgument


def validate_request(prompt_ids: Sequence[int], max_tokens: int, k: int, *, context_len: int, max_k: int,
                     k_field: str = "k") -> None:
    """`k` = 0 means plain decoding (any method; a request may opt out of speculation), up to max_k a speculative
    method's. k_field: what the caller calls k (the gRPC API: num_speculative_tokens)."""
    if not prompt_ids:
        raise InvalidArgument("prompt", "must not be empty")
    if max_tokens < 1:
        raise InvalidArgument("max_tokens", f"must be at least 1, got {max_tokens}")
    if len(prompt_ids) >= context_len:
        raise InvalidArgument(
            "prompt", f"{len(prompt_ids)} tokens do not fit the model's context of {context_len} tokens"
        )
    if len(prompt_ids) + max_tokens > context_len:
        raise InvalidArgument(
            "max_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
            f"{context_len} tokens; at most {context_len - len(prompt_ids)}",
        )
    if max_k == 0 and k != 0:
        raise InvalidArgument(k_field, "this method drafts nothing; leave it unset")
    if max_k > 0 and not 0 <= k <= max_k:
        raise InvalidArgument(k_field, f"must be between 0 (plain decoding) and {max_k}, got {k}")


MAX_STOPS, MAX_STOP_CHARS = 64, 1000  # each stop sequence is searched in every message's text (the router: its event loop)


def validate_stops(stops: Sequence[str], field: str = "stop") -> None:
    if any(not stop for stop in stops):
        raise InvalidArgument(field, "stop sequences must not be empty")
    if len(stops) > MAX_STOPS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise InvalidArgument(field, f"at most {MAX_STOPS} stop sequences of at most {MAX_STOP_CHARS} characters each "
                                     f"(got {len(stops)}, the longest {max(map(len, stops))})")
