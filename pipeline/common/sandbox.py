"""A sandbox for untrusted Python: a program and its ``assert`` tests in a fresh, limited process.

Used by the ``code_exec`` verifier, the code task's hidden truth and the code environment.

The sandbox (``run_tests``), per program:

- a fresh interpreter (``python -I``: no user site, no environment, script dir not on
  the path) with an **empty environment**, in a **temporary working directory** that is
  deleted afterwards;
- resource limits set in the child before ``exec``: ``RLIMIT_CPU`` (CPU seconds),
  ``RLIMIT_AS`` (address space, so a memory hog gets ``MemoryError``), ``RLIMIT_NOFILE``,
  ``RLIMIT_FSIZE`` (largest file it may write), ``RLIMIT_NPROC`` (processes), no core
  dumps; started by root, it runs as ``nobody`` (the kernel exempts root from
  ``RLIMIT_NPROC``, and nobody cannot write outside its working directory);
- **no network**: when ``unshare -rn`` works on this machine the program runs in a new
  user + network namespace (only a down loopback, so even 127.0.0.1 is unreachable) and
  a new PID namespace (when the sandbox's first process dies the kernel kills every
  process it left, even ones that called ``setsid``). Where ``unshare`` is missing or not
  permitted, the program runs without network isolation and ``ExecResult.network_isolated``
  says so (``note`` explains);
- a **wall-clock timeout**, after which the whole process group is killed (SIGKILL).
  A run stopped for time (at the wall clock, or once it has used its whole CPU allowance,
  whichever comes first: on a loaded machine either can) is ``timed_out``, and makes the
  verifier abstain for that completion.

What it does not protect: the tests run in the same interpreter as the solution, so a
hostile program can tamper with the harness and forge its own result. The sandbox
protects the machine, not the reward; a score from it is one weak signal among others.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resource limits of one sandboxed program."""

    wall_s: float = 5.0
    """Wall-clock seconds before the process group is killed."""
    cpu_s: int = 2
    """RLIMIT_CPU: CPU seconds per process."""
    memory_bytes: int = 512 << 20
    """RLIMIT_AS: address space per process (bytes)."""
    nofile: int = 32
    """RLIMIT_NOFILE: open file descriptors."""
    fsize_bytes: int = 1 << 20
    """RLIMIT_FSIZE: largest file the program may write (bytes)."""
    nproc: int = 32
    """RLIMIT_NPROC: processes (enforced inside the user namespace)."""
    output_bytes: int = 64 << 10
    """Stdout/stderr kept per program (the rest is discarded)."""


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    """Outcome of one sandboxed run."""

    passed: int
    """Test asserts that passed."""
    total: int
    """Test asserts run."""
    timed_out: bool
    """Stopped for time: killed at the wall-clock limit, or it used its whole CPU allowance."""
    network_isolated: bool
    """Ran in its own network namespace (no network, loopback down)."""
    returncode: int | None
    """Exit status (negative: killed by that signal); None if it could not start."""
    stderr: str = ""
    """Tail of the program's stderr (tracebacks, MemoryError, ...)."""
    note: str = ""
    """Why network isolation is unavailable, or why the run failed to start."""
    pid: int | None = None
    """Pid (= process group id) of the sandbox's first process; gone once this returns."""

    @property
    def score(self) -> float:
        """Share of asserts passed; NaN when it timed out or had no tests (abstain)."""
        if self.timed_out or self.total == 0:
            return float("nan")
        return self.passed / self.total


_UNSHARE = shutil.which("unshare")
_UNSHARE_ARGS = ["-r", "-n", "-p", "-f", "--kill-child"]


@functools.cache
def network_isolation() -> tuple[bool, str]:
    """(available, note): whether ``unshare -rn`` (plus a PID namespace) works here, checked once."""
    if _UNSHARE is None:
        return False, "network isolation unavailable: no 'unshare' on PATH"
    try:
        proc = subprocess.run([_UNSHARE, *_UNSHARE_ARGS, "true"], capture_output=True, timeout=10, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"network isolation unavailable: unshare failed to run ({exc})"
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        return False, f"network isolation unavailable: 'unshare -rn' refused ({err or proc.returncode})"
    return True, ""


_HARNESS = r'''
import json, sys
tests = json.load(open("tests.json"))
ns = {"__name__": "__main__"}
passed = 0
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as exc:
    sys.stderr.write("solution failed: %r\n" % (exc,))
else:
    for t in tests:
        try:
            exec(compile(t, "test", "exec"), ns)
            passed += 1
        except BaseException as exc:
            sys.stderr.write("test failed: %s: %r\n" % (t, exc))
sys.stdout.write("\n" + json.dumps({"passed": passed}) + "\n")
'''


# Sets the limits, then becomes the sandbox command. A separate exec step rather than
# Popen's preexec_fn, which is unsafe in a threaded parent (the verifier stage runs this
# kind in a worker thread).
_LIMITER = r'''
import os, resource, sys
if DROP and os.getuid() == 0:  # root ignores RLIMIT_NPROC and may write anywhere: run as nobody
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
for name, value in zip(("CPU", "AS", "NOFILE", "FSIZE", "NPROC", "CORE"), map(int, sys.argv[1].split(","))):
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
os.execv(sys.argv[2], sys.argv[2:])
'''


def _limited(cmd: list[str], limits: SandboxLimits) -> list[str]:
    values = (limits.cpu_s, limits.memory_bytes, limits.nofile, limits.fsize_bytes, limits.nproc, 0)
    python, drop, _ = sandbox_python()
    limiter = _LIMITER.replace("NOBODY", str(NOBODY)).replace("DROP", str(drop))
    return [python, "-I", "-c", limiter, ",".join(str(int(v)) for v in values), *cmd]


NOBODY = 65534
"""Uid and gid a sandbox started by root runs as (the kernel exempts root from RLIMIT_NPROC)."""


@functools.cache
def sandbox_python() -> tuple[str, bool, str]:
    """(interpreter, runs as nobody, note), chosen once.

    Not root: this interpreter, as the current user. Root: the first of this
    interpreter and the system ``python3`` that ``nobody`` can run (a virtualenv under
    a private home directory is not); if neither, this interpreter as root, with
    RLIMIT_NPROC unenforced (the wall clock and the PID namespace still bound a fork bomb).
    """
    if os.getuid() != 0:
        return sys.executable, False, ""
    for python in dict.fromkeys([sys.executable, shutil.which("python3", path="/usr/bin:/bin") or ""]):
        if not python:
            continue
        probe = _LIMITER.replace("NOBODY", str(NOBODY)).replace("DROP", "True")
        try:
            ok = subprocess.run([python, "-I", "-c", probe, "60,1073741824,64,1048576,64,0", python, "-I", "-c", "pass"],
                                capture_output=True, timeout=20, env={}, cwd="/").returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return python, True, ""
    return sys.executable, False, "running as root: RLIMIT_NPROC is not enforced (no interpreter nobody can run)"


def run_tests(code: str, tests: Sequence[str], *, limits: SandboxLimits = SandboxLimits(),
              isolate_network: bool = True) -> ExecResult:
    """Run ``code`` then each test statement in a sandbox (module docstring); count the passing ones.

    ``isolate_network=False`` skips the namespaces even where they are available (for
    comparison in tests); the result always says which was used.
    """
    isolated, note = network_isolation() if isolate_network else (False, "network isolation not requested")
    with tempfile.TemporaryDirectory(prefix="code_exec-") as cwd:
        with open(os.path.join(cwd, "solution.py"), "w") as f:
            f.write(code)
        with open(os.path.join(cwd, "tests.json"), "w") as f:
            json.dump(list(tests), f)
        with open(os.path.join(cwd, "harness.py"), "w") as f:
            f.write(_HARNESS)
        if sandbox_python()[1]:  # the sandbox runs as nobody: give it its working directory
            for name in ("", "solution.py", "tests.json", "harness.py"):
                os.chown(os.path.join(cwd, name), NOBODY, NOBODY)
        cmd = [sandbox_python()[0], "-I", "harness.py"]
        if isolated:
            cmd = [_UNSHARE, *_UNSHARE_ARGS, *cmd]
        # Output goes to files, not pipes: a child left holding a pipe open would keep a
        # reader waiting after the program ended; RLIMIT_FSIZE also caps these files.
        with open(os.path.join(cwd, "stdout"), "w+b") as out, open(os.path.join(cwd, "stderr"), "w+b") as err:
            try:
                proc = subprocess.Popen(_limited(cmd, limits), cwd=cwd, env={}, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, start_new_session=True)
            except OSError as exc:
                return ExecResult(passed=0, total=len(tests), timed_out=False, network_isolated=isolated,
                                  returncode=None, note=f"could not start the sandbox: {exc}")
            try:
                ended = _reap_within(proc.pid, limits.wall_s)
            finally:
                _kill_group(proc.pid)  # the program on timeout, and anything it left behind in its group
            timed_out = ended is None
            # wait4, not Popen.wait: its usage counts the sandboxed program too (unshare waited for it).
            _, status, usage = ended or os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            # Killed for CPU time is stopped for time, as the wall clock is (under load either comes first);
            # the CPU counted is the program's and that of the processes it waited for.
            # Not from the exit status alone: unshare reports its child's SIGKILL as its own exit status 1.
            timed_out = timed_out or (proc.returncode != 0 and
                                      usage.ru_utime + usage.ru_stime >= limits.cpu_s * _CPU_SHARE)
            out.seek(0, os.SEEK_END)
            out.seek(max(0, out.tell() - limits.output_bytes))
            stdout = out.read().decode(errors="replace")
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - limits.output_bytes))
            stderr = err.read().decode(errors="replace")
    passed = 0
    if not timed_out:
        try:
            passed = int(json.loads(stdout.strip().rsplit("\n", 1)[-1])["passed"])
        except (ValueError, KeyError, TypeError, IndexError):
            passed = 0  # killed (CPU limit, crash) before the harness reported
    if not note:
        note = sandbox_python()[2]
    return ExecResult(passed=max(0, min(passed, len(tests))), total=len(tests), timed_out=timed_out,
                      network_isolated=isolated, returncode=proc.returncode, stderr=stderr, note=note, pid=proc.pid)


_CPU_SHARE = 0.9
"""Share of ``cpu_s`` that counts as the whole allowance: the kernel kills at the limit by its
own clock, while the usage it reports (user + system, split by sampling) can read a few percent
under it (0.97 s at a limit of 1 s, measured here)."""


def _reap_within(pid: int, timeout_s: float):
    """``os.wait4``'s (pid, status, usage) for child ``pid`` if it ends within ``timeout_s``, else
    None (looking every 10 ms, as ``Popen.wait`` with a timeout does)."""
    deadline = time.monotonic() + timeout_s
    while not (ended := os.wait4(pid, os.WNOHANG))[0]:
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)
    return ended


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The code of a completion: the first fenced block if there is one, else the whole text."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion
