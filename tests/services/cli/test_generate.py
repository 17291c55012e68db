"""`blockspec generate`: the JSON contract, streaming text, and bad input -> exit code 2, nothing written."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from blockspec.services.cli.main import main
from tests.helpers import hf_greedy


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_contract(capsys, tiny_models, tokenizer):
    target = tiny_models["qwen3"]["target"]
    prompt = "def split(s):"
    code, out, _ = run_cli(capsys, "generate", prompt, "--target", str(target), "--method", "ngram", "-k", "4",
                           "--max-tokens", "40", "--json")
    assert code == 0
    obj = json.loads(out)
    assert set(obj) == {"text", "token_ids", "finish_reason", "stats"}
    assert obj["finish_reason"] in ("length", "stop")
    assert set(obj["stats"]) == {"steps", "drafted", "accepted", "tau", "acceptance_rate", "accepted_per_pos",
                                 "tokens_per_s", "elapsed_s", "ttft_s"}
    assert 0 < obj["stats"]["ttft_s"] < obj["stats"]["elapsed_s"]  # the first token comes from the prefill
    assert obj["token_ids"] == hf_greedy(target, tokenizer.encode(prompt), 40)
    assert obj["text"] == tokenizer.decode(obj["token_ids"], skip_special_tokens=True)
    stats = obj["stats"]
    assert stats["drafted"] > 0 and len(stats["accepted_per_pos"]) <= 4
    assert stats["tau"] == pytest.approx(1 + stats["accepted"] / stats["steps"], abs=1e-3)
    assert sum(stats["accepted_per_pos"]) == stats["accepted"]


def test_generate_with_prompt_lookup_equals_the_target_alone(capsys, tiny_models, tokenizer):
    dirs, prompt = tiny_models["qwen3"], "def split(s):"
    code, out, _ = run_cli(capsys, "generate", prompt, "--target", str(dirs["target"]), "--drafter", str(dirs["other"]),
                           "-k", "4", "--max-tokens", "60", "--prompt-lookup", "--json")
    assert code == 0
    obj = json.loads(out)
    assert obj["token_ids"] == hf_greedy(dirs["target"], tokenizer.encode(prompt), 60) and obj["stats"]["drafted"] > 0


def test_generate_in_bfloat16(capsys, tiny_pair):
    """--dtype bfloat16 builds the target and the dflash drafter in bf16 and generates (README, Device and dtype)."""
    code, out, _ = run_cli(capsys, "generate", "def split(s):", "--target", str(tiny_pair.target), "--drafter",
                           str(tiny_pair.drafter),
                           "-k", "5", "--max-tokens", "24", "--dtype", "bfloat16", "--invariant", "--json")
    assert code == 0
    obj = json.loads(out)
    assert obj["finish_reason"] in ("length", "stop") and obj["stats"]["drafted"] > 0


def test_generate_streams_text_then_stats(capsys, tiny_models, tokenizer):
    target = tiny_models["llama"]["target"]
    code, out, _ = run_cli(capsys, "generate", "import os", "--target", str(target), "--drafter",
                           str(tiny_models["llama"]["other"]), "--max-tokens", "30")
    assert code == 0
    expected = tokenizer.decode(hf_greedy(target, tokenizer.encode("import os"), 30), skip_special_tokens=True)
    assert out.startswith(expected)
    assert "tau" in out and "acceptance rate" in out and "accepted per position" in out and "tokens/s" in out
    assert " | TTFT " in out.splitlines()[-1] and out.rstrip().endswith(" ms")


def test_prompts_file_runs_concurrently_one_json_line_each(capsys, tiny_models, tokenizer, tmp_path):
    target = tiny_models["qwen2"]["target"]
    prompts = ["class A:", "for i in range(10):", "x = [1, 2, 3]"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    code, out, _ = run_cli(capsys, "generate", "--prompts-file", str(f), "--target", str(target), "--method",
                           "draft_model", "--drafter", str(target), "-k", "3", "--max-tokens", "24", "--json")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [o["token_ids"] for o in lines] == [hf_greedy(target, tokenizer.encode(p), 24) for p in prompts]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["", "--method", "ngram"], "prompt: must not be empty"),
        (["x " * 600, "--method", "ngram"], "do not fit the model's context"),
        (["hi", "--max-tokens", "600"], "--max-tokens: prompt"),
        (["hi", "--method", "ngram", "-k", "17"], "-k: must be between 0 (plain decoding) and 16"),
        (["hi", "--method", "none", "-k", "3"], "-k: this method drafts nothing"),
        (["hi", "--method", "ngram", "--drafter", "DRAFTER"], "--drafter: method 'ngram' takes no drafter"),
        (["hi", "--method", "draft_model"], "--drafter: method 'draft_model' needs a drafter"),
        (["hi", "--method", "draft_model", "--drafter", "/nonexistent/dir"], "/nonexistent/dir: checkpoint directory not found"),
        (["hi", "--temperature", "-1"], "--temperature: must be a number in [0.0, 100.0]"),
        (["hi", "--top-p", "0"], "--top-p: must be"),
        (["hi", "--logit-bias", "5:1"], "--logit-bias: expected TOKEN_ID=BIAS"),
        (["hi", "--logit-bias", "5=1", "--logit-bias", "5=-100"], "--logit-bias: token 5 is given twice"),
        (["hi", "--method", "ngram", "--prompt-lookup-tokens", "8"], "--prompt-lookup-tokens: goes with --prompt-lookup"),
        (["hi", "--method", "ngram", "--draft-tree", "2"], "--draft-tree: drafts a tree with method dflash only"),
        (["hi", "--logit-bias", "9999=1"], "--logit-bias: token id 9999 is outside"),
        (["hi", "--repetition-penalty", "0"], "--repetition-penalty: must be"),
        (["hi", "--method", "ngram", "--device", "tpu"], "--device: 'tpu' is not a device; use cpu, cuda or cuda:N"),
        (["hi", "--method", "ngram", "--stop", ""], "--stop: stop sequences must not be empty"),
        (["hi", "--method", "ngram", *["--stop", "x"] * 65], "--stop: at most 64 stop sequences"),
        (["hi", "--method", "ngram", "--max-model-len", "99999"], "--max-model-len: 99999 exceeds the model's context of"),
        (["\udcff", "--method", "ngram"], "prompt: not UTF-8 text (character 0)"),  # byte 0xff, as argv brings it
        (["hi", "--method", "ngram", "--stop", "a\udcff"], "--stop: not UTF-8 text (character 1)"),
        *([] if torch.cuda.is_available() else
          [(["hi", "--method", "ngram", "--device", "cuda"], "--device: 'cuda': CUDA is not available on this machine")]),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(capsys, tiny_models, extra, message):
    dirs = tiny_models["qwen3"]
    argv = ["generate", *[str(dirs["other"]) if a == "DRAFTER" else a for a in extra], "--target", str(dirs["target"])]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert message in err


def test_unknown_method_and_missing_target_exit_2(tiny_models):
    target = str(tiny_models["qwen3"]["target"])
    for argv in (["generate", "hi", "--target", target, "--method", "magic"], ["generate", "hi", "--target", "/no/such/dir"]):
        proc = subprocess.run([sys.executable, "-m", "blockspec.services.cli", *argv], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stdout == ""
        assert "magic" in proc.stderr or "/no/such/dir: checkpoint directory not found" in proc.stderr


def test_sampling_flags_strict_seed_and_stop(capsys, tiny_pair):
    """--rule strict --seed: the same text with and without speculation; --stop ends the text before it."""
    common = ["generate", "    def fill(self, text):", "--target", str(tiny_pair.target), "--max-tokens", "48",
              "--temperature", "0.9", "--top-k", "50", "--seed", "11", "--rule", "strict", "--json"]
    outs = [json.loads(run_cli(capsys, *common, *extra)[1]) for extra in
            (["--method", "none"], ["--drafter", str(tiny_pair.drafter), "-k", "6"], ["--method", "ngram"])]
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"]
    other_seed = json.loads(run_cli(capsys, *common[:-5], "--seed", "12", "--rule", "strict", "--json")[1])
    assert other_seed["token_ids"] != outs[0]["token_ids"]
    text = outs[0]["text"]
    stop = text[10:13]
    code, out, _ = run_cli(capsys, *common, "--method", "none", "--stop", stop)
    stopped = json.loads(out)
    assert code == 0 and stopped["finish_reason"] == "stop_sequence" and stopped["text"] == text[: text.find(stop)]


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_a_stop_sequence_in_the_last_step_ends_the_text(capsys, tiny_models, tokenizer, max_tokens):
    """--stop where the stop sequence completes with the request's last token (the step that finished it): the text
    ends before it and the finish reason is stop_sequence (this once crashed: the request was already gone)."""
    target = tiny_models["qwen3"]["target"]
    texts = {p: tokenizer.decode(hf_greedy(target, tokenizer.encode(p), max_tokens), skip_special_tokens=True)
             for p in ("def f(x):", "class A:", "import os", "x = 1", "return")}
    n = min(max_tokens, 2)  # the stop's characters: the last token's, or the last two
    prompt, text = next((p, t) for p, t in texts.items() if t[-n:].strip() and t.find(t[-n:]) == len(t) - n)
    stop = text[-n:]
    code, out, err = run_cli(capsys, "generate", prompt, "--target", str(target), "--method", "ngram", "--max-tokens",
                             str(max_tokens), "--stop", stop, "--json")
    result = json.loads(out)
    assert code == 0 and result["finish_reason"] == "stop_sequence" and result["text"] == text[: text.find(stop)]


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "hi", "--max-batch", "0"], "argument --max-batch: 0 is out of range: 1..1024"),
    (["generate", "hi", "--max-model-len", "-3"], "argument --max-model-len: -3 is out of range: at least 16"),
    (["generate", "hi", "--prompt-lookup-tokens", "0"], "argument --prompt-lookup-tokens: 0 is out of range: 1..48"),
    (["generate", "hi", "--server", "h:1", "--timeout", "nan"], "argument --timeout: nan is not a time in seconds > 0"),
    (["serve", "--config", "c.yaml", "--port", "70000"], "argument --port: 70000 is not a port: 0..65535"),
    (["serve", "--config", "c.yaml", "--grpc-port", "-1"], "argument --grpc-port: -1 is not a port"),
    (["role", "verifier", "--target", "t", "--method", "none", "--port", "65536"], "argument --port: 65536 is not a port"),
    (["check-invariance", "--target", "t", "--text-file", "f", "-k", "0"], "argument -k: 0 is out of range: at least 1"),
    (["check-invariance", "--target", "t", "--text-file", "f", "--sequences", "0"], "argument --sequences: 0 is out"),
    # Values the gRPC API's fields cannot hold (a traceback from the protobuf with --server), threads OpenMP cannot make
    (["generate", "hi", "--server", "h:1", "--max-tokens", "-1"], "argument --max-tokens: -1 is out of range: 1..4294967295"),
    (["generate", "hi", "--server", "h:1", "-k", "-1"], "argument -k: -1 is out of range"),
    (["generate", "hi", "--server", "h:1", "--top-k", "99999999999"], "argument --top-k: 99999999999 is out of range"),
    (["generate", "hi", "--server", "h:1", "--seed", "-1"], "argument --seed: -1 is out of range: 0..18446744073709551615"),
    (["generate", "hi", "--server", "h:1", "--no-repeat-ngram-size", "-2"], "argument --no-repeat-ngram-size: -2 is out"),
    (["generate", "hi", "--threads", "100000"], "argument --threads: 100000 is out of range: 1..256"),
    (["generate", "hi", "--draft-tree", "2,0"], "argument --draft-tree: '2,0' is not a draft tree"),
    (["generate", "hi", "--draft-tree", "3,x"], "argument --draft-tree: '3,x' is not a draft tree"),
    (["bench", "--threads", "0"], "argument --threads: 0 is out of range: 1..256"),
    (["build-default", "--threads", "0"], "argument --threads: 0 is out of range"),
    (["build-default", "--minutes", "-1"], "argument --minutes: -1 is not a time in minutes > 0"),
    (["build-assistant", "--steps", "0"], "argument --steps: 0 is out of range: at least 1"),  # was: the default 4,000
    *[(["train-drafter", "--target", "t", "--out", "o", "--text-file", "f", flag, value], f"argument {flag}: {value} is out")
      for flag, value in (("--prompts", "0"), ("--prompt-len", "0"), ("--steps", "0"), ("--block-size", "1"),
                          ("--layers", "0"), ("--seed", "-1"), ("--new-tokens", "0"), ("--kl-top-k", "0"),
                          ("--selector-top-k", "129"), ("--sampling-top-k", "129"), ("--sampling-top-k", "0"))],
    # An address whose port gRPC would wrap (99999 -> 34463), or none at all
    (["generate", "hi", "--server", "127.0.0.1:99999"], "argument --server: '127.0.0.1:99999' is not HOST:PORT"),
    (["bench", "--server", ""], "argument --server: '' is not HOST:PORT"),
    (["serve", "--config", "c.yaml", "--verifier-address", "v"], "argument --verifier-address: 'v' is not HOST:PORT"),
])
def test_flags_out_of_range_are_refused_before_anything_runs(capsys, argv, message):
    """Before: --port 70000 a traceback (HTTP) or a wrapped port (gRPC: 4464), --max-model-len -3 a traceback,
    --prompt-lookup-tokens 1000 and check-invariance -k 5000 ran."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_prompts_file_that_is_not_utf8_exits_2(capsys, tiny_models, tmp_path):
    (tmp_path / "p.txt").write_bytes(b"def f():\n\xff\xfe\n")
    code, out, err = run_cli(capsys, "generate", "--prompts-file", str(tmp_path / "p.txt"), "--target",
                             str(tiny_models["qwen3"]["target"]))
    assert code == 2 and out == "" and "--prompts-file: " in err and "not UTF-8 text (byte 9)" in err


def test_bench_refuses_bad_counts(capsys):
    for flag, value in (("--num-prompts", "0"), ("--num-prompts", "-3")):
        code, out, err = run_cli(capsys, "bench", flag, value, "--modes", "none", "--concurrency", "1")
        assert code == 2 and f"{flag}: must be at least 1, got {value}" in err


def test_serve_refuses_flags_that_do_not_go_together(capsys):
    config = str(Path(__file__).resolve().parents[3] / "deploy" / "config.yaml")
    for extra, message in ((["--no-ray", "--ray-address", "auto"], "--ray-address: serves on Ray"),
                           (["--drafter-address", "h:1"], "--drafter-address: goes with --verifier-address"),
                           (["--ray-address", "127.0.0.1:1"], "--ray-address: 127.0.0.1:1: no Ray cluster answers there")):
        code, out, err = run_cli(capsys, "serve", "--config", config, *extra)
        assert code == 2 and message in err
    code, out, err = run_cli(capsys, "serve", "--config", config, "--ray-address", "garbage")  # Ray's ValueError
    assert code == 1 and "--ray-address garbage: cannot join the Ray cluster: Invalid address format" in err


def test_bad_files_and_places_are_one_line_naming_them(capsys, tmp_path, tiny_models):
    """A prompts file nested past Python's recursion limit, a card or config that is not what build-default writes,
    train-drafter's --out on a file (found before the training, not after it)."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 200_000 + "\n")
    code, _, err = run_cli(capsys, "generate", "--prompts-file", str(deep), "--target", "t")
    assert code == 2 and "--prompts-file: " in err and "nests too deep" in err
    for name, content, message in (("card.json", "{}", "not a card build-default writes (KeyError: 'target_parameters')"),
                                   ("card.json", "[1]", "expected a JSON object, got list"),
                                   ("card.json", "\udcff", "not readable JSON"),
                                   ("config.json", '{"a":', "not readable JSON")):
        pair = tmp_path / f"pair-{name}-{len(content)}"
        pair.mkdir()
        (pair / name).write_bytes(content.encode("utf-8", "surrogateescape"))
        code, _, err = run_cli(capsys, "info", str(pair))
        assert code == 2 and err.startswith(f"blockspec: error: path: {pair / name}: ") and message in err, err
    code, _, err = run_cli(capsys, "train-drafter", "--target", str(tiny_models["qwen3"]["target"]),
                           "--out", str(deep), "--text-file", str(deep))
    assert code == 2 and f"--out: cannot make directory '{deep}'" in err
    code, _, err = run_cli(capsys, "train-drafter", "--target", "t", "--out", str(tmp_path / "o"), "--text-file", "f",
                           "--selector-only")
    assert code == 2 and "--selector-only: trains the path selector of a drafter: give it --init-from" in err
    code, _, err = run_cli(capsys, "train-drafter", "--target", "t", "--out", str(tmp_path / "o"), "--text-file", "f",
                           "--selector-top-k", "32", "--sampling-top-k", "16")
    assert code == 2 and "--sampling-top-k: 16 is under --selector-top-k 32" in err


def test_a_role_refuses_a_method_without_its_drafter_and_an_address_it_cannot_bind(tiny_models, capsys):
    target = str(tiny_models["qwen3"]["target"])
    # Refused before the role loads or serves anything: in this process.
    for argv, message in ((["verifier", "--method", "dflash"], "--drafter: method 'dflash' needs a drafter"),
                          (["drafter", "--method", "none"], "--method: a drafter role with method 'none' would")):
        code, out, err = run_cli(capsys, "role", argv[0], "--target", target, *argv[1:])
        assert code == 2 and out == "" and err.startswith(f"blockspec: error: {message}"), err
    # Once loaded, an address it cannot bind: one line, exit 1 (a process of its own, as serve starts it).
    proc = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "role", "verifier", "--target", target,
                           "--method", "none", "--host", "192.0.2.1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("blockspec: error: "), proc.stderr
    assert "cannot bind 192.0.2.1:0 (Cannot assign requested address)" in proc.stderr


@pytest.fixture(scope="module")
def ports():
    """A port that speaks HTTP/1.1 (as the server's /health, /metrics and /v1 port), one that speaks gRPC (HTTP/2, as
    its API's port, with no service) and one where nothing listens."""
    import grpc

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:  # quiet: the test reads stderr
            pass

    class Web(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:  # gRPC's preface, the probe's closed socket
            pass

    web = Web(("127.0.0.1", 0), Health)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    api = grpc.server(ThreadPoolExecutor(1))
    grpc_port = api.add_insecure_port("127.0.0.1:0")
    api.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    yield {"http": f"127.0.0.1:{web.server_port}", "grpc": f"127.0.0.1:{grpc_port}", "closed": f"127.0.0.1:{closed}"}
    web.shutdown()
    api.stop(None)


def test_the_other_protocols_port_is_refused_in_one_line_naming_the_flag(capsys, ports, tmp_path):
    """--server takes the gRPC port everywhere, --http the HTTP port: given the other one, each command says so in one
    line, exit code 2 (generate and bench said UNAVAILABLE with gRPC's parse error, exit 1; validate --http at the gRPC
    port was an http.client BadStatusLine traceback). A port where nothing listens is still gRPC's error, exit 1."""
    from blockspec.services.cli.ports import GRPC, HTTP, speaks

    assert (speaks(ports["http"]), speaks(ports["grpc"]), speaks(ports["closed"])) == (HTTP, GRPC, None)
    (tmp_path / "p.txt").write_text("def f(x):\n")
    at_http = (f"--server: {ports['http']} speaks HTTP, not gRPC: --server takes the server's gRPC port; the HTTP port "
               "(server.port, default 8000) goes to --http of batch and validate")
    at_grpc = (f"--http: {ports['grpc']} speaks gRPC, not HTTP: --http takes the server's HTTP port; the gRPC port "
               "(server.grpc_port, default 8001) goes to --server of generate, bench and validate")
    for argv, message in ((["generate", "hi", "--server", ports["http"]], at_http),
                          (["bench", "--server", ports["http"], "--prompts-file", str(tmp_path / "p.txt"), "--out",
                            str(tmp_path / "bench")], at_http),
                          (["validate", "--server", ports["http"], "--prompts-file", str(tmp_path / "p.txt")], at_http),
                          (["validate", "--server", ports["grpc"], "--http", ports["grpc"], "--prompts-file",
                            str(tmp_path / "p.txt")], at_grpc)):
        code, out, err = run_cli(capsys, *argv)
        assert (code, out, err) == (2, "", f"blockspec: error: {message}\n"), argv
    code, out, err = run_cli(capsys, "generate", "hi", "--server", ports["closed"])
    assert code == 1 and err.startswith(f"blockspec: error: server {ports['closed']}: UNAVAILABLE: ")
