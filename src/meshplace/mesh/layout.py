"""Meshes over a cluster's devices and Mesh-TensorFlow layout rules.

Source: Shazeer et al., "Mesh-TensorFlow: Deep Learning for Supercomputers" (NeurIPS 2018),
Sections 2-4: a *mesh* is an n-dimensional array of identical processors with named
dimensions; a *layout* maps tensor-dimension names to mesh-dimension names. A layout is
illegal when it maps two dimensions of one tensor to the same mesh dimension, or a tensor
dimension whose size is not divisible by the mesh dimension's size (:class:`LayoutError`).

Mapping a mesh onto the hardware
--------------------------------
The mesh is only a naming abstraction; how fast a collective along a mesh axis runs depends
on where its devices sit. On a torus (TPU pods) :func:`build_mesh` takes a box-shaped slice
of the torus (a corner ``S_0 x S_1 x ...``, every ``S_d <= T_d``) and lays the mesh over the
slice's devices by reshaping them in C order, trying every slice shape and every order of
the mesh axes and keeping the mapping whose axes all-reduce fastest. Where the mesh shape
matches the slice (``16x32`` on a ``32x32`` pod), each mesh axis *is* a torus dimension, so
a collective along it is a ring collective along torus rings.

Each mesh axis is then described by one or more :class:`CommStage` levels:

- when the devices of an axis form a sub-grid of the torus (all combinations of some
  coordinates in some torus dimensions), one stage per torus dimension it spans, and
  collectives run dimension by dimension (reduce-scatter along each dimension, then
  all-gather back: the 2D-torus all-reduce of Kumar et al. 2019);
- otherwise (and on switched clusters: NVSwitch, PCIe trees, multi-host) one ring stage
  through :meth:`Cluster.ring_order` of the axis's devices.

A stage's bandwidth and latency come from the cluster's links along the real routes: every
ring of the stage (one per group of the axis, all running at once) sends one chunk per
step to its successor; a link crossed by ``k`` ring edges gives each ``bandwidth / k``; the
stage's bandwidth is the minimum over the links used, its per-step latency the longest
route's summed latency. Rings that can run in both directions at once (a full torus ring)
get twice the bandwidth; a line (part of a ring, no wrap-around) uses the *folded* ring
order (0, 2, 4, ..., 5, 3, 1) so no step spans more than two hops. Collective times then
come from :func:`meshplace.cost.collectives.collective_time` (ring formulas) stage by stage.

Complexity: :func:`build_mesh` is O(candidates x devices x hops) (a few ms for 512 chips);
:meth:`Mesh.collective_time` is O(stages).

Example
-------
>>> from meshplace.hardware import load_cluster
>>> mesh = build_mesh(load_cluster("tpu-v3-pod"), (16, 32), chips=512)
>>> mesh.axis_names, [s.size for s in mesh.axis("y").stages]
(('x', 'y'), [32])
>>> mesh.axis("y").stages[0].bandwidth / 1e9  # a full torus ring, both directions
200.0
>>> check_tensor("w1", (("d_model", 1024), ("d_ff", 4096)), {"d_ff": "y"}, mesh)
(None, 'y')
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from meshplace.cost.collectives import collective_time
from meshplace.cost.compute import CostModel
from meshplace.errors import InputError
from meshplace.hardware.cluster import Cluster

AXIS_NAMES = ("x", "y", "z", "w")
# Message used to score candidate mappings of a mesh onto a torus.
_SCORE_BYTES = 64 * 2**20
# All-to-all loads are computed from real routes for rings up to this many devices.
_ALL_TO_ALL_EXACT = 64
KINDS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "collective_permute",
    "broadcast",
)


class LayoutError(InputError):
    """An illegal mesh or layout: uneven division, one mesh axis used twice by one tensor,
    an unknown mesh axis or dimension, or a mesh that does not match the chip count."""


@dataclass(frozen=True)
class CommStage:
    """One ring level of a mesh axis.

    Attributes:
        size: devices per ring.
        bandwidth: effective bytes/s for the ring formulas (both directions summed where the
            rings run bidirectionally), after sharing links with the stage's other rings.
        latency: seconds per ring step (the longest route between ring neighbours).
        link_bandwidth: bytes/s one way between ring neighbours (for point-to-point
            exchanges such as halos).
        a2a_factor: an all-to-all of ``n`` bytes per device moves ``n * a2a_factor / size``
            bytes over the stage's most loaded link (computed from the routes; ``size - 1``
            on a crossbar, about ``size**2 / 8`` on a bidirectional ring).
        desc: where the ring runs, for reports.
    """

    size: int
    bandwidth: float
    latency: float
    link_bandwidth: float
    a2a_factor: float
    desc: str = ""


@dataclass(frozen=True)
class MeshAxis:
    """A named mesh axis, its size and its communication stages."""

    name: str
    size: int
    stages: tuple[CommStage, ...]

    @property
    def desc(self) -> str:
        return " x ".join(s.desc for s in self.stages) or "one device"


def _stage_time(kind: str, nbytes: float, stages: Sequence[CommStage]) -> float:
    """Seconds for a collective run stage by stage (dimension-ordered; see module doc)."""
    if nbytes <= 0 or not stages:
        return 0.0
    total = 0.0
    shard = float(nbytes)
    for st in stages:
        if st.size <= 1:
            continue
        if kind in ("all_reduce", "reduce_scatter", "all_gather"):
            total += collective_time(
                kind, "ring", shard, st.size, bandwidth=st.bandwidth, latency=st.latency
            )
            shard /= st.size
        elif kind == "all_to_all":
            # collective_time's pairwise formula moves n(p-1)/p per device over its own link;
            # scale n so its bandwidth term equals the most loaded link's load.
            scaled = nbytes * st.a2a_factor / (st.size - 1)
            total += collective_time(
                "all_to_all",
                "ring",
                scaled,
                st.size,
                bandwidth=st.link_bandwidth,
                latency=st.latency,
            )
        elif kind == "collective_permute":
            # Exchange with both neighbours at once, one message each way: half the bytes
            # each direction (the broadcast ring formula with p=2 is one transfer).
            total = max(
                total,
                collective_time(
                    "broadcast",
                    "ring",
                    nbytes / 2,
                    2,
                    bandwidth=st.link_bandwidth,
                    latency=st.latency,
                ),
            )
        elif kind == "broadcast":
            # the whole message to every ring member along a binomial tree (DDP's buffer
            # broadcast before each forward): log2(size) rounds, one link each
            total += collective_time(
                "broadcast",
                "tree",
                nbytes,
                st.size,
                bandwidth=st.link_bandwidth,
                latency=st.latency,
            )
        else:
            raise LayoutError(f"unknown collective {kind!r}; allowed: {', '.join(KINDS)}")
    return total


@dataclass
class Mesh:
    """A mesh of ``shape`` (axis names ``axis_names``) laid over ``devices`` (cluster device
    indices, an array of ``shape``). Build with :func:`build_mesh`."""

    cluster: Cluster
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    devices: np.ndarray
    axes: tuple[MeshAxis, ...]
    mapping: str = ""
    _index: dict[str, int] = field(default_factory=dict, repr=False)
    # collective kind -> (latency s, bandwidth bytes/s) measured on this mesh's device kind
    # (:meth:`calibrated`); kinds not here are costed on the cluster's links
    measured: Mapping[str, tuple[float, float]] = field(default_factory=dict, repr=False)
    # the same, measured as the process group's own calls (``torch.distributed``'s, which
    # DDP, FSDP2 and the runtime's bucketed gradient reductions and ZeRO gathers issue)
    # rather than as DTensor's redistributions; kinds not here cost as ``measured`` does
    measured_c10d: Mapping[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {a: i for i, a in enumerate(self.axis_names)}

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))

    @property
    def label(self) -> str:
        return "x".join(str(s) for s in self.shape)

    def axis(self, name: str) -> MeshAxis:
        """The :class:`MeshAxis` called ``name``; :class:`LayoutError` if there is none."""
        try:
            return self.axes[self._index[name]]
        except KeyError:
            raise LayoutError(
                f"mesh {self.label} has no axis {name!r}; its axes are: "
                f"{', '.join(self.axis_names)}"
            ) from None

    def axis_size(self, name: str) -> int:
        return self.axis(name).size

    def collective_time(
        self, kind: str, nbytes: float, axes: Iterable[str], *, c10d: bool = False
    ) -> float:
        """Seconds for collective ``kind`` of ``nbytes`` per device over the mesh ``axes``
        (all groups at once); stages of several axes run one after another. ``c10d``: the
        process group's own call (DDP's, FSDP2's, a bucketed reduction's), at the rate
        measured for such calls where there is one (:meth:`calibrated`), else as DTensor
        runs it.

        >>> from meshplace.hardware import load_cluster
        >>> m = build_mesh(load_cluster("tpu-v3-8"), (4,))
        >>> m.collective_time("all_reduce", 0, ["x"])
        0.0
        """
        axes = list(axes)
        fit = (self.measured_c10d.get(kind) if c10d else None) or self.measured.get(kind)
        if fit is not None:
            p = math.prod(self.axis(a).size for a in axes)
            if nbytes <= 0 or p <= 1:
                return 0.0
            latency, bandwidth = fit
            return collective_time(kind, "ring", nbytes, p, bandwidth=bandwidth, latency=latency)
        stages: list[CommStage] = []
        for a in axes:
            stages.extend(self.axis(a).stages)
        return _stage_time(kind, nbytes, stages)

    @property
    def device_kind(self) -> str:
        """The kind of the mesh's devices (a mesh's devices are identical)."""
        return self.cluster.devices[int(self.devices.reshape(-1)[0])].kind

    def calibrated(self, cost_model: CostModel | None) -> Mesh:
        """This mesh with the collectives ``cost_model`` measured on its device kind
        (``CostModel.collectives``, and ``CostModel.c10d_collectives`` for the process
        group's own calls): :meth:`collective_time` then costs those kinds with the ring
        formula at the measured latency and bandwidth over the axes' devices; the mesh
        itself when there are none.

        >>> from meshplace.cost.compute import CostModel
        >>> from meshplace.hardware import load_cluster
        >>> m = build_mesh(load_cluster("dgx-h100"), (2,), chips=2)
        >>> cm = CostModel(collectives={"h100": {"all_reduce": (1e-4, 1e9)}})
        >>> round(m.calibrated(cm).collective_time("all_reduce", 1e6, ["x"]) * 1e3, 3)
        1.2
        """
        if cost_model is None:
            return self
        fits = cost_model.collectives.get(self.device_kind)
        c10d = cost_model.c10d_collectives.get(self.device_kind)
        if not fits and not c10d:
            return self
        return replace(self, measured=dict(fits or {}), measured_c10d=dict(c10d or {}))

    def describe(self) -> dict[str, object]:
        """Plain-data description (for JSON)."""
        return {
            "shape": list(self.shape),
            "axes": list(self.axis_names),
            "mapping": self.mapping,
            "axis_links": {
                ax.name: [
                    {
                        "size": s.size,
                        "bandwidth": s.bandwidth,
                        "latency": s.latency,
                        "ring": s.desc,
                    }
                    for s in ax.stages
                ]
                for ax in self.axes
            },
        }


# ---------------------------------------------------------------------- legality
def check_tensor(
    tensor: str,
    dims: Sequence[tuple[str, int]],
    rules: Mapping[str, str | None],
    mesh: Mesh | Mapping[str, int],
) -> tuple[str | None, ...]:
    """The mesh axis of each dimension of a tensor, or :class:`LayoutError` naming the tensor
    and dimension when the layout is illegal (Mesh-TensorFlow Sec. 4: one mesh axis used by
    two dimensions of one tensor, or a size not divisible by the axis size).

    ``dims`` is ``(name, size)`` per dimension; ``mesh`` a :class:`Mesh` or ``{axis: size}``.
    O(len(dims)).

    >>> try:
    ...     check_tensor("x", (("batch", 6), ("d", 4)), {"batch": "x"}, {"x": 4})
    ... except LayoutError as exc:
    ...     print(exc)
    tensor 'x': dimension 'batch' of size 6 does not divide evenly over mesh axis 'x' of size 4
    """
    sizes = _axis_sizes(mesh)
    out: list[str | None] = []
    used: dict[str, str] = {}
    for name, size in dims:
        axis = rules.get(name)
        if axis is None:
            out.append(None)
            continue
        if axis not in sizes:
            raise LayoutError(
                f"layout rule {name}={axis}: the mesh has no axis {axis!r}; its axes are: "
                f"{', '.join(sizes) or 'none'}"
            )
        if axis in used:
            raise LayoutError(
                f"tensor {tensor!r}: dimensions {used[axis]!r} and {name!r} are both split over "
                f"mesh axis {axis!r}; a mesh axis can split only one dimension of a tensor"
            )
        if size % sizes[axis]:
            raise LayoutError(
                f"tensor {tensor!r}: dimension {name!r} of size {size} does not divide evenly "
                f"over mesh axis {axis!r} of size {sizes[axis]}"
            )
        used[axis] = name
        out.append(axis)
    return tuple(out)


def _axis_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    if isinstance(mesh, Mesh):
        return dict(zip(mesh.axis_names, mesh.shape, strict=True))
    return dict(mesh)


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """``"16x32"`` -> ``(16, 32)``; :class:`LayoutError` on anything else.

    >>> parse_mesh_shape("16x32")
    (16, 32)
    """
    parts = text.lower().replace("×", "x").split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise LayoutError(
            f"mesh shape {text!r} is not of the form 16x32 (positive integers joined by 'x')"
        ) from None
    if not shape or any(s < 1 for s in shape) or len(shape) > len(AXIS_NAMES):
        raise LayoutError(
            f"mesh shape {text!r} must have 1 to {len(AXIS_NAMES)} positive sizes, e.g. 16x32"
        )
    return shape


def mesh_and_chips(mesh_text: str | None, chips: int | None) -> tuple[int, ...] | None:
    """The ``--mesh`` shape (or ``None``), checked against ``--chips``: their product must
    match (:class:`LayoutError` otherwise).

    >>> mesh_and_chips("2x4", 8), mesh_and_chips(None, 8)
    ((2, 4), None)
    """
    shape = parse_mesh_shape(mesh_text) if mesh_text else None
    if shape is not None and chips is not None and chips != math.prod(shape):
        raise LayoutError(
            f"--mesh {mesh_text} has {math.prod(shape)} devices but --chips is {chips}; the "
            "product of the mesh shape must equal the chip count"
        )
    return shape


# ---------------------------------------------------------------------- building meshes
def accelerators(cluster: Cluster) -> list[int]:
    """Indices of the devices a mesh may use: the cluster's accelerators
    (:meth:`Cluster.accelerators`). A cluster of host CPUs only is a :class:`LayoutError`:
    costing Xeons as if they were mesh chips would give a plan nobody can run as one —
    except the calibrated cluster of local worker processes that ``meshplace run
    --cluster-out`` writes (``meta.worker_device``): each of its devices is one process,
    which torchrun runs as one rank (gloo), so a mesh over them is what runs.

    >>> from meshplace.hardware import Cluster, Device, Link, device_spec
    >>> cpus = [Device(f"cpu{i}", "xeon", device_spec("xeon")) for i in range(2)]
    >>> lo = [Link("lo", "cpu0", "cpu1", 1e9, 1e-4), Link("lo", "cpu1", "cpu0", 1e9, 1e-4)]
    >>> accelerators(Cluster("workers", cpus, lo, meta={"worker_device": "cpu"}))
    [0, 1]
    """
    out = cluster.accelerators()
    if not out and cluster.meta.get("worker_device") is not None:
        return list(range(len(cluster.devices)))
    if not out:
        kinds = sorted({d.kind for d in cluster.devices})
        raise LayoutError(
            f"cluster {cluster.name!r} has no accelerators (only host CPUs: "
            f"{', '.join(kinds)}); a mesh is laid over GPUs or TPUs, choose a cluster with some"
        )
    return out


def build_mesh(
    cluster: Cluster,
    shape: Sequence[int],
    axis_names: Sequence[str] | None = None,
    *,
    chips: int | None = None,
) -> Mesh:
    """A mesh of ``shape`` over ``chips`` devices of ``cluster`` (default: all of its
    accelerators), mapped onto the topology as the module docstring explains.

    Raises :class:`LayoutError` when the shape's product differs from ``chips`` or the
    cluster has fewer devices. O(candidate mappings x devices x route length).
    """
    shape_t = tuple(int(s) for s in shape)
    names = tuple(axis_names) if axis_names is not None else AXIS_NAMES[: len(shape_t)]
    if len(names) != len(shape_t) or len(set(names)) != len(names):
        raise LayoutError(f"mesh shape {shape_t} needs {len(shape_t)} distinct axis names")
    accel = accelerators(cluster)
    n = int(math.prod(shape_t))
    if chips is None:
        chips = n
    if n != chips:
        raise LayoutError(
            f"mesh {'x'.join(map(str, shape_t))} has {n} devices but {chips} chips were "
            "asked for; the product of the mesh shape must equal the chip count"
        )
    if chips > len(accel):
        raise LayoutError(
            f"cluster {cluster.name!r} has {len(accel)} accelerators; cannot build a mesh of "
            f"{chips} chips"
        )
    key = (id(cluster), shape_t, names)
    cache = _MESH_CACHE.get(id(cluster))
    if cache is not None and cache[0] is cluster and key in cache[1]:
        return cache[1][key]
    cands = list(_candidates(cluster, accel, shape_t))
    if len(cands) > 4:  # analyse only the structurally best few (contiguous sub-grids)
        ranked = sorted(range(len(cands)), key=lambda k: _structure_penalty(cluster, cands[k][0]))
        cands = [cands[k] for k in sorted(ranked[:4])]
    routes = _RouteCache(cluster)
    best: tuple[float, Mesh] | None = None
    for devices, how in cands:
        axes = tuple(_analyse_axis(routes, devices, i, names[i]) for i in range(len(shape_t)))
        score = sum(_stage_time("all_reduce", _SCORE_BYTES, ax.stages) for ax in axes)
        if best is None or score < best[0] - 1e-12:
            best = (score, Mesh(cluster, shape_t, names, devices, axes, how))
    assert best is not None
    mesh = best[1]
    if cache is None or cache[0] is not cluster:
        cache = (cluster, {})
        _MESH_CACHE[id(cluster)] = cache
    if len(_MESH_CACHE) > 8:  # keep the cache to a few clusters
        _MESH_CACHE.clear()
        _MESH_CACHE[id(cluster)] = cache
    cache[1][key] = mesh
    return mesh


_MESH_CACHE: dict[int, tuple[Cluster, dict[tuple, Mesh]]] = {}


def mesh_over(
    cluster: Cluster,
    devices: np.ndarray,
    axis_names: Sequence[str] | None = None,
    mapping: str = "given",
) -> Mesh:
    """A mesh whose device array is ``devices`` (cluster device indices, shaped as the
    mesh), analysed as :func:`build_mesh` analyses its candidates but without choosing the
    mapping: for a caller that needs an axis in a given place (tensor parallelism inside a
    host, data parallelism across hosts). O(devices x route length).

    >>> from meshplace.hardware import load_cluster
    >>> c = load_cluster("h2-8xh100")
    >>> m = mesh_over(c, np.array(accelerators(c)).reshape(2, 8))  # 8 per host, inner
    >>> m.collective_time("all_reduce", 1e9, ["x"]) > m.collective_time("all_reduce", 1e9, ["y"])
    True
    """
    devices = np.asarray(devices, dtype=np.int64)
    shape = tuple(int(s) for s in devices.shape)
    names = tuple(axis_names) if axis_names is not None else AXIS_NAMES[: len(shape)]
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise LayoutError(f"mesh shape {shape} needs {len(shape)} distinct axis names")
    routes = _RouteCache(cluster)
    axes = tuple(_analyse_axis(routes, devices, i, names[i]) for i in range(len(shape)))
    return Mesh(cluster, shape, names, devices, axes, mapping)


def _candidates(
    cluster: Cluster, accel: list[int], shape: tuple[int, ...]
) -> list[tuple[np.ndarray, str]]:
    """(device array of ``shape``, description) for each candidate mapping: every slice shape
    x mesh-axis order x C or Fortran order of the slice's coordinates."""
    n = int(math.prod(shape))
    perms = list(itertools.permutations(range(len(shape))))
    tdims = cluster.dims
    out: list[tuple[np.ndarray, str]] = []
    seen: set[bytes] = set()

    def add(flat: np.ndarray, how: str) -> None:
        for perm in perms:
            arr = np.transpose(flat.reshape([shape[p] for p in perm]), np.argsort(perm))
            arr = np.ascontiguousarray(arr)
            key = arr.tobytes()
            if key not in seen:
                seen.add(key)
                out.append((arr, how))

    if tdims is not None and len(accel) == len(cluster.devices):
        for s in _box_shapes(n, tdims):
            how = f"torus slice {'x'.join(map(str, s))} of {'x'.join(map(str, tdims))}"
            for order in ("C", "F"):
                grid = np.indices(s).reshape(len(s), -1)
                if order == "F":
                    grid = np.indices(s[::-1]).reshape(len(s), -1)[::-1]
                add(np.ravel_multi_index(tuple(grid), tdims), how)
        return out
    add(np.asarray(accel[:n]), f"first {n} accelerators of {cluster.name}")
    return out


def _box_shapes(n: int, tdims: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every ``S`` with ``prod(S) == n`` and ``S_d <= T_d``; full dimensions first."""
    out: list[tuple[int, ...]] = []

    def rec(d: int, rest: int, acc: tuple[int, ...]) -> None:
        if d == len(tdims):
            if rest == 1:
                out.append(acc)
            return
        for k in range(1, min(rest, tdims[d]) + 1):
            if rest % k == 0:
                rec(d + 1, rest // k, (*acc, k))

    rec(0, n, ())
    if not out:
        raise LayoutError(f"{n} chips cannot be cut as a box out of a torus of {tdims}")
    out.sort(key=lambda s: (-sum(a == b for a, b in zip(s, tdims)), s))
    return out[:6]


def _torus_coords(cluster: Cluster, idx: np.ndarray) -> np.ndarray:
    dims = cluster.dims
    assert dims is not None
    return np.stack(np.unravel_index(idx, dims), axis=-1)


def _structure_penalty(cluster: Cluster, devices: np.ndarray) -> tuple[int, int]:
    """(axes that are not torus sub-grids, sum of coordinate strides - 1) for one mapping."""
    if cluster.dims is None:
        return (0, 0)
    bad = 0
    stride = 0
    for axis, size in enumerate(devices.shape):
        if size == 1:
            continue
        g = np.moveaxis(devices, axis, -1).reshape(-1, size)[0]
        c = _torus_coords(cluster, g)
        counts = [len(np.unique(c[:, d])) for d in range(c.shape[1])]
        if math.prod(counts) != size:
            bad += 1
            continue
        for d in range(c.shape[1]):
            u = np.unique(c[:, d])
            if len(u) > 1:
                stride += int(np.diff(u).max()) - 1
    return (bad, stride)


class _RouteCache:
    """Routes and their summed latencies between devices, memoised for one mesh build."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._lat = cluster.link_latency.tolist()
        self._memo: dict[tuple[int, int], tuple[tuple[int, ...], float]] = {}

    def get(self, a: int, b: int) -> tuple[tuple[int, ...], float]:
        hit = self._memo.get((a, b))
        if hit is None:
            r = self.cluster.route(a, b)
            hit = (r, sum(self._lat[k] for k in r))
            self._memo[(a, b)] = hit
        return hit


def _analyse_axis(routes: _RouteCache, devices: np.ndarray, axis: int, name: str) -> MeshAxis:
    cluster = routes.cluster
    size = devices.shape[axis]
    if size == 1:
        return MeshAxis(name, 1, ())
    groups = np.moveaxis(devices, axis, -1).reshape(-1, size)
    if cluster.dims is not None:
        coords = _torus_coords(cluster, groups)
        sub = _sub_grid(coords)
        if sub is not None:
            stages = [_torus_stage(routes, groups, coords, d) for d in sub]
            # Reduce-scatter over the fastest stage first: the slower ones then carry less.
            stages.sort(key=lambda st: -st.bandwidth)
            return MeshAxis(name, size, tuple(stages))
    rings = [cluster.ring_order([int(i) for i in g]) for g in groups]
    return MeshAxis(name, size, (_ring_stage(routes, rings, f"ring of {size}"),))


def _sub_grid(coords: np.ndarray) -> list[int] | None:
    """Torus dimensions spanned when every group's coordinates form a full sub-grid."""
    ndim = coords.shape[2]
    varying: list[int] | None = None
    for g in coords:
        counts = [len(np.unique(g[:, d])) for d in range(ndim)]
        if math.prod(counts) != g.shape[0]:
            return None
        v = [d for d in range(ndim) if counts[d] > 1]
        if varying is None:
            varying = v
        elif v != varying:
            return None
    return varying


def _torus_stage(routes: _RouteCache, groups: np.ndarray, coords: np.ndarray, d: int) -> CommStage:
    """Rings along torus dimension ``d`` inside every group of the axis.

    Dimension-order routes between two chips that differ only in coordinate ``d`` stay on
    their torus line, so rings on different lines never share a link: link loads are
    computed for one line of each distinct pattern of ring coordinates (torus links are
    uniform per dimension), which keeps 4,096-chip meshes fast."""
    tdims = routes.cluster.dims
    assert tdims is not None
    others = [k for k in range(coords.shape[2]) if k != d]
    # line -> its rings, each as [(coordinate along d, device), ...]
    per_line: dict[tuple[int, ...], list[list[tuple[int, int]]]] = {}
    for g, c in zip(groups.tolist(), coords.tolist()):
        rings: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for dev, cc in zip(g, c):
            rings.setdefault(tuple(cc[k] for k in others), []).append((cc[d], dev))
        for line, members in rings.items():
            members.sort()
            per_line.setdefault(line, []).append(members)
    natural: list[list[int]] = []
    seen: set[tuple] = set()
    for rings_on_line in per_line.values():
        pattern = tuple(sorted(tuple(cd for cd, _ in r) for r in rings_on_line))
        if pattern in seen:
            continue
        seen.add(pattern)
        natural.extend([dev for _, dev in r] for r in rings_on_line)
    p = len(natural[0])
    full = p == tdims[d]
    label = f"torus dim {d} ({p} of {tdims[d]}, {'ring' if full else 'line'})"
    best = _ring_stage(routes, natural, label)
    if not full and p > 2:
        folded = [r[0::2] + r[1::2][::-1] for r in natural]
        alt = _ring_stage(routes, folded, label)
        if _stage_time("all_reduce", _SCORE_BYTES, [alt]) < _stage_time(
            "all_reduce", _SCORE_BYTES, [best]
        ):
            best = alt
    return best


def _ring_stage(routes: _RouteCache, rings: list[list[int]], label: str) -> CommStage:
    """Bandwidth and latency of all ``rings`` stepping at once (see module docstring)."""
    cluster = routes.cluster
    p = len(rings[0])
    nlinks = len(cluster.links)
    fwd = np.zeros(nlinks)
    rev = np.zeros(nlinks)
    latency = 0.0
    fl: list[int] = []
    rl: list[int] = []
    for ring in rings:
        for k in range(p):
            a, b = ring[k], ring[(k + 1) % p]
            r1, l1 = routes.get(a, b)
            r2, l2 = routes.get(b, a)
            fl.extend(r1)
            rl.extend(r2)
            latency = max(latency, l1, l2)
    np.add.at(fwd, np.asarray(fl, dtype=np.int64), 1)
    np.add.at(rev, np.asarray(rl, dtype=np.int64), 1)
    bw = cluster.link_bandwidth
    used = fwd > 0
    uni = float(np.min(bw[used] / fwd[used])) if used.any() else math.inf
    both = fwd + rev
    used2 = both > 0
    bidir = 2 * float(np.min(bw[used2] / both[used2])) if used2.any() else math.inf
    a2a = _all_to_all_factor(routes, rings[0], p)
    return CommStage(p, max(uni, bidir), latency, uni, a2a, label)


def _all_to_all_factor(routes: _RouteCache, ring: list[int], p: int) -> float:
    """Most loaded link's load when each of ``ring``'s devices sends one unit to each other
    (exact from routes up to 64 devices; a bidirectional-ring estimate beyond)."""
    if p > _ALL_TO_ALL_EXACT:
        return max(p - 1.0, p * p / 8.0)
    load: dict[int, int] = {}
    for a in ring:
        for b in ring:
            if a != b:
                for lk in routes.get(a, b)[0]:
                    load[lk] = load.get(lk, 0) + 1
    if not load:
        return p - 1.0
    bw = routes.cluster.link_bandwidth
    # Normalise to the slowest link the ring uses (the stage's link_bandwidth is per link).
    worst = max(load[lk] / bw[lk] for lk in load)
    return float(worst * min(bw[lk] for lk in load))
