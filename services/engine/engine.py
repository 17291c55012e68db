"""The in-process engine: a verifier, a proposer and the step loop wired together in one process."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from blockspec.common.config import DEFAULT_K, DEFAULT_MAX_LEN, MIN_MODEL_LEN
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.runtime.backends import uses_cuda_runner
from blockspec.common.runtime.device import kv_cache_blocks
from blockspec.common.runtime.runner import Runner
from blockspec.common.runtime.threads import ThreadGovernor
from blockspec.common.sampling import GREEDY, SamplingParams, checked
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS
from blockspec.services.drafter.proposers import TargetView, build_proposer, check_method, verifier_needs
from blockspec.services.router.messages import ModelFacts
from blockspec.services.router.step_loop import DEFAULT_PREFILL_CHUNK, FinishEvent, Request, StepLoop, TokenEvent
from blockspec.services.router.validation import validate_request
from blockspec.services.verifier.verifier import Verifier

log = logging.getLogger(__name__)



def serving_len(model_context: int, max_len: int | None) -> int:
    """Tokens per request (the KV cache per slot): max_len (max_model_len), at most the model's context; unset,
    the model's context up to DEFAULT_MAX_LEN (said in the log when that cuts it)."""
    if max_len is not None and max_len < MIN_MODEL_LEN:
        raise InvalidArgument("max_model_len", f"{max_len} is too small: at least {MIN_MODEL_LEN} tokens")
    if max_len is not None and max_len > model_context:
        raise InvalidArgument("max_model_len", f"{max_len} exceeds the model's context of {model_context} tokens "
                                               "(max_position_embeddings)")
    if max_len is None and model_context > DEFAULT_MAX_LEN:
        log.warning("serving %d of the model's %d-token context per request; max_model_len raises it (KV cache per "
                    "slot)", DEFAULT_MAX_LEN, model_context)
    return max_len or min(model_context, DEFAULT_MAX_LEN)


def check_draft_tree(draft_tree: Sequence[int], method: str, invariant: bool, adaptive_k: bool,
                     prompt_lookup: bool) -> tuple[int, ...]:
    """The draft tree setting as a tuple, or InvalidArgument naming `draft_tree`."""
    tree = tuple(int(n) for n in draft_tree)
    if not tree:
        return tree
    if any(n < 1 for n in tree):
        raise InvalidArgument("draft_tree", f"{list(tree)}: children per node must be at least 1")
    if method != "dflash":
        raise InvalidArgument("draft_tree", f"drafts a tree with method dflash only, not {method}")
    if invariant or adaptive_k or prompt_lookup:
        raise InvalidArgument("draft_tree", "is not allowed with invariant mode, adaptive k or prompt lookup (they "
                                            "verify one path)")
    return tree


class Engine:
    """Generate with speculative decoding in this process; the same roles the services run apart."""

    def __init__(
        self,
        target: str | Path,
        drafter: str | Path | None = None,
        method: str = "ngram",
        max_batch: int = 8,
        max_len: int | None = None,
        invariant: bool = False,
        use_dynamic_conv: bool = True,
        use_path_selector: bool = True,
        adaptive_k: bool = False,
        prompt_lookup: bool = False,  # prompt lookup first, the drafter for the rest (router/step_loop.py)
        prompt_lookup_tokens: int | None = None,  # a lookup's draft tokens (None: the step's k); not with invariant
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        device: torch.device | str = "cpu",  # target and drafter (common/device.resolve checks user input)
        dtype: torch.dtype = torch.float32,
        threads: int | None = None,  # CPU threads; None: one per core that other processes leave free (threads.py)
        backend: str = "auto",  # the verifier's runner (runner.make_runner): auto, eager or graphs
        tensor_parallel_size: int = 1,  # ranks the target is split over (this process leads; common/runtime/tensor_parallel.py)
        draft_tree: Sequence[int] = (),  # a draft tree's children per node by depth (1 past the end); (): one path
        kv_cache_tokens: int | None = None,  # positions the paged KV cache holds (None: max_batch x max_len)
        kv_block_size: int = BLOCK_TOKENS,  # positions a KV block holds
        prefix_caching: bool = True,  # prompts start from cached blocks of earlier ones (services/verifier)
        verifier_fraction: float | None = None,  # of the GPU's memory: its KV cache takes what the rest leaves
    ) -> None:
        check_method(method, drafter)
        draft_tree = check_draft_tree(draft_tree, method, invariant, adaptive_k, prompt_lookup)
        if prompt_lookup_tokens and (invariant or adaptive_k):  # one verify width / adaptive k's table up to k + 1
            raise InvalidArgument("prompt_lookup_tokens", "is not allowed with invariant mode or adaptive k (wider "
                                                          "verifies than k + 1)")
        if threads is not None:
            torch.set_num_threads(threads)
        # Started first: its first reading sets the thread count before any parallel work starts the thread pool.
        governor = ThreadGovernor() if threads is None and torch.device(device).type == "cpu" else None
        checkpoint = load_checkpoint(target)
        max_len = serving_len(checkpoint.config.max_position_embeddings, max_len)
        dflash_model = None
        if method == "dflash":
            from blockspec.services.drafter.dflash.checkpoint import check_fits_target, load_drafter

            dflash_model = load_drafter(drafter)
            check_fits_target(dflash_model.cfg, checkpoint.config, str(drafter))
            dflash_model = dflash_model.to(device, dtype)
        tap_layers, max_k = verifier_needs(method, dflash_model.cfg if dflash_model is not None else None)
        # Invariant mode: decode and verify share one query width, the widest verify.
        query_width = max_k + 1 if invariant else None
        kv_blocks = self._kv_blocks(checkpoint, max_batch, max_len, tap_layers, dtype, torch.device(device), backend,
                                    tensor_parallel_size, kv_cache_tokens, kv_block_size, verifier_fraction)
        self.verifier = Verifier(checkpoint, max_batch, max_len, query_width, tap_layers=tap_layers, dtype=dtype,
                                 device=device, threads=governor, backend=backend,
                                 tensor_parallel_size=tensor_parallel_size, kv_blocks=kv_blocks,
                                 block_size=kv_block_size, prefix_caching=prefix_caching)
        view = TargetView(self.verifier.runner.embedding, self.verifier.runner.lm_head, self.verifier.features,
                          self.verifier.tap_buffer)
        self.proposer = build_proposer(method, checkpoint, drafter, max_batch, max_len, view, dflash_model,
                                       use_dynamic_conv, use_path_selector, device, dtype)
        if draft_tree:
            if checkpoint.config.hybrid or type(self.verifier.runner) is not Runner:
                raise InvalidArgument("draft_tree", "needs a target of attention layers only, verified by the eager "
                                                    "runner of one process (not a hybrid, the CUDA graphs backend or "
                                                    "tensor parallelism)")
            self.proposer.tree = draft_tree
        self.tokenizer = checkpoint.tokenizer
        self.method = method
        self.target_path, self.drafter_path = Path(target), drafter
        self.loop = StepLoop(self.verifier, self.proposer, max_batch, adaptive_k, prefill_chunk, prompt_lookup,
                             prompt_lookup_tokens)

    @staticmethod
    def _kv_blocks(checkpoint, max_batch: int, max_len: int, tap_layers, dtype: torch.dtype, device: torch.device,
                   backend: str, world: int, tokens: int | None, block_size: int, fraction: float | None) -> int | None:
        """The verifier's KV blocks (`device.kv_cache_blocks`): kv_cache_tokens', else on a GPU with a memory share
        what it leaves, else max_batch requests of max_len."""
        if world > 1 or device.type != "cuda" or fraction is None:
            return -(-tokens // block_size) if tokens else None
        graphs = uses_cuda_runner(checkpoint.config, device, backend)
        layout = Verifier.layout(checkpoint, max_batch, tap_layers, dtype, graphs, world, block_size, max_len)
        return kv_cache_blocks(layout, max_len, torch.cuda.get_device_properties(device).total_memory, fraction,
                               tokens)

    @property
    def context_len(self) -> int:
        return self.verifier.max_len

    def facts(self, default_k: int = DEFAULT_K) -> ModelFacts:
        """What the router's API says of this engine's model (`serve --inprocess`, the tests)."""
        max_k = self.proposer.max_k
        return ModelFacts(target=str(self.target_path), drafter=str(self.drafter_path or ""), method=self.method,
                          max_k=max_k, default_k=min(default_k, max_k), context_len=self.context_len,
                          vocab_size=self.verifier.runner.config.vocab_size, tokenizer=self.tokenizer)

    def request(self, request_id: str, prompt_ids: Sequence[int], max_tokens: int, k: int | None = None,
                sampling: SamplingParams = GREEDY, cache_salt: str = "") -> Request:
        """A validated request; k=None takes the method's default (0 for `none`)."""
        max_k = self.proposer.max_k
        k = (min(DEFAULT_K, max_k) if max_k else 0) if k is None else k
        validate_request(prompt_ids, max_tokens, k, context_len=self.context_len, max_k=max_k)
        sampling = checked(sampling, self.verifier.runner.config.vocab_size)
        return Request(request_id, tuple(prompt_ids), max_tokens, k, sampling, cache_salt=cache_salt)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt) if prompt else []

    def generate(self, requests: Sequence[Request]) -> Iterator[TokenEvent | FinishEvent]:
        """Stream token and finish events; all requests step together, up to max_batch at a time."""
        return self.loop.run(requests)

    def complete(self, requests: Sequence[Request], on_finish: Callable[[FinishEvent], None] | None = None
                 ) -> list[FinishEvent]:
        """Run the requests to their end; their finish events in the order given (`on_finish` sees each as it ends)."""
        done = {}
        for event in self.generate(requests):
            if isinstance(event, FinishEvent):
                done[event.request_id] = event
                if on_finish is not None:
                    on_finish(event)
        return [done[r.request_id] for r in requests]
