"""`blockspec gpu-check`: random-weight Qwen3-shaped targets up to the reference size (~27B, bf16) and a
matching DFlash drafter on one GPU: r(k+1), c_d, orchestration overhead, CUDA IPC sharing between two
processes, and greedy exactness of verify vs decode (default and invariant mode). Prints a table.

`--device cpu --sizes tiny` runs the same code on the CPU in seconds (what the tests run)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockspec.common.models import Checkpoint, parse_config
from blockspec.common.runner import Runner, Segment

# name -> (layers, hidden, heads, kv heads, intermediate, vocab); "27b" is the reference target's shape.
SIZES = {
    "tiny": (2, 64, 4, 2, 128, 512),
    "1b": (28, 1024, 16, 8, 3072, 151936),
    "8b": (36, 4096, 32, 8, 12288, 151936),
    "27b": (64, 5120, 40, 8, 17408, 151936),
}
DRAFTER_LAYERS = {"tiny": 1, "1b": 1, "8b": 3, "27b": 5}
KS = (1, 3, 5, 7, 15)


def random_target(size: str, device: str, dtype: torch.dtype) -> Checkpoint:
    """A Qwen3-shaped checkpoint with random weights made directly on the device (no file, no host copy)."""
    from blockspec.common.decoder import Decoder

    layers, hidden, heads, kv, inter, vocab = SIZES[size]
    raw = {"model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128 if hidden >= 1024 else 16,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "eos_token_id": vocab - 1}
    cfg = parse_config(raw, Path(f"<random {size}>"))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Decoder(cfg).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {k: (torch.ones(s, dtype=dtype, device=device) if k.endswith("norm.weight") else
                   torch.randn(s, dtype=dtype, device=device, generator=gen) * 0.02) for k, s in shapes.items()}
    return Checkpoint(path=Path(f"<random {size}>"), config=cfg, weights=weights, tokenizer=None)


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


def check_size(size: str, device: str, dtype: torch.dtype, context: int = 1024, repeats: int = 20) -> SizeReport:
    from blockspec.services.drafter.dflash.config import DFlashConfig
    from blockspec.services.drafter.dflash.model import DFlashDrafter
    from blockspec.services.bench import cost_ratios
    from blockspec.services.drafter.proposers.dflash import DFlashProposer
    from blockspec.services.router.step_loop import Request, StepLoop
    from blockspec.services.verifier.invariance import verify_vs_decode
    from blockspec.services.verifier.verifier import Verifier

    target = random_target(size, device, dtype)
    cfg = target.config
    context = min(context, 256) if size == "tiny" else context
    params = sum(w.numel() for w in target.weights.values()) / 1e9
    taps = tuple(sorted({0, cfg.num_layers // 2, cfg.num_layers - 1}))
    verifier = Verifier(target, num_slots=2, max_len=context + 64, tap_layers=taps,
                        dtype=dtype, device=device)
    prompt = torch.randint(0, cfg.vocab_size - 1, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    verifier.add("x", prompt)
    verifier.prefill(["x"])
    dcfg = DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=DRAFTER_LAYERS[size],
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                        num_target_layers=cfg.num_layers, target_layer_ids=verifier.runner.tap_layers, block_size=16,
                        mask_token_id=0, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, conv_kernel_size=2,
                        conv_group_size=16, selector_rank=256 if size != "tiny" else 8, selector_top_k=16)
    drafter = DFlashDrafter(dcfg).to(device, dtype).eval().requires_grad_(False)
    proposer = DFlashProposer(drafter, verifier.runner.embedding, verifier.runner.lm_head, verifier.features, 2,
                              verifier.max_len)
    decode, r, c_d = cost_ratios(verifier, proposer, "x", KS, repeats, device)
    # Orchestration: a whole step loop step vs the drafter and verifier calls it makes.
    loop = StepLoop(verifier, proposer, max_batch=2)
    verifier.release("x")
    proposer.release("x")
    loop.submit(Request("y", tuple(prompt), 64, 5))
    loop.step()
    steps, started = 0, time.perf_counter()
    inner = 0.0
    while not loop.idle and steps < repeats:
        loop.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        inner += loop.last_report.draft_s + loop.last_report.verify_s if loop.last_report else 0.0
        steps += 1
    overhead = ((time.perf_counter() - started) - inner) / max(steps, 1) * 1e3
    # Greedy exactness: verify vs decode logits along a random sequence, default and invariant width.
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
    report = SizeReport(size, round(params, 3), decode * 1e3, r, c_d, overhead, mismatches[False], mismatches[True],
                        max_diff, positions)
    del verifier, proposer, drafter, target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return report


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
             "loop overhead ms | argmax flips default | invariant | max diff default |",
             "|---" * (9 + len(KS)) + "|"]
    for r in reports:
        lines.append(f"| {r.size} | {r.params_b} | {r.decode_ms:.2f} | " + " | ".join(f"{r.r[k]:.2f}" for k in KS)
                     + f" | {r.c_d.get(5, float('nan')):.2f} | {r.c_d.get(15, float('nan')):.2f} | {r.overhead_ms:.2f} | "
                     f"{r.exact_default}/{r.positions} | {r.exact_invariant}/{r.positions} | {r.max_diff_default:.2e} |")
    return "\n".join(lines)


def main(sizes: list[str], device: str, out: Path | None) -> int:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    reports = []
    for size in sizes:
        started = time.perf_counter()
        reports.append(check_size(size, device, dtype))
        print(f"{size}: done in {time.perf_counter() - started:.0f} s", flush=True)
    ipc = check_ipc(device)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    text = f"Device: {name}, dtype {dtype}.\n\n{table(reports)}\n\nSharing between processes: {ipc}\n"
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(text)
        (out / "gpu_check.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return 0
