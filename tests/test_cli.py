"""`meshplace graph`: summaries, JSON output, user models, and every bad input → exit 2."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from meshplace.cli import main
from meshplace.graph import load_graph
from tests.forked_cli import run_meshplace

USER_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(20, 40), nn.Tanh(), nn.Linear(40, 5))

        def forward(self, x):
            return self.body(x)

    def build():
        return Net(), (torch.randn(8, 20),)

    def broken():
        raise RuntimeError("weights not found")

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y if y.max() > 0 else -y

    def branchy():
        return Branchy(), (torch.randn(2, 4),)
    """
)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_resnet50_inference_matches_published_params_and_flops(capsys) -> None:
    code, out, _ = _run(capsys, "graph", "resnet50", "--batch", "1", "--inference", "--json")
    assert code == 0
    s = json.loads(out)
    assert {
        "name",
        "ops",
        "params",
        "flops_forward",
        "flops_total",
        "param_bytes",
        "groups",
    } <= set(s)
    assert s["params"] == pytest.approx(25.56e6, rel=0.005)
    assert s["flops_forward"] == pytest.approx(8.2e9, rel=0.03)  # 2 x 4.1 G multiply-adds
    assert s["flops_total"] == s["flops_forward"]


def test_readable_summary_and_graph_file(capsys, tmp_path) -> None:
    out_file = tmp_path / "g.json"
    code, out, _ = _run(capsys, "graph", "dmcca", "--groups", "32", "--out", str(out_file))
    assert code == 0
    for label in ("ops by phase", "parameters", "FLOPs forward", "co-location groups"):
        assert label in out
    graph = load_graph(out_file)
    assert graph.meta["workload"] == "dmcca"
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"]  # no temp file left behind
    # A saved graph is a model source too, and summarises the same way.
    code, out2, _ = _run(capsys, "graph", str(out_file), "--groups", "32", "--json")
    assert code == 0
    assert json.loads(out2)["ops"] == graph.num_ops


def test_user_model_from_python_file(capsys, tmp_path) -> None:
    path = tmp_path / "mymodel.py"
    path.write_text(USER_MODEL)
    code, out, _ = _run(capsys, "graph", f"{path}:build", "--json")
    assert code == 0
    s = json.loads(out)
    assert s["params"] == 20 * 40 + 40 + 40 * 5 + 5
    assert set(s["ops_by_phase"]) == {"forward", "backward", "update"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["graph", "alexnet"], "Unknown workload 'alexnet'"),
        (["graph", "gpt", "--size", "530b"], "Unknown size '530b' for workload 'gpt'"),
        (["graph", "missing.json"], "missing.json: no such graph file"),
        (["graph", "{dir}/bad.json"], "bad.json: op 'a' field 'flops'"),
        (["graph", "{dir}/nope.py:build"], "nope.py: no such Python file"),
        (["graph", "{dir}/mymodel.py:absent"], "has no function named 'absent'"),
        (["graph", "{dir}/mymodel.py:broken"], "broken() failed with RuntimeError"),
        (["graph", "{dir}/mymodel.py:branchy"], "data-dependent control flow"),
        (["graph", "{dir}/mymodel.py"], "name the build function as FILE.py:FUNCTION"),
        (["graph", "dmcca", "--out", "{dir}/no/such/dir/g.json"], "does not exist"),
        (["graph", "{dir}/bad.json", "--batch", "4"], "--batch and --size apply to models"),
    ],
)
def test_bad_input_exits_2_with_one_sentence(capsys, tmp_path, argv, expected) -> None:
    (tmp_path / "mymodel.py").write_text(USER_MODEL)
    bad = {
        "format": "meshplace.opgraph",
        "version": 1,
        "name": "b",
        "ops": [{"name": "a", "kind": "matmul", "flops": -3}],
    }
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    argv = [a.format(dir=tmp_path) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert expected in err
    assert err.startswith("meshplace: error: ")
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "no").exists()


def test_bad_batch_is_rejected_by_the_parser(capsys) -> None:
    code, out, err = _run(capsys, "graph", "resnet50", "--batch", "0")
    assert code == 2 and out == ""
    assert err.startswith("meshplace: error: argument --batch: expected a positive integer")
    assert err.count("\n") == 1, err


def test_a_files_batch_takes_the_first_rows_of_its_inputs(tmp_path, capsys) -> None:
    """`--batch` on FILE.py:build captures the first rows of its inputs (a micro-batch of
    them); a batch its inputs' batch does not divide is one sentence, exit 2."""
    model = tmp_path / "net.py"
    model.write_text(USER_MODEL)
    code, out, err = _run(capsys, "graph", f"{model}:build", "--batch", "2", "--json", "--no-cache")
    assert code == 0, err
    graph = json.loads(out)
    code, out, _ = _run(capsys, "graph", f"{model}:build", "--json", "--no-cache")
    whole = json.loads(out)
    assert graph["flops_forward"] == pytest.approx(whole["flops_forward"] / 4)  # 2 of 8 rows
    assert graph["param_bytes"] == whole["param_bytes"]
    code, out, err = _run(capsys, "graph", f"{model}:build", "--batch", "3", "--no-cache")
    assert code == 2 and out == ""
    assert "have a batch of 8; --batch 3 must divide it" in err and err.count("\n") == 1


def test_console_script_exit_code_without_traceback(tmp_path) -> None:
    bad = tmp_path / "cyclic.json"
    bad.write_text(
        json.dumps(
            {
                "format": "meshplace.opgraph",
                "version": 1,
                "name": "c",
                "ops": [{"name": "a", "kind": "x"}, {"name": "b", "kind": "y"}],
                "edges": [{"src": "a", "dst": "b"}, {"src": "b", "dst": "a"}],
            }
        )
    )
    proc = run_meshplace(["graph", str(bad)])
    assert proc.returncode == 2
    assert "has a cycle: a -> b -> a" in proc.stderr or "has a cycle: b -> a -> b" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_command_bad_input_exits_2(capsys, tmp_path) -> None:
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    for target in (tmp_path / "missing.json", tmp_path / "other.json"):
        code = main(["report", str(target)])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith("meshplace: error: ") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json"]


def test_a_profiled_graph_without_parameter_ops_has_an_unknown_parameter_count(
    capsys, tmp_path
) -> None:
    """Parameter bytes on the ops but no parameter op to count elements of: the count is
    unknown (``null``), not 0 beside gigabytes of parameter memory."""
    from meshplace.graph.io import save_graph
    from meshplace.graph.ir import Op, OpGraph

    g = OpGraph("profiled")
    g.add_op(Op("layer0", "matmul", param_bytes=2**30, measured_time={"cpu": 1e-3}))
    save_graph(g, tmp_path / "g.json")
    assert main(["graph", str(tmp_path / "g.json"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["params"] is None and s["param_bytes"] == 2**30
    assert main(["graph", str(tmp_path / "g.json")]) == 0
    assert "unknown (no parameter ops" in capsys.readouterr().out


def test_out_all_writes_every_placers_plan(capsys, tmp_path) -> None:
    folder = tmp_path / "plans"
    argv = ["plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer", "single,m_etf,pipeline"]
    assert main([*argv, "--budget", "1", "--out-all", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in folder.iterdir()) == [
        "expert.json", "m_etf.json", "pipeline.json", "single.json",
    ]  # fmt: skip
    assert len(report["out_all"]) == 4
    for row in report["results"]:
        plan = json.loads((folder / f"{row['placer']}.json").read_text())
        assert plan["meta"]["placer"] == row["placer"]
        assert plan["meta"]["objective_value_s"] == row["objective_value_s"]
    (tmp_path / "file").write_text("")
    assert main([*argv, "--out-all", str(tmp_path / "file")]) == 2
    assert "--out-all" in capsys.readouterr().err


def test_runnable_stages_gives_a_pipeline_plan_that_runs_stage_by_stage(capsys, tmp_path) -> None:
    """Under the throughput objective `pipeline` may return a plan torch.distributed.
    pipelining cannot run stage by stage (the DP over ideals, the non-contiguous local
    search); `--runnable-stages` keeps a split of execution order that it runs. Either
    way the plan file carries the micro-batches its objective value was simulated at, and
    `simulate` reports the same number for it (one pipeline objective)."""
    from meshplace.graph.sources import workload_graph
    from meshplace.placers.pipeline import runs_as_stages
    from meshplace.plan.placement import load_plan

    argv = ["plan", "resnet50", "--cluster", "colocrl-2gpu", "--placer", "pipeline"]
    argv += ["--objective", "throughput", "--budget", "1", "--json"]
    graph = workload_graph("resnet50")
    graph_file = tmp_path / "resnet50.json"
    assert main(["graph", "resnet50", "--out", str(graph_file)]) == 0
    capsys.readouterr()
    values = {}
    for flag in ([], ["--runnable-stages"]):
        folder = tmp_path / f"plans{len(flag)}"
        assert main([*argv, *flag, "--out-all", str(folder)]) == 0
        rows = {r["placer"]: r for r in json.loads(capsys.readouterr().out)["results"]}
        row = rows["pipeline"]
        plan = load_plan(folder / "pipeline.json")
        devices = [plan.placement[o.name] for o in graph.ops]
        names = sorted(set(devices))
        as_stages = runs_as_stages(graph, np.array([names.index(d) for d in devices]))
        assert row["stats"]["runs_as_stages"] == as_stages
        assert plan.micro_batches == row["micro_batches"] == row["stats"]["micro_batches"] > 1
        values[bool(flag)] = row["objective_value_s"]
        if flag:
            assert as_stages and "local_search" not in row["stats"]
        else:
            assert row["stats"]["local_search"]["evaluations"] >= 1
        # `simulate` reads the micro-batches and the objective from the plan file
        sim = ["simulate", "--graph", str(graph_file), "--cluster", "colocrl-2gpu"]
        assert main([*sim, "--plan", str(folder / "pipeline.json"), "--json"]) == 0
        simulated = json.loads(capsys.readouterr().out)
        assert simulated["objective"] == "throughput"
        assert simulated["objective_value_s"] == pytest.approx(row["objective_value_s"], rel=1e-12)
        schedule = row["stats"]["schedule"]
        assert simulated["pipeline"]["micro_batches"] == schedule["micro_batches"]
        assert simulated["pipeline"]["step_s"] == pytest.approx(schedule["step_s"], rel=1e-12)
    assert values[False] <= values[True]
    code, _out, err = _run(capsys, "plan", "dmcca", "--cluster", "colocrl-2gpu", "--placer",
                          "metis", "--runnable-stages")  # fmt: skip
    assert code == 2 and "add pipeline to --placer" in err and err.count("\n") == 1
