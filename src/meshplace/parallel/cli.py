"""``meshplace shard`` for any model: the captured-graph sharding search, or the hand-written
named-dimension programs (:mod:`meshplace.mesh.cli`) where one exists.

``--method auto`` (the default) uses a named-dimension program for the four models that
have one (``transformer``, ``gpt``, ``resnet50``, ``detection``) and the captured graph
(:func:`meshplace.parallel.search.shard_graph`) for everything else — every reference
workload, a saved ``graph.json`` and a ``file.py:build`` model; ``--method graph`` forces
the captured graph. The captured path prints the mesh, step time, memory per device
against capacity, per-parameter placements (DTensor placements and the weight-update
sharding stage), the ops taking the most time and their strategies, the collectives, and
the runner-up meshes; ``--json`` prints the same as one object and ``--out`` writes the
plan file (``meshplace.parallel_plan``, ``docs/formats.md``).

Bad input (a mesh that does not match the chips, a memory fraction outside (0, 1], a model
no plan fits) is one sentence and exit status 2.

Example
-------
>>> import argparse, contextlib, io, json
>>> ns = argparse.Namespace(model="dmcca", cluster="dgx-h100", chips=4, json=True)
>>> buf = io.StringIO()
>>> with contextlib.redirect_stdout(buf):
...     code = cmd_shard(ns)
>>> data = json.loads(buf.getvalue())
>>> code, data["method"], data["fits"], data["chips"]
(0, 'graph', True, 4)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from meshplace.errors import InputError
from meshplace.mesh import cli as mesh_cli
from meshplace.mesh.cli import format_gib as gib
from meshplace.mesh.cli import format_ms as ms
from meshplace.mesh.layout import mesh_and_chips
from meshplace.mesh.program import PROGRAM_MODELS
from meshplace.parallel.sharding import COMPUTE_MODELS
from meshplace.util import check_output_paths, dumps_strict_json, print_json, write_text_atomic

METHODS = ("auto", "graph", "program")
CAPTURE_OPTIMIZERS = ("adam", "momentum", "sgd")


def add_shard_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``shard`` arguments: the named-dimension search's plus the captured graph's."""
    mesh_cli.add_shard_arguments(
        parser,
        model_help="reference workload, graph.json or file.py:build (transformer, gpt, "
        "resnet50 and detection also have hand-written named-dimension programs)",
    )
    parser.add_argument(
        "--method",
        choices=list(METHODS),
        default="auto",
        help="graph: shard the captured graph (any model); program: a named-dimension "
        "program; auto: program where one exists, else graph",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=1.0,
        help="share of each device's memory a plan may use (0 < f <= 1, default 1)",
    )
    parser.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], help="cast the model before capture"
    )
    parser.add_argument(
        "--autocast", choices=["bf16", "fp16"], help="capture the forward under autocast"
    )
    parser.add_argument("--no-cache", action="store_true", help="capture a file.py model afresh")
    parser.add_argument(
        "--compute",
        choices=list(COMPUTE_MODELS),
        default="eager",
        help="eager: every op its own kernel (PyTorch eager); fused: point-wise chains and "
        "optimizer updates one kernel each (torch.compile, XLA) (default eager)",
    )
    parser.add_argument(
        "--no-tie",
        action="store_true",
        help="decide every layer on its own (default: identical layers share a decision)",
    )
    parser.add_argument(
        "--pipeline",
        choices=["off", "auto"],
        default="off",
        help="auto: choose data, tensor and pipeline parallelism, ZeRO stage, micro-batches, "
        "schedule and recomputation jointly, stages cut between identical layers (gpt) or "
        "between a model's blocks (resnet50, encoder-decoder); needs --global-batch",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step, for --pipeline auto",
    )
    parser.add_argument(
        "--style",
        choices=["joint", "megatron"],
        default="joint",
        help="--pipeline auto: joint search (default) or a Megatron-style grid (equal stages, "
        "Megatron's tensor-parallel pattern, one recomputation, ZeRO 0/1) scored alike",
    )
    parser.add_argument(
        "--engine-costs",
        action="store_true",
        help="FILE.py:build models: price plans by the program the torchrun runtime runs "
        "for them (a dry run on a fake process group, seconds each) rather than by the "
        "solver's op strategies; without --pipeline, rank the solver's plan of every mesh "
        "and every Megatron grid point (data x tensor parallel x ZeRO) that fits this way "
        "and keep the fastest; with --pipeline auto, price tensor parallelism per degree "
        "and micro-batch",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        help="a calibration file (meshplace run --calibration-out): its measured "
        "efficiencies and launch cost replace the roofline's defaults on its device kind "
        "(both methods)",
    )


def memory_fraction_of(args: argparse.Namespace) -> float:
    """``--memory-fraction`` (default 1), checked to lie in (0, 1]."""
    fraction = getattr(args, "memory_fraction", 1.0)
    fraction = 1.0 if fraction is None else fraction
    if not 0 < fraction <= 1:
        raise InputError(
            f"--memory-fraction {fraction}: must be greater than 0 and at most 1 (the share "
            "of each device's memory a plan may use)"
        )
    return fraction


def zero_stages_of(args: argparse.Namespace) -> tuple[int, ...]:
    """The ZeRO stages ``--weight-update-sharding`` lets a plan use: ``auto`` 0-3, ``on``
    1-3, ``off`` 0."""
    wus = getattr(args, "weight_update_sharding", "auto") or "auto"
    return {"auto": (0, 1, 2, 3), "on": (1, 2, 3), "off": (0,)}[wus]


def calibrated_cost_model_of(args: argparse.Namespace, cluster: Any) -> Any:
    """The cost model ``--calibration FILE`` gives on ``cluster`` (``None`` without it)."""
    if not getattr(args, "calibration", None):
        return None
    from meshplace.cost.calibration import calibrated_cost_model, load_calibration

    return calibrated_cost_model(load_calibration(args.calibration), cluster)


def _method(args: argparse.Namespace) -> str:
    method = getattr(args, "method", "auto") or "auto"
    if method not in METHODS:
        raise InputError(f"--method {method!r}: choose one of {', '.join(METHODS)}")
    if method == "program" and args.model not in PROGRAM_MODELS:
        raise InputError(
            f"--method program: {args.model!r} has no named-dimension program (those are: "
            f"{', '.join(PROGRAM_MODELS)}); use --method graph"
        )
    if method == "auto":
        return "program" if args.model in PROGRAM_MODELS else "graph"
    return method


def check_engine_costs(model: str, pricer: Callable[..., Any] | None) -> None:
    """``--engine-costs`` needs a ``FILE.py:build`` model (the dry run builds it under the
    torchrun runtime) and the runtime's pricer: one :class:`InputError` otherwise."""
    from meshplace.models import available

    if model in available() or model.endswith(".json"):
        raise InputError(
            f"--engine-costs dry-runs the model under the torchrun runtime, which builds a "
            f"FILE.py:build model; {model!r} is not one"
        )
    if pricer is None:
        raise InputError("--engine-costs needs the torchrun runtime (meshplace.runtime)")


def cmd_shard(
    args: argparse.Namespace,
    engine_pricer: Callable[..., Any] | None = None,
    plan_pricer: Callable[..., Any] | None = None,
) -> int:
    """``meshplace shard``: dispatch to the program search or the captured-graph search
    (or, with ``--pipeline auto``, the hybrid search). What ``--engine-costs`` prices
    with is given by the command line above this package: ``engine_pricer``
    (:func:`meshplace.runtime.dryrun.engine_pricer`) for the hybrid search,
    ``plan_pricer`` (:func:`meshplace.runtime.dryrun.plan_prices`) for the
    captured-graph search (:func:`rank_by_engine`)."""
    if getattr(args, "pipeline", "off") == "auto":
        return cmd_hybrid(args, engine_pricer)
    engine_costs = bool(getattr(args, "engine_costs", False))
    if engine_costs:
        check_engine_costs(args.model, plan_pricer)
    if getattr(args, "global_batch", None) is not None:
        raise InputError("--global-batch applies to --pipeline auto; use --batch otherwise")
    if getattr(args, "style", "joint") == "megatron":
        raise InputError("--style applies to --pipeline auto")
    if _method(args) == "program":
        return mesh_cli.cmd_shard(args)
    out = getattr(args, "out", None)
    check_output_paths({"--out": out}, inputs=[args.model, args.cluster])
    result, data = shard_captured(args)
    best, engine_cost = result.best, None
    if engine_costs:
        assert plan_pricer is not None  # check_engine_costs
        started = time.perf_counter()
        best, ranking, unplanned = rank_by_engine(args, result, plan_pricer)
        # the grid's integer programs and one dry run per distinct plan
        data["search"]["engine_seconds"] = time.perf_counter() - started
        data["search"]["dry_runs"] = len(ranking)
        engine_cost = next(r["engine"] for r in ranking if r["chosen"])
        data.update(best.to_dict())
        data["engine"] = engine_cost
        data["engine_ranking"] = ranking
        data["grid_unplanned"] = unplanned
        data["search"]["ranked_by"] = "engine dry run"
    else:
        data["search"]["ranked_by"] = "solver"
    if out:
        plan = best.plan_file(args.model, data["cluster"])
        if engine_cost is not None:
            plan["predicted"]["engine"] = engine_cost
        write_text_atomic(out, dumps_strict_json(plan) + "\n")
    if getattr(args, "json", False):
        print_json(data)
    else:
        console = Console()
        print_captured(console, result, data, best)
        if engine_costs:
            print_engine_ranking(console, data["engine_ranking"])
            console.print(
                f"ranked by {data['search']['dry_runs']} dry runs in "
                f"{data['search']['engine_seconds']:.1f} s (the grid's plans included)",
                highlight=False,
            )
            for u in unplanned:
                line = f"{u['plan']}: no plan ({u['reason']})"
                console.print(line, highlight=False, markup=False)
    return 0


def rank_by_engine(
    args: argparse.Namespace, result: Any, pricer: Callable[..., Any]
) -> tuple[Any, list[dict[str, Any]], list[dict[str, str]]]:
    """``meshplace shard FILE.py:build --engine-costs``: the candidates — the solver's
    plan of every mesh it tried and every point of the Megatron grid
    (:func:`meshplace.parallel.grid.megatron_grid`: data x tensor parallel x ZeRO, the
    plans users write by hand; each tensor-parallel point both with the matrices split as
    the integer program prefers and with Megatron's own layout,
    :func:`meshplace.parallel.grid.megatron_layers`) on the same chips, those that fit,
    each distinct plan once — priced by ``pricer(plan documents, model, cluster, cost model)``
    (:func:`meshplace.runtime.dryrun.plan_prices`: what the torchrun runtime runs for
    each, costed by the same cost model) and ranked by that price.

    Why: the solver prices its own op strategies, but the runtime places the parameters
    and lets PyTorch run the model — DTensor choosing each op's placement, data-parallel
    plans on DDP or FSDP2 — so the program that runs, and what it costs, can differ from
    the one the solver priced, and so can the order of the candidates (docs/parallel.md).
    With ``--mesh`` or ``--rules`` the grid, which knows neither, is left out.

    Returns the fastest candidate that its engine runs; the ranking, fastest first: per
    candidate its ``plan`` label (``"solver 2x4"``, ``"dp2 x tp1 zero3"``; ``same_as``
    lists other candidates with the same placements), ``mesh``, ``solver_step_s``,
    ``engine`` (the price's parts) or ``error`` (why its engine cannot run it), and
    ``chosen``; and the grid points without a plan that fits, each ``plan`` and
    ``reason`` (a batch the data axis does not divide). Raises :class:`InputError`, naming
    the first of both, when no candidate runs. O(candidates) integer programs and dry
    runs."""
    from meshplace.cost.compute import CostModel
    from meshplace.hardware import load_cluster
    from meshplace.parallel.grid import megatron_grid

    cluster = load_cluster(args.cluster)
    cost_model = calibrated_cost_model_of(args, cluster)
    candidates = [(f"solver {c.mesh.label}", c) for c in result.candidates if c.fits]
    unplanned: list[dict[str, str]] = []
    if not getattr(args, "mesh", None) and not getattr(args, "rules", None):
        grid = megatron_grid(
            result.best.problem.graph,
            cluster,
            chips=result.chips,
            memory_fraction=memory_fraction_of(args),
            zero_stages=zero_stages_of(args),
            compute=getattr(args, "compute", "eager") or "eager",
            cost_model=cost_model,
            layouts=("free", "megatron"),
        )
        candidates += [(p.label, p.plan) for p in grid.points if p.fits]
        unplanned = [
            {"plan": p.label, "reason": p.reason or "does not fit"}
            for p in grid.points
            if not p.fits
        ]
    distinct: dict[str, int] = {}
    entries: list[dict[str, Any]] = []
    plans: list[Any] = []
    documents: list[dict[str, Any]] = []
    for label, plan in candidates:
        document = plan.plan_file(args.model, cluster.name)
        key = json.dumps([document["mesh"], document["parameters"], document["inputs"]])
        if key in distinct:
            entries[distinct[key]]["same_as"].append(label)
            continue
        distinct[key] = len(entries)
        entries.append(
            {"plan": label, "mesh": plan.mesh.label, "solver_step_s": plan.step_time_s,
             "same_as": []}
        )  # fmt: skip
        plans.append(plan)
        documents.append(document)
    costs = pricer(documents, args.model, cluster, cost_model or CostModel())
    for entry, cost in zip(entries, costs, strict=True):
        if isinstance(cost, str):
            entry["error"] = cost
        else:
            entry["engine"] = cost
    priced = [i for i, e in enumerate(entries) if "engine" in e]
    if not priced:
        why = [f"{e['plan']}: {e['error']}" for e in entries[:3]]
        why += [f"{u['plan']}: no plan ({u['reason']})" for u in unplanned[:1]]
        raise InputError("no candidate plan runs on its engine: " + "; ".join(why))
    order = sorted(priced, key=lambda i: entries[i]["engine"]["step_s"])
    order += [i for i in range(len(entries)) if i not in priced]
    for rank, i in enumerate(order):
        entries[i]["chosen"] = rank == 0
    return plans[order[0]], [entries[i] for i in order], unplanned


def print_engine_ranking(console: Console, ranking: list[dict[str, Any]]) -> None:
    """The table of ``--engine-costs``: every candidate's price as its engine runs it
    (and its parts) beside the solver's; ``*`` marks the plan kept."""
    table = Table(
        title="step time (ms) as the torchrun runtime runs each candidate (* kept), and as "
        "the solver priced it",
        title_justify="left",
    )
    columns = ("plan", "mesh", "engine", "compute", "dispatch", "comm.", "skew", "solver")
    for col in columns:
        left = col in ("plan", "mesh")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for r in ranking:
        label = ("* " if r["chosen"] else "  ") + r["plan"]
        label += f" (= {', '.join(r['same_as'])})" if r["same_as"] else ""
        solver = f"{r['solver_step_s'] * 1e3:.3f}"
        if "engine" in r:
            e = r["engine"]
            parts = (e["step_s"], e["compute_s"], e["dispatch_s"], e["communication_s"])
            parts += (e.get("sync_s", 0.0),)  # waiting for the slowest rank
            table.add_row(label, r["mesh"], *(f"{x * 1e3:.3f}" for x in parts), solver)
        else:
            table.add_row(label, r["mesh"], "cannot run", "", "", "", "", solver)
    console.print(table)
    for r in ranking:
        if "error" in r:
            console.print(f"{r['plan']} cannot run: {r['error']}", highlight=False, markup=False)


def shard_captured(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Capture (or load) the model and run :func:`meshplace.parallel.search.shard_graph`."""
    from meshplace.graph.sources import graph_source
    from meshplace.hardware import load_cluster
    from meshplace.parallel.search import shard_graph

    get = getattr
    fraction = memory_fraction_of(args)
    optimizer = get(args, "optimizer", None) or "adam"
    if optimizer not in CAPTURE_OPTIMIZERS:
        raise InputError(
            f"--optimizer {optimizer}: a captured graph's update is one of "
            f"{', '.join(CAPTURE_OPTIMIZERS)} (lars and adafactor exist for the "
            "named-dimension programs only)"
        )
    stages = zero_stages_of(args)
    cluster = load_cluster(args.cluster)
    cost_model = calibrated_cost_model_of(args, cluster)
    chips = get(args, "chips", None)
    shape = mesh_and_chips(get(args, "mesh", None), chips)
    console = Console(stderr=True)
    with console.status(f"capturing {args.model}…", spinner="dots") as status:
        source = graph_source(
            args.model,
            batch=get(args, "batch", None),
            size=get(args, "size", None),
            training=True,
            optimizer=optimizer,
            dtype=get(args, "dtype", None),
            autocast=get(args, "autocast", None),
            cache=not get(args, "no_cache", False),
        )
        for note in source.notes:
            console.print(f"meshplace: note: {note}", highlight=False, markup=False)
        graph = source.graph
        status.update(f"sharding {graph.name} on {cluster.name}…")
        result = shard_graph(
            graph,
            cluster,
            chips=chips,
            mesh_shape=shape,
            max_axes=get(args, "max_axes", 2) or 2,
            memory_fraction=fraction,
            zero_stages=stages,
            tie_layers=not get(args, "no_tie", False),
            compute=get(args, "compute", "eager") or "eager",
            pinned=mesh_cli.parse_rules(get(args, "rules", None)),
            cost_model=cost_model,
            progress=lambda m: status.update(f"sharding {graph.name} on {cluster.name}: {m}…"),
        )
    best = result.best
    top = max(1, get(args, "top", 5) or 5)
    data: dict[str, Any] = {
        "method": "graph",
        "model": args.model,
        "graph": graph.name,
        "ops": graph.num_ops,
        "cluster": cluster.name,
        "chips": result.chips,
        "parameters_count": graph.meta.get("params"),
        "optimizer": graph.meta.get("optimizer"),
        **best.to_dict(),
        "runners_up": [
            {
                "mesh": c.mesh.label,
                "step_time_s": c.step_time_s,
                "slowdown": c.step_time_s / best.step_time_s if best.step_time_s else 0.0,
                "peak_memory_bytes": c.peak_memory_bytes,
                "fits": c.fits,
            }
            for c in result.candidates[1:top]
        ],
        "search": {
            "seconds": result.seconds,
            "mesh_shapes": ["x".join(map(str, s)) for s in result.mesh_shapes],
            "failed": result.failures,
        },
    }
    return result, data


def print_captured(console: Console, result: Any, data: dict[str, Any], best: Any = None) -> None:
    """The tables of ``meshplace shard`` on a captured graph: of ``best`` (default the
    solver's best plan)."""
    best = result.best if best is None else best
    mesh = best.mesh
    head = mesh_cli.mesh_table(
        f"{data['graph']} ({data['ops']:,} ops) on {data['chips']} chips of {data['cluster']}",
        mesh,
    )
    head.add_row(
        "step time",
        f"[bold]{ms(best.step_time_s)}[/bold] = compute {ms(best.compute_s)} + exposed "
        f"communication {ms(best.exposed_communication_s)} (of {ms(best.communication_s)}: "
        f"reductions {ms(best.timeline.get('backward_stream_s', 0.0))} behind backward, "
        f"gathers {ms(best.timeline.get('forward_gathers_s', 0.0))} ahead of forward)"
        + (
            f" + waiting for the slowest rank {ms(best.timeline['sync_s'])}"
            if best.timeline.get("sync_s")
            else ""
        ),
    )
    solver = data["solver"]
    head.add_row(
        "search",
        f"meshes {', '.join(data['search']['mesh_shapes'])} in {result.seconds:.2f} s; "
        f"{solver['groups']:,} op groups in {solver['classes']:,} classes, "
        f"{solver['variables']:,} variables, {solver['status']}",
    )
    if data["replicated_ops"]:
        names = ", ".join(data["replicated_ops"][:5])
        more = len(data["replicated_ops"]) - 5
        head.add_row("replicated (no rule)", names + (f" and {more} more" if more > 0 else ""))
    console.print(head)

    mem = Table(title="memory per device", title_justify="left")
    mem.add_column("part")
    mem.add_column("bytes", justify="right")
    for k, v in best.memory_bytes.items():
        mem.add_row(k.replace("_", " "), gib(v))
    mem.add_row(*mesh_cli.peak_row(best.peak_memory_bytes, best.capacity_bytes, best.fits))
    console.print(mem)

    params = Table(title="parameters (largest first)", title_justify="left")
    for col in ("parameter", "shape", "placements", "update sharding"):
        params.add_column(col)
    rows = sorted(data["parameters"].items(), key=lambda kv: -kv[1]["local_bytes"])
    for name, p in rows[:12]:
        params.add_row(
            name,
            "x".join(map(str, p["shape"])),
            ", ".join(p["placements"]),
            f"ZeRO-{p['zero']}" if p["zero"] else "replicated",
        )
    if len(rows) > 12:
        params.add_row(f"… {len(rows) - 12} more (--json or --out)", "", "", "")
    console.print(params)

    ops = Table(title="ops taking the most time", title_justify="left")
    for col in ("op", "module", "phase", "index notation", "strategy", "time"):
        ops.add_column(col, justify="right" if col == "time" else "left")
    for r in data["top_ops"]:
        ops.add_row(
            r["op"],
            r["module"],
            r["phase"],
            r["einsum"] or "-",
            r["strategy"],
            ms(r["seconds"]),
        )
    console.print(ops)

    coll = Table(title="collectives (per device, per step)", title_justify="left")
    for col in ("category", "kind", "axis", "calls", "bytes", "time"):
        coll.add_column(col, justify="right" if col in ("calls", "bytes", "time") else "left")
    for c in data["collectives"][:10]:
        coll.add_row(
            c["category"],
            c["kind"].replace("_", "-"),
            c["axis"],
            f"{c['calls']:,}",
            f"{c['bytes'] / 1e6:,.1f} MB",
            ms(c["seconds"]),
        )
    if not data["collectives"]:
        coll.add_row("(none)", "", "", "", "", "")
    console.print(coll)

    if data["runners_up"]:
        ru = Table(title="runner-up meshes", title_justify="left")
        for col in ("mesh", "step", "vs best", "peak memory", "fits"):
            ru.add_column(col, justify="left" if col == "mesh" else "right")
        for c in data["runners_up"]:
            ru.add_row(
                c["mesh"],
                ms(c["step_time_s"]),
                f"{c['slowdown']:.3f}x",
                gib(c["peak_memory_bytes"]),
                "yes" if c["fits"] else "no",
            )
        console.print(ru)


# ----------------------------------------------------------------- --pipeline auto
def cmd_hybrid(args: argparse.Namespace, engine_pricer: Callable[..., Any] | None = None) -> int:
    """``meshplace shard MODEL --pipeline auto --global-batch B``: the joint search of
    :mod:`meshplace.parallel.hybrid`, printed (or ``--json``) and written (``--out``);
    ``--engine-costs``: tensor parallelism priced by ``engine_pricer(model, cluster,
    cost model, global_batch=B)`` (:func:`meshplace.runtime.dryrun.engine_pricer`)."""
    from meshplace.hardware import load_cluster
    from meshplace.models import available, varies_depth
    from meshplace.parallel.hybrid import hybrid_search

    get = getattr
    out = get(args, "out", None)
    check_output_paths({"--out": out}, inputs=[args.cluster, args.model])
    batch = get(args, "global_batch", None)
    if batch is None:
        raise InputError("--pipeline auto needs --global-batch (sequences per optimizer step)")
    if batch < 1:
        raise InputError(f"--global-batch {batch}: must be a positive number of sequences")
    if get(args, "batch", None) is not None:
        raise InputError("--pipeline auto takes --global-batch, not --batch")
    if get(args, "mesh", None):
        raise InputError("--pipeline auto chooses the mesh itself; leave out --mesh")
    for flag, value, default in (
        ("--dtype", get(args, "dtype", None), None),
        ("--rules", get(args, "rules", None), None),
        ("--no-tie", get(args, "no_tie", False), False),
        ("--method", get(args, "method", "auto"), "auto"),
        ("--optimizer", get(args, "optimizer", None) or "adam", "adam"),
    ):
        if value != default:
            raise InputError(
                f"{flag} does not apply to --pipeline auto (it captures the model's layers "
                "with Adam under --autocast, default bf16, and ties identical layers)"
            )
    zero_stages = zero_stages_of(args)
    engine_costs = bool(get(args, "engine_costs", False))
    if engine_costs:
        check_engine_costs(args.model, engine_pricer)
    fraction = memory_fraction_of(args)
    cluster = load_cluster(args.cluster)
    cost_model = calibrated_cost_model_of(args, cluster)
    if engine_costs:
        from meshplace.cost.compute import CostModel

        fixed_engine = {
            "engine": engine_pricer(
                args.model, cluster, cost_model or CostModel(), global_batch=batch
            )
        }
    else:
        fixed_engine = {}
    console = Console(stderr=True)
    autocast = get(args, "autocast", None) or "bf16"
    with console.status(f"searching {args.model}…", spinner="dots") as status:
        fixed: dict[str, Any] = {}
        if not varies_depth(args.model):
            from meshplace.graph.sources import graph_source
            from meshplace.parallel.hybrid import graph_batch

            def captured(batch: int | None) -> Any:
                status.update(f"capturing {args.model}…")
                source = graph_source(
                    args.model,
                    batch=batch,
                    size=get(args, "size", None),
                    training=True,
                    autocast=autocast,
                    cache=not get(args, "no_cache", False),
                )
                for note in source.notes:
                    console.print(f"meshplace: note: {note}", highlight=False, markup=False)
                return source.graph

            if args.model in available() or not args.model.endswith(".json"):
                # a reference workload of fixed depth (its builder takes the batch) or a
                # FILE.py:build model (the first rows of its inputs): the whole model,
                # captured at each micro-batch size; its own layer stack, or its units
                # where its layers differ (ResNet's stages, encoder-decoder)
                fixed = {"graphs": captured}
            else:
                # a saved graph: its own capture, at its own batch as the micro-batch
                graph = captured(None)
                fixed = {"graphs": lambda b: graph, "micro_batch_sizes": (graph_batch(graph),)}
        result = hybrid_search(
            args.model,
            get(args, "size", None),
            cluster,
            global_batch=batch,
            chips=get(args, "chips", None),
            memory_fraction=fraction,
            autocast=autocast,
            cost_model=cost_model,
            compute=get(args, "compute", "eager") or "eager",
            zero_stages=zero_stages,
            style=get(args, "style", "joint") or "joint",
            progress=lambda m: status.update(f"searching {args.model}: {m}…"),
            **fixed,
            **fixed_engine,
        )
    best = result.best
    top = max(1, get(args, "top", 5) or 5)
    others = [p for p in result.plans if p is not best and not math.isnan(p.time_per_batch_s)]
    data: dict[str, Any] = {
        "method": "hybrid",
        "style": get(args, "style", "joint") or "joint",
        "model": result.model,
        "cluster": cluster.name,
        "chips": result.chips,
        "global_batch": result.global_batch,
        "layers": result.layers,
        **({"units": result.units} if result.units else {}),
        "best": best.to_dict(),
        "runners_up": [
            {k: v for k, v in p.to_dict().items() if k != "schedule_tasks"}
            for p in others[: top - 1]
        ],
        "search": {
            "seconds": result.search_s,
            "tensor_parallelism_priced_by": (
                "engine dry run" if engine_costs and not result.units else "solver"
            ),
            "sharding_solves": result.solves,
            "configurations": result.configurations,
            "skipped": result.skipped,
        },
    }
    if out:
        write_text_atomic(
            out, dumps_strict_json(hybrid_plan_file(result, best, cluster.name)) + "\n"
        )
        data["out"] = out
    if get(args, "json", False):
        print_json(data)
    else:
        print_hybrid(Console(), data)
    return 0


def stage_parameters(tensor_placements: dict[str, str], zero: int) -> dict[str, Any]:
    """A hybrid plan file's ``parameters``: each parameter replicated over a stage's data
    axis, placed on its tensor axis as ``tensor_placements`` says, under ZeRO ``zero``.

    >>> stage_parameters({"w": "Shard(0)"}, 1)
    {'w': {'placements': ['Replicate()', 'Shard(0)'], 'zero': 1}}
    """
    return {
        name: {"placements": ["Replicate()", placement], "zero": zero}
        for name, placement in sorted(tensor_placements.items())
    }


def hybrid_plan_file(result: Any, plan: Any, cluster: str) -> dict[str, Any]:
    """The hybrid plan as a ``meshplace.parallel_plan`` document with its ``stages``."""
    from meshplace.parallel.hybrid import INTERLEAVE_CHUNKS

    c = plan.config
    stages = []
    first = 0
    size = c.dp * c.tp
    # interleaved: device i runs virtual stages i, i + pp, ..., each an equal run of layers
    chunks = INTERLEAVE_CHUNKS if c.schedule == "interleaved" and not plan.stage_units else 1
    per_chunk = result.layers // (c.pp * chunks) if chunks > 1 else 0
    for i, (k, r) in enumerate(zip(plan.layers_per_stage, plan.recompute, strict=True)):
        runs = [[(j * c.pp + i) * per_chunk, (j * c.pp + i + 1) * per_chunk] for j in range(chunks)]
        stages.append(
            {
                "layers": runs[0] if chunks > 1 else [first, first + k],
                **({"chunks": runs} if chunks > 1 else {}),
                **({"units": plan.stage_units[i]} if plan.stage_units else {}),
                "embedding": i == 0,
                "head": i == c.pp - 1,
                "recompute": r,
                "devices": list(range(i * size, (i + 1) * size)),
                "forward_s": plan.stage_forward_s[i],
                "backward_s": plan.stage_backward_s[i],
                "memory_bytes": plan.stage_memory_bytes[i],
                # a device's parameter, gradient and optimizer-state bytes after ZeRO
                **({"held_bytes": plan.stage_held_bytes[i]} if plan.stage_held_bytes else {}),
            }
        )
        first += k
    return {
        "format": "meshplace.parallel_plan",
        "version": 1,
        "graph": {
            "source": result.model,
            "name": result.model,
            "layers": result.layers,
            **({"units": result.units} if result.units else {}),
            **({"layer_container": result.layer_container} if result.layer_container else {}),
        },
        "cluster": cluster,
        "mesh": {"shape": [c.pp, c.dp, c.tp], "axes": ["pipe", "data", "tensor"]},
        # inside each stage: the stage's (data, tensor) mesh; a parameter's placements
        # are over it (replicated over data, weight-update sharded by `zero`)
        "stage_mesh": {"shape": [c.dp, c.tp], "axes": ["data", "tensor"]},
        "parameters": stage_parameters(plan.tensor_placements, c.zero),
        "inputs": {},
        "ops": plan.strategies,
        "stages": stages,
        "pipeline": {
            "global_batch": result.global_batch,
            "micro_batch": c.micro_batch,
            "micro_batches": c.micro_batches,
            "schedule": c.schedule,
            "zero": c.zero,
            "virtual_stages": chunks,
        },
        "predicted": {
            "time_per_batch_s": plan.time_per_batch_s,
            "bubble_fraction": plan.bubble_fraction,
            "mfu": plan.mfu,
            "peak_memory_bytes": max(plan.stage_memory_bytes),
            "capacity_bytes": plan.capacity_bytes,
        },
    }


def one_stage_plan_file(
    parts: Any, layers: int, container: str, global_batch: int, source: str
) -> dict[str, Any]:
    """A hybrid plan document of one stage over ``parts.tp`` devices (no data
    parallelism, no ZeRO, no recomputation): the model of ``source`` (``layers`` layers
    under ``container``) with the parameter placements of ``parts`` (a
    :class:`meshplace.parallel.hybrid.PartCosts`), its ``global_batch`` in micro-batches
    of ``parts.micro_batch`` under 1F1B — what a dry run of the engine records for that
    (tp, micro-batch). O(parameters)."""
    return {
        "format": "meshplace.parallel_plan",
        "version": 1,
        "graph": {"source": source, "name": source, "layers": layers, "layer_container": container},
        "mesh": {"shape": [1, 1, parts.tp], "axes": ["pipe", "data", "tensor"]},
        "stage_mesh": {"shape": [1, parts.tp], "axes": ["data", "tensor"]},
        "parameters": stage_parameters(parts.tensor_placements, 0),
        "inputs": {},
        "stages": [
            {
                "layers": [0, layers],
                "embedding": True,
                "head": True,
                "recompute": "none",
                "devices": list(range(parts.tp)),
            }
        ],
        "pipeline": {
            "global_batch": global_batch,
            "micro_batch": parts.micro_batch,
            "micro_batches": global_batch // parts.micro_batch,
            "schedule": "1f1b",
            "zero": 0,
            "virtual_stages": 1,
        },
    }


def print_hybrid(console: Console, data: dict[str, Any]) -> None:
    """The tables of ``meshplace shard --pipeline auto``."""
    b = data["best"]
    head = Table(
        title=f"{data['model']} ({data['layers']} {'units' if data.get('units') else 'layers'}) "
        f"on {data['chips']} chips of "
        f"{data['cluster']}, global batch {data['global_batch']}",
        title_justify="left",
        show_header=False,
    )
    head.add_column("what")
    head.add_column("value")
    layout = {"megatron": ", Megatron's layout", "solver": ", the solver's layout"}
    head.add_row(
        "degrees",
        f"data {b['dp']} x tensor {b['tp']} x pipeline {b['pp']}"
        + (layout.get(b.get("tensor_layout", ""), "") if b["tp"] > 1 else ""),
    )
    head.add_row(
        "micro-batches",
        f"{b['micro_batches']} of {b['micro_batch']} sequence(s) per replica, "
        f"{b['schedule']} schedule, ZeRO-{b['zero']}",
    )
    head.add_row(
        "time per batch",
        f"[bold]{ms(b['time_per_batch_s'])}[/bold] (simulated schedule; bubble "
        f"{b['bubble_fraction']:.1%}), model FLOPs utilisation {b['mfu']:.1%}",
    )
    s = data["search"]
    head.add_row(
        "search",
        f"{s['configurations']:,} configurations, {s['sharding_solves']} sharding solves, "
        f"{s['seconds']:.1f} s",
    )
    console.print(head)
    stages = Table(title="stages", title_justify="left")
    named = b.get("stage_units")  # a model cut between units: their names
    columns = ("stage", "units" if named else "layers", "recompute", "forward", "backward")
    for col in (*columns, "memory", "capacity"):
        left = col in ("stage", "recompute", "units")
        stages.add_column(col, justify="left" if left else "right")
    first = 0
    for i, k in enumerate(b["layers_per_stage"]):
        mem = b["stage_memory_bytes"][i]
        over = mem > b["capacity_bytes"]
        stages.add_row(
            str(i),
            named[i] if named else f"{first}-{first + k - 1}",
            b["recompute"][i],
            ms(b["stage_forward_s"][i]),
            ms(b["stage_backward_s"][i]),
            ("[red]" if over else "") + gib(mem) + (" OOM[/red]" if over else ""),
            gib(b["capacity_bytes"]),
        )
        first += k
    console.print(stages)
    if data["runners_up"]:
        ru = Table(title="runners-up", title_justify="left")
        for col in ("plan", "stages", "recompute", "time per batch", "MFU", "fits"):
            ru.add_column(
                col, justify="left" if col in ("plan", "stages", "recompute") else "right"
            )
        for p in data["runners_up"]:
            ru.add_row(
                p["label"],
                ",".join(map(str, p["layers_per_stage"])),
                ",".join(sorted(set(p["recompute"]))),
                ms(p["time_per_batch_s"]),
                f"{p['mfu']:.1%}",
                "yes" if p["fits"] else "no",
            )
        console.print(ru)
