"""The OpGraph: meshplace's intermediate representation of a training (or inference) step.

An :class:`OpGraph` is a DAG whose nodes are ops (an aten op, a parameter, an input, or
anything a user describes in JSON) and whose edges carry the bytes of the tensor that flows
from producer to consumer. It is held twice over:

* as a list of :class:`Op` records (readable, what the JSON file stores), and
* as flat numpy arrays (:meth:`OpGraph.arrays`), the form the simulator and placers use,
  because per-op Python attribute access is too slow for scoring thousands of plans a second.

``OpGraph.to_networkx()`` gives a ``networkx.DiGraph`` for the graph algorithms that networkx
already does well (topological sorts, cuts, critical paths).

Example
-------
>>> g = OpGraph("tiny")
>>> _ = g.add_op(Op("x", "input", output_shapes=[[4, 8]]))
>>> _ = g.add_op(Op("mm", "matmul", flops=2 * 4 * 8 * 8, output_shapes=[[4, 8]]))
>>> g.add_edge("x", "mm", 4 * 8 * 4)
>>> g.num_ops, g.num_edges, g.total_flops()
(2, 1, 512.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import networkx as nx
import numpy as np

from meshplace.errors import InputError

PHASES = ("forward", "backward", "update")
PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}


class GraphError(InputError):
    """A graph is malformed: a cycle, a dangling edge, a duplicate name or a bad cost."""


@dataclass
class Op:
    """One node of an :class:`OpGraph`.

    Attributes:
        name: unique within the graph.
        kind: coarse op kind used by cost models (``matmul``, ``conv2d``, ``elementwise``…).
        phase: ``forward``, ``backward`` or ``update``.
        module: module path the op came from (``encoder.layers.1.attn``); ``""`` for the root.
        target: the exact operator (``aten.addmm.default``) when captured from PyTorch.
        output_shapes: one shape per output tensor.
        output_dtypes: one dtype name per output tensor (``float32``…).
        dim_names: per output, per dimension, a name (``batch``, ``seq``…) or ``None``.
        flops: floating-point operations of one execution.
        bytes_read: bytes of the tensors the op reads.
        bytes_written: bytes of the tensors the op writes.
        param_bytes: bytes of trainable parameters and buffers this op owns (resident).
        state_bytes: bytes of optimizer state this op owns (resident while training).
        memory_bytes: working memory of the op's outputs if it differs from their size.
        measured_time: seconds per execution measured on a device kind (``{"k80": 2e-4}``).
        unsupported: device kinds or categories that cannot run the op at all (an operator
            an FPGA or a TPU lacks): its time there is infinite, so no plan puts it there.
        colocation: ops sharing a key prefer one device (a parameter and its update ops).
        forward_op: for a backward op, the forward op it differentiates.
        einsum: index notation of the op's operands and outputs
            (:mod:`meshplace.graph.opdims`): which dimensions a mesh may split.
        operands: one record per tensor operand, in the notation's order:
            ``{"op": producer, "out": output index, "shape": as this op reads it,
            "map": per dimension the producer output dimension it is (-1: none)}``.
    """

    name: str
    kind: str
    phase: str = "forward"
    module: str = ""
    target: str = ""
    output_shapes: list[list[int]] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    dim_names: list[list[str | None]] | None = None
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    param_bytes: int = 0
    state_bytes: int = 0
    memory_bytes: int | None = None
    measured_time: dict[str, float] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)
    colocation: str | None = None
    forward_op: str | None = None
    einsum: str | None = None
    operands: list[dict] | None = None

    def output_bytes(self) -> int:
        """Bytes of all outputs (``memory_bytes`` when the op declares it)."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        total = 0
        for i, shape in enumerate(self.output_shapes):
            dtype = self.output_dtypes[i] if i < len(self.output_dtypes) else "float32"
            total += math.prod(shape) * dtype_size(dtype)
        return total


_DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name (``float32`` → 4)."""
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise GraphError(
            f"unknown dtype {dtype!r}; allowed: {', '.join(sorted(_DTYPE_SIZES))}"
        ) from None


def known_dtypes() -> list[str]:
    """The dtype names an OpGraph accepts."""
    return sorted(_DTYPE_SIZES)


# The op kinds a graph file may name: every kind ``meshplace.graph.flops.op_kind`` gives an
# aten op, the kinds capture gives parameters, buffers and inputs, and ``collective`` (the
# point-to-point schedules of ``meshplace.cost.collectives``). Cost models key their
# efficiencies on these (``meshplace.cost.compute.DEFAULT_EFFICIENCY``), so a misspelt kind
# would silently get the fallback efficiency: graph files are checked against this list.
OP_KINDS = (
    "matmul",
    "conv",
    "conv_grad",
    "attention",
    "attention_grad",
    "softmax",
    "softmax_grad",
    "batch_norm",
    "batch_norm_grad",
    "layer_norm",
    "layer_norm_grad",
    "group_norm",
    "group_norm_grad",
    "embedding",
    "embedding_grad",
    "loss",
    "loss_grad",
    "pool",
    "pool_grad",
    "reduction",
    "linalg",
    "copy",
    "fill",
    "elementwise",
    "collective",
    "parameter",
    "buffer",
    "input",
)


@dataclass(frozen=True)
class GraphArrays:
    """Flat numpy view of an OpGraph, indexed by op position.

    ``succ_ptr``/``succ_idx`` (and ``pred_ptr``/``pred_idx``) are CSR adjacency: the successors
    of op ``i`` are ``succ_idx[succ_ptr[i]:succ_ptr[i + 1]]`` and ``succ_edge`` gives the edge
    index of each, so ``edge_bytes[succ_edge[k]]`` is the size of that transfer.
    """

    flops: np.ndarray
    bytes_accessed: np.ndarray
    output_bytes: np.ndarray
    param_bytes: np.ndarray
    state_bytes: np.ndarray
    phase: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_bytes: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    succ_edge: np.ndarray
    pred_ptr: np.ndarray
    pred_idx: np.ndarray
    pred_edge: np.ndarray
    topo_order: np.ndarray


class OpGraph:
    """A DAG of :class:`Op` with byte-weighted edges.

    Edges are unique per (producer, consumer) pair: adding the same pair twice adds the
    bytes, because a consumer that reads two outputs of one producer receives both.
    """

    def __init__(self, name: str, meta: dict | None = None) -> None:
        self.name = name
        self.meta: dict = dict(meta or {})
        self.ops: list[Op] = []
        self._index: dict[str, int] = {}
        self._edges: dict[tuple[int, int], float] = {}

    # ----------------------------------------------------------------- building
    def add_op(self, op: Op) -> int:
        """Append ``op`` and return its index; a duplicate name is a :class:`GraphError`."""
        if op.name in self._index:
            raise GraphError(f"duplicate op name {op.name!r}")
        self._index[op.name] = len(self.ops)
        self.ops.append(op)
        self._invalidate()
        return len(self.ops) - 1

    def add_edge(self, src: str | int, dst: str | int, nbytes: float) -> None:
        """Add a tensor of ``nbytes`` flowing from ``src`` to ``dst`` (names or indices)."""
        s = self.index(src) if isinstance(src, str) else src
        d = self.index(dst) if isinstance(dst, str) else dst
        if s == d:
            raise GraphError(f"op {self.ops[s].name!r} has an edge to itself")
        self._edges[(s, d)] = self._edges.get((s, d), 0.0) + float(nbytes)
        self._invalidate()

    def _invalidate(self) -> None:
        self.__dict__.pop("arrays_cache", None)

    # ------------------------------------------------------------------ queries
    def index(self, name: str) -> int:
        """Position of the op called ``name``."""
        try:
            return self._index[name]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no op named {name!r}") from None

    def op(self, name: str) -> Op:
        return self.ops[self.index(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def num_edges(self) -> int:
        return len(self._edges)

    def edges(self) -> Iterable[tuple[int, int, float]]:
        """(src index, dst index, bytes) for every edge, in insertion order."""
        return ((s, d, b) for (s, d), b in self._edges.items())

    def edge_bytes(self, src: str, dst: str) -> float:
        return self._edges[(self.index(src), self.index(dst))]

    def edge_bytes_at(self, src: int, dst: int) -> float:
        """Bytes on the edge between op indices ``src`` and ``dst`` (0 if there is none)."""
        return self._edges.get((src, dst), 0.0)

    def total_flops(self, phase: str | None = None) -> float:
        return float(sum(o.flops for o in self.ops if phase is None or o.phase == phase))

    def param_bytes(self) -> int:
        return int(sum(o.param_bytes for o in self.ops))

    def count_by(self, attr: str) -> dict[str, int]:
        """How many ops share each value of ``attr`` (``kind``, ``phase``…), largest first."""
        counts: dict[str, int] = {}
        for o in self.ops:
            key = getattr(o, attr)
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    # ------------------------------------------------------------------ arrays
    @cached_property
    def arrays_cache(self) -> GraphArrays:
        return self._build_arrays()

    def arrays(self) -> GraphArrays:
        """The flat array form (cached until the graph changes); checks acyclicity."""
        return self.arrays_cache

    def _build_arrays(self) -> GraphArrays:
        n = len(self.ops)
        if self._edges:
            pairs = np.array(list(self._edges.keys()), dtype=np.int64)
            src, dst = pairs[:, 0], pairs[:, 1]
            nbytes = np.fromiter(self._edges.values(), dtype=np.float64, count=len(self._edges))
        else:
            src = dst = np.zeros(0, dtype=np.int64)
            nbytes = np.zeros(0, dtype=np.float64)
        succ_ptr, succ_idx, succ_edge = _csr(src, dst, n)
        pred_ptr, pred_idx, pred_edge = _csr(dst, src, n)
        order = _topological_order(n, succ_ptr, succ_idx, pred_ptr)
        if len(order) < n:
            stuck = sorted(set(range(n)) - set(order.tolist()))
            cycle = _find_cycle(self, stuck)
            raise GraphError(f"graph {self.name!r} has a cycle: {' -> '.join(cycle)}")
        return GraphArrays(
            flops=np.array([o.flops for o in self.ops], dtype=np.float64),
            bytes_accessed=np.array(
                [o.bytes_read + o.bytes_written for o in self.ops], dtype=np.float64
            ),
            output_bytes=np.array([o.output_bytes() for o in self.ops], dtype=np.float64),
            param_bytes=np.array([o.param_bytes for o in self.ops], dtype=np.float64),
            state_bytes=np.array([o.state_bytes for o in self.ops], dtype=np.float64),
            phase=np.array([PHASE_INDEX[o.phase] for o in self.ops], dtype=np.int8),
            edge_src=src,
            edge_dst=dst,
            edge_bytes=nbytes,
            succ_ptr=succ_ptr,
            succ_idx=succ_idx,
            succ_edge=succ_edge,
            pred_ptr=pred_ptr,
            pred_idx=pred_idx,
            pred_edge=pred_edge,
            topo_order=order,
        )

    def check_acyclic(self) -> None:
        """Raise :class:`GraphError` naming a cycle if the graph has one."""
        self.arrays()

    # ---------------------------------------------------------------- networkx
    def to_networkx(self) -> nx.DiGraph:
        """A ``networkx.DiGraph`` with op names as nodes, ``Op`` under ``"op"`` and edge
        attribute ``"bytes"``."""
        g = nx.DiGraph(name=self.name)
        for o in self.ops:
            g.add_node(o.name, op=o)
        for s, d, b in self.edges():
            g.add_edge(self.ops[s].name, self.ops[d].name, bytes=b)
        return g

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpGraph):
            return NotImplemented
        return (
            self.name == other.name
            and self.meta == other.meta
            and self.ops == other.ops
            and self._edges == other._edges
        )

    def __repr__(self) -> str:
        return f"OpGraph({self.name!r}, ops={self.num_ops}, edges={self.num_edges})"


def _csr(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.argsort(src, kind="stable")
    counts = np.bincount(src, minlength=n)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr, dst[order].astype(np.int64), order.astype(np.int64)


def _topological_order(
    n: int, succ_ptr: np.ndarray, succ_idx: np.ndarray, pred_ptr: np.ndarray
) -> np.ndarray:
    """Kahn's algorithm, smallest index first among ready ops, so the order is stable and
    follows the order ops were added (capture order is execution order). O((V+E) log V)."""
    import heapq

    indeg = np.diff(pred_ptr).tolist()
    ptr = succ_ptr.tolist()
    idx = succ_idx.tolist()
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        u = heapq.heappop(ready)
        out.append(u)
        for k in range(ptr[u], ptr[u + 1]):
            v = idx[k]
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, v)
    return np.array(out, dtype=np.int64)


def _find_cycle(graph: OpGraph, candidates: list[int]) -> list[str]:
    sub = nx.DiGraph()
    cand = set(candidates)
    for s, d, _ in graph.edges():
        if s in cand and d in cand:
            sub.add_edge(graph.ops[s].name, graph.ops[d].name)
    cycle = nx.find_cycle(sub)
    names = [u for u, _ in cycle]
    return [*names, names[0]]
