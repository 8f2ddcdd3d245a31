"""Cluster YAML files (format ``meshplace.cluster``, version 1; documented in
``docs/clusters.md``): validation with pydantic, building, and writing back.

A file either lists devices, switches and links explicitly, or names a generator in a
``topology:`` block (and may add devices, switches and links to what it generates).
Every problem becomes one :class:`ClusterError` sentence naming the file and the field.

>>> text = '''
... name: two-gpus
... devices:
...   - {count: 2, kind: v100}
... switches: [sw]
... links:
...   - {src: gpu0, dst: sw, bandwidth: 12 GB/s, latency: 1 us}
...   - {src: gpu1, dst: sw, bandwidth: 12 GB/s, latency: 1 us}
... '''
>>> c = cluster_from_yaml(text)
>>> c.device_names, c.path_bandwidth(0, 1)
(['gpu0', 'gpu1'], 12000000000.0)
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from meshplace.hardware.catalogue import (
    DTYPES,
    KIND_ALIASES,
    DeviceSpec,
    catalogue,
    normalize_dtype,
)
from meshplace.hardware.cluster import Cluster, Device, Link
from meshplace.hardware.errors import ClusterError, UnknownDeviceError, allowed
from meshplace.hardware.topology import (
    GENERATORS,
    ICI_HOP_LATENCY,
    MAX_DEVICES,
    NIC_LATENCY,
    NVLINK_HOP_LATENCY,
    PCIE3_X16_MEASURED,
    PCIE4_X16,
    PCIE_HOP_LATENCY,
    SOCKET_LINK,
    TPU_V3_ICI,
    build_topology,
)
from meshplace.hardware.units import parse_quantity
from meshplace.util import read_text_file, short_repr, write_text_atomic

FORMAT = "meshplace.cluster"
VERSION = 1


def _quantity(kind: Any) -> BeforeValidator:
    return BeforeValidator(lambda v: parse_quantity(v, kind) if v is not None else v)


def _integer(value: Any) -> Any:
    """Refuse ``true``/``false`` and strings where an integer belongs (pydantic's lax mode
    reads ``true`` as 1 and ``'2'`` as 2)."""
    if isinstance(value, bool | str):
        raise ValueError(f"expected an integer, not {short_repr(value)}")
    return value


_Int = BeforeValidator(_integer)
Flag = Annotated[bool, Field(strict=True)]


Bandwidth = Annotated[float, _quantity("bandwidth"), Field(gt=0)]
Seconds = Annotated[float, _quantity("time"), Field(ge=0)]
Bytes = Annotated[float, _quantity("bytes"), Field(gt=0)]
Flops = Annotated[float, _quantity("flops"), Field(gt=0)]
Name = Annotated[str, Field(min_length=1)]
Count = Annotated[int, _Int, Field(ge=0, le=1 << 16)]
Positive = Annotated[int, _Int, Field(ge=1, le=1 << 16)]
Category = Literal["cpu", "gpu", "tpu", "accelerator"]
Transfers = Literal["overlap", "occupy"]
_SPEC_FIELDS = (
    "description",
    "peak_flops",
    "memory_bandwidth",
    "memory_bytes",
    "launch_overhead_s",
    "source",
    "category",
    "transfers",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _KindModel(_Strict):
    base: str | None = None
    description: str | None = None
    peak_flops: dict[str, Flops] | None = None
    memory_bandwidth: Bandwidth | None = None
    memory_bytes: Bytes | None = None
    launch_overhead_s: Seconds | None = None
    source: str | None = None
    category: Category | None = None
    transfers: Transfers | None = None


class _DeviceModel(_Strict):
    name: Name | None = None
    kind: Name
    host: Name = "host0"
    count: Positive | None = None
    description: str | None = None
    peak_flops: dict[str, Flops] | None = None
    memory_bandwidth: Bandwidth | None = None
    memory_bytes: Bytes | None = None
    launch_overhead_s: Seconds | None = None
    source: str | None = None
    category: Category | None = None
    transfers: Transfers | None = None


class _LinkModel(_Strict):
    src: Name
    dst: Name
    bandwidth: Bandwidth
    latency: Seconds = 0.0
    name: Name | None = None
    kind: str = ""
    bidirectional: Flag = True
    latency_overlaps: Flag = False


class _PcieTree(_Strict):
    generator: Literal["pcie_tree"]
    num_gpus: Count = 4
    gpus_per_switch: Positive = 2
    gpu_kind: Name = "k80"
    cpu_kind: Name = "xeon"
    cpus: Count = 1
    gpu_link_bandwidth: Bandwidth = PCIE3_X16_MEASURED
    uplink_bandwidth: Bandwidth = PCIE3_X16_MEASURED
    latency: Seconds = PCIE_HOP_LATENCY
    link_kind: str = "pcie3"
    host: Name = "host0"


class _NvlinkMesh(_Strict):
    generator: Literal["nvlink_mesh"]
    gpus: Positive = 8
    gpu_kind: Name = "a100-80gb"
    nvlink_bandwidth: Bandwidth | None = None
    nvlink_latency: Seconds = NVLINK_HOP_LATENCY
    nvswitch: Flag = True
    cpus: Count = 2
    cpu_kind: Name = "xeon"
    pcie_bandwidth: Bandwidth = PCIE4_X16
    pcie_latency: Seconds = PCIE_HOP_LATENCY
    gpus_per_pcie_switch: Positive = 2
    socket_bandwidth: Bandwidth = SOCKET_LINK
    pcie_kind: str = "pcie"
    host: Name = "host0"


class _Torus(_Strict):
    generator: Literal["torus"]
    dims: Annotated[list[Positive], Field(min_length=1, max_length=4)]
    device_kind: Name = "tpu-v3"
    link_bandwidth: Bandwidth = TPU_V3_ICI
    latency: Seconds = ICI_HOP_LATENCY
    wrap: Flag | list[Flag] = True
    chips_per_host: list[Positive] | None = None
    name_prefix: Name = "tpu"
    link_kind: str = "ici"


class _MultiHost(_Strict):
    generator: Literal["multi_host"]
    hosts: Positive
    per_host: Annotated[_PcieTree | _NvlinkMesh, Field(discriminator="generator")]
    nic_bandwidth: Bandwidth
    nic_latency: Seconds = NIC_LATENCY
    nic_attach: list[Name] | None = None
    nic_per_device: Flag = False


_TOPOLOGY_MODELS: dict[str, type[BaseModel]] = {
    "pcie_tree": _PcieTree,
    "nvlink_mesh": _NvlinkMesh,
    "torus": _Torus,
    "multi_host": _MultiHost,
}
assert set(_TOPOLOGY_MODELS) == set(GENERATORS)


class _ClusterModel(_Strict):
    format: Literal["meshplace.cluster"] = "meshplace.cluster"
    version: Annotated[int, _Int] = VERSION
    name: Name | None = None
    kind: str | None = None
    source: str = ""
    meta: dict[str, Any] = Field(default_factory=dict)
    transfers: Transfers | None = None
    device_kinds: dict[str, _KindModel] = Field(default_factory=dict)
    topology: (
        Annotated[_PcieTree | _NvlinkMesh | _Torus | _MultiHost, Field(discriminator="generator")]
        | None
    ) = None
    devices: list[_DeviceModel] = Field(default_factory=list)
    switches: list[Name] = Field(default_factory=list)
    links: list[_LinkModel] = Field(default_factory=list)


# ---------------------------------------------------------------------- reading
def load_cluster_file(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file. A missing file, a folder, a binary or
    non-UTF-8 file are each one :class:`ClusterError` sentence naming the file."""
    p = Path(path)
    text = read_text_file(p, "cluster", ClusterError)
    return cluster_from_yaml(text, str(p), default_name=p.stem)


def cluster_from_yaml(text: str, source: str = "cluster.yaml", default_name: str = "") -> Cluster:
    """Parse YAML ``text`` (errors name ``source``; :func:`parse_yaml`) and build the
    cluster."""
    return cluster_from_dict(parse_yaml(text, source), source, default_name=default_name)


# YAML read defensively. PyYAML's loaders share one node per anchor, so an alias bomb ("billion
# laughs": nine aliases of nine aliases of ...) loads instantly, but anything that then walks
# the data (validation, printing, JSON) expands it; libyaml's composer recurses in C and
# crashes the process on nesting around 100,000 deep; and a mapping keeps the last of two
# equal keys silently. parse_yaml checks the composed node graph for all three first.
_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built with it
MAX_YAML_DEPTH = 64
# Aliases may repeat blocks (``<<: *defaults``), not multiply the file: the data may hold at
# most this many times the values written (and at least _MIN_EXPANSION values).
MAX_YAML_EXPANSION = 10
_MIN_EXPANSION = 100_000
# Nesting the C composer certainly survives (it crashed at 100,000 levels, not at 10,000).
_COMPOSE_SAFE_DEPTH = 1000


def parse_yaml(text: str, source: str = "cluster.yaml") -> Any:
    """Parse YAML ``text`` safely (libyaml's ``CSafeLoader`` when present, else PyYAML's
    ``SafeLoader``) and return plain data. Each of these is one :class:`ClusterError`
    sentence naming ``source``: text that is not YAML (with its line and column); nesting
    deeper than :data:`MAX_YAML_DEPTH`; aliases that expand the data to more than
    :data:`MAX_YAML_EXPANSION` times the values written (a "billion laughs" bomb) or that
    refer to a collection containing themselves; one key twice in a mapping; and an integer
    with more digits than Python converts (4,300).

    >>> parse_yaml("a: &x [1, 2]\\nb: *x\\n")
    {'a': [1, 2], 'b': [1, 2]}
    >>> parse_yaml("a: 1\\na: 2\\n", "c.yaml")
    Traceback (most recent call last):
    ...
    meshplace.hardware.errors.ClusterError: c.yaml: key 'a' appears twice in one mapping ...
    """
    bound = _nesting_bound(text)
    if bound > _COMPOSE_SAFE_DEPTH:
        _check_event_depth(text, source)  # exact, iterative: the composer would recurse
    loader = _Loader(text, source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if "*" in text or bound > MAX_YAML_DEPTH:  # aliases, or possibly deep: walk it all
            _check_nodes(node, source)
            loader.check_keys = False  # done on the raw nodes, before merges flatten them
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "malformed YAML"
        if "nesting depth" in str(problem):  # libyaml's own limit (PyYAML >= 6.0.4)
            raise ClusterError(_too_deep(source)) from None
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ClusterError(f"{source}: not valid YAML ({problem}{where})") from None
    except RecursionError:
        raise ClusterError(_too_deep(source)) from None
    except ValueError as exc:  # int() of a scalar beyond sys.get_int_max_str_digits()
        if "digits" not in str(exc):
            raise
        raise ClusterError(
            f"{source}: holds an integer with too many digits to read; no cluster field needs one"
        ) from None
    finally:
        loader.dispose()


class _Loader(_BaseLoader):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader (libyaml's when built with it) that refuses a key twice in one
    mapping and memoises the tag of each plain scalar: a large cluster file repeats the same
    keys and values thousands of times, and resolving a tag runs regular expressions."""

    def __init__(self, stream: str, source: str) -> None:
        super().__init__(stream)
        self.source = source
        self.check_keys = True
        self._tags: dict[tuple[str, Any], str] = {}

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        if kind is not yaml.ScalarNode:
            return super().resolve(kind, value, implicit)
        key = (value, implicit)
        tag = self._tags.get(key)
        if tag is None:
            tag = super().resolve(kind, value, implicit)
            if len(self._tags) < 1 << 16:
                self._tags[key] = tag
        return tag

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        # before SafeConstructor flattens merge keys (an alias-free file has no shared
        # nodes, so every mapping is still as written here)
        if self.check_keys and isinstance(node, yaml.MappingNode):
            _check_keys(node, self.source)
        return super().construct_mapping(node, deep)


def _too_deep(source: str) -> str:
    return (
        f"{source}: YAML nested more than {MAX_YAML_DEPTH} levels deep; a cluster file needs "
        "only a few"
    )


def _nesting_bound(text: str) -> int:
    """An upper bound on the nesting depth of YAML ``text``, cheap to compute (two regular
    expression scans, no parsing): the deepest unclosed flow bracket (brackets in quoted
    strings only raise it) plus twice the longest run of indentation and compact
    indicators (``- - -``, ``? ``) that starts a line, plus two: a block collection nests
    only by indenting further or by a compact indicator, except a sequence written at its
    parent key's indentation, which at most doubles the count. Flow collections hold no
    block ones, so the two add up. O(len(text))."""
    depth = best = 0
    for m in re.finditer(r"[\[\]{}]", text):
        depth = depth + 1 if m.group() in "[{" else max(0, depth - 1)
        best = max(best, depth)
    indent = max((len(m.group()) for m in re.finditer(r"(?m)^[ \t?-]*", text)), default=0)
    return best + 2 * indent + 2


def _check_event_depth(text: str, source: str) -> None:
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_BaseLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise ClusterError(_too_deep(source))
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        return  # the loader reports it with its line and column


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Walk the composed node graph without recursion: cycles through aliases, duplicate
    keys, and the number of values and the nesting depth the data would expand to (each
    collection visited once, sizes and heights memoised, so a bomb costs its written size)."""
    done: dict[int, tuple[int, int]] = {}  # id(collection) -> (values, height) expanded
    on_path: set[int] = set()
    written = 0
    # (node, depth, finished): a collection is opened, then finished after its children
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            values, height = 1, 1
            for child in _children(node):
                v, h = done.get(id(child), (1, 1))
                values += v
                height = max(height, h + 1)
            if height > MAX_YAML_DEPTH:
                raise ClusterError(_too_deep(source))
            done[key] = (values, height)
            continue
        if key in done or isinstance(node, yaml.ScalarNode):
            continue
        if depth > MAX_YAML_DEPTH:
            raise ClusterError(_too_deep(source))
        on_path.add(key)
        stack.append((node, depth, True))
        written += 1
        if isinstance(node, yaml.MappingNode):
            _check_keys(node, source)
        for child in _children(node):
            if isinstance(child, yaml.ScalarNode):
                written += 1
            elif id(child) in on_path:
                raise ClusterError(
                    f"{source}: a YAML alias at line {child.start_mark.line + 1} refers to a "
                    "collection that contains it; the data would be infinite"
                )
            else:
                stack.append((child, depth + 1, False))
    expanded = done.get(id(root), (1, 1))[0]
    limit = max(_MIN_EXPANSION, MAX_YAML_EXPANSION * written)
    if expanded > limit:
        raise ClusterError(
            f"{source}: YAML aliases expand {written:,} written values to {_count(expanded)}, "
            f"more than {MAX_YAML_EXPANSION} times as many; an alias may repeat a block, not "
            "multiply the file"
        )


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**15 else f"about 10^{len(str(n)) - 1}"


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_keys(node: yaml.MappingNode, source: str) -> None:
    seen: set[tuple[str, str]] = set()
    for k, _ in node.value:
        if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
            continue
        ident = (k.tag, k.value)
        if ident in seen:
            raise ClusterError(
                f"{source}: key {short_repr(k.value)} appears twice in one mapping (line "
                f"{k.start_mark.line + 1}); each key may appear once"
            )
        seen.add(ident)


def cluster_from_dict(data: Any, source: str = "cluster", default_name: str = "") -> Cluster:
    """Validate parsed YAML/JSON ``data`` and build the cluster."""
    if not isinstance(data, dict):
        got = "empty" if data is None else f"a {type(data).__name__}"
        raise ClusterError(f"{source}: the top level must be a mapping of fields, not {got}")
    if data.get("format", FORMAT) != FORMAT:
        raise ClusterError(f"{source}: field 'format' must be {FORMAT!r} for a cluster file")
    if data.get("version", VERSION) != VERSION:
        raise ClusterError(
            f"{source}: field 'version' is {data.get('version')!r}; this meshplace reads "
            f"version {VERSION}"
        )
    try:
        model = _ClusterModel.model_validate(data)
    except ValidationError as exc:
        raise ClusterError(f"{source}: {_describe(exc)}") from None
    return _build(model, source, default_name or "cluster")


def _build(model: _ClusterModel, source: str, default_name: str) -> Cluster:
    kinds = _custom_kinds(model, source)
    devices: list[Device] = []
    links: list[Link] = []
    switches: list[str] = []
    base: Cluster | None = None
    if model.topology is not None:
        _check_topology_kinds(model.topology, kinds, source)
        block = model.topology.model_dump(exclude_none=True)
        try:
            base = build_topology({**block, "specs": kinds} if kinds else block)
        except ClusterError as exc:
            msg = str(exc).removeprefix("topology: ")
            raise ClusterError(f"{source}: field 'topology' is invalid: {msg}") from None
        devices.extend(base.devices)
        links.extend(base.links)
        switches.extend(base.switches)
    total = len(devices) + sum(dm.count if dm.count is not None else 1 for dm in model.devices)
    if total > MAX_DEVICES:
        raise ClusterError(
            f"{source}: field 'devices' gives {total:,} devices; at most {MAX_DEVICES:,} allowed"
        )
    # the cluster-wide transfers default; a device entry or its custom kind may say otherwise
    kind_says = {k for k, km in model.device_kinds.items() if km.transfers is not None}
    if model.transfers is not None:
        devices = [d if d.kind in kind_says else d.with_transfers(model.transfers) for d in devices]
    counters: dict[str, int] = {}
    for k, dm in enumerate(model.devices):
        where = f"{source}: field 'devices[{k}]'"
        spec = _resolve_kind(dm.kind, kinds, where)
        if model.transfers is not None and dm.transfers is None and dm.kind not in kind_says:
            spec = spec.with_overrides(transfers=model.transfers)
        overrides = {f: getattr(dm, f) for f in _SPEC_FIELDS if getattr(dm, f) is not None}
        if overrides:
            spec = _apply(spec, overrides, f"{source}: field 'devices[{k}]")
        kind = spec.kind if dm.kind not in kinds else dm.kind
        if dm.count is None:
            if dm.name is None:
                raise ClusterError(
                    f"{where} needs a 'name' (or a 'count' to name the devices itself)"
                )
            devices.append(Device(dm.name, kind, spec, dm.host))
            continue
        prefix = dm.name or (spec.category if spec.category != "accelerator" else "dev")
        start = counters.get(prefix, 0)
        for i in range(start, start + dm.count):
            devices.append(Device(f"{prefix}{i}", kind, spec, dm.host))
        counters[prefix] = start + dm.count
    switches.extend(model.switches)
    nodes = {d.name for d in devices} | set(switches)
    for k, lm in enumerate(model.links):
        where = f"{source}: field 'links[{k}]' ({lm.src!r} -> {lm.dst!r})"
        if lm.src == lm.dst:
            raise ClusterError(f"{where} connects {lm.src!r} to itself")
        for end in (lm.src, lm.dst):
            if end not in nodes:
                raise ClusterError(
                    f"{where} names node {end!r}, which is neither a device nor a switch; "
                    f"known nodes include: {allowed(sorted(nodes), 8)}"
                )
        fwd = lm.name or f"{lm.src}->{lm.dst}"
        overlaps = lm.latency_overlaps
        links.append(Link(fwd, lm.src, lm.dst, lm.bandwidth, lm.latency, lm.kind, overlaps))
        if lm.bidirectional:
            rev = f"{lm.name}:reverse" if lm.name else f"{lm.dst}->{lm.src}"
            links.append(Link(rev, lm.dst, lm.src, lm.bandwidth, lm.latency, lm.kind, overlaps))
    pure = base is not None and not (model.devices or model.switches or model.links)
    meta = dict(base.meta) if base is not None else {}
    meta.pop("nic_attach", None)
    meta.update(model.meta)
    label = model.kind or (base.topology if base is not None else "custom")
    return Cluster(
        model.name or (base.name if base is not None else default_name),
        devices,
        links,
        switches,
        topology=label,
        source=model.source or (base.source if base is not None else ""),
        meta=meta,
        origin=source,
        recipe=base.recipe if pure and base is not None else None,
        torus=base._torus if pure and base is not None else None,
    )


def _custom_kinds(model: _ClusterModel, source: str) -> dict[str, DeviceSpec]:
    builtin = catalogue()
    kinds: dict[str, DeviceSpec] = {}
    for name, km in model.device_kinds.items():
        where = f"{source}: field 'device_kinds.{name}'"
        if name in builtin or name in KIND_ALIASES:
            raise ClusterError(
                f"{where} redefines a built-in kind; pick another name, or override fields "
                "on the devices instead"
            )
        given = {f: getattr(km, f) for f in _SPEC_FIELDS if getattr(km, f) is not None}
        if km.base is not None:
            spec = _resolve_kind(km.base, kinds, f"{source}: field 'device_kinds.{name}.base'")
            spec = _apply(spec, given, f"{source}: field 'device_kinds.{name}")
            spec = spec.with_overrides(kind=name)
            if "description" not in given:
                spec = spec.with_overrides(description=f"{name} (based on {km.base})")
        else:
            for f in ("peak_flops", "memory_bandwidth", "memory_bytes", "launch_overhead_s"):
                if f not in given:
                    raise ClusterError(
                        f"{where} is missing the field {f!r}; give it or a 'base' kind to "
                        "inherit from"
                    )
            spec = DeviceSpec(
                kind=name,
                description=given.get("description", name),
                peak_flops=_dtypes(given["peak_flops"], f"{source}: field 'device_kinds.{name}"),
                memory_bandwidth=given["memory_bandwidth"],
                memory_bytes=int(given["memory_bytes"]),
                launch_overhead_s=given["launch_overhead_s"],
                source=given.get("source", f"defined in {source}"),
                category=given.get("category", "accelerator"),
            )
        kinds[name] = spec
    return kinds


def _resolve_kind(kind: str, kinds: dict[str, DeviceSpec], where: str) -> DeviceSpec:
    if kind in kinds:
        return kinds[kind]
    builtin = catalogue()
    key = KIND_ALIASES.get(kind, kind)
    if key in builtin:
        return builtin[key]
    known = [*builtin, *KIND_ALIASES, *kinds]
    close = difflib.get_close_matches(kind.lower(), known, n=1) if isinstance(kind, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnknownDeviceError(
        f"{where} has unknown device kind {kind!r}{hint}; allowed kinds: "
        f"{', '.join([*builtin, *kinds])} (or define it under 'device_kinds')"
    )


def _check_topology_kinds(block: BaseModel, kinds: dict[str, DeviceSpec], source: str) -> None:
    inner = block.per_host if isinstance(block, _MultiHost) else block
    prefix = "topology.per_host" if inner is not block else "topology"
    for f in ("gpu_kind", "cpu_kind", "device_kind"):
        value = getattr(inner, f, None)
        if value is not None:
            _resolve_kind(value, kinds, f"{source}: field '{prefix}.{f}'")


def _dtypes(flops: dict[str, float], where: str) -> dict[str, float]:
    """``where`` is ``"file: field 'path"`` (no closing quote: the field is appended)."""
    out: dict[str, float] = {}
    for key, value in flops.items():
        dt = normalize_dtype(key)
        if dt not in DTYPES:
            raise ClusterError(
                f"{where}.peak_flops' has unknown dtype {key!r}; allowed: {', '.join(DTYPES)}"
            )
        out[dt] = float(value)
    return out


def _apply(spec: DeviceSpec, overrides: dict[str, Any], where: str) -> DeviceSpec:
    """``where`` as for :func:`_dtypes`."""
    changes = dict(overrides)
    if "peak_flops" in changes:
        changes["peak_flops"] = _dtypes(changes["peak_flops"], where)
    if "memory_bytes" in changes:
        changes["memory_bytes"] = int(changes["memory_bytes"])
    return spec.with_overrides(**changes)


# ---------------------------------------------------------------------- error sentences
def _model_at(loc: list[Any]) -> tuple[type[BaseModel] | None, list[Any]]:
    """The pydantic model that owns the last field of ``loc``, and ``loc`` with union tags
    dropped (for display)."""
    model: type[BaseModel] | None = _ClusterModel
    shown: list[Any] = []
    i = 0
    while i < len(loc):
        part = loc[i]
        shown.append(part)
        tagged = i + 1 < len(loc) and loc[i + 1] in _TOPOLOGY_MODELS
        if tagged and (
            (model is _ClusterModel and part == "topology")
            or (model is _MultiHost and part == "per_host")
        ):
            model = _TOPOLOGY_MODELS[loc[i + 1]]
            i += 2
            continue
        if (
            model is _ClusterModel
            and part in ("devices", "links", "device_kinds")
            and i + 2 < len(loc)
        ):
            model = {"devices": _DeviceModel, "links": _LinkModel}.get(part, _KindModel)
            shown.append(loc[i + 1])
            i += 2
            continue
        if i < len(loc) - 1:
            model = None
        i += 1
    return model, shown


def _path(parts: list[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _describe(exc: ValidationError) -> str:
    """One sentence for the first validation error."""
    err = exc.errors()[0]
    loc = list(err["loc"])
    etype = err["type"]
    owner, shown = _model_at(loc)
    if etype == "extra_forbidden":
        parent = _path(shown[:-1])
        fields = list(owner.model_fields) if owner is not None else []
        subject = f"field {parent!r}" if parent else "the cluster file"
        return f"{subject} has unknown field {shown[-1]!r}; allowed: {', '.join(fields)}"
    if etype == "missing":
        parent = _path(shown[:-1])
        subject = f"field {parent!r}" if parent else "the cluster file"
        return f"{subject} is missing the required field {shown[-1]!r}"
    if etype in ("union_tag_invalid", "union_tag_not_found"):
        tags = "pcie_tree, nvlink_mesh" if "per_host" in shown else ", ".join(_TOPOLOGY_MODELS)
        tag = err.get("ctx", {}).get("tag")
        got = f" is {tag!r}" if tag is not None else " is missing"
        return f"field '{_path([*shown, 'generator'])}'{got}; allowed generators: {tags}"
    where = f"field {_path(shown)!r}"
    value = err.get("input")
    got = "" if isinstance(value, dict | list) else f" (got {short_repr(value)})"
    if etype == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return f"{where}: {msg}"
    if etype in ("greater_than", "greater_than_equal"):
        bound = err.get("ctx", {}).get("gt", err.get("ctx", {}).get("ge"))
        rel = "greater than" if etype == "greater_than" else "at least"
        return f"{where} must be {rel} {bound}{got}"
    if etype == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{where} must be one of {expected}{got}"
    msg = err["msg"][0].lower() + err["msg"][1:]
    return f"{where}: {msg}{got}".replace("\n", " ")


# ---------------------------------------------------------------------- writing
def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The cluster as a YAML/JSON-ready dict that :func:`cluster_from_dict` reads back to
    an equal cluster: a ``topology:`` block when the cluster came from a generator and no
    device was changed since, else explicit devices, switches and one entry per directed
    link (``bidirectional: false``)."""
    builtin = catalogue()
    out: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "name": cluster.name,
        "kind": cluster.topology,
        "source": cluster.source,
    }
    meta = {k: v for k, v in cluster.meta.items() if k != "nic_attach"}
    if meta:
        out["meta"] = meta
    custom: dict[str, DeviceSpec] = {}
    for d in cluster.devices:
        if d.kind not in builtin and d.kind not in custom:
            custom[d.kind] = d.spec
    if custom:
        out["device_kinds"] = {k: _spec_dict(s) for k, s in custom.items()}
    plain = all(d.spec == builtin.get(d.kind, custom.get(d.kind)) for d in cluster.devices)
    if cluster.recipe is not None and plain:
        out["topology"] = _plain(cluster.recipe)
        return out
    devices = []
    for d in cluster.devices:
        entry: dict[str, Any] = {"name": d.name, "kind": d.kind, "host": d.host}
        ref = builtin.get(d.kind, custom.get(d.kind))
        if ref is not None and d.spec != ref:
            for f in _SPEC_FIELDS:
                if getattr(d.spec, f) != getattr(ref, f):
                    entry[f] = _plain(getattr(d.spec, f))
        devices.append(entry)
    out["devices"] = devices
    if cluster.switches:
        out["switches"] = list(cluster.switches)
    out["links"] = [
        {
            "name": lk.name,
            "src": lk.src,
            "dst": lk.dst,
            "bandwidth": float(lk.bandwidth),
            "latency": float(lk.latency),
            "kind": lk.kind,
            "bidirectional": False,
            # written only where set, so that other clusters' files read as they did
            **({"latency_overlaps": True} if lk.latency_overlaps else {}),
        }
        for lk in cluster.links
    ]
    return out


def _spec_dict(spec: DeviceSpec) -> dict[str, Any]:
    return {f: _plain(getattr(spec, f)) for f in _SPEC_FIELDS}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    return value


def cluster_to_yaml(cluster: Cluster) -> str:
    """The cluster as YAML text (see :func:`cluster_to_dict`)."""
    return yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False, allow_unicode=True)


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write the cluster as YAML to ``path`` atomically."""
    write_text_atomic(path, cluster_to_yaml(cluster))
