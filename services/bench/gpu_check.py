"""`blockspec gpu-check`: random-weight Qwen3-shaped targets up to the reference size (~27B, bf16), Qwen3.5 hybrids
(`tiny-hybrid`, and `27b-hybrid` with Qwen3.5-27B's published shape) and a matching DFlash drafter on one GPU: r(k+1),
c_d, orchestration overhead, CUDA IPC sharing between two processes, greedy exactness of verify vs decode and of a
speculative stream vs plain decoding (default and invariant mode), and what those streams cost per token. Prints a
table.

`--device cpu --sizes tiny,tiny-hybrid` runs the same code on the CPU in seconds (what the tests run)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockspec.common.errors import InvalidArgument
from blockspec.common.models import Checkpoint, parse_config
from blockspec.common.runner import Runner

# name -> (layers, hidden, heads, kv heads, intermediate, vocab), untied LM head: 0.75B, 8.2B and 26.7B
# parameters. "27b" has the reference target's size (~54 GB bf16); its drafter 2.2B.
SIZES = {
    "tiny": (2, 64, 4, 2, 128, 512),
    "1b": (28, 1024, 16, 8, 3072, 151936),
    "8b": (36, 4096, 32, 8, 12288, 151936),
    "27b": (64, 5120, 40, 8, 21504, 151936),
}
# Qwen3.5 hybrids: the published Qwen3.5-27B language model (26.9B parameters, 48 Gated DeltaNet and 16 attention
# layers), and the same shrunk (services/build/tiny.py).
HYBRID_SIZES = ("tiny-hybrid", "27b-hybrid")
SIZES = {**SIZES, **{size: None for size in HYBRID_SIZES}}
DRAFTER_LAYERS = {"tiny": 1, "1b": 1, "8b": 3, "27b": 5, "tiny-hybrid": 1, "27b-hybrid": 5}
KS = (1, 3, 5, 7, 15)
STREAM_TOKENS = 48  # per stream of stream_check, after a 128-token prompt


def hf_config(size: str) -> dict:
    """The size's config.json as transformers writes it for Qwen3 (a hybrid size: Qwen3.5's), also what a
    transformers peer is built from."""
    if size in HYBRID_SIZES:
        from blockspec.services.build.tiny import QWEN3_5_27B, tiny_family_config, tiny_tokenizer

        cfg = QWEN3_5_27B if size == "27b-hybrid" else tiny_family_config("qwen3_5", tiny_tokenizer())
        return {**cfg, "max_position_embeddings": 4096, "eos_token_id": cfg["vocab_size"] - 1}
    layers, hidden, heads, kv, inter, vocab = SIZES[size]
    return {"model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 128 if hidden >= 1024 else 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            "eos_token_id": vocab - 1}


def random_target(size: str, device: str, dtype: torch.dtype) -> Checkpoint:
    """A checkpoint of the size's shape with random weights made directly on the device (no file, no host copy)."""
    from blockspec.common.runner import decoder_class

    cfg = parse_config(hf_config(size), Path(f"<random {size}>"))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in decoder_class(cfg)(cfg).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(0)
    # Norms at their identity: weight 1, or 0 where a hybrid's norm scales by 1 + weight.
    identity = {k: 0.0 if cfg.hybrid and not k.endswith("linear_attn.norm.weight") else 1.0 for k in shapes
                if k.endswith("norm.weight")}
    weights = {k: (torch.full(s, identity[k], dtype=dtype, device=device) if k in identity else
                   torch.randn(s, dtype=dtype, device=device, generator=gen) * 0.02) for k, s in shapes.items()}
    return Checkpoint(path=Path(f"<random {size}>"), config=cfg, weights=weights, tokenizer=None)


def weights_bytes(size: str, dtype: torch.dtype) -> int:
    """The bytes of the size's target and drafter weights in dtype (counted on the meta device: nothing allocated)."""
    from blockspec.common.footprint import parameters

    cfg = parse_config(hf_config(size), Path(f"<random {size}>"))
    params = parameters(cfg).total
    with torch.device("meta"):
        params += sum(p.numel() for p in random_drafter(size, cfg, "meta", dtype).parameters())
    return params * dtype.itemsize


def free_bytes(device: str) -> int:
    """Memory the device has free now: the GPU's (cudaMemGetInfo), or the host's MemAvailable."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def check_fits(sizes: list[str], device: str, dtype: torch.dtype) -> None:
    """Refuse, naming --sizes, a size whose weights alone pass the device's free memory (each size is built after the
    last one is freed): `--device cpu` with the default sizes would build a 27B model in fp32 and be killed."""
    free = free_bytes(device)
    for size in sizes:
        need = weights_bytes(size, dtype)
        if need > free:
            fitting = [s for s in SIZES if weights_bytes(s, dtype) <= free]
            raise InvalidArgument("--sizes", f"{size} needs {need / 2**30:.1f} GiB for its weights in {dtype} on "
                                             f"{device}, which has {free / 2**30:.1f} GiB free: choose from "
                                             f"{', '.join(fitting) or 'none'}")


@dataclass
class SizeReport:
    size: str
    params_b: float
    decode_ms: float
    r: dict[int, float]  # r(k + 1)
    c_d: dict[int, float]  # drafter proposal / one target decode
    overhead_ms: float  # step loop time per step beyond the drafter and verifier calls
    exact_default: int  # argmax mismatches verify vs decode, default mode
    exact_invariant: int  # invariant mode
    max_diff_default: float
    positions: int
    stream_default: int  # tokens of a k=5 step-loop stream equal to plain decoding's before they part
    stream_invariant: int  # the same in invariant mode (query width 16)
    stream_tokens: int
    stream_plain_ms: float  # per token of those streams, default mode (see stream_check)
    stream_spec_ms: float


def check_size(size: str, device: str, dtype: torch.dtype, context: int = 1024, repeats: int = 20) -> SizeReport:
    from blockspec.services.bench.costs import cost_ratios

    target = random_target(size, device, dtype)
    context = min(context, 256) if size.startswith("tiny") else context
    params = sum(w.numel() for w in target.weights.values()) / 1e9
    prompt = torch.randint(0, target.config.vocab_size - 1, (context,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    drafter = random_drafter(size, target.config, device, dtype)
    verifier, proposer = roles(target, drafter, None, context + 64, dtype, device)
    verifier.add("x", prompt)
    verifier.prefill(["x"])
    decode, r, c_d = cost_ratios(verifier, proposer, "x", KS, repeats, device)
    verifier.release("x")
    proposer.release("x")
    overhead = loop_overhead(verifier, proposer, prompt, repeats, device)
    mismatches, max_diff, positions = verify_vs_decode_flips(target, prompt, context, dtype, device)
    default = stream_check(verifier, proposer, prompt[:128], 5, STREAM_TOKENS, device)
    del verifier, proposer
    verifier, proposer = roles(target, drafter, 16, context + 64, dtype, device)
    invariant = stream_check(verifier, proposer, prompt[:128], 5, STREAM_TOKENS, device)
    del verifier, proposer
    del drafter, target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return SizeReport(size, round(params, 3), decode * 1e3, r, c_d, overhead, mismatches[False], mismatches[True],
                      max_diff, positions, default[0], invariant[0], STREAM_TOKENS, default[1], default[2])


def random_drafter(size: str, cfg, device: str, dtype: torch.dtype):
    """A DFlash drafter shaped for the target (random weights), tapping its first, middle and last layer."""
    from blockspec.services.drafter.dflash.config import DFlashConfig
    from blockspec.services.drafter.dflash.model import DFlashDrafter

    taps = tuple(sorted({0, cfg.num_layers // 2, cfg.num_layers - 1}))
    dcfg = DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=DRAFTER_LAYERS[size],
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                        num_target_layers=cfg.num_layers, target_layer_ids=taps, block_size=16,
                        mask_token_id=0, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, conv_kernel_size=2,
                        conv_group_size=16, selector_rank=8 if size.startswith("tiny") else 256, selector_top_k=16)
    return DFlashDrafter(dcfg).to(device, dtype).eval().requires_grad_(False)


def roles(target: Checkpoint, drafter, query_width: int | None, max_len: int, dtype: torch.dtype, device: str):
    """The verifier and the dflash proposer over it (two slots; query_width 16 = invariant mode)."""
    from blockspec.services.drafter.proposers.dflash import DFlashProposer
    from blockspec.services.verifier.verifier import Verifier

    verifier = Verifier(target, num_slots=2, max_len=max_len, query_width=query_width,
                        tap_layers=drafter.cfg.target_layer_ids, dtype=dtype, device=device)
    proposer = DFlashProposer(drafter, verifier.runner.embedding, verifier.runner.lm_head, verifier.features, 2,
                              verifier.max_len)
    return verifier, proposer


def loop_overhead(verifier, proposer, prompt: list[int], repeats: int, device: str) -> float:
    """Milliseconds per step-loop step (k=5) beyond the drafter and verifier calls it makes."""
    from blockspec.services.router.step_loop import Request, StepLoop

    loop = StepLoop(verifier, proposer, max_batch=2)
    loop.submit(Request("y", tuple(prompt), 64, 5))
    loop.step()
    steps, inner, started = 0, 0.0, time.perf_counter()
    while not loop.idle and steps < repeats:
        loop.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        inner += loop.last_report.draft_s + loop.last_report.verify_s if loop.last_report else 0.0
        steps += 1
    overhead = ((time.perf_counter() - started) - inner) / max(steps, 1) * 1e3
    list(loop.run([]))  # finish the request: its slot is free again
    return overhead


def verify_vs_decode_flips(target: Checkpoint, prompt: list[int], context: int, dtype: torch.dtype, device: str):
    """Greedy exactness of the math: argmax flips between verify and decode logits along the prompt, in
    default and invariant width ({invariant: flips}, max |diff| default, positions per mode)."""
    from blockspec.services.verifier.invariance import verify_vs_decode

    mismatches, max_diff, positions = {}, 0.0, 0
    for invariant in (False, True):
        runner = Runner(target, 1, context + 64, 16 if invariant else None, dtype=dtype, device=device)
        bad = 0
        for cut in range(16, min(context, 256), 48):
            v, d = verify_vs_decode(runner, prompt[:cut], prompt[cut : cut + 8])
            bad += int((v.argmax(-1) != d.argmax(-1)).sum())
            positions += 8 if not invariant else 0
            if not invariant:
                max_diff = max(max_diff, float((v - d).abs().max()))
        mismatches[invariant] = bad
        del runner
    return mismatches, max_diff, positions


def stream_check(verifier, proposer, prompt: list[int], k: int, tokens: int, device: str) -> tuple[int, float, float]:
    """Greedy exactness end to end, and what the streams cost: (how many tokens of a speculative stream (k)
    through the step loop equal plain decoding's (k=0) on the same roles before the two part, plain ms
    per token, speculative ms per token; each stream's prefill included). These decode as serving does,
    the keys growing by one every step; the random drafter's drafts are nearly all rejected, so the
    speculative figure is the price of drafting at acceptance ~0."""
    from blockspec.services.router.step_loop import Request, StepLoop, TokenEvent

    streams, cost = [], []
    for width in (0, k):
        loop = StepLoop(verifier, proposer, max_batch=2)
        started = time.perf_counter()
        events = list(loop.run([Request(f"s{width}", tuple(prompt), tokens, width)]))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        cost.append((time.perf_counter() - started) / tokens * 1e3)
        streams.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
    plain, spec = streams
    same = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    return same, cost[0], cost[1]


def check_ipc(device: str) -> str:
    """Export a tensor from this process and map it in a child: same bytes, no copy (CUDA IPC / shm)."""
    import multiprocessing as mp

    from blockspec.common.tensor_share import SharedTensors

    shares = SharedTensors()
    try:
        tensor = torch.arange(1 << 20, dtype=torch.float32, device=device)
        shared, handle = shares.export(tensor)
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            total = pool.apply(_child_sum, (handle,))
        expected = float(shared.sum())
        return f"{handle.kind}: child read sum {total:.0f}, expected {expected:.0f} -> {'ok' if total == expected else 'MISMATCH'}"
    finally:
        shares.close()


def _child_sum(handle) -> float:
    from blockspec.common.tensor_share import open_handle

    return float(open_handle(handle).sum())


def table(reports: list[SizeReport]) -> str:
    lines = ["| size | params (B) | decode ms | " + " | ".join(f"r({k + 1})" for k in KS) + " | c_d k=5 | c_d k=15 | "
             "loop overhead ms | argmax flips default | invariant | max diff default | k=5 stream = plain, default "
             "| invariant | stream ms/token plain | k=5 |", "|---" * (13 + len(KS)) + "|"]
    for r in reports:
        lines.append(f"| {r.size} | {r.params_b} | {r.decode_ms:.2f} | " + " | ".join(f"{r.r[k]:.2f}" for k in KS)
                     + f" | {r.c_d.get(5, float('nan')):.2f} | {r.c_d.get(15, float('nan')):.2f} | {r.overhead_ms:.2f} | "
                     f"{r.exact_default}/{r.positions} | {r.exact_invariant}/{r.positions} | {r.max_diff_default:.2e} | "
                     f"{r.stream_default}/{r.stream_tokens} | {r.stream_invariant}/{r.stream_tokens} | {r.stream_plain_ms:.2f} | "
                     f"{r.stream_spec_ms:.2f} |")
    return "\n".join(lines)


def main(sizes: list[str], device: str, out: Path | None) -> int:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    check_fits(sizes, device, dtype)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    reports = []
    for size in sizes:  # the files are rewritten after each size: a run cut short keeps what it measured
        started = time.perf_counter()
        reports.append(check_size(size, device, dtype))
        print(f"{size}: done in {time.perf_counter() - started:.0f} s", flush=True)
        _write(out, f"Device: {name}, dtype {dtype}.\n\n{table(reports)}\n", reports)
    text = f"Device: {name}, dtype {dtype}.\n\n{table(reports)}\n\nSharing between processes: {check_ipc(device)}\n"
    print(text)
    _write(out, text, reports)
    return 0


def _write(out: Path | None, text: str, reports: list[SizeReport]) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(text)
        (out / "gpu_check.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
