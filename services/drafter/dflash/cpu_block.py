"""The drafter's inference forward on the CPU in one C++ call per proposal.

The drafter runs once per speculative step, over a block of 8 slots, against a small target whose CPU step is
short. In torch it is about 150 small operations (norms, RoPE, the dynamic convolutions, attention over the cached
context, the MLP), and their dispatch cost, not their arithmetic, makes a proposal cost most of a target decode.
Here the same computation is one call (the C++ is `cpu_block.cpp`, its bf16 projections in `cpu_bf16.cpp`, the walk in
`cpu_walk.cpp`, built on first use like `common/kernels/cpu_kernels.py`):

* `block`: the block [anchor, MASK...] of every request through all layers and the final norm,
  attending to the request's cached context K/V (read in place, no gathered copy) and to the whole
  block (bidirectional);
* `context`: the context K/V of newly committed positions (fc, norm, K/V projections, K norm, RoPE),
  written into the cache;
* `walk`: the path selector's walk (top-k candidates per slot, pairwise scores, argmax or a sample);
* `propose`: a whole proposal in one call: the missing context, the block of every request, the
  LM head over the draft slots and the walk, greedy or sampling (the noise of `common/runtime/distributions.py`, drawn
  from the same counter-based generator at each candidate's token; the q a rejection draft came from).

Linear layers use the packed small-batch kernel of `common.cpu_kernels`; attention has its own loop (every
query of a block sees the same keys: scores a vector of queries at a time, no horizontal sums); everything
else is plain loops over fp32. The arithmetic is the module's (`model.py`), not bit for bit: sums run in another
order. A proposal only decides what the target verifies, so this changes speed, never the output.

Scope: fp32, CPU, inference, head_dim 16, 32, 64, 128 or 256, hidden and intermediate sizes multiples
of 16. Projections whose output count is not whole panels of 64 run as plain dot products. Elsewhere
(training, GPU, bf16 models, a kernel that cannot be built or is switched off) the proposer
runs the torch module; `tests/services/drafter/test_dflash_cpu_block.py` holds the two together.

bf16 weights (`bf16=True`; the proposer asks for them unless BLOCKSPEC_DRAFTER_BF16=0): the
projections and the LM head read bfloat16 copies and multiply bf16-rounded activations, summing in
fp32: with AVX512-BF16 (`vdpbf16ps`), or on AVX2 by widening each weight to fp32 in registers (exact)
and adding the exact products with FMA. Norms, attention, the convolutions and the walk stay fp32.
Half the bytes (and with AVX512-BF16 twice the products per instruction): a proposal at concurrency 1
and k = 7 costs less, on drafts that differ from the fp32 ones only where two candidates nearly tie
(tau: docs/performance.md). Where the CPU has neither, the weights stay fp32. Where the compiler targets Intel's
AMX tiles (Sapphire Rapids and later) and Linux grants the process their state, the bf16 projections run
as tile products instead (`TDPBF16PS`; two threads from 256 outputs on; BLOCKSPEC_DRAFTER_AMX=0 keeps `vdpbf16ps`;
inputs in whole tiles of 32): the same bf16 operands and fp32 sums, rounded within a few ulp of the vector path's.

int8 weights (`int8=True`; the proposer asks for them unless BLOCKSPEC_DRAFTER_INT8=0) where AMX runs the bf16
projections and the CPU has AMX-INT8 tiles: the projections over whole tiles of 64 inputs and the LM head read int8
copies (each output feature's weights in steps of its max |w| / 127) and multiply them on the tiles (`TDPBSSD`,
exact int32 sums) by each activation row split into two int8 rows, so only the weights lose precision. Half the
bytes of bf16: right after a verify, reading the weights from L3 is most of a proposal. The drafts differ from the
bf16 ones where candidates nearly tie (tau: docs/performance.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from blockspec.common.kernels import cpu_kernels

ENV_BF16 = "BLOCKSPEC_DRAFTER_BF16"  # "0": the drafter's CPU path keeps fp32 weights
ENV_AMX = "BLOCKSPEC_DRAFTER_AMX"  # "0": bf16 projections on AVX512-BF16 even where the CPU has AMX tiles
ENV_INT8 = "BLOCKSPEC_DRAFTER_INT8"  # "0": bf16 weights even where AMX-INT8 tiles could take int8 ones

_SOURCE = cpu_kernels.PANEL_SOURCE + "".join((Path(__file__).parent / name).read_text()
                                                for name in ("cpu_bf16.cpp", "cpu_walk.cpp", "cpu_block.cpp"))

_extension = cpu_kernels.Extension("blockspec_dflash_cpu", _SOURCE, "the drafter's torch forward")


class CpuDrafter:
    """The fast CPU path of one DFlashDrafter at inference; `usable` says whether it applies."""

    def __init__(self, model, use_dynamic_conv: bool, bf16: bool = False, int8: bool = False) -> None:
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.use_conv = use_dynamic_conv and cfg.conv_kernel_size is not None
        ext = _extension.get()
        self.usable = (
            ext is not None and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
            and cfg.head_dim in (16, 32, 64, 128, 256) and cfg.hidden_size % 16 == 0
            and cfg.num_heads % cfg.num_kv_heads == 0 and cfg.intermediate_size % 16 == 0
        )
        # bf16 weights (projections and LM head; activations, norms, attention and sums stay fp32) where
        # asked for and the CPU has AVX512-BF16 or AVX2. Every projection input (hidden, intermediate, taps) is even.
        self.bf16 = bool(bf16 and self.usable and ext.bf16_supported())
        if self.bf16:  # AMX tiles for the bf16 projections where the CPU and the kernel allow them
            ext.set_amx(os.environ.get(ENV_AMX, "1") != "0")
        # int8 weights where asked for, AMX runs the bf16 projections and the extension has the int8 tiles.
        self.int8 = bool(int8 and self.amx and ext.int8_supported())
        self._prepared_for: tuple | None = None
        self._copied: list[torch.Tensor] = []  # the weights the prepared lists hold copies of
        self._prepared: tuple[list[torch.Tensor], tuple, tuple, tuple] = ([], (), (), ())
        self._proposer_state: tuple = ()  # `bind`: the calling proposer's cache, RoPE tables, embedding, vocabulary
        self._bound: tuple = (None, None)  # `propose`'s (LM head panels, the C++ Proposer binding them)
        self._head_panels: tuple = (None, -1, None)  # lm_head_panels' last: (LM head, its version, panels)

    @property
    def amx(self) -> bool:
        """Whether this drafter's bf16 projections run on AMX tiles now: one switch per process, which the last
        CpuDrafter built with bf16 weights set from BLOCKSPEC_DRAFTER_AMX."""
        return self.bf16 and _extension.get().amx_on()

    @property
    def weights(self) -> str:
        """The packed projections' format and what multiplies them (for reports)."""
        if self.int8:
            return "int8 weights on AMX tiles"
        return ("bf16 weights on AMX tiles" if self.amx else "bf16 weights") if self.bf16 else "fp32 weights"

    def _prepare(self) -> tuple[list[torch.Tensor], tuple, tuple, tuple]:
        """The weight lists of `block` and `context` and the fixed arguments of `propose` around the block
        (context, then LM head and walk), made again only after a weight they copy (the projections,
        packed) changed in place (e.g. load_state_dict); the other weights go as views, which see such
        changes. Gathering them (module attributes, detach) costs more than a small proposal's arithmetic,
        and so does checking every parameter's version in the loop (its objects out of cache)."""
        versions = tuple(p._version for p in self._copied)
        if not versions or versions != self._prepared_for:
            cfg, sel = self.cfg, getattr(self.model, "candidate_selector", None)
            self._copied = []
            block_w, (fc, *kv) = self._weights(), self._context_weights()
            context_args = (fc, self.model.hidden_norm.weight.detach(), kv)
            block_args = (block_w, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.conv_kernel_size if self.use_conv else 0, cfg.conv_group_size, cfg.rms_norm_eps)
            walk_args = (() if sel is None else  # plain DFlash: no walk, `propose` is not called
                         (cfg.output_multiplier or 0.0, cfg.final_logit_softcapping or 0.0,
                          sel.hidden_projection.weight.detach(), sel.predecessor_codebook.detach(),
                          sel.successor_codebook.detach(), sel.top_k, sel.sampling_width))
            self._prepared = (block_w, context_args, block_args, walk_args)
            self._prepared_for = tuple(p._version for p in self._copied)
        return self._prepared

    def _form(self, in_features: int) -> str:
        """The packed format of a projection over in_features inputs: int8 takes whole tiles of 64 inputs only."""
        return "int8" if self.int8 and in_features % 64 == 0 else "bf16" if self.bf16 else "fp32"

    def _projection(self, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self._copied += weights
        return _projection(weights, self._form(weights[0].shape[1]))

    def _weights(self) -> list[torch.Tensor]:
        """The weights in the order `block` reads them, projections as `_projection` gives them."""
        out = []
        for layer in self.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            items = [layer.input_layernorm.weight, (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight),
                     att.q_norm.weight, att.k_norm.weight, (att.o_proj.weight,), layer.post_attention_layernorm.weight,
                     (mlp.gate_proj.weight, mlp.up_proj.weight), (mlp.down_proj.weight,)]
            if self.use_conv:
                items += [layer.attention_conv.base_kernel, (layer.attention_conv.kernel_projection.weight,),
                          layer.mlp_conv.base_kernel, (layer.mlp_conv.kernel_projection.weight,)]
            out += [self._projection(item) if isinstance(item, tuple) else item.detach() for item in items]
            out += [torch.empty(0)] * (12 - len(items))
        return out + [self.model.norm.weight.detach()]

    def _context_weights(self) -> list[torch.Tensor]:
        out = [self._projection((self.model.fc.weight,))]
        for layer in self.model.layers:
            att = layer.self_attn
            out += [self._projection((att.k_proj.weight, att.v_proj.weight)), att.k_norm.weight.detach()]
        return out

    def block(self, block_embeds: torch.Tensor, cache, slots: torch.Tensor, lens: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """block_embeds [R, B, H] -> normed hidden [R, B, H]; each request attends to its slot's first
        `lens` cached positions and the block, the block at positions lens .. lens + B - 1."""
        cfg = self.cfg
        return _extension.get().block(
            block_embeds.contiguous(), cache.k, cache.v, slots, lens, cos, sin, self._prepare()[0], cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.conv_kernel_size if self.use_conv else 0, cfg.conv_group_size,
            cfg.rms_norm_eps)

    def lm_head_panels(self, lm_head: torch.Tensor) -> torch.Tensor | None:
        """The LM head packed for `propose`; None where it is not this process's own fp32 parameter (a
        tensor mapped from the target's process is never copied) or the packing budget is spent. The last
        packing is kept with the head's version: called before every proposal, right after a target forward,
        where the packing cache's lookup meets cold caches and costs more than this check."""
        last = self._head_panels
        if last[0] is lm_head and last[1] == lm_head._version:
            return last[2]
        if not (isinstance(lm_head, torch.nn.Parameter) and lm_head.shape[0] % 64 == 0 and lm_head.dtype == torch.float32):
            return None
        panels = cpu_kernels.packed((lm_head,), self._form(lm_head.shape[1]))
        if panels is not None:
            self._head_panels = (lm_head, lm_head._version, panels)
        return panels

    def bind(self, cache, cos: torch.Tensor, sin: torch.Tensor, embedding: torch.Tensor,
             vocab_ids: torch.Tensor | None = None) -> None:
        """What `propose` reads besides its per-call arguments: the context K/V cache, the RoPE tables, the
        target's embedding and the token id of each LM head row (a draft vocabulary; None where row v is
        token v). Tensors, read in place: later writes to them are seen."""
        self._proposer_state = (cache.k, cache.v, cos, sin, embedding.detach(), _column_ids(vocab_ids))
        self._bound = (None, None)

    def propose(self, pending: Sequence[tuple[int, int, int, torch.Tensor]], anchors: list[int], slots: list[int],
                lens: list[int], lm_head_panels: torch.Tensor, block: int, sampling: tuple | None = None):
        """A proposal in one call (after `bind`) -> block - 1 tokens per request: first the context each
        request lacks (`pending`: slot, start, end, its tap features [>= end, n_taps * H]), then per request r the block
        [anchors[r], MASK x (block - 1)] after lens[r] context positions of slot slots[r], the LM head over
        its draft slots and the walk. The caller sets the cache lengths.

        sampling (None: every walk greedy): per request (temperatures, seeds, noise streams, positions of the
        first draft, rejection flags), lists; each walk then picks as `distributions.draft_pick` does, with the
        same noise (drawn in the C++ at the candidates' tokens), and the call returns (tokens, q_ids, q_probs): the
        candidates and q [R, block - 1, width] of every slot (width: the selector's sampling_width), meaningful in
        rejection rows.

        The fixed arguments are bound once per set of prepared weights and LM head (a C++ `Proposer`, which also
        checks the versions of the weights its packed copies come from: None back means one changed in place, and
        the weights are prepared and bound again). The proposal runs right after a target forward, where every
        Python operation meets cold caches, so the path around it is kept lean: with the arguments bound, a call
        into the C++ converts a handful of small arguments, not all of them."""
        if self._bound[0] is not lm_head_panels or self._bound[1] is None:
            self._bound = (lm_head_panels, self._fixed(lm_head_panels))
        ctx_slots, starts, ends, features = zip(*pending) if pending else ((), (), (), ())
        features = [f[start:end] for f, start, end in zip(features, starts, ends)]  # the rows the context lacks
        args = (features, ctx_slots, starts, ends, anchors, slots, lens, block, block - 1)
        rows = self._bound[1](*args) if sampling is None else self._bound[1].sampled(*args, *sampling)
        if rows is None:  # a weight changed in place since the binding
            self._bound = (None, None)
            return self.propose(pending, anchors, slots, lens, lm_head_panels, block, sampling)
        return rows

    def _fixed(self, lm_head_panels: torch.Tensor):
        """`propose`'s fixed arguments (the weights prepared now) bound in a C++ Proposer, with the weights the
        prepared lists copy and their versions."""
        if not self._proposer_state:
            raise RuntimeError("CpuDrafter.propose needs bind() first")
        _, context_args, block_args, walk_args = self._prepare()
        kc, vc, cos, sin, embedding, ids = self._proposer_state
        return _extension.get().Proposer(kc, vc, cos, sin, *context_args, embedding, self.cfg.mask_token_id,
                                         *block_args, lm_head_panels, *walk_args, ids, self._copied,
                                         list(self._prepared_for))

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             vocab_ids: torch.Tensor | None = None, sampling: tuple | None = None):
        """CandidateSelector.walk: hidden [R, S, H], logits [R, S, V] -> [R, S], greedy; with sampling (as `propose`
        takes it) -> (tokens, q_ids, q_probs), each walk picking as WalkSampler does."""
        sel = self.model.candidate_selector
        args = (hidden.contiguous(), logits.contiguous(), sel.hidden_projection.weight.detach(),
                sel.predecessor_codebook.detach(), sel.successor_codebook.detach(), anchor,
                min(sel.top_k, logits.shape[-1]))
        ext = _extension.get()
        if sampling is None:
            return ext.walk(*args, _column_ids(vocab_ids))
        return ext.walk_sampled(*args, min(sel.sampling_width, logits.shape[-1]), _column_ids(vocab_ids), *sampling)

    def context(self, taps: torch.Tensor, cache, slots: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Context K/V of tap rows taps [N, n_taps * H], each written at its (slot, position)."""
        _extension.get().context(taps.float().contiguous(), cache.k, cache.v, slots, positions, cos, sin,
                                 *self._prepare()[1], self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.rms_norm_eps)


_no_ids = torch.empty(0, dtype=torch.int64)  # walk / propose: logit column v is token v


def _column_ids(vocab_ids: torch.Tensor | None) -> torch.Tensor:
    return _no_ids if vocab_ids is None else vocab_ids


def _projection(weights: tuple[torch.Tensor, ...], form: str = "fp32") -> torch.Tensor:
    """cat(weights) as `project` takes it: packed for the kernel (cached by cpu_kernels; in the form asked for)
    where the output count is whole panels and the budget allows, else the plain fp32 [O, I] weight."""
    packable = all(w.shape[0] % 64 == 0 for w in weights)
    panels = cpu_kernels.packed(weights, form) if packable else None
    if panels is not None:
        return panels
    return weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
