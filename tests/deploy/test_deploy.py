"""Deployment files stay valid: compose passes `docker-compose config`, every command line they run
parses with our CLI, configs validate."""

from __future__ import annotations

import copy
import functools
import json
import posixpath
import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from blockspec.common.config import load_config, parse_config
from blockspec.services.cli.main import build_parser
from blockspec.services.serving.rollout import Fleet

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_passes_docker_compose_config():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (.ci/run installs Debian's package)")
    proc = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True, check=False)
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



# KubeRay (deploy/kuberay): checked offline, as YAML and against blockspec's own parser and config schema.

KUBERAY = ROOT / "deploy" / "kuberay"
SEPARATORS = {"&&", "||", "&", ";", "|"}
_parser = functools.cache(build_parser)


@functools.cache
def _parsed(name: str) -> tuple[dict, ...]:
    return tuple(yaml.safe_load_all((KUBERAY / name).read_text()))


def _docs(name: str) -> list[dict]:
    """The file's YAML documents, a copy each call (a test may change its own)."""
    return copy.deepcopy(list(_parsed(name)))


def _rayservice() -> dict:
    return next(d for d in _docs("rayservice.yaml") if d["kind"] == "RayService")


def _services() -> list[dict]:
    return [d for name in ("rayservice.yaml", "bluegreen.yaml") for d in _docs(name) if d["kind"] == "Service"]


def _head(rayservice: dict) -> dict:
    return rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]


def _workers(rayservice: dict) -> list[dict]:
    return [g["template"] for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]]


def _containers(rayservice: dict) -> list[dict]:
    return [c for t in (_head(rayservice), *_workers(rayservice)) for c in t["spec"]["containers"]]


def _labels(template: dict) -> dict[str, str]:
    return template.get("metadata", {}).get("labels", {})


def _container_port(template: dict, target: int | str) -> int:
    """The head container's port that a Service's targetPort (a number or a port's name) reaches."""
    ports = template["spec"]["containers"][0]["ports"]
    return next(p["containerPort"] for p in ports if target in (p["containerPort"], p.get("name")))


def _mounted(template: dict, path: str) -> tuple[dict, dict]:
    """(the volume, the head container's mount) that holds the file `path`: a mount of its directory."""
    mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"]
                 if m["mountPath"] == posixpath.dirname(path))
    return next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"]), mount


def _configmap_data() -> dict[str, str]:
    return next(d for d in _docs("rayservice.yaml") if d["kind"] == "ConfigMap")["data"]


def _configmap_file(path: str) -> str:
    """The text of the ConfigMap key that the head pod reads as `path`."""
    volume, _ = _mounted(_head(_rayservice()), path)
    assert volume["configMap"]["name"] == "blockspec-config", path
    return _configmap_data()[posixpath.basename(path)]


def _live_config():
    return parse_config(yaml.safe_load(_configmap_data()["config.yaml"]))


def _rollout_config(text: str):
    """The config `rollout start` runs for `text`: the server's own merge over the live config (Fleet.parse reads
    nothing else of the fleet)."""
    return Fleet.parse(SimpleNamespace(active=SimpleNamespace(cfg=_live_config())), text)


def _blockspec_argv(line: str) -> list[str] | None:
    """The arguments of the `blockspec` invocation in a shell line, up to the next `&&`, `;`, `&` or `|`."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    if "blockspec" not in words:
        return None
    rest = words[words.index("blockspec") + 1 :]
    return rest[: next((i for i, w in enumerate(rest) if w in SEPARATORS), len(rest))]


def _commented_commands(name: str, word: str) -> list[str]:
    """The shell lines in a file's comments that contain `word`, `\\`-continued lines joined."""
    text = (KUBERAY / name).read_text()
    comments = "\n".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    return [line for line in comments.replace("\\\n", " ").splitlines() if word in line]


def _green() -> dict:
    """The green RayService, made by bluegreen.yaml's own `sed` line."""
    if shutil.which("sed") is None:
        pytest.skip("sed not installed")
    (command,) = _commented_commands("bluegreen.yaml", "sed -e")
    argv = shlex.split(command.split(" | kubectl apply")[0])
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (green,) = [d for d in yaml.safe_load_all(out) if d]
    return green


def test_kuberay_yaml_documents_parse():
    for path in sorted(KUBERAY.glob("*.yaml")):
        docs = _docs(path.name)
        assert docs, path
        for doc in docs:
            assert isinstance(doc, dict) and doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path


def test_kuberay_manifest_serves_from_its_configmap():
    argvs = [_blockspec_argv(" ".join(c.get("command", []) + c.get("args", []))) for c in _containers(_rayservice())]
    parsed = [_parser().parse_args(argv) for argv in argvs if argv is not None]
    assert [a.command for a in parsed] == ["serve"]  # the head's; the workers run what KubeRay gives them
    assert parsed[0].ray_address == "auto"
    _configmap_file(parsed[0].config)
    assert _live_config().server.admin is not None


def test_next_version_is_a_new_version_of_the_live_one():
    live, nxt = _live_config(), _rollout_config(_configmap_data()["next-version.yaml"])
    assert nxt.version != live.version  # the server refuses a version name that already runs
    assert nxt.model.device == live.model.device  # the model section is replaced whole: device is not inherited


def test_manifest_rollout_commands_parse_and_use_the_mounted_files():
    admin = _live_config().server.admin
    argvs = [_blockspec_argv(line) for line in _commented_commands("rayservice.yaml", "-- blockspec rollout")]
    parsed = [_parser().parse_args(argv) for argv in argvs if argv is not None]
    assert len(parsed) == len(argvs)
    assert {"start", "promote", "rollback"} <= {a.action for a in parsed}
    for args in parsed:
        assert args.admin_key_file == admin.key_file
        assert int(args.admin.rsplit(":", 1)[1]) == admin.port  # run in the head pod: its own management port
        if args.action == "start":
            _rollout_config(_configmap_file(args.config))


def test_admin_port_stays_inside_the_cluster():
    head_group = _rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head_group.get("serviceType", "ClusterIP") == "ClusterIP"  # KubeRay's head Service carries every port
    (admin,) = [s["spec"] for s in _services() if s["metadata"]["name"] == "blockspec-admin"]
    assert admin.get("type", "ClusterIP") == "ClusterIP"
    assert not any("nodePort" in p for p in admin["ports"])
    assert not {"externalIPs", "loadBalancerIP", "externalName"} & set(admin)


def test_services_select_the_head_pod_and_reach_its_ports():
    rayservice, cfg = _rayservice(), _live_config()
    head = _head(rayservice)
    expected = {"blockspec": {cfg.server.port, cfg.server.grpc_port}, "blockspec-admin": {cfg.server.admin.port}}
    services = _services()
    assert {s["metadata"]["name"] for s in services} == set(expected)
    for service in services:
        selector = service["spec"]["selector"].items()
        assert selector and selector <= _labels(head).items(), service["metadata"]["name"]
        assert not any(selector <= _labels(w).items() for w in _workers(rayservice))
        ports = {_container_port(head, p.get("targetPort", p["port"])) for p in service["spec"]["ports"]}
        assert ports == expected[service["metadata"]["name"]]


def test_admin_key_secret_is_mounted_where_the_config_reads_it():
    key_file = _live_config().server.admin.key_file
    volume, mount = _mounted(_head(_rayservice()), key_file)
    assert volume["secret"]["secretName"] == "blockspec-admin-key" and mount.get("readOnly")
    assert posixpath.basename(key_file) in [item["path"] for item in volume["secret"].get("items", [])]


def test_green_is_blue_renamed_relabelled_on_a_new_image():
    green, blue = _green(), _rayservice()
    assert green["metadata"]["name"] == "blockspec-green"
    assert _labels(_head(green))["blockspec.io/color"] == "green"
    images = [c["image"] for c in _containers(blue)]
    assert all(c["image"] != image for c, image in zip(_containers(green), images, strict=True))
    green["metadata"]["name"] = blue["metadata"]["name"]  # nothing else differs: no hand-kept copy
    _head(green)["metadata"]["labels"] = _labels(_head(blue))
    for c, image in zip(_containers(green), images, strict=True):
        c["image"] = image
    assert green == blue


def test_switch_patches_select_the_green_head():
    patches = [shlex.split(line) for line in _commented_commands("bluegreen.yaml", "kubectl patch service")]
    patched = {argv[3]: json.loads(argv[5])["spec"]["selector"] for argv in patches}
    assert set(patched) == {s["metadata"]["name"] for s in _services()}  # the admin Service follows too
    green_head = _labels(_head(_green()))
    for service in _services():
        selector = {**service["spec"]["selector"], **patched[service["metadata"]["name"]]}  # a merge patch
        assert selector.items() <= green_head.items(), service["metadata"]["name"]
