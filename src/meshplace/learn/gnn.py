"""The ``gnn`` placer: a pretrained graph policy that places unseen graphs zero-shot.

A graph neural network reads the co-location-group DAG of any graph and the devices of any
cluster of 2–8 (possibly heterogeneous) devices, and emits a device per group. It is
trained once with PPO across a family of graphs and clusters
(:mod:`meshplace.learn.train_gnn`); the weights ship in the package
(``learn/weights/gnn.pt``). Sources followed:

* **Placeto** (Addanki et al., NeurIPS 2019, §3): graph embeddings by message passing
  over the DAG in both directions (parent → child and child → parent aggregations), so
  one set of weights generalises to graphs it never saw;
* **GDP** (Zhou et al., "GDP: Generalized Device Placement for Dataflow Graphs", 2019,
  §3–4): a graph encoder trained with PPO over a family of graphs, a batch of placements
  sampled per graph, zero-shot placement of held-out graphs and fine-tuning on one graph;
* the **device side** follows the list schedulers' view of a placement (HEFT, Topcuoglu
  et al., IEEE TPDS 2002, §4.1): groups are decoded in topological order while a per-sample
  state tracks each device's load, ready time and memory, and the policy scores each
  device from the group's embedding, the device's embedding, a graph context and those
  state features (earliest finish time if placed there, transfer-ready time, bytes already
  on that device, memory after placing). Devices enter only through features (speed for
  this graph relative to the fastest, memory, is-CPU, bandwidth to the others), so the
  logits are equivariant to device order and any device count works.

Architecture (:class:`GNNPolicy`, hidden ``H``)::

    h⁰_g = ReLU(W_in x_g)                     x_g: group_features ⊕ cluster-aware features
    hʳ⁺¹_g = LN(hʳ_g + ReLU(W_u[hʳ_g ⊕ mean_{p→g} ReLU(W_f[hʳ_p ⊕ e_pg])
                                 ⊕ mean_{g→s} ReLU(W_b[hʳ_s ⊕ e_gs])]))   (R rounds)
    u_d = MLP(y_d)                            y_d: device features
    c = W_c[mean_g h_g ⊕ max_g h_g ⊕ mean_d u_d ⊕ z]   z: graph scalars
    logit(g, d) = w₃ · ReLU(W₂ ReLU(A h_g + B u_d + C c + D s_{g,d})) + w_p · s_{g,d}
                                              s: decoding state (10 features)

``w_p`` is a linear path initialised as a soft HEFT rule (−8 on the log relative
earliest-finish-time gap, +1 on "earliest finish here", −2 on "memory overflows"), so PPO
starts from a list scheduler rather than from a uniform policy.

Invalid choices are masked: a device whose memory (``problem.group_memory`` summed) would
overflow while another still has room. Decoding is sequential (topological), so sampling
``K`` placements costs ``G`` small vectorised steps; scoring sampled placements with
gradients (PPO) is one batched pass, because the state features do not depend on the
weights and are recorded while sampling.

**Zero-shot** (:func:`zero_shot`): the greedy decode plus ``ZERO_SHOT_SAMPLES − 1``
sampled placements, each simulated once; the best is returned. The placer does this twice,
on the problem's groups and on a grouping up to ``FINE_GROUPS_FACTOR`` (4) times finer, as
``anneal`` walks both (coarse groups cut from a topological order lump parallel branches,
such as Inception's towers, together), and keeps the better (``stats["samples"]``,
``stats["granularities"]``).
**Fine-tuning** (``--finetune SECONDS``): PPO on this one graph (at the grouping that won
zero-shot) from the pretrained weights; the budget becomes a fixed number of updates
(like ``rl``), the result is the best plan seen (never worse than zero-shot), with
checkpoints and exact resume.

Complexity: encoding O(R · (G + E_g) · H²); decoding K placements O(G · K · (P·D + D·H²))
for P predecessors per group; plus one simulation per distinct placement,
O((V + E) log V).

Example
-------
>>> from meshplace.graph.sources import workload_graph
>>> from meshplace.hardware import load_cluster
>>> from meshplace.placers.base import PlacementProblem
>>> p = PlacementProblem.build(workload_graph("dmcca"), load_cluster("colocrl-2gpu"))
>>> policy = GNNPolicy(GNNConfig(hidden=16, rounds=1))
>>> out = zero_shot(p, policy, seed=0, samples=4)
>>> out.group_devices.shape == (p.num_groups,), out.stats["samples"]
(True, 4)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numba import njit
from torch import nn

from meshplace.graph.groups import group_ops
from meshplace.learn.features import NUM_FEATURES, group_features
from meshplace.learn.training import TrainingRun, save_checkpoint
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

WEIGHTS_FORMAT = "meshplace.gnn-weights v1"
CHECKPOINT_FORMAT = "meshplace.gnn-checkpoint v1"
DEFAULT_WEIGHTS = Path(__file__).parent / "weights" / "gnn.pt"
ZERO_SHOT_SAMPLES = 32  # per grouping (the problem's and a finer one)
FINE_GROUPS_FACTOR = 4
ZERO_SHOT_WORK = 1_000_000  # samples x groups x devices at most
EXTRA_NODE_FEATURES = 6
NODE_FEATURES = NUM_FEATURES + EXTRA_NODE_FEATURES
EDGE_FEATURES = 2
DEVICE_FEATURES = 9
GRAPH_FEATURES = 4
STATE_FEATURES = 10
FEATURE_CLIP = 4.0

# Fine-tuning budget -> updates (measured on one CPU thread, see docs/learn.md).
UPDATE_OVERHEAD_S = 0.01
DECODE_S_PER_GROUP = 1.5e-4  # a decoding step for 16 samples on 5 devices
PPO_S_PER_GROUP_PASS = 1.2e-4  # a batched log-prob pass: per group, 16 samples, 5 devices
BUDGET_SHARE = 0.6
DEADLINE_SHARE = 0.97


@dataclass(frozen=True)
class GNNConfig:
    """Architecture of :class:`GNNPolicy`."""

    hidden: int = 64
    rounds: int = 3


@dataclass(frozen=True)
class PPOConfig:
    """PPO hyper-parameters: clip 0.2 (Schulman et al. 2017, §6.1 and Table 3), entropy
    bonus 0.01 (their Table 5), gradient-norm clip 0.5 (OpenAI baselines' PPO2 default);
    2 epochs and learning rate 1e-3 are our choices for a short CPU training (see
    docs/learn.md). GDP (Zhou et al. 2019) trains its graph policy with PPO too."""

    samples: int = 16
    epochs: int = 2
    clip: float = 0.2
    learning_rate: float = 1e-3
    entropy: float = 0.01
    max_grad_norm: float = 0.5
    checkpoint_every: int = 10


# ---------------------------------------------------------------- problem inputs
@dataclass
class ProblemInputs:
    """Everything the policy reads about one problem, computed once (numpy + torch)."""

    node_x: torch.Tensor  # [G, NODE_FEATURES]
    edge_src: torch.Tensor  # [E] long
    edge_dst: torch.Tensor  # [E] long
    edge_x: torch.Tensor  # [E, EDGE_FEATURES]
    device_x: torch.Tensor  # [D, DEVICE_FEATURES]
    graph_x: torch.Tensor  # [GRAPH_FEATURES]
    order: np.ndarray  # topological order of the groups
    pred_ptr: np.ndarray  # CSR predecessors of each group in the group graph
    pred_idx: np.ndarray
    pred_bytes: np.ndarray  # bytes on each of those edges
    group_time: np.ndarray  # [D, G]
    group_memory: np.ndarray  # [G]
    capacity: np.ndarray  # [D]
    latency: np.ndarray  # [D, D], 0 on the diagonal
    inv_bandwidth: np.ndarray  # [D, D], 0 on the diagonal
    balanced_s: float  # fastest total time over the device count


def _log_clip(x: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(np.log10(1.0 + np.maximum(x, 0.0)) / scale, 0.0, FEATURE_CLIP)


def problem_inputs(problem: PlacementProblem) -> ProblemInputs:
    """The policy's view of ``problem``: group, edge, device and graph features and the
    arrays the decoder needs. O(V + E + G·D + D²)."""
    n, nd = problem.num_groups, problem.num_devices
    gt = np.maximum(problem.group_time, 0.0)
    fastest = gt.min(axis=0)
    total_fast = max(float(fastest.sum()), 1e-12)
    mean_group = total_fast / max(n, 1)
    ga = problem.group_graph.arrays()
    order = ga.topo_order.astype(np.int64)
    # Upward / downward ranks (longest paths with each group at its fastest time).
    down = np.zeros(n)
    for g in order.tolist():
        p = ga.pred_idx[ga.pred_ptr[g] : ga.pred_ptr[g + 1]]
        down[g] = (down[p] + fastest[p]).max() if len(p) else 0.0
    up = np.zeros(n)
    for g in order[::-1].tolist():
        s = ga.succ_idx[ga.succ_ptr[g] : ga.succ_ptr[g + 1]]
        up[g] = fastest[g] + (up[s].max() if len(s) else 0.0)
    critical = max(float(up.max(initial=0.0)), 1e-12)
    capacity = problem.device_memory.astype(np.float64)
    mean_cap = float(capacity.mean())
    extra = np.stack(
        [
            _log_clip(fastest / mean_group, 1.0),
            np.clip(
                np.log10(np.maximum(gt.max(axis=0), 1e-15) / np.maximum(fastest, 1e-15)) / 3.0, 0, 4
            ),
            _log_clip(problem.group_memory / mean_cap * n, 2.0),
            up / critical,
            down / critical,
            (up + down) / critical,
        ],
        axis=1,
    )
    node_x = np.concatenate([group_features(problem), extra], axis=1).astype(np.float32)

    lat, bw = problem.cluster.path_matrices()
    lat = np.array(lat, dtype=np.float64)
    np.fill_diagonal(lat, 0.0)
    inv_bw = np.where(np.isfinite(bw) & (bw > 0), 1.0 / np.where(bw > 0, bw, 1.0), 0.0)
    np.fill_diagonal(inv_bw, 0.0)
    off = ~np.eye(nd, dtype=bool)
    bw_off = np.where(off, bw, np.nan)
    bw_ref = float(np.nanmax(bw_off)) if nd > 1 else 1.0

    src, dst = ga.edge_src.astype(np.int64), ga.edge_dst.astype(np.int64)
    eb = ga.edge_bytes.astype(np.float64)
    edge_x = np.stack(
        [_log_clip(eb, 10.0), _log_clip(eb / bw_ref / mean_group, 2.0)], axis=1
    ).astype(np.float32)

    per_device = gt.sum(axis=1)
    speed = total_fast / np.maximum(per_device, 1e-15)
    is_cpu = np.array([d.spec.category == "cpu" for d in problem.cluster.devices], dtype=float)
    mean_bw = np.nanmean(bw_off, axis=1) if nd > 1 else np.ones(nd)
    min_bw = np.nanmin(bw_off, axis=1) if nd > 1 else np.ones(nd)
    total_mem = float(problem.group_memory.sum())
    device_x = np.stack(
        [
            speed,
            np.clip(-np.log10(speed) / 3.0, 0, FEATURE_CLIP),
            is_cpu,
            capacity / capacity.max(),
            _log_clip(total_mem / capacity, 1.0),
            np.clip(-np.log10(mean_bw / bw_ref) / 3.0, 0, FEATURE_CLIP),
            np.clip(-np.log10(min_bw / bw_ref) / 3.0, 0, FEATURE_CLIP),
            np.full(nd, 1.0 / nd),
            np.full(nd, nd / 8.0),
        ],
        axis=1,
    ).astype(np.float32)
    graph_x = np.array(
        [
            np.log10(1.0 + n) / 3.0,
            nd / 8.0,
            critical / (total_fast / nd),
            _log_clip(np.array(total_mem / mean_cap), 1.0),
        ],
        dtype=np.float32,
    )
    return ProblemInputs(
        node_x=torch.from_numpy(node_x),
        edge_src=torch.from_numpy(src),
        edge_dst=torch.from_numpy(dst),
        edge_x=torch.from_numpy(edge_x),
        device_x=torch.from_numpy(device_x),
        graph_x=torch.from_numpy(graph_x),
        order=order,
        pred_ptr=ga.pred_ptr.astype(np.int64),
        pred_idx=ga.pred_idx.astype(np.int64),
        pred_bytes=ga.edge_bytes[ga.pred_edge].astype(np.float64),
        group_time=gt,
        group_memory=problem.group_memory.astype(np.float64),
        capacity=capacity,
        latency=lat,
        inv_bandwidth=inv_bw,
        balanced_s=total_fast / nd,
    )


# ---------------------------------------------------------------- the network
class GNNPolicy(nn.Module):
    """Message-passing group encoder, device encoder and a per-(group, device) scorer."""

    def __init__(self, config: GNNConfig | None = None) -> None:
        super().__init__()
        self.config = config or GNNConfig()
        h = self.config.hidden
        self.node_in = nn.Linear(NODE_FEATURES, h)
        self.fwd = nn.ModuleList(nn.Linear(h + EDGE_FEATURES, h) for _ in range(self.config.rounds))
        self.bwd = nn.ModuleList(nn.Linear(h + EDGE_FEATURES, h) for _ in range(self.config.rounds))
        self.upd = nn.ModuleList(nn.Linear(3 * h, h) for _ in range(self.config.rounds))
        self.norm = nn.ModuleList(nn.LayerNorm(h) for _ in range(self.config.rounds))
        self.dev = nn.Sequential(
            nn.Linear(DEVICE_FEATURES, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU()
        )
        self.ctx = nn.Sequential(nn.Linear(3 * h + GRAPH_FEATURES, h), nn.ReLU())
        self.head_group = nn.Linear(h, h)
        self.head_device = nn.Linear(h, h, bias=False)
        self.head_ctx = nn.Linear(h, h, bias=False)
        self.head_state = nn.Linear(STATE_FEATURES, h, bias=False)
        self.head_hidden = nn.Linear(h, h)
        self.head_out = nn.Linear(h, 1)
        # A linear path from the state features straight to the logit, initialised as a
        # soft HEFT rule (prefer the earliest finish time, avoid memory overflow), so
        # training starts from a list scheduler rather than a uniform policy.
        self.head_prior = nn.Linear(STATE_FEATURES, 1, bias=False)
        with torch.no_grad():
            self.head_prior.weight.zero_()
            self.head_prior.weight[0, 1] = -8.0
            self.head_prior.weight[0, 6] = -2.0
            self.head_prior.weight[0, 7] = 1.0

    def static_scores(self, x: ProblemInputs) -> torch.Tensor:
        """``[G, D, H]``: the first head layer's pre-activation without the state term."""
        h = torch.relu(self.node_in(x.node_x))
        n = h.shape[0]
        src, dst = x.edge_src, x.edge_dst
        ones = torch.ones(len(src))
        indeg = torch.zeros(n).index_add_(0, dst, ones).clamp(min=1.0)[:, None]
        outdeg = torch.zeros(n).index_add_(0, src, ones).clamp(min=1.0)[:, None]
        for r in range(self.config.rounds):
            mf = torch.relu(self.fwd[r](torch.cat([h[src], x.edge_x], dim=1)))
            mb = torch.relu(self.bwd[r](torch.cat([h[dst], x.edge_x], dim=1)))
            agg_f = torch.zeros_like(h).index_add_(0, dst, mf) / indeg
            agg_b = torch.zeros_like(h).index_add_(0, src, mb) / outdeg
            h = self.norm[r](h + torch.relu(self.upd[r](torch.cat([h, agg_f, agg_b], dim=1))))
        u = self.dev(x.device_x)
        c = self.ctx(torch.cat([h.mean(0), h.max(0).values, u.mean(0), x.graph_x]))
        return (
            self.head_group(h)[:, None, :]
            + self.head_device(u)[None, :, :]
            + self.head_ctx(c)[None, None, :]
        )

    def logits(self, static: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., D]`` from static scores ``[..., D, H]`` and state ``[..., D, S]``."""
        z = torch.relu(static + self.head_state(state))
        z = torch.relu(self.head_hidden(z))
        return self.head_out(z)[..., 0] + self.head_prior(state)[..., 0]


@dataclass
class Rollout:
    """Placements sampled by :func:`decode`, in decoding (topological) order."""

    actions: np.ndarray  # [K, G] device per decoding step
    state: np.ndarray  # [K, G, D, STATE_FEATURES] float32
    mask: np.ndarray  # [K, G, D] bool, True = not allowed
    group_devices: np.ndarray  # [K, G] device per group (group index order)


@njit(cache=True)
def _state_step(
    g: int,
    slot: int,
    frac: float,
    pred_ptr: np.ndarray,
    pred_idx: np.ndarray,
    pred_bytes: np.ndarray,
    group_time: np.ndarray,
    group_memory: np.ndarray,
    capacity: np.ndarray,
    latency: np.ndarray,
    inv_bw: np.ndarray,
    unit: float,
    dev: np.ndarray,
    finish: np.ndarray,
    avail: np.ndarray,
    load: np.ndarray,
    mem: np.ndarray,
    state: np.ndarray,
    masks: np.ndarray,
    eft: np.ndarray,
) -> None:
    """The decoding state features of group ``g`` on every device, for every sample."""
    k_n, d_n = avail.shape
    t_min = 1e-9
    t_low = group_time[0, g]
    for d in range(d_n):
        t_low = min(t_low, group_time[d, g])
    t_min = max(t_low, 1e-9)
    lo, hi = pred_ptr[g], pred_ptr[g + 1]
    b_sum = 0.0
    for e in range(lo, hi):
        b_sum += pred_bytes[e]
    b_sum = max(b_sum, 1.0)
    ready = np.zeros(d_n)
    comm = np.zeros(d_n)
    for k in range(k_n):
        ready[:] = 0.0
        comm[:] = 0.0
        for e in range(lo, hi):
            p = pred_idx[e]
            src = dev[k, p]
            f = finish[k, p]
            b = pred_bytes[e]
            for d in range(d_n):
                arrive = f + latency[src, d] + b * inv_bw[src, d]
                if arrive > ready[d]:
                    ready[d] = arrive
            comm[src] += b
        best = np.inf
        r_min = np.inf
        all_over = True
        for d in range(d_n):
            eft[k, d] = max(avail[k, d], ready[d]) + group_time[d, g]
            best = min(best, eft[k, d])
            r_min = min(r_min, ready[d])
            if (mem[k, d] + group_memory[g]) / capacity[d] <= 1.0:
                all_over = False
        for d in range(d_n):
            gap = eft[k, d] - best
            mem_after = (mem[k, d] + group_memory[g]) / capacity[d]
            over = mem_after > 1.0
            masks[k, slot, d] = over and not all_over
            s = state[k, slot, d]
            s[0] = min(gap / unit, FEATURE_CLIP)
            s[1] = min(np.log1p(gap / t_min) / 4.0, FEATURE_CLIP)
            s[2] = min((ready[d] - r_min) / unit, FEATURE_CLIP)
            s[3] = min(load[k, d] / unit, FEATURE_CLIP)
            s[4] = comm[d] / b_sum
            s[5] = min(mem_after, 2.0)
            s[6] = 1.0 if over else 0.0
            s[7] = 1.0 if eft[k, d] <= best else 0.0
            s[8] = min(np.log10(max(group_time[d, g], t_min) / t_min) / 3.0, FEATURE_CLIP)
            s[9] = frac


@njit(cache=True)
def _choose_step(
    g: int,
    step: int,
    slot: int,
    logits: np.ndarray,
    uniforms: np.ndarray,
    greedy_rows: int,
    group_time: np.ndarray,
    group_memory: np.ndarray,
    masks: np.ndarray,
    eft: np.ndarray,
    actions: np.ndarray,
    dev: np.ndarray,
    finish: np.ndarray,
    avail: np.ndarray,
    load: np.ndarray,
    mem: np.ndarray,
) -> None:
    """Sample (or, for the first ``greedy_rows`` samples, take the most likely) device for
    group ``g`` from masked logits, and update the decoding state."""
    k_n, d_n = logits.shape
    for k in range(k_n):
        top = -np.inf
        arg = 0
        for d in range(d_n):
            if not masks[k, slot, d] and logits[k, d] > top:
                top = logits[k, d]
                arg = d
        choice = arg
        if k >= greedy_rows:
            total = 0.0
            for d in range(d_n):
                if not masks[k, slot, d]:
                    total += np.exp(logits[k, d] - top)
            u = uniforms[k, step] * total
            acc = 0.0
            for d in range(d_n):
                if not masks[k, slot, d]:
                    acc += np.exp(logits[k, d] - top)
                    choice = d
                    if acc > u:
                        break
        actions[k, step] = choice
        dev[k, g] = choice
        end = eft[k, choice]
        finish[k, g] = end
        avail[k, choice] = end
        load[k, choice] += group_time[choice, g]
        mem[k, choice] += group_memory[g]


def decode(
    policy: GNNPolicy,
    x: ProblemInputs,
    samples: int,
    rng: np.random.Generator,
    greedy_rows: int = 0,
    static: torch.Tensor | None = None,
    record: bool = True,
) -> Rollout:
    """Decode ``samples`` placements group by group in topological order (the first
    ``greedy_rows`` take the most likely device, the rest sample), tracking per sample each
    device's ready time, load and memory. No gradients; O(G · K · (P·D + D·H²)); the state
    and sampling loops are compiled with numba, the head's matrix products are BLAS calls.
    ``record=False`` keeps no per-step state or masks (zero-shot needs none)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny products: one thread is fastest and reproducible
    try:
        return _decode(policy, x, samples, rng, greedy_rows, static, record)
    finally:
        torch.set_num_threads(threads)


def _decode(
    policy: GNNPolicy,
    x: ProblemInputs,
    samples: int,
    rng: np.random.Generator,
    greedy_rows: int,
    static: torch.Tensor | None,
    record: bool,
) -> Rollout:
    with torch.no_grad():
        static_t = policy.static_scores(x) if static is None else static
        w_lin = torch.cat([policy.head_state.weight.T, policy.head_prior.weight.T], dim=1)
        w_hid = policy.head_hidden.weight.T.contiguous()
        b_hid = policy.head_hidden.bias
        w_out = policy.head_out.weight[0]
        b_out = float(policy.head_out.bias[0])
    order = x.order
    n, nd, k = len(order), x.group_time.shape[0], samples
    dev = np.zeros((k, n), dtype=np.int64)
    finish = np.zeros((k, n))
    avail = np.zeros((k, nd))
    load = np.zeros((k, nd))
    mem = np.zeros((k, nd))
    eft = np.zeros((k, nd))
    state = np.zeros((k, n if record else 1, nd, STATE_FEATURES), dtype=np.float32)
    masks = np.zeros((k, n if record else 1, nd), dtype=bool)
    actions = np.zeros((k, n), dtype=np.int64)
    unit = max(x.balanced_s, 1e-12)
    uniforms = rng.random((k, n))
    hid = policy.config.hidden
    for step, g in enumerate(order.tolist()):
        slot = step if record else 0
        _state_step(
            g, slot, step / n, x.pred_ptr, x.pred_idx, x.pred_bytes, x.group_time,
            x.group_memory, x.capacity, x.latency, x.inv_bandwidth, unit,
            dev, finish, avail, load, mem, state, masks, eft,
        )  # fmt: skip
        with torch.no_grad():
            lin = torch.from_numpy(state[:, slot]).reshape(k * nd, -1) @ w_lin  # [K·D, H+1]
            z = torch.relu(lin[:, :hid].reshape(k, nd, hid) + static_t[g])
            z = torch.relu(torch.addmm(b_hid, z.reshape(k * nd, hid), w_hid))
            logits = (z @ w_out + lin[:, hid]).reshape(k, nd).double().numpy() + b_out
        _choose_step(
            g, step, slot, logits, uniforms, greedy_rows, x.group_time, x.group_memory,
            masks, eft, actions, dev, finish, avail, load, mem,
        )  # fmt: skip
    return Rollout(actions, state, masks, dev)


def log_probs(
    policy: GNNPolicy, x: ProblemInputs, rollout: Rollout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([K, G] log-probability of each decision, mean entropy)`` with gradients, in one
    batched pass over the recorded states."""
    static = policy.static_scores(x)[torch.from_numpy(x.order)]  # [G, D, H]
    state = torch.from_numpy(rollout.state)
    mask = torch.from_numpy(rollout.mask)
    logits = policy.logits(static[None], state).masked_fill(mask, -torch.inf)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, torch.from_numpy(rollout.actions)[..., None])[..., 0]
    p = logp.exp()
    entropy = -(torch.where(mask, 0.0, p * logp)).sum(-1).mean()
    return chosen, entropy


def ppo_update(
    policy: GNNPolicy,
    optimizer: torch.optim.Optimizer,
    batch: list[tuple[ProblemInputs, Rollout, np.ndarray]],
    config: PPOConfig,
) -> float:
    """One PPO update (clipped surrogate, Schulman et al. 2017, eq. 7) over rollouts of
    one or more problems; each rollout carries per-sample advantages, shared by all of its
    decisions (one terminal reward, no discount). Returns the last epoch's loss."""
    with torch.no_grad():
        old = [log_probs(policy, x, r)[0] for x, r, _ in batch]
    loss_value = 0.0
    for _ in range(config.epochs):
        optimizer.zero_grad()
        total = torch.zeros(())
        for (x, r, adv), old_lp in zip(batch, old):
            lp, entropy = log_probs(policy, x, r)
            ratio = torch.exp(lp - old_lp)
            a = torch.from_numpy(adv).float()[:, None]
            surrogate = torch.minimum(
                ratio * a, torch.clamp(ratio, 1 - config.clip, 1 + config.clip) * a
            )
            total = total + (-surrogate.mean() - config.entropy * entropy) / len(batch)
        total.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
        optimizer.step()
        loss_value = float(total.detach())
    return loss_value


def advantages(scores: np.ndarray) -> np.ndarray:
    """Per-sample advantages from scores (seconds, lower is better): ``−log score``,
    normalised over the samples of one problem (their mean is the baseline: the shared
    baseline of POMO, Kwon et al., NeurIPS 2020)."""
    r = -np.log(np.maximum(scores, 1e-12))
    return (r - r.mean()) / (r.std() + 1e-8)


# ---------------------------------------------------------------- weights
def save_weights(
    path: str | Path, policy: GNNPolicy, training: dict[str, Any] | None = None
) -> None:
    """Write ``{format, config, state_dict, training}`` with ``torch.save`` (atomic)."""
    save_checkpoint(
        Path(path),
        {
            "format": WEIGHTS_FORMAT,
            "config": asdict(policy.config),
            "state_dict": policy.state_dict(),
            # plain JSON types only, so the file loads with weights_only=True
            "training": json.loads(json.dumps(training or {}, default=str)),
        },
    )


def load_weights(path: str | Path | None = None) -> tuple[GNNPolicy, dict[str, Any]]:
    """The policy stored at ``path`` (default: the shipped ``learn/weights/gnn.pt``) and its
    training record; a missing or unreadable file is a :class:`PlacerError`."""
    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    if not path.is_file():
        raise PlacerError(
            f"{path}: the gnn placer's weights file is missing; reinstall meshplace or "
            "retrain with python -m meshplace.learn.train_gnn"
        )
    try:
        blob = torch.load(path, weights_only=True, map_location="cpu")
        if not isinstance(blob, dict) or blob.get("format") != WEIGHTS_FORMAT:
            raise ValueError(f"not a {WEIGHTS_FORMAT} file")
        policy = GNNPolicy(GNNConfig(**blob["config"]))
        policy.load_state_dict(blob["state_dict"])
    except Exception as exc:  # any unreadable file is one user-facing error
        raise PlacerError(
            f"{path}: the gnn placer's weights file is unreadable ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); retrain with "
            "python -m meshplace.learn.train_gnn"
        ) from None
    policy.eval()
    return policy, dict(blob.get("training", {}))


def weights_fingerprint(policy: GNNPolicy) -> float:
    """A cheap checksum of the weights (so a checkpoint refuses other weights)."""
    return float(sum(float(t.double().abs().sum()) for t in policy.state_dict().values()))


# ---------------------------------------------------------------- placing
@dataclass
class GNNResult:
    """The best plan found (a device per group) and stats."""

    group_devices: np.ndarray
    best_score_s: float
    stats: dict[str, Any] = field(default_factory=dict)


def _score(problem: PlacementProblem, plans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from meshplace.learn.features import score_and_step_batch

    scores, steps, _ = score_and_step_batch(problem, plans)
    return scores, steps


def zero_shot(
    problem: PlacementProblem,
    policy: GNNPolicy,
    seed: int,
    samples: int = ZERO_SHOT_SAMPLES,
    inputs: ProblemInputs | None = None,
) -> GNNResult:
    """The greedy decode plus ``samples − 1`` sampled placements, simulated; the best wins."""
    start = now()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = inputs or problem_inputs(problem)
        # Keep large clusters (trained for 2-8 devices) within a few seconds.
        work = max(problem.num_groups * problem.num_devices, 1)
        samples = max(1, min(samples, ZERO_SHOT_WORK // work))
        rng = np.random.default_rng([seed, 0])
        rollout = decode(policy, x, samples, rng, greedy_rows=1, record=False)
    finally:
        torch.set_num_threads(threads)
    before = problem.evaluations
    scores, steps = _score(problem, rollout.group_devices)
    k = int(np.argmin(scores))
    stats = {
        "samples": samples,
        "evaluations": problem.evaluations - before,
        "greedy_step_time_s": float(steps[0]),
        "zero_shot_step_time_s": float(steps[k]),
        "zero_shot_score_s": float(scores[k]),
        "zero_shot_s": now() - start,
    }
    return GNNResult(rollout.group_devices[k].copy(), float(scores[k]), stats)


def planned_updates(problem: PlacementProblem, budget_s: float, config: PPOConfig) -> int:
    """Fine-tuning updates that ``budget_s`` buys on ``problem`` (at least 1)."""
    g, k = problem.num_groups, config.samples / 16
    per_update = (
        UPDATE_OVERHEAD_S
        + DECODE_S_PER_GROUP * g * max(k, 0.5)
        + PPO_S_PER_GROUP_PASS * g * k * (problem.num_devices / 5) * (config.epochs + 1)
        + config.samples * problem.graph.num_ops / SIMULATED_OPS_PER_SECOND
    )
    return max(1, int(BUDGET_SHARE * budget_s / per_update))


def finetune(
    problem: PlacementProblem,
    policy: GNNPolicy,
    budget_s: float,
    seed: int,
    *,
    config: PPOConfig | None = None,
    updates: int | None = None,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: ProgressFn | None = None,
    first: GNNResult | None = None,
) -> GNNResult:
    """Zero-shot (or ``first``, a :func:`zero_shot` result already computed), then PPO on
    ``problem`` alone from ``policy``'s weights (modified in place) for ``updates`` updates
    (default: what ``budget_s`` buys); returns the best plan seen, so never worse than
    zero-shot. Checkpoints and resume as in
    :func:`meshplace.learn.rl.train_rl` (a resumed run ends with the uninterrupted plan)."""
    check_budget(budget_s)
    config = config or PPOConfig()
    start = now()
    total = int(updates) if updates is not None else planned_updates(problem, budget_s, config)
    path = Path(checkpoint) if checkpoint is not None else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = problem_inputs(problem)
        fingerprint = {
            "graph": problem.graph.name,
            "ops": problem.graph.num_ops,
            "groups": problem.num_groups,
            "devices": problem.num_devices,
            "seed": seed,
            "updates": total,
            "config": asdict(config),
            "weights": weights_fingerprint(policy),
        }
        if first is None:
            first = zero_shot(problem, policy, seed, inputs=x)
        zs = first.stats
        optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)
        stateful = {"policy": policy, "optimizer": optimizer}
        run = TrainingRun(
            problem,
            total=total,
            fingerprint=fingerprint,
            fmt=CHECKPOINT_FORMAT,
            best=first.group_devices,
            path=path,
            checkpoint_every=config.checkpoint_every,
            progress=progress,
            start=start,
            deadline_s=DEADLINE_SHARE * budget_s,
            stop_after=stop_after,
        )
        # The zero-shot plan is where fine-tuning starts: the curve's first point.
        run.best_score, run.best_step = first.best_score_s, zs["zero_shot_step_time_s"]
        run.evaluations = int(zs["evaluations"])
        run.curve = {
            "evaluations": [float(run.evaluations)],
            "best_step_time_s": [run.best_step],
            "wall_s": [zs["zero_shot_s"]],
        }
        if resume:
            run.resume(stateful)

        policy.train()
        while run.keep_going():
            rng = np.random.default_rng([seed, 1 + run.done])
            rollout = decode(policy, x, config.samples, rng)
            scores, steps = run.count(lambda r=rollout: _score(problem, r.group_devices))
            run.offer(rollout.group_devices, scores, steps)
            ppo_update(policy, optimizer, [(x, rollout, advantages(scores))], config)
            run.finish_update(stateful)
        run.end_session(stateful, {})
        policy.eval()
    finally:
        torch.set_num_threads(threads)
    stats: dict[str, Any] = {
        **zs,
        **run.stats(),
        "finetune_updates": run.done,
        "ppo": asdict(config),
    }
    stats.pop("updates")
    return GNNResult(run.best, run.best_score, stats)


def warm_up_decoder() -> None:
    """Run the decoding kernels once on a two-op graph, so that numba's one-off loading
    (or, in a fresh checkout, compiling) of them is paid before a placement is timed
    (:func:`meshplace.placers.base.warm_up` calls this once per process)."""
    from meshplace.graph.ir import Op, OpGraph
    from meshplace.hardware import load_cluster

    graph = OpGraph("gnn-warm-up")
    graph.add_op(Op("x", "input", output_shapes=[[8, 8]]))
    graph.add_op(Op("mm", "matmul", flops=1e6, output_shapes=[[8, 8]]))
    graph.add_edge("x", "mm", 256)
    problem = PlacementProblem(graph, load_cluster("colocrl-2gpu"))
    policy = GNNPolicy(GNNConfig(hidden=8, rounds=1))
    decode(policy, problem_inputs(problem), 2, np.random.default_rng(0), greedy_rows=1)


@register(
    "gnn",
    family="learned",
    description="pretrained graph policy (message passing over the group DAG, device "
    "embeddings, load-aware decoding) trained with PPO across graphs and clusters; "
    "zero-shot, or fine-tuned with --finetune",
    source="Placeto (Addanki et al., NeurIPS 2019, §3); GDP (Zhou et al., 2019, §3-4)",
    uses_budget=True,
    takes_options=True,
    warmup=warm_up_decoder,
)
def place_gnn(
    problem: PlacementProblem, budget_s: float, seed: int, options: PlacerOptions
) -> tuple[OpAssignment, dict[str, Any]]:
    """Zero-shot placement with the shipped weights; PPO fine-tuning for
    ``options.finetune_s`` seconds when given (the best plan seen is returned)."""
    policy, training = load_weights()
    finetune_s = float(options.finetune_s or 0.0)
    start = now()
    # Zero-shot at the problem's grouping and at one up to 4x finer (as anneal walks
    # both: coarse groups cut from a topological order lump parallel branches together).
    candidates = [problem]
    fine = group_ops(problem.graph, FINE_GROUPS_FACTOR * problem.num_groups)
    if fine.num_groups > problem.num_groups:
        candidates.append(
            PlacementProblem(
                problem.graph, problem.cluster, problem.objective, fine, problem.simulator
            )
        )
    shots = [zero_shot(c, policy, seed) for c in candidates]
    pick = min(range(len(shots)), key=lambda i: (shots[i].best_score_s, i))
    chosen, first = candidates[pick], shots[pick]
    zs = {
        **first.stats,
        "samples": sum(z.stats["samples"] for z in shots),
        "evaluations": sum(z.stats["evaluations"] for z in shots),
        "zero_shot_s": now() - start,
        "zero_shot_groups": chosen.num_groups,
        "granularities": [
            {"groups": c.num_groups, "step_time_s": z.stats["zero_shot_step_time_s"]}
            for c, z in zip(candidates, shots)
        ],
    }
    first.stats = zs
    if finetune_s > 0:
        out = finetune(
            chosen,
            policy,
            finetune_s,
            seed,
            checkpoint=options.checkpoint("gnn"),
            resume=options.resume,
            progress=options.progress,
            first=first,
        )
        out.stats["zero_shot_s"] = zs["zero_shot_s"]
    else:
        out = first
        out.stats = {
            **zs,
            "best_score_s": out.best_score_s,
            "best_step_time_s": zs["zero_shot_step_time_s"],
            "finetune_updates": 0,
            # zero-shot is a fixed number of samples, with no deadline to stop it
            "stopped_by": "budget",
            "learning_curve": {
                "evaluations": [float(zs["evaluations"])],
                "best_step_time_s": [zs["zero_shot_step_time_s"]],
                "wall_s": [zs["zero_shot_s"]],
            },
        }
    for c in candidates[1:]:
        problem.evaluations += c.evaluations  # simulations on the finer grouping count too
    out.stats["weights_updates"] = training.get("updates")
    return OpAssignment(chosen.expand(out.group_devices)), out.stats


__all__ = [
    "DEFAULT_WEIGHTS",
    "GNNConfig",
    "GNNPolicy",
    "GNNResult",
    "PPOConfig",
    "ProblemInputs",
    "Rollout",
    "advantages",
    "decode",
    "finetune",
    "load_weights",
    "log_probs",
    "ppo_update",
    "problem_inputs",
    "save_weights",
    "zero_shot",
]
