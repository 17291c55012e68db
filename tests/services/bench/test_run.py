"""`blockspec bench`: every mode side by side, exactness against plain decoding, the cost model, outputs."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.common.errors import InvalidArgument
from blockspec.services.bench.modes import Mode, parse_modes
from blockspec.services.bench.run import workload
from blockspec.services.cli.main import main


def test_modes_parse_and_bad_ones_name_the_flag():
    assert parse_modes("none, dflash:5,hf-lookup:3,ngram:4:adaptive,dflash:7:replay") == [
        Mode("none"), Mode("dflash", 5), Mode("hf-lookup", 3), Mode("ngram", 4, adaptive=True), Mode("dflash", 7, replay=True)]
    assert Mode("dflash", 7, replay=True).label == "dflash replay k=7"
    assert parse_modes("dflash:7:lookup,dflash:5:lookup:adaptive,draft_model:3:replay:lookup") == [
        Mode("dflash", 7, lookup=True), Mode("dflash", 5, adaptive=True, lookup=True),
        Mode("draft_model", 3, replay=True, lookup=True)]
    assert Mode("dflash", 5, adaptive=True, lookup=True).label == "dflash lookup adaptive k=5"
    assert parse_modes("dflash:7:lookup16") == [Mode("dflash", 7, lookup=True, lookup_tokens=16)]
    assert Mode("dflash", 7, lookup=True, lookup_tokens=16).label == "dflash lookup16 k=7"
    assert parse_modes("dflash:5:tree3,dflash:4:tree2x2x1") == [Mode("dflash", 5, tree=(3,)),
                                                               Mode("dflash", 4, tree=(2, 2, 1))]
    assert Mode("dflash", 4, tree=(2, 2)).label == "dflash tree2x2 k=4"
    for bad in ("magic:3", "dflash", "ngram:x", "hf-lookup:3:adaptive", "dflash:3:fast", "hf-lookup:3:replay", "none:1:replay",
                "ngram:5:lookup", "none:1:lookup", "dflash:7:lookup:lookup", "dflash:7:adaptive:replay", "hf-lookup:3:lookup",
                "dflash:7:lookup0", "dflash:7:lookupx", "dflash:7:lookup16:adaptive", "dflash:7:lookup:lookup16",
                "dflash:7:lookup\u00b2", "dflash:\u0663", "dflash:7:lookup49", "dflash:5:tree0", "dflash:5:tree2x",
                "ngram:5:tree2", "dflash:5:tree2:adaptive", "dflash:5:tree2:tree3"):  # a superscript, an Arabic-Indic 3, > 48
        with pytest.raises(InvalidArgument) as e:
            parse_modes(bad)
        assert e.value.field == "--modes"


def test_a_pass_keeps_every_stream_busy_over_several_waves():
    prompts = [[1], [2], [3]]
    assert workload(prompts, 1, 3) == prompts  # enough prompts: each once, in order
    assert workload(prompts, 1, 4) == [[1], [2], [3], [1]]
    assert workload(prompts, 2, 4) == [[1], [2], [3], [1], [2], [3], [1], [2]]  # cycled to 4 x 2 requests
    assert workload(prompts, 16, 1) == [prompts[i % 3] for i in range(16)]


def test_bench_on_the_tiny_pair_writes_report_json_and_plots(tiny_pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def wrap(self, text):\\n"\n"class TextWrapper:\\n    "\n')
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_pair.target), "--drafter", str(tiny_pair.drafter), "--prompts-file",
                 str(prompts), "--max-tokens", "24", "--modes", "ngram:3,dflash:3,dflash:3:adaptive,dflash:3:replay,hf,hf-lookup:3",
                 "--concurrency", "1,2", "--request-rates", "40", "--max-concurrency", "2",
                 "--out", str(out), "--threads", "1", "--rounds", "2", "--waves", "2"]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["waves"] == 2 and "max(2, 2 c) requests" in (out / "bench.md").read_text()
    rows = {(r["mode"], r["k"], r["concurrency"]) for r in result["rows"]}
    assert {("none", 0, 1), ("none", 0, 2), ("dflash", 3, 2), ("hf", 0, 1), ("hf-lookup", 3, 1)} <= rows
    assert all(r["exact"] for r in result["rows"] + result["rate_rows"]), "every mode must reproduce plain decoding"
    # Open loop: the engine modes (not transformers') at 40 requests/s, at most 2 in flight, TTFT from arrival.
    assert {(r["mode"], r["request_rate"], r["concurrency"]) for r in result["rate_rows"]} == {
        (m, 40.0, 2) for m in ("none", "ngram", "dflash", "dflash adaptive", "dflash replay")}
    assert all(0 < r["ttft_ms"] <= r["ttft_p99_ms"] and len(r["rounds"]) == 2 for r in result["rate_rows"])
    assert all(r["request_rate"] is None for r in result["rows"]) and result["request_rates"] == [40.0]
    assert "| dflash k=3 | 40 | 2 |" in (out / "bench.md").read_text()
    assert (out / "latency_by_rate.png").stat().st_size > 10_000  # TPOT and TTFT p99 against the rate
    assert all(len(r["rounds"]) == 2 and r["tokens_per_s"] in r["rounds"] for r in result["rows"])
    dflash = next(r for r in result["rows"] if r["mode"] == "dflash" and r["concurrency"] == 1)
    assert dflash["tau"] > 1 and sum(dflash["accepted_per_pos"]) > 0
    step, verify, draft = dflash["step_ms"]  # the loop's own split of a step at concurrency 1
    assert 0 < verify and 0 < draft and verify + draft < step
    plain_split = next(r for r in result["rows"] if r["mode"] == "none" and r["concurrency"] == 1)
    assert len(plain_split["step_ms"]) == 3 and plain_split["acceptance_rate"] is None  # split, nothing drafted
    assert all(not r["step_ms"] for r in result["rows"] if r["concurrency"] == 2 or r["mode"].startswith("hf"))
    assert result["costs"]["r"]["3"] > 0 and result["costs"]["c_d"]["3"] > 0
    report = (out / "bench.md").read_text()
    # The machine line names the CPU's vector extension (the kernels' speed depends on it).
    assert f"({torch.backends.cpu.get_cpu_capability()})" in result["machine"] and result["machine"] in report
    assert result["machine"].endswith("models on the CPU in float32")  # --device, --dtype
    # ... and the pair where the dflash drafter's proposals run (its weights' format moves its cost).
    assert result["drafter_kernel"].startswith(("C++ (", "the torch module")) and result["drafter_kernel"] in report
    assert "ceiling tau / r(k+1)" in report and "| dflash k=3 | 2 |" in report and "Inside the step loop" in report
    # The spread of the passes, and each round's share of the ceiling (against the same round's plain pass)
    cells = next(line for line in report.splitlines() if line.startswith("| dflash k=3 | 1 |")).split(" | ")
    low, high = map(float, cells[3].split("-"))
    assert low == pytest.approx(min(dflash["rounds"]), abs=0.5) and high == pytest.approx(max(dflash["rounds"]), abs=0.5)
    ceiling_table = report.split("ceiling tau / r(k+1)")[1].split("Inside the step loop")[0].splitlines()

    def ceiling_row(label: str) -> list[str]:
        return next(line for line in ceiling_table if line.startswith(f"| {label} | ")).strip(" |").split(" | ")

    # The cost model was timed in one slice after each round at concurrency 1; r is the slices' median, and each
    # round's share uses its own slice.
    r_slices = result["costs"]["r_slices"]["3"]
    assert len(r_slices) == 2 and result["costs"]["r"]["3"] == pytest.approx(sorted(r_slices)[0] / 2 + sorted(r_slices)[1] / 2)
    assert "one after each round of the concurrency-1 passes" in report and "median of 2 slices" in report
    plain = next(r for r in result["rows"] if r["mode"] == "none" and r["concurrency"] == 1)
    per_round = [a / b / (dflash["tau"] / r) for a, b, r in zip(dflash["rounds"], plain["rounds"], r_slices)]
    shares = [float(x) for x in ceiling_row("dflash k=3")[-3].split("-")]
    assert shares == pytest.approx([min(per_round), max(per_round)], abs=0.006)
    # Latency: TTFT (from admission) and TPOT (decode time per token after the first) for engine rows, none for
    # transformers'; the decode phase's share of the ceiling uses TPOT, the prefill left out as the ceiling leaves it.
    engine_rows = [r for r in result["rows"] if not r["mode"].startswith("hf")]
    assert all(0 < r["ttft_ms"] and 0 < r["tpot_ms"] and len(r["tpot_rounds"]) == 2 for r in engine_rows)
    assert all(r["ttft_ms"] <= r["ttft_p99_ms"] and 0 < r["tpot_p99_ms"] for r in engine_rows)
    assert all(r["ttft_ms"] is r["ttft_p99_ms"] is r["tpot_p99_ms"] is None for r in result["rows"] if r["mode"].startswith("hf"))
    assert cells[5:8] == [f"{dflash['ttft_ms']:.2f} / {dflash['ttft_p99_ms']:.2f}",
                          f"{dflash['tpot_ms']:.3f} / {dflash['tpot_p99_ms']:.3f}",
                          f"{dflash['itl_ms']:.3f} / {dflash['itl_p99_ms']:.3f}"]  # p50 / p99, all / p99, p50 / p99
    # ITL: the gaps between a stream's chunks (test_chunk_gaps_...); transformers' rows stream nothing
    assert all(0 < r["itl_ms"] <= r["itl_p99_ms"] for r in engine_rows)
    assert all(r["itl_ms"] is r["itl_p99_ms"] is None for r in result["rows"] if r["mode"].startswith("hf"))
    assert dflash["tpot_ms"] * (24 - 1) < dflash["elapsed_s"] * 1e3  # per request, less than its share of the pass
    decode_speedup = plain["tpot_ms"] / dflash["tpot_ms"]
    cell, decode_spread = ceiling_row("dflash k=3")[-1].split(" (")
    assert float(ceiling_row("dflash k=3")[-2]) == pytest.approx(decode_speedup, abs=0.006)
    assert float(cell) == pytest.approx(decode_speedup / (dflash["tau"] / result["costs"]["r"]["3"]), abs=0.006)
    decode_rounds = [b / a / (dflash["tau"] / r) for a, b, r in zip(dflash["tpot_rounds"], plain["tpot_rounds"], r_slices)]
    assert [float(x) for x in decode_spread.rstrip(")").split("-")] == pytest.approx(
        [min(decode_rounds), max(decode_rounds)], abs=0.006)
    # The loop's own split: the part of a step in the verify, and that against plain decoding's (both within a pass).
    split_row = next(line for line in report.splitlines() if line.startswith("| dflash k=3 | ") and line.count("|") == 8)
    fraction, against_plain = map(float, split_row.strip(" |").split(" | ")[-2:])
    assert fraction == pytest.approx(verify / step, abs=0.006)
    assert against_plain == pytest.approx(verify / step / (plain["step_ms"][1] / plain["step_ms"][0]), abs=0.006)
    # Replayed drafts: the same drafts, so the same output and acceptance, with no drafter call in the step.
    for c in (1, 2):
        live, replayed = (next(r for r in result["rows"] if r["mode"] == m and r["k"] == 3 and r["concurrency"] == c)
                          for m in ("dflash", "dflash replay"))
        assert replayed["exact"] and replayed["accepted_per_pos"] == live["accepted_per_pos"]
        assert (replayed["tau"], replayed["steps"]) == (live["tau"], live["steps"])
    # (That no drafter runs is ReplayProposer's own test: a timer's few microseconds are no proof on a shared core.)
    assert replayed["step_ms"] == [] and len(next(r for r in result["rows"] if r["mode"] == "dflash replay")["step_ms"]) == 3
    replay_ceiling = ceiling_row("dflash replay k=3")
    assert replay_ceiling[2] == "0.00" and replay_ceiling[4] == replay_ceiling[5]  # c_d 0: with the drafter = the ceiling
    for png in ("tokens_per_s.png", "acceptance_per_position.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out


def test_latency_gives_the_median_the_whole_and_the_99th_percentile():
    """TTFT: the median request's and the 99th percentile (numpy's linear one, as vLLM's serving benchmark); TPOT:
    all decode time over all tokens after the first, and the 99th percentile of each request's own (a request with
    a single token has no decode)."""
    from blockspec.services.bench.latency import latency

    got = latency([0.001, 0.002, 0.003, 0.010], [(0.1, 100), (0.3, 100), (0.0, 0)], [0.004] * 99 + [0.104])
    assert got == pytest.approx({"ttft_ms": 2.5, "ttft_p99_ms": 9.79, "tpot_ms": 2.0, "tpot_p99_ms": 2.98,
                                 "itl_ms": 4.0, "itl_p99_ms": 5.0})
    assert latency([], []) == {"ttft_ms": None, "ttft_p99_ms": None, "tpot_ms": None, "tpot_p99_ms": None,
                               "itl_ms": None, "itl_p99_ms": None}


def test_chunk_gaps_are_per_stream_and_count_only_chunks_with_tokens():
    """ITL as vLLM's serving benchmark takes it: the gaps between consecutive chunks of one stream (not between
    two streams' chunks, nor before a stream's first); a step loop's finish events and empty chunks are no chunk."""
    from blockspec.services.bench.latency import ChunkGaps
    from blockspec.services.router.step_loop import FinishEvent, RequestStats, TokenEvent

    chunks = ChunkGaps()
    for stream, at in (("a", 1.0), ("b", 1.5), ("a", 3.0), ("b", 4.0), ("a", 3.5)):
        chunks.saw(stream, at)
    assert chunks.gaps == [2.0, 2.5, 0.5]
    events = ChunkGaps()
    events.saw_events([TokenEvent("a", (1, 2)), TokenEvent("b", ()), FinishEvent("a", "stop", (1, 2), RequestStats())])
    events.saw_events([TokenEvent("a", (3,)), TokenEvent("b", (4,))])
    assert len(events.gaps) == 1 and events.gaps[0] > 0  # a's second chunk; b's first


def test_accepted_per_position_sums_lists_of_any_length():
    """Per position over the requests; a request that ended at its first token (two of the default pair's held-out
    prompts do: an end-of-sequence token) brings an empty list, which once crashed `bench --server`."""
    from blockspec.services.bench.run import accepted_per_position

    assert accepted_per_position([[3, 2, 1], [], [1]]).tolist() == [4, 2, 1]
    assert accepted_per_position([[], []], k=3).tolist() == [0, 0, 0]
    assert accepted_per_position([]).tolist() == []


def test_the_cost_model_times_each_target_forward_after_a_decode():
    """Every target forward right after a decode (a decode follows a decode in plain decoding), a proposal right
    after a verify of its width (as in the step loop)."""
    from blockspec.services.bench import costs as bench_costs

    events = []

    class Verifier:
        def roll_back(self, ids):
            pass

        def committed(self, rid):
            return [1, 2, 3]

        def verify(self, inputs):
            events.append(("verify", len(inputs[0].draft.token_ids) + 1))

    class Proposer:
        max_k, fallbacks = 7, 0

        def propose(self, inputs):
            events.append(("propose", inputs[0].k))

    decode, r, c_d = bench_costs.cost_ratios(Verifier(), Proposer(), "x", [3, 5], repeats=3)
    assert decode > 0 and set(r) == set(c_d) == {3, 5}
    # The target's forwards, each after its setup (an untimed round, then 3 timed ones), then the proposals.
    forwards = [("verify", 1), ("verify", 1), ("verify", 1), ("verify", 4), ("verify", 1), ("verify", 6)]
    proposals = [("verify", 4), ("propose", 3), ("verify", 6), ("propose", 5)]
    assert events == forwards * 4 + proposals * 4


@pytest.mark.parametrize("rule", ["strict", "rejection"])
def test_bench_samples_every_request_and_compares_outputs_where_the_rule_fixes_them(tiny_pair, tmp_path, rule):
    """`bench --temperature`: every mode decodes the same seeded requests (request i seeded SEED + i). Under strict the
    engine modes must reproduce plain decoding's sampled text; under rejection, and for transformers' own sampler,
    `exact` is unknown."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def wrap(self, text):\\n"\n"class TextWrapper:\\n    "\n')
    out = tmp_path / "out"
    assert main(["bench", "--target", str(tiny_pair.target), "--drafter", str(tiny_pair.drafter), "--prompts-file",
                 str(prompts), "--max-tokens", "12", "--modes", "dflash:3,hf", "--concurrency", "1", "--out", str(out),
                 "--threads", "1", "--rounds", "1", "--waves", "1", "--temperature", "1.0", "--top-k", "40",
                 "--rule", rule, "--seed", "3"]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["sampling"] | {"temperature": 1.0, "top_k": 40, "rule": rule, "seed": 3} == result["sampling"]
    exact = {r["mode"]: r["exact"] for r in result["rows"]}
    assert exact == ({"none": True, "dflash": True, "hf": None} if rule == "strict" else
                     {"none": None, "dflash": None, "hf": None})
    assert f"sampled at temperature 1 (top-k 40, top-p 1), rule `{rule}`" in (out / "bench.md").read_text()
    dflash = next(r for r in result["rows"] if r["mode"] == "dflash")
    assert dflash["acceptance_rate"] is not None and dflash["tokens"] > 0


def test_bench_flags_are_checked(capsys, tmp_path):
    assert main(["bench", "--concurrency", "0,2"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err
    assert main(["bench", "--waves", "0"]) == 2
    assert "--waves" in capsys.readouterr().err
    assert main(["bench", "--device", "tpu"]) == 2 and "--device: 'tpu' is not a device" in capsys.readouterr().err
    for bad in ("0", "fast", "5,-1", "inf"):
        assert main(["bench", "--request-rates", bad]) == 2 and "--request-rates" in capsys.readouterr().err
    # 64 requests a pass (16 prompts, 4 waves of 16): 0.01 / s would arrive over about 1.8 hours
    assert main(["bench", "--request-rates", "10,0.01", "--out", str(tmp_path / "rates")]) == 2
    err = capsys.readouterr().err
    assert "--request-rates: at 0.01 requests/s the 64 requests of a pass would arrive over" in err
    assert "past the 3600 s allowed: at least 0.0182 requests/s" in err  # refused before any model loads
    assert main(["bench", "--request-rates", "5", "--max-concurrency", "0"]) == 2
    assert "--max-concurrency" in capsys.readouterr().err
    for flag, value in (("--concurrency", "1,1"), ("--request-rates", "5,5.0")):
        assert main(["bench", flag, value]) == 2 and f"{flag}: each value once" in capsys.readouterr().err
    assert main(["bench", "--temperature", "-1"]) == 2 and "--temperature: must be" in capsys.readouterr().err
    assert main(["bench", "--top-p", "1.5"]) == 2 and "--top-p" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "--max-tokens", "0"])
    assert e.value.code == 2 and "--max-tokens: 0 is out of range: at least 1" in capsys.readouterr().err


def test_an_out_that_cannot_be_a_directory_is_refused_before_the_run(capsys, tmp_path):
    taken = tmp_path / "a file"
    taken.write_text("")
    for out in (taken, taken / "under"):
        assert main(["bench", "--modes", "none", "--concurrency", "1", "--out", str(out)]) == 2
        assert f"--out: cannot make directory '{out}'" in capsys.readouterr().err
    assert main(["bench", "--server", "127.0.0.1:1", "--out", str(taken)]) == 2  # before connecting: nothing runs
    assert "--out: " in capsys.readouterr().err


def test_lengths_past_the_context_name_the_flag_and_the_room_left(tiny_pair, capsys):
    from blockspec.services.bench.run import check_lengths, model_context

    context = model_context(tiny_pair.target)
    check_lengths(tiny_pair.target, [[5] * 10, [6] * 4], context - 10)  # exactly full: fine
    with pytest.raises(InvalidArgument) as e:
        check_lengths(tiny_pair.target, [[5] * 10, [6] * 4], context - 9)
    assert e.value.field == "--max-tokens" and f"at most {context - 10}" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        check_lengths(tiny_pair.target, [[5] * context], 1)
    assert e.value.field == "--prompts-file"


def test_a_k_past_the_method_s_largest_names_the_mode(tiny_pair):
    from blockspec.services.bench.run import engine_runner

    with pytest.raises(InvalidArgument) as e:
        engine_runner(tiny_pair.target, tiny_pair.drafter, Mode("dflash", 99), [[5, 6, 7]], 8, 1)
    assert e.value.field == "--modes" and e.value.message.startswith("dflash k=99: ")


def test_arrivals_are_a_seeded_poisson_process():
    from blockspec.services.bench.rate import arrival_times

    times = arrival_times(20000, 50.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps) and times == arrival_times(20000, 50.0)  # every mode's
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.03)  # mean gap 1 / rate
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.02 * 0.693, rel=0.05)  # exponential: median ln 2 / rate
    assert arrival_times(3, 50.0, seed=1) != times[:3] and arrival_times(1, 2.0) == [0.0]


def test_open_loop_submits_at_arrival_and_counts_ttft_from_it(tiny_pair):
    """One slot: the second request arrives with the first and waits for its slot, its TTFT counting the wait; the
    third arrives after both finished, the loop idles until then, and its TTFT is its own prefill."""
    from blockspec.services.bench.run import _engine_run
    from blockspec.services.engine.engine import Engine

    engine = Engine(tiny_pair.target, None, "none", max_batch=1)
    elapsed, done, ttft, gaps = _engine_run(engine, [[5, 6, 7], [8, 9, 10], [11, 12, 13]], 8, None, [0.0, 0.0, 1.0])
    assert [e.request_id for e in done] == ["0", "1", "2"] and all(len(e.token_ids) == 8 for e in done)
    a, b, c = (e.stats for e in done)
    assert elapsed >= 1.0 and b.started + b.elapsed_s <= c.started  # the first two were done before the third arrived
    assert b.started + b.queued_s >= a.started + a.elapsed_s  # admitted once the first had finished
    assert ttft[1] >= b.queued_s > 0  # the wait for the slot is in its TTFT
    assert 0 < ttft[2] < 0.9  # the third's is its own prefill, not the second it arrived after the pass began
    # Plain decoding streams a token a chunk: 7 gaps a request, each its own stream's (none spans the idle second)
    assert len(gaps) == 3 * 7 and 0 < max(gaps) < 0.9


def test_a_row_that_drafted_nothing_has_no_ceiling(tiny_pair, tmp_path, capsys):
    """max_tokens 2: the one step after the prefill has no room for a draft, so its steps were decodes."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def wrap(self, text):\\n"\n')
    assert main(["bench", "--target", str(tiny_pair.target), "--drafter", str(tiny_pair.drafter), "--prompts-file",
                 str(prompts), "--max-tokens", "2", "--modes", "dflash:3", "--concurrency", "1", "--rounds", "1",
                 "--out", str(tmp_path / "out")]) == 0
    report = (tmp_path / "out" / "bench.md").read_text()
    assert "No dflash row at concurrency 1 drafted at a fixed k: no ceiling to compare with." in report
    assert "| mode | r(k+1) |" not in report  # no table of one row with r(4), c_d and a share of the ceiling above 1
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["rows"][1]["acceptance_rate"] is None
    capsys.readouterr()


def test_a_server_stream_without_its_finish_message_is_one_line(monkeypatch, tmp_path, capsys):
    """A stream the server closes cleanly before its finish message breaks the API's contract: `bench --server` says
    so in one line, exit code 1 (it was an AttributeError traceback). A fake stub stands for the server."""
    from blockspec.protos import api_grpc, api_pb2

    class Truncating:
        def __init__(self, channel) -> None:
            pass

        def Tokenize(self, request, timeout=None):
            return api_pb2.TokenizeResponse(token_ids=[5, 6, 7])

        def Generate(self, request, timeout=None):
            yield api_pb2.GenerateResponse(token_ids=[8, 9])  # then the stream ends: no finish

    monkeypatch.setattr(api_grpc, "GenerationStub", Truncating)
    code = main(["bench", "--server", "127.0.0.1:1", "--server-k", "0", "--num-prompts", "1", "--rounds", "1",
                 "--concurrency", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == ("blockspec: error: server 127.0.0.1:1: a stream ended after 2 tokens without "
                                         "its finish message"), err
