"""What a target holds, from its config alone: parameters (all, and those a token reads in an MoE) and the bytes of
one request slot at a context length and dtype. `blockspec info` prints them; the verifier's start-up memory check
(`Verifier.static_bytes`) adds them up the same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.common.models.kv_cache import SlotKVCache
from blockspec.common.models.model_config import ModelConfig
from blockspec.common.models.state_cache import SlotStates

SPECULATIVE_BLOCK = 16  # the widest verify a slot keeps rollback inputs for, in info's figures (k = 15)
SPARE_BLOCK = 16  # the CUDA runner's KV block size, where its captured steps' padding rows write


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


def verifier_bytes(cfg: ModelConfig, weights: int, num_slots: int, max_len: int, n_taps: int, dtype: torch.dtype,
                   graphs: bool = False, world: int = 1, vocab_bytes: int = 0) -> int:
    """What a verifier holds once built: its weights' bytes, and per slot the KV cache, states and tap features;
    graphs (the CUDA runner): also its spare block (and a hybrid's spare state row) and what its captured steps keep
    (their outputs, the block tables). The start-up check
    (`Verifier.static_bytes`) and `blockspec plan` both count with this. world > 1 (model.tensor_parallel_size): the
    lead rank's part - a world-th of the layers' weights, of the KV cache and of a hybrid's states, and the embedding
    and LM head (`vocab_bytes`) and the tap features whole, which the drafter reads in place (the other ranks hold a
    world-th of the first two, and no taps)."""
    from blockspec.common.runtime.cuda_runner import CudaRunner

    slots = slot_bytes(cfg, max_len, dtype, n_taps)
    if world > 1:  # a rank's heads: its part of the KV cache (a KV head each where there are fewer than ranks) and of
        # a hybrid's states and their rollback inputs; the tap features (whole hidden states) stay whole on rank 0
        taps = max_len * n_taps * cfg.hidden_size * dtype.itemsize
        kv_heads = max(1, cfg.num_kv_heads // world)
        slots = {"kv": slots["kv"] * kv_heads // cfg.num_kv_heads, "conv": slots["conv"] // world,
                 "recurrent": slots["recurrent"] // world, "speculative": (slots["speculative"] - taps) // world + taps}
    per_slot = sum(slots.values())
    weights = (weights - vocab_bytes) // world + vocab_bytes
    if not graphs:
        return weights + num_slots * per_slot
    spare = sum(slot_bytes(cfg, SPARE_BLOCK, dtype, n_taps).values())  # the block (and state row) padding rows write
    return weights + num_slots * per_slot + spare + CudaRunner.graph_bytes(cfg, num_slots, max_len, SPARE_BLOCK)


def drafter_bytes(weights: int, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_len: int,
                  dtype: torch.dtype, spare_slot: bool = False) -> int:
    """What a drafter role holds: its weights' bytes and its own KV cache (a spare slot more where its proposals are
    captured). The drafter role's start-up check and `blockspec plan` both count with this."""
    return weights + SlotKVCache.nbytes(num_layers, num_slots + int(spare_slot), num_kv_heads, max_len, head_dim, dtype)
