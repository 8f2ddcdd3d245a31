"""The sharding runtime against the same data parallelism written by hand (issue 15's
target: at most 5 % overhead).

The Llama example (``examples/llama.py:build_tiny``) on 2 gloo CPU ranks, one thread
each, Adam, run two ways in alternation for two plans of the Megatron grid on 2 devices:

* **dp2, ZeRO 0**: by hand, ``DistributedDataParallel`` (each rank half the batch,
  gradients all-reduced in buckets while the backward runs); meshplace, ``python -m
  meshplace.runtime`` on the grid point's plan (parameters replicated DTensors, inputs
  split over the batch, each gradient reduced as its placement says);
* **dp2, ZeRO 3**: by hand, FSDP2 (``fully_shard`` on every block, then the model);
  meshplace, the ZeRO-3 grid point (parameters sharded, gathered for use).

Each run: ``--warmup`` untimed then ``--steps`` timed steps, each step the slowest rank's,
the median reported; ``--repeats`` alternating pairs per plan. The by-hand runs are this
script's ``--worker``.

Usage: ``python benchmarks/sharded_overhead.py [--repeats 2] [--steps 20] [--warmup 3]``
(about 2 minutes; ``benchmarks/results/sharded_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from two_ranks import report_slowest_median, torchrun_json  # noqa: E402

SOURCE = f"{ROOT / 'examples' / 'llama.py'}:build_tiny"
PLANS = {"ddp": 0, "fsdp": 3}  # by-hand engine -> the ZeRO stage of meshplace's plan


def worker(engine: str, steps: int, warmup: int) -> None:
    """One rank of the hand-written data parallelism (under torchrun); rank 0 prints the
    median step time (the slowest rank's per step) as JSON."""
    import torch
    import torch.distributed as dist

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_from_seed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, args, kwargs = build_from_seed(SOURCE)

    def mine(x: object) -> object:  # this rank's rows of the batch
        return x.chunk(world)[rank] if isinstance(x, torch.Tensor) else x

    args = [mine(a) for a in args]
    kwargs = {k: mine(v) for k, v in kwargs.items()}
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    times = []
    for _ in range(steps + warmup):
        dist.barrier()
        start = time.perf_counter()
        loss, _how = as_loss(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    report_slowest_median(times, warmup)


def grid_plans(folder: Path) -> dict[str, Path]:
    """The Megatron grid's dp2 points (ZeRO 0 and 3) on 2 devices as plan files, by the
    by-hand engine they are compared with."""
    import torch

    from meshplace.graph.capture import capture
    from meshplace.graph.sources import load_build_function
    from meshplace.hardware import load_cluster
    from meshplace.parallel.grid import megatron_grid

    torch.manual_seed(0)
    model, args, kwargs = load_build_function(SOURCE)()
    graph = capture(model, args, example_kwargs=kwargs, training=True)
    grid = megatron_grid(graph, load_cluster("dgx-h100"), chips=2, zero_stages=(0, 3))
    paths = {}
    for engine, zero in PLANS.items():
        point = next(p for p in grid.points if p.dp == 2 and p.zero == zero and p.fits)
        path = folder / f"{engine}.json"
        path.write_text(json.dumps(point.plan.plan_file(SOURCE, "dgx-h100")))
        paths[engine] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs (default 2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", choices=sorted(PLANS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sharded_overhead.json"))
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.steps, args.warmup)
        return 0
    from meshplace.provenance import write_result

    rows = []
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    print("| plan | by hand | by hand ms | meshplace ms | overhead |\n|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        plans = grid_plans(Path(folder))
        for engine, plan in plans.items():
            by_hand, ours = [], []
            for _ in range(args.repeats):
                by_hand.append(
                    torchrun_json([__file__, "--worker", engine, *common])["step_time_s"]
                )
                report = torchrun_json(
                    [
                        *["-m", "meshplace.runtime", "--plan", str(plan), "--model", SOURCE],
                        *[*common, "--device", "cpu", "--json"],
                    ]
                )
                ours.append(report["measured"]["step_time_s"])
            row = {
                "plan": f"dp2 zero{PLANS[engine]}",
                "by_hand": engine,
                "by_hand_s": by_hand,
                "meshplace_s": ours,
                "overhead": statistics.median(ours) / statistics.median(by_hand) - 1,
            }
            rows.append(row)
            print(
                f"| {row['plan']} | {engine} | {1e3 * statistics.median(by_hand):.1f} | "
                f"{1e3 * statistics.median(ours):.1f} | {100 * row['overhead']:+.1f} % |",
                flush=True,
            )
    write_result(args.out, {"model": SOURCE, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
