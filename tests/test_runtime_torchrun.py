"""A sharding plan run by torchrun on 2 gloo ranks: ``meshplace run --plan`` starts
``torchrun -m meshplace.runtime``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshplace.graph.capture import as_loss, capture
from meshplace.graph.sources import load_build_function
from meshplace.hardware import load_cluster
from meshplace.parallel.search import shard_graph
from tests.forked_cli import run_meshplace
from tests.forked_ranks import free_port, run_forked_ranks
from tests.test_runtime_faults import session_processes, wait_for

MODEL = """\
import torch


def build():
    # on the meta device, as a model too big for one rank is built: the runtime creates
    # only each rank's blocks
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        )
    return model, (torch.randn(32, 64),)
"""

# the same MLP built with real parameters: a pure data-parallel plan of it runs on DDP or
# FSDP2 (a model built on the meta device stays on DTensor, which creates it by blocks)
MODEL_ON_THE_HOST = MODEL.replace('    with torch.device("meta"):\n', "    if True:\n")
assert MODEL_ON_THE_HOST != MODEL


def one_process_losses(source: str, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The losses of ``steps`` Adam steps (lr 1e-3) of the ``FILE.py:build`` model in one
    process, built from seed 0 as every rank builds it (a model built on the meta device
    gets the runtime's initial values); and the trained model."""
    from meshplace.runtime.program import concrete_inputs, materialize

    torch.manual_seed(0)
    built = load_build_function(source)()
    model, args = built[0], list(built[1])
    kwargs = built[2] if len(built) > 2 else {}
    # inputs on the meta device: the values every rank makes of them
    values = concrete_inputs([*args, *kwargs.values()])
    args, kwargs = values[: len(args)], dict(zip(kwargs, values[len(args) :], strict=True))
    if any(p.is_meta for p in model.parameters()):  # the runtime's per-name initial values
        model = materialize(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss, _how = as_loss(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model


def trained_like_one_process(report: dict, source: str, checkpoint: Path, steps: int) -> None:
    """The run's losses, and its parameters gathered whole into ``checkpoint``, equal
    ``steps`` Adam steps of one process within 1e-5 (the reductions run in another
    order)."""
    expected, trained = one_process_losses(source, steps)
    assert torch.allclose(
        torch.tensor(report["measured"]["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6
    )
    saved = torch.load(checkpoint / "rank0.pt")
    reference = dict(trained.named_parameters())
    assert sorted(saved) == sorted(reference)
    for name, value in saved.items():
        assert torch.allclose(value, reference[name].detach(), rtol=1e-5, atol=1e-6), name


def _meshplace_run(tmp_path: Path, *args: str, fault: str = "") -> subprocess.CompletedProcess:
    """``meshplace run ARGS`` (a sharding plan: torchrun ``--standalone``, so a free
    rendezvous port on 127.0.0.1 for this test alone); ``fault``: ``"RANK:STEP"``, that
    rank kills itself in that step (``MESHPLACE_TORCHRUN_FAULT``). The command runs in a
    fork of this process (tests/forked_cli.py); torchrun and its ranks are real processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHPLACE_TORCHRUN_FAULT": fault}
    return run_meshplace(["run", *args], cwd=tmp_path, env=env, timeout=240)


def test_a_plan_trains_under_torchrun_like_one_process_and_each_rank_holds_its_share(
    tmp_path: Path,
) -> None:
    source = f"{tmp_path / 'mlp.py'}:build"
    (tmp_path / "mlp.py").write_text(MODEL)
    torch.manual_seed(0)
    model, (x,) = load_build_function(source)()
    graph = capture(model, (x,), training=True)
    # ZeRO 3 the only weight-update sharding offered: a parameter the plan replicates is
    # sharded as FSDP shards it (offered every stage, the solver's ties among plans whose
    # communication all hides behind compute decide which, if any, it picks)
    plan = shard_graph(graph, load_cluster("dgx-h100"), chips=2, zero_stages=(3,)).best.plan_file(
        source, "dgx-h100"
    )
    zero = {n: p["zero"] for n, p in plan["parameters"].items()}
    assert any(zero.values()), zero  # weight-update sharding is exercised
    assert any("Shard" in " ".join(p["placements"]) for p in plan["parameters"].values())
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    # the whole model's parameters and Adam state exceed the budget; one rank's share not
    whole = 3 * sum(p.numel() * 4 for p in model.parameters())
    memory = plan["predicted"]["memory_bytes"]
    share = sum(memory.get(k, 0) for k in ("parameters", "buffers", "optimizer_state", "inputs"))
    budget = int(share + whole) // 2
    assert share < budget < whole
    done = _meshplace_run(
        tmp_path, "--plan", "plan.json", "--steps", "3", "--warmup", "1", "--json",
        "--memory-budget", str(budget), "--checkpoint-dir", "ck",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout)  # rank 0 prints exactly one JSON document
    trained_like_one_process(report, source, tmp_path / "ck", steps=3)
    assert report["world_size"] == 2 and report["steps"] == 3 and report["warmup"] == 1
    assert report["measured"]["step_time_s"] > 0
    cpu = report["measured"]["cpu_time_s_per_rank"]  # each rank's process, in the step
    assert len(cpu) == 2 and all(c > 0 for c in cpu), cpu
    # each rank holds its block of every parameter, gradient and Adam moment exactly as
    # predicted, ZeRO-3's parameter shards included
    assert 3 in zero.values(), zero
    memory = report["memory_per_rank"]
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert memory[kind]["measured"] == [memory[kind]["predicted"]] * 2, kind
    assert report["notes"] == []
    # and the step as DTensor ran it (rank 0's warm-up step recorded), costed on the
    # plan's cluster: ZeRO-3 gathers its parameter shards, so there are collectives
    engine = report["predicted"]["engine"]
    assert engine["cluster"] == "dgx-h100" and engine["kernels"] > 0
    assert engine["collectives"].get("all_gather", 0) >= 1, engine["collectives"]
    assert engine["step_s"] == pytest.approx(
        engine["compute_s"] + engine["dispatch_s"] + engine["communication_s"]
    )


@pytest.mark.parametrize("zero,engine", [(0, "ddp"), (1, "ddp"), (2, "dtensor"), (3, "fsdp2")])
def test_a_pure_data_parallel_plan_runs_on_ddp_or_fsdp2_like_one_process(
    tmp_path: Path, zero: int, engine: str
) -> None:
    """An MLP's dp2 grid point runs on PyTorch's own data-parallel engine (ZeRO 0: DDP;
    ZeRO 1: DDP, each rank's Adam updating its half of every parameter, the halves
    gathered back in one flat all-gather; ZeRO 2: DTensor, the gradients reduce-scattered
    onto the halves in one flat reduce-scatter; ZeRO 3: FSDP2), trains as one process
    does, and each rank holds the parameter, gradient and Adam bytes the plan predicts
    (ZeRO 1: half the Adam state; ZeRO 2: half the gradients too; ZeRO 3: half of each).
    (An MLP: the
    parameters of a model with near-zero gradients, such as the Llama example's
    attention, are off by up to 1e-3 after three Adam steps on either engine, DTensor
    included — Adam's first steps move a weight by about the learning rate whatever its
    gradient's size, so a gradient summed in another order can flip its sign.)"""
    from meshplace.parallel.grid import megatron_grid

    (tmp_path / "mlp.py").write_text(MODEL_ON_THE_HOST)
    source = f"{tmp_path / 'mlp.py'}:build"
    torch.manual_seed(0)
    model, args = load_build_function(source)()
    graph = capture(model, args, training=True)
    grid = megatron_grid(graph, load_cluster("dgx-h100"), chips=2, zero_stages=(zero,))
    point = next(p for p in grid.points if p.dp == 2 and p.fits)
    (tmp_path / "plan.json").write_text(json.dumps(point.plan.plan_file(source, "dgx-h100")))
    # three warm-up steps: the one recorded for the prediction is DDP's steady step
    done = run_forked_ranks(
        tmp_path, 2, "--plan", "plan.json", "--steps", "4", "--warmup", "3", "--json",
        "--checkpoint-dir", "ck",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["engine"] == engine and report["notes"] == []
    trained_like_one_process(report, source, tmp_path / "ck", steps=4)
    memory = report["memory_per_rank"]
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert memory["parameters"]["measured"] == [whole // (2 if zero == 3 else 1)] * 2
    assert memory["optimizer_state"]["measured"] == [2 * whole // (2 if zero else 1)] * 2
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert memory[kind]["measured"] == [memory[kind]["predicted"]] * 2, kind
    # the step as the engine ran it: DDP's bucketed all-reduce (at ZeRO 1 then one
    # all-gather of the updated halves), FSDP2's gathers and reduce-scatters; no DTensor
    # dispatch for DDP
    collectives = report["predicted"]["engine"]["collectives"]
    if zero == 2:
        assert collectives.get("reduce_scatter") == 1, collectives
        assert collectives.get("all_gather") == 1 and "all_reduce" not in collectives
    elif zero < 3:
        assert collectives.get("all_reduce") == 1, collectives
        assert collectives.get("all_gather", 0) == zero, collectives
        assert report["predicted"]["engine"]["dispatched"] == 0
    else:
        assert collectives.get("all_gather", 0) >= 1 and collectives.get("reduce_scatter", 0) >= 1


def test_bad_runs_are_one_sentence_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    from meshplace.cli import main as meshplace_main
    from meshplace.runtime.launch import main as runtime_main
    from meshplace.runtime.launch import uses_cuda

    (tmp_path / "plan.json").write_text(
        json.dumps({"format": "meshplace.parallel_plan", "mesh": {"shape": [4]}, "graph": {}})
    )
    placed = {"format": "meshplace.plan", "version": 1, "graph": "g", "graph_ops": 1}
    placed["placement"] = {"a": "gpu0"}
    (tmp_path / "placed.json").write_text(json.dumps(placed))
    pipe = {**placed, "objective": "throughput", "micro_batches": 2}
    (tmp_path / "pipe.json").write_text(json.dumps(pipe))
    big = {"format": "meshplace.parallel_plan", "mesh": {"shape": [2]}, "graph": {}}
    big["predicted"] = {"memory_bytes": {"parameters": 64.0, "optimizer_state": 128.0}}
    (tmp_path / "big.json").write_text(json.dumps(big))
    (tmp_path / "f").write_text("a file, not a folder")
    env_world = {"WORLD_SIZE": "2", "RANK": "0"}
    # the module as torchrun starts it: one sentence on stderr, nothing on stdout
    done = subprocess.run(
        [sys.executable, "-m", "meshplace.runtime", "--plan", "missing.json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **env_world},
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert "does not exist" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    # every other check runs before torch.distributed is touched: in this process
    monkeypatch.chdir(tmp_path)
    for name, value in env_world.items():
        monkeypatch.setenv(name, value)
    cases = [
        (["--plan", "placed.json", "--micro-batches", "2"], "apply to pipelined placements"),
        (["--plan", "pipe.json", "--schedule", "zigzag"], "choose one of 1F1B, GPipe"),
        (["--plan", "pipe.json", "--memory-budget", "9"], "does not apply to a pipelined"),
        # --micro-batches 1 runs a pipeline as an op placement: its model is looked up
        (["--plan", "pipe.json", "--micro-batches", "1"], "not a model the runtime knows"),
        (["--plan", "big.json", "--model", "m.py:build", "--memory-budget", "9"], "over"),
        (["--plan", "plan.json", "--model", "m.py:build", "--schedule", "GPipe"], "pipelined"),
        (["--plan", "plan.json"], "FILE.py:build"),
        (["--plan", "plan.json", "--model", "m.py:build"], "needs 4 processes, torchrun started 2"),
        (["--plan", "plan.json", "--steps", "2", "--warmup", "2"], "fewer than --steps"),
        (["--plan", "plan.json", "--model", "m.py:build", "--checkpoint-dir", "f"], "is a file"),
        # a placement is predicted on its own cluster unless --cluster names one
        (["--plan", "placed.json", "--calibration", "c.json"], "names no cluster"),
        (
            ["--plan", "placed.json", "--engine", "dtensor"],
            "--engine applies to sharding and hybrid plans",
        ),
    ]
    for args, message in cases:
        assert runtime_main(args) == 2, args
        out, err = capsys.readouterr()
        assert message in err and err.count("\n") == 1, (args, err)
        assert out == ""
    # NCCL runs one rank per GPU: more ranks on this host than GPUs is one sentence with
    # --device cuda (--device auto takes gloo on the CPU)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert runtime_main(["--plan", "plan.json", "--model", "m.py:build", "--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert "--device cuda runs one rank per GPU: 64 ranks on this host" in err, err
    assert err.count("\n") == 1 and out == ""
    assert not uses_cuda("auto", 64) and not uses_cuda("cpu", 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # through meshplace run: the same checks before torchrun starts
    for args, message in (
        (["--plan", "plan.json", "--graph", "m.py:build", "--cluster-out", "c.yaml"], "does not"),
        (["--plan", "plan.json", "--graph", "m.py:build", "--worker-devices", "cuda:0"], "cpu or"),
        (["--plan", "plan.json", "--graph", "m.py:build", "--checkpoint-dir", "f"], "is a file"),
        (["--plan", "plan.json", "--graph", "m.py:build", "--calibration", "no.json"], "no.json"),
        (["--plan", "plan.json", "--graph", "m.py:build", "--cluster", "nowhere"], "nowhere"),
        (["--graph", "mlp", "--placer", "single", "--calibration", "c.json"], "sharding plans"),
        (["--graph", "mlp", "--placer", "single", "--engine", "dtensor"], "sharding plans"),
    ):
        assert meshplace_main(["run", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (args, err)


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
    sentence = (
        "rank 1 was killed by SIGKILL while running the forward of module '0' (Linear) in "
        "step 2; torchrun stopped the other ranks (exit status 1)"
    )
    assert err.splitlines()[-1] == f"meshplace: error: {sentence}"
    assert json.loads(out) == {"error": sentence, "exit_status": 1}
    wait_for(lambda: not session_processes(proc.pid), "every rank to be gone", timeout=30)


def test_a_plan_splitting_a_convolution_over_its_channels_is_refused_in_one_sentence() -> None:
    import pytest

    from meshplace.errors import InputError
    from meshplace.runtime.launch import refuse_channel_split_convolutions

    # batch, height and width splits run (the weights whole); channel splits do not
    refuse_channel_split_convolutions({"ops": {"convolution": "n@x h@y", "mm": "o@x"}})
    for strategy in ("o@x", "n@x i@y"):
        with pytest.raises(InputError, match=r"splits convolution 'convolution_2' over its"):
            refuse_channel_split_convolutions({"ops": {"convolution_2": strategy}})


def test_two_nodes_on_this_host_run_the_llama_plan(tmp_path: Path) -> None:
    """torchrun's multi-host launch (``--nnodes 2``, one process per "node", rendezvous on
    127.0.0.1) runs the Llama example's plan; the losses are the one-process run's."""
    source = f"{Path(__file__).resolve().parents[1] / 'examples' / 'llama.py'}:build_tiny"
    torch.manual_seed(0)
    model, args, kwargs = load_build_function(source)()
    graph = capture(model, args, example_kwargs=kwargs, training=True)
    plan = shard_graph(graph, load_cluster("dgx-h100"), chips=2).best.plan_file(source, "dgx-h100")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    port = str(free_port())
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


def test_partial_gradients_are_all_reduced_in_buckets(tmp_path: Path) -> None:
    """Data-parallel gradients (partial sums the parameters replicate) are reduced
    together, a bucket per collective: on a world of one every sum is the value itself,
    so each gradient must come back as its own values, shape and the parameter's
    placements, whatever the bucket size; the collectives are one per bucket."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module

    from meshplace.runtime.dryrun import EngineProgram, recorder
    from meshplace.runtime.launch import place_gradients_like_parameters

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        model = distribute_module(model, mesh)  # every parameter a replicated DTensor
        grads = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
        for bucket_bytes, collectives in ((1, 4), (1 << 20, 1)):
            for n, p in model.named_parameters():
                p.grad = DTensor.from_local(grads[n].clone(), mesh, [Partial()], run_check=False)
            program = EngineProgram(world_size=1)
            with recorder(program, {}):
                place_gradients_like_parameters(model, bucket_bytes=bucket_bytes)
            assert sum(c.kind == "all_reduce" for c in program.collectives) == collectives
            for n, p in model.named_parameters():
                assert tuple(p.grad.placements) == (Replicate(),)
                assert torch.equal(p.grad.to_local(), grads[n])
    finally:
        dist.destroy_process_group()


TIED_LANGUAGE_MODEL = """\
import torch


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # GPT's tied embedding and head

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build():
    with torch.device("meta"):  # shapes only, inputs too: GPT's workload is built so
        model = TiedLM()
        ids = torch.empty(4, 8, dtype=torch.long)
        labels = torch.empty(4, 8, dtype=torch.long)
    return model, (ids,), {"labels": labels}
"""


def test_tied_weights_and_meta_inputs_train_as_one_parameter_like_one_process(
    tmp_path: Path,
) -> None:
    """A model whose head is its embedding (GPT-124M's) built on the meta device, inputs
    too: the plan names the tied weight once, every alias gets the same DTensor (else the
    head trains a second tensor the plan has no entry for), and the meta inputs become the
    values one process trains on. A world of one, in this process."""
    import torch.distributed as dist

    from meshplace.runtime.launch import ShardedTraining

    source = f"{tmp_path / 'tied.py'}:build"
    (tmp_path / "tied.py").write_text(TIED_LANGUAGE_MODEL)
    model, args, kwargs = load_build_function(source)()
    graph = capture(model, args, example_kwargs=kwargs, training=True)
    plan = shard_graph(graph, load_cluster("dgx-h100"), chips=1).best.plan_file(source, "dgx-h100")
    assert sorted(plan["parameters"]) == ["embed.weight", "mix.bias", "mix.weight"]
    expected, trained = one_process_losses(source, 3)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        training = ShardedTraining(plan, source, lr=1e-3, device_type="cpu")
        assert training.model.head.weight is training.model.embed.weight
        losses = [training.loss_value(training.step()[0]) for _ in range(3)]
        weights = {n: p.detach().full_tensor() for n, p in training.model.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert torch.allclose(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert sorted(weights) == sorted(n for n, _ in trained.named_parameters())
    for name, value in trained.named_parameters():
        assert torch.allclose(weights[name], value.detach(), rtol=1e-5, atol=1e-6), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_plan_runs_on_a_gpu_under_nccl_like_one_process(
    tmp_path: Path,
) -> None:  # pragma: no cover
    """``--worker-devices cuda``: one rank per GPU on NCCL (a one-chip plan, so one GPU
    does), the meta-built model created on the GPU block by block; the losses and
    parameters are one CPU process's to float32 rounding, the state bytes the plan's, and
    the peak memory CUDA's."""
    source = f"{tmp_path / 'mlp.py'}:build"
    (tmp_path / "mlp.py").write_text(MODEL)
    model, args = load_build_function(source)()
    graph = capture(model, args, training=True)
    plan = shard_graph(graph, load_cluster("dgx-h100"), chips=1).best.plan_file(source, "dgx-h100")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = _meshplace_run(
        tmp_path, "--plan", "plan.json", "--worker-devices", "cuda", "--steps", "3",
        "--warmup", "1", "--json", "--checkpoint-dir", "ck",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["device"] == "cuda" and report["peak_kind"] == "cuda max_memory_allocated"
    expected, trained = one_process_losses(source, 3)
    assert report["measured"]["losses"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    saved = torch.load(tmp_path / "ck" / "rank0.pt")
    for name, value in trained.named_parameters():
        torch.testing.assert_close(saved[name].cpu(), value.detach(), rtol=1e-4, atol=1e-5)
    memory = report["memory_per_rank"]
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert memory[kind]["measured"] == [memory[kind]["predicted"]], kind
    assert report["peak_bytes_per_rank"][0] >= memory["parameters"]["measured"][0]


def test_the_text_report_shows_each_ranks_peak_beside_both_predictions(capsys) -> None:
    """The report's text names the measured peak per rank with what it measures, beside
    the plan's liveness peak and the solver's bound (what ``--json`` carries)."""
    from meshplace.runtime.launch import print_report

    report = {
        "model": "m.py:build",
        "world_size": 2,
        "device": "cuda",
        "mesh": {"shape": [2]},
        "steps": 3,
        "warmup": 1,
        "measured": {"step_time_s": 0.01, "losses": [1.0, 0.5, 0.25]},
        "predicted": {
            "step_time_s": 0.009,
            "cluster": "dgx-h100",
            "live_peak_bytes": 3 * 2**20,
            "peak_memory_bytes": 4 * 2**20,
        },
        "memory_per_rank": {"parameters": {"predicted": 8.0, "measured": [8, 8]}},
        "peak_bytes_per_rank": [3 * 2**20, 5 * 2**19],
        "peak_kind": "cuda max_memory_allocated",
        "notes": [],
    }
    print_report(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "m.py:build on a 2 mesh of 2 cuda ranks"
    assert "parameters bytes: predicted 8.0, measured per rank [8, 8]" in lines
    assert lines[-1] == (
        "peak memory per rank: measured 3.0, 2.5 MiB (cuda max_memory_allocated); "
        "predicted 3.0 MiB live tensors or 4.0 MiB the solver's bound"
    )
