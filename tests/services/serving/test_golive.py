"""`blockspec validate`: the go-live checks against real servers of the shipped pair - passing on a healthy one,
failing and naming the check on one whose drafter is down (ratio) and against a reference serving another target
(identity)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from blockspec.services.serving.golive import ACCEPTANCE_ALERT, CHECKS, check_tokenizer, first_difference, role_memory
from tests.helpers import CONFIG, RouterThread, http_status, role_pids, spawn_serve, stop_serve, wait_for

ROOT = Path(__file__).resolve().parents[3]
PAIR = ROOT / "models" / "base"
shipped = pytest.mark.skipif(not (PAIR / "card.json").is_file(), reason="models/base is not built (build-default)")
# A line no speculating server misses, however loaded the machine (the shipped pair measures about 2.7x on a quiet
# one, 1.4x beside a full test run): these tests check the pass and the failure, not the speed;
# test_the_ratio_check_holds_the_line_and_fails_a_server_that_drafts_nothing checks the comparison.
MIN_RATIO = "0.2"


def validate(capsys, *args: str) -> tuple[int, dict, str]:
    """`blockspec validate ARGS --json` -> (exit code, the JSON object, stderr)."""
    from blockspec.services.cli.main import main

    capsys.readouterr()
    code = main(["validate", *args, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def health(port: int) -> str:
    """/health's body, a 503's too."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        return e.read().decode()


def statuses(result: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in result["checks"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shipped pair, roles as processes, its drafter a copy (the last test breaks it)."""
    root = tmp_path_factory.mktemp("validate")
    drafter = root / "drafter"
    shutil.copytree(PAIR / "drafter", drafter)
    cfg = root / "config.yaml"
    cfg.write_text(CONFIG.format(target=PAIR / "target", drafter=drafter))
    log = root / "serve.log"
    with log.open("w") as stderr:
        info = spawn_serve("--config", str(cfg), "--no-ray", stderr=stderr)
    assert wait_for(lambda: http_status(info["http"]) == 200)
    info.update(drafter=drafter, root=root, where=["--server", f"127.0.0.1:{info['grpc']}", "--http",
                                                   f"127.0.0.1:{info['http']}"])
    yield info
    stop_serve(info)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[str]:
    """The flags of a short run: the four held-out prompts the shipped drafter does best on (acceptance 0.6-0.85
    at k = 5, against 0.2-0.5 for the first four), 64 tokens each."""
    lines = (PAIR / "heldout_prompts.jsonl").read_text().splitlines()
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(lines[i] + "\n" for i in (7, 8, 10, 12)))
    return ["--prompts-file", str(path), "--max-tokens", "64", "--min-ratio", MIN_RATIO]


@shipped
@pytest.mark.e2e
def test_a_healthy_server_passes_and_a_reference_with_another_target_fails_identity(server, run, capsys):
    code, result, err = validate(capsys, *server["where"], *run)
    assert code == 0 and err == "" and result["passed"], (err, result["checks"])
    assert list(statuses(result)) == list(CHECKS)
    assert statuses(result) == {"ready": "pass", "identity": "pass", "ratio": "pass", "acceptance": "pass",
                                "latency": "info", "memory": "info", "tokenizer": "skip"}, result["checks"]
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["identity"]["figures"]["tokens"] == 4 * 64
    assert checks["ratio"]["figures"]["ratio"] >= float(MIN_RATIO) and checks["ratio"]["figures"]["k"] == 5
    assert checks["memory"]["figures"]["0"]["verifier"]["rss"] > 0 and checks["memory"]["figures"]["0"]["drafter"]
    assert "the drafter unix:" in checks["tokenizer"]["detail"]  # the split router names its drafter by address

    # Plain decoding by a reference serving another target of the same tokenizer (the shipped assistant): identity
    # fails, naming the prompt and the token.
    from blockspec.services.engine.engine import Engine

    other = RouterThread(Engine(PAIR / "assistant", None, "none", max_batch=1))
    reference = f"127.0.0.1:{other.router.port}"
    try:
        code, result, err = validate(capsys, *server["where"], *run, "--rounds", "1", "--reference", reference)
    finally:
        other.close()
    assert code == 1 and statuses(result)["identity"] == "fail", result["checks"]
    assert re.search(r"^blockspec: validate: identity failed: pass 1, prompt 0, token \d+: \[\d+\] at k=5, "
                     rf"\[\d+\] from plain decoding \({reference}\)$", err, re.MULTILINE), err


@shipped
@pytest.mark.e2e
def test_a_server_whose_drafter_is_down_fails_the_ratio_check(server, run, capsys):
    """The drafter's role killed and its checkpoint gone, so its restart fails: requests are served at k = 0, output
    unchanged. validate names ratio and acceptance; identity still holds; ready reports /health, which says why."""
    server["drafter"].rename(server["root"] / "moved")
    (pid,) = role_pids(server["proc"], "role drafter")
    os.kill(pid, signal.SIGKILL)
    # From here to the restart that fails and each retry's, requests step at k = 0.
    assert wait_for(lambda: "drafter not answering" in health(server["http"]))
    code, result, err = validate(capsys, *server["where"], *run, "--rounds", "1")
    assert code == 1 and not result["passed"], result["checks"]
    ready = result["checks"][0]
    assert "drafter not answering" in ready["detail"]
    assert ready["status"] == ("pass" if "/health 200 " in ready["detail"] else "fail")  # as a load balancer sees it
    assert statuses(result) == {"ready": ready["status"], "identity": "pass", "ratio": "fail", "acceptance": "fail",
                                "latency": "info", "memory": "info", "tokenizer": "skip"}, result["checks"]
    failed = {line.split(" failed: ")[0].removeprefix("blockspec: validate: "): line
              for line in err.strip().splitlines()}
    assert set(failed) == {"ratio", "acceptance"} | ({"ready"} if ready["status"] == "fail" else set()), err
    assert failed["ratio"].endswith(f"(at least {float(MIN_RATIO):.2f}x); nothing drafted (k fell back to 0)"), err
    assert failed["acceptance"].endswith("nothing drafted at k=5 (the alert line: 0.25)"), err


@shipped
def test_the_tokenizer_check_reads_the_checkpoints_modelinfo_names(tokenizer, tmp_path):
    """The start-up checks again: the shipped dflash drafter works on the target's ids through its draft vocabulary;
    a draft model of another tokenizer is named."""
    from blockspec.services.training.tiny import build_tiny_checkpoint

    texts = [json.loads(line) for line in (PAIR / "heldout_prompts.jsonl").read_text().splitlines()[:2]]
    info = SimpleNamespace(target=str(PAIR / "target"), drafter=str(PAIR / "drafter"), method="dflash", vocab_size=4096)
    check = check_tokenizer(info, texts, None)
    assert check.status == "pass", check
    assert check.detail == ("vocabulary sizes equal; dflash drafter on the target's embedding and LM head, a draft "
                            "vocabulary of 2048 of its 4096 ids")
    other = build_tiny_checkpoint(tmp_path / "other", tokenizer=tokenizer)  # the tests' 320-token tokenizer
    check = check_tokenizer(SimpleNamespace(**{**vars(info), "drafter": str(other), "method": "draft_model"}), texts,
                            None)
    assert check.status == "fail" and "drafter tokenizer differs from the target's" in check.detail, check
    check = check_tokenizer(SimpleNamespace(**{**vars(info), "vocab_size": 320}), texts, [[1]] * len(texts))
    assert check.status == "fail" and check.detail.startswith("the server's vocabulary 320, the target's 4096; 2 "
                                                              "prompts tokenize differently on the server"), check


def test_the_ratio_check_holds_the_line_and_fails_a_server_that_drafts_nothing():
    from blockspec.services.bench.modes import Row
    from blockspec.services.serving.golive import Passes, check_ratio

    def passes(k: int, speedup: float, acceptance: float | None) -> Passes:
        spec = Row("server", k, 1, 64, 1.0, 64.0 * speedup, acceptance_rate=acceptance, speedup=speedup)
        return Passes(k, spec, Row("server", 0, 1, 64, 1.0, 64.0), [], [])

    assert check_ratio(passes(5, 2.8, 0.6), 2.7).status == "pass"
    low = check_ratio(passes(5, 2.6, 0.6), 2.7)
    assert low.status == "fail" and low.detail.endswith("2.60x (at least 2.70x)"), low.detail
    assert low.figures["ratio"] == 2.6 and low.figures["min_ratio"] == 2.7
    # Nothing drafted fails even where noise put the ratio over the line.
    fell_back = check_ratio(passes(5, 1.1, None), 1.0)
    assert fell_back.status == "fail" and fell_back.detail.endswith("; nothing drafted (k fell back to 0)")
    assert check_ratio(passes(0, 1.0, None), 0.5).detail.endswith("; the server's default k is 0")


def test_the_acceptance_line_is_the_alert_rules():
    """--min-acceptance's default is BlockspecAcceptanceLow's floor in the shipped alert rules."""
    rules = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    floor = re.search(r"num_draft_tokens_total\[10m\]\)\) < ([0-9.]+)", rules)
    assert floor and float(floor.group(1)) == ACCEPTANCE_ALERT


def test_first_difference_names_the_prompt_and_the_token():
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_difference([[1, 2], [3, 5]], [[1, 2], [3, 4]]) == (1, 1)
    assert first_difference([[1, 2], [3]], [[1, 2], [3, 4]]) == (1, 1)  # ended early
    assert first_difference([[9, 2], [3]], [[1, 2], [3, 4]]) == (0, 0)


def test_role_memory_reads_the_gauges_of_metrics():
    text = ('# TYPE blockspec_role_memory_bytes gauge\n'
            'blockspec_role_memory_bytes{kind="rss",replica="0",role="verifier"} 3.0e+08\n'
            'blockspec_role_memory_bytes{kind="gpu",replica="0",role="verifier"} 0.0\n'
            'blockspec_role_memory_bytes{kind="rss",replica="1",role="drafter"} 1.5e+08\n'
            '# TYPE blockspec_requests_running gauge\nblockspec_requests_running{replica="0"} 1.0\n')
    assert role_memory(text) == {"0": {"verifier": {"rss": 3e8, "gpu": 0.0}}, "1": {"drafter": {"rss": 1.5e8}}}


def test_flags_that_do_not_go_together_are_refused(capsys):
    from blockspec.services.cli.main import main

    assert main(["validate", "--config", "c.yaml", "--http", "127.0.0.1:8000"]) == 2
    assert "blockspec: error: --http: goes with --server" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["validate", "--server", "127.0.0.1:8001", "--min-acceptance", "1.5"])
    assert "argument --min-acceptance: 1.5 is not a share in (0, 1]" in capsys.readouterr().err


def test_a_server_that_does_not_answer_fails_ready_and_skips_the_rest(tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("def f(x):\n")
    code, result, err = validate(capsys, "--server", "127.0.0.1:1", "--prompts-file", str(tmp_path / "prompts.txt"))
    assert code == 1 and statuses(result) == {"ready": "fail", **{name: "skip" for name in CHECKS[1:]}}
    assert err.startswith("blockspec: validate: ready failed: gRPC 127.0.0.1:1: UNAVAILABLE")


@shipped
@pytest.mark.slow
def test_the_shipped_config_passes(monkeypatch, capsys):
    """`validate --config deploy/config.yaml` with every default: the shipped pair served in one process, 16 held-out
    prompts x 128 tokens, ratio at least 2.7 (a quiet machine: nothing else running)."""
    monkeypatch.chdir(ROOT)  # the config's model paths
    code, result, err = validate(capsys, "--config", "deploy/config.yaml")
    assert code == 0 and result["passed"], (result, err)
    assert all(status in ("pass", "info") for status in statuses(result).values()), result
