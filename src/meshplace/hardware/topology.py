"""Topology generators: PCIe trees, NVLink/NVSwitch meshes, tori, and multi-host clusters.

Every generator returns a :class:`~meshplace.hardware.cluster.Cluster` whose links are
directed (one :class:`Link` per direction) and whose ``recipe`` is the ``topology:`` block
that rebuilds it from YAML. Bandwidths are **per direction**: NVIDIA quotes NVLink as the
sum of both directions ("600 GB/s" on A100 is 300 GB/s each way), so the constants below
are halved datasheet totals. The interconnect constants below (bytes/s per direction,
seconds) each cite their source in a comment; presets in :mod:`meshplace.hardware.presets`
are built from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from meshplace.hardware.catalogue import KIND_ALIASES, DeviceSpec, device_spec
from meshplace.hardware.cluster import Cluster, Device, Link, TorusRouting
from meshplace.hardware.errors import ClusterError

# PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 / 8 = 15.75 GB/s per direction in theory; host<->
# device copies measure 10-12 GB/s (CUDA bandwidthTest, pinned memory). meshplace uses 10 GB/s
# where the papers' K40/K80 testbeds are modelled (ANCHORS.md: "PCIe3 x16 ~10 GB/s measured").
PCIE3_X16_MEASURED = 10e9
PCIE3_X16 = 15.75e9
# PCIe 4.0 x16: 16 GT/s -> 31.5 GB/s per direction (NVIDIA quotes "64 GB/s" for both ways).
PCIE4_X16 = 31.5e9
# PCIe 5.0 x16: 32 GT/s -> 63 GB/s per direction ("128 GB/s" both ways on H100 datasheets).
PCIE5_X16 = 63e9
# One PCIe switch or root-port traversal plus DMA setup: order of 1 µs (estimate). Software
# per-transfer overheads (Placeto measured 25 µs per transfer on K80) are the cost model's.
PCIE_HOP_LATENCY = 1e-6
# NVLink per GPU, per direction: P100 4 links x 20 GB/s; V100 6 x 25; A100 12 x 25 (= "600
# GB/s" bidirectional, NVIDIA A100 datasheet); H100/H200 18 x 25 (= "900 GB/s").
NVLINK_PER_DIRECTION: dict[str, float] = {
    "p100": 80e9,
    "v100": 150e9,
    "a100-40gb": 300e9,
    "a100-80gb": 300e9,
    "h100": 450e9,
    "h200": 450e9,
    "accelerator": 300e9,
}
# GPU -> NVSwitch (or peer) link traversal, order of 0.5 µs (estimate), so ~1 µs GPU to GPU.
NVLINK_HOP_LATENCY = 0.5e-6
# CPU socket to socket (Intel UPI / AMD xGMI): three UPI links at 10.4 GT/s x 2 B ~ 62 GB/s
# per direction; used as an order-of-magnitude figure for any 2-socket host.
SOCKET_LINK = 62e9
SOCKET_LATENCY = 0.2e-6
# TPU v3 ICI: 100 GB/s per link per direction. Cloud TPU v3 docs give a 6.4 TB/s bisection
# for the 1,024-chip pod; a 32x32 torus cut in half severs 2 x 32 = 64 links -> 100 GB/s each.
# Same figure as "How to Scale Your Model" (Austin et al. 2025, TPU chapter): 1e11 B/s one way.
TPU_V3_ICI = 100e9
# TPU v4 ICI: 45 GB/s per link per direction ("How to Scale Your Model": 4.5e10 one way;
# Cloud TPU v4 docs: 24 TB/s bisection / (16 x 16 x 2 = 512 links) = 46.9 GB/s; the ISCA 2023
# paper's links signal at 400 Gb/s = 50 GB/s raw).
TPU_V4_ICI = 45e9
# TPU v2 ICI: 4 links x 496 Gb/s (Jouppi et al., CACM 2020) = 62 GB/s per link (taken as one
# direction; verify).
TPU_V2_ICI = 62e9
# One ICI hop: order of 1 µs (estimate; not published per hop).
ICI_HOP_LATENCY = 1e-6
# Host-to-host over the data-centre network, NIC to NIC: ~5 µs end to end for RDMA through one
# switch (estimate; InfiniBand switch hops are ~0.1-0.2 µs, the rest is NIC and software).
NIC_LATENCY = 5e-6
# NIC line rates per direction: EDR 100 Gb/s, HDR 200 Gb/s, NDR 400 Gb/s InfiniBand.
EDR_IB = 100e9 / 8
HDR_IB = 200e9 / 8
NDR_IB = 400e9 / 8
# Most devices a generator builds (a 512x256 torus): beyond it a cluster takes minutes to build
# and gigabytes to hold, and a typo such as hosts: 100000 should be a sentence, not a hang.
MAX_DEVICES = 1 << 17
# Most GPUs wired all-to-all without an NVSwitch (every ordered pair gets a link).
MAX_ALL_TO_ALL_GPUS = 1024


def _spec(kind: str, specs: Mapping[str, DeviceSpec] | None) -> tuple[str, DeviceSpec]:
    """(kind, spec) from the custom ``specs`` first, then the catalogue (with aliases)."""
    if specs and kind in specs:
        return kind, specs[kind]
    return KIND_ALIASES.get(kind, kind), device_spec(kind)


def _both(links: list[Link], a: str, b: str, bandwidth: float, latency: float, kind: str) -> None:
    links.append(Link(f"{a}->{b}", a, b, bandwidth, latency, kind))
    links.append(Link(f"{b}->{a}", b, a, bandwidth, latency, kind))


def _positive_int(value: object, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ClusterError(
            f"topology: {what} must be an integer of at least {minimum}, not {value!r}"
        )
    return int(value)


def _positive(value: object, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ClusterError(f"topology: {what} must be a number greater than 0, not {value!r}")
    return float(value)


def _nonneg(value: object, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ClusterError(f"topology: {what} must be a number of 0 or more, not {value!r}")
    return float(value)


# ---------------------------------------------------------------------- PCIe tree
def pcie_tree(
    num_gpus: int = 4,
    gpus_per_switch: int = 2,
    *,
    gpu_kind: str = "k80",
    cpu_kind: str = "xeon",
    cpus: int = 1,
    gpu_link_bandwidth: float = PCIE3_X16_MEASURED,
    uplink_bandwidth: float = PCIE3_X16_MEASURED,
    latency: float = PCIE_HOP_LATENCY,
    link_kind: str = "pcie3",
    host: str = "host0",
    name: str | None = None,
    source: str = "",
    specs: Mapping[str, DeviceSpec] | None = None,
) -> Cluster:
    """A host whose GPUs hang under PCIe switches below one root complex.

    Nodes: ``cpus`` CPU devices (``cpu0``...) and ``num_gpus`` GPUs (``gpu0``...), the root
    ``{host}/pcie-root`` and switches ``{host}/pcie-switch{k}`` each holding
    ``gpus_per_switch`` consecutive GPUs (the last may hold fewer; ``gpus_per_switch=1``
    models GPUs on their own root ports). Each GPU<->switch link (``gpu_link_bandwidth``)
    and each switch<->root uplink (``uplink_bandwidth``) is modelled separately and per
    direction, so GPUs under one switch talk without touching the root but SHARE the uplink
    when talking to the rest. CPUs attach to the root with their memory bandwidth. Two K80
    dies on one board behind its PLX switch are the canonical case (ColocRL, Placeto).

    Source: PCIe topology as in NVIDIA K80 board design (on-board PEX switch) and typical
    multi-GPU servers. Complexity O(num_gpus) nodes and links.

    >>> c = pcie_tree(4, 2)
    >>> c.device_names
    ['cpu0', 'gpu0', 'gpu1', 'gpu2', 'gpu3']
    >>> [c.links[k].dst for k in c.route("gpu0", "gpu1")]
    ['host0/pcie-switch0', 'gpu1']
    """
    num_gpus = _positive_int(num_gpus, "num_gpus", 0)
    gpus_per_switch = _positive_int(gpus_per_switch, "gpus_per_switch")
    cpus = _positive_int(cpus, "cpus", 0)
    _check_size(num_gpus + cpus, "num_gpus + cpus")
    if num_gpus + cpus == 0:
        raise ClusterError("topology: a pcie_tree needs at least one CPU or GPU")
    gpu_bw = _positive(gpu_link_bandwidth, "gpu_link_bandwidth")
    up_bw = _positive(uplink_bandwidth, "uplink_bandwidth")
    lat = _nonneg(latency, "latency")
    gkind, gspec = _spec(gpu_kind, specs)
    ckind, cspec = _spec(cpu_kind, specs)
    root = f"{host}/pcie-root"
    devices: list[Device] = []
    links: list[Link] = []
    switches = [root]
    for c in range(cpus):
        devices.append(Device(f"cpu{c}", ckind, cspec, host))
        _both(links, f"cpu{c}", root, cspec.memory_bandwidth, lat, "host")
    nsw = math.ceil(num_gpus / gpus_per_switch)
    for k in range(nsw):
        sw = f"{host}/pcie-switch{k}"
        switches.append(sw)
        _both(links, sw, root, up_bw, lat, link_kind)
    for g in range(num_gpus):
        devices.append(Device(f"gpu{g}", gkind, gspec, host))
        _both(links, f"gpu{g}", f"{host}/pcie-switch{g // gpus_per_switch}", gpu_bw, lat, link_kind)
    recipe = {
        "generator": "pcie_tree",
        "num_gpus": num_gpus,
        "gpus_per_switch": gpus_per_switch,
        "gpu_kind": gpu_kind,
        "cpu_kind": cpu_kind,
        "cpus": cpus,
        "gpu_link_bandwidth": gpu_bw,
        "uplink_bandwidth": up_bw,
        "latency": lat,
        "link_kind": link_kind,
        "host": host,
    }
    attach = switches[1:] or [root]
    return Cluster(
        name or f"pcie-tree-{num_gpus}x{gkind}",
        devices,
        links,
        switches,
        topology="pcie-tree",
        source=source or "meshplace pcie_tree generator",
        meta={"nic_attach": attach},
        recipe=recipe,
    )


# ---------------------------------------------------------------------- NVLink mesh
def nvlink_mesh(
    gpus: int = 8,
    *,
    gpu_kind: str = "a100-80gb",
    nvlink_bandwidth: float | None = None,
    nvlink_latency: float = NVLINK_HOP_LATENCY,
    nvswitch: bool = True,
    cpus: int = 2,
    cpu_kind: str = "xeon",
    pcie_bandwidth: float = PCIE4_X16,
    pcie_latency: float = PCIE_HOP_LATENCY,
    gpus_per_pcie_switch: int = 2,
    socket_bandwidth: float = SOCKET_LINK,
    pcie_kind: str = "pcie",
    host: str = "host0",
    name: str | None = None,
    source: str = "",
    specs: Mapping[str, DeviceSpec] | None = None,
) -> Cluster:
    """GPUs joined all-to-all by NVLink, plus the PCIe tree to the host CPUs (DGX style).

    With ``nvswitch=True`` every GPU has one link each way to ``{host}/nvswitch`` at
    ``nvlink_bandwidth`` (per GPU, per direction: its whole NVLink budget), so any GPU pair
    gets the full rate and a GPU receiving from several peers shares its one switch->GPU
    link. With ``nvswitch=False`` every ordered GPU pair gets its own direct link at
    ``nvlink_bandwidth`` (set it to the per-pair figure). The default bandwidth is the
    kind's NVLink total halved (:data:`NVLINK_PER_DIRECTION`).

    PCIe side: one root ``{host}/pcie-root{c}`` per CPU socket (CPU attached with its memory
    bandwidth), roots chained by ``socket_bandwidth`` links (UPI/xGMI), and PCIe switches of
    ``gpus_per_pcie_switch`` GPUs spread evenly over the roots. Routes prefer NVLink for
    GPU<->GPU (lower cost) and use PCIe for CPU<->GPU.

    Source: NVIDIA DGX A100 / DGX H100 system architecture white papers (8 GPUs, 6 / 4
    NVSwitch chips, 4 PCIe switches each with 2 GPUs, 2 CPU sockets). Complexity O(gpus)
    links with a switch, O(gpus^2) without.

    >>> c = nvlink_mesh(4, cpus=1)
    >>> [c.links[k].kind for k in c.route("gpu0", "gpu3")]
    ['nvlink', 'nvlink']
    >>> c.path_bandwidth("gpu0", "gpu3") / 1e9
    300.0
    """
    gpus = _positive_int(gpus, "gpus")
    cpus = _positive_int(cpus, "cpus", 0)
    per_switch = _positive_int(gpus_per_pcie_switch, "gpus_per_pcie_switch")
    _check_size(gpus + cpus, "gpus + cpus")
    if not nvswitch and gpus > MAX_ALL_TO_ALL_GPUS:
        raise ClusterError(
            f"topology: {gpus} GPUs wired all-to-all (nvswitch: false) would need "
            f"{gpus * (gpus - 1):,} links; at most {MAX_ALL_TO_ALL_GPUS} GPUs without an NVSwitch"
        )
    gkind, gspec = _spec(gpu_kind, specs)
    ckind, cspec = _spec(cpu_kind, specs)
    if nvlink_bandwidth is None:
        if gkind not in NVLINK_PER_DIRECTION:
            raise ClusterError(
                f"topology: gpu_kind {gpu_kind!r} has no NVLink; give nvlink_bandwidth or use "
                f"one of: {', '.join(NVLINK_PER_DIRECTION)}"
            )
        nvlink_bandwidth = NVLINK_PER_DIRECTION[gkind]
    nv_bw = _positive(nvlink_bandwidth, "nvlink_bandwidth")
    nv_lat = _nonneg(nvlink_latency, "nvlink_latency")
    pcie_bw = _positive(pcie_bandwidth, "pcie_bandwidth")
    pcie_lat = _nonneg(pcie_latency, "pcie_latency")
    sock_bw = _positive(socket_bandwidth, "socket_bandwidth")
    devices: list[Device] = []
    links: list[Link] = []
    switches: list[str] = []
    nroots = max(cpus, 1)
    roots = [f"{host}/pcie-root{c}" for c in range(nroots)]
    switches.extend(roots)
    for c in range(cpus):
        devices.append(Device(f"cpu{c}", ckind, cspec, host))
        _both(links, f"cpu{c}", roots[c], cspec.memory_bandwidth, pcie_lat, "host")
    for c in range(nroots - 1):
        _both(links, roots[c], roots[c + 1], sock_bw, SOCKET_LATENCY, "socket")
    nsw = math.ceil(gpus / per_switch)
    pcie_switches = [f"{host}/pcie-switch{k}" for k in range(nsw)]
    switches.extend(pcie_switches)
    for k, sw in enumerate(pcie_switches):
        _both(links, sw, roots[k * nroots // nsw], pcie_bw, pcie_lat, pcie_kind)
    for g in range(gpus):
        devices.append(Device(f"gpu{g}", gkind, gspec, host))
        _both(links, f"gpu{g}", pcie_switches[g // per_switch], pcie_bw, pcie_lat, pcie_kind)
    if nvswitch:
        nvs = f"{host}/nvswitch"
        switches.append(nvs)
        for g in range(gpus):
            _both(links, f"gpu{g}", nvs, nv_bw, nv_lat, "nvlink")
    else:
        for a in range(gpus):
            for b in range(a + 1, gpus):
                _both(links, f"gpu{a}", f"gpu{b}", nv_bw, nv_lat, "nvlink")
    recipe = {
        "generator": "nvlink_mesh",
        "gpus": gpus,
        "gpu_kind": gpu_kind,
        "nvlink_bandwidth": nv_bw,
        "nvlink_latency": nv_lat,
        "nvswitch": bool(nvswitch),
        "cpus": cpus,
        "cpu_kind": cpu_kind,
        "pcie_bandwidth": pcie_bw,
        "pcie_latency": pcie_lat,
        "gpus_per_pcie_switch": per_switch,
        "socket_bandwidth": sock_bw,
        "pcie_kind": pcie_kind,
        "host": host,
    }
    return Cluster(
        name or f"nvlink-{gpus}x{gkind}",
        devices,
        links,
        switches,
        topology="nvlink-mesh",
        source=source or "meshplace nvlink_mesh generator",
        meta={"nic_attach": pcie_switches},
        recipe=recipe,
    )


# ---------------------------------------------------------------------- torus
def torus(
    dims: Sequence[int] = (32, 32),
    *,
    device_kind: str = "tpu-v3",
    link_bandwidth: float = TPU_V3_ICI,
    latency: float = ICI_HOP_LATENCY,
    wrap: bool | Sequence[bool] = True,
    chips_per_host: Sequence[int] | None = None,
    name_prefix: str = "tpu",
    link_kind: str = "ici",
    name: str | None = None,
    source: str = "",
    specs: Mapping[str, DeviceSpec] | None = None,
) -> Cluster:
    """A 1D/2D/3D torus (``wrap=True``) or mesh (``wrap=False``, per dimension if a list) of
    identical chips, routed by dimension order (see :mod:`meshplace.hardware.cluster`).

    Devices ``{name_prefix}{i}`` are numbered in C order of their coordinates (last dimension
    fastest). Each chip has one link each way to its "+" and "-" neighbour in every
    dimension. A wrapped ring of size 2 has both neighbours equal: its two physical links are
    merged into one link of twice the bandwidth each way. ``chips_per_host`` (default
    2 x 2 over the first two dimensions — a TPU v2/v3/v4 host drives 4 chips) groups
    chips into hosts ``host{k}``.

    Source: TPU v2/v3 2D torus and v4 3D torus (Jouppi et al., CACM 2020 and ISCA 2023;
    Cloud TPU system architecture docs). O(n * len(dims)) links; routes O(diameter) each.

    >>> c = torus((32, 32), link_bandwidth=100e9)
    >>> len(c), len(c.route(0, 16 * 32 + 16))
    (1024, 32)
    """
    dims_t = tuple(_positive_int(x, "every entry of dims") for x in dims)
    if not 1 <= len(dims_t) <= 4:
        raise ClusterError(f"topology: dims must have 1 to 4 entries, not {len(dims_t)}")
    n = int(np.prod(dims_t))
    if n > MAX_DEVICES:
        raise ClusterError(f"topology: dims {dims_t} give {n} chips; at most {MAX_DEVICES} allowed")
    wrap_t = (bool(wrap),) * len(dims_t) if isinstance(wrap, bool) else tuple(map(bool, wrap))
    if len(wrap_t) != len(dims_t):
        raise ClusterError(f"topology: wrap has {len(wrap_t)} entries but dims has {len(dims_t)}")
    bw = _positive(link_bandwidth, "link_bandwidth")
    lat = _nonneg(latency, "latency")
    if chips_per_host is None:
        per_host = tuple(min(2, dims_t[d]) if d < 2 else 1 for d in range(len(dims_t)))
    else:
        per_host = tuple(_positive_int(x, "every entry of chips_per_host") for x in chips_per_host)
        if len(per_host) != len(dims_t):
            raise ClusterError(
                f"topology: chips_per_host has {len(per_host)} entries but dims has {len(dims_t)}"
            )
    kind, spec = _spec(device_kind, specs)
    idx = np.arange(n).reshape(dims_t)
    coords = np.stack(np.unravel_index(np.arange(n), dims_t), axis=1)
    blocks = tuple(math.ceil(dims_t[d] / per_host[d]) for d in range(len(dims_t)))
    host_of = np.ravel_multi_index(tuple((coords // np.array(per_host)).T), blocks)
    names = [f"{name_prefix}{i}" for i in range(n)]
    devices = [Device(names[i], kind, spec, f"host{int(host_of[i])}") for i in range(n)]
    next_node = np.full((len(dims_t), 2, n), -1, dtype=np.int64)
    link_of = np.full((len(dims_t), 2, n), -1, dtype=np.int64)
    links: list[Link] = []
    for d, size in enumerate(dims_t):
        if size == 1:
            continue
        plus = np.roll(idx, -1, axis=d).reshape(-1)
        minus = np.roll(idx, 1, axis=d).reshape(-1)
        pos = coords[:, d]
        merged = wrap_t[d] and size == 2
        for s, nbr in ((0, plus), (1, minus)):
            if merged and s == 1:
                link_of[d, 1] = link_of[d, 0]
                next_node[d, 1] = next_node[d, 0]
                break
            has = np.ones(n, bool) if wrap_t[d] else (pos < size - 1 if s == 0 else pos > 0)
            link_bw = 2 * bw if merged else bw
            sign = "+" if s == 0 else "-"
            for i in np.flatnonzero(has).tolist():
                j = int(nbr[i])
                link_of[d, s, i] = len(links)
                next_node[d, s, i] = j
                links.append(
                    Link(
                        f"{names[i]}->{names[j]} d{d}{sign}",
                        names[i],
                        names[j],
                        link_bw,
                        lat,
                        link_kind,
                    )
                )
    routing = TorusRouting(dims_t, wrap_t, next_node, link_of)
    shape = "x".join(map(str, dims_t))
    recipe = {
        "generator": "torus",
        "dims": list(dims_t),
        "device_kind": device_kind,
        "link_bandwidth": bw,
        "latency": lat,
        "wrap": list(wrap_t),
        "chips_per_host": list(per_host),
        "name_prefix": name_prefix,
        "link_kind": link_kind,
    }
    return Cluster(
        name or f"{'torus' if all(wrap_t) else 'mesh'}-{shape}-{kind}",
        devices,
        links,
        [],
        topology="torus" if any(wrap_t) else "mesh",
        source=source or "meshplace torus generator",
        recipe=recipe,
        torus=routing,
    )


# ---------------------------------------------------------------------- multi-host
def multi_host(
    hosts: int,
    per_host_builder: Callable[[str], Cluster],
    nic_bandwidth: float,
    nic_latency: float = NIC_LATENCY,
    *,
    nic_attach: Sequence[str] | None = None,
    nic_per_device: bool = False,
    name: str | None = None,
    source: str = "",
) -> Cluster:
    """``hosts`` copies of a one-host cluster joined through NICs by one network switch.

    ``per_host_builder(host_name)`` builds host ``host{h}``; its devices are renamed
    ``host{h}/{name}`` and its switches prefixed ``host{h}/`` when they are not already. A NIC
    ``host{h}/nic{k}`` (``nic_bandwidth`` each way) plugs into each attach point: the node
    names (without the host prefix) in ``nic_attach``, else the host cluster's
    ``meta["nic_attach"]`` (its PCIe switches for the generators here, like the NIC-per-
    PCIe-switch layout of DGX systems), else its first switch, else its first device. With
    ``nic_per_device=True`` instead, every device gets its own NIC wired straight to it
    (GPUDirect RDMA with one NIC per GPU, as in DGX A100/H100 compute fabrics), so each
    GPU's cross-host traffic is limited by its own NIC. NICs link to the switch ``network``
    with ``nic_latency / 2`` each way, so crossing hosts adds ``nic_latency``. The network
    is one non-blocking switch (a full-bisection fat tree).

    Source: DGX SuperPOD-style rail networks, simplified to one switch. O(hosts x host size).

    >>> c = multi_host(2, lambda h: pcie_tree(2, 2, host=h), nic_bandwidth=12.5e9)
    >>> c.device_names
    ['host0/cpu0', 'host0/gpu0', 'host0/gpu1', 'host1/cpu0', 'host1/gpu0', 'host1/gpu1']
    >>> c.path_bandwidth("host0/gpu0", "host1/gpu1") / 1e9
    10.0
    """
    hosts = _positive_int(hosts, "hosts")
    nic_bw = _positive(nic_bandwidth, "nic_bandwidth")
    nic_lat = _nonneg(nic_latency, "nic_latency")
    devices: list[Device] = []
    links: list[Link] = []
    switches: list[str] = ["network"]
    first: Cluster | None = None
    for h in range(hosts):
        hname = f"host{h}"
        sub = per_host_builder(hname)
        if first is None:
            first = sub
            _check_size(hosts * len(sub.devices), f"{hosts} hosts x {len(sub.devices)} devices")
        prefix = f"{hname}/"
        rename: dict[str, str] = {}
        for d in sub.devices:
            rename[d.name] = prefix + d.name
            devices.append(Device(prefix + d.name, d.kind, d.spec, hname))
        for s in sub.switches:
            rename[s] = s if s.startswith(prefix) else prefix + s
            switches.append(rename[s])
        for lk in sub.links:
            src, dst = rename[lk.src], rename[lk.dst]
            links.append(replace(lk, name=f"{src}->{dst}", src=src, dst=dst))
        if nic_per_device:
            points = [prefix + d.name for d in sub.devices]
        elif nic_attach is not None:
            points = [prefix + p for p in nic_attach]
        elif sub.meta.get("nic_attach"):
            points = [rename[p] for p in sub.meta["nic_attach"]]
        elif sub.switches:
            points = [rename[sub.switches[0]]]
        else:
            points = [rename[sub.devices[0].name]]
        for k, point in enumerate(points):
            if point not in rename.values():
                raise ClusterError(
                    f"topology: nic_attach names {point!r}, which host {hname} does not have"
                )
            nic = f"{hname}/nic{k}"
            switches.append(nic)
            _both(links, point, nic, nic_bw, 0.0, "nic")
            _both(links, nic, "network", nic_bw, nic_lat / 2, "network")
    assert first is not None
    recipe = None
    if first.recipe is not None:
        per_host = {k: v for k, v in first.recipe.items() if k not in ("host", "name", "source")}
        recipe = {
            "generator": "multi_host",
            "hosts": hosts,
            "per_host": per_host,
            "nic_bandwidth": nic_bw,
            "nic_latency": nic_lat,
        }
        if nic_attach is not None:
            recipe["nic_attach"] = list(nic_attach)
        if nic_per_device:
            recipe["nic_per_device"] = True
    return Cluster(
        name or f"{hosts}x-{first.name}",
        devices,
        links,
        switches,
        topology="multi-host",
        source=source or f"meshplace multi_host generator over: {first.source}",
        meta={k: v for k, v in first.meta.items() if k != "nic_attach"},
        recipe=recipe,
    )


GENERATORS: dict[str, Callable[..., Cluster]] = {
    "pcie_tree": pcie_tree,
    "nvlink_mesh": nvlink_mesh,
    "torus": torus,
    "multi_host": multi_host,
}


def _check_size(n: int, what: str) -> None:
    if n > MAX_DEVICES:
        raise ClusterError(f"topology: {what} give {n:,} devices; at most {MAX_DEVICES:,} allowed")


def build_topology(block: dict[str, Any]) -> Cluster:
    """Build a cluster from an already-validated ``topology:`` block (a generator's keyword
    arguments plus ``generator``; for ``multi_host``, ``per_host`` is a nested block; an
    optional ``specs`` entry maps custom kind names to their specs).

    >>> len(build_topology({"generator": "torus", "dims": [4, 4], "link_bandwidth": 1e9}))
    16
    """
    params = dict(block)
    gen = params.pop("generator")
    specs = params.pop("specs", None)
    if gen == "multi_host":
        inner = dict(params.pop("per_host"))
        inner_gen = inner.pop("generator")
        inner.pop("host", None)  # multi_host names the hosts
        if inner_gen not in ("pcie_tree", "nvlink_mesh"):
            raise ClusterError(
                f"topology: per_host generator {inner_gen!r} is not allowed; "
                "allowed: pcie_tree, nvlink_mesh"
            )
        builder = GENERATORS[inner_gen]
        return multi_host(
            per_host_builder=lambda h: builder(host=h, specs=specs, **inner), **params
        )
    return GENERATORS[gen](specs=specs, **params)
