"""Group features and batched scoring shared by the placement environment and the learners.

Each co-location group (``problem.grouping``) becomes one fixed-width row of
:data:`FEATURE_NAMES`, in the spirit of ColocRL's op embeddings (Mirhoseini et al., ICML
2017, §3: op type, output shape, adjacency):

* ``kind:*`` — the share of the group's ops of each coarse op kind (:data:`KINDS`; a
  backward kind such as ``matmul_grad`` counts as its forward kind, the phase columns tell
  them apart);
* ``phase:*`` — the share of forward, backward and update ops;
* ``log_flops``, ``log_bytes``, ``log_output_bytes``, ``log_memory`` — ``log10(1 + x) / 12``
  of the group's FLOPs, bytes read and written, output bytes and memory demand
  (``problem.group_memory``), so a 1-TFLOP group sits at 1.0;
* ``log_ops`` — ``log10(1 + ops) / 4``;
* ``level`` — longest-path depth of the group in the group graph over the deepest group's
  (0 at the sources, 1 at the deepest sink);
* ``log_in_degree``, ``log_out_degree`` — ``log2(1 + degree) / 8`` in the group graph;
* ``valid`` — 1 for a real group, 0 for a padding row.

Every feature is clipped to ``[0, FEATURE_HIGH]``; rows past ``num_groups`` are zero.

Complexity: O(V + E) for the features; :func:`score_batch` is one simulation per distinct
placement, O(B × (V + E) log V).

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> x = group_features(p, max_groups=p.num_groups + 2)
>>> x.shape == (p.num_groups + 2, len(FEATURE_NAMES)), float(x[-1].sum())
(True, 0.0)
>>> scores = score_batch(p, np.zeros((2, p.num_groups), dtype=np.int64))
>>> bool(scores[0] == scores[1] == p.score(p.evaluate(np.zeros(p.num_groups, np.int64))))
True
"""

from __future__ import annotations

import numpy as np

from meshplace.placers.base import PlacementProblem

KINDS = (
    "matmul",
    "conv",
    "attention",
    "softmax",
    "norm",
    "embedding",
    "loss",
    "pool",
    "reduction",
    "linalg",
    "copy",
    "elementwise",
    "parameter",
    "input",
    "other",
)
_KIND_ALIASES = {
    "batch_norm": "norm",
    "layer_norm": "norm",
    "group_norm": "norm",
    "fill": "copy",
}
FEATURE_NAMES: tuple[str, ...] = (
    *(f"kind:{k}" for k in KINDS),
    "phase:forward",
    "phase:backward",
    "phase:update",
    "log_flops",
    "log_bytes",
    "log_output_bytes",
    "log_memory",
    "log_ops",
    "level",
    "log_in_degree",
    "log_out_degree",
    "valid",
)
NUM_FEATURES = len(FEATURE_NAMES)
FEATURE_HIGH = 4.0


def kind_index(kind: str) -> int:
    """Column of ``kind`` in :data:`KINDS` (``matmul_grad`` → ``matmul``; unknown → other).

    >>> KINDS[kind_index("layer_norm_grad")], KINDS[kind_index("custom")]
    ('norm', 'other')
    """
    base = kind.removesuffix("_grad")
    base = _KIND_ALIASES.get(base, base)
    return KINDS.index(base) if base in KINDS else KINDS.index("other")


def group_levels(problem: PlacementProblem) -> np.ndarray:
    """Longest-path depth of every group in the (acyclic) group graph."""
    a = problem.group_graph.arrays()
    level = np.zeros(problem.num_groups, dtype=np.int64)
    for g in a.topo_order.tolist():
        preds = a.pred_idx[a.pred_ptr[g] : a.pred_ptr[g + 1]]
        if len(preds):
            level[g] = int(level[preds].max()) + 1
    return level


def group_features(problem: PlacementProblem, max_groups: int | None = None) -> np.ndarray:
    """``[max_groups, NUM_FEATURES]`` float32 features of the problem's groups (see module
    docstring); ``max_groups`` defaults to ``problem.num_groups`` and must not be smaller."""
    n = problem.num_groups
    rows = n if max_groups is None else int(max_groups)
    if rows < n:
        raise ValueError(f"max_groups={rows} is smaller than the problem's {n} groups")
    graph = problem.graph
    arrays = graph.arrays()
    group_of = problem.group_of
    ops_per_group = np.bincount(group_of, minlength=n).astype(np.float64)
    counts = np.maximum(ops_per_group, 1.0)[:, None]

    kinds = np.fromiter((kind_index(o.kind) for o in graph.ops), dtype=np.int64, count=len(graph))
    kind_hist = np.zeros((n, len(KINDS)))
    np.add.at(kind_hist, (group_of, kinds), 1.0)
    phase_hist = np.zeros((n, 3))
    np.add.at(phase_hist, (group_of, arrays.phase.astype(np.int64)), 1.0)

    def per_group(values: np.ndarray) -> np.ndarray:
        return np.bincount(group_of, weights=values, minlength=n)

    def log_scaled(values: np.ndarray, scale: float) -> np.ndarray:
        return np.log10(1.0 + np.maximum(values, 0.0)) / scale

    ga = problem.group_graph.arrays()
    level = group_levels(problem).astype(np.float64)
    in_deg = np.diff(ga.pred_ptr).astype(np.float64)
    out_deg = np.diff(ga.succ_ptr).astype(np.float64)
    columns = [
        kind_hist / counts,
        phase_hist / counts,
        log_scaled(per_group(arrays.flops), 12.0)[:, None],
        log_scaled(per_group(arrays.bytes_accessed), 12.0)[:, None],
        log_scaled(per_group(arrays.output_bytes), 12.0)[:, None],
        log_scaled(problem.group_memory, 12.0)[:, None],
        log_scaled(ops_per_group, 4.0)[:, None],
        (level / max(float(level.max(initial=0.0)), 1.0))[:, None],
        (np.log2(1.0 + in_deg) / 8.0)[:, None],
        (np.log2(1.0 + out_deg) / 8.0)[:, None],
        np.ones((n, 1)),
    ]
    out = np.zeros((rows, NUM_FEATURES), dtype=np.float32)
    out[:n] = np.clip(np.concatenate(columns, axis=1), 0.0, FEATURE_HIGH)
    return out


def score_batch(
    problem: PlacementProblem,
    assignments: np.ndarray,
    cache: dict[bytes, tuple[float, float, bool]] | None = None,
) -> np.ndarray:
    """``problem.score`` of each row of ``assignments`` (``[B, num_groups]`` device
    indices): the objective in seconds, with ColocRL's OOM penalty (``value × 10 + 100``).

    Identical rows are simulated once; ``cache`` (placement bytes → (score, step time,
    OOM)),
    when given, is read and filled so repeated placements across calls cost nothing.
    Every simulation counts one ``problem.evaluations``.
    """
    return score_and_step_batch(problem, assignments, cache)[0]


def score_and_step_batch(
    problem: PlacementProblem,
    assignments: np.ndarray,
    cache: dict[bytes, tuple[float, float, bool]] | None = None,
    *,
    per_op: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like :func:`score_batch`, also returning each plan's simulated step time and
    whether it ran out of memory. With ``per_op=True`` the rows are device-per-op plans
    (``[B, num_ops]``, as ``hrl`` makes) instead of device-per-group ones."""
    batch = np.ascontiguousarray(assignments, dtype=np.int64)
    width = problem.graph.num_ops if per_op else problem.num_groups
    evaluate = problem.evaluate_ops if per_op else problem.evaluate
    if batch.ndim != 2 or batch.shape[1] != width:
        raise ValueError(f"assignments must be [B, {width}] device indices, got {batch.shape}")
    if batch.size and (batch.min() < 0 or batch.max() >= problem.num_devices):
        raise ValueError(f"device indices must lie in 0..{problem.num_devices - 1}")
    memo: dict[bytes, tuple[float, float, bool]] = {} if cache is None else cache
    scores = np.empty(len(batch))
    steps = np.empty(len(batch))
    ooms = np.zeros(len(batch), dtype=bool)
    for i, row in enumerate(batch):
        key = row.tobytes()
        hit = memo.get(key)
        if hit is None:
            result = evaluate(row)
            hit = (problem.score(result), result.step_time_s, result.oom)
            memo[key] = hit
        scores[i], steps[i], ooms[i] = hit
    return scores, steps, ooms


STRUCTURE_NAMES: tuple[str, ...] = (
    "layer_position",
    *(f"layer_{f}{k}" for k in (1, 2, 4) for f in ("sin", "cos")),
    "topo_position",
    "pred_offset",
    "succ_offset",
)
"""Columns of :func:`structure_features`."""


def layer_key(module: str) -> str:
    """The layer an op belongs to: its module path cut to four components (so
    ``encoder.lstm.0.fw.gates`` and ``encoder.lstm.0.fw`` are one layer, and the two
    directions of a bidirectional LSTM are two).

    >>> layer_key("encoder.lstm.0.fw.gates"), layer_key("decoder.attention")
    ('encoder.lstm.0.fw', 'decoder.attention')
    """
    return ".".join(module.split(".")[:4])


def structure_features(problem: PlacementProblem) -> np.ndarray:
    """``[num_groups, len(STRUCTURE_NAMES)]`` float32: where each group sits in the model.

    ColocRL embeds each op's adjacency (the ops it reads and feeds) beside its type and
    shape, which is what lets its policy tell the same cell of two LSTM layers apart; the
    kind and cost columns of :func:`group_features` cannot. These columns carry it:

    * ``layer_position`` — the rank of the group's majority layer (:func:`layer_key` of its
      ops' modules, ops without a module ignored) among the model's layers ordered by first
      appearance in topological order, scaled to ``[0, 1]``; with ``sin``/``cos`` of
      ``π · k · position`` for k = 1, 2, 4 so that nearby layers are separable;
    * ``topo_position`` — the group's index in the group graph's topological order over
      the number of groups;
    * ``pred_offset`` / ``succ_offset`` — the mean topological position of its predecessor /
      successor groups minus its own (0 where it has none), so long-range edges (an encoder
      state feeding attention at every decoder step) stand out.

    Complexity: O(V + E).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> x = structure_features(p)
    >>> x.shape == (p.num_groups, len(STRUCTURE_NAMES)), bool(np.isfinite(x).all())
    (True, True)
    """
    n = problem.num_groups
    graph = problem.graph
    order = graph.arrays().topo_order
    layers: dict[str, int] = {}
    layer_of_op = np.full(graph.num_ops, -1, dtype=np.int64)
    for i in order.tolist():
        module = graph.ops[i].module
        if module:
            layer_of_op[i] = layers.setdefault(layer_key(module), len(layers))
    counts = np.zeros((n, max(len(layers), 1)))
    known = layer_of_op >= 0
    np.add.at(counts, (problem.group_of[known], layer_of_op[known]), 1.0)
    position = counts.argmax(axis=1) / max(len(layers) - 1, 1)
    columns = [position]
    for k in (1, 2, 4):
        columns += [np.sin(np.pi * k * position), np.cos(np.pi * k * position)]

    ga = problem.group_graph.arrays()
    topo = np.empty(n)
    topo[ga.topo_order] = np.arange(n) / max(n - 1, 1)

    def mean_offset(ptr: np.ndarray, idx: np.ndarray) -> np.ndarray:
        deg = np.diff(ptr)
        owner = np.repeat(np.arange(n), deg)
        total = np.bincount(owner, weights=topo[idx], minlength=n)
        return np.where(deg > 0, total / np.maximum(deg, 1) - topo, 0.0)

    columns += [topo, mean_offset(ga.pred_ptr, ga.pred_idx), mean_offset(ga.succ_ptr, ga.succ_idx)]
    return np.stack(columns, axis=1).astype(np.float32)
