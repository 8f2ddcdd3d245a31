"""The ``hrl`` placer: the hierarchical planner (a Grouper and a Placer trained jointly).

Mirhoseini, Goldie, Pham, Steiner, Le, Dean, "A Hierarchical Model for Device Placement",
ICLR 2018, §2: no hand-made grouping. A **Grouper** — a feed-forward network over per-op
features — puts every op of the graph into one of ``N`` groups (a softmax per op); a
**Placer** — a seq2seq LSTM with attention (:class:`meshplace.learn.policy.Seq2SeqPolicy`)
— reads one embedding per group and assigns each group a device. The plan is per op. Both
networks are trained together with REINFORCE on the simulated step time:

* ``log π = Σ_ops log p(group of op) + Σ_groups log p(device of group)``;
* reward ``R = −√score``, ``score = problem.score(sim)`` (the objective, with the OOM
  penalty ``value × 10 + 100``; the paper's ``failing_signal``);
* ``∇ ≈ 1/K Σₖ (Rₖ − b) ∇ log π(aₖ)``, ``b`` an exponential moving average of the batch's
  mean reward (decay 0.9), ``K`` (grouping, placement) pairs sampled per update, Adam,
  gradient norm clipped at 1.

**Op features** (:func:`op_features`, computed here from ``problem.graph``): the coarse op
kind (one-hot over :data:`meshplace.learn.features.KINDS`), the phase, ``log10(1 + x)/12``
of FLOPs, bytes accessed, output bytes and parameter bytes, ``log2(1 + d)/16`` of the first
output's first four dimensions and the number of outputs, ``log2(1 + degree)/8`` of in-
and out-degree, the op's longest-path depth over the deepest op's, and its *anchor*
(:func:`op_anchor`): where the forward op it belongs to lies in the model (a backward op's
``forward_op``, a parameter's or input's first consumer, an update op's producers), as a
rank in ``[0, 1]``; and its *layer* (:func:`op_layer`): the rank of its module path's
layer (:func:`meshplace.learn.features.layer_key`, as ``rl``'s structure features) in
order of appearance. Both raw and as sinusoidal encodings (Vaswani et al. 2017) at
:data:`ANCHOR_FREQUENCIES` and :data:`LAYER_FREQUENCIES` × π, weighted by
:data:`ANCHOR_WEIGHT` and :data:`LAYER_WEIGHT`, so that one layer of the network can cut
the model into bands of equal op count, or into its layers. The paper embeds the op type,
output shapes and the topological indices of adjacent ops; anchor and layer play the part
of those indices (TensorFlow op names carry the layer as a name scope; the paper does not
feed names to the Grouper). On NMT the layer columns matter: without them (and with an
entropy bonus of 0.1) the best plans after a 60 s budget took 0.518 s (2-layer) and
0.843 s (4-layer), against 0.483 s and 0.722 s with them.

**Group embeddings** (:func:`group_embeddings`, per sampled grouping, as in the paper's
released code ``tensorflow/python/grappler/hierarchical_controller.py``): the group's
out- and in-edge counts to every other group (``2N`` columns, each row over its maximum
+ 1), the share of its ops of each kind and phase, log FLOPs, output bytes, parameter bytes
and op count, and its ops' mean anchor, depth and layer. The Placer reads the groups ordered by
mean anchor, empty groups last (:func:`placer_order`; ColocRL reads its groups in
topological order). No gradient flows through the embeddings: the Grouper learns only
through its own log-probability term, as in the paper.

Hyper-parameters (:class:`HRLConfig`; the released code's defaults in brackets):

* ``N = min(256, 20 × devices)`` groups [the same]; Grouper hidden size 64 [64], tanh [no
  non-linearity between the two matrices];
* Grouper output layer initialised at 100 × PyTorch's default [Glorot uniform]: with the
  default, every op's group is near-uniform over ``N``, the first plans scatter ops over
  all devices (2.5 s steps on NMT 2-layer where one GPU takes 0.78 s) and REINFORCE drifts
  towards one device (best 0.71 s after 185 updates, greedy plan on one GPU); scaled up,
  ops with similar features start in the same group and the first plans are coherent;
* Placer hidden size 64 [512, bi-LSTM encoder]: smaller and uni-directional to run on CPU;
* ``K = 16`` (grouping, placement) samples per update [one per controller];
* Adam, learning rate 3e-3 [0.1, decayed ×0.95 every 50 steps after 400]: 0.1 collapsed
  to a single-device greedy policy within a few updates here (best 0.62 s on NMT 2-layer);
* no entropy bonus [none; noise of 0.5 × the logits' norm for the first 750 steps];
  ``entropy_weight`` adds ``w × (mean per-op Grouper entropy + mean per-group Placer
  entropy)``, but 0.1 did not help on NMT (mean best step over seeds 0–2 at a 60 s budget:
  2-layer 0.485 s vs 0.479 s without, 4-layer 0.760 s vs 0.744 s);
* baseline decay 0.9 [0.9]; gradient norm clip 1 [1]; reward ``−√score`` [``sqrt``].

**Budget, determinism, result, checkpoints**: exactly as :mod:`meshplace.learn.rl` — the
budget becomes a fixed number of updates (:func:`planned_updates`: a measured policy cost
per op and per group plus ``K`` simulations at 3 M ops/s, filling 60 % of the budget), a
hard stop at 97 % of it in training seconds across resumed sessions
(``stats["stopped_by"] == "deadline"``), one torch thread, the best plan
ever sampled or the greedy decode of the final policy (argmax group per op, then the
Placer's greedy devices), a learning curve with one point per update, and checkpoints
written by :class:`meshplace.learn.training.TrainingRun`, from which ``resume=True`` ends
with the plan, best score and curve of an uninterrupted run.

Complexity per update: Grouper O(V·F·H_g + V·N) (one matmul over all ops), K group
embeddings O(K·(V + E + N²)), Placer O(K·N·(H² + N·H)), K simulations O(K·(V + E) log V).

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> out = train_hrl(p, budget_s=5.0, seed=0, updates=2)
>>> out.op_devices.shape == (p.graph.num_ops,), out.stats["updates"], out.stats["groups"]
(True, 2, 60)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from meshplace.learn.features import KINDS, kind_index, layer_key, score_and_step_batch
from meshplace.learn.policy import Seq2SeqPolicy
from meshplace.learn.training import TrainingRun
from meshplace.placers.base import (
    SIMULATED_OPS_PER_SECOND,
    OpAssignment,
    PlacementProblem,
    PlacerError,
    PlacerOptions,
    ProgressFn,
    check_budget,
    now,
    register,
)

UPDATE_OVERHEAD_S = 0.02
GROUPER_S_PER_OP = 8.0e-6  # per op per update, 16 samples: Grouper, sampling, embeddings, grad
PLACER_S_PER_GROUP = 8.0e-4  # per group per update, 16 samples, hidden 64, one thread
BUDGET_SHARE = 0.6
DEADLINE_SHARE = 0.97
CHECKPOINT_FORMAT = "meshplace.hrl-checkpoint v1"
ANCHOR_FREQUENCIES = (0.5, 1.0, 2.0, 4.0)
ANCHOR_WEIGHT = 4.0
LAYER_FREQUENCIES = (1.0, 2.0, 4.0, 8.0)
LAYER_WEIGHT = 4.0
SHAPE_DIMS = 4
_PHASES = 3
_COUNT_COLUMN = -4  # group_embeddings: log op count, mean anchor, mean depth, mean layer
_ANCHOR_COLUMN = -3


@dataclass(frozen=True)
class HRLConfig:
    """Hyper-parameters of :func:`train_hrl` (see the module docstring for sources).

    ``groups=None`` means the paper's ``min(256, 20 × devices)``.
    """

    groups: int | None = None
    grouper_hidden: int = 64
    hidden: int = 64
    samples: int = 16
    learning_rate: float = 3e-3
    baseline_decay: float = 0.9
    max_grad_norm: float = 1.0
    grouper_init_scale: float = 100.0
    entropy_weight: float = 0.0
    checkpoint_every: int = 20

    def num_groups(self, num_devices: int) -> int:
        """``N``: the configured count, or ``min(256, 20 × devices)``."""
        n = self.groups if self.groups is not None else min(256, 20 * num_devices)
        if n < 1:
            raise PlacerError(f"the hierarchical planner needs at least one group, got {n}")
        return int(n)


@dataclass
class HRLResult:
    """What :func:`train_hrl` returns: the best op-level plan and its stats."""

    op_devices: np.ndarray
    best_score_s: float
    stats: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ op features
def _depths(graph_arrays: Any, n: int) -> np.ndarray:
    """Longest-path depth of every op (0 at the sources)."""
    depth = np.zeros(n, dtype=np.int64)
    ptr, idx = graph_arrays.pred_ptr, graph_arrays.pred_idx
    for v in graph_arrays.topo_order.tolist():
        lo, hi = ptr[v], ptr[v + 1]
        if hi > lo:
            depth[v] = int(depth[idx[lo:hi]].max()) + 1
    return depth


def op_anchor(problem: PlacementProblem) -> tuple[np.ndarray, np.ndarray]:
    """Each op's depth over the deepest op's, and its anchor: where the forward op it
    belongs to lies in the model, as a rank in ``[0, 1]``.

    A forward op anchors at its own depth; a backward op at its ``forward_op``'s depth if
    it has one; a parameter or input at its first forward consumer's depth; everything else
    (update ops, backward ops without a link) at the mean anchor of its anchored producers,
    else consumers, else its own mirrored depth. The anchor returned is the op's rank among
    all ops' anchor depths over ``V − 1`` (ties share their mean rank), so equal-width
    anchor bands hold equal numbers of ops. O(V log V + E).
    """
    graph = problem.graph
    a = graph.arrays()
    n = graph.num_ops
    depth = _depths(a, n).astype(np.float64)
    depth /= max(float(depth.max(initial=0.0)), 1.0)
    phase = a.phase.astype(np.int64)
    anchor = np.full(n, np.nan)
    forward = phase == 0
    anchor[forward] = depth[forward]
    for i, op in enumerate(graph.ops):
        if op.kind in ("parameter", "input", "buffer"):
            succ = a.succ_idx[a.succ_ptr[i] : a.succ_ptr[i + 1]]
            fwd = succ[forward[succ]]
            if len(fwd):
                anchor[i] = depth[fwd].min()
        elif op.phase == "backward" and op.forward_op is not None and op.forward_op in graph:
            j = graph.index(op.forward_op)
            if forward[j]:
                anchor[i] = depth[j]
    for _ in range(3):  # update ops and unlinked backward ops: from anchored neighbours
        missing = np.flatnonzero(np.isnan(anchor))
        if not len(missing):
            break
        for i in missing.tolist():
            for ptr, idx in ((a.pred_ptr, a.pred_idx), (a.succ_ptr, a.succ_idx)):
                vals = anchor[idx[ptr[i] : ptr[i + 1]]]
                vals = vals[~np.isnan(vals)]
                if len(vals):
                    anchor[i] = float(vals.mean())
                    break
    rest = np.isnan(anchor)
    anchor[rest] = 1.0 - depth[rest]
    ranked = np.sort(anchor)
    mid_rank = (np.searchsorted(ranked, anchor) + np.searchsorted(ranked, anchor, "right") - 1) / 2
    return depth, mid_rank / max(n - 1, 1)


def op_layer(problem: PlacementProblem) -> np.ndarray:
    """Each op's layer position in ``[0, 1]``: the rank of its layer
    (:func:`meshplace.learn.features.layer_key` of its module path, the same key ``rl``'s
    structure features use) among the model's layers in order of first appearance along
    the topological order, over the number of layers − 1.

    An op without a module takes its ``forward_op``'s layer, else the mean of its producers'
    (else consumers'), else 0.5; a graph without module paths gets 0.5 everywhere. O(V + E).
    """
    graph = problem.graph
    a = graph.arrays()
    n = graph.num_ops
    rank: dict[str, int] = {}
    layer = np.full(n, np.nan)
    for i in a.topo_order.tolist():
        module = graph.ops[i].module
        if module:
            layer[i] = rank.setdefault(layer_key(module), len(rank))
    layer /= max(len(rank) - 1, 1)
    linked = [
        i
        for i, op in enumerate(graph.ops)
        if np.isnan(layer[i]) and op.forward_op is not None and op.forward_op in graph
    ]
    for i in linked:
        layer[i] = layer[graph.index(graph.ops[i].forward_op)]
    for _ in range(3):
        missing = np.flatnonzero(np.isnan(layer))
        if not len(missing):
            break
        for i in missing.tolist():
            for ptr, idx in ((a.pred_ptr, a.pred_idx), (a.succ_ptr, a.succ_idx)):
                vals = layer[idx[ptr[i] : ptr[i + 1]]]
                vals = vals[~np.isnan(vals)]
                if len(vals):
                    layer[i] = float(vals.mean())
                    break
    for i in linked:  # a forward op filled from its neighbours passes its layer on
        layer[i] = layer[graph.index(graph.ops[i].forward_op)]
    return np.nan_to_num(layer, nan=0.5)


def op_feature_names() -> tuple[str, ...]:
    """Column names of :func:`op_features`."""
    sinus = [
        f"{fn}({x}*{f:g}pi)"
        for x, freqs in (("anchor", ANCHOR_FREQUENCIES), ("layer", LAYER_FREQUENCIES))
        for f in freqs
        for fn in ("sin", "cos")
    ]
    return (
        *(f"kind:{k}" for k in KINDS),
        "phase:forward",
        "phase:backward",
        "phase:update",
        "log_flops",
        "log_bytes",
        "log_output_bytes",
        "log_param_bytes",
        *(f"log_dim{d}" for d in range(SHAPE_DIMS)),
        "log_outputs",
        "log_in_degree",
        "log_out_degree",
        "depth",
        "anchor",
        "layer",
        *sinus,
    )


def op_features(problem: PlacementProblem) -> np.ndarray:
    """``[V, len(op_feature_names())]`` float32 features of every op (module docstring)."""
    graph = problem.graph
    a = graph.arrays()
    n = graph.num_ops
    kinds = np.fromiter((kind_index(o.kind) for o in graph.ops), dtype=np.int64, count=n)
    shapes = np.zeros((n, SHAPE_DIMS))
    outputs = np.zeros(n)
    for i, op in enumerate(graph.ops):
        outputs[i] = len(op.output_shapes)
        if op.output_shapes:
            dims = op.output_shapes[0][:SHAPE_DIMS]
            shapes[i, : len(dims)] = dims
    depth, anchor = op_anchor(problem)

    def log10s(x: np.ndarray) -> np.ndarray:
        return np.log10(1.0 + np.maximum(x, 0.0)) / 12.0

    layer = op_layer(problem)

    def sinusoids(x: np.ndarray, freqs: tuple[float, ...], weight: float) -> np.ndarray:
        angles = np.pi * x[:, None] * np.asarray(freqs)[None, :]
        return weight * np.stack([np.sin(angles), np.cos(angles)], axis=2).reshape(n, -1)

    columns = [
        np.eye(len(KINDS))[kinds],
        np.eye(_PHASES)[a.phase.astype(np.int64)],
        log10s(a.flops)[:, None],
        log10s(a.bytes_accessed)[:, None],
        log10s(a.output_bytes)[:, None],
        log10s(a.param_bytes)[:, None],
        np.log2(1.0 + np.maximum(shapes, 0.0)) / 16.0,
        (np.log2(1.0 + outputs) / 4.0)[:, None],
        (np.log2(1.0 + np.diff(a.pred_ptr)) / 8.0)[:, None],
        (np.log2(1.0 + np.diff(a.succ_ptr)) / 8.0)[:, None],
        depth[:, None],
        anchor[:, None],
        layer[:, None],
        sinusoids(anchor, ANCHOR_FREQUENCIES, ANCHOR_WEIGHT),
        sinusoids(layer, LAYER_FREQUENCIES, LAYER_WEIGHT),
    ]
    return np.concatenate(columns, axis=1).astype(np.float32)


# ------------------------------------------------------------- group embeddings
class _OpTable:
    """Per-op arrays the group embeddings aggregate (computed once per problem)."""

    def __init__(self, problem: PlacementProblem, features: np.ndarray) -> None:
        graph = problem.graph
        a = graph.arrays()
        self.n_ops = graph.num_ops
        self.kinds = np.fromiter(
            (kind_index(o.kind) for o in graph.ops), dtype=np.int64, count=self.n_ops
        )
        self.phase = a.phase.astype(np.int64)
        self.flops = a.flops
        self.output_bytes = a.output_bytes
        self.param_bytes = a.param_bytes
        names = op_feature_names()
        self.depth = features[:, names.index("depth")].astype(np.float64)
        self.anchor = features[:, names.index("anchor")].astype(np.float64)
        self.layer = features[:, names.index("layer")].astype(np.float64)
        self.src = a.edge_src
        self.dst = a.edge_dst


def group_embedding_size(num_groups: int) -> int:
    """Width of :func:`group_embeddings`' rows for ``num_groups`` groups."""
    return 2 * num_groups + len(KINDS) + _PHASES + 7


def group_embeddings(table: _OpTable, groupings: np.ndarray, num_groups: int) -> np.ndarray:
    """``[K, N, group_embedding_size(N)]`` float32 embeddings of ``K`` sampled groupings
    (``groupings[k, op]`` = group of ``op``): see the module docstring. O(K·(V + E + N²))."""
    k_count = groupings.shape[0]
    n = num_groups
    offsets = (np.arange(k_count, dtype=np.int64) * n)[:, None]
    flat = (groupings + offsets).ravel()  # sample-major group id per (sample, op)
    size = k_count * n

    def per_group(weights: np.ndarray | None) -> np.ndarray:
        w = None if weights is None else np.broadcast_to(weights, groupings.shape).ravel()
        return np.bincount(flat, weights=w, minlength=size).reshape(k_count, n)

    count = per_group(None)
    denom = np.maximum(count, 1.0)[..., None]
    nk = len(KINDS)
    kind_hist = np.bincount(
        (flat * nk + np.broadcast_to(table.kinds, groupings.shape).ravel()), minlength=size * nk
    ).reshape(k_count, n, nk)
    phase_hist = np.bincount(
        (flat * _PHASES + np.broadcast_to(table.phase, groupings.shape).ravel()),
        minlength=size * _PHASES,
    ).reshape(k_count, n, _PHASES)
    gs, gd = groupings[:, table.src], groupings[:, table.dst]
    dag = np.bincount(((gs + offsets) * n + gd).ravel(), minlength=size * n).reshape(k_count, n, n)
    adjacency = np.concatenate([dag, dag.transpose(0, 2, 1)], axis=2).astype(np.float64)
    adjacency /= adjacency.max(axis=2, keepdims=True) + 1.0

    def log10s(x: np.ndarray, scale: float) -> np.ndarray:
        return (np.log10(1.0 + x) / scale)[..., None]

    scalars = np.concatenate(
        [
            log10s(per_group(table.flops), 12.0),
            log10s(per_group(table.output_bytes), 12.0),
            log10s(per_group(table.param_bytes), 12.0),
            log10s(count, 4.0),
            per_group(table.anchor)[..., None] / denom,
            per_group(table.depth)[..., None] / denom,
            per_group(table.layer)[..., None] / denom,
        ],
        axis=2,
    )
    out = np.concatenate([adjacency, kind_hist / denom, phase_hist / denom, scalars], axis=2)
    return out.astype(np.float32)


def placer_order(embeddings: np.ndarray) -> np.ndarray:
    """``[K, N]``: the order in which the Placer reads each grouping's groups — by their ops'
    mean anchor (along the model, as ColocRL reads groups in topological order), empty
    groups last."""
    count = embeddings[..., _COUNT_COLUMN]
    key = np.where(count > 0, embeddings[..., _ANCHOR_COLUMN], np.inf)
    return np.argsort(key, axis=1, kind="stable")


# ------------------------------------------------------------------------ model
class Grouper(nn.Module):
    """Feed-forward Grouper: op features → hidden (tanh) → logits over ``num_groups``."""

    def __init__(self, n_features: int, num_groups: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_features, hidden), nn.Tanh(), nn.Linear(hidden, num_groups)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[V, num_groups]`` log-probabilities (one matmul over all ops)."""
        return torch.log_softmax(self.net(features), dim=-1)


class BatchedPlacer(Seq2SeqPolicy):
    """:class:`Seq2SeqPolicy` whose batch rows each read their *own* group embeddings
    (``[B, G, F]``), since every sampled grouping has different groups.

    Same modules, weights, gate order and multiplicative attention as the parent; the
    parent's :meth:`Seq2SeqPolicy.greedy` decodes one grouping's embeddings.
    """

    def _encode_batch(
        self, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        enc, state = self.encoder(self.embed(features))  # [B, G, H]
        return enc, self.attend(enc), state

    @torch.no_grad()
    def sample_batch(self, features: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``[B, G]`` devices, row ``b`` sampled autoregressively given ``features[b]``."""
        enc, keys, (h0, c0) = self._encode_batch(features)
        batch, groups, hid = enc.shape
        w_ih = self.decoder.weight_ih_l0
        device_gates = self.device_embed.weight @ w_ih[:, :hid].T  # [D + 1, 4H]
        enc_gates = enc @ w_ih[:, hid:].T + self.decoder.bias_ih_l0 + self.decoder.bias_hh_l0
        w_hh_t = self.decoder.weight_hh_l0.T.contiguous()
        keys_t = keys.transpose(1, 2).contiguous()  # [B, H, G]
        w_out_t = self.out.weight.T.contiguous()
        h, c = h0[0].contiguous(), c0[0].contiguous()
        prev = torch.full((batch,), self.n_devices, dtype=torch.long)
        out = torch.empty((batch, groups), dtype=torch.long)
        for t in range(groups):
            gates = torch.addmm(device_gates[prev] + enc_gates[:, t], h, w_hh_t)
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            weights = torch.softmax(torch.bmm(h[:, None, :], keys_t), dim=-1)  # [B, 1, G]
            context = torch.bmm(weights, enc)[:, 0]
            logits = torch.addmm(self.out.bias, torch.cat([h, context], dim=1), w_out_t)
            prev = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
            out[:, t] = prev
        return out

    def log_prob_batch(
        self, features: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B]`` log-probabilities of ``actions[b]`` given ``features[b]``, and the mean
        entropy per decision along those rows (teacher forcing, with grad)."""
        enc, keys, (h, c) = self._encode_batch(features)
        batch = actions.shape[0]
        start = torch.full((batch, 1), self.n_devices, dtype=torch.long)
        prev = torch.cat([start, actions[:, :-1]], dim=1)
        dec, _ = self.decoder(torch.cat([self.device_embed(prev), enc], dim=-1), (h, c))
        weights = torch.softmax(dec @ keys.transpose(1, 2), dim=-1)  # [B, G, G]
        logits = self.out(torch.cat([dec, weights @ enc], dim=-1))
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1).mean()
        return logp.gather(-1, actions[..., None])[..., 0].sum(dim=1), entropy


class HierarchicalPolicy(nn.Module):
    """The Grouper and the Placer, one module so one optimizer and checkpoint hold both."""

    def __init__(
        self, n_op_features: int, num_groups: int, n_devices: int, config: HRLConfig
    ) -> None:
        super().__init__()
        self.num_groups = num_groups
        self.grouper = Grouper(n_op_features, num_groups, config.grouper_hidden)
        with torch.no_grad():
            self.grouper.net[-1].weight.mul_(config.grouper_init_scale)
        self.placer = BatchedPlacer(group_embedding_size(num_groups), n_devices, config.hidden)


def sample_groups(
    log_probs: torch.Tensor, samples: int, generator: torch.Generator
) -> torch.Tensor:
    """``[samples, V]`` groups drawn from the per-op distributions ``exp(log_probs)``
    (``[V, N]``) by inverse-CDF sampling: one sorted search over all ops per sample."""
    with torch.no_grad():
        cdf = torch.cumsum(log_probs.exp(), dim=1)  # [V, N]
        cdf[:, -1] = float("inf")  # rounding never lets a draw fall past the last group
        u = torch.rand((log_probs.shape[0], samples), generator=generator, dtype=cdf.dtype)
        groups = torch.searchsorted(cdf.contiguous(), u.contiguous(), right=True)
    return groups.T.contiguous()


# ---------------------------------------------------------------------- scoring
def score_ops_batch(
    problem: PlacementProblem, op_plans: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``problem.score``, step time and OOM flag of each row of ``op_plans`` (``[B, V]``
    device per op): :func:`meshplace.learn.features.score_and_step_batch` on op-level
    plans (identical rows simulated once, each simulation one ``problem.evaluations``)."""
    return score_and_step_batch(problem, op_plans, per_op=True)


def planned_updates(problem: PlacementProblem, budget_s: float, config: HRLConfig) -> int:
    """The number of joint updates ``budget_s`` buys on ``problem`` (at least 1).

    >>> from meshplace.graph.sources import workload_graph
    >>> from meshplace.hardware import load_cluster
    >>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
    >>> planned_updates(p, 10.0, HRLConfig()) > planned_updates(p, 1.0, HRLConfig())
    True
    """
    v = problem.graph.num_ops
    n = config.num_groups(problem.num_devices)
    k = config.samples / 16
    per_update = (
        UPDATE_OVERHEAD_S
        + GROUPER_S_PER_OP * v * k
        + PLACER_S_PER_GROUP * n * k * (config.hidden / 64)
        + config.samples * v / SIMULATED_OPS_PER_SECOND
    )
    return max(1, int(BUDGET_SHARE * budget_s / per_update))


def _fingerprint(problem: PlacementProblem, seed: int, updates: int, config: HRLConfig) -> dict:
    return {
        "graph": problem.graph.name,
        "ops": problem.graph.num_ops,
        "edges": problem.graph.num_edges,
        "devices": problem.num_devices,
        "objective": problem.objective,
        "seed": seed,
        "updates": updates,
        "config": asdict(config),
    }


# --------------------------------------------------------------------- training
def train_hrl(
    problem: PlacementProblem,
    budget_s: float,
    seed: int,
    *,
    config: HRLConfig | None = None,
    updates: int | None = None,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: ProgressFn | None = None,
) -> HRLResult:
    """Train the hierarchical planner on ``problem`` and return the best op placement seen.

    Args:
        problem: the placement problem (its ``graph``; its co-location groups are unused).
        budget_s: seconds; fixes the number of updates (:func:`planned_updates`) unless
            ``updates`` is given, and is enforced as a hard wall-clock stop.
        seed: seeds both networks' initial weights and the sampling generator.
        config: hyper-parameters (:class:`HRLConfig`).
        updates: train for exactly this many updates instead of the budget's number.
        checkpoint: file to save training state to every ``config.checkpoint_every``
            updates and at the end.
        resume: continue from ``checkpoint`` if it exists (same problem, seed, updates
            and config, else :class:`PlacerError`).
        stop_after: stop (after checkpointing) once this session has done this many
            updates — a deliberate interruption, for tests of resuming.
        progress: called after every update with ``(done, total, best step time)``.

    Returns:
        :class:`HRLResult` with the best op-level placement and stats (``evaluations``,
        ``best_score_s``, ``best_step_time_s``, ``updates``, ``planned_updates``,
        ``stopped_by``, ``stopped_at_deadline``, ``learning_curve``, hyper-parameters...).
    """
    check_budget(budget_s)
    config = config or HRLConfig()
    start = now()
    total = int(updates) if updates is not None else planned_updates(problem, budget_s, config)
    n_groups = config.num_groups(problem.num_devices)
    path = Path(checkpoint) if checkpoint is not None else None
    fingerprint = _fingerprint(problem, seed, total, config)
    n_ops = problem.graph.num_ops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        feats_np = op_features(problem)
        table = _OpTable(problem, feats_np)
        feats = torch.from_numpy(feats_np)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            policy = HierarchicalPolicy(feats.shape[1], n_groups, problem.num_devices, config)
        optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)
        generator = torch.Generator().manual_seed(seed)
        stateful = {"policy": policy, "optimizer": optimizer, "generator": generator}
        run = TrainingRun(
            problem,
            total=total,
            fingerprint=fingerprint,
            fmt=CHECKPOINT_FORMAT,
            best=np.zeros(n_ops, dtype=np.int64),
            path=path,
            checkpoint_every=config.checkpoint_every,
            progress=progress,
            start=start,
            deadline_s=DEADLINE_SHARE * budget_s,
            stop_after=stop_after,
        )
        baseline: float | None = None
        if resume:
            scalars = run.resume(stateful)
            if scalars is not None:
                baseline = scalars["baseline"]

        while run.keep_going():
            log_groups = policy.grouper(feats)  # [V, N]
            groups = sample_groups(log_groups, config.samples, generator)  # [K, V]
            groups_np = groups.numpy()
            embeds_np = group_embeddings(table, groups_np, n_groups)
            order = placer_order(embeds_np)  # [K, N]: the Placer's t-th group
            embeds = torch.from_numpy(np.take_along_axis(embeds_np, order[..., None], axis=1))
            devices = policy.placer.sample_batch(embeds, generator)  # [K, N], Placer order
            by_group = np.empty_like(order)
            np.put_along_axis(by_group, order, devices.numpy(), axis=1)
            plans = np.take_along_axis(by_group, groups_np, axis=1)  # [K, V]
            # Repeats within a batch are simulated once; no cache across updates, so the
            # evaluation count (the learning curve's x axis) survives a resume exactly.
            scores, steps, _ = run.count(lambda p=plans: score_ops_batch(problem, p))
            run.offer(plans, scores, steps)
            rewards = -np.sqrt(scores)
            mean_reward = float(rewards.mean())
            if baseline is None:
                baseline = mean_reward
            advantage = torch.from_numpy(rewards - baseline).float()
            logp_groups = log_groups.gather(1, groups.T).sum(dim=0)  # [K]
            logp_devices, placer_entropy = policy.placer.log_prob_batch(embeds, devices)
            grouper_entropy = -(log_groups.exp() * log_groups).sum(dim=1).mean()
            loss = -(advantage * (logp_groups + logp_devices)).mean() - config.entropy_weight * (
                grouper_entropy + placer_entropy
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
            optimizer.step()
            baseline = config.baseline_decay * baseline + (1 - config.baseline_decay) * mean_reward
            run.finish_update(stateful, {"baseline": baseline})
        run.end_session(stateful, {"baseline": baseline})

        greedy_score = None
        if run.finished:
            greedy = greedy_plan(policy, feats, table)[None, :]
            g_score, g_step, _ = run.count(lambda: score_ops_batch(problem, greedy))
            greedy_score = float(g_score[0])
            run.offer(greedy, g_score, g_step)
    finally:
        torch.set_num_threads(threads)

    stats: dict[str, Any] = {
        **run.stats(),
        "greedy_score_s": greedy_score,
        "groups": n_groups,
        "grouper_hidden": config.grouper_hidden,
        "hidden": config.hidden,
        "samples_per_update": config.samples,
        "learning_rate": config.learning_rate,
        "baseline_decay": config.baseline_decay,
        "baseline": baseline,
        "devices_used": len(np.unique(run.best)),
    }
    return HRLResult(run.best, run.best_score, stats)


def greedy_plan(policy: HierarchicalPolicy, feats: torch.Tensor, table: _OpTable) -> np.ndarray:
    """The policy's most likely plan: each op's argmax group, then the Placer's greedy
    devices for that grouping's embeddings ([V] device per op)."""
    with torch.no_grad():
        groups = policy.grouper(feats).argmax(dim=1).numpy()[None, :]
        embeds = group_embeddings(table, groups, policy.num_groups)
        order = placer_order(embeds)[0]
        devices = policy.placer.greedy(torch.from_numpy(embeds[0][order])).numpy()
    by_group = np.empty_like(order)
    by_group[order] = devices
    return by_group[groups[0]]


@register(
    "hrl",
    family="learned",
    description="hierarchical planner: a feed-forward Grouper puts every op into one of N "
    "groups, a seq2seq LSTM Placer assigns groups to devices; trained jointly by REINFORCE",
    source="Mirhoseini et al., A Hierarchical Model for Device Placement, ICLR 2018, §2",
    uses_budget=True,
    takes_options=True,
)
def place_hrl(
    problem: PlacementProblem, budget_s: float, seed: int, options: PlacerOptions
) -> tuple[OpAssignment, dict[str, Any]]:
    out = train_hrl(
        problem,
        budget_s,
        seed,
        checkpoint=options.checkpoint("hrl"),
        resume=options.resume,
        progress=options.progress,
    )
    return OpAssignment(out.op_devices), out.stats
