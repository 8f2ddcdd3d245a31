"""Op placements under torchrun: each rank builds only its ops' share
(``meshplace.runtime.placed``), and pipelined placements run as
``torch.distributed.pipelining`` stages (``meshplace.runtime.pipelined``). A file of its
own, so that the test runner can spread the torchrun tests over its workers."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from meshplace.graph.capture import capture
from meshplace.graph.sources import load_build_function
from meshplace.hardware import load_cluster
from tests.forked_ranks import free_port, run_forked_ranks
from tests.test_runtime_torchrun import _meshplace_run, one_process_losses


def _gpus_only(problem: object) -> object:
    """``problem`` with less than no memory on its CPU, so that the pipeline placer (which may give
    the CPU a stage) uses the two GPUs: two ranks."""
    problem.device_memory[problem.device_names.index("cpu0")] = -1.0
    return problem


def _nmt_placement(tmp_path: Path, graph: object, placer: str | None) -> str:
    """A placement plan of ``graph`` (nmt-small's) on colocrl-2gpu by ``placer`` (``None``:
    every op on gpu0), written to ``tmp_path``; its path."""
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.plan import Plan, save_plan

    if placer is None:
        plan = Plan.from_devices(graph, "colocrl-2gpu", ["gpu0"] * graph.num_ops)
    else:
        cluster = load_cluster("colocrl-2gpu")
        result = run_placer(placer, _gpus_only(PlacementProblem(graph, cluster)), 5.0, 0)
        names = [cluster.device_names[d] for d in result.op_devices.tolist()]
        plan = Plan.from_devices(graph, "colocrl-2gpu", names)
    path = tmp_path / f"{placer or 'single'}.json"
    save_plan(plan, path)
    return str(path)


def test_an_op_placement_runs_under_torchrun_each_rank_building_only_its_ops(
    tmp_path: Path, monkeypatch, capfd
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
    done = run_forked_ranks(
        tmp_path,
        2,
        *["--plan", plan, "--model", "nmt-small", *model, *steps, "--checkpoint-dir", "ck"],
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

    # `python -m meshplace.runtime`'s entry point as the one rank of a world of one, run in
    # this process (the runs above and below start rank processes): its exit status, what
    # it writes to file descriptors 1 and 2, and the Python warnings a process of its own
    # would have printed there (Python's default filters, each warning again)
    from meshplace.runtime.launch import main as rank_main

    single = _nmt_placement(tmp_path, step.graph, None)
    one = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    with monkeypatch.context() as env, warnings.catch_warnings(record=True) as warned:
        warnings.resetwarnings()
        quiet = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
        for category in quiet:
            warnings.simplefilter("ignore", category)
        for name, value in {**one, "MASTER_PORT": str(free_port())}.items():
            env.setenv(name, value)
        env.chdir(tmp_path)
        capfd.readouterr()
        status = rank_main(["--plan", single, "--model", "nmt-small", *model, *steps])
        refused = capfd.readouterr()
    assert status == 2, refused.err[-2000:]
    assert refused.err.startswith("meshplace: error: rank 0 (gpu0) would hold ")
    assert refused.err.count("\n") == 1 and f"--memory-budget {int(budget):,}" in refused.err
    assert refused.out == "" and not warned, [str(w.message) for w in warned]

    # started by `meshplace run`, rank 1 killed in the second step: named with the op it
    # was running
    killed = _meshplace_run(
        tmp_path,
        *["--plan", plan, "--graph", "nmt-small", *model, "--launcher", "torchrun"],
        *["--steps", "3", "--warmup", "1"],
        fault="1:1",
    )
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert re.fullmatch(
        r"meshplace: error: rank 1 was killed by SIGKILL while running op '\w+' in step 2; "
        r"torchrun stopped the other ranks \(exit status 1\)",
        killed.stderr.splitlines()[-1],
    ), killed.stderr[-2000:]


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


def _llama_batch_8(tmp_path: Path) -> tuple[str, object]:
    """The Llama example at batch 8 as a ``FILE.py:build`` source in ``tmp_path``, and its
    captured training step (built from seed 0, as every rank builds it)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "llama.py"
    (tmp_path / "llama8.py").write_text(LLAMA_BATCH_8.format(folder=str(example.parent)))
    source = f"{tmp_path / 'llama8.py'}:build"
    torch.manual_seed(0)
    model, args, kwargs = load_build_function(source)()
    return source, capture(model, args, example_kwargs=kwargs, training=True)


def test_a_pipelined_placement_runs_as_a_1f1b_pipeline_like_one_process(tmp_path: Path) -> None:
    """The pipeline placer's 2-stage plan of a Llama (batch 8) runs under torchrun as a
    torch.distributed.pipelining 1F1B schedule of 4 micro-batches: the losses are one
    process's within 1e-5, and each stage holds the parameters, buffers and Adam state the
    plan puts on its device."""
    from meshplace.cost.calibration import (
        CostCalibration,
        calibrated_cost_model,
        save_calibration,
    )
    from meshplace.cost.compute import CostModel
    from meshplace.placers.base import PlacementProblem, PlacerOptions, run_placer
    from meshplace.plan import save_plan
    from meshplace.planning import best_plan
    from meshplace.runtime.launch import simulated_placement_step

    source, graph = _llama_batch_8(tmp_path)
    # Kernel launches free (as a calibration file may say of a device): on K80s' launch
    # overhead the throughput objective would rightly run this tiny model unsplit, one
    # plain step; without it, pipelining pays and the plan carries its micro-batches.
    free_launches = CostModel(launch_overhead={"k80": 0.0, "xeon-e5-2699v3": 0.0})
    problem = _gpus_only(
        PlacementProblem.build(
            graph, load_cluster("colocrl-2gpu"), "throughput", cost_model=free_launches
        )
    )
    stages = PlacerOptions(runnable_stages=True)  # what `plan --runnable-stages` asks for
    plan = best_plan(problem, [run_placer("pipeline", problem, 5.0, 0, stages)], 5.0, 0)
    assert plan.micro_batches in (2, 4, 8) and len(set(plan.placement.values())) == 2
    save_plan(plan, tmp_path / "pipe.json")
    calibration = CostCalibration(
        device_kind="k80",
        peak_flops=3e12,
        memory_bandwidth=2e11,
        launch_overhead_s=0.0,
        pipeline_exchange_s=2e-3,
        pipeline_message_s=5e-4,
    )
    save_calibration(calibration, tmp_path / "k80.json")
    done = run_forked_ranks(
        tmp_path,
        2,
        *["--plan", "pipe.json", "--model", source, "--schedule", "1F1B", "--micro-batches", "4"],
        *["--steps", "3", "--warmup", "1", "--json", "--checkpoint-dir", "ck"],
        *["--calibration", "k80.json"],  # the run predicted by the simulator as well
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["plan"] == "pipeline" and report["micro_batches"] == 4
    assert report["stage_begins"][0] == "" and report["stage_begins"][1].startswith("layers.")
    expected, trained = one_process_losses(source, 3)
    assert torch.allclose(
        torch.tensor(report["measured"]["losses"]), torch.tensor(expected), rtol=0, atol=1e-5
    )
    cpu = report["measured"]["cpu_time_s_per_rank"]  # each stage's process, in the step
    assert len(cpu) == 2 and all(c > 0 for c in cpu), cpu
    # the parameters after the three steps: each stage's own, together the whole model's
    # (four micro-batches' gradients summed, so within 1e-5, not bit for bit)
    stages = [torch.load(tmp_path / "ck" / f"rank{r}.pt") for r in (0, 1)]
    assert stages[0] and stages[1] and not set(stages[0]) & set(stages[1])
    saved = {**stages[0], **stages[1]}
    reference = dict(trained.named_parameters())
    assert sorted(saved) == sorted(reference)
    for name, value in saved.items():
        assert torch.allclose(value, reference[name].detach(), rtol=0, atol=1e-5), name
    memory = report["memory_per_rank"]
    assert memory["optimizer_state"]["measured"] == memory["optimizer_state"]["predicted"]
    assert memory["parameters"]["measured"] == memory["parameters"]["predicted"]
    # beside the plan's own prediction, the simulator's of this run (4 micro-batches,
    # 1F1B) with the calibration's cost model: the number this process computes
    cluster = load_cluster("colocrl-2gpu")
    expected_run = simulated_placement_step(
        plan, graph, cluster, calibrated_cost_model(calibration, cluster), micro_batches=4
    )
    simulated = report["predicted"]["simulated"]
    assert simulated["step_time_s"] == pytest.approx(expected_run["step_time_s"], rel=1e-9)
    assert simulated["micro_batches"] == 4 and simulated["schedule"] == "1F1B"
    assert simulated["calibration"] == "k80.json" and simulated["cluster"] == "colocrl-2gpu"

    # rank 1 killed in the second step: named with the micro-batch whose forward it ran
    killed = _meshplace_run(
        tmp_path,
        *["--plan", "pipe.json", "--graph", source, "--launcher", "torchrun"],
        *["--micro-batches", "4", "--steps", "3", "--warmup", "1"],
        fault="1:1",
    )
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert killed.stderr.splitlines()[-1] == (
        "meshplace: error: rank 1 was killed by SIGKILL while running the forward of "
        "micro-batch 1 of 4 on stage 1 in step 2; torchrun stopped the other ranks "
        "(exit status 1)"
    ), killed.stderr[-2000:]


def test_a_stage_that_begins_inside_attention_receives_its_views_contiguous(
    tmp_path: Path,
) -> None:
    """A pipelined placement whose second stage begins at ``layers.1.attn.k_proj`` (a cut
    the pipeline placer made on a calibrated host) hands that stage the queries as a
    transposed view, which neither gloo nor NCCL sends ("input tensor has to be
    contiguous"); the runtime sends every value between stages contiguous
    (``contiguous_between_stages``), so the 2-stage GPipe run of 4 micro-batches trains
    as one process does (losses within 1e-5)."""
    import numpy as np

    from meshplace.placers.colocate import complete_placement
    from meshplace.plan import Plan, save_plan

    source, graph = _llama_batch_8(tmp_path)
    compute = [
        i
        for i, o in enumerate(graph.ops)
        if o.phase == "forward" and o.kind not in ("parameter", "buffer", "input")
    ]
    cut = next(k for k, i in enumerate(compute) if graph.ops[i].module == "layers.1.attn.k_proj")
    partial = np.full(graph.num_ops, -1, dtype=np.int64)
    partial[compute[:cut]], partial[compute[cut:]] = 0, 1
    names = [f"gpu{d}" for d in complete_placement(graph, partial, default=0).tolist()]
    plan = Plan.from_devices(graph, "colocrl-2gpu", names, objective="throughput", micro_batches=4)
    save_plan(plan, tmp_path / "cut.json")
    done = run_forked_ranks(
        tmp_path,
        2,
        *["--plan", "cut.json", "--model", source, "--schedule", "GPipe"],
        *["--micro-batches", "4", "--steps", "2", "--warmup", "1", "--json"],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["stage_begins"] == ["", "layers.1.attn.k_proj"]
    expected, _trained = one_process_losses(source, 2)
    assert torch.allclose(
        torch.tensor(report["measured"]["losses"]), torch.tensor(expected), rtol=0, atol=1e-5
    )
