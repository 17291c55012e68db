"""`blockspec gpu-check`: the same code path on the CPU with a tiny shape (the GPU run needs a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from blockspec.services.cli.main import main


def test_gpu_check_runs_on_cpu_with_the_tiny_shapes(tmp_path, capsys):
    """The smoke stage first, printed and written before the sizes; then the captured runner's code (uncaptured on the
    CPU) for the dense and the hybrid shape: its logits equal to the eager runner's in fp32, every column filled, the
    fixed-acceptance drafter at its tau, every stream equal to plain decoding alone."""
    from blockspec.services.bench.smoke_cases import CASES

    args = ["gpu-check", "--device", "cpu", "--sizes", "tiny,tiny-hybrid", "--backend", "graphs", "--peer",
            "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| tiny | 0.0 | graphs | " in out and "| tiny-hybrid | 0.0 | graphs | " in out and "-> ok" in out
    assert out.index("Smoke (") < out.index("| operator |") < out.index("| size |")
    assert "| logits / fp32 (error / tolerance, argmax) |" in out and out.count(" / 1e-05 ok, argmax 72/72 |") == 2
    written = (tmp_path / "gpu_check.md").read_text()
    assert written.index("| cache_attention |") < written.index("| tiny |")
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert smoke["passed"] and [c["name"] for c in smoke["cases"]] == list(CASES)
    for report in json.loads((tmp_path / "gpu_check.json").read_text()):
        logits = report["logits"]
        assert logits["runner"] == "graphs" and logits["passed"] and logits["error"] <= logits["tolerance"] == 1e-5
        assert logits["agree"] == logits["rows"] == 72 and logits["layers"] == (4 if "hybrid" in report["size"] else 2)
        assert set(report["r"]) == {"1", "3", "5", "7", "15"} and all(v > 0 for v in report["c_d"].values())
        assert report["decode_ms"] > 0 and report["floor_ms"] > 0 and report["kernels_per_decode"] is None
        assert report["tau"] == pytest.approx(3.6, abs=0.1)
        assert set(report["tokens_per_s"]) == {"plain-1", "spec-1", "plain-8", "spec-8", "peer-1"}
        assert all(v > 0 for v in report["tokens_per_s"].values())
        assert report["exact"] == dict.fromkeys(("spec-1", "plain-8", "spec-8"), 8 * report["exact_of"])
        assert set(report["numerics_ms"]) == ({"invariant-1", "fast-1", "invariant-16", "fast-16"}
                                              if report["backend"] == "graphs" else set())
        assert report["skipped"] == [] and report["overhead_ms"] > 0


def test_a_size_past_its_budget_leaves_out_its_optional_stages_and_says_which(tmp_path, capsys):
    """The logits against fp32, the step costs, the throughput and the exactness counts always run; the loop overhead,
    the numerics' cost and transformers are left out once the size's budget is spent, named under the table.
    --no-smoke leaves out the smoke stage."""
    args = ["gpu-check", "--device", "cpu", "--sizes", "tiny", "--backend", "graphs", "--peer", "--budget-s", "0.001",
            "--no-smoke", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Left out of tiny (its budget spent): loop overhead, numerics, transformers" in out
    assert "Smoke (" not in out and not (tmp_path / "smoke.json").exists()
    [report] = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["logits"]["passed"]
    assert report["skipped"] == ["loop overhead", "numerics", "transformers"]
    assert report["overhead_ms"] is None and report["numerics_ms"] == {} and report["tokens_per_s"]["peer-1"] is None
    assert report["decode_ms"] > 0 and report["exact"] == dict.fromkeys(("spec-1", "plain-8", "spec-8"),
                                                                         8 * report["exact_of"])
    with pytest.raises(SystemExit) as refused:
        main(["gpu-check", "--device", "cpu", "--sizes", "tiny", "--budget-s", "-1"])
    assert refused.value.code == 2 and "--budget-s: -1 is not a number of seconds >= 0" in capsys.readouterr().err


def test_a_size_that_fails_is_said_and_the_others_still_run(tmp_path, capsys, monkeypatch):
    from blockspec.services.bench import gpu_check

    run = gpu_check.check_size

    def flaky(size, *args, **kwargs):
        if size == "tiny":
            raise RuntimeError("no kernel image is available")
        return run(size, *args, **kwargs)

    monkeypatch.setattr(gpu_check, "check_size", flaky)
    args = ["gpu-check", "--device", "cpu", "--sizes", "tiny,tiny-hybrid", "--no-smoke", "--out", str(tmp_path)]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "Failed: tiny: RuntimeError: no kernel image is available" in out and "| tiny-hybrid |" in out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["size"] for r in report] == ["tiny-hybrid"] and report[0]["tokens_per_s"]["peer-1"] is None


def test_logits_off_the_fp32_reference_are_said_under_the_table_and_the_exit_code_is_1(capsys, monkeypatch):
    """The CUDA runner's fp32 logits differ from the eager runner's in their last bits: held to a tolerance of 0 they
    fail, the size's other stages still run."""
    from blockspec.services.bench import gpu_logits

    monkeypatch.setitem(gpu_logits.LOGITS_TOLERANCE, torch.float32, 0.0)
    args = ["gpu-check", "--device", "cpu", "--sizes", "tiny", "--backend", "graphs", "--budget-s", "0.001",
            "--no-smoke"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "Logits off the fp32 reference: tiny (error " in out and " / 0e+00 FAILED, argmax 72/72 |" in out
    assert "Failed:" not in out and "| tiny | 0.0 | graphs |" in out


def test_a_failed_smoke_case_is_said_the_sizes_still_run_and_the_exit_code_is_1(capsys, monkeypatch):
    from blockspec.services.bench import smoke_cases

    def broken(s, dtype, device):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setitem(smoke_cases.CASES, "broken", broken)
    assert main(["gpu-check", "--device", "cpu", "--sizes", "tiny", "--budget-s", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "| broken | - |" in out and "Smoke failed: broken" in out and "| tiny | 0.0 |" in out


def test_the_hybrid_reference_shape_is_qwen3_5_27b():
    from blockspec.common.models.model_config import parse_config
    from blockspec.common.runtime.footprint import parameters
    from blockspec.services.bench.gpu_sizes import hf_config

    cfg = parse_config(hf_config("27b-hybrid"), Path("."))
    assert cfg.linear_layers == tuple(i for i in range(64) if (i + 1) % 4) and cfg.rope_dim == 64
    assert round(parameters(cfg).total / 1e9, 1) == 26.9


def test_gpu_check_script_puts_the_checkout_on_the_path_where_blockspec_is_not_installed(tmp_path):
    """deploy/gpu_check.sh under an interpreter that has torch but cannot import blockspec, as a GPU
    machine's own Python (here: ours with -S, its site-packages on PYTHONPATH, so no .pth file is read)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "PYTHONPATH": sysconfig.get_paths()["purelib"], "DEVICE": "cpu",
           "SIZES": "tiny", "OUT": str(tmp_path / "out")}
    assert subprocess.run([python, "-c", "import blockspec"], env=env, capture_output=True).returncode != 0
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(["bash", "deploy/gpu_check.sh"], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| tiny |" in done.stdout and json.loads((tmp_path / "out" / "gpu_check.json").read_text())[0]["size"] == "tiny"


def test_gpu_check_runs_where_the_serving_packages_are_not_installed(tmp_path):
    """The GPU machines' image has no pydantic, OpenTelemetry, Ray, uvicorn or Starlette: deploy/gpu_check.sh runs its
    CPU size with each of them unimportable (before: the CLI's parser imported the config schema, and the step loop
    OpenTelemetry, so the check failed before it measured anything)."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pydantic', 'opentelemetry', 'ray', 'uvicorn', 'starlette'):\n"
        "            raise ImportError('not on the GPU image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n")
    env = {**os.environ, "PYTHONPATH": str(blocker), "PYTHON": sys.executable, "DEVICE": "cpu", "SIZES": "tiny",
           "PEER": "0", "OUT": str(tmp_path / "out")}
    assert subprocess.run([sys.executable, "-c", "import pydantic"], env=env, capture_output=True).returncode != 0
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(["bash", "deploy/gpu_check.sh"], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Failed" not in done.stdout, (done.stdout + done.stderr)[-2000:]
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())[0]["exact"]["spec-1"] > 0


def test_gpu_check_refuses_unknown_sizes_and_a_missing_gpu(capsys):
    assert main(["gpu-check", "--sizes", "huge"]) == 2
    assert "--sizes" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["gpu-check", "--device", "cuda", "--sizes", "tiny"]) == 2


def test_sizes_whose_weights_pass_the_free_memory_are_refused_before_anything_is_built(capsys, monkeypatch):
    """`--device cpu` with the default sizes would have built the 27B target in fp32 (108 GiB with its drafter) and been
    killed by the kernel: each size's weights are counted first, on the meta device."""
    from blockspec.services.bench import gpu_check, gpu_sizes

    assert gpu_sizes.weights_bytes("1b", torch.float32) == 2 * gpu_sizes.weights_bytes("1b", torch.bfloat16)
    monkeypatch.setattr(gpu_sizes, "free_bytes", lambda device: 8 * 2**30)
    monkeypatch.setattr(gpu_check, "check_size", lambda *a: pytest.fail("a size was built"))
    assert main(["gpu-check", "--device", "cpu", "--sizes", "tiny,8b"]) == 2
    assert capsys.readouterr().err.strip() == ("blockspec: error: --sizes: 8b needs 33.2 GiB for its weights in "
                                               "torch.float32 on cpu, which has 8.0 GiB free: choose from tiny, 1b, tiny-hybrid")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run deploy/gpu_check.sh there)")
def test_gpu_check_on_cuda_small(capsys):
    assert main(["gpu-check", "--device", "cuda", "--sizes", "tiny,1b"]) == 0
    assert "cuda_ipc: child read sum" in capsys.readouterr().out


def test_the_tensor_parallel_step_runs_two_ranks_and_says_a_single_gpu(monkeypatch):
    """The check's last step: two ranks over gloo here (two GPUs on a GPU machine), every stream equal to plain
    decoding alone at 2 ranks; a machine of one GPU is told it was skipped and why."""
    from blockspec.services.bench import gpu_check

    line = subprocess.run([sys.executable, "-c", "from blockspec.services.bench.gpu_check import check_tensor_parallel;"
                           " print(check_tensor_parallel('cpu'))"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True).stdout.strip().splitlines()[-1]
    total = 8 * gpu_check.THROUGHPUT_TOKENS
    assert line.startswith("2 ranks (LeadRunner), tau 3.") and line.count(f"{total}/{total}") == 3, line
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_check.check_tensor_parallel("cuda") == "skipped: it needs two GPUs, this machine has 1"
