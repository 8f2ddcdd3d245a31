"""A sharding plan run by torchrun on 2 gloo ranks: ``meshplace run --plan`` starts
``torchrun -m meshplace.runtime``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from meshplace.graph.capture import as_loss, capture
from meshplace.graph.sources import load_build_function
from meshplace.hardware import load_cluster
from meshplace.parallel.search import shard_graph
from tests.test_runtime_faults import session_processes, wait_for

MODEL = """\
import torch


def build():
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )
    return model, (torch.randn(32, 64),)
"""


def one_process_losses(source: str, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The losses of ``steps`` Adam steps (lr 1e-3) of the ``FILE.py:build`` model in one
    process, built from seed 0 as every rank builds it; and the trained model."""
    torch.manual_seed(0)
    built = load_build_function(source)()
    model, args = built[0], built[1]
    kwargs = built[2] if len(built) > 2 else {}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss, _how = as_loss(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model


def _meshplace_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``meshplace run ARGS`` (a sharding plan: torchrun ``--standalone``, so a free
    rendezvous port on 127.0.0.1 for this test alone)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "meshplace.cli", "run", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=240,
    )


def test_a_plan_trains_under_torchrun_like_one_process_and_each_rank_holds_its_share(
    tmp_path: Path,
) -> None:
    source = f"{tmp_path / 'mlp.py'}:build"
    (tmp_path / "mlp.py").write_text(MODEL)
    torch.manual_seed(0)
    model, (x,) = load_build_function(source)()
    graph = capture(model, (x,), training=True)
    plan = shard_graph(graph, load_cluster("dgx-h100"), chips=2).best.plan_file(source, "dgx-h100")
    zero = {n: p["zero"] for n, p in plan["parameters"].items()}
    assert any(zero.values()), zero  # weight-update sharding is exercised
    assert any("Shard" in " ".join(p["placements"]) for p in plan["parameters"].values())
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = _meshplace_run(
        tmp_path, "--plan", "plan.json", "--steps", "3", "--warmup", "1", "--json"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout)  # rank 0 prints exactly one JSON document
    expected, _model = one_process_losses(source, 3)  # the same three Adam steps
    assert torch.allclose(
        torch.tensor(report["measured"]["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6
    )
    assert report["world_size"] == 2 and report["steps"] == 3 and report["warmup"] == 1
    assert report["measured"]["step_time_s"] > 0
    # each rank holds its block of every parameter, gradient and Adam moment exactly as
    # predicted, ZeRO-3's parameter shards included
    assert 3 in zero.values(), zero
    memory = report["memory_per_rank"]
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert memory[kind]["measured"] == [memory[kind]["predicted"]] * 2, kind
    assert report["notes"] == []


def test_bad_runs_are_one_sentence_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(
        json.dumps({"format": "meshplace.parallel_plan", "mesh": {"shape": [4]}, "graph": {}})
    )
    env_world = {"WORLD_SIZE": "2", "RANK": "0"}
    cases = [
        (["--plan", "missing.json"], "does not exist"),
        (["--plan", "plan.json"], "FILE.py:build"),
        (["--plan", "plan.json", "--model", "m.py:build"], "needs 4 processes, torchrun started 2"),
        (["--plan", "plan.json", "--steps", "2", "--warmup", "2"], "fewer than --steps"),
    ]
    for args, message in cases:
        done = subprocess.run(
            [sys.executable, "-m", "meshplace.runtime", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, **env_world},
            timeout=120,
        )
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and done.stderr.count("\n") == 1, (args, done.stderr)
        assert done.stdout == ""
    # through meshplace run: the same checks before torchrun starts
    for args, message in (
        (["--plan", "plan.json", "--graph", "m.py:build", "--cluster-out", "c.yaml"], "does not"),
        (["--plan", "plan.json", "--graph", "m.py:build", "--worker-devices", "cuda:0"], "cpu or"),
        (["--plan", "plan.json", "--graph", "m.py:build", "--memory-budget", "9"], "does not"),
    ):
        done = _meshplace_run(tmp_path, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and done.stderr.count("\n") == 1, (args, done.stderr)


def test_a_rank_killed_mid_run_ends_the_job_with_one_sentence_and_no_processes(
    tmp_path: Path,
) -> None:
    (tmp_path / "mlp.py").write_text(MODEL)
    plan = {
        "format": "meshplace.parallel_plan",
        "graph": {"source": f"{tmp_path / 'mlp.py'}:build"},
        "mesh": {"shape": [2], "axes": ["x"]},
        "parameters": {
            name: {"placements": ["Replicate()"], "zero": 0}
            for name in ("0.weight", "0.bias", "2.weight", "2.bias")
        },
        "inputs": {"input": {"placements": ["Shard(0)"]}},
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHPLACE_TORCHRUN_FAULT": "1:1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshplace.cli", "run", "--plan", "plan.json", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
        start_new_session=True,  # its own session: every process it starts is findable
    )
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err[-2000:]
    sentence = "rank 1 was killed by SIGKILL; torchrun stopped the other ranks (exit status 1)"
    assert err.splitlines()[-1] == f"meshplace: error: {sentence}"
    assert json.loads(out) == {"error": sentence, "exit_status": 1}
    wait_for(lambda: not session_processes(proc.pid), "every rank to be gone", timeout=30)


def test_a_plan_splitting_a_convolution_weight_is_refused_in_one_sentence() -> None:
    import pytest

    from meshplace.errors import InputError
    from meshplace.runtime.launch import refuse_split_convolutions

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    whole = {"0.weight": {"placements": ["Replicate()", "Replicate()"]}}
    refuse_split_convolutions(model, {"parameters": whole})  # whole weights run
    split = {"0.weight": {"placements": ["Shard(1)", "Replicate()"]}}
    with pytest.raises(InputError, match=r"splits convolution parameter '0\.weight'"):
        refuse_split_convolutions(model, {"parameters": split})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_this_host_run_the_llama_plan(tmp_path: Path) -> None:
    """torchrun's multi-host launch (``--nnodes 2``, one process per "node", rendezvous on
    127.0.0.1) runs the Llama example's plan; the losses are the one-process run's."""
    source = f"{Path(__file__).resolve().parents[1] / 'examples' / 'llama.py'}:build_tiny"
    torch.manual_seed(0)
    model, args, kwargs = load_build_function(source)()
    graph = capture(model, args, example_kwargs=kwargs, training=True)
    plan = shard_graph(graph, load_cluster("dgx-h100"), chips=2).best.plan_file(source, "dgx-h100")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    launch += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    runtime = ["-m", "meshplace.runtime", "--plan", "plan.json", "--steps", "2", "--warmup", "1"]
    nodes = [
        subprocess.Popen(
            [*launch, "--node-rank", str(rank), *runtime, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1][-2000:]
    report = json.loads(outs[0][0])  # node 0 holds rank 0, which reports
    assert outs[1][0] == "" and report["world_size"] == 2
    expected, _model = one_process_losses(source, 2)
    assert torch.allclose(
        torch.tensor(report["measured"]["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-5
    )


def _nmt_placement(tmp_path: Path, graph: object, placer: str | None) -> str:
    """A placement plan of ``graph`` (nmt-small's) on colocrl-2gpu by ``placer`` (``None``:
    every op on gpu0), written to ``tmp_path``; its path."""
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.plan import Plan, save_plan

    if placer is None:
        plan = Plan.from_devices(graph, "colocrl-2gpu", ["gpu0"] * graph.num_ops)
    else:
        cluster = load_cluster("colocrl-2gpu")
        result = run_placer(placer, PlacementProblem(graph, cluster), 5.0, 0)
        names = [cluster.device_names[d] for d in result.op_devices.tolist()]
        plan = Plan.from_devices(graph, "colocrl-2gpu", names)
    path = tmp_path / f"{placer or 'single'}.json"
    save_plan(plan, path)
    return str(path)


def test_an_op_placement_runs_under_torchrun_each_rank_building_only_its_ops(
    tmp_path: Path,
) -> None:
    """nmt-small (3 tokens, batch 4) placed over 2 ranks by the pipeline placer, under a
    per-rank memory budget the whole model exceeds: each rank creates only its ops'
    parameters and Adam state (exactly the plan's bytes), and losses and parameters after
    3 steps are the one-process run's, bit for bit. The same budget refuses the one-device
    plan in one sentence."""
    from meshplace.runtime.executor import run_reference
    from meshplace.runtime.program import ModelSpec, trace_step

    step = trace_step(ModelSpec("nmt-small", batch=4, size="tiny"))
    whole = sum(o.param_bytes + o.state_bytes for o in step.graph.ops)
    plan = _nmt_placement(tmp_path, step.graph, "pipeline")
    budget = str(whole * 2 // 3)
    model = ["--batch", "4", "--size", "tiny"]
    steps = ["--steps", "3", "--warmup", "1", "--memory-budget", budget, "--json"]
    done = _meshplace_run(
        tmp_path,
        *["--plan", plan, "--graph", "nmt-small", *model, "--launcher", "torchrun"],
        *[*steps, "--checkpoint-dir", "ck"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["plan"] == "placement" and report["devices"] == ["gpu0", "gpu1"]
    memory = report["memory_per_rank"]
    for kind in ("parameters", "optimizer_state", "inputs"):
        assert memory[kind]["measured"] == memory[kind]["predicted"], kind
    held = [
        p + s
        for p, s in zip(memory["parameters"]["measured"], memory["optimizer_state"]["measured"])
    ]
    assert sum(held) == whole and max(held) < int(budget) < whole, (held, budget)
    losses, params = run_reference(step, 3)
    assert report["measured"]["losses"] == losses
    shards = [torch.load(tmp_path / "ck" / f"rank{r}.pt") for r in (0, 1)]
    assert not set(shards[0]) & set(shards[1])  # no tensor is held twice
    saved = {**shards[0], **shards[1]}
    assert all(torch.equal(saved[n], p) for n, p in params.items())
    assert report["measured"]["bytes_sent_per_rank"][0] > 0 < report["measured"]["step_time_s"]

    single = _nmt_placement(tmp_path, step.graph, None)
    one = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    runtime = ["-m", "meshplace.runtime", "--plan", single, "--model", "nmt-small"]
    refused = subprocess.run(
        [sys.executable, *runtime, *model, *steps],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **one, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())},
        timeout=240,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.startswith("meshplace: error: rank 0 (gpu0) would hold ")
    assert refused.stderr.count("\n") == 1 and f"--memory-budget {int(budget):,}" in refused.stderr
    assert refused.stdout == ""


LLAMA_BATCH_8 = """\
import dataclasses
import sys

import torch

sys.path.insert(0, {folder!r})
import llama  # examples/llama.py


def build():
    cfg = dataclasses.replace(llama.CONFIGS["tiny"], batch=8)
    model = llama.Llama(cfg)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    return model, (ids,), {{"labels": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))}}
"""


def test_a_pipelined_placement_runs_as_a_1f1b_pipeline_like_one_process(tmp_path: Path) -> None:
    """The pipeline placer's 2-stage plan of a Llama (batch 8) runs under torchrun as a
    torch.distributed.pipelining 1F1B schedule of 4 micro-batches: the losses are one
    process's within 1e-5, and each stage holds the parameters, buffers and Adam state the
    plan puts on its device."""
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.plan import save_plan
    from meshplace.planning import best_plan

    example = Path(__file__).resolve().parents[1] / "examples" / "llama.py"
    (tmp_path / "llama8.py").write_text(LLAMA_BATCH_8.format(folder=str(example.parent)))
    source = f"{tmp_path / 'llama8.py'}:build"
    torch.manual_seed(0)
    model, args, kwargs = load_build_function(source)()
    graph = capture(model, args, example_kwargs=kwargs, training=True)
    problem = PlacementProblem.build(graph, load_cluster("colocrl-2gpu"), "throughput")
    plan = best_plan(problem, [run_placer("pipeline", problem, 5.0, 0)], 5.0, 0)
    assert plan.micro_batches == 8 and len(set(plan.placement.values())) == 2
    save_plan(plan, tmp_path / "pipe.json")
    done = subprocess.run(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
            *["--nproc-per-node", "2", "-m", "meshplace.runtime", "--plan", "pipe.json"],
            *["--model", source, "--schedule", "1F1B", "--micro-batches", "4"],
            *["--steps", "3", "--warmup", "1", "--json"],
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["plan"] == "pipeline" and report["micro_batches"] == 4
    assert report["stage_begins"][0] == "" and report["stage_begins"][1].startswith("layers.")
    expected, _model = one_process_losses(source, 3)
    assert torch.allclose(
        torch.tensor(report["measured"]["losses"]), torch.tensor(expected), rtol=0, atol=1e-5
    )
    memory = report["memory_per_rank"]
    assert memory["optimizer_state"]["measured"] == memory["optimizer_state"]["predicted"]
    assert memory["parameters"]["measured"] == memory["parameters"]["predicted"]
