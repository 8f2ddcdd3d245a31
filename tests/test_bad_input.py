"""Bad input through the command line (a process each, forked from the test's: see
tests/forked_cli.py): one sentence on stderr, exit 2, no traceback, nothing written — and
with ``--json``, one JSON document on stdout. Ctrl-C and the lazy import of torch are
tested on the real console script.

One test per class of the bad-input audit (issue 13) that the command line itself owns;
file formats (graph, plan, cluster) are tested in test_graph_io.py / test_hardware.py and
the runtime's in test_runtime.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.forked_cli import run_meshplace

MESHPLACE = str(Path(sys.executable).with_name("meshplace"))

# Three independent ops of 600 MiB of parameters each on two devices of 1 GiB: the graph
# fits the cluster's memory in sum and each op fits a device, but any placement puts two
# ops (1.2 GiB) on one device, so every placer runs out of memory. Three devices fit it.
BIG_OPS = {
    "format": "meshplace.opgraph",
    "version": 1,
    "name": "big-ops",
    "ops": [
        {"name": n, "kind": "matmul", "flops": 1e9, "param_bytes": 600 * 2**20}
        for n in ("a", "b", "c")
    ],
    "edges": [],  # independent, so grouping cannot merge them
}
SMALL_DEVICES = """\
name: small-devices
kind: pair
device_kinds:
  small:
    base: v100
    memory_bytes: 1 GiB
devices:
  - {{count: {n}, kind: small, name: dev}}
links:
{links}
"""


def small_devices(n: int) -> str:
    links = "\n".join(
        f"  - {{src: dev{i}, dst: dev{i + 1}, bandwidth: 10 GB/s, latency: 1 us}}"
        for i in range(n - 1)
    )
    return SMALL_DEVICES.format(n=n, links=links)


def cli(*argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_meshplace(argv, cwd=cwd, timeout=timeout)


def assert_bad(done: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 2, stderr exactly one sentence starting ``meshplace: error:`` naming ``words``."""
    err = done.stderr
    assert done.returncode == 2, (done.returncode, err[-1000:])
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("meshplace: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture()
def small(tmp_path: Path) -> Path:
    """A folder with a tiny graph (g.json), a two-device cluster it cannot fit (c.yaml)
    and a three-device one it fits (c3.yaml)."""
    (tmp_path / "g.json").write_text(json.dumps(BIG_OPS))
    (tmp_path / "c.yaml").write_text(small_devices(2))
    (tmp_path / "c3.yaml").write_text(small_devices(3))
    return tmp_path


def test_output_path_that_is_a_folder_is_refused_before_any_work(small: Path) -> None:
    (small / "adir").mkdir()
    before = files(small)
    assert_bad(cli("plan", "g.json", "--cluster", "c.yaml", "--out", "adir", cwd=small), "adir")
    assert_bad(
        cli("simulate", "--graph", "g.json", "--cluster", "c.yaml", "--plan", "p.json",
            "--trace", "adir", cwd=small),
        "--trace adir", "folder",
    )  # fmt: skip
    assert files(small) == before


def test_output_where_nothing_can_be_written_is_refused_before_any_work(small: Path) -> None:
    # /sys refuses new files even to root (permission bits alone would not say so)
    done = cli("graph", "g.json", "--out", "/sys/meshplace-test.json", cwd=small)
    assert_bad(done, "--out /sys/meshplace-test.json", "cannot write")
    done = cli("graph", "g.json", "--out", "/dev/null", cwd=small)
    assert_bad(done, "not a regular file")


def test_a_late_output_error_does_not_leave_the_first_output_written(small: Path) -> None:
    done = cli(
        "plan", "g.json", "--cluster", "c.yaml", "--placer", "round_robin",
        "--out", "ok.json", "--result", "missing/r.json", cwd=small,
    )  # fmt: skip
    assert_bad(done, "missing/r.json", "does not exist")
    assert not (small / "ok.json").exists()


def test_outputs_that_collide_with_each_other_or_with_the_input(small: Path) -> None:
    graph_before = (small / "g.json").read_bytes()
    done = cli("plan", "g.json", "--cluster", "c.yaml", "--out", "x.json", "--result",
               "x.json", cwd=small)  # fmt: skip
    assert_bad(done, "--out and --result are the same file")
    done = cli("plan", "g.json", "--cluster", "c.yaml", "--out", "g.json", cwd=small)
    assert_bad(done, "also an input")
    done = cli("graph", "g.json", "--out", "./g.json", cwd=small)
    assert_bad(done, "also an input")
    assert (small / "g.json").read_bytes() == graph_before
    assert not (small / "x.json").exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--seed", "-1"], ["--seed", "between 0 and 2**32 - 1"]),
        (["--seed", "1.5"], ["--seed", "integer"]),
        (["--budget", "inf"], ["--budget", "finite and positive"]),
        (["--budget", "nan"], ["--budget", "finite and positive"]),
        (["--budget", "0"], ["--budget", "finite and positive"]),
        (["--finetune", "-1", "--placer", "gnn"], ["--finetune", "non-negative"]),
        (["--placer", ""], ["placer"]),
        (["--placer", "anneal", "--finetune", "5"], ["--finetune", "gnn"]),
        (["--resume"], ["--resume needs --checkpoint-dir"]),
        (["--inference"], ["--inference", "saved graph"]),
    ],
)
def test_plan_flags_are_checked_before_any_work(small: Path, flags, words) -> None:
    before = files(small)
    assert_bad(cli("plan", "g.json", "--cluster", "c.yaml", *flags, cwd=small), *words)
    assert files(small) == before


def test_an_unknown_workload_is_named_with_the_known_ones(small: Path) -> None:
    assert_bad(cli("workloads", "dmcca", "nosuchmodel", cwd=small), "nosuchmodel", "rnnlm")


def test_checkpoint_dir_is_not_created_for_a_run_that_is_refused(small: Path) -> None:
    done = cli("plan", "g.json", "--cluster", "c.yaml", "--placer", "rl,nosuchplacer",
               "--checkpoint-dir", "ckpt", cwd=small)  # fmt: skip
    assert_bad(done, "nosuchplacer")
    assert not (small / "ckpt").exists()


def test_json_callers_get_one_json_document_even_on_bad_input(small: Path) -> None:
    for argv in (
        ["plan", "g.json", "--cluster", "c.yaml", "--seed", "-1", "--json"],
        ["plan", "g.json", "--cluster", "c.yaml", "--placer", "", "--json"],
        ["simulate", "--graph", "g.json", "--cluster", "c.yaml", "--plan", "nope.json", "--json"],
    ):
        done = cli(*argv, cwd=small)
        assert done.returncode == 2, done.stderr
        doc = json.loads(done.stdout)  # exactly one document: json.loads refuses extra data
        assert doc["exit_status"] == 2 and doc["error"], doc
        assert not doc["error"].startswith(("meshplace", "error")), doc  # the reason alone
        assert doc["error"] in done.stderr
        assert "Traceback" not in done.stderr


def test_when_every_placer_runs_out_of_memory_nothing_is_claimed_written(small: Path) -> None:
    done = cli("plan", "g.json", "--cluster", "c.yaml", "--placer", "single,round_robin",
               "--out", "p.json", "--json", cwd=small)  # fmt: skip
    assert done.returncode == 2, done.stderr
    report = json.loads(done.stdout)
    assert report["best"] is None and report["out"] is None
    assert "p.json was not written" in report["error"]
    assert report["results"] and all(r["oom"] for r in report["results"])
    assert "p.json was not written" in done.stderr
    assert "plan written" not in done.stdout + done.stderr
    assert not (small / "p.json").exists()
    # on three devices the same placers find a plan that fits, and it is written
    done = cli("plan", "g.json", "--cluster", "c3.yaml", "--placer", "single,round_robin",
               "--out", "p.json", cwd=small)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "plan written to p.json" in done.stdout
    assert json.loads((small / "p.json").read_text())["format"] == "meshplace.plan"


def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(small: Path) -> None:
    # Interrupt while torch is being imported and while capturing: never a traceback.
    for delay in (0.3, 2.5):
        proc = subprocess.Popen(
            [MESHPLACE, "graph", "resnet50", "--batch", "2"],
            cwd=small,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay)  # not a race: any moment must give the same answer
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
        if proc.returncode == 0:  # finished before the signal: nothing to check
            continue
        assert proc.returncode == 130, (delay, err[-1000:])
        assert "Traceback" not in err, err
        assert err.strip().splitlines()[-1] == "meshplace: interrupted"


def test_usage_errors_are_one_sentence_without_the_usage_block(small: Path) -> None:
    done = cli("plan", "g.json", cwd=small)  # --cluster missing
    line = assert_bad(done, "--cluster", "meshplace plan --help")
    assert "usage:" not in line
    done = cli("simulate", "--graph", "g.json", "--cluster", "c.yaml", "--plan", "p.json",
               "--objective", "fast", cwd=small)  # fmt: skip
    assert_bad(done, "--objective", "step", "throughput")


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom meshplace.cli import main\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert done.stdout.strip() == "False", done.stderr


def test_shard_refuses_a_cluster_of_cpus_only(tmp_path: Path) -> None:
    links = "\n".join(
        f"  - {{src: cpu{i}, dst: cpu{i + 1}, bandwidth: 10 GB/s, latency: 1 us}}" for i in range(3)
    )
    (tmp_path / "cpus.yaml").write_text(
        f"name: cpus-only\nkind: ethernet\ndevices:\n  - {{count: 4, kind: xeon, name: cpu}}\n"
        f"links:\n{links}\n"
    )
    done = cli("shard", "transformer", "--size", "base", "--cluster", "cpus.yaml", cwd=tmp_path)
    assert_bad(done, "cpus-only", "no accelerators", "xeon")
    # the calibrated cluster of local worker processes (meshplace run --cluster-out) is the
    # exception: each of its CPUs is one process, one torchrun rank
    from meshplace.hardware import load_cluster
    from meshplace.mesh.layout import accelerators

    workers = (tmp_path / "cpus.yaml").read_text() + "meta:\n  worker_device: cpu\n"
    (tmp_path / "workers.yaml").write_text(workers.replace("cpus-only", "workers"))
    assert accelerators(load_cluster(str(tmp_path / "workers.yaml"))) == [0, 1, 2, 3]
