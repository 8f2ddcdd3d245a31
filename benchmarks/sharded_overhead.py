"""The sharding runtime against the same data parallelism written by hand (issue 15's
target: at most 5 % overhead).

The Llama example (``examples/llama.py:build_tiny``) on 2 gloo CPU ranks, one thread
each, Adam, run two ways in alternation for two plans of the Megatron grid on 2 devices:

* **dp2, ZeRO 0**: by hand, ``DistributedDataParallel`` (each rank half the batch,
  gradients all-reduced in buckets while the backward runs); meshplace, ``python -m
  meshplace.runtime`` on the grid point's plan (parameters replicated DTensors, inputs
  split over the batch, each gradient reduced as its placement says);
* **dp2, ZeRO 1**: by hand, DDP with PyTorch's ``ZeroRedundancyOptimizer`` (Adam's state
  partitioned by whole parameters over the ranks, each rank's updated parameters
  broadcast); meshplace, the ZeRO-1 grid point (DDP, each rank's Adam on its half of
  every parameter, the halves all-gathered in one flat buffer);
* **dp2, ZeRO 3**: by hand, FSDP2 (``fully_shard`` on every block, then the model);
  meshplace, the ZeRO-3 grid point (parameters sharded, gathered for use);
* **tp2, Megatron's layout**: by hand, PyTorch's tensor parallelism as torchtitan writes
  it (``parallelize_module``: ``ColwiseParallel`` query, key, value, gate and up
  projections, ``RowwiseParallel`` output and down projections, a vocabulary-parallel
  embedding and head, each rank's attention on its heads, one foreach Adam for the split
  parameters and one for the replicated ones); meshplace, the same placements as a plan
  file (:func:`megatron_plan`: the grid's dp1 tp2 point with Megatron's layout, which on
  this model the grid does not choose by itself);
* **dp2, 4 micro-batches** (the Llama example at batch 8,
  ``benchmarks/fidelity_models.py:build_llama_batch8``): by hand, DDP with gradient
  accumulation (``no_sync`` on all but the last micro-batch, each loss divided by 4);
  meshplace, the hybrid search's one-stage plan of data parallelism 2 in micro-batches
  of one sequence (``meshplace.runtime.hybrid``, which accumulates them on DDP).

Each run: ``--warmup`` untimed then ``--steps`` timed steps, each step the slowest rank's,
the median reported; ``--repeats`` alternating pairs per plan. The by-hand runs are this
script's ``--worker``. Beside the wall-clock step, each rank's CPU time per step (its
process, all threads: ``time.process_time``; the mean of the ranks' medians) and its
overhead: a rank that waits for its peer spends wall time but no CPU, so the CPU time
separates the work the runtime adds from waiting (the wall-clock overhead is the
target's). On a virtual machine whose host is busy the CPU time moves too (a slowed vCPU
is charged more of it): session 48 saw the same by-hand DDP step at 5.7-8.7 ms of CPU.

``--interleaved`` runs both sides in one torchrun job instead, step by step in
alternation on the same ranks (:func:`interleaved_worker`: meshplace's own
:class:`~meshplace.runtime.launch.ShardedRankSteps` and
:class:`~meshplace.runtime.hybrid.HybridRankSteps`), and reports the median over the
pairs of steps of meshplace's over the hand's (:func:`two_ranks.paired_overhead`): a slow
spell of the host falls on both steps of a pair. ``--without-hooks`` adds a third side,
meshplace without its rank-activity hooks, on the sharding plans' rows.

Usage: ``python benchmarks/sharded_overhead.py [--repeats 2] [--steps 20] [--warmup 3]
[--interleaved [--without-hooks]]`` (about 2 minutes; 4 with ``--repeats 5 --steps 30``;
``benchmarks/results/sharded_overhead.json``; ``--interleaved --without-hooks --repeats 5
--steps 40``: about 3 minutes, ``benchmarks/results/sharded_overhead_interleaved.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshplace.hostmemory import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from two_ranks import (  # noqa: E402
    paired_overhead,
    relative_overhead,
    report_alternating,
    report_slowest_median,
    torchrun_json,
)

SOURCE = f"{ROOT / 'examples' / 'llama.py'}:build_tiny"
# by-hand engine -> the ZeRO stage of meshplace's plan
PLANS = {"ddp": 0, "zero1": 1, "fsdp": 3}
# Megatron-LM's tensor-parallel layout of the Llama example (Shoeybi et al. 2019, Sec. 3)
COLUMN_PARALLEL = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("attn.o_proj", "mlp.down_proj")
VOCABULARY_PARALLEL = ("embed", "lm_head")
ACCUMULATED = f"{ROOT / 'benchmarks' / 'fidelity_models.py'}:build_llama_batch8"
MICRO_BATCHES = 4  # of the accumulated row: global batch 8 over 2 replicas, 1 row each
WORKERS = (*PLANS, "tp", "ddp-accumulate")


def by_hand_steps(engine: str) -> Any:
    """This rank's hand-written data (or tensor) parallelism of ``engine`` (a
    :data:`WORKERS` name; ``torch.distributed`` initialised): a function that runs one
    step after a barrier of the ranks and returns its wall-clock and CPU seconds (this
    process, all threads)."""
    import torch
    import torch.distributed as dist

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_from_seed

    rank, world = dist.get_rank(), dist.get_world_size()
    accumulating = engine == "ddp-accumulate"
    model, args, kwargs = build_from_seed(ACCUMULATED if accumulating else SOURCE)
    if engine == "tp":  # every rank the whole batch
        return tensor_parallel_by_hand(model, args, kwargs)
    micro_batches = MICRO_BATCHES if accumulating else 1

    def mine(x: object) -> object:  # this rank's rows of the batch
        return x.chunk(world)[rank] if isinstance(x, torch.Tensor) else x

    args = [mine(a) for a in args]
    kwargs = {k: mine(v) for k, v in kwargs.items()}
    if engine in ("ddp", "zero1", "ddp-accumulate"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if engine == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer: Any = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3, foreach=True
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)

    def step() -> tuple[float, float]:
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        for k in range(micro_batches):

            def chunk(x: object, k: int = k) -> object:
                return x.chunk(micro_batches)[k] if isinstance(x, torch.Tensor) else x

            last = k == micro_batches - 1
            with contextlib.nullcontext() if last or not accumulating else model.no_sync():
                loss, _how = as_loss(
                    model(*map(chunk, args), **{n: chunk(v) for n, v in kwargs.items()})
                )
                (loss / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - cpu_start

    return step


def tensor_parallel_by_hand(model: Any, args: Any, kwargs: dict) -> Any:
    """The ``tp`` row's hand-written step: every rank the whole batch, the model under
    ``parallelize_module`` with torchtitan's styles for Megatron's layout (local tensors
    between modules; each rank's attention on its own heads, as torchtitan's model
    arguments divide them). Returns the step function of :func:`by_hand_steps`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from meshplace.graph.capture import as_loss

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i, layer in enumerate(model.layers):
        for name in COLUMN_PARALLEL:
            styles[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ROW_PARALLEL:
            styles[f"layers.{i}.{name}"] = RowwiseParallel(input_layouts=Shard(-1))
        layer.attn.n_heads //= mesh.size()
        layer.attn.n_kv_heads //= mesh.size()
    parallelize_module(model, mesh, styles)
    # a foreach Adam cannot mix DTensors and plain tensors (the norms' scales): two
    split = [p for p in model.parameters() if isinstance(p, DTensor)]
    whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
    optimizers = [torch.optim.Adam(ps, lr=1e-3, foreach=True) for ps in (split, whole) if ps]

    def step() -> tuple[float, float]:
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss, _how = as_loss(model(*args, **kwargs))
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - cpu_start

    return step


def megatron_plan(folder: Path, grid: Any) -> Path:
    """The ``tp`` row's plan file: the grid's dp1 tp2 point of the Llama example with
    Megatron's layout over its tensor axis (column-parallel :data:`COLUMN_PARALLEL`,
    row-parallel :data:`ROW_PARALLEL`, :data:`VOCABULARY_PARALLEL` split over the
    vocabulary, norms replicated): what the by-hand styles run. The grid lets its solve
    pick each matrix's split, and on this model it splits the query, key and value
    weights by columns instead (``Shard(1)``: row-parallel)."""
    point = next(p for p in grid.points if p.tp == 2 and p.fits)
    document = point.plan.plan_file(SOURCE, "dgx-h100")
    for name, entry in document["parameters"].items():
        owner = name.removesuffix(".weight")
        if owner in VOCABULARY_PARALLEL or owner.endswith(COLUMN_PARALLEL):
            entry["placements"] = ["Shard(0)"]
        elif owner.endswith(ROW_PARALLEL):
            entry["placements"] = ["Shard(1)"]
        else:
            entry["placements"] = ["Replicate()"]
    path = folder / "tp.json"
    path.write_text(json.dumps(document))
    return path


def worker(engine: str, steps: int, warmup: int) -> None:
    """One rank of the hand-written data parallelism (under torchrun); rank 0 prints the
    median step time (the slowest rank's per step) as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    step = by_hand_steps(engine)
    times, cpu_times = zip(*(step() for _ in range(steps + warmup)), strict=True)
    report_slowest_median(list(times), warmup, list(cpu_times))


def interleaved_worker(
    engine: str, plan: str, steps: int, warmup: int, without_hooks: bool = False
) -> None:
    """One rank running meshplace's steps of ``plan`` (the runtime's own
    :class:`meshplace.runtime.launch.ShardedRankSteps`, or
    :class:`meshplace.runtime.hybrid.HybridRankSteps` for the accumulated row) and the
    hand-written ``engine`` in one process, step by step in alternation (meshplace first
    in even steps, the hand second, then the other way round), each step after a barrier
    of the ranks; rank 0 prints, per step after ``warmup``, each side's slowest rank's
    wall-clock seconds and its ranks' mean CPU seconds. A slow spell of the host then
    falls on both sides of a pair of steps, a few milliseconds apart, rather than on one
    of two runs. With ``without_hooks`` (the sharding plans' rows), a third side:
    meshplace's steps on a second copy whose rank-activity hooks are removed (what naming
    a dying rank's module costs); the three sides take turns in rotation."""
    import torch
    import torch.distributed as dist

    from meshplace.runtime.hybrid import HybridRankSteps
    from meshplace.runtime.launch import ShardedRankSteps

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank_steps = HybridRankSteps if engine == "ddp-accumulate" else ShardedRankSteps
    source = ACCUMULATED if engine == "ddp-accumulate" else SOURCE
    ours = rank_steps(json.loads(Path(plan).read_text()), source, lr=1e-3, device_type="cpu")
    theirs = by_hand_steps(engine)
    sides: list[tuple[str, Any]] = [
        ("meshplace", lambda i: ours.step(i)[2:4]),
        ("by_hand", lambda _i: theirs()),
    ]
    if without_hooks and rank_steps is ShardedRankSteps:
        bare = ShardedRankSteps(
            json.loads(Path(plan).read_text()), source, lr=1e-3, device_type="cpu"
        )
        for handle in bare.hooks:
            handle.remove()
        sides.append(("meshplace_without_hooks", lambda i: bare.step(i)[2:4]))
    engine_name = "ddp" if engine == "ddp-accumulate" else ours.training.engine
    report_alternating(sides, steps, warmup, {"engine": engine_name})


def plan_label(engine: str) -> str:
    """The row's plan in words, by the by-hand engine it is compared with."""
    if engine == "tp":
        return "tp2, Megatron's layout"
    return (
        f"dp2 zero{PLANS[engine]}"
        if engine in PLANS
        else f"dp2 zero0, {MICRO_BATCHES} micro-batches"
    )


def grid_plans(folder: Path) -> dict[str, Path]:
    """The Megatron grid's dp2 points (ZeRO 0, 1 and 3) on 2 devices, its tp2 point with
    Megatron's layout (:func:`megatron_plan`) and the accumulated row's plan as plan
    files, by the by-hand engine they are compared with."""
    import torch

    from meshplace.graph.capture import capture
    from meshplace.graph.sources import load_build_function
    from meshplace.hardware import load_cluster
    from meshplace.parallel.grid import megatron_grid

    torch.manual_seed(0)
    model, args, kwargs = load_build_function(SOURCE)()
    graph = capture(model, args, example_kwargs=kwargs, training=True)
    grid = megatron_grid(
        graph, load_cluster("dgx-h100"), chips=2, zero_stages=tuple(PLANS.values())
    )
    paths = {}
    for engine, zero in PLANS.items():
        point = next(p for p in grid.points if p.dp == 2 and p.zero == zero and p.fits)
        path = folder / f"{engine}.json"
        path.write_text(json.dumps(point.plan.plan_file(SOURCE, "dgx-h100")))
        paths[engine] = path
    paths["tp"] = megatron_plan(folder, grid)
    paths["ddp-accumulate"] = accumulated_plan(folder)
    return paths


def accumulated_plan(folder: Path) -> Path:
    """The hybrid search's one-stage plan of :data:`ACCUMULATED` on 2 devices: data
    parallelism 2, micro-batches of one sequence (:data:`MICRO_BATCHES` per replica),
    ZeRO 0, as a plan file."""
    from meshplace.graph.sources import graph_source
    from meshplace.hardware import load_cluster
    from meshplace.parallel.cli import hybrid_plan_file
    from meshplace.parallel.hybrid import hybrid_search

    result = hybrid_search(
        ACCUMULATED, None, load_cluster("dgx-h100"), global_batch=2 * MICRO_BATCHES, chips=2,
        tensor_parallel=(1,), pipeline_degrees=(1,), micro_batch_sizes=(1,),
        schedules=("1f1b",), zero_stages=(0,), synchronous_gradients=True,
        graphs=lambda b: graph_source(ACCUMULATED, batch=b, training=True).graph,
    )  # fmt: skip
    plan = next(p for p in result.plans if p.dp == 2 and p.config.micro_batches == MICRO_BATCHES)
    path = folder / "ddp-accumulate.json"
    path.write_text(json.dumps(hybrid_plan_file(result, plan, "dgx-h100")))
    return path


def interleaved(args: argparse.Namespace) -> int:
    """``--interleaved``: for the dp2 ZeRO 0, 1 and 3 plans, ``--repeats`` torchrun jobs
    of :func:`interleaved_worker`; per plan the pairs of steps of all jobs, the paired
    overhead (:func:`paired_overhead`) of the wall-clock and CPU times, and the medians."""
    from meshplace.provenance import write_result

    rows = []
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    print(
        "| plan | by hand | by hand ms | meshplace ms | paired overhead | by hand CPU ms "
        "| meshplace CPU ms | paired CPU overhead | pairs |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    with tempfile.TemporaryDirectory() as folder:
        plans = grid_plans(Path(folder))
        for engine in WORKERS:
            pairs: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                plan = str(plans[engine])
                hooks = ["--without-hooks"] if args.without_hooks else []
                done = torchrun_json(
                    [__file__, "--interleaved-worker", engine, "--plan", plan, *common, *hooks]
                )
                for key, values in done.items():
                    if isinstance(values, list):
                        pairs.setdefault(key, []).extend(values)
            row = {
                "plan": plan_label(engine),
                "model": ACCUMULATED if engine == "ddp-accumulate" else SOURCE,
                "by_hand": engine,
                "engine": done["engine"],
                **pairs,
                "pairs": len(pairs["by_hand_s"]),
                "by_hand_median_s": statistics.median(pairs["by_hand_s"]),
                "meshplace_median_s": statistics.median(pairs["meshplace_s"]),
                "overhead": paired_overhead(pairs["meshplace_s"], pairs["by_hand_s"]),
                "cpu_overhead": paired_overhead(pairs["meshplace_cpu_s"], pairs["by_hand_cpu_s"]),
                "overhead_of_medians": relative_overhead(pairs["meshplace_s"], pairs["by_hand_s"]),
            }
            if "meshplace_without_hooks_s" in pairs:
                bare = pairs["meshplace_without_hooks_s"]
                bare_cpu = pairs["meshplace_without_hooks_cpu_s"]
                row["overhead_without_hooks"] = paired_overhead(bare, pairs["by_hand_s"])
                row["cpu_overhead_without_hooks"] = paired_overhead(
                    bare_cpu, pairs["by_hand_cpu_s"]
                )
                print(
                    f"  {row['plan']} without the activity hooks: "
                    f"{100 * row['overhead_without_hooks']:+.1f} % "
                    f"(CPU {100 * row['cpu_overhead_without_hooks']:+.1f} %)",
                    flush=True,
                )
            rows.append(row)
            print(
                f"| {row['plan']} | {engine} | {1e3 * row['by_hand_median_s']:.2f} | "
                f"{1e3 * row['meshplace_median_s']:.2f} | {100 * row['overhead']:+.1f} % | "
                f"{1e3 * statistics.median(pairs['by_hand_cpu_s']):.2f} | "
                f"{1e3 * statistics.median(pairs['meshplace_cpu_s']):.2f} | "
                f"{100 * row['cpu_overhead']:+.1f} % | {row['pairs']} |",
                flush=True,
            )
    out = args.out or str(ROOT / "benchmarks/results/sharded_overhead_interleaved.json")
    write_result(out, {"model": SOURCE, "protocol": "interleaved", "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs (default 2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="meshplace and the hand-written engine in one torchrun job, step by step in "
        "alternation",
    )
    parser.add_argument(
        "--without-hooks",
        action="store_true",
        help="with --interleaved: also meshplace without its rank-activity hooks",
    )
    parser.add_argument("--worker", choices=WORKERS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=None, help="default results/sharded_overhead[_interleaved].json"
    )
    args = parser.parse_args(argv)
    keep_freed_memory()  # as meshplace's own processes (meshplace.hostmemory)
    if args.worker is not None:
        worker(args.worker, args.steps, args.warmup)
        return 0
    if args.interleaved_worker is not None:
        interleaved_worker(
            args.interleaved_worker, args.plan, args.steps, args.warmup, args.without_hooks
        )
        return 0
    if args.interleaved:
        return interleaved(args)
    from meshplace.provenance import write_result

    args.out = args.out or str(ROOT / "benchmarks/results/sharded_overhead.json")

    rows = []
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    print(
        "| plan | by hand | by hand ms | meshplace ms | overhead | by hand CPU ms "
        "| meshplace CPU ms | CPU overhead |\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    with tempfile.TemporaryDirectory() as folder:
        plans = grid_plans(Path(folder))
        for engine, plan in plans.items():
            by_hand, ours, by_hand_cpu, ours_cpu = [], [], [], []
            for _ in range(args.repeats):
                done = torchrun_json([__file__, "--worker", engine, *common])
                by_hand.append(done["step_time_s"])
                by_hand_cpu.append(statistics.mean(done["cpu_time_s_per_rank"]))
                source = ACCUMULATED if engine == "ddp-accumulate" else SOURCE
                report = torchrun_json(
                    [
                        *["-m", "meshplace.runtime", "--plan", str(plan), "--model", source],
                        *[*common, "--device", "cpu", "--json"],
                    ]
                )
                ours.append(report["measured"]["step_time_s"])
                ours_cpu.append(statistics.mean(report["measured"]["cpu_time_s_per_rank"]))
            row = {
                "plan": plan_label(engine),
                "model": source,
                "by_hand": engine,
                "by_hand_s": by_hand,
                "meshplace_s": ours,
                "overhead": relative_overhead(ours, by_hand),
                "by_hand_cpu_s": by_hand_cpu,
                "meshplace_cpu_s": ours_cpu,
                "cpu_overhead": relative_overhead(ours_cpu, by_hand_cpu),
            }
            rows.append(row)
            print(
                f"| {row['plan']} | {engine} | {1e3 * statistics.median(by_hand):.1f} | "
                f"{1e3 * statistics.median(ours):.1f} | {100 * row['overhead']:+.1f} % | "
                f"{1e3 * statistics.median(by_hand_cpu):.1f} | "
                f"{1e3 * statistics.median(ours_cpu):.1f} | {100 * row['cpu_overhead']:+.1f} % |",
                flush=True,
            )
    write_result(args.out, {"model": SOURCE, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
