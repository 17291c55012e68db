"""A size's first stage in `blockspec gpu-check`, before any speed figure: the logits of the runner the size is measured
with (the CUDA runner in bf16 on a GPU) against the eager runner in fp32 on the same device, over the size's random
target cut to its first layers (a 27B target in fp32 does not fit one GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Layers kept: a dense target's first two; a hybrid's first four, three Gated DeltaNet layers and a gated attention.
LAYERS = {"dense": 2, "hybrid": 4}
PREFILL = 64  # prompt tokens, every row's logits compared
DECODES = 8  # decode steps after it, each fed the reference's greedy token
# Largest error of the runner's logits over the largest magnitude of the reference's, by the runner's dtype. bf16:
# a few layers of bf16 roundings (2^-9 of a value each) through the final norm and the LM head; fp32: both runners in
# fp32, the same arithmetic in another order.
LOGITS_TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 5e-2, torch.float32: 1e-5}


@dataclass
class LogitsCheck:
    runner: str  # the runner checked: "graphs" (the CUDA runner) or "eager"
    dtype: str
    layers: int
    error: float  # max abs error of the runner's logits over the max abs of the fp32 reference's, all rows compared
    tolerance: float
    agree: int  # rows whose greedy token (argmax) is the reference's
    rows: int  # rows compared: the prefill's, then one a decode
    passed: bool  # error within the tolerance


def check_logits(size: str, device: str, dtype: torch.dtype, backend: str = "auto") -> LogitsCheck:
    """The size's target cut to LAYERS, random weights in `dtype`: `make_runner(..., backend)` in dtype (the runner
    the size's verifier gets) against the eager runner in fp32 on fp32 copies of the same weights, over a PREFILL-token
    prompt (every row) and DECODES decodes of the reference's greedy tokens."""
    from blockspec.common.models.checkpoint import Checkpoint
    from blockspec.common.runtime.backends import make_runner
    from blockspec.common.runtime.runner import Runner, Segment
    from blockspec.services.bench.gpu_sizes import HYBRID_SIZES, random_target

    target = random_target(size, device, dtype, layers=LAYERS["hybrid" if size in HYBRID_SIZES else "dense"])
    fp32 = Checkpoint(target.path, target.config, {k: v.float() for k, v in target.weights.items()}, None)
    max_len = PREFILL + DECODES
    runner = make_runner(target, 1, max_len, dtype=dtype, device=device, backend=backend)
    reference = Runner(fp32, 1, max_len, dtype=torch.float32, device=device)
    slots = runner.cache.allocate(), reference.cache.allocate()
    prompt = torch.randint(0, target.config.vocab_size, (PREFILL,), generator=torch.Generator().manual_seed(2)).tolist()
    got, want = [], []
    tokens = prompt
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the reference's convolutions in fp32 (cuDNN's default is TF32)
    try:
        for _ in range(DECODES + 1):
            got.append(runner.forward([Segment(slots[0], tokens)]).logits[0].float())
            want.append(reference.forward([Segment(slots[1], tokens)]).logits[0])
            tokens = [int(want[-1][-1].argmax())]
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    got, want = torch.cat(got), torch.cat(want)  # [PREFILL + DECODES, vocab]
    error = float((got - want).abs().max()) / float(want.abs().max())
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    name = "graphs" if type(runner).__name__ == "CudaRunner" else "eager"
    tolerance = LOGITS_TOLERANCE[dtype]
    return LogitsCheck(name, str(dtype).removeprefix("torch."), target.config.num_layers, error, tolerance, agree,
                       len(want), error <= tolerance)


def logits_cell(check: LogitsCheck | None) -> str:
    """The table's cell: error / tolerance, ok or FAILED, greedy tokens agreeing."""
    if check is None:
        return "-"
    verdict = "ok" if check.passed else "FAILED"
    return f"{check.error:.1e} / {check.tolerance:.0e} {verdict}, argmax {check.agree}/{check.rows}"
