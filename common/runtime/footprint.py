"""What a target holds, from its config alone: parameters (all, and those a token reads in an MoE) and the bytes of
one request slot at a context length and dtype, and a verifier's parts by what they scale with (fixed, a slot, a KV
block). `blockspec info` prints them; the verifier's start-up memory check and `blockspec plan` add them up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.common.models.kv_cache import SlotKVCache
from blockspec.common.models.model_config import ModelConfig
from blockspec.common.models.state_cache import SlotStates
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS

SPECULATIVE_BLOCK = 16  # the widest verify a slot keeps rollback inputs for, in info's figures (k = 15)
# Bytes of a GPU share the verifier's KV blocks leave free for a step's intermediates (activations, gathered keys,
# logits), which no tensor holds between steps; an estimate, not measured per model.
STEP_RESERVE = 512 * 2**20


@dataclass(frozen=True)
class Parameters:
    total: int
    active: int  # read per token: the routed experts' top_k of num_experts (all of them for a dense model)


def parameters(cfg: ModelConfig) -> Parameters:
    """Parameter counts implied by the config (what the checkpoint's tensors hold, biases and norms included)."""
    H, hd = cfg.hidden_size, cfg.head_dim
    total = cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2) + H  # embedding, LM head, final norm
    active = total
    for layer in range(cfg.num_layers):
        mixer = 2 * H  # the two norms
        if cfg.layer_type(layer) == "linear_attention":
            lin = cfg.linear
            mixer += H * (lin.conv_dim + lin.value_dim + 2 * lin.num_v_heads)  # in_proj_qkv, _z, _b, _a
            mixer += lin.conv_dim * lin.conv_kernel + 2 * lin.num_v_heads + lin.v_head_dim  # conv, dt_bias, A_log, norm
            mixer += lin.value_dim * H  # out_proj
        else:
            q_out = cfg.num_heads * hd * (2 if cfg.hybrid else 1)  # a hybrid's q_proj makes its gate too
            kv_out = 2 * cfg.num_kv_heads * hd
            mixer += H * (q_out + kv_out) + cfg.num_heads * hd * H
            mixer += (q_out + kv_out) * cfg.qkv_bias + H * cfg.o_bias + 2 * hd * cfg.qk_norm
        mlp = routed = 3 * H * cfg.intermediate_size + (2 * cfg.intermediate_size + H) * cfg.mlp_bias
        if cfg.sparse(layer):
            e = cfg.experts
            expert = 3 * H * e.intermediate_size
            shared = (3 * H * e.shared_intermediate_size + H) if e.shared_intermediate_size else 0
            mlp = H * e.num_experts + e.num_experts * expert + shared
            routed = H * e.num_experts + e.top_k * expert + shared
        total += mixer + mlp
        active += mixer + routed
    return Parameters(total, active)


def slot_bytes(cfg: ModelConfig, context: int, dtype: torch.dtype, tap_layers: int = 0,
               block: int = SPECULATIVE_BLOCK) -> dict[str, int]:
    """Bytes one request slot holds at `context` tokens: the attention layers' KV cache, the linear layers' conv and
    recurrent states (two buffers each, see state_cache.py), and the speculative extras: the rollback inputs of a
    verify of `block` tokens and the tap features a DFlash drafter reads (`tap_layers` x hidden per position)."""
    states = SlotStates.nbytes(cfg, dtype, "replay", block)
    return {
        "kv": SlotKVCache.nbytes(len(cfg.attention_layers), 1, cfg.num_kv_heads, context, cfg.head_dim, dtype),
        "conv": states["conv"],
        "recurrent": states["recurrent"],
        "speculative": states["speculative"] + context * tap_layers * cfg.hidden_size * dtype.itemsize,
    }


@dataclass(frozen=True)
class VerifierLayout:
    """What a verifier holds, by what each part scales with: fixed bytes (weights, the CUDA runner's buffers), bytes a
    request slot (a hybrid's states and rollback inputs), and bytes a KV block (the K/V of every attention layer for
    block_size positions, and those positions' tap features, which lie in the same blocks)."""

    weights: int
    buffers: int  # the CUDA runner's captured steps' outputs, and its spare slot's state and block for padding rows
    slot: int  # one request slot's fixed state
    kv_block: int
    tap_block: int
    block_size: int
    slots: int

    @property
    def block(self) -> int:
        return self.kv_block + self.tap_block

    @property
    def fixed(self) -> int:
        """Bytes held whatever the KV cache's size: weights, buffers and the slots' states."""
        return self.weights + self.buffers + self.slots * self.slot

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def held(self, num_blocks: int) -> int:
        return self.fixed + num_blocks * self.block

    def blocks_in(self, share: int) -> int:
        """The KV blocks that fit `share` bytes beside the fixed part and STEP_RESERVE (0 where none does)."""
        return max(0, (share - STEP_RESERVE - self.fixed) // self.block)


def verifier_layout(cfg: ModelConfig, weights: int, num_slots: int, n_taps: int, dtype: torch.dtype,
                    block_size: int = BLOCK_TOKENS, graphs: bool = False, world: int = 1,
                    vocab_bytes: int = 0, max_len: int = 0) -> VerifierLayout:
    """The parts of a verifier of `num_slots` request slots (`VerifierLayout`); the start-up check
    (`Verifier.layout`) and `blockspec plan` both count with this. graphs (the CUDA runner): also what its captured
    steps keep (`CudaRunner.graph_bytes`: their outputs, and block tables of max_len positions) and the spare state
    row and block its padding rows write. world > 1
    (model.tensor_parallel_size): the lead rank's part - a world-th of the layers' weights, of the KV cache and of a
    hybrid's states, and the embedding and LM head (`vocab_bytes`) and the tap features whole, which the drafter reads
    in place (the other ranks hold a world-th of the first two, and no taps)."""
    from blockspec.common.runtime.cuda_runner import CudaRunner

    per_slot = slot_bytes(cfg, block_size, dtype)  # a block's K/V, and the slot's states and rollback inputs
    kv, states = per_slot["kv"], per_slot["conv"] + per_slot["recurrent"] + per_slot["speculative"]
    if world > 1:  # a rank's heads: its part of the KV cache (a KV head each where there are fewer than ranks) and of
        # a hybrid's states and their rollback inputs; the tap features (whole hidden states) stay whole on rank 0
        kv = kv * max(1, cfg.num_kv_heads // world) // cfg.num_kv_heads
        states //= world
    taps = block_size * n_taps * cfg.hidden_size * dtype.itemsize
    buffers = states + kv + taps + CudaRunner.graph_bytes(cfg, num_slots, max_len, block_size) if graphs else 0
    return VerifierLayout((weights - vocab_bytes) // world + vocab_bytes, buffers, states, kv, taps, block_size,
                          num_slots)


def drafter_bytes(weights: int, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_len: int,
                  dtype: torch.dtype, spare_slot: bool = False) -> int:
    """What a drafter role holds: its weights' bytes and its own KV cache (a spare slot more where its proposals are
    captured). The drafter role's start-up check and `blockspec plan` both count with this."""
    return weights + SlotKVCache.nbytes(num_layers, num_slots + int(spare_slot), num_kv_heads, max_len, head_dim, dtype)
