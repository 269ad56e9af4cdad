"""The benchmark harness pieces: the table writer, the stream and record measurements, the
async harness on a real Redis with real processes, and the end-to-end figures."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest


import bench_async  # noqa: E402
import bench_e2e  # noqa: E402
import bench_records  # noqa: E402
import bench_streams  # noqa: E402
import run as bench_run  # noqa: E402
from pipeline.keys import Keys  # noqa: E402
from pipeline.records import RolloutGroup  # noqa: E402


def test_rows_compute_ratios_from_the_measured_values():
    rate = bench_run.Row("streams", "emit", 800.0, "raw", 1000.0, "rec/s", "python x.py", aim=0.8)
    time_row = bench_run.Row("async", "step", 0.4, "ideal", 0.3, "s", "python y.py", better="lower", aim=0.9)
    assert rate.ratio == pytest.approx(0.8) and rate.meets_aim
    assert time_row.ratio == pytest.approx(0.75) and time_row.meets_aim is False
    assert bench_run.Row("e2e", "idle", 0.0, "η = 0", 0.5, "%", "c").ratio is None
    table = bench_run.render_table([rate, time_row])
    assert "0.80×" in table and "0.75×" in table and "**missed**" in table and "`python y.py`" in table
    with pytest.raises(ValueError, match="better"):
        bench_run.Row("x", "y", 1.0, "b", 1.0, "s", "c", better="sideways")


def test_streams_rows_and_findings_follow_the_measurements():
    row = {"payload": "embedded", "bytes": 700, "generator_batch": 16, "produce_pipeline": 600.0, "produce_raw": 1000.0,
           "produce_one_ack": 900.0, "consume_pipeline": 500.0, "consume_raw": 1000.0, "consume_one_ack": 550.0,
           "consume_plumbing": 850.0, "redis_benchmark": {"rps": 4000.0, "clients": 1, "pipeline": 16}}
    ratios = {"produce": 0.6, "produce_one_ack": 0.9, "consume": 0.5, "consume_one_ack": 0.55, "consume_plumbing": 0.85}
    for fig, ratio in ratios.items():
        row[f"{fig}_ratio"] = row[f"{fig}_cpu_ratio"] = ratio
    res = {"command": "python bench/bench_streams.py", "aim": 0.8, "rows": [row]}
    rows = bench_run.streams_rows(res)
    emit = next(r for r in rows if r.figure.startswith("generator emit (Stage.emit"))
    assert emit.ratio == pytest.approx(0.6) and emit.meets_aim is False
    ceiling = next(r for r in rows if "C ceiling" in r.figure)
    assert ceiling.ratio == pytest.approx(0.25)
    findings = "\n".join(bench_run.streams_findings(res, None))
    assert "60% of raw redis-py" in findings and "90%" in findings and "85%" in findings
    assert "one script call" in findings, "16 records of 700 B: the script path"
    row.update(bytes=49_905)
    assert "a WATCHed MULTI" in "\n".join(bench_run.streams_findings(res, None)), "16 records of 50 KB: the MULTI"
    row.update(produce_ratio=0.85, consume_ratio=0.9)
    assert bench_run.streams_findings(res, None) == []


def test_typical_rollout_group_has_the_stated_shape_and_round_trips():
    g = bench_records.typical_group()
    assert g.group_size == 8 and g.prompt_ids.size == 200 and g.completion_ids.size == 8 * 500
    wire = g.encode()
    assert 40_000 < len(wire) < 60_000
    assert RolloutGroup.decode(wire).encode() == wire
    res = bench_records.measure(seconds=0.05, repeats=1)
    assert all(x["roundtrips_per_s"] > 0 and x["plain_msgpack_roundtrips_per_s"] > 0 for x in res["rows"])


def test_stream_paths_move_every_record_and_ack_it(redis_client):
    keys = Keys("benchtest")
    payload = bench_records.embedded_group().encode()
    emit = bench_streams.produce_pipeline(redis_client, keys, payload, 40, 16)
    assert emit["rate"] > 0 and emit["cpu_rate"] > 0 and emit["server_cpu_us"] > 0
    assert redis_client.xlen(keys.shard(0).rollouts) == 40
    assert bench_streams.produce_raw(redis_client, payload, 40, 16)["rate"] > 0
    redis_client.delete(keys.shard(0).rollouts)
    assert bench_streams.consume_pipeline(redis_client, keys, payload, 40, 16)["rate"] > 0
    assert redis_client.xpending(keys.shard(0).rollouts, "verifiers")["pending"] == 0
    redis_client.delete("bench:raw")
    assert bench_streams.consume_raw(redis_client, payload, 40, 16)["rate"] > 0
    assert redis_client.xinfo_groups("bench:raw")[0]["pending"] == 0


@pytest.mark.skipif(shutil.which("redis-benchmark") is None, reason="redis-benchmark not installed (redis-tools)")
def test_redis_benchmark_ceiling_writes_payloads_of_the_given_size(redis_url, redis_client):
    res = bench_streams.redis_benchmark(redis_url, 1234, 200, clients=2, pipeline=4)
    assert res["rps"] > 0
    _, fields = redis_client.xrange("bench:rb", count=1)[0]
    assert len(fields[b"d"]) == 1234


@pytest.mark.one_server
def test_async_harness_overlaps_stages_when_staleness_is_allowed(redis_url):
    # The time limit guards against a hang only: eight stage processes starting at once on a busy
    # two-core machine took more than the bench's own 68 s; the figures compared are per step.
    kw = dict(steps=8, warmup=2, gen_s=0.1, verify_s=0.03, train_s=0.07, batch=4, timeout_s=300)
    with ThreadPoolExecutor(2) as pool:
        sync_f = pool.submit(bench_async.run_harness, redis_url, eta=0, **kw)
        async_f = pool.submit(bench_async.run_harness, redis_url, eta=1, **kw)
        sync, asyn = sync_f.result(), async_f.result()
    assert sync["ideal_step_s"] == pytest.approx(0.2) and asyn["ideal_step_s"] == pytest.approx(0.1)
    assert asyn["step_s"] < sync["step_s"]
    assert sync["step_s"] >= 0.2 * 0.98  # a synchronous step cannot beat the sum of its stages
    # η bounds what the trainer consumed: all on-policy for η = 0, at most one version old for η = 1.
    assert sync["staleness_hist"][1:] == [0] and sum(sync["staleness_hist"]) == 8 * 4
    assert asyn["staleness_hist"][2:] == [0] and sync["stale_dropped"] == asyn["stale_dropped"] == 0


@pytest.mark.one_server
def test_async_harness_refuses_a_run_too_short_to_time(redis_url):
    with pytest.raises(ValueError, match="warmup"):
        bench_async.run_harness(redis_url, eta=0, steps=2, warmup=2)


def test_e2e_figures_are_read_from_the_run_files(tmp_path):
    (tmp_path / "logs").mkdir()
    summary = {"run_id": "r", "status": "finished", "max_staleness": 1, "wall_seconds": 100.0,
               "tokens_generated": 5000.0, "trainer_idle_fraction": 0.25, "goodput": 0.8,
               "accounting": {"stale": 0, "lost": 0}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    steps = [{"kind": "step", "version": v, "time": 1_000_000.0 + 2 * v} for v in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    events = [("1970-01-12T13:46:41Z", 100), ("1970-01-12T13:46:45Z", 300), ("1970-01-12T13:47:00Z", 999)]
    (tmp_path / "logs" / "gen-0.jsonl").write_text("".join(
        json.dumps({"event": "batch_generated", "timestamp": t, "tokens": n}) + "\n" for t, n in events))
    from pipeline_runs import read_run

    f = bench_e2e.figures(read_run(tmp_path), tmp_path)
    assert f["step_s"] == pytest.approx(2.0) and f["tokens_per_s"] == pytest.approx(50.0)
    # Steps span 1_000_002..1_000_010 (8 s); only the 13:46:45 event (1_000_005) falls inside it.
    assert f["tokens_per_s_window"] == pytest.approx(300 / 8)
    rows = bench_run.e2e_rows({"command": "c", "runs": [{**f, "max_staleness": 0, "step_s": 4.0,
                                                         "tokens_per_s_window": 20.0}, f]})
    assert next(r for r in rows if r.figure.startswith("wall time")).ratio == pytest.approx(2.0)


def test_the_real_model_generation_section_renders_from_its_results_file_alone():
    """bench/results/gen-real.json (bench/bench_gen_real.py, run in the vllm lane's venv) becomes a
    section of BENCHMARKS.md without vLLM or the model: each system's median beside HF generate's."""
    def system(label, tps, paired):
        return {"label": label, "start_s": 2.5, "tokens_per_s_median": tps, "seconds_median": 4096 / tps,
                "mean_length": 30.2, "ended_fraction": 0.1, "vs_hf_generate": round(tps / 200.0, 2),
                "vs_hf_generate_paired_median": paired, "rounds": []}

    res = {"command": "python bench/bench_gen_real.py --threads 1", "date": "2026-01-01 00:00 UTC",
           "base_dir": "/x/artifacts/smollm2-135m-instruct",
           "model": {"parameters": 134_515_008, "architecture": "LlamaForCausalLM", "tied_embeddings": True},
           "workload": {"prompts": 16, "group_size": 8, "sequences": 128, "prompt_tokens": [36], "max_new_tokens": 32,
                        "temperature": 1.0, "threads": 1, "dtype": "float32", "repeats": 5},
           "versions": {"torch": "2.13.0+cpu", "transformers": "5.24.0", "vllm": "0.32.0"},
           "load_average": {"start": [3.0, 2.0, 1.0]},
           "systems": {"vllm": system("vLLM-CPU", 500.0, 2.4), "hf_generate": system("HF generate", 200.0, 1.0),
                       "torch_sample": system("torch sampler", 300.0, 1.6)}}
    text = "\n".join(bench_run.gen_real_section(res))
    assert "## Generation on a real model (bench/results/gen-real.json)" in text
    assert "smollm2-135m-instruct (134.5M parameters, LlamaForCausalLM)" in text and "128 sequences" in text
    assert "1 torch thread;" in text and "vllm 0.32.0" in text
    assert "`python bench/bench_gen_real.py --threads 1`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "tok/s" in line]
    # HF generate first (the baseline), then the others in a fixed order; absent systems are left out.
    assert [r.split(" | ")[0] for r in rows] == ["| HF generate", "| torch sampler", "| vLLM-CPU"]
    assert "| 1.00× | 1.00× |" in rows[0] and "| 1.50× | 1.60× |" in rows[1] and "| 2.50× | 2.40× |" in rows[2]
    assert "500 tok/s" in rows[2] and "30.2 tokens" in rows[2]


def test_the_gpu_section_lists_its_rows_as_not_yet_run_until_a_gpu_check_result_exists():
    """Without bench/results/gpu-check.json the section says what each row will hold; with it (the
    JSON ops/gpu_check.sh writes) each phase's figures, a failed phase's error, torchtitan's reason."""
    text = "\n".join(bench_run.gpu_section(None))
    assert "**Not yet run**" in text
    assert text.count("| not yet run |") == len(bench_run.GPU_ROWS)
    engines = {"preset": "smollm2-135m", "parameters": 134_515_008, "prompts": 32, "n": 8, "prompt_tokens": 64,
               "max_new_tokens": 256,
               "generation": {"slot_sampler": {"tokens_per_s": 30_000.0, "mfu": 0.05},
                              "hf_generate": {"tokens_per_s": 12_000.0, "mfu": 0.02}, "slot_over_hf": 2.5},
               "train": {"tokens": 81_920, "step_seconds_median": 1.5, "tokens_per_s": 54_613.0, "mfu": 0.3}}
    res = {"started_at": 0.0, "phases": {
        "environment": {"gpu": "NVIDIA H200", "gpu_memory_gib": 139.8, "cpu_count": 16, "python": "3.12.3",
                        "torch": "2.11.0+cu130", "cuda": "13.0", "packages": {"transformers": "5.17.0"}},
        "matmul": {"n": 8192, "float32_flops": 5.1e13, "bfloat16_flops": 7.9e14},
        "engines_smollm2_135m": engines, "engines_qwen3_0.6b": {"error": "OutOfMemoryError: CUDA out of memory"},
        "weights": {"bytes": 3 << 30, "tensor_device": "cuda:0",
                    "shm": {"error": "OSError: [Errno 28] No space left on device"},
                    "tcp": {"median": {}, "publish_gb_per_s": 2.0, "fetch_gb_per_s": 3.0, "load_gb_per_s": 10.0,
                            "end_to_end_gb_per_s": 1.0}},
        "e2e": {"steps": 5, "step_seconds_median": 2.0, "trainer_idle_fraction": 0.4, "generator_swaps": 10,
                "generator_swap_seconds_median": 0.3},
        "torchtitan": {"ran": False, "reason": "torchtitan does not import on torch 2.11.0+cu130: ImportError: x"},
        "vllm": {"runnable": False, "reason": "no vllm"}}}
    text = "\n".join(bench_run.gpu_section(res))
    assert "NVIDIA H200, 139.8 GiB, 16 cores; Python 3.12.3, torch 2.11.0+cu130" in text
    assert "| 51.0 / 790.0 TFLOP/s |" in text
    assert "| 30,000 tok/s | HF generate: 12,000 tok/s | 2.50× |" in text and "MFU slot / HF: 5.0% / 2.0%" in text
    assert "1.500 s (54,613 tok/s)" in text and "(MFU 30.0%)" in text
    assert "**OutOfMemoryError: CUDA out of memory**" in text and "**OSError: [Errno 28]" in text
    assert "2.00 / 3.00 / 10.00 GB/s" in text
    assert "2.000 s, 40% idle, 10 swaps (0.300 s median)" in text
    assert "not run: torchtitan does not import on torch 2.11.0+cu130" in text and "not runnable: no vllm" in text


def test_the_game_bench_keys_names_and_reports_each_configuration_apart(tmp_path):
    """bench/game.py: a configuration's runs are kept for --resume only under its own key (budget, turn
    limit, evaluation spacing), and its report names its own figure and the command that reproduces
    and resumes it (imported without the openenv extra: main() alone needs that)."""
    import argparse

    import game

    def args(**kw):
        base = {"steps": 20, "lr": 1e-5, "max_new_tokens": game.MAX_NEW_TOKENS, "max_turn_tokens": 0,
                "eval_every": game.EVAL_EVERY, "heldout_size": 100, "out": str(tmp_path / "game-x.json")}
        return argparse.Namespace(**{**base, **kw})

    a, b = args(), args(max_new_tokens=256, max_turn_tokens=32)
    c = args(steps=60, eval_every=10)
    assert game.plan_key(a) == [20, 1e-5] and game.plan_key(b) == [20, 1e-5, 256, 32]  # as recorded so far
    assert len({str(game.plan_key(x)) for x in (a, b, c, args(eval_every=10))}) == 4
    run = {"seed": 0, "status": "finished", "base": 0.0, "final": 0.1, "base_turns": 1.0, "final_turns": 2.0,
           "steps": 60, "wall_s": 100.0, "restarts": 0, "resumes": 1, "servers_left": [],
           "accounting": {"lost": 0, "duplicated": 0, "unexpected": 0}}
    res = game.aggregate([run], c)
    assert "--eval-every 10" in res["command"] and res["figure"] == "game-x.png"
    assert res["resume_command"].endswith("--steps 60 --eval-every 10 --out " + str((tmp_path / "game-x.json")
                                                                                   .resolve()) + " --resume")
    md = game.report(res)
    assert "](game-x.png)" in md and "](game.png)" not in md and res["resume_command"] in md
    assert "(resumed 1x)" in md and "evaluated every 10 steps" in md
    assert game.overrides(tmp_path, seed=0, steps=60, heldout_size=100, eval_every=10,
                          lr=1e-5)["cluster.timeout_s"] == 360 * 60
