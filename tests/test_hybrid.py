"""The joint hybrid search (issue 18): the pipeline DP equals brute force, every chosen
plan fits by the model's own accounting, and the CLI prints one plan."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplace.cli import main
from meshplace.errors import InputError
from meshplace.graph.capture import capture
from meshplace.graph.ir import Op, OpGraph
from meshplace.hardware import load_cluster
from meshplace.models import gpt
from meshplace.parallel import hybrid
from meshplace.parallel.sharding import ShardingError
from tests.forked_cli import run_meshplace


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda p: st.tuples(
            st.just(p),
            st.integers(p, 7),
            st.integers(1, 2),
            st.integers(1, 9),
            st.integers(0, 2**32 - 1),
        )
    )
)
def test_the_pipeline_dp_equals_brute_force(case) -> None:
    p, layers, options, micro_batches, seed = case
    rng = np.random.default_rng(seed)
    times = rng.integers(1, 20, size=(p, layers + 1, options)).astype(float)
    times = np.cumsum(times, axis=1) if seed % 2 else times  # monotone in k, or not at all
    feasible = rng.random((p, layers + 1, options)) < 0.8
    got = hybrid.best_split(times, feasible, micro_batches)
    want = hybrid.brute_force_split(times, feasible, micro_batches)
    assert got[0] == pytest.approx(want[0])
    if np.isfinite(got[0]):
        value = [times[i, k, r] for i, (k, r) in enumerate(zip(got[1], got[2], strict=True))]
        assert sum(got[1]) == layers and all(k >= 1 for k in got[1])
        assert all(feasible[i, k, r] for i, (k, r) in enumerate(zip(got[1], got[2], strict=True)))
        assert sum(value) + (micro_batches - 1) * max(value) == pytest.approx(got[0])


@functools.cache
def _tiny_graphs(batch: int) -> OpGraph:
    """A 2-layer GPT of width 256 over a vocabulary of 512 and 32 tokens (captured once per
    batch: the searches only read it)."""
    with torch.device("meta"):
        model = gpt.GPT(gpt.Config(2, 256, 4), vocab=512, context=32)
    ids = torch.zeros(batch, 32, dtype=torch.int64)
    return capture(model, (ids, ids), training=True, name=f"tiny-b{batch}")


@pytest.fixture(scope="module")
def tiny_result() -> hybrid.HybridResult:
    return hybrid.hybrid_search(
        "tiny", None, load_cluster("h2-8xh100"), global_batch=16,
        tensor_parallel=(1, 2), micro_batch_sizes=(1, 2), graphs=_tiny_graphs, layers=8,
        simulate_top=1000,
    )  # fmt: skip


def test_an_engine_reprices_tensor_parallel_parts_and_a_failing_one_skips_them(
    tiny_result,
) -> None:
    """With ``engine``, every (tp >= 2, micro-batch)'s parts cost what the engine says the
    whole model costs (forward and backward per micro-batch, the optimizer's step), shared
    among the parts as the solver shares them; tp 1 keeps the solver's; where the engine
    cannot run a (tp, micro-batch), its plans are gone and the reason is in ``skipped``."""
    asked = []

    def engine(parts, layers, container, devices):
        asked.append((parts.tp, parts.micro_batch, layers, container, len(devices)))
        if parts.micro_batch == 1:
            raise InputError("the engine cannot run it")
        return hybrid.EngineCost(forward_backward_s=0.25, update_s=0.125)

    r = hybrid.hybrid_search(
        "tiny", None, load_cluster("h2-8xh100"), global_batch=16,
        tensor_parallel=(1, 2), micro_batch_sizes=(1, 2), graphs=_tiny_graphs, layers=8,
        simulate_top=1000, engine=engine,
    )  # fmt: skip
    # each (tp 2, micro-batch) once per layout: the solver's, and Megatron's where it differs
    megatron = [k for k in r.skipped if k.endswith(" megatron")]
    assert sorted(set(asked)) == [(2, 1, 8, "layers", 2), (2, 2, 8, "layers", 2)]
    assert len(asked) == 4 and megatron == ["tp2 mb1 megatron"]
    assert r.skipped["tp2 mb1"] == "the engine cannot run it"
    assert not [p for p in r.plans if p.tp == 2 and p.config.micro_batch == 1]
    pc = r.part_costs[(2, 2)]
    counts = {"pre": 1, "layer": 8, "post": 1}
    parts = {k: getattr(pc, k) for k in counts}
    assert sum(n * (parts[k].forward_s + parts[k].backward_s) for k, n in counts.items()) == (
        pytest.approx(0.25)
    )
    assert sum(n * parts[k].update_s for k, n in counts.items()) == pytest.approx(0.125)
    solver = tiny_result.part_costs[(2, 2)]
    ratio = pc.layer.forward_s / solver.layer.forward_s
    assert pc.pre.backward_s == pytest.approx(solver.pre.backward_s * ratio)
    assert pc.layer.parameter_bytes == solver.layer.parameter_bytes
    assert replace(r.part_costs[(1, 2)], solve_s=0) == replace(
        tiny_result.part_costs[(1, 2)], solve_s=0
    )
    same = {p.config: p.time_per_batch_s for p in tiny_result.plans if p.tp == 1}
    assert {p.config: p.time_per_batch_s for p in r.plans if p.tp == 1} == same


def test_parts_add_up_to_the_whole_step() -> None:
    """The three parts' FLOPs are the captured step's forward and backward (model FLOPs,
    not the optimizer's), counting the probe layer twice."""
    g = _tiny_graphs(2)
    pc = hybrid.part_costs(g, load_cluster("h2-8xh100"), 1, 2)
    total = sum(o.flops for o in g.ops if o.phase != "update")
    assert pc.pre.flops + 2 * pc.layer.flops + pc.post.flops == pytest.approx(total, rel=1e-9)
    assert pc.layer.forward_s > 0 and pc.layer.backward_s > pc.layer.forward_s
    assert pc.layer.parameter_bytes > 0 and pc.layer.state_bytes == 2 * pc.layer.parameter_bytes
    assert pc.boundary_bytes == 2 * 32 * 256 * 4  # the residual stream, float32
    assert pc.tied_bytes == 512 * 256 * 4  # the embedding the head reuses


def test_the_stage_solve_minimises_what_the_parts_charge() -> None:
    """The intra-stage solve charges every collective in full, as the parts charge them on
    every micro-batch: what the parts attribute to the whole 2-layer graph is the solve's
    own step, and the layout the overlapped timeline would choose costs the parts more
    (3-17 % on this model at tp 2-8)."""
    from meshplace.mesh.layout import build_mesh
    from meshplace.parallel.sharding import ShardingProblem

    g = _tiny_graphs(2)
    cluster = load_cluster("h2-8xh100")

    def charged(problem: ShardingProblem, choice: list[int]) -> float:
        acc, _ = hybrid._attributed_costs(problem, choice, lambda i: "all", ["all"], set())
        return sum(acc["all"].get(k, 0.0) for k in ("forward_s", "backward_s", "update_s"))

    for tp in (2, 8):
        problem, choice = hybrid._solve_over_tp(g, cluster, tp, None, "eager", 20.0)
        assert charged(problem, choice) == pytest.approx(problem.timeline(choice)["step_s"])
        mesh = build_mesh(cluster, (tp,), chips=tp)
        overlapped = ShardingProblem(g, mesh, zero_stages=(0,), overlap=True)
        solution = overlapped.cost_tables().solve(float("inf"), time_limit_s=20.0)
        theirs = [
            solution.choice[int(overlapped.class_of[i])] for i in range(len(overlapped.groups))
        ]
        assert overlapped.timeline(theirs)["step_s"] < charged(overlapped, theirs)
        assert charged(problem, choice) < charged(overlapped, theirs)


def test_every_configuration_is_searched_and_the_best_fits(tiny_result) -> None:
    r = tiny_result
    # tp 1 and 2 at micro-batches 1 and 2, and Megatron's pattern at tp 2 (it differs)
    assert r.solves == 6 and r.layers == 8 and set(r.megatron_part_costs) == {(2, 1), (2, 2)}
    assert {p.tensor_layout for p in r.plans if p.tp == 2} == {"solver", "megatron"}
    best = r.best
    assert best.fits and best.dp * best.tp * best.pp == 16
    assert sum(best.layers_per_stage) == 8
    cluster = load_cluster("h2-8xh100")
    checked = 0
    for p in r.plans:
        c = p.config
        assert c.dp * c.micro_batch * c.micro_batches == 16
        if c.schedule not in ("1f1b", "gpipe"):
            continue
        # each stage's memory is its resident bytes, its kept activations times the
        # micro-batches the schedule holds (1F1B: min(p - i, m); GPipe: m), its working set
        pc = r.costs_of(p)
        devices = np.array(cluster.ring_order(hybrid.accelerators(cluster))[: c.dp * c.tp])
        mesh = hybrid.mesh_over(cluster, devices.reshape(c.dp, c.tp), ("data", "tensor"))
        model = hybrid._stage_model(pc, c, 8, mesh, "data" if c.dp > 1 else None)
        flight = np.minimum(c.pp - np.arange(c.pp), c.micro_batches)
        if c.schedule == "gpipe":
            flight = np.full(c.pp, c.micro_batches)
        for i, (k, rec) in enumerate(zip(p.layers_per_stage, p.recompute, strict=True)):
            o = hybrid.RECOMPUTE.index(rec)
            want = model["resident"][i, k, o] + flight[i] * model["kept"][i, k, o]
            want += model["transient"][i, k, o]
            assert p.stage_memory_bytes[i] == pytest.approx(want)
        checked += 1
    assert checked > 10
    assert {p.config.schedule for p in r.plans if p.pp > 1} >= {"1f1b", "gpipe"}
    assert all(p.config.zero in hybrid.PIPELINE_ZERO for p in r.plans if p.pp > 1)


def test_oom_plans_are_never_chosen() -> None:
    """Below the memory the unconstrained best plan needs, the search picks another plan
    (recomputation, more stages) that fits; with room for none, one sentence says so."""
    cluster = load_cluster("h2-8xh100")
    kwargs = dict(
        global_batch=16, tensor_parallel=(1,), micro_batch_sizes=(1,), graphs=_tiny_graphs,
        layers=8, simulate_top=1000, zero_stages=(0, 1),
    )  # fmt: skip
    free = hybrid.hybrid_search("tiny", None, cluster, **kwargs).best
    capacity = cluster.devices[hybrid.accelerators(cluster)[0]].spec.memory_bytes
    fraction = 0.99 * max(free.stage_memory_bytes) / capacity
    tight = hybrid.hybrid_search("tiny", None, cluster, memory_fraction=fraction, **kwargs)
    best = tight.best
    assert best.fits and max(best.stage_memory_bytes) <= fraction * capacity
    assert best.config != free.config or best.recompute != free.recompute
    assert best.time_per_batch_s >= free.time_per_batch_s  # the unconstrained one was best
    assert any(not p.fits for p in tight.plans)  # OOM plans are listed, never chosen
    with pytest.raises(ShardingError, match="no hybrid plan"):
        _ = hybrid.hybrid_search("tiny", None, cluster, memory_fraction=1e-9, **kwargs).best


def test_zero_stages_divide_what_they_shard_and_the_last_stage_holds_the_tied_embedding() -> None:
    cluster = load_cluster("h2-8xh100")
    pc = hybrid.part_costs(_tiny_graphs(1), cluster, 1, 1)
    mesh = hybrid.mesh_over(cluster, np.array(hybrid.accelerators(cluster)[:8]).reshape(8, 1))
    L, pre, post = pc.layer, pc.pre, pc.post
    for z in range(4):
        config = hybrid.HybridConfig(1, 8, 1, 1, 2, z, "1f1b")
        model = hybrid._stage_model(pc, config, 8, mesh, "x")
        P = 8 * L.parameter_bytes + pre.parameter_bytes + post.parameter_bytes
        G = 8 * L.gradient_bytes + pre.gradient_bytes + post.gradient_bytes
        S = 8 * L.state_bytes + pre.state_bytes + post.state_bytes
        want = P / (8 if z >= 3 else 1) + G / (8 if z >= 2 else 1) + S / (8 if z >= 1 else 1)
        assert model["resident"][0, 8, 0] == pytest.approx(want)
    two = hybrid._stage_model(pc, hybrid.HybridConfig(2, 8, 1, 1, 2, 0, "1f1b"), 8, mesh, "x")
    share = pc.tied_bytes / pre.parameter_bytes
    assert 0 < share <= 1
    copy = share * (pre.parameter_bytes + pre.gradient_bytes + pre.state_bytes)
    last = 4 * (L.parameter_bytes + L.gradient_bytes + L.state_bytes)
    last += post.parameter_bytes + post.gradient_bytes + post.state_bytes
    assert two["resident"][1, 4, 0] == pytest.approx(last + copy)


def test_data_parallelism_crosses_hosts_and_tensor_parallelism_stays_inside() -> None:
    """dp 2 x tp 8 on two hosts of 8: the data axis runs over the network, so its
    all-reduce is slower than the tensor axis's over NVSwitch."""
    cluster = load_cluster("h2-8xh100")
    devices = np.array(cluster.ring_order(hybrid.accelerators(cluster))).reshape(2, 8)
    assert len({cluster.devices[d].host for d in devices[0]}) == 1  # a row is one host
    mesh = hybrid.mesh_over(cluster, devices, ("data", "tensor"))
    data = mesh.collective_time("all_reduce", 1e9, ["data"])
    tensor = mesh.collective_time("all_reduce", 1e9, ["tensor"])
    assert data > 3 * tensor


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12)])
def test_interleaved_memory_counts_what_the_schedule_holds(p: int, m: int) -> None:
    """The DP's in-flight count for interleaving, (p v + p - 1 - 2 i) / v stage-micro-batches
    on device i, is the simulated schedule's peak of chunk-micro-batches over v."""
    from meshplace.sim.schedule import StageTimes, simulate_schedule

    v = hybrid.INTERLEAVE_CHUNKS
    result = simulate_schedule(StageTimes.uniform(p * v, 1.0, 2.0), "interleaved", m, v)
    formula = np.minimum((p * v + p - 1 - 2 * np.arange(p)) / v, m)
    assert np.allclose(np.array(result.peak_in_flight) / v, formula)


def test_full_recomputation_trades_time_for_memory() -> None:
    cluster = load_cluster("h2-8xh100")
    pc = hybrid.part_costs(_tiny_graphs(1), cluster, 1, 1)
    config = hybrid.HybridConfig(2, 8, 1, 1, 2, 0, "1f1b")
    mesh = hybrid.build_mesh(cluster, (8, 1), chips=8)
    model = hybrid._stage_model(pc, config, 8, mesh, mesh.axis_names[0])
    assert np.all(model["backward"][:, 1:, 1] > model["backward"][:, 1:, 0])
    assert np.all(model["kept"][:, 1:, 1] < model["kept"][:, 1:, 0])


def test_the_joint_search_is_no_worse_than_the_megatron_grid() -> None:
    """Both scored by the same model and every plan simulated: on this model the joint
    plan is at least as fast (the benchmark measures the gap at scale)."""
    cluster = load_cluster("h2-8xh100")
    kwargs = dict(
        global_batch=16, tensor_parallel=(1, 2), micro_batch_sizes=(1,), graphs=_tiny_graphs,
        layers=8, simulate_top=1000,
    )  # fmt: skip
    joint = hybrid.hybrid_search("tiny", None, cluster, **kwargs)
    grid = hybrid.hybrid_search("tiny", None, cluster, style="megatron", **kwargs)
    assert joint.best.time_per_batch_s <= grid.best.time_per_batch_s
    for p in grid.plans:  # what the grid allows
        assert len(set(p.layers_per_stage)) == 1 and len(set(p.recompute)) == 1
        assert p.config.zero in hybrid.PIPELINE_ZERO


def test_the_joint_search_holds_every_plan_the_grid_simulates() -> None:
    """Where the solver lays tensor parallelism out otherwise than Megatron's pattern, the
    joint search also solves that pattern and simulates the grid's own best plans, so each
    plan the grid simulates is in the joint result at the same time: the joint best is
    never slower than the grid's, whatever ``simulate_top`` cuts."""
    cluster = load_cluster("h2-8xh100")
    kwargs = dict(
        global_batch=16, tensor_parallel=(2,), micro_batch_sizes=(1, 2), graphs=_tiny_graphs,
        layers=8, simulate_top=3,
    )  # fmt: skip
    joint = hybrid.hybrid_search("tiny", None, cluster, **kwargs)
    grid = hybrid.hybrid_search("tiny", None, cluster, style="megatron", **kwargs)
    for key, pc in grid.part_costs.items():  # the two layouts differ: not a vacuous check
        assert pc.tensor_placements != joint.part_costs[key].tensor_placements
    assert joint.solves == 2 * grid.solves

    def same(p: hybrid.HybridPlan, q: hybrid.HybridPlan) -> bool:
        return (p.config, p.layers_per_stage, p.recompute, p.tensor_placements) == (
            q.config, q.layers_per_stage, q.recompute, q.tensor_placements
        )  # fmt: skip

    simulated = [p for p in grid.plans if not math.isnan(p.time_per_batch_s)]
    assert len(simulated) == 3
    for p in simulated:
        assert [q.time_per_batch_s for q in joint.plans if same(p, q)] == [p.time_per_batch_s]
    assert joint.best.time_per_batch_s <= grid.best.time_per_batch_s


def test_cli_prints_one_plan_and_writes_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "hybrid.json"
    argv = ["shard", "gpt", "--size", "124m", "--cluster", "h1-8xh100", "--pipeline", "auto"]
    # in a process of its own: stdout is exactly one JSON document, whatever HiGHS prints
    done = run_meshplace([*argv, "--chips", "2", "--global-batch", "2", "--json", "--out", out])
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    best = data["best"]
    assert (
        data["method"] == "hybrid" and best["fits"] and data["search"]["sharding_solves"] == 6
    )  # tp 1, 2 x mb 1, 2; Megatron's tp 2
    assert best["dp"] * best["tp"] * best["pp"] == 2 and sum(best["layers_per_stage"]) == 12
    plan = json.loads(out.read_text())
    assert plan["format"] == "meshplace.parallel_plan" and len(plan["stages"]) == best["pp"]
    assert plan["pipeline"]["micro_batches"] == best["micro_batches"]
    # the report draws the schedule (a box per task) and memory per stage
    tasks = best["schedule_tasks"]
    assert len(tasks) == 2 * best["pp"] * best["micro_batches"] * (
        2 if best["schedule"] == "interleaved" else 1
    )
    assert max(t[5] for t in tasks) <= best["time_per_batch_s"] + 1e-12
    result = tmp_path / "hybrid-result.json"
    result.write_text(json.dumps(data))
    assert main(["report", str(result), "--html", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert 'id="chart-schedule"' in page and 'id="chart-stage-memory"' in page
    assert page.count("micro-batch 0 on stage") == 2 * best["pp"] or best["pp"] == 1
    capsys.readouterr()
    for bad, words in (
        (["--global-batch", "0"], "positive"),
        ([], "needs --global-batch"),
        (["--global-batch", "16", "--batch", "4"], "not --batch"),
    ):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1
    assert main(["shard", "dmcca", "--cluster", "h1-8xh100", "--global-batch", "8"]) == 2
    assert "--pipeline auto" in capsys.readouterr().err
    assert main(["shard", "dmcca", "--cluster", "h1-8xh100", "--style", "megatron"]) == 2
    assert "--pipeline auto" in capsys.readouterr().err
    for flag in (["--dtype", "bf16"], ["--no-tie"], ["--optimizer", "sgd"]):
        assert main([*argv, "--global-batch", "16", *flag]) == 2
        err = capsys.readouterr().err
        assert "does not apply to --pipeline auto" in err and err.count("\n") == 1


def test_a_hybrid_plan_of_a_reference_workload_is_refused_by_the_runtime(
    tmp_path: Path, capsys
) -> None:
    """The torchrun runtime builds real weights from FILE.py:build; a hybrid plan of a
    reference workload (built on the meta device) is one sentence, exit 2, before any
    process starts."""
    plan = {"format": "meshplace.parallel_plan", "version": 1, "mesh": {"shape": [2, 1, 1]},
            "graph": {"source": "gpt", "layer_container": "layers"},
            "pipeline": {"schedule": "1f1b", "micro_batches": 2, "global_batch": 2},
            "stages": [{"layers": [0, 1]}, {"layers": [1, 2]}]}  # fmt: skip
    path = tmp_path / "hybrid.json"
    path.write_text(json.dumps(plan))
    assert main(["run", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "FILE.py:build" in err and err.count("\n") == 1


def test_a_strict_class_across_layers_keeps_the_model_in_one_stage() -> None:
    """Issue 17's strict co-location holds in the joint search: a class with ops in two
    layers would be split by any cut between them, so no plan has more than one stage."""

    def tied(batch: int) -> OpGraph:
        g = _tiny_graphs.__wrapped__(batch)  # a capture of its own, marked
        g.meta["strict_colocation"] = True
        for layer in (0, 1):
            op = next(o for o in g.ops if o.module == f"layers.{layer}.mlp.fc")
            op.colocation = "across"
        return g

    cluster = load_cluster("h2-8xh100")
    kwargs = dict(
        global_batch=16, tensor_parallel=(1,), micro_batch_sizes=(1,), layers=8,
        simulate_top=1000,
    )  # fmt: skip
    free = hybrid.hybrid_search("tiny", None, cluster, graphs=_tiny_graphs, **kwargs)
    assert any(p.pp > 1 for p in free.plans)
    result = hybrid.hybrid_search("tiny", None, cluster, graphs=tied, **kwargs)
    assert result.plans and all(p.pp == 1 for p in result.plans)
    assert "'across'" in result.skipped["pipeline"]


def test_a_users_model_file_is_searched_at_each_micro_batch_its_batch_divides(capsys) -> None:
    """`file.py:build` (no depth to vary): captured on the first rows of its inputs at each
    micro-batch size that divides its batch (build_tiny: 2 sequences, so 1 and 2), its own
    layer stack; a micro-batch size its batch does not divide is skipped."""
    example = Path(__file__).resolve().parents[1] / "examples" / "llama.py"
    argv = ["shard", f"{example}:build_tiny", "--cluster", "dgx-h100", "--chips", "2"]
    assert main([*argv, "--pipeline", "auto", "--global-batch", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["best"]
    assert data["layers"] == 2 and best["micro_batch"] in (1, 2)  # build_tiny: 2 layers
    assert best["dp"] * best["micro_batch"] * best["micro_batches"] == 8
    assert data["search"]["sharding_solves"] == 6  # tp 1 and 2 x micro-batches of 1 and 2
    assert main([*argv, "--pipeline", "auto", "--global-batch", "3", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["micro_batch"] == 1 and best["dp"] * best["micro_batches"] == 3


def test_a_fixed_depth_workload_is_captured_at_each_micro_batch_size(capsys) -> None:
    """A reference workload whose depth is fixed (rnnlm: two LSTM layers) but whose batch
    is not: the whole model at micro-batches of 1 and 2 sequences, so the search may
    split the global batch as it likes (not only at the workload's own batch). (A global
    batch of 2, not 8: each micro-batch size is a capture of the unrolled LSTMs, ~5 s, and
    two sizes show that each one is captured as well as four do.)"""
    argv = ["shard", "rnnlm", "--cluster", "dgx-h100", "--chips", "2", "--pipeline", "auto"]
    assert main([*argv, "--global-batch", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layers"] == 2
    assert data["search"]["sharding_solves"] == 6  # 2 micro-batch sizes x tp 1 and 2
    sizes = {p["micro_batch"] for p in [data["best"], *data["runners_up"]]}
    assert sizes - {64}  # not only rnnlm's reference batch
    best = data["best"]
    assert best["dp"] * best["micro_batch"] * best["micro_batches"] == 2


@pytest.mark.parametrize(
    ("modules", "words"),
    [
        (["enc.layers.0", "enc.layers.1", "dec.layers.0", "dec.layers.1"], "2 separate layer"),
        (["embed", "head"], "no stack of repeated layers"),
    ],
)
def test_one_stack_of_layers_is_cut(modules, words) -> None:
    g = OpGraph("g")
    for m in modules:
        g.add_op(Op(m, "matmul", module=m, flops=1.0))
    with pytest.raises(InputError, match=words):
        hybrid.layer_container(g)


def _stack(flops: tuple[float, ...], chained: bool) -> OpGraph:
    g = OpGraph("stack")
    g.add_op(Op("embed", "embedding", module="embed", flops=1.0))
    for k, f in enumerate(flops):
        g.add_op(Op(f"l{k}", "matmul", module=f"layers.{k}.mlp.0", flops=f))
        g.add_op(Op(f"l{k}b", "matmul", module=f"layers.{k}.mlp.1", flops=0.0))
        g.add_edge(f"l{k}", f"l{k}b", 4)
        g.add_edge(f"l{k - 1}b" if chained and k else "embed", f"l{k}", 4)
    return g


@pytest.mark.parametrize(
    ("flops", "chained", "words"),
    [((2.0, 3.0, 2.0), True, "layer 1 has 3"), ((2.0, 2.0, 2.0), False, "does not read")],
)
def test_the_stack_must_be_a_chain_of_identical_layers(flops, chained, words) -> None:
    """The search prices every layer as one and cuts between them: a layer that differs,
    or layers that are parallel branches, are refused in one sentence."""
    good = _stack((2.0, 2.0, 2.0), chained=True)
    assert hybrid.layer_container(good) == "layers"  # not layers.N.mlp, a Sequential inside
    hybrid.check_layer_stack(good, *hybrid.op_parts(good, "layers"))
    bad = _stack(flops, chained)
    with pytest.raises(InputError, match=words):
        hybrid.check_layer_stack(bad, *hybrid.op_parts(bad, "layers"))


def test_one_device_stages_pay_no_engine_dispatch() -> None:
    """A stage with neither data nor tensor parallelism runs plain tensors under torchrun,
    so the engine's per-op dispatch (a calibration's ``dispatch_overhead_s``) is charged to
    stages of several devices only: a pipeline of one-device stages costs what it costs
    without dispatch; data parallelism over the same chips costs more."""
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind

    def search(cost_model: CostModel) -> dict[tuple[int, int, int], float]:
        r = hybrid.hybrid_search(
            "tiny", None, cluster, chips=2, global_batch=4, tensor_parallel=(1,),
            micro_batch_sizes=(2,), graphs=_tiny_graphs, layers=2, simulate_top=1000,
            schedules=("gpipe",), zero_stages=(0,), cost_model=cost_model,
        )  # fmt: skip
        return {(p.pp, p.dp, p.tp): p.time_per_batch_s for p in r.plans}

    plain = search(CostModel())
    engine = search(CostModel(dispatch_overhead={kind: 1e-4}))
    assert engine[(2, 1, 1)] == pytest.approx(plain[(2, 1, 1)], rel=1e-12)
    assert engine[(1, 2, 1)] > plain[(1, 2, 1)] + 1e-4 * 100  # hundreds of ops, each 0.1 ms


def test_synchronous_gradients_cost_exposed_bucketed_all_reduces() -> None:
    """``synchronous_gradients`` scores data parallelism as meshplace's runtime runs it:
    a stage with ZeRO on DTensor, its gradients all-reduced after the schedule in buckets
    of ``GRADIENT_BUCKET_BYTES``, none hidden behind the backward (the default model hides
    the reduction behind the backward): the stage's synchronisation is exactly one
    all-reduce per bucket, then one all-gather of the updated parameters per bucket of as
    many bytes (ZeRO 1); at ZeRO 2 one reduce-scatter per bucket instead, once, where the
    default model reduce-scatters after every micro-batch's backward; a data-parallel
    stage without ZeRO on DDP, which hides it as the default model does."""
    import math

    from meshplace.cost.collectives import GRADIENT_BUCKET_BYTES
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind
    latency = 1e-3
    cost_model = CostModel(
        collectives={
            kind: {
                "all_reduce": (latency, 1e10),
                "all_gather": (2 * latency, 1e10),
                "reduce_scatter": (latency / 2, 1e10),
            }
        }
    )

    def search(synchronous: bool, model: CostModel = cost_model) -> hybrid.HybridResult:
        return hybrid.hybrid_search(
            "tiny", None, cluster, chips=2, global_batch=4, tensor_parallel=(1,),
            micro_batch_sizes=(2,), graphs=_tiny_graphs, layers=2, simulate_top=1000,
            schedules=("gpipe",), zero_stages=(0, 1, 2), pipeline_degrees=(1,),
            cost_model=model, synchronous_gradients=synchronous,
        )  # fmt: skip

    overlapped, synchronous = search(False), search(True)
    pc = synchronous.part_costs[(1, 2)]
    grads = pc.pre.gradient_bytes + 2 * pc.layer.gradient_bytes + pc.post.gradient_bytes
    buckets = max(1, math.ceil(grads / GRADIENT_BUCKET_BYTES))
    params = pc.pre.parameter_bytes + 2 * pc.layer.parameter_bytes + pc.post.parameter_bytes
    gathers = max(1, math.ceil(params / GRADIENT_BUCKET_BYTES))
    dp2 = {(p.dp, p.config.zero): p for p in overlapped.plans}
    dp2_sync = {(p.dp, p.config.zero): p for p in synchronous.plans}
    assert dp2_sync[(2, 1)].time_per_batch_s >= dp2[(2, 1)].time_per_batch_s  # none hidden
    # one collective per bucket, not per parameter tensor (of which a GPT layer has many)
    assert pc.layer.parameter_tensors >= 4 and buckets < pc.layer.parameter_tensors
    assert sum(dp2_sync[(2, 1)].sync_s) == pytest.approx(
        buckets * cluster_collective(cluster, cost_model, grads / buckets)
        + gathers * cluster_collective(cluster, cost_model, params / gathers, "all_gather"),
        rel=1e-6,
    )
    assert sum(dp2_sync[(2, 2)].sync_s) == pytest.approx(
        buckets * cluster_collective(cluster, cost_model, grads / buckets, "reduce_scatter")
        + gathers * cluster_collective(cluster, cost_model, params / gathers, "all_gather"),
        rel=1e-6,
    )
    # the micro-batches' reduce-scatters, which the default model charges on the backward
    # (exposed where they outlast it, as 0.5 ms do here), are not the runtime's
    scatter = cluster_collective(cluster, cost_model, grads, "reduce_scatter")
    assert sum(dp2[(2, 2)].stage_backward_s) >= scatter
    assert dp2_sync[(2, 2)].stage_backward_s == pytest.approx(dp2_sync[(2, 1)].stage_backward_s)
    assert sum(dp2_sync[(2, 1)].stage_backward_s) < scatter
    # ZeRO 0: DDP's reduction, hidden behind the backward as the default model hides it
    assert dp2_sync[(2, 0)].time_per_batch_s == pytest.approx(dp2[(2, 0)].time_per_batch_s)
    assert sum(dp2_sync[(2, 0)].sync_s) == pytest.approx(sum(dp2[(2, 0)].sync_s))
    # and DDP's stages run plain tensors: DTensor's dispatch is charged to ZeRO 1 only
    dispatched = search(True, replace(cost_model, dispatch_overhead={kind: 1e-4}))
    by_zero = {(p.dp, p.config.zero): p.time_per_batch_s for p in dispatched.plans}
    assert by_zero[(2, 0)] == pytest.approx(dp2_sync[(2, 0)].time_per_batch_s)
    assert by_zero[(2, 1)] > dp2_sync[(2, 1)].time_per_batch_s


def _two_chip_plans(
    cluster: Any, cost_model: Any, synchronous: bool = True
) -> dict[tuple[int, int, int], hybrid.HybridPlan]:
    """The tiny model's plans on 2 chips of ``cluster`` (global batch 8, micro-batches of
    2, GPipe, ZeRO 0-1, one or two stages), by (pp, dp, zero)."""
    result = hybrid.hybrid_search(
        "tiny", None, cluster, chips=2, global_batch=8, tensor_parallel=(1,),
        micro_batch_sizes=(2,), graphs=_tiny_graphs, layers=2, simulate_top=1000,
        schedules=("gpipe",), zero_stages=(0, 1), pipeline_degrees=(1, 2),
        cost_model=cost_model, synchronous_gradients=synchronous,
    )  # fmt: skip
    return {(p.pp, p.dp, p.config.zero): p for p in result.plans}


def test_ddp_stages_pay_the_ddp_overhead_per_micro_batch_and_others_do_not() -> None:
    """A cost model's ``ddp_overhead`` (what DDP adds per micro-batch, its hooks) is
    charged on every micro-batch of a stage meshplace's runtime runs on DDP (data
    parallelism, ZeRO 0, ``synchronous_gradients``) and nowhere else: not a ZeRO-1 stage
    (DTensor), not one replica, not the default model (which does not say the engine)."""
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind
    ddp = 1e-3

    def times(model: CostModel, synchronous: bool = True) -> dict[tuple[int, int, int], float]:
        plans = _two_chip_plans(cluster, model, synchronous)
        return {key: plan.time_per_batch_s for key, plan in plans.items()}

    plain, charged = times(CostModel()), times(CostModel(ddp_overhead={kind: ddp}))
    micro_batches = 8 // (2 * 2)  # one stage, two replicas, micro-batches of 2
    assert charged[(1, 2, 0)] - plain[(1, 2, 0)] == pytest.approx(micro_batches * ddp, rel=1e-6)
    for key in [(1, 2, 1), (2, 1, 0)]:  # ZeRO 1 on DTensor; two stages of one device each
        assert charged[key] == pytest.approx(plain[key], rel=1e-12), key
    default = times(CostModel(ddp_overhead={kind: ddp}), synchronous=False)
    assert default[(1, 2, 0)] == pytest.approx(times(CostModel(), False)[(1, 2, 0)], rel=1e-12)


def test_stages_of_several_devices_pay_the_synchronisation_skew_on_their_local_work() -> None:
    """A cost model's ``sync_skew`` (the fraction of a rank's local work that its meetings
    cost, profile.link.measure_sync_skew) is charged once per step to a stage that spans
    two devices — its micro-batches' forward and backward times the skew, with its
    gradient synchronisation — and not to a pipeline of one-device stages, whose meetings
    are the measured exchange's."""
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind
    plain = _two_chip_plans(cluster, CostModel())
    skewed = _two_chip_plans(cluster, CostModel(sync_skew={kind: 0.25}))
    for key in [(1, 2, 0), (1, 2, 1)]:  # one stage over two devices: DDP, ZeRO 1
        local = plain[key].config.micro_batches * (
            plain[key].stage_forward_s[0] + plain[key].stage_backward_s[0]
        )
        assert skewed[key].sync_s[0] - plain[key].sync_s[0] == pytest.approx(0.25 * local)
        assert skewed[key].time_per_batch_s - plain[key].time_per_batch_s == pytest.approx(
            0.25 * local, rel=1e-6
        )
    pipeline = (2, 1, 0)  # two stages of one device each
    assert skewed[pipeline].time_per_batch_s == plain[pipeline].time_per_batch_s
    assert skewed[pipeline].sync_s == plain[pipeline].sync_s


def cluster_collective(cluster, cost_model, nbytes: float, kind: str = "all_reduce") -> float:
    """The collective ``kind`` of ``nbytes`` over 2 devices of ``cluster`` as the search
    costs it."""
    from meshplace.mesh.layout import mesh_over

    order = cluster.ring_order(hybrid.accelerators(cluster))
    mesh = mesh_over(cluster, np.array(order[:2]).reshape(2, 1), ("data", "tensor"), "tp inner")
    return mesh.calibrated(cost_model).collective_time(kind, nbytes, ["data"])


def _gpipe_seconds(cluster: Any, cost_model: Any, pp: int) -> float:
    """The search's time per batch of the tiny GPT (2 layers, batch 8 in micro-batches of
    2) on 2 chips of ``cluster`` as a GPipe pipeline of ``pp`` stages (tp 1, ZeRO 0)."""
    result = hybrid.hybrid_search(
        "tiny", None, cluster, chips=2, global_batch=8, tensor_parallel=(1,),
        micro_batch_sizes=(2,), graphs=_tiny_graphs, layers=2, simulate_top=1000,
        schedules=("gpipe",), zero_stages=(0,), pipeline_degrees=(pp,), cost_model=cost_model,
    )  # fmt: skip
    (plan,) = [p for p in result.plans if p.pp == pp and p.tp == 1]
    return plan.time_per_batch_s


def test_the_pipelining_engine_and_message_cpu_are_charged_per_micro_batch() -> None:
    """A cost model's ``pipeline_overhead`` (what torch's pipelining adds per micro-batch
    and stage, which meshplace's hybrid runtime pays on every plan) lengthens each
    micro-batch on every stage: ``m`` micro-batches on one stage pay it ``m`` times, a
    GPipe pipeline's ``m + p - 1`` beats once each; ``message_cpu`` makes every message
    between stages cost its two ends' compute."""
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind
    engine = 1e-3

    def seconds(cost_model: CostModel, pp: int) -> float:
        return _gpipe_seconds(cluster, cost_model, pp)

    plain, with_engine = CostModel(), CostModel(pipeline_overhead={kind: engine})
    micro_batches = 8 // (2 * 2)  # one stage, two replicas, micro-batches of 2
    assert seconds(with_engine, 1) - seconds(plain, 1) == pytest.approx(
        micro_batches * engine, rel=1e-6
    )
    beats = 8 // 2 + 2 - 1  # two stages, one replica: 4 micro-batches
    assert seconds(with_engine, 2) - seconds(plain, 2) == pytest.approx(beats * engine, rel=1e-6)
    # host-staged messages: a stage's compute pays its messages' ends, 1 ms each here, so
    # every micro-batch on the first stage (send out, receive the gradient) takes 2 ms
    # more, and GPipe's beats, each as long as the slowest stage, as much
    host_staged = CostModel(message_cpu={kind: (1e-3, 0.0, 1e-3, 0.0)})
    assert seconds(host_staged, 2) - seconds(plain, 2) == pytest.approx(beats * 2e-3, rel=1e-6)
    assert seconds(host_staged, 1) == pytest.approx(seconds(plain, 1))  # no stage messages


def test_one_stage_in_1f1b_order_pays_no_pipelining_engine() -> None:
    """meshplace's runtime accumulates a one-stage plan's micro-batches on the model
    itself, without torch's pipelining (runtime.hybrid.accumulate_micro_batches), when the
    plan's order is 1F1B: such a plan pays no ``pipeline_overhead``; a one-stage GPipe
    plan, which still runs as a schedule, and a pipeline of two stages do."""
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind
    engine = 1e-3

    def seconds(cost_model: CostModel, schedule: str, pp: int) -> float:
        result = hybrid.hybrid_search(
            "tiny", None, cluster, chips=2, global_batch=8, tensor_parallel=(1,),
            micro_batch_sizes=(2,), graphs=_tiny_graphs, layers=2, simulate_top=1000,
            schedules=(schedule,), zero_stages=(0,), pipeline_degrees=(pp,),
            cost_model=cost_model,
        )  # fmt: skip
        (plan,) = [p for p in result.plans if p.pp == pp and p.tp == 1]
        return plan.time_per_batch_s

    plain, charged = CostModel(), CostModel(pipeline_overhead={kind: engine})
    assert seconds(charged, "1f1b", 1) == pytest.approx(seconds(plain, "1f1b", 1), rel=1e-12)
    micro_batches = 8 // (2 * 2)  # one stage, two replicas, micro-batches of 2
    assert seconds(charged, "gpipe", 1) - seconds(plain, "gpipe", 1) == pytest.approx(
        micro_batches * engine, rel=1e-6
    )
    beats = 8 // 2 + 2 - 1  # two stages in 1F1B: 4 micro-batches, 5 beats
    assert seconds(charged, "1f1b", 2) - seconds(plain, "1f1b", 2) == pytest.approx(
        beats * engine, rel=1e-6
    )


def test_a_measured_exchange_replaces_the_engine_and_messages_fixed_costs_of_a_pipeline() -> None:
    """A cost model's ``pipeline_exchange`` (a beat's cost to two busy ranks beyond
    compute, and each further value crossing the cut; runtime.pipeline_exchange) is what a
    pipeline of two stages pays per beat instead of the engine and the messages' fixed CPU:
    the tiny GPT's cut carries two values (the hidden state and the targets the loss
    reads), so each beat costs the exchange plus one further value, and the messages'
    route latency, which the measured exchange holds, leaves the wire (a GPipe step's
    critical path crosses the cut twice: the first activation, the last gradient). One
    stage has no cut and pays the engine as before."""
    from meshplace.cost.compute import CostModel

    cluster = load_cluster("h2-8xh100")
    kind = cluster.devices[hybrid.accelerators(cluster)[0]].kind
    assert hybrid.part_costs(_tiny_graphs(2), cluster, 1, 2).boundary_values == 2

    def seconds(cost_model: CostModel, pp: int) -> float:
        return _gpipe_seconds(cluster, cost_model, pp)

    engine, beat, per_value = 1e-3, 4e-3, 2e-3
    fixed_cpu = {kind: (1e-3, 0.0, 1e-3, 0.0)}  # fixed costs only: the exchange's
    measured = CostModel(
        pipeline_overhead={kind: engine},
        message_cpu=fixed_cpu,
        pipeline_exchange={kind: (beat, per_value)},
    )
    plain = CostModel()
    beats = 8 // 2 + 2 - 1  # two stages, one replica: 4 micro-batches
    first, second = hybrid.accelerators(cluster)[:2]
    latency = cluster.path_latency(first, second)
    assert latency > 0
    assert seconds(measured, 2) - seconds(plain, 2) == pytest.approx(
        beats * (beat + per_value) - 2 * latency, rel=1e-9
    )
    micro_batches = 8 // (2 * 2)  # one stage, two replicas
    assert seconds(measured, 1) - seconds(plain, 1) == pytest.approx(
        micro_batches * engine, rel=1e-6
    )


def test_each_micro_batch_after_the_first_adds_its_gradients_into_the_held_ones() -> None:
    """A stage of ``m`` micro-batches makes ``m - 1`` passes adding a micro-batch's
    gradients into the held ones, one add kernel per parameter tensor
    (:class:`meshplace.cost.pipeline.GradientAccumulation`): raising that kernel's fixed
    cost by ``x`` lengthens a one-stage plan of ``m`` micro-batches by exactly ``(m - 1)
    x`` per parameter tensor and a two-stage pipeline by some of it, and leaves a plan of
    one micro-batch as it was."""
    from meshplace.cost.compute import CostModel
    from meshplace.cost.pipeline import ACCUMULATE_TARGET

    cluster = load_cluster("h2-8xh100")
    device = cluster.devices[hybrid.accelerators(cluster)[0]]
    extra = 1e-4
    raised = CostModel(
        kernel_overhead={device.kind: {ACCUMULATE_TARGET: device.spec.launch_overhead_s + extra}}
    )

    def times(model: CostModel, global_batch: int) -> dict[tuple[int, int], float]:
        result = hybrid.hybrid_search(
            "tiny", None, cluster, chips=2, global_batch=global_batch, tensor_parallel=(1,),
            micro_batch_sizes=(1,), graphs=_tiny_graphs, layers=2, simulate_top=1000,
            schedules=("gpipe",), zero_stages=(0,), pipeline_degrees=(1, 2), cost_model=model,
        )  # fmt: skip
        return {(p.pp, p.dp): p.time_per_batch_s for p in result.plans}

    tensors = sum(o.kind == "parameter" for o in _tiny_graphs(1).ops)
    plain, charged = times(CostModel(), 8), times(raised, 8)
    micro_batches = 8 // 2  # one stage, two replicas, micro-batches of one sequence
    added = charged[(1, 2)] - plain[(1, 2)]
    assert added == pytest.approx((micro_batches - 1) * tensors * extra, rel=1e-6)
    assert 0 < charged[(2, 1)] - plain[(2, 1)] < (8 + 1) * tensors * extra
    one = times(CostModel(), 2), times(raised, 2)  # one micro-batch per replica
    assert one[1][(1, 2)] == pytest.approx(one[0][(1, 2)], rel=1e-12)
