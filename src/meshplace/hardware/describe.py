"""Summaries of a cluster: a JSON-ready dict and rich tables.

>>> from meshplace.hardware.presets import load_cluster
>>> d = describe(load_cluster("colocrl-4gpu"))
>>> d["totals"]["devices"], d["devices"][1]["kind"]
(5, 'k80')
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshplace.hardware.catalogue import DTYPES
from meshplace.hardware.cluster import Cluster
from meshplace.hardware.units import format_bandwidth, format_bytes, format_flops, format_time


def _dtypes(cluster: Cluster) -> list[str]:
    present = {k for d in cluster.devices for k in d.spec.peak_flops}
    return [dt for dt in DTYPES if dt in present]


def describe(cluster: Cluster) -> dict[str, Any]:
    """Everything about ``cluster`` as plain JSON-ready data: name, topology, source, meta,
    torus dims, devices, switches, links, and totals (device/host/link counts, devices per
    kind, aggregate peak FLOP/s per dtype — each device counted at its :meth:`peak` for that
    dtype, fallbacks included — and total device memory). O(devices + links)."""
    dtypes = _dtypes(cluster)
    devices = [
        {
            "name": d.name,
            "kind": d.kind,
            "host": d.host,
            "category": d.spec.category,
            "peak_flops": {k: float(v) for k, v in d.spec.peak_flops.items()},
            "memory_bytes": int(d.spec.memory_bytes),
            "memory_bandwidth": float(d.spec.memory_bandwidth),
            "launch_overhead_s": float(d.spec.launch_overhead_s),
            "transfers": d.spec.transfers,
        }
        for d in cluster.devices
    ]
    links = [
        {
            "name": lk.name,
            "src": lk.src,
            "dst": lk.dst,
            "bandwidth": float(lk.bandwidth),
            "latency": float(lk.latency),
            "kind": lk.kind,
        }
        for lk in cluster.links
    ]
    totals = {
        "devices": len(cluster.devices),
        "hosts": len(cluster.hosts()),
        "links": len(cluster.links),
        "kinds": dict(Counter(d.kind for d in cluster.devices)),
        "peak_flops": {dt: float(sum(d.spec.peak(dt) for d in cluster.devices)) for dt in dtypes},
        "memory_bytes": int(sum(d.spec.memory_bytes for d in cluster.devices)),
    }
    return {
        "name": cluster.name,
        "topology": cluster.topology,
        "source": cluster.source,
        "meta": {k: v for k, v in cluster.meta.items() if k != "nic_attach"},
        "dims": list(cluster.dims) if cluster.dims is not None else None,
        "devices": devices,
        "switches": list(cluster.switches),
        "links": links,
        "totals": totals,
    }


def print_cluster(console: Console, cluster: Cluster, max_rows: int = 24) -> None:
    """Print ``cluster`` as rich tables: a header, devices (one row each when there are at
    most ``max_rows``, else grouped by kind and host, or by kind alone when even the groups
    are too many), links (likewise grouped by kind, bandwidth and latency), and totals. A
    1,024-chip pod prints a handful of rows.

    >>> from io import StringIO
    >>> from meshplace.hardware.presets import load_cluster
    >>> out = Console(file=StringIO(), width=120)
    >>> print_cluster(out, load_cluster("tpu-v3-pod"))
    >>> "1024" in out.file.getvalue()
    True
    """
    hosts = cluster.hosts()
    shape = f" {'x'.join(map(str, cluster.dims))}" if cluster.dims else ""
    console.print(
        f"[bold]{escape(cluster.name)}[/bold]: {escape(cluster.topology)}{shape}, "
        f"{len(cluster.devices)} devices on {len(hosts)} host(s), {len(cluster.links)} "
        f"directed links, {len(cluster.switches)} switches"
    )
    if cluster.source:
        console.print(f"[dim]source: {escape(cluster.source)}[/dim]")
    console.print(_device_table(cluster, max_rows))
    console.print(_link_table(cluster, max_rows))
    d = describe_totals(cluster)
    peaks = ", ".join(f"{dt} {format_flops(v)}" for dt, v in d["peak_flops"].items())
    console.print(f"total peak: {peaks}; total device memory {format_bytes(d['memory_bytes'])}")
    occupying = [dev.name for dev in cluster.devices if dev.spec.transfers == "occupy"]
    if occupying:
        which = "every device" if len(occupying) == len(cluster.devices) else ", ".join(occupying)
        console.print(f"transfers occupy the device (no copy engine): {escape(which)}")
    for k, v in cluster.meta.items():
        if k != "nic_attach":
            console.print(f"[dim]{escape(str(k))}: {escape(str(v))}[/dim]")


def describe_totals(cluster: Cluster) -> dict[str, Any]:
    """The ``totals`` part of :func:`describe`, without listing devices and links."""
    dtypes = _dtypes(cluster)
    return {
        "peak_flops": {dt: float(sum(d.spec.peak(dt) for d in cluster.devices)) for dt in dtypes},
        "memory_bytes": int(sum(d.spec.memory_bytes for d in cluster.devices)),
    }


def _low(spec: Any) -> str:
    return format_flops(
        spec.peak("bfloat16") if "bfloat16" in spec.peak_flops else spec.peak("float16")
    )


def _device_table(cluster: Cluster, max_rows: int) -> Table:
    if len(cluster.devices) <= max_rows:
        t = Table(title="devices")
        for col in ("name", "kind", "host", "fp32", "bf16/fp16", "memory", "mem bw", "op overhead"):
            t.add_column(col)
        for d in cluster.devices:
            s = d.spec
            t.add_row(
                escape(d.name),
                escape(d.kind),
                escape(d.host),
                format_flops(s.peak("float32")),
                _low(s),
                format_bytes(s.memory_bytes),
                format_bandwidth(s.memory_bandwidth),
                format_time(s.launch_overhead_s),
            )
        return t
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, d in enumerate(cluster.devices):
        groups.setdefault((d.kind, d.host), []).append(i)
    by_host = len(groups) <= max_rows
    if not by_host:
        groups = {}
        for i, d in enumerate(cluster.devices):
            groups.setdefault((d.kind,), []).append(i)
    t = Table(title="devices (grouped)")
    for col in ("kind", "host" if by_host else "hosts", "count", "fp32 each", "bf16/fp16 each"):
        t.add_column(col)
    for col in ("memory each", "mem bw each", "first .. last"):
        t.add_column(col)
    for key, idx in groups.items():
        s = cluster.devices[idx[0]].spec
        host = key[1] if by_host else str(len({cluster.devices[i].host for i in idx}))
        span = cluster.devices[idx[0]].name
        if len(idx) > 1:
            span += f" .. {cluster.devices[idx[-1]].name}"
        t.add_row(
            escape(key[0]),
            escape(host),
            str(len(idx)),
            format_flops(s.peak("float32")),
            _low(s),
            format_bytes(s.memory_bytes),
            format_bandwidth(s.memory_bandwidth),
            escape(span),
        )
    return t


def _link_table(cluster: Cluster, max_rows: int) -> Table:
    if len(cluster.links) <= max_rows:
        t = Table(title="links (one per direction)")
        for col in ("src", "dst", "kind", "bandwidth", "latency"):
            t.add_column(col)
        for lk in cluster.links:
            t.add_row(
                escape(lk.src),
                escape(lk.dst),
                escape(lk.kind),
                format_bandwidth(lk.bandwidth),
                format_time(lk.latency),
            )
        return t
    groups = Counter((lk.kind, lk.bandwidth, lk.latency) for lk in cluster.links)
    t = Table(title="links (grouped, one per direction)")
    for col in ("kind", "count", "bandwidth", "latency"):
        t.add_column(col)
    for (kind, bw, lat), count in groups.items():
        t.add_row(escape(kind), str(count), format_bandwidth(bw), format_time(lat))
    return t
