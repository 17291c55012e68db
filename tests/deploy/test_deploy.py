"""Deployment files stay valid: compose passes `docker-compose config`, every command line they run
parses with our CLI, configs validate."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from blockspec.common.config import load_config, parse_config
from blockspec.services.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_passes_docker_compose_config():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (.ci/run installs Debian's package)")
    proc = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_compose_commands_and_config_are_valid():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert {"router", "verifier", "drafter"} <= set(compose["services"])
    for name in ("router", "verifier", "drafter"):
        build_parser().parse_args(compose["services"][name]["command"])
    assert compose["services"]["drafter"]["ipc"] == "service:verifier"  # maps the verifier's /dev/shm
    load_config(ROOT / "deploy" / "compose.config.yaml")
    load_config(ROOT / "deploy" / "config.yaml")


def test_systemd_unit_runs_a_valid_serve_command():
    unit = (ROOT / "deploy" / "systemd" / "blockspec.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert argv[0].endswith("blockspec")
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.no_ray


def test_kuberay_manifest_serves_from_its_configmap():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    serve_cmd = head["args"][0].split("&&")[-1].split()
    assert build_parser().parse_args(serve_cmd[1:]).ray_address == "auto"
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    parse_config(yaml.safe_load(configmap["data"]["config.yaml"]))
