"""A role's command line (`blockspec role verifier|drafter ...`): what `serve` writes for each role process or Ray
actor, and how the role reads it back."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from blockspec.common.argtypes import bounded, port
from blockspec.common.config import MAX_BATCH, MIN_MODEL_LEN, ServerConfig
from blockspec.common.runtime.device import add_device_args
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS
from blockspec.services.drafter.proposers import METHODS


def add_role_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `blockspec role ...`: what `serve` writes in a role's command line (`plan.plan`)."""
    parser.add_argument("role", choices=("verifier", "drafter"))
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter")
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--max-batch", type=bounded(1, MAX_BATCH), default=ServerConfig().max_batch)
    parser.add_argument("--max-model-len", type=bounded(MIN_MODEL_LEN))
    parser.add_argument("--no-dynamic-conv", action="store_true")
    parser.add_argument("--no-path-selector", action="store_true")
    parser.add_argument("--invariant", action="store_true", help="verifier: decode with the verify query width")
    parser.add_argument("--runner", choices=("auto", "eager", "graphs"), default="auto",
                        help="verifier: the target's runner (docs/gpu.md)")
    parser.add_argument("--tensor-parallel-size", type=bounded(1, 8), default=1,
                        help="verifier: ranks the target is split over (this process leads, the others are its children)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="this replica's part of the GPU's memory, both roles (model.gpu_memory_utilization over "
                             "the replicas on the GPU); unset: no share, nothing checked")
    drafter = parser.add_mutually_exclusive_group()
    drafter.add_argument("--drafter-memory", type=bounded(0),
                         help="bytes the drafter role holds: its share is that with a margin, the verifier's the rest")
    drafter.add_argument("--drafter-memory-fraction", type=float,
                         help="the drafter role's share of the GPU's memory (model.drafter_memory_fraction)")
    parser.add_argument("--kv-cache-tokens", type=bounded(MIN_MODEL_LEN),
                        help="verifier: positions its paged KV cache holds (default: on a GPU what its share leaves, "
                             "on the CPU max-batch x max-model-len)")
    parser.add_argument("--kv-block-size", type=int, default=BLOCK_TOKENS, help="verifier: positions a KV block holds")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="verifier: no prompt starts from an earlier one's cached KV blocks")
    add_device_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=0)
    parser.add_argument("--unix-socket", help="also listen on this Unix domain socket (serve and the Ray actors use one "
                                              "for a router on the same host)")


def parse_role_args(argv: Sequence[str]) -> argparse.Namespace:
    """A role's command line (`role verifier|drafter ...`, as `plan.plan` writes it), as the Ray actors receive it."""
    parser = argparse.ArgumentParser(prog="blockspec role")
    add_role_arguments(parser)
    argv = list(argv)
    return parser.parse_args(argv[1:] if argv[:1] == ["role"] else argv)
