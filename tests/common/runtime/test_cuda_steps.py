"""What a captured step launches on CUDA, counted on the CPU: the step runs with its operators' CUDA launchers (Triton
replaced by counters, so no kernel runs and no GPU is needed) under a dispatch mode that counts every other torch
operation as one launch (views and allocations: none). Per layer: <= 10 a dense or attention layer, <= 14 a Gated
DeltaNet layer; the rollback of every slot and layer is one launch; the recurrence is one launch for any width."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockspec.common.kernels import gpu_kernels as gk
from blockspec.common.kernels import triton_deltanet as td
from blockspec.common.kernels import triton_kernels as tk
from blockspec.common.kernels import triton_rows as tr
from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.runtime.cuda_runner import CudaRunner
from blockspec.common.runtime.runner import Segment
from blockspec.services.training.tiny import build_tiny_checkpoint, build_tiny_family

# each operator's CUDA launcher, called with the operator's own arguments
LAUNCHERS = {
    "linear": tk.triton_linear, "linear_parts": tk.triton_linear_parts, "cache_attention": tk.triton_attention,
    "add_rms_norm": tr.triton_add_rms_norm, "attention_inputs": tr.triton_attention_inputs,
    "silu_mul": tr.triton_silu_mul, "gated_rms_norm": tr.triton_gated_rms_norm, "causal_conv": td.triton_causal_conv,
    "delta_gates": td.triton_delta_gates, "gated_delta_rule": td.triton_gated_delta_rule,
    "rollback_states": td.triton_rollback, "moe": tk.triton_moe,
}
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
        "detach", "detach_", "alias", "_reshape_alias"}


class Launches(TorchDispatchMode):
    """Counts launches: each Triton kernel (its name), each torch operation that is neither a view nor an allocation
    ("torch.<op>"). `marks` maps a weight to a label: a product with it starts a new group of `groups`."""

    def __init__(self, marks: dict[int, str] | None = None) -> None:
        super().__init__()
        self.marks, self.groups, self.current = marks or {}, [], Counter()
        self.groups.append(("start", self.current))

    def kernel(self, name: str) -> None:
        self.current[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "blockspec":
            name = func._opname
            if name in ("linear", "linear_parts") and id(args[1]) in self.marks:
                self.current = Counter()
                self.groups.append((self.marks[id(args[1])], self.current))
            with self:
                return LAUNCHERS[name](*args, **kwargs)
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if not view and func._opname not in FREE:
            self.current[f"torch.{func._opname}"] += 1
        return func(*args, **kwargs)


class _Kernel:
    def __init__(self, counter: list[Launches], name: str) -> None:
        self.counter, self.name = counter, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.counter[0].kernel(self.name)


@pytest.fixture
def counting(monkeypatch):
    """Triton's kernels replaced by counters; yields a function that runs fn under a `Launches` mode."""
    active: list[Launches] = [None]
    fake_triton = SimpleNamespace(cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    names = {tk: {"_products": ("gemm", "sum_splits", "grouped_gemm"), "_attention": ("attend", "combine")},
             tr: {"_rows": ("add_norm", "norm_rope", "silu_mul", "gated_norm")},
             td: {"_deltanet": ("conv", "gates", "delta_rule", "rollback")}}
    for module, groups in names.items():
        for group, kernels in groups.items():
            space = SimpleNamespace(triton=fake_triton, **{k: _Kernel(active, k) for k in kernels})
            monkeypatch.setattr(module, group, lambda space=space: space)
    monkeypatch.setattr(tr, "triton_dtype", lambda dtype: None)

    def run(fn, marks=None) -> Launches:
        active[0] = Launches(marks)
        with torch.inference_mode(), active[0]:
            fn()
        return active[0]

    return run


def layer_marks(runner: CudaRunner) -> dict[int, str]:
    """Each layer's first product weight -> "dense 3" / "attention 3" / "deltanet 3"; the LM head -> "head"."""
    marks = {id(runner.step.lm_head): "head"}
    for i, layer in enumerate(runner.step.layers):
        if runner.config.hybrid:
            mixer = layer[1]
            marks[id(mixer[2])] = f"{'deltanet' if mixer[0] == 'linear' else 'attention'} {i}"
        else:
            marks[id(layer[1])] = f"dense {i}"
    return marks


def per_layer(launches: Launches) -> dict[str, int]:
    return {label: sum(c.values()) for label, c in launches.groups if label not in ("start", "head")}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, tokenizer):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "qwen3", "qwen3", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tokenizer):
    return build_tiny_family(tmp_path_factory.mktemp("hybrid") / "qwen3_5", "qwen3_5", tokenizer=tokenizer)


def decode_and_verify(runner: CudaRunner, width: int):
    """The captured step of a forward of three requests of `width` tokens (its bucket's inputs set by one forward,
    outside the count; the host-device copies around a replay are not kernels)."""
    slots = [runner.cache.allocate() for _ in range(3)]
    runner.forward([Segment(s, list(range(5, 25)), last_only=True) for s in slots])
    runner.forward([Segment(s, list(range(7, 7 + width))) for s in slots])
    bucket = runner._bucket(runner.bucket_of(3, width))
    return lambda: runner.step(*bucket.args())


@pytest.mark.parametrize("width", [1, 16])
def test_a_dense_layer_is_at_most_ten_launches(width, dense_dir, counting):
    runner = CudaRunner(load_checkpoint(dense_dir), 4, 64, (), torch.float32, "cpu", warm_up=False)
    launches = counting(decode_and_verify(runner, width), layer_marks(runner))
    counts = per_layer(launches)
    assert len(counts) == runner.config.num_layers and max(counts.values()) <= 10, launches.groups
    assert all(c["sum_splits"] == 0 for label, c in launches.groups if label != "head")  # sums ride on consumers
    # the step's total: the layers, the embedding and first norm, the LM head and the greedy decision
    assert sum(sum(c.values()) for _, c in launches.groups) <= 10 * runner.config.num_layers + 12, launches.groups


@pytest.mark.parametrize("width", [1, 16])
def test_a_gated_deltanet_layer_is_at_most_fourteen_launches(width, hybrid_dir, counting):
    runner = CudaRunner(load_checkpoint(hybrid_dir), 4, 64, (), torch.float32, "cpu", warm_up=False)
    launches = counting(decode_and_verify(runner, width), layer_marks(runner))
    counts = per_layer(launches)
    assert {label.split()[0] for label in counts} == {"deltanet", "attention"}
    for label, n in counts.items():
        assert n <= (14 if label.startswith("deltanet") else 10), (label, launches.groups)
    deltanet = next(c for label, c in launches.groups if label.startswith("deltanet"))
    assert deltanet["delta_rule"] == 1 and deltanet["conv"] == 1  # one recurrence launch whatever the width


def test_the_rollback_of_every_slot_and_layer_is_one_launch(hybrid_dir, counting):
    """Three slots each verified and rolled back to a different length: one launch at the next forward for all of
    them and every Gated DeltaNet layer, no host loop over slots or layers."""
    runner = CudaRunner(load_checkpoint(hybrid_dir), 4, 64, (), torch.float32, "cpu", warm_up=False)
    decode_and_verify(runner, 8)
    for slot, keep in zip(range(3), (1, 4, 6)):
        runner.cache.set_length(slot, 20 + keep)
    launches = counting(runner.cache.states.flush)
    assert launches.current == Counter({"rollback": 1}), launches.current


def test_the_recurrence_is_one_launch_for_any_width(counting):
    """A prefill of 300 tokens through the recurrence kernel: one launch, no host loop over blocks of tokens."""
    B, T, HK, HV, D = 1, 300, 2, 4, 16
    C = 2 * HK * D + HV * D
    rec, both, gates = torch.zeros(2, 2, HV, D, D), torch.zeros(B, T, 2, C), torch.zeros(B, T, 2, HV)
    slots = reads = torch.zeros(1, dtype=torch.long)
    launches = counting(lambda: gk.gated_delta_rule(rec, slots, reads, both, gates, HK, 0.25))
    assert launches.current == Counter({"delta_rule": 1})


def test_the_products_are_chosen_by_a_row_invariance_probe(dense_dir, monkeypatch):
    """gemm "auto" on CUDA probes torch's products at the step's weight shapes and every bucket's row count: cuBLAS
    where they are row-invariant, else the Triton GEMM (the probe itself: tests/common/kernels/test_gemm_choice.py).
    Off CUDA the references run; a GEMM named is taken; another name is refused."""
    from blockspec.common.kernels import gemm_choice
    from blockspec.common.runtime import cuda_runner

    runner = CudaRunner(load_checkpoint(dense_dir), 4, 64, (), torch.float32, "cpu", warm_up=False)
    assert runner.gemm == "triton" and not gk.GEMM.cublas
    probed = {}

    def probe(shapes, device, rows):
        probed.update(shapes=shapes, rows=rows)
        return gemm_choice.GemmChoice(answer, tuple(shapes), tuple(rows), None, 0.0)

    monkeypatch.setattr(gemm_choice, "choose_gemm", probe)
    try:
        for answer in ("cublas", "triton"):
            assert cuda_runner.choose_gemm(runner.step, "auto", torch.device("cuda"), (1, 2, 4)) == answer
            assert gk.GEMM.cublas == (answer == "cublas")
        cfg = runner.config
        assert (cfg.intermediate_size * 2, cfg.hidden_size) in probed["shapes"]  # the merged gate/up weight
        assert (cfg.vocab_size, cfg.hidden_size) in probed["shapes"] and {1, 64, 512} <= set(probed["rows"])
        assert cuda_runner.choose_gemm(runner.step, "cublas", torch.device("cuda"), (1,)) == "cublas"
        with pytest.raises(ValueError, match="gemm 'fastest': choose from auto, triton, cublas"):
            cuda_runner.choose_gemm(runner.step, "fastest", torch.device("cuda"), (1,))
    finally:
        gk.use_cublas(False)
