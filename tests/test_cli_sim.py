"""`meshplace cluster` and `meshplace simulate`, and their bad inputs (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplace.cli import main
from meshplace.graph.io import save_graph
from meshplace.graph.sources import workload_graph
from meshplace.plan.placement import Plan, save_plan


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def dmcca_files(tmp_path_factory) -> dict[str, Path]:
    """A saved dmcca graph and an expert-style plan: one encoder per GPU."""
    folder = tmp_path_factory.mktemp("sim")
    graph = workload_graph("dmcca")
    graph_path = folder / "dmcca.json"
    save_graph(graph, graph_path)
    placement = {}
    for o in graph.ops:
        if o.module.startswith("encoders."):
            placement[o.name] = f"gpu{int(o.module.split('.')[1]) % 4}"
    plan = Plan.for_graph(graph, "colocrl-4gpu", placement, default_device="gpu0")
    plan_path = folder / "plan.json"
    save_plan(plan, plan_path)
    other = workload_graph("dmcca", size="8view")
    other_plan = Plan.for_graph(other, "colocrl-4gpu", {}, default_device="gpu0")
    save_plan(other_plan, folder / "other-plan.json")
    bad_device = Plan.for_graph(graph, "colocrl-4gpu", {}, default_device="gpu9")
    save_plan(bad_device, folder / "bad-device.json")
    return {"graph": graph_path, "plan": plan_path, "folder": folder}


def test_cluster_preset_json(capsys) -> None:
    code, out, _ = _run(capsys, "cluster", "colocrl-4gpu", "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["devices"]) == 5
    assert {d["kind"] for d in data["devices"]} >= {"k80"}


def test_cluster_table_for_a_pod_is_compact(capsys) -> None:
    code, out, _ = _run(capsys, "cluster", "tpu-v3-pod")
    assert code == 0
    assert "1,024" in out or "1024" in out
    assert len(out.splitlines()) < 80


def test_simulate_json_and_trace(capsys, dmcca_files) -> None:
    trace = dmcca_files["folder"] / "trace.json"
    code, out, _ = _run(
        capsys,
        "simulate",
        "--graph",
        dmcca_files["graph"],
        "--cluster",
        "colocrl-4gpu",
        "--plan",
        dmcca_files["plan"],
        "--trace",
        trace,
        "--json",
    )
    assert code == 0
    s = json.loads(out)
    assert {"step_time_s", "lower_bound_s", "oom", "devices"} <= set(s)
    assert s["step_time_s"] >= s["lower_bound_s"] > 0
    assert s["oom"] is False
    for d in s["devices"]:
        assert {"name", "busy_s", "peak_memory_bytes"} <= set(d)
    used = [d for d in s["devices"] if d["ops"]]
    assert {d["name"] for d in used} == {"gpu0", "gpu1", "gpu2", "gpu3"}
    assert json.loads(trace.read_text())["traceEvents"]


def _simulate_dmcca(capsys, files: dict[str, Path], *extra: str) -> tuple[int, str, str]:
    """``meshplace simulate`` of the dmcca plan on colocrl-4gpu, throughput objective."""
    return _run(
        capsys,
        "simulate",
        "--graph",
        files["graph"],
        "--cluster",
        "colocrl-4gpu",
        "--plan",
        files["plan"],
        "--objective",
        "throughput",
        *extra,
    )


def test_simulate_table(capsys, dmcca_files) -> None:
    code, out, _ = _simulate_dmcca(capsys, dmcca_files)
    assert code == 0
    for label in ("step time", "lower bound", "peak memory", "busiest links"):
        assert label in out


BAD_YAML = {
    "zero-bandwidth.yaml": (
        "name: z\ndevices:\n  - {name: a, kind: k80}\n  - {name: b, kind: k80}\n"
        "links:\n  - {src: a, dst: b, bandwidth: 0}\n",
        "bandwidth",
    ),
    "negative-bandwidth.yaml": (
        "name: n\ndevices:\n  - {name: a, kind: k80}\n  - {name: b, kind: k80}\n"
        "links:\n  - {src: a, dst: b, bandwidth: -5 GB/s}\n",
        "bandwidth",
    ),
    "malformed.yaml": ("name: [unclosed\n  devices: {\n", "YAML"),
}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["cluster", "colocrl-9gpu"], "colocrl-9gpu"),
        (["cluster", "{dir}/zero-bandwidth.yaml"], "bandwidth"),
        (["cluster", "{dir}/negative-bandwidth.yaml"], "bandwidth"),
        (["cluster", "{dir}/malformed.yaml"], "malformed.yaml"),
        (["cluster", "{dir}/missing.yaml"], "missing.yaml"),
        (
            ["simulate", "--graph", "{graph}", "--cluster", "colocrl-4gpu", "--plan", "{bad}"],
            "device 'gpu9', which cluster 'colocrl-4gpu' does not have",
        ),
        (
            ["simulate", "--graph", "{graph}", "--cluster", "colocrl-4gpu", "--plan", "{other}"],
            "was made for graph 'dmcca-8view'",
        ),
        (
            ["simulate", "--graph", "{graph}", "--cluster", "nowhere", "--plan", "{plan}"],
            "nowhere",
        ),
        (
            ["simulate", "--graph", "{graph}", "--cluster", "colocrl-4gpu", "--plan", "{dir}/x"],
            "no such plan file",
        ),
        (
            ["simulate", "--graph", "{graph}", "--cluster", "colocrl-4gpu", "--plan", "{graph}"],
            "not a meshplace plan",
        ),
        (
            [
                "simulate",
                "--graph",
                "{graph}",
                "--cluster",
                "colocrl-4gpu",
                "--plan",
                "{plan}",
                "--trace",
                "{dir}/no/such/trace.json",
            ],
            "does not exist",
        ),
    ],
)
def test_bad_input_exits_2(capsys, dmcca_files, argv, expected) -> None:
    folder = dmcca_files["folder"]
    for name, (text, _) in BAD_YAML.items():
        (folder / name).write_text(text)
    subs = {
        "dir": folder,
        "graph": dmcca_files["graph"],
        "plan": dmcca_files["plan"],
        "bad": folder / "bad-device.json",
        "other": folder / "other-plan.json",
    }
    before = sorted(p.name for p in folder.iterdir())
    code, out, err = _run(capsys, *[a.format(**subs) for a in argv])
    assert code == 2, err
    assert out == ""
    assert err.startswith("meshplace: error: ")
    assert expected in err
    assert err.count("\n") == 1, err
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing half-written


def test_transfers_that_occupy_the_devices_charge_them_and_move_the_throughput_bound(
    capsys, dmcca_files, tmp_path: Path
) -> None:
    def simulate(*extra: str) -> dict:
        code, out, _ = _simulate_dmcca(capsys, dmcca_files, "--json", *extra)
        assert code == 0
        return json.loads(out)

    overlap, occupy = simulate(), simulate("--transfers", "occupy")
    assert overlap["transfers"] == occupy["transfers"] > 0
    # every device that sends or receives is busier by exactly that traffic's time
    for a, b in zip(overlap["devices"], occupy["devices"], strict=True):
        assert b["busy_s"] >= a["busy_s"]
    assert sum(d["busy_s"] for d in occupy["devices"]) > sum(
        d["busy_s"] for d in overlap["devices"]
    )
    # the throughput bound, not the step one, and no plan beats it
    for s in (overlap, occupy):
        assert s["objective"] == "throughput"
        assert 0 < s["lower_bound_s"] <= s["throughput_time_s"]
    # the same through the cluster file
    yaml_file = tmp_path / "occupy.yaml"
    code, out, _ = _run(capsys, "cluster", "colocrl-4gpu", "--json")
    assert code == 0 and all(d["transfers"] == "overlap" for d in json.loads(out)["devices"])
    yaml_file.write_text(
        "name: colocrl-4gpu\ntransfers: occupy\ntopology:\n  generator: pcie_tree\n"
    )
    code, out, _ = _run(capsys, "cluster", yaml_file, "--json")
    assert code == 0 and all(d["transfers"] == "occupy" for d in json.loads(out)["devices"])
    code, _, err = _simulate_dmcca(capsys, dmcca_files, "--transfers", "sometimes")
    assert code == 2 and "sometimes" in err and len(err.strip().splitlines()) == 1
