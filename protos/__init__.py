"""gRPC stubs for protos/*.proto, generated on first import into a cache keyed by the protos' content.

Generated code is never committed: it must match the installed protobuf runtime.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("blockspec_api.proto", "blockspec_roles.proto")


def _cache_root() -> Path:
    base = os.environ.get("BLOCKSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "blockspec")
    return Path(base) / "protos"


def generate(out_root: Path | None = None) -> Path:
    """Run protoc (grpc_tools) over the protos unless this exact content was generated before."""
    import grpc_tools
    from grpc_tools import protoc

    digest = hashlib.sha256(grpc_tools.__file__.encode())
    for name in PROTO_FILES:
        digest.update((PROTO_DIR / name).read_bytes())
    out = (out_root or _cache_root()) / digest.hexdigest()[:16]
    if (out / "blockspec_api_pb2.py").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}"]
    if protoc.main(args + [str(PROTO_DIR / n) for n in PROTO_FILES]) != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"protoc failed on {PROTO_DIR}")
    try:
        tmp.rename(out)
    except OSError:  # another process generated the same content first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _load(name: str) -> ModuleType:
    path = str(generate())
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


api_pb2 = _load("blockspec_api_pb2")
api_grpc = _load("blockspec_api_pb2_grpc")
roles_pb2 = _load("blockspec_roles_pb2")
roles_grpc = _load("blockspec_roles_pb2_grpc")
