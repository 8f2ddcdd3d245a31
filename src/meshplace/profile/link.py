"""Measure the local inter-worker link: gloo send/recv ping-pong between two processes.

A message of ``n`` bytes takes ``latency + n / bandwidth`` (the Hockney model, as the
cluster's links assume); both are fitted by least squares to the median one-way time
(half a round trip) of a few sizes. Cost: two spawned processes, ~1-2 s.

>>> bw, lat = fit_link([(0, 1e-5), (1e6, 1e-5 + 1e-3)])
>>> round(bw / 1e9, 6), round(lat * 1e6, 6)
(1.0, 10.0)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

SIZES = (4, 4096, 65536, 1 << 20, 4 << 20)


def fit_link(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` from ``(bytes, seconds)`` samples: least squares of
    the *relative* error (rows weighted by 1/time), so small messages fix the latency and
    large ones the bandwidth."""
    x = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    a = np.vstack([np.ones_like(x), x]).T * w[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    inv_bw = max(float(inv_bw), 1e-12)
    return 1.0 / inv_bw, max(float(lat), 0.0)


def _pingpong(rank: int, store_path: str, sizes: Sequence[int], reps: int, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    res = []
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32)
        buf2 = torch.zeros_like(buf)
        times = []
        for r in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            # isend + blocking recv, as the runtime's workers do
            if rank == 0:
                w = dist.isend(buf, 1, tag=r)
                dist.recv(buf2, 1, tag=r)
            else:
                dist.recv(buf2, 0, tag=r)
                w = dist.isend(buf, 0, tag=r)
            w.wait()
            if r >= 2:
                times.append((time.perf_counter() - t0) / 2)
        res.append((float(n), statistics.median(times)))
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def measure_link(
    sizes: Sequence[int] = SIZES, reps: int = 20, timeout: float = 60.0
) -> dict[str, Any]:
    """Ping-pong between two spawned gloo workers; returns ``bandwidth``, ``latency`` and the
    ``samples``. Raises ``RuntimeError`` if the workers do not finish within ``timeout``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="meshplace-link-")
    path = os.path.join(tmp, "store")
    procs = [
        ctx.Process(target=_pingpong, args=(r, path, list(sizes), reps, out), daemon=True)
        for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        samples = out.get(timeout=timeout)
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(2)
        try:
            os.remove(path)
            os.rmdir(tmp)
        except OSError:
            pass
    bw, lat = fit_link(samples)
    return {"bandwidth": bw, "latency": lat, "samples": samples}
