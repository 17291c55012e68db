"""`blockspec rollout start | status | promote | rollback`: blue/green rollouts through a server's management port
(server.admin; services/serving/admin.py). The admin key comes from --admin-key-file or $BLOCKSPEC_ADMIN_KEY."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from blockspec.common.argtypes import address
from blockspec.common.errors import InvalidArgument

ENV_ADMIN_KEY = "BLOCKSPEC_ADMIN_KEY"
DEFAULT_ADMIN = "127.0.0.1:8002"
SETTLED = ("ready", "failed")  # a candidate's states where `start --wait` stops waiting


def add_rollout_command(sub) -> None:
    r = sub.add_parser("rollout", help="blue/green rollouts of a model version on a running server (management port)")
    r.add_argument("action", choices=("start", "status", "promote", "rollback"),
                   help="start: a new version beside the live one, checked; promote: it takes new requests; "
                        "rollback: new requests go back to the previous version")
    r.add_argument("--config", help="start: the new version's config (its model section, and server.max_batch / "
                                    "server.prefill_chunk_tokens where they change)")
    r.add_argument("--admin", type=address, default=DEFAULT_ADMIN,
                   help=f"HOST:PORT of the server's management port (default {DEFAULT_ADMIN})")
    r.add_argument("--admin-key-file", help=f"the admin key (default: ${ENV_ADMIN_KEY})")
    r.add_argument("--wait", action="store_true", help="start: wait until its checks have passed or failed")
    r.add_argument("--timeout", type=float, default=1800.0, help="--wait: seconds at most (default 1800)")
    r.add_argument("--json", action="store_true", help="the status object as JSON instead of the table")
    r.set_defaults(func=cmd_rollout)


def admin_key(path: str | None) -> str:
    if path:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgument("--admin-key-file", f"{path}: cannot read it ({e})") from None
        if not key:
            raise InvalidArgument("--admin-key-file", f"{path} is empty")
        return key
    key = os.environ.get(ENV_ADMIN_KEY, "").strip()
    if not key:
        raise InvalidArgument("--admin-key-file", f"give the admin key's file, or set ${ENV_ADMIN_KEY}")
    return key


def call(admin: str, key: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{admin}{path}", data=body, method=method,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/yaml"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise InvalidArgument("--admin", f"{admin}: no management port answers there ({reason})") from None


def cmd_rollout(args: argparse.Namespace) -> int:
    key = admin_key(args.admin_key_file)
    if args.action == "start":
        if not args.config:
            raise InvalidArgument("--config", "rollout start needs the new version's config")
        try:
            body = Path(args.config).read_bytes()
        except OSError as e:
            raise InvalidArgument("--config", f"{args.config}: cannot read it ({e.strerror or e})") from None
        code, out = call(args.admin, key, "POST", "/v1/rollout", body)
        if code == 202 and args.wait:
            code, out = _wait(args, key)
    elif args.action == "status":
        code, out = call(args.admin, key, "GET", "/v1/rollout")
    else:
        code, out = call(args.admin, key, "POST", f"/v1/rollout/{args.action}")
    if code >= 400:
        error = out.get("error", {})
        print(f"blockspec: error: rollout {args.action}: {error.get('message', out)}", file=sys.stderr)
        return 2 if code in (400, 401) else 1
    print(json.dumps(out, indent=1) if args.json else table(out))
    candidate = next((r for r in out["versions"] if r["version"] != out["active"]), None)
    return 1 if args.action == "start" and args.wait and candidate and candidate["state"] == "failed" else 0


def _wait(args: argparse.Namespace, key: str) -> tuple[int, dict]:
    """Status until the candidate's checks have settled (or it is gone)."""
    deadline = time.monotonic() + args.timeout
    while True:
        code, out = call(args.admin, key, "GET", "/v1/rollout")
        states = [r["state"] for r in out.get("versions", []) if r["version"] != out.get("active")]
        if code >= 400 or not any(s in ("starting", "checking") for s in states) or time.monotonic() > deadline:
            return code, out
        time.sleep(1.0)


def table(out: dict) -> str:
    lines = ["| version | state | replicas | streams | target | checks |", "|---|---|---|---|---|---|"]
    for r in out["versions"]:
        checks = ", ".join(f"{c['name']} {c['status']}" for c in r.get("checks", []) if c["status"] != "skip")
        state = r["state"] + (" (active)" if r["version"] == out["active"] else "")
        state += f", {r['grace_left_s']:.0f} s left" if "grace_left_s" in r else ""
        lines.append(f"| {r['version']} | {state} | {r['replicas']} | {r['streams']} | {r['target']} | {checks} |")
        if r.get("error"):
            lines.append(f"| | error: {r['error']} | | | | |")
    return "\n".join(lines)
