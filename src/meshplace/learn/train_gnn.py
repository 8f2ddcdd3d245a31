"""Train the ``gnn`` placer's shipped weights: PPO across a family of graphs and clusters.

GDP (Zhou et al., 2019, §4) trains one graph policy on a batch of graphs and places held-out
graphs zero-shot; Placeto (Addanki et al., NeurIPS 2019, §4) trains on families of graphs
and evaluates on unseen members. Here:

* :data:`TRAIN_FAMILY` — reference workloads at several sizes and batch sizes (dmcca 4view
  and 8view, rnnlm, resnet50, transformer base), each also at a coarser grouping (96
  groups) and with **perturbed costs** (every op's time on every device kind multiplied by
  an independent log-normal factor, σ = 0.5: the same DAG with a different cost
  landscape); each graph is paired with several of :func:`family_clusters` (2–8 devices:
  CPU + K80/K40 PCIe trees, NVLink V100 / A100 / P100 hosts, GPU-only hosts, and mixed
  K80 + V100 hosts);
* :data:`HELD_OUT` — graphs that appear in training in no size or batch: ``nmt`` (2layer
  and 4layer), ``inception_v3`` and ``gpt`` (124m), on the ColocRL clusters and on
  ``h1-4xv100``, a cluster not in the family.

Each update draws :data:`PROBLEMS_PER_UPDATE` problems (seeded), samples ``K`` placements
of each with the current policy, scores them with the simulator and takes one PPO update
(:func:`meshplace.learn.gnn.ppo_update`) with per-problem normalised advantages. The budget
becomes a fixed number of updates (``budget / UPDATE_S``), so ``--seed`` and the number of
updates fix the weights. Captured graphs and built problems are cached in the process.

Reproduce the shipped weights (one CPU thread)::

    python -m meshplace.learn.train_gnn --out src/meshplace/learn/weights/gnn.pt \\
        --budget 1500 --seed 0

Complexity: O(updates × PROBLEMS_PER_UPDATE × (K · G · (P·D + D·H²) + K · (V + E) log V)).

Example
-------
>>> from meshplace.hardware import load_cluster
>>> sorted(len(c.devices) for c in family_clusters().values())[:2]
[2, 2]
>>> any(label.startswith("nmt") for label, _, _ in training_specs())
False
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshplace.graph.groups import group_ops
from meshplace.graph.ir import OpGraph
from meshplace.hardware import load_cluster
from meshplace.hardware.catalogue import device_spec
from meshplace.hardware.cluster import Cluster, Device
from meshplace.hardware.topology import nvlink_mesh, pcie_tree
from meshplace.learn.features import score_and_step_batch
from meshplace.learn.gnn import (
    GNNConfig,
    GNNPolicy,
    PPOConfig,
    advantages,
    decode,
    load_weights,
    ppo_update,
    problem_inputs,
    save_weights,
)
from meshplace.placers.base import PlacementProblem, PlacerError, run_placer
from meshplace.sim.simulator import Simulator

UPDATE_S = 0.75  # assumed seconds per update when turning --budget into updates
PROBLEMS_PER_UPDATE = 4
PERTURB_SIGMA = 0.5
COARSE_GROUPS = 96


@dataclass(frozen=True)
class GraphSpec:
    """One family member: a workload (size, batch) and a variant."""

    workload: str
    size: str | None = None
    batch: int | None = None
    max_groups: int | None = None  # coarser grouping than the default 256
    perturb: int | None = None  # seed of the log-normal cost perturbation

    @property
    def label(self) -> str:
        parts = [self.workload + (f"-{self.size}" if self.size else "")]
        if self.batch is not None:
            parts.append(f"b{self.batch}")
        if self.max_groups is not None:
            parts.append(f"g{self.max_groups}")
        if self.perturb is not None:
            parts.append(f"p{self.perturb}")
        return "/".join(parts)


def _mixed(cpu: bool = True) -> Cluster:
    base = pcie_tree(4, 2, gpu_kind="k80", cpu_kind="xeon-e5-2699v3", cpus=1 if cpu else 0)
    devices = [
        Device(d.name, "v100", device_spec("v100"), d.host) if d.name in ("gpu2", "gpu3") else d
        for d in base.devices
    ]
    name = "mixed-2xk80-2xv100" + ("" if cpu else "-nocpu")
    return Cluster(name, devices, base.links, base.switches, topology="pcie-tree")


@functools.cache
def family_clusters() -> dict[str, Cluster]:
    """The training clusters, 2–8 devices, by name."""
    e5 = "xeon-e5-2699v3"
    clusters = {
        "colocrl-2gpu": load_cluster("colocrl-2gpu"),
        "colocrl-4gpu": load_cluster("colocrl-4gpu"),
        "pcie-1xk80": pcie_tree(1, 2, gpu_kind="k80", cpu_kind=e5, name="pcie-1xk80"),
        "pcie-3xk40": pcie_tree(3, 2, gpu_kind="k40", cpu_kind="xeon", name="pcie-3xk40"),
        "pcie-7xk80": pcie_tree(7, 2, gpu_kind="k80", cpu_kind=e5, name="pcie-7xk80"),
        "gpus-3xk80": pcie_tree(3, 2, gpu_kind="k80", cpus=0, name="gpus-3xk80"),
        "nvl-2xv100": nvlink_mesh(2, gpu_kind="v100", cpus=0, name="nvl-2xv100"),
        "nvl-4xv100-1cpu": nvlink_mesh(4, gpu_kind="v100", cpus=1, name="nvl-4xv100-1cpu"),
        "h1-2xa100": load_cluster("h1-2xa100"),
        "h1-6xp100": load_cluster("h1-6xp100"),
        "mixed-2xk80-2xv100": _mixed(True),
        "mixed-2xk80-2xv100-nocpu": _mixed(False),
    }
    return clusters


_BASE_GRAPHS: tuple[GraphSpec, ...] = (
    GraphSpec("dmcca", "4view"),
    GraphSpec("dmcca", "4view", batch=64),
    GraphSpec("dmcca", "8view"),
    GraphSpec("rnnlm"),
    GraphSpec("rnnlm", batch=16),
    GraphSpec("resnet50"),
    GraphSpec("resnet50", batch=8),
    GraphSpec("transformer", "base"),
    GraphSpec("transformer", "base", batch=16),
)


def _variants() -> list[GraphSpec]:
    out: list[GraphSpec] = []
    for i, g in enumerate(_BASE_GRAPHS):
        out.append(g)
        out.append(GraphSpec(g.workload, g.size, g.batch, max_groups=COARSE_GROUPS))
        out.append(GraphSpec(g.workload, g.size, g.batch, perturb=i))
    return out


TRAIN_FAMILY: tuple[tuple[GraphSpec, str], ...] = tuple(
    (spec, cluster)
    for i, spec in enumerate(_variants())
    for j, cluster in enumerate(
        [
            "colocrl-2gpu",
            "colocrl-4gpu",
            "pcie-1xk80",
            "pcie-3xk40",
            "pcie-7xk80",
            "gpus-3xk80",
            "nvl-2xv100",
            "nvl-4xv100-1cpu",
            "h1-2xa100",
            "h1-6xp100",
            "mixed-2xk80-2xv100",
            "mixed-2xk80-2xv100-nocpu",
        ]
    )
    if (i + j) % 3 == 0 or cluster in ("colocrl-4gpu",)
)
"""(graph, cluster) pairs trained on: every graph variant on ``colocrl-4gpu`` and on a
third of the other clusters (a diagonal pattern, so every cluster sees every workload)."""

HELD_OUT: tuple[tuple[GraphSpec, str], ...] = (
    (GraphSpec("nmt", "2layer"), "colocrl-4gpu"),
    (GraphSpec("nmt", "2layer"), "colocrl-2gpu"),
    (GraphSpec("nmt", "4layer"), "colocrl-4gpu"),
    (GraphSpec("inception_v3"), "colocrl-4gpu"),
    (GraphSpec("inception_v3"), "h1-4xv100"),
    (GraphSpec("gpt", "124m"), "h1-4xv100"),
)
"""Held-out (graph, cluster) pairs: no nmt, inception_v3 or gpt graph is in training."""


def training_specs() -> list[tuple[str, GraphSpec, str]]:
    """``(label, graph spec, cluster name)`` of every training problem."""
    return [(f"{s.label}@{c}", s, c) for s, c in TRAIN_FAMILY]


@functools.cache
def _graph(workload: str, size: str | None, batch: int | None) -> OpGraph:
    from meshplace.graph.sources import workload_graph

    return workload_graph(workload, size=size, batch=batch)


def _cluster(name: str) -> Cluster:
    clusters = family_clusters()
    return clusters[name] if name in clusters else load_cluster(name)


def build_problem(spec: GraphSpec, cluster_name: str) -> PlacementProblem:
    """The placement problem of one family member (graphs are cached per process)."""
    graph = _graph(spec.workload, spec.size, spec.batch)
    cluster = _cluster(cluster_name)
    grouping = group_ops(graph, spec.max_groups) if spec.max_groups else None
    if spec.perturb is None:
        if grouping is None:
            return PlacementProblem.build(graph, cluster)
        return PlacementProblem(graph, cluster, grouping=grouping)
    sim = Simulator(graph, cluster)
    rng = np.random.default_rng([12345, spec.perturb])
    factors = rng.lognormal(0.0, PERTURB_SIGMA, size=sim.op_time_by_kind.shape)
    sim.op_time_by_kind = sim.op_time_by_kind * factors
    return PlacementProblem(graph, cluster, grouping=grouping, simulator=sim)


def held_out_problems() -> list[tuple[str, PlacementProblem]]:
    """``(label, problem)`` for every :data:`HELD_OUT` pair (captures nmt, inception_v3,
    gpt: about a minute the first time in a process)."""
    return [(f"{s.label}@{c}", build_problem(s, c)) for s, c in HELD_OUT]


def generalisation_table(
    anneal_budget_s: float = 30.0,
    finetune_s: float = 30.0,
    seed: int = 0,
    problems: list[tuple[str, PlacementProblem]] | None = None,
) -> list[dict[str, Any]]:
    """One row per held-out problem: ``gnn`` zero-shot (step time, seconds), ``gnn`` with
    ``--finetune finetune_s``, ``anneal`` with ``anneal_budget_s``, ``expert``, and the
    gaps to ``anneal`` in percent (positive = slower than anneal). Call it in a process
    that has placed once already (numba compiles the decoder on first use, ~5 s)."""
    from meshplace.placers.base import PlacerOptions

    rows = []
    for label, problem in problems or held_out_problems():
        zs = run_placer("gnn", problem, 1.0, seed)
        ft = run_placer("gnn", problem, finetune_s, seed, PlacerOptions(finetune_s=finetune_s))
        an = run_placer("anneal", problem, anneal_budget_s, seed)
        ex = run_placer("expert", problem, 1.0, seed)
        rows.append(
            {
                "problem": label,
                "groups": problem.num_groups,
                "devices": problem.num_devices,
                "gnn_zero_shot_step_s": zs.step_time_s,
                "gnn_zero_shot_s": zs.stats["zero_shot_s"],
                "gnn_finetune_step_s": ft.step_time_s,
                "gnn_finetune_updates": ft.stats["finetune_updates"],
                "gnn_finetune_s": ft.search_time_s,
                "anneal_step_s": an.step_time_s,
                "anneal_s": an.search_time_s,
                "expert_step_s": ex.step_time_s,
                "zero_shot_gap_pct": 100.0 * (zs.step_time_s / an.step_time_s - 1.0),
                "finetune_gap_pct": 100.0 * (ft.step_time_s / an.step_time_s - 1.0),
            }
        )
    return rows


def _family(log: Any) -> list[tuple[str, PlacementProblem]]:
    out = []
    for label, spec, cluster in training_specs():
        start = time.perf_counter()
        try:
            problem = build_problem(spec, cluster)
            problem.check_fits_somewhere()
        except PlacerError as exc:
            log(f"skip {label}: {exc}")
            continue
        out.append((label, problem))
        log(
            f"{label}: {problem.num_groups} groups, {problem.num_devices} devices "
            f"({time.perf_counter() - start:.1f} s)"
        )
    return out


def train(
    out: str | Path,
    budget_s: float,
    seed: int,
    *,
    updates: int | None = None,
    config: GNNConfig | None = None,
    ppo: PPOConfig | None = None,
    specs: list[tuple[str, GraphSpec, str]] | None = None,
    command: str = "",
    log: Any = print,
) -> dict[str, Any]:
    """Train a :class:`GNNPolicy` on the family (or ``specs``) and save it to ``out``.

    The budget fixes the number of updates (``budget_s / UPDATE_S``) unless ``updates`` is
    given; weights are saved every 100 updates and at the end. Returns the training record
    stored with the weights.
    """
    config = config or GNNConfig()
    ppo = ppo or PPOConfig()
    total = int(updates) if updates is not None else max(1, int(budget_s / UPDATE_S))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        if specs is None:
            family = _family(log)
        else:
            family = [(label, build_problem(s, c)) for label, s, c in specs]
        inputs = [problem_inputs(p) for _, p in family]
        reference = [run_placer("heft", p, 1.0, 0).sim.value for _, p in family]
        log(f"{len(family)} problems, {total} updates ({time.perf_counter() - start:.0f} s)")
        torch.manual_seed(seed)
        policy = GNNPolicy(config)
        optimizer = torch.optim.Adam(policy.parameters(), lr=ppo.learning_rate)
        record: dict[str, Any] = {
            "command": command,
            "seed": seed,
            "updates": total,
            "config": asdict(config),
            "ppo": asdict(ppo),
            "problems_per_update": PROBLEMS_PER_UPDATE,
            "family": [label for label, _ in family],
            "held_out": [f"{s.label}@{c}" for s, c in HELD_OUT],
            "torch": torch.__version__,
        }
        ratios: list[float] = []
        for done in range(total):
            rng = np.random.default_rng([seed, done])
            picks = rng.choice(
                len(family), size=min(PROBLEMS_PER_UPDATE, len(family)), replace=False
            )
            batch = []
            for i in picks.tolist():
                _, problem = family[i]
                rollout = decode(policy, inputs[i], ppo.samples, rng)
                scores, _, _ = score_and_step_batch(problem, rollout.group_devices)
                batch.append((inputs[i], rollout, advantages(scores)))
                ratios.append(float(np.mean(scores)) / reference[i])
            ppo_update(policy, optimizer, batch, ppo)
            if (done + 1) % 25 == 0 or done + 1 == total:
                log(
                    f"update {done + 1}/{total}: mean sampled score / heft = "
                    f"{np.mean(ratios):.3f} ({time.perf_counter() - start:.0f} s)"
                )
                ratios = []
            if (done + 1) % 100 == 0 or done + 1 == total:
                record["wall_s"] = time.perf_counter() - start
                record["updates_done"] = done + 1
                save_weights(out, policy, record)
    finally:
        torch.set_num_threads(threads)
    return record


def main(argv: list[str] | None = None) -> int:
    """``python -m meshplace.learn.train_gnn --out FILE --budget SECONDS --seed N``."""
    parser = argparse.ArgumentParser(prog="python -m meshplace.learn.train_gnn")
    parser.add_argument("--out", required=True, help="weights file to write (.pt)")
    parser.add_argument("--budget", type=float, default=1500.0, help="seconds (-> updates)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--updates", type=int, default=None, help="exact number of updates")
    parser.add_argument(
        "--workloads",
        default=None,
        help="comma-separated workloads to keep from the family (default: all)",
    )
    parser.add_argument("--evaluate", action="store_true", help="held-out zero-shot check")
    args = parser.parse_args(argv)
    specs = None
    if args.workloads:
        keep = set(args.workloads.split(","))
        specs = [t for t in training_specs() if t[1].workload in keep]
    command = "python -m meshplace.learn.train_gnn " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    train(args.out, args.budget, args.seed, updates=args.updates, specs=specs, command=command)
    if args.evaluate:
        policy, _ = load_weights(args.out)
        from meshplace.learn.gnn import zero_shot

        for label, problem in held_out_problems():
            z = zero_shot(problem, policy, 0)
            heft = run_placer("heft", problem, 1.0, 0).step_time_s
            print(f"{label}: zero-shot {z.stats['zero_shot_step_time_s']:.4f} s, heft {heft:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
