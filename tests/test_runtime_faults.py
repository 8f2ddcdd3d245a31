"""``meshplace run`` through the real console script when things go wrong: the driver is
killed, a worker is stopped, the command is terminated; and (in a fork of the test's
process) a build that never returns. No process may outlive the driver, no temporary
folder may be left, and a worker failure is one sentence on stderr (exit 1) with, under
``--json``, one JSON object on stdout.

Each test waits on explicit signals read from ``/proc`` — a worker's name (the workers
call themselves ``meshplace-w<rank>``), its gloo threads (it has joined the group) — and
never on a sleep racing the child; the deadlines only bound a broken run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshplace.plan.placement import Plan, save_plan
from meshplace.runtime.program import ModelSpec, trace_step
from tests.forked_cli import run_meshplace

MESHPLACE = str(Path(sys.executable).with_name("meshplace"))

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)"
)


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """``(name, fields after the name)`` of ``/proc/PID/stat``, or ``None`` if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    name = raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode(errors="replace")
    return name, raw[raw.rindex(b")") + 2 :].decode().split()


def session_processes(sid: int) -> dict[int, str]:
    """Live (non-zombie) processes of session ``sid`` by pid: name. The driver is started
    in a session of its own, which its workers and the resource tracker inherit and keep
    even when re-parented to PID 1, so this finds orphans too."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[1][0] != "Z" and int(stat[1][3]) == sid:
            found[int(entry)] = stat[0]
    return found


def has_joined_group(pid: int) -> bool:
    """Whether a worker has joined its gloo group: gloo's threads exist once it has."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().startswith(("gloo", "pt_gloo")):
                return True
        except OSError:
            continue
    return False


def wait_for(condition, what: str, timeout: float = 120.0):
    """Poll ``condition()`` until it returns something true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def worker(driver: subprocess.Popen, rank: int, joined: bool = False) -> int:
    """The pid of worker ``rank`` of ``driver``'s run once it exists (and, with
    ``joined``, has joined the gloo group)."""

    def find() -> int | None:
        assert driver.poll() is None, driver.communicate()[1][-2000:]
        for pid, name in session_processes(driver.pid).items():
            if name == f"meshplace-w{rank}" and (not joined or has_joined_group(pid)):
                return pid
        return None

    return wait_for(find, f"worker {rank}")


@pytest.fixture
def run_env(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    """A plan splitting the MLP over two workers, and an environment whose temporary
    folder is private, so a test can see what a run leaves there."""
    step = trace_step(ModelSpec("mlp"))
    n = step.graph.num_ops
    plan = tmp_path / "plan.json"
    save_plan(
        Plan.from_devices(step.graph, "local", ["cpu0"] * (n // 2) + ["cpu1"] * (n - n // 2)),
        plan,
    )
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return plan, {**os.environ, "TMPDIR": str(tmp)}, tmp


def start_run(plan: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    """``meshplace run`` of ``plan`` for a practically endless number of steps, without
    calibration, in a session of its own."""
    return subprocess.Popen(
        [
            MESHPLACE,
            "run",
            "--graph",
            "mlp",
            "--plan",
            str(plan),
            "--no-predict",
            "--steps",
            "100000000",
            *extra,
        ],
        env=env,
        cwd=plan.parent,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def no_process_left(sid: int, timeout: float = 10.0) -> None:
    """Every process of session ``sid`` is gone within ``timeout`` seconds; any left is
    killed (so a failing test does not leave them computing) and reported."""
    try:
        wait_for(lambda: not session_processes(sid), "the session to empty", timeout)
    except AssertionError:
        left = session_processes(sid)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes outlived the driver: {left}") from None


def meshplace_folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("meshplace-"))


def test_sigkill_of_the_driver_takes_its_workers_and_the_resource_tracker(run_env) -> None:
    plan, env, _ = run_env
    driver = start_run(plan, env)
    try:
        workers = {worker(driver, 0), worker(driver, 1)}
        assert workers <= set(session_processes(driver.pid))
    finally:
        driver.kill()  # SIGKILL: the driver runs no clean-up at all
        driver.communicate()
    no_process_left(driver.pid)


def test_a_stopped_worker_is_blamed_on_stderr_with_json_on_stdout(run_env) -> None:
    plan, env, tmp = run_env
    driver = start_run(plan, env, "--json", "--hang-timeout", "2")
    try:
        stopped = worker(driver, 1, joined=True)
        os.kill(stopped, signal.SIGSTOP)  # from outside, whatever it is doing
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert driver.returncode == 1, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("meshplace: error: worker 1 (cpu1) hung: it is stopped"), err
    doc = json.loads(out)  # exactly one JSON document
    assert doc["worker"] == 1 and doc["device"] == "cpu1" and doc["cause"] == "stopped"
    assert doc["exit_status"] == 1 and doc["error"] == lines[0].removeprefix("meshplace: error: ")
    no_process_left(driver.pid)
    assert meshplace_folders(tmp) == []


def test_sigterm_stops_the_workers_and_removes_the_temporary_folder(run_env) -> None:
    plan, env, tmp = run_env
    driver = start_run(plan, env)
    try:
        worker(driver, 1, joined=True)
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert driver.returncode == 130 and err.strip().endswith("meshplace: interrupted"), err
    no_process_left(driver.pid)
    assert meshplace_folders(tmp) == []


def test_a_build_that_never_returns_is_one_sentence(tmp_path: Path) -> None:
    # what the command prints and leaves, not how a process starts or stops: the command
    # in a fork of this process (tests/forked_cli.py)
    (tmp_path / "slow.py").write_text("import time\n\ndef build():\n    time.sleep(3600)\n")
    done = run_meshplace(
        [
            "run",
            "--graph",
            "slow.py:build",
            "--placer",
            "single",
            "--build-timeout",
            "0.5",
            "--cluster-out",
            "local.yaml",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "meshplace: error: slow.py:build: build() did not return within 0.5 s"
    )
    assert done.stdout == "" and not (tmp_path / "local.yaml").exists()
