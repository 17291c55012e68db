"""Conformance with transformers for every supported family and layout. Checkpoints built by transformers' own classes
over a sweep of configs (value heads != key heads, GQA ratios, partial rotary, nested and flat, optional keys absent
and present, tied and untied, weights scaled by 3) give transformers' logits - a prefill, decode steps and a
multi-token verify, within fp32 tolerance - and its greedy tokens exactly, in the eager runner and in the CUDA
runner's torch references; keys absent take transformers' defaults; keys not understood are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from blockspec.common.errors import ModelLoadError
from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.models.model_config import CONFIG_CLASSES, DEFAULTS, READ_KEYS, parse_config
from blockspec.common.runtime.cuda_runner import CudaRunner, unsupported
from blockspec.common.runtime.runner import Runner, Segment
from blockspec.services.training.tiny import PUBLISHED, build_family, tiny_family_config
from tests.helpers import base_config


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    layout: str = "text"
    changes: dict = dataclasses.field(default_factory=dict)  # over base_config(): None removes a key before the build
    drop: tuple[str, ...] = ()  # the language model's keys removed from the saved config.json: read as absent
    drop_top: tuple[str, ...] = ()  # a multimodal config's top-level keys removed
    outer: dict | None = None  # a multimodal config's top-level keys


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = [
    Case("llama", "llama"),
    Case("llama-mha-biases-tied", "llama", changes={"num_key_value_heads": 4, "head_dim": None, "attention_bias": True,
                                                    "mlp_bias": True, "tie_word_embeddings": True},
         drop=("num_key_value_heads", "head_dim")),
    Case("llama-llama3-rope", "llama", changes={"rope_parameters": LLAMA3_ROPE}),
    Case("qwen2", "qwen2"),
    Case("qwen2-gqa4-tied", "qwen2", changes={"num_key_value_heads": 1, "head_dim": None, "tie_word_embeddings": True},
         drop=("head_dim",)),
    Case("qwen3", "qwen3"),
    Case("qwen3-wide-heads", "qwen3", changes={"head_dim": 64, "num_key_value_heads": 4}),
    Case("qwen3-defaults", "qwen3", changes={"head_dim": 128},
         drop=("head_dim", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "layer_types")),
    Case("qwen3_moe", "qwen3_moe", changes={"norm_topk_prob": True}),
    Case("qwen3_moe-defaults", "qwen3_moe", changes={"norm_topk_prob": False, "head_dim": 16},
         drop=("norm_topk_prob", "head_dim", "decoder_sparse_step", "mlp_only_layers")),
    Case("qwen3_moe-sparse-step", "qwen3_moe", changes={"decoder_sparse_step": 2, "mlp_only_layers": [0],
                                                        "num_hidden_layers": 4}),
    Case("qwen3_next", "qwen3_next"),
    Case("qwen3_next-v3k-defaults", "qwen3_next", changes={"linear_num_value_heads": 6, "norm_topk_prob": True},
         drop=("norm_topk_prob", "partial_rotary_factor", "rope_parameters", "layer_types")),
    Case("qwen3_5", "qwen3_5"),
    Case("qwen3_5-defaults", "qwen3_5", changes={"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4},
         drop=("head_dim", "num_key_value_heads", "partial_rotary_factor", "rope_parameters", "layer_types",
               "linear_conv_kernel_dim")),
    Case("qwen3_5-half-rotary-mixed-layers-tied", "qwen3_5", changes={
        "partial_rotary_factor": 0.5, "num_key_value_heads": 1, "linear_num_value_heads": 2,
        "tie_word_embeddings": True,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}),
    Case("qwen3_5-mm", "qwen3_5", "multimodal"),
    Case("qwen3_5-mm-tied-outer", "qwen3_5", "multimodal", {"linear_num_value_heads": 6},
         outer={"tie_word_embeddings": True}),
    # text_config says tied, the top level not: transformers' conditional-generation model reads the top level
    Case("qwen3_5-mm-tied-in-text-config", "qwen3_5", "multimodal", {"tie_word_embeddings": True}),
    Case("qwen3_5-mm-top-level-absent", "qwen3_5", "multimodal", drop_top=("tie_word_embeddings",)),
    Case("qwen3_5_moe", "qwen3_5_moe"),
    Case("qwen3_5_moe-top1-v3k", "qwen3_5_moe", changes={"num_experts_per_tok": 1, "linear_num_value_heads": 6,
                                                         "num_key_value_heads": 1}),
    Case("qwen3_5_moe-mm", "qwen3_5_moe", "multimodal"),
]
DECODES, VERIFY = 3, 4  # single-token steps after the prefill, then one forward of VERIFY tokens


def build(root, tokenizer, case: Case) -> object:
    config = {k: v for k, v in {**base_config(case.family, len(tokenizer)), **case.changes}.items() if v is not None}
    return build_family(root / case.name, case.family, config, case.layout, seed=sum(map(ord, case.name)) % 97,
                        tokenizer=tokenizer, weight_scale=3.0, outer=case.outer, drop_keys=case.drop,
                        drop_top_keys=case.drop_top)


def reference(path, prompt: list[int]) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """transformers, as the checkpoint's own architecture class loads it: the prefill's logits [T, V], the greedy
    continuation and the logits of each generated position (generate's own)."""
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        prefill = model(torch.tensor([prompt])).logits[0]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=DECODES + VERIFY + 1, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return prefill, out.sequences[0, len(prompt):].tolist(), [row[0] for row in out.logits]


def ours(runner, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The runner's logits over the same positions: the prefill, DECODES single-token steps fed transformers' tokens,
    then one forward of the next VERIFY tokens (a verify's shape)."""
    slot = runner.cache.allocate()
    rows = [runner.forward([Segment(slot, prompt)]).logits[0]]
    for t in tokens[:DECODES]:
        rows.append(runner.forward([Segment(slot, [t])]).logits[0])
    rows.append(runner.forward([Segment(slot, tokens[DECODES : DECODES + VERIFY])]).logits[0])
    return rows


def assert_conforms(got: list[torch.Tensor], prefill: torch.Tensor, tokens: list[int], logits: list[torch.Tensor]):
    """Prefill logits, each later position's logits within fp32 tolerance (relative to the logits' scale), and the
    greedy token at every position exactly transformers'."""
    want = [prefill, *[logits[i + 1][None] for i in range(DECODES)], torch.stack(logits[DECODES + 1 :])]
    tol = 2e-5 * max(1.0, float(prefill.abs().max()))
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, step
        assert float((g - w).abs().max()) <= tol, f"step {step}: logits differ by {float((g - w).abs().max()):.2e}"
    argmax = [int(got[0][-1].argmax())] + [int(g.argmax(-1)[i]) for g in got[1:] for i in range(len(g))]
    assert argmax == tokens[: len(argmax)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_logits_and_greedy_tokens_equal_transformers(case, tokenizer, prompts, tmp_path):
    path = build(tmp_path, tokenizer, case)
    prompt = prompts[4][:24]
    prefill, tokens, logits = reference(path, prompt)
    checkpoint = load_checkpoint(path)
    assert_conforms(ours(Runner(checkpoint, num_slots=1, max_len=64), prompt, tokens), prefill, tokens, logits)
    assert unsupported(checkpoint.config) is None  # the CUDA runner's step, on its torch references on the CPU
    cuda = CudaRunner(load_checkpoint(path), 1, 64, (), torch.float32, "cpu")
    assert_conforms(ours(cuda, prompt, tokens), prefill, tokens, logits)


def test_the_defaults_are_transformers(tmp_path):
    """Every default blockspec takes for an absent key is the one transformers' config class takes (None: derived from
    other keys, where transformers derives it too: its class has no such field, or defaults it to None)."""
    import transformers

    for family, class_name in CONFIG_CLASSES.items():
        cls = getattr(transformers, class_name)
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        for key, ours_default in DEFAULTS[family].items():
            if key in ("partial_rotary_factor", "full_attention_interval"):  # set in __post_init__
                made = cls(num_hidden_layers=8)
                theirs = (made.rope_parameters["partial_rotary_factor"] if key == "partial_rotary_factor"
                          else made.layer_types.index("full_attention") + 1)
            else:
                theirs = fields.get(key)
            assert ours_default == theirs, f"{family} {key}: {ours_default!r}, transformers {theirs!r}"


@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_the_published_configs_are_read_whole(family, tokenizer, tmp_path):
    """The language models of the published checkpoints this project serves parse, every key read or named inert."""
    cfg = parse_config(PUBLISHED[family], tmp_path)
    assert cfg.family == PUBLISHED[family]["model_type"]
    assert not set(PUBLISHED[family]) - READ_KEYS[cfg.family] - {"model_type"}


# The top level and text_config of Qwen3.6-27B's config.json as published (layer_types cut to 4 layers).
QWEN3_6_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056, "language_model_only": False,
    "model_type": "qwen3_5", "tie_word_embeddings": False, "transformers_version": "4.57.1", "video_token_id": 248057,
    "vision_end_token_id": 248054, "vision_start_token_id": 248053,
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5", "out_hidden_size": 5120},
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 248044,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24, "num_hidden_layers": 4, "num_key_value_heads": 4, "output_gate_type": "swish",
        "pad_token_id": None, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320},
}


def test_a_published_multimodal_config_reads_its_text_config(tmp_path):
    cfg = parse_config(QWEN3_6_27B, tmp_path)
    assert (cfg.family, cfg.hidden_size, cfg.head_dim, cfg.rotary_dim, cfg.linear.num_v_heads) == (
        "qwen3_5", 5120, 256, 64, 48)
    assert cfg.eos_token_ids == (248044,) and cfg.rope_theta == 1e7 and not cfg.tie_word_embeddings


def with_key(raw: dict, key: str, value: object, top: bool = False) -> dict:
    raw = json.loads(json.dumps(raw))
    (raw if top or "text_config" not in raw else raw["text_config"])[key] = value
    return raw


@pytest.mark.parametrize(("raw", "message"), [
    (with_key(QWEN3_6_27B, "quantization_config", {"quant_method": "fp8"}), "quantization_config are not supported"),
    (with_key(QWEN3_6_27B, "rope_parameters", {}, top=True), "rope_parameters at the top level of a multimodal"),
    (with_key(QWEN3_6_27B, "mamba_ssm_dtype", "bfloat16"), "mamba_ssm_dtype='bfloat16' is not supported"),
    (with_key(QWEN3_6_27B, "output_gate_type", "sigmoid"), "output_gate_type='sigmoid' is not supported"),
    (with_key(QWEN3_6_27B, "sliding_window", 4096), "sliding_window are not supported for qwen3_5"),
    (with_key(PUBLISHED["qwen3_moe"], "layer_types", ["sliding_attention"] * 48), "only full_attention"),
    (with_key(PUBLISHED["qwen3_moe"], "partial_rotary_factor", 0.5), "partial_rotary_factor 0.5 is not supported"),
    (with_key(PUBLISHED["qwen3_moe"], "attention_chunk_size", 8192), "attention_chunk_size are not supported"),
    (with_key(PUBLISHED["qwen3_5_moe"], "norm_topk_prob", False), "norm_topk_prob=false is not supported"),
    ({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "attention_bias": True},
     "attention_bias are not supported for qwen2"),
    (with_key(PUBLISHED["qwen3_moe"], "head_dim", "128"), "head_dim '128' is not an integer"),
], ids=["quantization", "mm-outer-rope", "ssm-dtype", "gate-type", "hybrid-sliding", "dense-sliding-layers",
        "dense-partial-rotary", "unknown", "moe-no-norm", "qwen2-attention-bias", "not-an-integer"])
def test_a_key_not_understood_is_refused_by_name(raw, message, tmp_path):
    with pytest.raises(ModelLoadError, match=message):
        parse_config(raw, tmp_path)


def test_the_tiny_family_configs_are_read_whole(tokenizer, tmp_path):
    for family in PUBLISHED:
        assert parse_config(tiny_family_config(family, tokenizer), tmp_path).family == PUBLISHED[family]["model_type"]
