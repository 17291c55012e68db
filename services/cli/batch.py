"""`blockspec batch INPUT.jsonl OUTPUT.jsonl --http HOST:PORT | --config C`: an offline job of OpenAI batch lines
against a server's /v1 API - a running one's HTTP port, or one this command starts from a config (`serve --inprocess`
on free ports, on this machine only, stopped at the end) - resumable.

Input: one request a line, OpenAI's batch file format - `custom_id`, `method` ("POST"), `url` (`/v1/completions` or
`/v1/chat/completions`) and `body` (that endpoint's request, not streamed). Output: one line per `custom_id` in
OpenAI's batch output format - `id`, `custom_id`, `response` (`status_code`, `request_id`, `body`) and `error`.

Resumable: each finished request is appended as one whole line and flushed to disk before the next; a run reads
OUTPUT first, drops a torn last line (a kill in the middle of a write), and sends only the ids not written. Killed at
any moment (SIGKILL included) and run again with the same arguments, it ends with every id exactly once and nothing
already written generated again. A line that is not a request (bad JSON, another url, a streamed body) becomes an
error record for its id; a line without an id, or an id twice, refuses the job before anything runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from blockspec.common.argtypes import address, bounded
from blockspec.common.errors import InvalidArgument
from blockspec.common.wire.tls import http_url
from blockspec.services.cli.args import add_tls_client_args, client_tls
from blockspec.services.cli.local_server import served
from blockspec.services.cli.ports import HTTP, check_speaks

URLS = ("/v1/completions", "/v1/chat/completions")
RETRIES = 3  # attempts of a request whose connection fails, before the job stops (a rerun resumes)
# A connection that fails; http.client.HTTPException: an answer that is not HTTP/1.1 (RemoteDisconnected is one)
FAILED = (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError)


def add_batch_command(sub) -> None:
    b = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) against a server's /v1 API, resumably")
    b.add_argument("input", help="JSONL: one {custom_id, method, url, body} a line")
    b.add_argument("output", help="JSONL of OpenAI batch output lines; an existing file is resumed")
    where = b.add_mutually_exclusive_group(required=True)
    where.add_argument("--http", type=address, metavar="HOST:PORT",
                       help="a running server's HTTP port (server.port): its /v1 API")
    where.add_argument("--server", help=argparse.SUPPRESS)  # the gRPC API's everywhere else: refused, naming --http
    where.add_argument("--config", help="a server config: serve it in one process for the job (ports chosen free)")
    b.add_argument("--max-in-flight", type=bounded(1, 1024), default=16,
                   help="requests sent at once (default 16: keep the server's batch full)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    add_tls_client_args(b)
    b.set_defaults(func=cmd_batch)


@dataclass(frozen=True)
class Job:
    custom_id: str
    url: str | None  # None: the line is not a request (`problem` says why)
    body: dict | None
    problem: str | None = None


def read_jobs(path: Path) -> list[Job]:
    """The input's requests in order. Refused (naming the lines): a line without a string custom_id, an id twice."""
    jobs, missing, seen, twice = [], [], {}, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            obj, error = None, f"line {number} is not JSON: {e.msg}"
        else:
            error = None
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        if not isinstance(cid, str) or not cid:
            missing.append(number)
            continue
        if cid in seen:
            twice.append(f"{cid!r} (lines {seen[cid]} and {number})")
            continue
        seen[cid] = number
        jobs.append(_job(cid, obj, error))
    if missing:
        raise InvalidArgument("input", f"line(s) {', '.join(map(str, missing[:10]))} have no string custom_id")
    if twice:
        raise InvalidArgument("input", f"custom_id used twice: {', '.join(twice[:10])}")
    return jobs


def _job(cid: str, obj: dict, error: str | None) -> Job:
    if error is None and obj.get("method", "POST") != "POST":
        error = f"method {obj.get('method')!r}: only POST"
    if error is None and obj.get("url") not in URLS:
        error = f"url {obj.get('url')!r}: expected one of {', '.join(URLS)}"
    body = obj.get("body")
    if error is None and not isinstance(body, dict):
        error = "body: expected an object (the endpoint's request)"
    if error is None and body.get("stream"):
        error = "body.stream: a batch request is not streamed"
    return Job(cid, None, None, error) if error else Job(cid, obj["url"], body)


def written_ids(path: Path) -> set[str]:
    """The custom_ids OUTPUT already holds; a torn last line (no newline, or not JSON) is cut off the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    ids, keep = set(), 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            ids.add(json.loads(line)["custom_id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        keep += len(line)
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return ids


def record(job: Job, status: int | None, body: dict | None, error: str | None = None) -> dict:
    """One OpenAI batch output line."""
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": job.custom_id, "response": None, "error": None}
    if status is not None:
        request_id = (body or {}).get("id", "") if isinstance(body, dict) else ""
        line["response"] = {"status_code": status, "request_id": request_id, "body": body}
    if error is not None:
        line["error"] = {"code": "invalid_request", "message": error}
    return line


def post(server: str, job: Job, key: str | None, timeout: float, tls=None) -> tuple[int, dict]:
    """The server's answer (status, JSON body): an HTTP error's too. A connection that fails RETRIES times raises.
    The custom_id goes as X-Request-Id where it can (printable ASCII, 64 characters at most)."""
    headers = {"Content-Type": "application/json"}
    if len(job.custom_id) <= 64 and all(" " <= ch <= "~" for ch in job.custom_id):
        headers["X-Request-Id"] = job.custom_id
    if key:
        headers["Authorization"] = f"Bearer {key}"
    base, context = http_url(server, tls)
    request = urllib.request.Request(f"{base}{job.url}", json.dumps(job.body).encode(), headers)
    for attempt in range(RETRIES):
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read())
            except json.JSONDecodeError:
                return e.code, {"error": {"message": e.reason}}
        except FAILED:
            if attempt == RETRIES - 1:
                raise
            time.sleep(1.0 * (attempt + 1))
    raise AssertionError("unreachable")


def cmd_batch(args: argparse.Namespace) -> int:
    inp = Path(args.input)
    if args.server is not None:
        raise InvalidArgument("--server", "names a server's gRPC API (generate, bench, validate); batch sends /v1 "
                                          "requests to its HTTP port: give --http HOST:PORT")
    if args.http is not None and args.http.startswith("unix:"):
        raise InvalidArgument("--http", "the HTTP port's HOST:PORT (the /v1 API)")
    if not inp.is_file():
        raise InvalidArgument("input", f"{inp}: no such file")
    read_jobs(inp)  # refused before a server starts
    if args.config is None:
        check_speaks("--http", args.http, HTTP, client_tls(args))
        return run_batch(args, args.http)
    with served(args.config) as server:
        return run_batch(args, server.http)


def run_batch(args: argparse.Namespace, server: str) -> int:
    import sys

    from tqdm import tqdm

    inp, out = Path(args.input), Path(args.output)
    jobs = read_jobs(inp)
    done = written_ids(out)
    todo = [j for j in jobs if j.custom_id not in done]
    key = os.environ.get("BLOCKSPEC_API_KEY")
    tls = client_tls(args)
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    progress, started = Progress(), time.monotonic()
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), unit="req", disable=args.quiet)

    def write(line: dict) -> None:  # one whole line, on disk before the next request's
        os.write(fd, (json.dumps(line, ensure_ascii=False) + "\n").encode())
        os.fsync(fd)

    try:
        for job in (j for j in todo if j.url is None):  # lines that are not requests: their error records
            write(record(job, None, None, job.problem))
            bar.update(1)
        pending = [j for j in todo if j.url is not None]
        with ThreadPoolExecutor(args.max_in_flight) as pool:
            running = {}
            while pending or running:
                while pending and len(running) < args.max_in_flight:
                    job = pending.pop(0)
                    running[pool.submit(post, server, job, key, args.timeout, tls)] = job
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    job = running.pop(future)
                    try:
                        status, body = future.result()
                    except FAILED as e:
                        for f in running:
                            f.cancel()
                        bar.close()
                        print(f"blockspec: error: the server at {server}: {e}; the {bar.n} written lines stay: run the "
                              "same command again to finish", file=sys.stderr)
                        return 1
                    write(record(job, status, body))
                    if status == 200:
                        progress.add(body)
                    bar.update(1)
                    bar.set_postfix(progress.figures(time.monotonic() - started))
    finally:
        os.close(fd)
        bar.close()
    if progress.requests:
        figures = progress.figures(time.monotonic() - started)
        print(f"{progress.requests} requests, {progress.tokens} tokens in {time.monotonic() - started:.1f} s: "
              + ", ".join(f"{k} {v}" for k, v in figures.items()), file=sys.stderr)
    return 0


class Progress:
    """What this run generated: tokens and the drafts' acceptance, summed over the answers."""

    def __init__(self) -> None:
        self.requests = self.tokens = self.drafted = self.accepted = 0

    def add(self, body: dict) -> None:
        self.requests += 1
        self.tokens += (body.get("usage") or {}).get("completion_tokens", 0)
        acceptance = body.get("acceptance") or {}
        self.drafted += acceptance.get("drafted", 0)
        self.accepted += acceptance.get("accepted", 0)

    def figures(self, seconds: float) -> dict[str, str]:
        figures = {"tokens/s": f"{self.tokens / max(seconds, 1e-9):.0f}"}
        if self.drafted:
            figures["acceptance"] = f"{self.accepted / self.drafted:.2f}"
        return figures
