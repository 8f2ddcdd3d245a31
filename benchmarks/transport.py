"""How the gloo threads' scheduling policy affects the runtime (docs/runtime.md, item 8).

Two measurements per policy of ``MESHPLACE_TRANSPORT`` (``normal``, ``nice``, ``idle``):

* **posting receives**: two gloo processes (one compute thread each, like the workers)
  repeat: barrier, post 15 ``irecv``, send 15 small tensors, wait. Reported: rounds whose
  posting or waiting took over 1.5 ms (the lock-spinning stalls) and the mean round time;
* **training steps**: the placements of a few placers on small runtime models, each run
  (3 + 15 steps) once per policy per repeat, policies interleaved; reported: the median
  step time per policy and the geometric mean of each policy's times over ``normal``'s.

Usage: ``python benchmarks/transport.py [--models mlp,transformer-small] [--rounds 110]
[--out results/transport.json]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshplace.provenance import write_result

POLICIES = ("normal", "nice", "idle")
PLACERS = ("expert", "anneal", "m_etf", "m_topo", "random")


def _post_worker(rank: int, path: str, policy: str, rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from meshplace.runtime.executor import thread_ids, yield_transport_threads

    torch.set_num_threads(1)
    before = thread_ids()
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    yield_transport_threads(policy, threads=thread_ids() - before)
    peer = 1 - rank
    rows = []
    for it in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        bufs = [torch.empty(4) for _ in range(15)]
        works = [dist.irecv(b, src=peer, tag=it * 100 + k) for k, b in enumerate(bufs)]
        t1 = time.perf_counter()
        sends = [dist.isend(torch.ones(4), dst=peer, tag=it * 100 + k) for k in range(15)]
        for w in works + sends:
            w.wait()
        rows.append((t1 - t0, time.perf_counter() - t1))
    out.put((rank, rows[10:]))  # after a warm-up
    dist.barrier()
    dist.destroy_process_group()


def posting(policy: str, rounds: int) -> dict[str, float]:
    """Stalls (> 1.5 ms) and mean time of the post and wait phases, both ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="meshplace-transport-")
    path = os.path.join(tmp, "store")
    procs = [ctx.Process(target=_post_worker, args=(r, path, policy, rounds, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(10)
    shutil.rmtree(tmp, ignore_errors=True)  # the FileStore may have removed its file
    phases = [t for _, rows in got for row in rows for t in row]
    return {
        "phases": len(phases),
        "stalls_over_1_5ms": sum(t > 1.5e-3 for t in phases),
        "mean_phase_s": statistics.mean(phases),
    }


def steps(models: list[str], repeats: int) -> dict[str, Any]:
    """Median step time of placers' plans under each policy, interleaved."""
    from meshplace.placers.base import PlacementProblem, run_placer
    from meshplace.profile.calibrate import local_cluster, local_device_spec
    from meshplace.runtime.executor import run_placement
    from meshplace.runtime.program import ModelSpec, trace_step

    cluster = local_cluster(local_device_spec(1e10, 1e10, 1e-5), 3e9, 1e-4)
    rows = []
    for name in models:
        step = trace_step(ModelSpec(name, batch=8))
        for placer in PLACERS:
            res = run_placer(placer, PlacementProblem(step.graph, cluster), 2.0, 0)
            devices = [cluster.device_names[i] for i in res.op_devices.tolist()]
            if len(set(devices)) < 2:
                continue
            times: dict[str, list[float]] = {p: [] for p in POLICIES}
            for _ in range(repeats):
                for policy in POLICIES:
                    os.environ["MESHPLACE_TRANSPORT"] = policy
                    run = run_placement(None, devices, 18, warmup=3, step=step, start_method="fork")
                    times[policy].append(run.step_time_s)
            row = {"model": name, "placer": placer, "messages": run.messages}
            row.update({p: statistics.median(v) for p, v in times.items()})
            rows.append(row)
            print(
                f"  {name:18} {placer:8} "
                + "  ".join(f"{p} {row[p] * 1e3:8.2f} ms" for p in POLICIES),
                file=sys.stderr,
            )
    os.environ.pop("MESHPLACE_TRANSPORT", None)
    ratio = {
        p: statistics.geometric_mean(r[p] / r["normal"] for r in rows) if rows else None
        for p in POLICIES
    }
    return {"plans": rows, "geometric_mean_over_normal": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer-small,nmt-small,dmcca-small")
    parser.add_argument("--rounds", type=int, default=120, help="posting rounds per policy")
    parser.add_argument("--repeats", type=int, default=2, help="runs per plan and policy")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "transport.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    post = {p: posting(p, args.rounds) for p in POLICIES}
    print(f"{'policy':8} {'stalls > 1.5 ms':>16} {'mean phase':>11}")
    for p, r in post.items():
        print(
            f"{p:8} {r['stalls_over_1_5ms']:>7d} of {r['phases']:<6d} "
            f"{r['mean_phase_s'] * 1e6:8.0f} us"
        )
    result = steps(args.models.split(","), args.repeats)
    print(
        "training steps, geometric mean over normal: "
        + ", ".join(f"{p} {v:.3f}" for p, v in result["geometric_mean_over_normal"].items())
    )
    write_result(
        args.out,
        {
            "posting": post,
            "steps": result,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
