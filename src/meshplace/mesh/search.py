"""Layout search: mesh shapes x layout rules, minimising step time within device memory.

Mesh-TensorFlow's own layout tool minimises memory only (Shazeer et al. 2018, Sec. 7;
``mtf.auto_mtf``); here every candidate is costed for **time and memory** by
:mod:`meshplace.mesh.cost` and the fastest layouts that fit are returned.

Search space:

- **mesh shapes**: every factorisation of the chip count into 1 to ``max_axes`` factors of
  at least 2, in non-decreasing order (``8x64`` and ``64x8`` name the same layouts with the
  axes swapped; :func:`meshplace.mesh.layout.build_mesh` picks the physical orientation), or
  one given shape;
- **rules**: each of the program's search dimensions (batch, seq, d_model, d_ff, heads,
  d_kv, vocab; batch, height, width for conv nets) goes to one mesh axis or stays whole;
- **weight-update sharding**: on, off, or both (``auto``).

Pruning, all exact (no layout that could win is dropped): a dimension is offered only the
axes whose size divides every size it has; assignments that put two dimensions of one
tensor on one axis are cut as soon as the second is assigned (depth-first enumeration over
the conflict graph of co-occurring names); layouts that leave a mesh axis unused are
skipped (they replicate all work along it: dominated by the same layout on the smaller
mesh). Layouts differing only by a swap of equally-sized axes are reported once.

Complexity: O(meshes x legal layouts x ops of one layer); op costs are memoised per
(op, axes of its names), so each evaluation is a few hundred dictionary look-ups
(~0.1 ms). The 5B Mesh-TensorFlow LM on 512 chips has ~10^3 legal layouts on 1-2 axes.

Example
-------
>>> from meshplace.hardware import load_cluster
>>> from meshplace.mesh.program import transformer_lm
>>> prog = transformer_lm({"batch": 64, "seq": 128, "d_model": 512, "d_ff": 2048,
...                        "heads": 8, "d_kv": 64, "layers": 2, "vocab": 8192})
>>> res = search(prog, load_cluster("tpu-v3-8"), chips=4, max_axes=1)
>>> res.best.mesh.label, res.best.fits
('4', True)
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from meshplace.cost.compute import CostModel
from meshplace.errors import InputError
from meshplace.hardware.cluster import Cluster
from meshplace.mesh.cost import Evaluator, LayoutCost
from meshplace.mesh.layout import AXIS_NAMES, LayoutError, Mesh, accelerators, build_mesh
from meshplace.mesh.program import Program

WUS_MODES = ("auto", "on", "off")


@dataclass
class SearchResult:
    """Ranked layouts (fitting ones first, then by step time) and search statistics."""

    ranked: list[LayoutCost]
    evaluated: int
    legal: int
    seconds: float
    mesh_shapes: list[tuple[int, ...]]
    chips: int
    min_memory_bytes: float = math.inf
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> LayoutCost:
        return self.ranked[0]


def mesh_shapes(chips: int, max_axes: int = 2) -> list[tuple[int, ...]]:
    """Non-decreasing factorisations of ``chips`` into 1..``max_axes`` factors >= 2.

    >>> mesh_shapes(16, 2)
    [(16,), (2, 8), (4, 4)]
    """
    if chips == 1:
        return [(1,)]
    out: list[tuple[int, ...]] = []

    def rec(rest: int, lo: int, acc: tuple[int, ...]) -> None:
        if rest == 1:
            if acc:
                out.append(acc)
            return
        if len(acc) == max_axes:
            return
        for f in range(lo, rest + 1):
            if rest % f == 0:
                rec(rest // f, f, (*acc, f))

    rec(chips, 2, ())
    out.sort(key=lambda s: (len(s), s))
    return out


def hand_layout(program: Program, chips: int) -> tuple[tuple[int, ...], dict[str, str]]:
    """Mesh-TensorFlow's hand layout for its Transformers (Shazeer et al. 2018, Sec. 6-7):
    a rows x columns mesh, batch over the rows, and d_ff, heads and vocab over the columns.
    Columns: the largest power of two that is at most 32 (the 16x32 mesh of its 512-core
    runs), at most half the chips (so there are rows) and divides the head count.
    Dimensions whose sizes an axis does not divide stay whole.

    >>> from meshplace.mesh.program import transformer_lm
    >>> p = transformer_lm({"batch": 256, "seq": 256, "d_model": 1024, "d_ff": 262144,
    ...                     "heads": 256, "d_kv": 256, "layers": 6, "vocab": 32000})
    >>> hand_layout(p, 512)
    ((16, 32), {'batch': 'x', 'd_ff': 'y', 'heads': 'y', 'vocab': 'y'})
    """
    sizes = program.dim_sizes()
    heads = min(sizes.get("heads", {1}))

    def ok(dim: str, n: int) -> bool:
        return dim in sizes and all(s % n == 0 for s in sizes[dim])

    model = 1
    while (
        model * 2 <= 32
        and model * 2 <= max(chips // 2, 1)
        and chips % (model * 2) == 0
        and heads % (model * 2) == 0
    ):
        model *= 2
    rows = chips // model
    if model == 1:
        return (chips,), ({"batch": "x"} if ok("batch", chips) else {})
    shape = (rows, model)
    rules = {"batch": "x"} if ok("batch", rows) else {}
    rules |= {d: "y" for d in ("d_ff", "heads", "vocab") if ok(d, model)}
    return shape, rules


def _canonical(shape: tuple[int, ...], rules: Mapping[str, str]) -> tuple:
    """The same layout with equally-sized axes relabelled to the smallest form."""
    names = AXIS_NAMES[: len(shape)]
    best = None
    for perm in itertools.permutations(range(len(shape))):
        if any(shape[i] != shape[p] for i, p in enumerate(perm)):
            continue
        ren = {names[i]: names[p] for i, p in enumerate(perm)}
        key = tuple(sorted((d, ren.get(a, a)) for d, a in rules.items()))
        if best is None or key < best:
            best = key
    return (shape, best)


def search(
    program: Program,
    cluster: Cluster,
    *,
    chips: int | None = None,
    mesh_shape: Sequence[int] | None = None,
    max_axes: int = 2,
    pinned: Mapping[str, str | None] | None = None,
    weight_update_sharding: str = "auto",
    top_k: int = 5,
    memory_fraction: float = 1.0,
    progress: Callable[[str], None] | None = None,
    cost_model: CostModel | None = None,
) -> SearchResult:
    """The ``top_k`` fastest layouts of ``program`` on ``chips`` devices of ``cluster``,
    costed with ``cost_model`` (default: the roofline's defaults).

    ``pinned`` fixes some rules (``{"batch": "x"}``; ``None`` keeps a dimension whole);
    the search assigns the other search dimensions. Raises :class:`InputError` (one
    sentence) when the mesh shape does not match the chip count, a rule names an unknown
    dimension or axis, no layout is legal, or no legal layout fits in memory.
    """
    start = time.perf_counter()
    if weight_update_sharding not in WUS_MODES:
        raise InputError(
            f"weight-update sharding {weight_update_sharding!r} is not one of: "
            f"{', '.join(WUS_MODES)}"
        )
    navail = len(accelerators(cluster))
    if mesh_shape is not None:
        shape_t = tuple(int(s) for s in mesh_shape)
        n = math.prod(shape_t)
        if chips is not None and chips != n:
            raise LayoutError(
                f"mesh {'x'.join(map(str, shape_t))} has {n} devices but --chips is {chips}; "
                "the product of the mesh shape must equal the chip count"
            )
        chips = n
        shapes = [shape_t]
    else:
        chips = navail if chips is None else chips
        if not 1 <= max_axes <= len(AXIS_NAMES):
            raise InputError(f"max_axes must be 1 to {len(AXIS_NAMES)}, not {max_axes}")
        shapes = mesh_shapes(chips, max_axes)
    if chips < 1 or chips > navail:
        raise LayoutError(
            f"cluster {cluster.name!r} has {navail} accelerators; cannot use {chips} chips"
        )
    pinned = dict(pinned or {})
    _check_names(program, pinned)
    wus_opts = {"auto": (False, True), "on": (True,), "off": (False,)}[weight_update_sharding]
    sizes = program.dim_sizes()
    search_dims = [d for d in program.search_dims if d not in pinned and d in sizes]
    # conflict graph: names that share a tensor cannot share an axis
    relevant = set(search_dims) | {d for d, a in pinned.items() if a}
    conflicts: dict[str, set[str]] = {d: set() for d in relevant}
    for t in program.tensors.values():
        ns = [n for n in t.names if n in relevant]
        for a, b in itertools.combinations(ns, 2):
            conflicts[a].add(b)
            conflicts[b].add(a)
    found: list[tuple[tuple, float, float, bool, int, dict[str, str]]] = []
    meshes: list[Mesh] = []
    evaluators: list[Evaluator] = []
    evaluated = legal = 0
    min_mem = math.inf
    last_error: LayoutError | None = None
    for shape in shapes:
        if progress:
            progress(f"mesh {'x'.join(map(str, shape))}")
        mesh = build_mesh(cluster, shape, chips=chips)
        ev = Evaluator(program, mesh, memory_fraction=memory_fraction, cost_model=cost_model)
        try:
            ev.check(pinned)
        except LayoutError as exc:
            if mesh_shape is not None:
                raise
            last_error = exc
            continue
        mi = len(meshes)
        meshes.append(mesh)
        evaluators.append(ev)
        axes = [a for a, s in zip(mesh.axis_names, mesh.shape, strict=True) if s > 1]
        axis_size = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        options = []
        for d in search_dims:
            opts: list[str | None] = [None]
            opts += [a for a in axes if all(s % axis_size[a] == 0 for s in sizes[d])]
            options.append(opts)
        base = {d: a for d, a in pinned.items() if a}
        for rules in _assignments(search_dims, options, conflicts, base):
            if set(rules.values()) != set(axes):
                continue  # an unused axis only replicates work
            legal += 1
            for wus in wus_opts:
                res = ev.evaluate(rules, wus, detail=False)
                assert isinstance(res, tuple)
                step, peak = res
                evaluated += 1
                min_mem = min(min_mem, peak)
                fits = peak <= ev.capacity
                found.append(((not fits, step, peak), step, peak, wus, mi, dict(rules)))
    if not found:
        if last_error is not None and not meshes:
            raise last_error
        raise InputError(
            f"no legal layout of {program.name!r} uses all of the mesh axes on {chips} chips "
            f"(tried meshes {', '.join('x'.join(map(str, s)) for s in shapes)}); "
            "try fewer chips or another mesh shape"
        )
    found.sort(key=lambda f: f[0])
    if found[0][0][0]:
        cap = evaluators[0].capacity
        raise InputError(
            f"{program.name} fits no layout on {chips} chips of {cluster.name}: the smallest "
            f"needs {min_mem / 2**30:.1f} GiB per device, more than the {cap / 2**30:.1f} GiB "
            "available"
        )
    ranked: list[LayoutCost] = []
    seen: set[tuple] = set()
    for _, _, _, wus, mi, rules in found:
        key = (_canonical(meshes[mi].shape, rules), wus)
        if key in seen:
            continue
        seen.add(key)
        full = evaluators[mi].evaluate(rules, wus)
        assert isinstance(full, LayoutCost)
        ranked.append(full)
        if len(ranked) >= top_k:
            break
    return SearchResult(
        ranked,
        evaluated,
        legal,
        time.perf_counter() - start,
        [m.shape for m in meshes],
        chips,
        min_mem,
    )


def _check_names(program: Program, rules: Mapping[str, str | None]) -> None:
    known = program.dim_sizes()
    for name in rules:
        if name not in known:
            raise LayoutError(
                f"layout rule names dimension {name!r}, which {program.name!r} does not have; "
                f"its dimensions are: {', '.join(sorted(known))}"
            )


def _assignments(
    dims: list[str],
    options: list[list[str | None]],
    conflicts: Mapping[str, set[str]],
    base: dict[str, str],
):
    """Depth-first enumeration of legal rule sets (no two conflicting names on one axis)."""
    rules = dict(base)

    def rec(k: int):
        if k == len(dims):
            yield rules
            return
        d = dims[k]
        for a in options[k]:
            if a is None:
                yield from rec(k + 1)
                continue
            if any(rules.get(c) == a for c in conflicts.get(d, ())):
                continue
            rules[d] = a
            yield from rec(k + 1)
            del rules[d]

    yield from rec(0)


def evaluate_layout(
    program: Program,
    cluster: Cluster,
    shape: Sequence[int],
    rules: Mapping[str, str | None],
    *,
    weight_update_sharding: bool = False,
    chips: int | None = None,
    memory_fraction: float = 1.0,
    cost_model: CostModel | None = None,
) -> LayoutCost:
    """Cost one given layout (a mesh ``shape`` and its ``rules``), e.g. a hand layout.

    Raises :class:`LayoutError` when the layout is illegal."""
    mesh = build_mesh(cluster, shape, chips=chips if chips is not None else math.prod(shape))
    ev = Evaluator(program, mesh, memory_fraction=memory_fraction, cost_model=cost_model)
    _check_names(program, rules)
    ev.check(rules)
    res = ev.evaluate(rules, weight_update_sharding)
    assert isinstance(res, LayoutCost)
    return res
