"""Where a GPU decode's time goes, as serving decodes (the keys grow by one every step): the runner's
decode wall time (median of 30, each with its argmax read back), CUDA kernels per decode and their summed
device time (torch.profiler), under three attention set-ups: cuDNN allowed with exact key lengths (a new
shape every step), cuDNN switched off, cuDNN over key spans (the runner's CUDA default). --hf adds
transformers' own generate on the 1b shape (tiny too: the CPU smoke run).

    python decode_profile.py cuda 1b,8b,27b [--hf] > decode_profile.log

Run with blockspec importable (deploy/gpu_check.sh says how on a machine where it is not installed)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from blockspec.common.runtime.runner import Runner, Segment
from blockspec.services.bench import gpu_sizes

CONTEXT = 1024
CUDA = torch.autograd.DeviceType.CUDA


def waiter(device: str):
    """A call that waits for the device's queued work (nothing to wait for on the CPU)."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure(label: str, step, device: str) -> None:
    sync = waiter(device)
    for _ in range(5):
        step()
    times = []
    for _ in range(30):
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        sync()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == CUDA) / 5
    kernel_ms = sum(e.self_device_time_total for e in events if e.device_type == CUDA) / 5 / 1e3
    print(f"{label}: runner decode median {statistics.median(times) * 1e3:.2f} ms; per decode: {kernels:.0f} "
          f"GPU kernels, {kernel_ms:.2f} ms summed kernel time", flush=True)
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:3]:
        print(f"   cpu {e.key[:50]:50s} n={e.count / 5:6.1f}/decode self {e.self_cpu_time_total / 5 / 1e3:.3f} ms/decode")


def hf_generate_ms(size: str, prompt: list[int], device: str, dtype: torch.dtype) -> float:
    """transformers' generate on the same shape (its own random weights): ms per decoded token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = {k: v for k, v in gpu_sizes.hf_config(size).items() if k != "model_type"}
    model = Qwen3ForCausalLM(Qwen3Config(**config)).to(device, dtype).eval()
    ids, sync = torch.tensor([prompt], device=device), waiter(device)

    def seconds(new: int) -> float:
        sync()
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - started

    seconds(4)
    one = statistics.median(seconds(1) for _ in range(3))
    return (statistics.median(seconds(33) for _ in range(3)) - one) / 32 * 1e3


def main(device: str, sizes: list[str], hf: bool) -> None:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for size in sizes:
        target = gpu_sizes.random_target(size, device, dtype)
        runner = Runner(target, 1, CONTEXT + 128, dtype=dtype, device=device)
        slot = runner.cache.allocate()
        prompt = torch.randint(0, target.config.vocab_size - 1, (CONTEXT,), generator=torch.Generator().manual_seed(1)).tolist()
        runner.forward([Segment(slot, prompt, last_only=True)])
        state = {"token": 5}

        def step() -> None:
            state["token"] = int(runner.forward([Segment(slot, [state["token"]])]).logits[0][-1].argmax())

        span = runner.cache.key_step
        for label, cudnn, key_step in (("cudnn, growing keys", True, 1), ("no cudnn, growing keys", False, 1),
                                       (f"cudnn, key spans of {span}", True, span)):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            runner.cache.key_step = key_step
            measure(f"{size} [{label}]", step, device)
        torch.backends.cuda.enable_cudnn_sdp(True)
        del runner
        if hf and size in ("tiny", "1b"):
            print(f"{size}: transformers generate {hf_generate_ms(size, prompt, device, dtype):.2f} ms per decoded token")
        del target
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), "--hf" in sys.argv[3:])
