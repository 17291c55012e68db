"""Where a C++ compiler is on the PATH, the CPU kernels build. Every other test of them skips where they could not be
built, so a source that stops compiling would otherwise pass as skips (once seen while editing cpu_kernels.cpp)."""

from __future__ import annotations

import os
import shutil

import pytest

from blockspec.common.kernels import cpu_kernels
from blockspec.services.drafter.dflash import cpu_block


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler here")
@pytest.mark.skipif(os.environ.get(cpu_kernels.ENV_SWITCH, "1") == "0", reason="the kernels are switched off")
def test_the_cpu_kernels_build_where_a_compiler_is():
    assert cpu_kernels.enabled(), "common/kernels/cpu_kernels.cpp did not build: the log's warning has the compiler's error"
    assert cpu_block._extension.get() is not None, "the drafter's C++ (dflash/cpu_block.cpp) did not build"


def test_the_build_key_follows_what_the_build_depends_on(monkeypatch):
    """Two environments share torch's extension cache: a kernel built for one torch installation, source or set of
    flags gets its own name, so neither rebuilds the other's; the same inputs give the same name."""
    import torch

    key = cpu_kernels.build_key("int f();")
    assert key == cpu_kernels.build_key("int f();") and len(key) == 12
    assert key != cpu_kernels.build_key("int g();")
    assert key != cpu_kernels.build_key("int f();", ("-O2",))
    monkeypatch.setattr(torch, "__file__", "/another/venv/torch/__init__.py")
    assert key != cpu_kernels.build_key("int f();")  # another environment's torch: its headers' path differs
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert key != cpu_kernels.build_key("int f();")
    assert cpu_kernels.Extension("x", "int f();", "torch").name == f"x_{cpu_kernels.build_key('int f();')}"


def test_a_lock_left_by_a_killed_build_does_not_hold_up_the_next_one(tmp_path, monkeypatch, caplog):
    """torch's build lock is a plain file: a build killed midway leaves it, and torch would wait on it forever. The
    next build (under its own flock, which no dead process holds) removes it and builds."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = cpu_kernels.Extension("stale_lock_test", "int f();", "torch")
    leftover = tmp_path / ext.name / "lock"
    leftover.parent.mkdir()
    leftover.write_text("")
    seen = []

    def load_inline(name, **kwargs):
        seen.append(leftover.exists())
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    assert ext.get() == "module" and seen == [False]
    assert "removing" in caplog.text and "left by a build that did not finish" in caplog.text
