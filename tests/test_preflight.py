"""`pipeline up` refuses a bad input before it starts anything, and stops everything it
started when a worker keeps failing or the driver itself exits abnormally.

Real processes, as a user runs them: ``python -m pipeline.cli up ...`` with the embedded
server. A refused input must exit 2 within 2 s, name the field on stderr, and leave no
process, no ``runs/`` directory and no ``cluster.json`` behind.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness import TINY

from pipeline.cli import COMMANDS, main, parse
from pipeline.config import ConfigError, field_names, load_config
from pipeline.run.plan import log_file, worker_table
from pipeline.run.preflight import check_run, preflight

pytestmark = pytest.mark.one_server

ROOT = Path(__file__).resolve().parents[1]
REFUSE_WITHIN_S = 10.0
"""A refusal comes before anything slow starts (the server, a base model, the workers): well under
the time a run takes to start, with room for a loaded host. The checks after it prove that nothing
started."""


def _args(tmp_path: Path, base: Path, *extra: str, command: str = "up") -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", command, "--runs_dir", str(tmp_path / "runs"),
            "--model.base_dir", str(base), "--config", str(TINY), *extra]


UP_ENV = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"},  # the embedded server
          "PYTHONPATH": str(ROOT)}


def _processes_under(path: Path) -> list[str]:
    """Command lines of the live processes naming ``path`` (the run's server and workers all do)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if str(path) in cmd and state != "Z":
            found.append(f"{proc.name}: {cmd}")
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _refused(tmp_path: Path, base: Path, *extra: str, command: str = "up") -> tuple[str, float]:
    """Run a `pipeline up` that must be refused; its stderr and how long it took."""
    t0 = time.monotonic()
    p = subprocess.run(_args(tmp_path, base, *extra, command=command), capture_output=True, text=True,
                       env=UP_ENV, cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "pipeline: config error: " in p.stderr, p.stderr
    assert elapsed < REFUSE_WITHIN_S, f"refused after {elapsed:.2f} s: {p.stderr}"
    assert not (tmp_path / "runs").exists(), "nothing was started: no run directory, no cluster.json"
    assert not _processes_under(tmp_path), _processes_under(tmp_path)
    print(f"refused in {elapsed:.2f} s: {p.stderr.strip()}")
    return p.stderr, elapsed


def _math_rows(path: Path, n: int, **fields: str) -> Path:
    names = {"problem": "problem", "answer": "answer", **fields}
    path.write_text("".join(json.dumps({names["problem"]: f"{i} + {i}", names["answer"]: str(2 * i)}) + "\n"
                            for i in range(n)))
    return path


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


# ----------------------------------------------------------------------------- refused before anything starts


def test_an_unknown_verifier_is_refused_naming_the_field(tmp_path, tiny_base_model):
    err, _ = _refused(tmp_path, tiny_base_model, "--verifier.verifiers", "format,mod9,nope")
    assert "verifier.verifiers: unknown verifier 'nope'; allowed:" in err and "mod9" in err


def test_an_unknown_reward_mode_is_refused_naming_the_field(tmp_path, tiny_base_model):
    err, _ = _refused(tmp_path, tiny_base_model, "--verifier.reward", "weavr")
    assert "verifier.reward: unknown reward mode 'weavr'; allowed:" in err and "'weaver'" in err


def test_a_single_verifier_reward_must_name_a_verifier_of_the_list(tmp_path, tiny_base_model):
    err, _ = _refused(tmp_path, tiny_base_model, "--verifier.reward", "single:mod7")
    assert "verifier.reward: 'single:mod7' must name a verifier of verifier.verifiers" in err


def test_a_math_dataset_missing_the_prompt_field_is_refused_naming_it(tmp_path, tiny_base_model):
    data = _math_rows(tmp_path / "rows.jsonl", 100, problem="question")
    err, _ = _refused(tmp_path, tiny_base_model, "--task.kind", "math", "--task.dataset", str(data))
    assert f"task.prompt_field: must name a column every row of {data} has" in err, err
    assert "row 1 has no 'problem'" in err


def test_a_text_task_on_a_character_vocabulary_is_refused_naming_the_model(tmp_path, tiny_base_model):
    """The tiny base reads digits and operators only: a reasoning-gym task's prompts are refused
    before launch, not a ValueError from its tokenizer inside the check."""
    pytest.importorskip("reasoning_gym", reason="the reasoning extra: pip install -e '.[reasoning]'")
    err, _ = _refused(tmp_path, tiny_base_model, "--task.kind", "reasoning_gym", "--task.datasets", "chain_sum",
                      "--task.heldout_size", "20")
    assert f"model.base_dir: the tokenizer of {tiny_base_model} cannot encode chain_sum's prompts" in err, err


def test_a_math_dataset_without_any_answer_is_refused_naming_the_field(tmp_path, tiny_base_model):
    """Rows without an answer are unlabelled (trained on with a label-free reward), but a file
    where none has one leaves no held-out set."""
    data = _math_rows(tmp_path / "rows.jsonl", 100, answer="solution")
    err, _ = _refused(tmp_path, tiny_base_model, "--task.kind", "math", "--task.dataset", str(data))
    assert "task.answer_field: " in err and "no row has an answer in 'answer'" in err, err


def test_a_heldout_set_as_large_as_the_dataset_is_refused_naming_the_field(tmp_path, tiny_base_model):
    data = _math_rows(tmp_path / "rows.jsonl", 30)
    err, _ = _refused(tmp_path, tiny_base_model, "--task.kind", "math", "--task.dataset", str(data))
    assert "task.heldout_size: must be below the 30 rows of" in err and "got 50" in err


def test_a_missing_model_dir_is_refused_with_how_to_build_one(tmp_path):
    typo = tmp_path / "artifacts" / "base-modle"
    err, _ = _refused(tmp_path, typo)
    assert f"model.base_dir: must be a checkpoint directory; '{typo}' does not exist" in err
    assert f"`pipeline pretrain --model.base_dir {typo}`" in err and "--model.build_missing true" in err
    assert "fix the path" in err
    assert not typo.exists(), "no warm-up was started into the typo"


def test_a_model_dir_without_a_loadable_checkpoint_is_refused_naming_what_it_lacks(tmp_path, tiny_base_model):
    base = tmp_path / "base"
    shutil.copytree(tiny_base_model, base)
    (base / "tokenizer.json").unlink()
    config = json.loads((base / "config.json").read_text())
    del config["vocab_size"]
    (base / "config.json").write_text(json.dumps(config))
    err, _ = _refused(tmp_path, base)
    assert "model.base_dir: must be a loadable checkpoint directory" in err
    assert "lacks an integer vocab_size in config.json, tokenizer.json" in err


@pytest.mark.parametrize("field, extra", [
    ("metrics.base_port", ("--metrics.base_port", "{port}")),
    ("weights.tcp_port", ("--weights.transport", "tcp", "--weights.tcp_port", "{port}")),
    ("weights.announce_port", ("--weights.announce_port", "{port}")),
])
def test_a_busy_port_is_refused_naming_the_field(tmp_path, tiny_base_model, field, extra):
    with _listening() as busy:
        port = busy.getsockname()[1]
        err, _ = _refused(tmp_path, tiny_base_model, *(x.format(port=port) for x in extra))
    assert f"{field}: must be a port free on this host; 127.0.0.1:{port}" in err, err


def test_every_problem_is_reported_at_once(tmp_path):
    err, _ = _refused(tmp_path, tmp_path / "nowhere", "--verifier.verifiers", "nope", "--verifier.reward", "weavr")
    assert "3 problems:" in err
    assert "  - model.base_dir: " in err and "  - verifier.verifiers: " in err and "  - verifier.reward: " in err


def test_chaos_refuses_a_schedule_naming_a_worker_the_run_does_not_have(tmp_path, tiny_base_model):
    err, _ = _refused(tmp_path, tiny_base_model, "--chaos.schedule", "gen-0,gen-5", command="chaos")
    assert "chaos.schedule: must name workers of this run" in err and "['gen-5']" in err


# ----------------------------------------------------------------------------- preflight, in process


def test_a_missing_base_dir_is_built_only_at_the_default_location_or_when_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    preflight(load_config())  # artifacts/base-model, relative to the working directory: built when missing
    preflight(load_config(overrides={"model.base_dir": str(tmp_path / "artifacts" / "base-model")}))
    elsewhere = str(tmp_path / "models" / "mine")
    with pytest.raises(ConfigError, match=r"^model\.base_dir: .*does not exist"):
        preflight(load_config(overrides={"model.base_dir": elsewhere}))
    preflight(load_config(overrides={"model.base_dir": elsewhere, "model.build_missing": "true"}))
    (tmp_path / "models" / "mine").mkdir(parents=True)  # an empty directory counts as missing
    preflight(load_config(overrides={"model.base_dir": elsewhere, "model.build_missing": "true"}))
    with pytest.raises(ConfigError, match=r"^model\.base_dir: .*is an empty directory"):
        preflight(load_config(overrides={"model.base_dir": elsewhere}))


def test_a_math_run_never_builds_its_model(tmp_path):
    data = _math_rows(tmp_path / "rows.jsonl", 100)
    cfg = load_config(overrides={"task.kind": "math", "task.dataset": str(data), "task.heldout_size": "10",
                                 "model.base_dir": str(tmp_path / "none"), "model.build_missing": "true"})
    with pytest.raises(ConfigError, match=r"^model\.base_dir: .*starts from an existing checkpoint.*init-model"):
        preflight(cfg)


def test_a_valid_config_passes(tmp_path, tiny_base_model):
    data = _math_rows(tmp_path / "rows.jsonl", 100)
    preflight(load_config(overrides={"model.base_dir": str(tiny_base_model)}), chaos=True)
    preflight(load_config(overrides={"model.base_dir": str(tiny_base_model), "task.kind": "math",
                                     "task.dataset": str(data), "task.heldout_size": "10",
                                     "verifier.verifiers": "boxed,math_equiv", "verifier.reward": "single:boxed"}))


def test_two_fixed_ports_that_collide_are_refused(tiny_base_model):
    cfg = load_config(overrides={"model.base_dir": str(tiny_base_model), "metrics.base_port": "20100",
                                 "weights.announce_port": "20102"})
    with pytest.raises(ConfigError, match=r"weights\.announce_port: must differ from the other ports this run "
                                          r"binds; 20102 .* is also feeder's metrics"):
        preflight(cfg)


def test_chaos_restarting_a_server_it_did_not_start_is_refused(tiny_base_model, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    cfg = load_config(overrides={"model.base_dir": str(tiny_base_model)})
    with pytest.raises(ConfigError, match=r"chaos\.kinds: restarting Redis needs a server this run starts"):
        preflight(cfg, chaos=True)
    with pytest.raises(ConfigError, match=r"chaos\.schedule: restarting Redis"):
        preflight(cfg.replace("chaos.schedule", ("gen-0", "redis")), chaos=True)
    preflight(cfg.replace("chaos.kinds", ("kill", "pause")), chaos=True)
    preflight(cfg)  # pipeline up injects nothing


def test_the_log_file_a_worker_writes_is_the_one_its_messages_name(tmp_path):
    cfg = load_config(overrides={"runs_dir": str(tmp_path), "run_id": "r"})
    files = {name: log_file(cfg, *spec).name for name, spec in worker_table(cfg).items()}
    assert files["trainer"] == "train.out" and files["ver-1"] == "ver-1.out" and files["feeder"] == "feed.out"


# ----------------------------------------------------------------------------- what the driver started, it stops


def _start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, threading.Thread]:
    """Start a driver; its output is read as it comes (a full pipe would stall it) into ``reader.chunks``."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=UP_ENV, cwd=tmp_path)
    reader = threading.Thread(target=lambda: reader.chunks.extend(iter(lambda: p.stdout.read1(65536), b"")),
                              daemon=True)
    reader.chunks = []
    reader.start()
    return p, reader


def _watch(p: subprocess.Popen, reader: threading.Thread, runs: Path, timeout: float) -> tuple[str, dict]:
    """Wait for ``p`` to exit; its output, and the last ``cluster.json`` seen while it ran."""
    info: dict = {}
    deadline = time.time() + timeout
    while p.poll() is None:
        if time.time() > deadline:
            p.kill()
            pytest.fail("the driver did not exit: " + b"".join(reader.chunks).decode(errors="replace")[-3000:])
        try:
            info = json.loads((runs / "cluster.json").read_text())
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    reader.join(10)
    return b"".join(reader.chunks).decode(errors="replace"), info


def _assert_all_stopped(tmp_path: Path, info: dict) -> None:
    assert info, "cluster.json was written while the run was up"
    for pid in [*info["workers"].values(), *info["server_pids"]]:
        assert not _alive(pid), f"pid {pid} outlived the driver"
    assert not _processes_under(tmp_path), _processes_under(tmp_path)
    assert not (tmp_path / "runs" / "cluster.json").exists()


def test_a_worker_that_keeps_failing_stops_the_run_and_shows_its_own_error(tmp_path, tiny_base_model):
    base = tmp_path / "base"
    shutil.copytree(tiny_base_model, base)
    (base / "model.safetensors").write_bytes(b"\xff" * 64)  # passes preflight: the file is there
    # Three quick exits make a crash loop here (five by default), restarted after 0.2 s: the same
    # policy, without a minute of backoff.
    p, reader = _start(_args(tmp_path, base, "--run-id", "crash", "--trainer.steps", "3",
                             "--cluster.crash_loop_exits", "3", "--cluster.restart_backoff_s", "0.2"), tmp_path)
    out, info = _watch(p, reader, tmp_path / "runs", timeout=400)
    assert p.returncode not in (0, 2), out[-4000:]
    m = re.search(r"pipeline: run crash failed: (\S+) keeps exiting \(code (-?\d+)\); its last lines are above, "
                  r"its whole output is (\S+)", out)
    assert m, out[-4000:]
    log = Path(m.group(3))
    assert log.is_file(), "the message points at the log file the worker wrote"
    own = [line for line in log.read_text().splitlines() if line.strip()]
    assert own and f"  | {own[-1]}" in out, "the driver shows the worker's own last error line"
    assert "  | safetensors._safetensors_rust.SafetensorError: Error while deserializing header" in out, out[-4000:]
    _assert_all_stopped(tmp_path, info)
    summary = json.loads((tmp_path / "runs" / "crash" / "summary.json").read_text())
    assert summary["status"].startswith(f"failed: {m.group(1)} keeps exiting"), summary["status"]


DRIVER_RAISES = textwrap.dedent("""
    import sys
    import pipeline.run.launch as launch
    from pipeline.cli import main

    def progress(*args, **kwargs):
        raise RuntimeError("the driver broke")

    launch._progress_line = progress
    sys.exit(main(sys.argv[1:]))
""")


def test_an_exception_in_the_driver_stops_every_worker_and_the_server(tmp_path, tiny_base_model):
    args = _args(tmp_path, tiny_base_model, "--run-id", "boom", "--trainer.steps", "100000")
    p, reader = _start([sys.executable, "-c", DRIVER_RAISES, *args[3:]], tmp_path)
    out, info = _watch(p, reader, tmp_path / "runs", timeout=120)
    assert p.returncode == 1 and "RuntimeError: the driver broke" in out, out[-3000:]
    _assert_all_stopped(tmp_path, info)


def test_sigterm_to_the_driver_alone_stops_every_worker_and_the_server(tmp_path, tiny_base_model):
    p, reader = _start(_args(tmp_path, tiny_base_model, "--run-id", "term", "--trainer.steps", "100000"), tmp_path)
    deadline = time.time() + 120
    while not (tmp_path / "runs" / "cluster.json").exists():
        assert time.time() < deadline and p.poll() is None, "the cluster never came up"
        time.sleep(0.2)
    time.sleep(1.0)
    info = json.loads((tmp_path / "runs" / "cluster.json").read_text())
    p.send_signal(signal.SIGTERM)
    out, _ = _watch(p, reader, tmp_path / "runs", timeout=120)
    assert "interrupted" in out, out[-3000:]
    _assert_all_stopped(tmp_path, info)
    summary = json.loads((tmp_path / "runs" / "term" / "summary.json").read_text())
    assert summary["status"] == "interrupted"


def test_a_checkpoint_the_torchtitan_trainer_cannot_build_is_refused_before_launch_naming_what_differs(tmp_path):
    """The architecture check runs in the driver without torch or torchtitan (the lane's tests build
    and train the models themselves)."""
    from pipeline.run.preflight import model_problems

    shipped = Path(__file__).resolve().parent.parent / "pipeline" / "model" / "arith_base"
    base = tmp_path / "base"
    shutil.copytree(shipped, base)
    cfg = load_config(TINY, {"model.base_dir": str(base), "trainer.backend": "torchtitan"})
    assert model_problems(cfg) == [], "the shipped Qwen3 base is one torchtitan builds"
    c = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**c, "hidden_act": "gelu", "attention_bias": True}))
    problems = model_problems(cfg)
    assert len(problems) == 1 and problems[0].startswith("model.base_dir: trainer.backend 'torchtitan' cannot build")
    assert "hidden_act 'gelu' (need 'silu')" in problems[0] and "attention_bias True (need False)" in problems[0]
    (base / "config.json").write_text(json.dumps({**c, "model_type": "gpt2"}))
    assert "model_type 'gpt2' (the torchtitan backend builds 'qwen3', 'llama')" in model_problems(cfg)[0]
    assert model_problems(load_config(TINY, {"model.base_dir": str(base)})) == [], "the torch trainer is not asked"
    out = subprocess.run([sys.executable, "-c", "import sys, pipeline.engines.titan_arch; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- pipeline config --check


def _documented_runs(tmp_path: Path) -> list[tuple[str, list[str]]]:
    """(command, arguments) of every shipped config and of every config the docs show: each
    ``configs/*.toml``, each TOML block of a run config in docs/ (written to a file), and each
    ``pipeline up`` / ``pipeline chaos`` command line of README.md and docs/."""
    runs: list[tuple[str, list[str]]] = [("up", ["--config", str(p)])
                                         for p in sorted((ROOT / "configs").glob("*.toml"))]
    tables = {f"[{n.partition('.')[0]}]" for n in field_names() if "." in n}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", text, flags=re.S)):
            if any(line.strip() in tables for line in block.splitlines()):
                path = tmp_path / f"{doc.stem}-{i}.toml"
                path.write_text(block)
                runs.append(("up", ["--config", str(path)]))
        text = re.sub(r"\\\n\s*", " ", text)  # shell line continuations
        for m in re.finditer(r"(?:^|`|\$ )pipeline (up|chaos)((?: [^`|\n]*)?)", text, flags=re.M):
            try:
                args = shlex.split(m.group(2), comments=True)
            except ValueError:
                continue
            # `--resume` continues a run that exists (its own config.toml): tests/test_resume.py.
            if "--help" not in args and "-h" not in args and "--resume" not in args:
                runs.append((m.group(1), args))
    return runs


def _outcome(call) -> tuple[int, str]:
    """(0, "") when ``call`` passes; (2, the message) when it refuses the config."""
    try:
        call()
    except ConfigError as e:
        return 2, str(e)
    except SystemExit as e:  # argparse
        return int(e.code or 0), "argparse"
    return 0, ""


def test_config_check_and_up_agree_on_every_shipped_and_documented_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the docs' relative paths (configs/, examples/) are the repository's
    monkeypatch.delenv("REDIS_URL", raising=False)
    runs = _documented_runs(tmp_path)
    assert len(runs) > 40 and sum(c == "chaos" for c, _ in runs) >= 1
    passed = 0
    for command, args in runs:
        def up_checks():  # what `pipeline up` checks before it starts anything, without starting it
            _, cfg = parse([command, *args])
            check_run(cfg, chaos=command == "chaos")

        def config_check():
            code = main(["config", "--check", command, *args])
            err = capsys.readouterr().err
            if code:
                raise ConfigError(err.removeprefix("pipeline: config error: ").strip())

        up = _outcome(up_checks)
        assert _outcome(config_check) == up, f"pipeline {command} {shlex.join(args)}"
        passed += up[0] == 0
    assert passed >= 10, "most documented configs pass"
    print(f"{len(runs)} configs, {passed} pass both, {len(runs) - passed} refused by both")


def test_config_check_refuses_what_up_refuses_with_the_way_round(tmp_path, tiny_base_model):
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "config", "--check", "--config", str(TINY),
                        "--verifier.reward", "ground_truth", "--model.base_dir", str(tiny_base_model)],
                       capture_output=True, text=True, env=UP_ENV, cwd=tmp_path, timeout=60)
    assert p.returncode == 2
    assert "verifier.min_fit_rows = 16: set, but cannot take effect" in p.stderr
    assert "leave it out of the config, or pass --verifier.min_fit_rows 128 (the default)" in p.stderr
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "config", "--check", "--config", str(TINY),
                        "--verifier.reward", "ground_truth", "--verifier.min_fit_rows", "128",
                        "--model.base_dir", str(tiny_base_model)],
                       capture_output=True, text=True, env=UP_ENV, cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and "passes every check of `pipeline up`" in p.stdout, p.stderr
    assert not (tmp_path / "runs").exists(), "nothing started"


def test_an_unknown_field_is_answered_with_the_closest_one():
    with pytest.raises(ConfigError, match=r"trainer\.stpes: unknown field \(did you mean trainer\.steps\?\)"):
        load_config(overrides={"trainer.stpes": "3"})
    with pytest.raises(ConfigError, match=r"did you mean task\.heldout_size\?"):
        load_config(overrides={"trainer.heldout_size": "3"})


def test_either_spelling_of_a_flag_is_the_same_flag():
    for argv in (["up", "--runs-dir", "x", "--run_id", "r", "--redis_url", "redis://h:1", "--trainer.max-refills", "3"],
                 ["up", "--runs_dir", "x", "--run-id", "r", "--redis-url", "redis://h:1", "--trainer.max_refills=3"]):
        _, cfg = parse(argv)
        assert (cfg.runs_dir, cfg.run_id, cfg.redis.url, cfg.trainer.max_refills) == ("x", "r", "redis://h:1", 3)
    assert parse(["down", "--runs_dir", "y"])[0].runs_dir == "y"
    assert parse(["generate", "--worker_id", "g", "--max_batches", "2"])[0].worker_id == "g"


def test_help_lists_every_command_and_every_config_field(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for name in COMMANDS:
        assert re.search(rf"^ +pipeline (?:[\w-]+ \| )*{name} ", top, flags=re.M), f"`pipeline --help` omits {name}"
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    up_help = " ".join(capsys.readouterr().out.split())
    assert "pipeline config" in up_help
    for name in field_names():
        table, _, leaf = name.rpartition(".")
        assert re.search(rf"\[{table or 'top'}\][^\[]*\b{leaf}\b", up_help), name
