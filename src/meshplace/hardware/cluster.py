"""Clusters: devices, directed links, switches, and deterministic routes between devices.

A :class:`Cluster` is a directed network. Its nodes are the devices (which run ops) and the
switches (which only forward: PCIe switches and root complexes, NVSwitch, NICs, the network);
its edges are :class:`Link` objects, one per direction, each with a bandwidth (bytes/s) and a
latency (seconds). A transfer between two devices follows one fixed route, so a simulator can
charge each link it crosses and model contention on shared links (e.g. two GPUs under one
PCIe switch sharing the switch's uplink).

Routing
-------
- **Tori** built by :func:`meshplace.hardware.topology.torus` use *dimension-order routing*:
  correct the coordinate of dimension 0 first, then 1, then 2; on a ring with wrap-around go
  the shorter way, and when both ways are equally long (a ring of even size, half-way round)
  go the "+" way. Routes are computed arithmetically on demand (O(hops) each, cached), so a
  4,096-chip pod needs no all-pairs precomputation.
- **Everything else** uses shortest paths (networkx Dijkstra) where a link costs
  ``latency + 1 MiB / bandwidth`` — the time to push a 1 MiB message across it, so routes
  prefer fast links (NVLink over PCIe) and then fewer hops. A route passes *through* another
  device only where no path through switches exists (each relay adds a 1 s penalty to the
  cost), so a CPU never reaches a GPU by way of a neighbouring GPU's NVLink. Ties are broken
  by the order of the links, so routes are deterministic. One Dijkstra per source device,
  run the first time a route from that source is asked for (O(E + V log V)); its
  shortest-path tree is kept as one array of V link indices (a bounded number of sources
  is cached), and a route is read off it in O(hops). Nothing is computed for all pairs
  unless :meth:`Cluster.route_table` is asked for, so a cluster of 10,000 devices builds
  in about a second and routes only the device pairs a plan uses.

Where two links join the same pair of nodes in the same direction, routes use the one with
the highest bandwidth (then lowest latency, then first listed).

Example
-------
>>> from meshplace.hardware.catalogue import device_spec
>>> spec = device_spec("v100")
>>> devs = [Device("gpu0", "v100", spec), Device("gpu1", "v100", spec)]
>>> links = [Link("a", "gpu0", "sw", 10e9, 1e-6), Link("b", "sw", "gpu1", 10e9, 1e-6),
...          Link("c", "gpu1", "sw", 10e9, 1e-6), Link("d", "sw", "gpu0", 10e9, 1e-6)]
>>> c = Cluster("tiny", devs, links, switches=["sw"])
>>> c.route(0, 1)
(0, 1)
>>> round(c.transfer_time(0, 1, 10e9), 6)
1.000002
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx
import numpy as np

from meshplace.hardware.catalogue import TRANSFER_MODES, DeviceSpec
from meshplace.hardware.errors import ClusterError, UnknownDeviceError, allowed

# The message size that turns a link's (latency, bandwidth) into one routing cost.
ROUTING_MESSAGE_BYTES = 2**20
# Extra routing cost (seconds) for passing *through* a device, so routes relay through other
# devices only where the network offers no switch path (e.g. GPUs linked in a ring).
DEVICE_RELAY_PENALTY = 1.0
_TORUS_CACHE_LIMIT = 1 << 16
# Cached shortest-path trees hold at most this many entries (int32 link indices) in all.
_TREE_CACHE_ENTRIES = 1 << 24


@dataclass(frozen=True)
class Device:
    """A device that runs ops. ``kind`` is the catalogue key (or a custom kind), ``spec`` what
    it can do (possibly a catalogue spec with overrides), ``host`` the machine it sits in."""

    name: str
    kind: str
    spec: DeviceSpec
    host: str = "host0"

    def with_transfers(self, mode: str) -> Device:
        """This device with ``spec.transfers`` set to ``mode`` (``"overlap"`` or
        ``"occupy"``)."""
        if mode not in TRANSFER_MODES:
            raise ClusterError(
                f"unknown transfer mode {mode!r}; allowed: {', '.join(TRANSFER_MODES)}"
            )
        if self.spec.transfers == mode:
            return self
        return Device(self.name, self.kind, self.spec.with_overrides(transfers=mode), self.host)


@dataclass(frozen=True)
class Link:
    """One direction of a physical link between two nodes (device or switch names).

    ``bandwidth`` in bytes/s, ``latency`` in seconds; ``kind`` is a free label such as
    ``"pcie3"``, ``"nvlink"``, ``"ici"`` or ``"network"``, used only for summaries.
    ``latency_overlaps``: the latency is time in flight, not on the wire — a transfer
    holds the link for its bytes only and the next one leaves while it travels (a TCP
    connection between processes, whose latency is both ends' software; see
    :mod:`meshplace.sim.engine`); by default a transfer holds it for its latency too."""

    name: str
    src: str
    dst: str
    bandwidth: float
    latency: float
    kind: str = ""
    latency_overlaps: bool = False


@dataclass(frozen=True)
class TorusRouting:
    """Arithmetic description of a torus (or mesh) whose devices are numbered in C order of
    their coordinates (last dimension fastest).

    ``next_node[d, s, i]`` and ``link_of[d, s, i]`` give the neighbour of device ``i`` along
    dimension ``d`` in direction ``s`` (0 = "+", 1 = "-") and the index of the link to it,
    or -1 where there is none (the edge of a mesh, a dimension of size 1)."""

    dims: tuple[int, ...]
    wrap: tuple[bool, ...]
    next_node: np.ndarray = field(repr=False, compare=False)
    link_of: np.ndarray = field(repr=False, compare=False)

    def coords(self, i: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(i, self.dims))

    def steps(self, a: int, b: int, d: int) -> tuple[int, int]:
        """(hops, direction) from coordinate ``a`` to ``b`` along dimension ``d``."""
        n = self.dims[d]
        if self.wrap[d]:
            fwd = (b - a) % n
            return (fwd, 0) if fwd <= n - fwd else (n - fwd, 1)
        return (b - a, 0) if b >= a else (a - b, 1)


class Cluster:
    """A set of devices joined by directed links, with deterministic routes.

    Args:
        name: cluster name.
        devices: the devices, in index order (index = position).
        links: directed links between node names (devices or ``switches``).
        switches: names of forwarding-only nodes.
        topology: a label: ``"pcie-tree"``, ``"nvlink-mesh"``, ``"torus"``, ``"multi-host"``,
            ``"custom"``.
        source: citation for the cluster's structure and numbers.
        meta: free-form extra facts (e.g. calibrated software overheads); JSON-ready.
        origin: what to call the cluster in error messages (a file name, a preset name).
        recipe: the ``topology:`` block (generator and parameters) that rebuilds this cluster,
            if it came from a generator; used when writing YAML.
        torus: arithmetic routing for a torus; set by the torus generator.

    Raises :class:`ClusterError` (one sentence naming the field) on duplicate names, links
    naming unknown nodes, non-positive bandwidth, negative latency, or devices that cannot
    reach each other.
    """

    def __init__(
        self,
        name: str,
        devices: Iterable[Device],
        links: Iterable[Link],
        switches: Iterable[str] = (),
        topology: str = "custom",
        source: str = "",
        *,
        meta: dict[str, Any] | None = None,
        origin: str | None = None,
        recipe: dict[str, Any] | None = None,
        torus: TorusRouting | None = None,
    ) -> None:
        self.name = name
        self.devices: list[Device] = list(devices)
        self.links: list[Link] = list(links)
        self.switches: list[str] = list(switches)
        self.topology = topology
        self.source = source
        self.meta: dict[str, Any] = dict(meta or {})
        self.origin = origin or f"cluster {name!r}"
        self.recipe = recipe
        self._torus = torus
        self._validate_nodes()
        n = len(self.devices)
        self._index = {d.name: i for i, d in enumerate(self.devices)}
        self._node_index = dict(self._index)
        for k, s in enumerate(self.switches):
            self._node_index[s] = n + k
        self._validate_links()
        self.link_src = np.array([self._node_index[lk.src] for lk in self.links], dtype=np.int32)
        self.link_dst = np.array([self._node_index[lk.dst] for lk in self.links], dtype=np.int32)
        self.link_bandwidth = np.array([lk.bandwidth for lk in self.links], dtype=np.float64)
        self.link_latency = np.array([lk.latency for lk in self.links], dtype=np.float64)
        self._graph: nx.DiGraph | None = None
        self._best: dict[tuple[int, int], int] | None = None
        self._trees: dict[int, np.ndarray] = {}
        self._torus_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        self._table: tuple[np.ndarray, np.ndarray] | None = None
        self._dfs: list[int] | None = None  # the depth-first device order, computed once
        if torus is not None:
            self._check_torus(torus)
        elif n > 1:
            self._check_connected()

    def with_transfers(self, mode: str) -> Cluster:
        """The same cluster with every device's transfers set to ``mode``: ``"occupy"``
        (each device is busy for every transfer it sends or receives) or ``"overlap"``
        (copy engines move the data). What ``--transfers`` on ``plan`` and ``simulate``
        applies.

        >>> from meshplace.hardware import load_cluster
        >>> c = load_cluster("colocrl-2gpu").with_transfers("occupy")
        >>> {d.spec.transfers for d in c.devices}
        {'occupy'}
        """
        return Cluster(
            self.name,
            [d.with_transfers(mode) for d in self.devices],
            self.links,
            self.switches,
            self.topology,
            self.source,
            meta=self.meta,
            origin=self.origin,
            recipe=self.recipe,
            torus=self._torus,
        )

    def with_link_latency(
        self, latency: float | None, *, latency_overlaps: bool | None = None
    ) -> Cluster:
        """The same cluster with every link's latency ``latency`` seconds (a route of
        several links pays it per link; ``None``: as it is) and, unless ``None``, every
        link's ``latency_overlaps``: for the calibrated ``local`` cluster, whose workers are
        joined by one loopback TCP link each way, the hop latency an in-situ calibration
        measured (:func:`meshplace.profile.calibrate.calibrate_in_situ`), spent in flight.
        The copy has no generator recipe, so a saved copy lists its links.

        >>> from meshplace.hardware import load_cluster
        >>> c = load_cluster("colocrl-2gpu").with_link_latency(1e-3, latency_overlaps=True)
        >>> {(lk.latency, lk.latency_overlaps) for lk in c.links}
        {(0.001, True)}
        """
        changes: dict[str, Any] = {}
        if latency is not None:
            changes["latency"] = float(latency)
        if latency_overlaps is not None:
            changes["latency_overlaps"] = bool(latency_overlaps)
        return Cluster(
            self.name,
            self.devices,
            [replace(lk, **changes) for lk in self.links],
            self.switches,
            self.topology,
            self.source,
            meta=self.meta,
            origin=self.origin,
            recipe=None,  # a recipe would rebuild the links at their old latency
            torus=self._torus,
        )

    # ------------------------------------------------------------------ basics
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return (
            f"Cluster({self.name!r}, {len(self.devices)} devices, {len(self.links)} links, "
            f"topology={self.topology!r})"
        )

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    @property
    def node_names(self) -> list[str]:
        """Device names (indices 0..n-1) then switch names (n..)."""
        return self.device_names + self.switches

    @property
    def dims(self) -> tuple[int, ...] | None:
        """The torus/mesh shape when routes are dimension-ordered, else None."""
        return self._torus.dims if self._torus is not None else None

    def coords(self, device: int | str) -> tuple[int, ...]:
        """Torus coordinates of a device (C order, last dimension fastest)."""
        if self._torus is None:
            raise ClusterError(f"{self.origin}: cluster {self.name!r} is not a torus")
        return self._torus.coords(self._idx(device))

    def device_index(self, name: str) -> int:
        """Index of the device called ``name``; raises :class:`UnknownDeviceError`."""
        try:
            return self._index[name]
        except KeyError:
            raise UnknownDeviceError(
                f"{self.origin}: cluster {self.name!r} has no device {name!r}; "
                f"devices include: {allowed(self._index, 8)}"
            ) from None

    def device(self, device: int | str) -> Device:
        return self.devices[self._idx(device)]

    def hosts(self) -> dict[str, list[int]]:
        """host name -> indices of its devices, in first-seen order."""
        out: dict[str, list[int]] = {}
        for i, d in enumerate(self.devices):
            out.setdefault(d.host, []).append(i)
        return out

    def _idx(self, device: int | str) -> int:
        if isinstance(device, str):
            return self.device_index(device)
        i = int(device)
        if not 0 <= i < len(self.devices):
            raise UnknownDeviceError(
                f"{self.origin}: device index {device} is out of range; cluster {self.name!r} "
                f"has {len(self.devices)} devices (0 to {len(self.devices) - 1})"
            )
        return i

    # ------------------------------------------------------------------ routes
    def route(self, src_dev: int | str, dst_dev: int | str) -> tuple[int, ...]:
        """Indices into :attr:`links` along the route from one device to another; ``()`` when
        they are the same device. Deterministic (see the module docstring)."""
        i, j = self._idx(src_dev), self._idx(dst_dev)
        if i == j:
            return ()
        if self._table is not None:
            ptr, links = self._table
            k = i * len(self.devices) + j
            return tuple(int(x) for x in links[ptr[k] : ptr[k + 1]])
        if self._torus is not None:
            key = (i, j)
            hit = self._torus_cache.get(key)
            if hit is None:
                if len(self._torus_cache) >= _TORUS_CACHE_LIMIT:
                    self._torus_cache.clear()
                hit = self._torus_route(i, j)
                self._torus_cache[key] = hit
            return hit
        return self._tree_route(self._tree_from(i), i, j)

    def routes(
        self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The routes of the given device pairs (``src[k]`` to ``dst[k]``, device indices) in
        CSR form: the route of pair ``k`` is ``links[ptr[k] : ptr[k + 1]]``; ``ptr`` int64 of
        length pairs + 1, ``links`` int32. Computes only these routes (one Dijkstra per
        distinct source on general topologies, arithmetic on tori), so it is what a
        simulator of a plan on a large cluster uses instead of :meth:`route_table`.

        >>> from meshplace.hardware.presets import load_cluster
        >>> c = load_cluster("colocrl-4gpu")
        >>> ptr, links = c.routes([1, 2], [2, 3])
        >>> tuple(links[ptr[1] : ptr[2]].tolist()) == c.route(2, 3)
        True
        """
        src_a = np.asarray(src, dtype=np.int64).ravel()
        dst_a = np.asarray(dst, dtype=np.int64).ravel()
        if src_a.shape != dst_a.shape:
            raise ValueError("routes() needs as many sources as destinations")
        chunks = [self.route(int(i), int(j)) for i, j in zip(src_a.tolist(), dst_a.tolist())]
        ptr = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in chunks], out=ptr[1:])
        links = np.fromiter((x for r in chunks for x in r), dtype=np.int32, count=int(ptr[-1]))
        return ptr, links

    def accelerators(self) -> list[int]:
        """Indices of the devices that are not host CPUs (catalogue category ``gpu``,
        ``tpu`` or ``accelerator``; :attr:`DeviceSpec.category`), in index order. Empty for
        a cluster made only of CPUs, which a mesh (``meshplace shard``) cannot use.

        >>> from meshplace.hardware.presets import load_cluster
        >>> load_cluster("colocrl-2gpu").accelerators()
        [1, 2]
        """
        return [i for i, d in enumerate(self.devices) if d.spec.category != "cpu"]

    def route_table(self) -> tuple[np.ndarray, np.ndarray]:
        """All routes in CSR form: the route from device ``i`` to ``j`` is
        ``links[ptr[i*n + j] : ptr[i*n + j + 1]]``. ``ptr`` is int64 of length n*n + 1,
        ``links`` int32. Built on first call and kept.

        Tori are built vectorised in numpy, O(n^2 * mean hops) time and int32 memory: a
        wrapped torus translates the routes out of device 0 to every source (1,024 chips:
        ~0.2 s, 67 MB; 4,096 chips: a few seconds, 0.8 GB). Other topologies run one
        Dijkstra per device. Quadratic by nature: for a few pairs of a large cluster use
        :meth:`route` or :meth:`routes`.
        """
        if self._table is None:
            if self._torus is not None:
                self._table = self._torus_table()
            else:
                self._table = self._general_table()
        return self._table

    def path_latency(self, i: int | str, j: int | str) -> float:
        """Sum of link latencies along the route (0 for the same device)."""
        r = self.route(i, j)
        return float(self.link_latency[list(r)].sum()) if r else 0.0

    def path_bandwidth(self, i: int | str, j: int | str) -> float:
        """Bottleneck (minimum) bandwidth along the route; ``inf`` for the same device."""
        r = self.route(i, j)
        return float(self.link_bandwidth[list(r)].min()) if r else math.inf

    def transfer_time(self, i: int | str, j: int | str, nbytes: float) -> float:
        """Seconds to move ``nbytes`` from device ``i`` to ``j`` with no contention: the sum of
        the route's latencies plus ``nbytes`` over its bottleneck bandwidth (0 when i == j).

        >>> from meshplace.hardware.presets import load_cluster
        >>> c = load_cluster("tpu-v3-pod")
        >>> c.transfer_time(0, 1, 100e9) == c.path_latency(0, 1) + 1.0
        True
        """
        r = self.route(i, j)
        if not r:
            return 0.0
        idx = list(r)
        return float(self.link_latency[idx].sum() + nbytes / self.link_bandwidth[idx].min())

    def path_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """(latency, bandwidth): n x n arrays of route latency sums and bottleneck bandwidths
        (0 and inf on the diagonal). Tori whose links are uniform per dimension get them
        arithmetically from hop counts (no route table); others from :meth:`route_table`."""
        n = len(self.devices)
        per_dim = self._torus_uniform() if self._torus is not None else None
        if per_dim is not None:
            latency = np.zeros(n * n)
            bandwidth = np.full(n * n, math.inf)
            for a in range(0, n, max(1, (1 << 22) // n)):
                b = min(n, a + max(1, (1 << 22) // n))
                src = np.repeat(np.arange(a, b), n)
                dst = np.tile(np.arange(n), b - a)
                hops, _ = self._torus_hops(src, dst)
                for d, (bw, lat) in enumerate(per_dim):
                    latency[a * n : b * n] += hops[:, d] * lat
                    np.minimum(
                        bandwidth[a * n : b * n],
                        np.where(hops[:, d] > 0, bw, math.inf),
                        out=bandwidth[a * n : b * n],
                    )
            return latency.reshape(n, n), bandwidth.reshape(n, n)
        ptr, links = self.route_table()
        lat_c = np.concatenate([[0.0], np.cumsum(self.link_latency[links])])
        latency = (lat_c[ptr[1:]] - lat_c[ptr[:-1]]).reshape(n, n)
        bandwidth = np.full(n * n, math.inf)
        nonempty = ptr[1:] > ptr[:-1]
        if links.size:
            bandwidth[nonempty] = np.minimum.reduceat(
                self.link_bandwidth[links], ptr[:-1][nonempty]
            )
        return latency, bandwidth.reshape(n, n)

    def ring_order(self, devices: Sequence[int | str] | None = None) -> list[int]:
        """A ring (Hamiltonian cycle where the topology allows) through ``devices`` (default:
        all), for ring collectives.

        - Torus/mesh: boustrophedon ("snake") order — dimension 0 outermost, each inner sweep
          reversed on alternate rows — so consecutive devices are neighbours; on a torus whose
          first dimension is even and wraps, the last device is also a neighbour of the first.
        - Other topologies: depth-first order of the network from device 0 (neighbours by
          index), so devices under one switch or in one host are consecutive and the ring
          crosses each shared uplink as rarely as possible.

        O(n + E). A subset is returned in the same relative order.

        >>> from meshplace.hardware.topology import torus
        >>> torus((2, 3), link_bandwidth=1e9).ring_order()
        [0, 1, 2, 5, 4, 3]
        """
        order = _snake(self._torus.dims) if self._torus is not None else self._dfs_order()
        if devices is None:
            return list(order)
        wanted = {self._idx(d) for d in devices}
        return [i for i in order if i in wanted]

    # ------------------------------------------------------------------ internals
    def _validate_nodes(self) -> None:
        where = self.origin
        if not self.devices:
            raise ClusterError(f"{where}: field 'devices' is empty; a cluster needs a device")
        seen: set[str] = set()
        for d in self.devices:
            if not isinstance(d.name, str) or not d.name:
                raise ClusterError(f"{where}: field 'devices' has a device with an empty name")
            if d.name in seen:
                raise ClusterError(
                    f"{where}: field 'devices' has two devices named {d.name!r}; "
                    "device names must be unique"
                )
            seen.add(d.name)
        for s in self.switches:
            if not isinstance(s, str) or not s:
                raise ClusterError(f"{where}: field 'switches' has an empty switch name")
            if s in seen:
                raise ClusterError(
                    f"{where}: field 'switches' names {s!r} twice or also as a device; "
                    "node names must be unique"
                )
            seen.add(s)

    def _validate_links(self) -> None:
        where = self.origin
        for k, lk in enumerate(self.links):
            label = f"{where}: field 'links' entry {k} ({lk.src!r} -> {lk.dst!r})"
            for end in (lk.src, lk.dst):
                if end not in self._node_index:
                    raise ClusterError(
                        f"{label} names node {end!r}, which is neither a device nor a switch; "
                        f"known nodes include: {allowed(self._node_index, 8)}"
                    )
            if lk.src == lk.dst:
                raise ClusterError(f"{label} connects {lk.src!r} to itself")
            if not (isinstance(lk.bandwidth, int | float) and math.isfinite(lk.bandwidth)):
                raise ClusterError(f"{label} has bandwidth {lk.bandwidth!r}; it must be finite")
            if lk.bandwidth <= 0:
                raise ClusterError(
                    f"{label} has bandwidth {lk.bandwidth!r}; it must be greater than 0 bytes/s"
                )
            if not (isinstance(lk.latency, int | float) and math.isfinite(lk.latency)):
                raise ClusterError(f"{label} has latency {lk.latency!r}; it must be finite")
            if lk.latency < 0:
                raise ClusterError(
                    f"{label} has latency {lk.latency!r}; it must be 0 seconds or more"
                )

    def _routing_graph(self) -> nx.DiGraph:
        if self._graph is None:
            g = nx.DiGraph()
            g.add_nodes_from(range(len(self._node_index)))
            best: dict[tuple[int, int], int] = {}
            for k, lk in enumerate(self.links):
                key = (int(self.link_src[k]), int(self.link_dst[k]))
                old = best.get(key)
                if old is None or (-lk.bandwidth, lk.latency) < (
                    -self.links[old].bandwidth,
                    self.links[old].latency,
                ):
                    best[key] = k
            for (u, v), k in best.items():
                lk = self.links[k]
                g.add_edge(u, v, w=lk.latency + ROUTING_MESSAGE_BYTES / lk.bandwidth)
            self._graph, self._best = g, best
        return self._graph

    def _check_connected(self) -> None:
        g = self._routing_graph()
        n = len(self.devices)
        down = nx.descendants(g, 0)
        up = nx.ancestors(g, 0)
        first = self.devices[0].name
        for j in range(1, n):
            if j not in down:
                raise ClusterError(
                    f"{self.origin}: field 'links' leaves device {self.devices[j].name!r} "
                    f"unreachable from device {first!r}; every device must reach every other"
                )
            if j not in up:
                raise ClusterError(
                    f"{self.origin}: field 'links' gives device {self.devices[j].name!r} "
                    f"no route back to device {first!r}; every device must reach every other"
                )

    def _check_torus(self, t: TorusRouting) -> None:
        n = len(self.devices)
        if int(np.prod(t.dims)) != n or t.link_of.shape != (len(t.dims), 2, n):
            raise ClusterError(
                f"{self.origin}: torus routing of shape {t.dims} does not match {n} devices"
            )
        ok = t.link_of >= 0
        li = t.link_of[ok]
        src_ok = self.link_src[li] == np.broadcast_to(np.arange(n), t.link_of.shape)[ok]
        dst_ok = self.link_dst[li] == t.next_node[ok]
        if not (src_ok.all() and dst_ok.all()):
            raise ClusterError(f"{self.origin}: torus routing tables disagree with the links")

    def _tree_from(self, i: int) -> np.ndarray:
        """The shortest-path tree out of device ``i``: for every node, the index of the link
        that enters it on its route from ``i`` (-1 for ``i`` itself). One Dijkstra
        (networkx), kept in a cache bounded by :data:`_TREE_CACHE_ENTRIES` in all."""
        tree = self._trees.get(i)
        if tree is not None:
            return tree
        g = self._routing_graph()
        assert self._best is not None
        best = self._best
        n = len(self.devices)

        def cost(u: int, v: int, data: dict[str, float]) -> float:
            # Leaving a device other than the source (relaying through it) costs a second
            # extra: used only where no switch path exists.
            return data["w"] + (DEVICE_RELAY_PENALTY if u < n and u != i else 0.0)

        # pred[v][0] is the node before v on the path networkx's single_source_dijkstra_path
        # returns (it rebuilds paths from the same first predecessors), so routes are the
        # same as reading those paths.
        pred, _ = nx.dijkstra_predecessor_and_distance(g, i, weight=cost)
        tree = np.full(len(self._node_index), -1, dtype=np.int32)
        for v, before in pred.items():
            if before:
                tree[v] = best[(before[0], v)]
        limit = max(2, _TREE_CACHE_ENTRIES // max(1, tree.size))
        while len(self._trees) >= limit:
            self._trees.pop(next(iter(self._trees)))
        self._trees[i] = tree
        return tree

    def _tree_route(self, tree: np.ndarray, i: int, j: int) -> tuple[int, ...]:
        out: list[int] = []
        v = j
        while v != i:
            k = int(tree[v])
            if k < 0:
                raise ClusterError(
                    f"{self.origin}: no route from device {self.devices[i].name!r} to node "
                    f"{self.node_names[v]!r}"
                )
            out.append(k)
            v = int(self.link_src[k])
        out.reverse()
        return tuple(out)

    def _general_table(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.devices)
        lengths = np.zeros(n * n, dtype=np.int64)
        chunks: list[np.ndarray] = []
        for i in range(n):
            tree = self._tree_from(i)
            routes = [self._tree_route(tree, i, j) if j != i else () for j in range(n)]
            flat = [x for r in routes for x in r]
            lengths[i * n : (i + 1) * n] = [len(r) for r in routes]
            chunks.append(np.asarray(flat, dtype=np.int32))
        ptr = np.zeros(n * n + 1, dtype=np.int64)
        np.cumsum(lengths, out=ptr[1:])
        links = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        return ptr, links

    def _torus_route(self, i: int, j: int) -> tuple[int, ...]:
        t = self._torus
        assert t is not None
        ci, cj = t.coords(i), t.coords(j)
        out: list[int] = []
        cur = i
        for d in range(len(t.dims)):
            hops, s = t.steps(ci[d], cj[d], d)
            for _ in range(hops):
                out.append(int(t.link_of[d, s, cur]))
                cur = int(t.next_node[d, s, cur])
        return tuple(out)

    def _torus_hops(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hops, direction) per pair and dimension, shape (pairs, dims); direction 0 = "+"."""
        t = self._torus
        assert t is not None
        coords = self._torus_coords()
        hops = np.empty((src.size, len(t.dims)), dtype=np.int32)
        dirs = np.empty((src.size, len(t.dims)), dtype=np.int8)
        for d, size in enumerate(t.dims):
            a, b = coords[src, d], coords[dst, d]
            if t.wrap[d]:
                fwd = (b - a) % size
                go_plus = fwd <= size - fwd
                hops[:, d] = np.where(go_plus, fwd, size - fwd)
            else:
                go_plus = b >= a
                hops[:, d] = np.abs(b - a)
            dirs[:, d] = np.where(go_plus, 0, 1)
        return hops, dirs

    def _torus_coords(self) -> np.ndarray:
        t = self._torus
        assert t is not None
        n = len(self.devices)
        return np.stack(np.unravel_index(np.arange(n), t.dims), axis=1).astype(np.int32)

    def _torus_table(self) -> tuple[np.ndarray, np.ndarray]:
        t = self._torus
        assert t is not None
        return self._torus_table_translated() if self._torus_affine() else self._torus_scatter()

    def _torus_affine(self) -> bool:
        """True when every dimension wraps and each link's id is (a per dimension and
        direction constant) + its source device, as the torus generator builds them."""
        t = self._torus
        assert t is not None
        if not all(t.wrap):
            return False
        n = len(self.devices)
        for d in range(len(t.dims)):
            for s in (0, 1):
                row = t.link_of[d, s]
                if t.dims[d] == 1:
                    if (row >= 0).any():
                        return False
                    continue
                if (row < 0).any() or not (row - np.arange(n) == row[0]).all():
                    return False
        return True

    def _torus_table_translated(self) -> tuple[np.ndarray, np.ndarray]:
        """All routes of a wrapped torus from the n routes out of device 0: the route from i
        to j is the route from 0 to (j - i), shifted by i (dimension-order routing depends only
        on the coordinate difference). One ragged gather per source: O(n^2 * mean hops)."""
        t = self._torus
        assert t is not None
        n = len(self.devices)
        dims = np.array(t.dims, dtype=np.int64)
        strides = np.array([int(np.prod(t.dims[d + 1 :])) for d in range(len(t.dims))])
        coords = self._torus_coords().astype(np.int64)
        template = [self._torus_route(0, j) for j in range(n)]
        t_len = np.array([len(r) for r in template], dtype=np.int64)
        t_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(t_len, out=t_ptr[1:])
        t_links = np.array([x for r in template for x in r], dtype=np.int64)
        total = int(t_ptr[-1])  # the same for every source
        t_node = self.link_src[t_links].astype(np.int64)
        t_base = (t_links - t_node).astype(np.int32)
        links = np.empty(n * total, dtype=np.int32)
        ptr = np.zeros(n * n + 1, dtype=np.int64)
        for i in range(n):
            q = ((coords - coords[i]) % dims) @ strides  # template index for each target j
            lengths = t_len[q]
            ends = np.cumsum(lengths)
            ptr[i * n + 1 : (i + 1) * n + 1] = ends + i * total
            idx = np.repeat(t_ptr[q] - (ends - lengths), lengths) + np.arange(total)
            shift = ((coords + coords[i]) % dims) @ strides  # device v -> v translated by i
            links[i * total : (i + 1) * total] = t_base[idx] + shift[t_node[idx]]
        return ptr, links

    def _torus_scatter(self) -> tuple[np.ndarray, np.ndarray]:
        """Dimension-order routes for all pairs at once, one hop per step for every pair
        still travelling (meshes and other non-translatable tori). O(n^2 * diameter)."""
        t = self._torus
        assert t is not None
        n = len(self.devices)
        src = np.repeat(np.arange(n), n)
        dst = np.tile(np.arange(n), n)
        hops, dirs = self._torus_hops(src, dst)
        ptr = np.zeros(n * n + 1, dtype=np.int64)
        np.cumsum(hops.sum(axis=1, dtype=np.int64), out=ptr[1:])
        links = np.empty(int(ptr[-1]), dtype=np.int32)
        cur = src.astype(np.int32)
        pos = ptr[:-1].copy()
        for d in range(len(t.dims)):
            h = hops[:, d]
            dir_d = dirs[:, d].copy()
            link_d = t.link_of[d].astype(np.int32)
            next_d = t.next_node[d].astype(np.int32)
            for k in range(int(h.max(initial=0))):
                sel = np.flatnonzero(h > k)
                c = cur[sel]
                s = dir_d[sel]
                links[pos[sel]] = link_d[s, c]
                cur[sel] = next_d[s, c]
                pos[sel] += 1
        return ptr, links

    def _torus_uniform(self) -> list[tuple[float, float]] | None:
        """Per dimension (bandwidth, latency) when every link of that dimension has the same
        numbers (true for the torus generator), else None."""
        t = self._torus
        assert t is not None
        out = []
        for d in range(len(t.dims)):
            ids = t.link_of[d][t.link_of[d] >= 0]
            if ids.size == 0:
                out.append((math.inf, 0.0))
                continue
            bw, lat = self.link_bandwidth[ids], self.link_latency[ids]
            if not ((bw == bw[0]).all() and (lat == lat[0]).all()):
                return None
            out.append((float(bw[0]), float(lat[0])))
        return out

    def _dfs_order(self) -> list[int]:
        if self._dfs is None:  # links never change after construction
            self._dfs = self._compute_dfs_order()
        return self._dfs

    def _compute_dfs_order(self) -> list[int]:
        n_nodes = len(self._node_index)
        nbrs: list[set[int]] = [set() for _ in range(n_nodes)]
        for u, v in zip(self.link_src.tolist(), self.link_dst.tolist()):
            nbrs[u].add(v)
            nbrs[v].add(u)
        n = len(self.devices)
        seen = [False] * n_nodes
        order: list[int] = []
        for start in range(n):
            if seen[start]:
                continue
            stack = [start]
            while stack:
                u = stack.pop()
                if seen[u]:
                    continue
                seen[u] = True
                if u < n:
                    order.append(u)
                stack.extend(sorted((v for v in nbrs[u] if not seen[v]), reverse=True))
        return order


def _snake(dims: tuple[int, ...]) -> list[int]:
    """Boustrophedon order of a C-ordered grid: consecutive cells differ by one in exactly
    one coordinate. O(n)."""
    if len(dims) == 1:
        return list(range(dims[0]))
    inner = _snake(dims[1:])
    block = int(np.prod(dims[1:]))
    out: list[int] = []
    for a in range(dims[0]):
        seq = inner if a % 2 == 0 else inner[::-1]
        out.extend(a * block + x for x in seq)
    return out
