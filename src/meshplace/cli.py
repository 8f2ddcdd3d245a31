"""The ``meshplace`` command: thin argument parsing over the library.

Every command prints a readable table by default and a JSON object with ``--json``; bad
input exits 2 with one sentence on stderr (never a traceback); outputs are written
atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

from meshplace.argtypes import non_negative_seconds, positive_int, positive_seconds, seed
from meshplace.errors import InputError
from meshplace.hostmemory import keep_freed_memory
from meshplace.util import (
    JsonOutput,
    check_output_paths,
    finite_or_none,
    print_json,
    write_text_atomic,
)

EXIT_BAD_INPUT = 2


class _UsageError(Exception):
    """A bad flag or argument, caught by :func:`main` like an :class:`InputError`."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one sentence (no usage block: ``--help`` has
    it) and lets :func:`main` answer ``--json`` callers with a JSON error too."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"meshplace: error: {message} (see {self.prog} --help)")


def _add_capture_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that shape a capture (``graph``, ``plan``, ``simulate``)."""
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        help="cast parameters and floating inputs to this dtype before capture "
        "(default: as the model was built)",
    )
    parser.add_argument(
        "--autocast",
        choices=["bf16", "fp16"],
        metavar="{bf16,fp16}",
        help="run the forward under torch.autocast with this dtype (mixed precision: "
        "matmuls and attention in it, reductions and norms in fp32)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="capture a file.py:fn model afresh instead of loading it from the capture cache "
        "($MESHPLACE_CACHE_DIR, else $XDG_CACHE_HOME/meshplace or ~/.cache/meshplace)",
    )


def _parser(command: str = "*") -> argparse.ArgumentParser:
    """The argument parser. The arguments of ``shard``, ``report``, ``profile`` and ``run``
    live in their packages, whose imports are heavy (torch): they are added only when
    ``command`` is that command (``"*"``: all), so ``meshplace --help``, other commands'
    bad flags and Ctrl-C are answered without importing them."""

    def wanted(name: str) -> bool:
        return command in ("*", name)

    parser = _Parser(
        prog="meshplace",
        description="Decide where every part of a neural network should run.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "graph",
        help="capture or load a model's op graph and summarise it",
        description="Summarise a model as the planner sees it: ops by phase and kind, "
        "parameters, FLOPs, memory and co-location groups.",
    )
    g.add_argument(
        "model", help="workload name (see `meshplace workloads`), graph.json or file.py:fn"
    )
    g.add_argument(
        "--batch",
        type=positive_int,
        help="batch size (reference workloads; FILE.py:build: the first rows of its inputs)",
    )
    g.add_argument("--size", help="model size, e.g. 124m or base (reference workloads)")
    g.add_argument("--inference", action="store_true", help="capture the inference graph")
    g.add_argument(
        "--optimizer", default="adam", choices=["adam", "momentum", "sgd"], help="update ops"
    )
    _add_capture_arguments(g)
    g.add_argument(
        "--groups", type=positive_int, default=256, help="coarsen to at most N groups (256)"
    )
    g.add_argument("--out", help="write the graph as JSON to this file")
    g.add_argument("--json", action="store_true", help="print a JSON object")

    w = sub.add_parser(
        "workloads",
        help="capture every reference workload and summarise them",
        description="One row per reference workload (default size and batch): ops, "
        "parameters, FLOPs, memory, groups and capture time.",
    )
    w.add_argument("names", nargs="*", help="only these workloads (default: every one)")
    w.add_argument("--all-sizes", action="store_true", help="every size, not just the default")
    w.add_argument("--json", action="store_true", help="print a JSON array")
    p = sub.add_parser(
        "plan",
        help="place a model on a cluster with one placer, several, or all, and compare",
        description="Run placers on a model and cluster; one row per placer with step time, "
        "speed-ups over the best single device and the human expert, peak memory, search time "
        "and simulator evaluations, beside the lower bound. Writes the best plan.",
    )
    p.add_argument("model", help="workload name, graph.json or file.py:fn")
    p.add_argument("--cluster", required=True, help="preset name or cluster.yaml")
    p.add_argument("--placer", default="all", help="NAME[,NAME...] or all (default: all)")
    p.add_argument("--objective", default="step", choices=["step", "throughput"])
    p.add_argument(
        "--budget",
        type=positive_seconds,
        default=10.0,
        help="seconds per searching placer (default 10)",
    )
    p.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    p.add_argument(
        "--batch",
        type=positive_int,
        help="batch size (reference workloads; FILE.py:build: the first rows of its inputs)",
    )
    p.add_argument("--size", help="model size (reference workloads)")
    p.add_argument("--inference", action="store_true", help="place the inference graph")
    _add_capture_arguments(p)
    p.add_argument(
        "--groups",
        type=positive_int,
        default=256,
        help="co-location groups to aim for: at most N, and no fewer where the graph has "
        "N ops (default 256)",
    )
    p.add_argument("--calibration", help=_CALIBRATION_HELP)
    p.add_argument("--transfers", choices=["overlap", "occupy"], help=_TRANSFERS_HELP)
    p.add_argument("--out", help="write the best plan to this file")
    p.add_argument("--result", help="write every placer's result as JSON to this file")
    p.add_argument(
        "--out-all",
        metavar="DIR",
        help="write every placer's plan to DIR/<placer>.json (out-of-memory ones too, "
        "marked in their meta)",
    )
    p.add_argument("--html", help="write a self-contained HTML report to this file")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument(
        "--checkpoint-dir",
        help="learned placers save their training state here (DIR/<placer>.ckpt) at intervals",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue learned placers from their checkpoints in --checkpoint-dir "
        "(same model, cluster, seed and budget end with the same plan)",
    )
    p.add_argument(
        "--runnable-stages",
        action="store_true",
        help="pipeline: only a split torch.distributed.pipelining runs stage by stage "
        "(contiguous in execution order; no non-contiguous local search)",
    )
    p.add_argument(
        "--finetune",
        type=non_negative_seconds,
        metavar="SECONDS",
        help="let the pretrained gnn policy train this many seconds on the model after "
        "placing it zero-shot (default: zero-shot only)",
    )

    c = sub.add_parser(
        "cluster",
        help="describe a cluster preset or YAML file",
        description="Devices, links and peak numbers of a cluster.",
    )
    c.add_argument("cluster", help="preset name (see --list) or cluster.yaml")
    c.add_argument("--json", action="store_true", help="print a JSON object")

    s = sub.add_parser(
        "simulate",
        help="simulate a placement plan of a graph on a cluster",
        description="Step time, lower bound, per-device busy time and peak memory, bytes "
        "moved per link; optionally a Chrome/Perfetto trace.",
    )
    s.add_argument("--graph", required=True, help="workload name, graph.json or file.py:fn")
    s.add_argument("--cluster", required=True, help="preset name or cluster.yaml")
    s.add_argument(
        "--batch",
        type=positive_int,
        help="batch size (reference workloads; FILE.py:build: the first rows of its inputs)",
    )
    s.add_argument("--size", help="model size (reference workloads)")
    s.add_argument("--inference", action="store_true", help="simulate the inference graph")
    _add_capture_arguments(s)
    s.add_argument("--plan", required=True, help="plan.json (see docs/formats.md)")
    s.add_argument(
        "--objective",
        choices=["step", "throughput"],
        help="which number is the objective (default: the plan's own)",
    )
    s.add_argument("--calibration", help=_CALIBRATION_HELP)
    s.add_argument("--transfers", choices=["overlap", "occupy"], help=_TRANSFERS_HELP)
    s.add_argument("--trace", help="write a Chrome trace (opens in Perfetto) to this file")
    s.add_argument("--json", action="store_true", help="print a JSON object")

    sh = sub.add_parser(
        "shard",
        help="shard any model over a device mesh: per-op strategies, weight-update sharding "
        "and memory per device",
        description="Search mesh shapes and, per mesh, every op's and parameter's sharding "
        "of the captured training graph (an integer program: step time within device "
        "memory), or, for the models with hand-written named-dimension programs, "
        "Mesh-TensorFlow layout rules; print the plan, its cost breakdown, memory per device "
        "and runner-ups.",
    )
    if wanted("shard"):
        from meshplace.parallel.cli import add_shard_arguments

        add_shard_arguments(sh)

    rp = sub.add_parser(
        "report",
        help="write a self-contained HTML report of a plan, shard or benchmark result",
        description="Charts of a `plan --result`, `shard --json` or benchmarks/results JSON "
        "as one HTML file (inline SVG, no network): placer comparison, timeline, memory, "
        "placement; layout and collectives; scaling curves.",
    )
    if wanted("report"):
        from meshplace.report.cli import add_report_arguments

        add_report_arguments(rp)

    pf = sub.add_parser(
        "profile",
        help="leveled profile (model / module / op / kernel) of a training step on this "
        "machine's devices side by side, or --compare saved profiles",
        description="Time a model's training step at the model, module, op and (on CUDA) "
        "kernel levels, each in a run with only that level and the ones above enabled, on "
        "every local device (--devices) side by side; tables, profile JSON and a Chrome "
        "trace per device. --compare puts saved profiles (from any machine) side by side.",
    )
    if wanted("profile"):
        from meshplace.profile.cli import add_profile_arguments

        add_profile_arguments(pf)
    rn = sub.add_parser(
        "run",
        help="execute a plan on local worker processes: measured vs predicted step time",
        description="Split the training step by device, run each device as a worker process "
        "(torch.distributed, gloo), and compare the measured step time with the simulator's "
        "prediction on the calibrated local cluster.",
    )
    if wanted("run"):
        from meshplace.runtime.cli import add_run_arguments

        add_run_arguments(rn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 a failed run, 2 bad input,
    130 interrupted). With ``--json`` stdout carries exactly one JSON document, also on
    errors (``{"error": ..., "exit_status": ...}``); everything else goes to stderr."""
    json_output: JsonOutput | None = None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            command = next((a for a in argv if not a.startswith("-")), "")
            args = _parser(command).parse_args(argv)
        except _UsageError as exc:
            if "--json" in argv:
                with JsonOutput() as out:
                    return _fail(out, f"{exc}", EXIT_BAD_INPUT)
            print(exc, file=sys.stderr)
            return EXIT_BAD_INPUT
        if getattr(args, "json", False):
            json_output = JsonOutput()
        keep_freed_memory()  # steps timed or trained here, and by forked workers
        with json_output or contextlib.nullcontext():
            try:
                return _dispatch(args)
            except InputError as exc:
                return _fail(json_output, f"meshplace: error: {exc}", EXIT_BAD_INPUT)
            except KeyboardInterrupt:
                return _fail(json_output, "meshplace: interrupted", 130)
    except KeyboardInterrupt:  # during parsing or imports, before the command started
        print("meshplace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`meshplace ... | head`): stop quietly, as Unix tools do, and
        # keep Python from complaining again when it flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


def _fail(json_output: JsonOutput | None, sentence: str, status: int) -> int:
    print(sentence, file=sys.stderr)
    if json_output is not None and not json_output.emitted:
        reason = sentence.removeprefix("meshplace: ").removeprefix("error: ")
        json_output.emit({"error": reason, "exit_status": status})
    return status


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "graph":
        return _cmd_graph(args)
    if args.command == "workloads":
        return _cmd_workloads(args)
    if args.command == "cluster":
        return _cmd_cluster(args)
    if args.command == "plan":
        return _cmd_plan(args)
    if args.command == "profile":
        from meshplace.profile.cli import cmd_profile

        return cmd_profile(args)
    if args.command == "run":
        from meshplace.runtime.cli import cmd_run

        return cmd_run(args)
    if args.command == "report":
        from meshplace.report.cli import cmd_report

        return cmd_report(args)
    if args.command == "shard":
        from meshplace.parallel.cli import cmd_shard
        from meshplace.runtime.dryrun import engine_pricer, plan_prices

        # the sharding package never imports the runtime: its dry runs are handed down
        return cmd_shard(args, engine_pricer, plan_prices)
    if args.command == "simulate":
        return _cmd_simulate(args)
    raise AssertionError(args.command)  # pragma: no cover - argparse requires a command


def _check_model_flags(args: argparse.Namespace, spec: str) -> None:
    """Flags that shape a capture mean nothing for a saved graph: refuse them rather than
    silently use the graph as it was saved."""
    if spec.endswith(".json") and getattr(args, "inference", False):
        raise InputError(
            f"{spec}: --inference applies to models captured here; a saved graph is "
            "already a training or inference graph"
        )
    for flag in ("dtype", "autocast"):
        if spec.endswith(".json") and getattr(args, flag, None) is not None:
            raise InputError(
                f"{spec}: --{flag} applies to models captured here; a saved graph keeps the "
                "dtypes it was captured with"
            )


def _load_model(args: argparse.Namespace, spec: str, err: Console, verb: str = "capturing"):
    """The :class:`~meshplace.graph.sources.GraphSource` for ``spec`` under the command's
    capture flags; says on stderr when it came from the capture cache, and prints the
    capture's notes (a torch.compile'd module, a stand-in loss) as ``meshplace: note:``."""
    from meshplace.graph.sources import graph_source

    with _status(err, f"{verb} {spec}…"):
        source = graph_source(
            spec,
            batch=args.batch,
            size=args.size,
            training=not args.inference,
            optimizer=getattr(args, "optimizer", "adam"),
            dtype=args.dtype,
            autocast=args.autocast,
            cache=not args.no_cache,
        )
    cache = source.cache or {}
    if cache.get("status") == "hit":
        err.print(f"captured graph from cache ({cache['path']})", highlight=False, soft_wrap=True)
    elif cache.get("status") == "unwritable":
        err.print(
            f"meshplace: note: the capture cache could not be written ({cache['reason']})",
            highlight=False,
            soft_wrap=True,
        )
    for note in source.notes:
        err.print(f"meshplace: note: {note}", highlight=False, soft_wrap=True, markup=False)
    return source


def _status(console: Console, message: str):
    return console.status(message, spinner="dots")


def _cmd_graph(args: argparse.Namespace) -> int:
    _check_model_flags(args, args.model)
    check_output_paths({"--out": args.out}, inputs=[args.model])

    from meshplace.graph.io import save_graph
    from meshplace.graph.summary import summarize

    err = Console(stderr=True)
    start = time.perf_counter()
    source = _load_model(args, args.model, err)
    graph = source.graph
    capture_s = time.perf_counter() - start
    with _status(err, "grouping…"):
        summary = summarize(graph, args.groups)
    summary["capture_s"] = round(capture_s, 3)
    if source.cache is not None:
        summary["cache"] = source.cache
    recomputed = graph.meta.get("recomputed") or {}
    if recomputed:
        summary["recomputed_ops"] = len(recomputed)
        summary["flops_recomputed"] = float(sum(o.flops for o in graph.ops if o.name in recomputed))
    if args.out:
        save_graph(graph, args.out)
        summary["out"] = args.out
    if args.json:
        print_json(summary)
    else:
        _print_graph_summary(Console(), summary)
    return 0


def _print_graph_summary(console: Console, s: dict[str, Any]) -> None:
    from meshplace.graph.summary import human

    meta = s["meta"]
    title = s["name"]
    if meta.get("batch"):
        title += f" (batch {meta['batch']})"
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("step", "training" if s["training"] else "inference")
    table.add_row("ops", f"{s['ops']:,}  ({s['edges']:,} edges)")
    table.add_row("ops by phase", ", ".join(f"{k} {v:,}" for k, v in s["ops_by_phase"].items()))
    kinds = list(s["ops_by_kind"].items())
    shown = ", ".join(f"{k} {v:,}" for k, v in kinds[:8])
    if len(kinds) > 8:
        shown += f", … ({len(kinds) - 8} more kinds)"
    table.add_row("ops by kind", shown)
    elementwise = list(s.get("elementwise_targets", {}).items())
    if elementwise:
        shown = ", ".join(f"{k} {v:,}" for k, v in elementwise[:6])
        if len(elementwise) > 6:
            shown += f", … ({len(elementwise) - 6} more)"
        table.add_row("costed element-wise", shown)
    table.add_row("precision", _precision(s))
    if s["params"] is None:  # parameter bytes on the ops, no parameter ops to count
        table.add_row("parameters", "unknown (no parameter ops; see parameter memory)")
    else:
        table.add_row("parameters", f"{s['params']:,}  ({human(s['params'])})")
    table.add_row("FLOPs forward", human(s["flops_forward"], "FLOP"))
    if s["training"]:
        table.add_row("FLOPs backward", human(s["flops_backward"], "FLOP"))
        table.add_row("FLOPs update", human(s["flops_update"], "FLOP"))
        ratio = s["flops_total"] / s["flops_forward"] if s["flops_forward"] else 0.0
        table.add_row("FLOPs total", f"{human(s['flops_total'], 'FLOP')}  ({ratio:.2f}× forward)")
        if s.get("recomputed_ops"):
            how = meta.get("checkpoint", "")
            table.add_row(
                "recomputed in backward",
                f"{s['recomputed_ops']:,} ops, {human(s['flops_recomputed'], 'FLOP')}"
                + (f"  ({how} activation checkpointing)" if how else ""),
            )
    table.add_row("parameter memory", human(s["param_bytes"], "B"))
    if s["state_bytes"]:
        table.add_row("optimizer state", human(s["state_bytes"], "B"))
    label = "saved activations" if s["training"] else "activations (all outputs)"
    table.add_row(label, human(s["activation_bytes"], "B"))
    table.add_row("co-location groups", f"{s['groups']:,} (at most {s['max_groups']})")
    if "capture_s" in s:
        hit = (s.get("cache") or {}).get("status") == "hit"
        table.add_row("capture time", f"{s['capture_s']:.2f} s" + (" (from cache)" if hit else ""))
    if s.get("out"):
        table.add_row("written to", s["out"])
    console.print(table)


def _precision(s: dict[str, Any]) -> str:
    """``parameters bfloat16, autocast bfloat16`` for the graph summary table."""
    meta = s["meta"]
    dtype = meta.get("dtype")
    text = f"parameters {dtype} (--dtype)" if dtype else "parameters as built"
    autocast = meta.get("autocast")
    text += f", forward autocast to {autocast}" if autocast else ", no autocast"
    return text + "; each op is costed at its output dtype's peak"


def _cmd_workloads(args: argparse.Namespace) -> int:
    from meshplace.graph.summary import human
    from meshplace.workloads_summary import summarize_workloads

    err = Console(stderr=True)
    rows = summarize_workloads(args.names, all_sizes=args.all_sizes, console=err)
    if args.json:
        print_json(rows)
        return 0
    table = Table(title="meshplace reference workloads (training step, Adam)")
    for col in ("workload", "batch", "params", "ops", "groups", "fwd FLOPs", "total/fwd"):
        table.add_column(col, justify="left" if col == "workload" else "right")
    table.add_column("params+state", justify="right")
    table.add_column("activations", justify="right")
    table.add_column("capture", justify="right")
    for r in rows:
        table.add_row(
            r["name"],
            str(r["batch"]),
            human(r["params"]),
            f"{r['ops']:,}",
            str(r["groups"]),
            human(r["flops_forward"], "FLOP"),
            f"{r['flops_total'] / r['flops_forward']:.2f}",
            human(r["param_bytes"] + r["state_bytes"], "B"),
            human(r["activation_bytes"], "B"),
            f"{r['capture_s']:.1f} s",
        )
    Console().print(table)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    _check_model_flags(args, args.model)
    check_output_paths(
        {"--out": args.out, "--result": args.result, "--html": args.html},
        inputs=[args.model, args.cluster, args.calibration],
    )
    from rich.progress import Progress, TextColumn

    from meshplace.hardware import load_cluster
    from meshplace.placers.base import PlacementProblem, PlacerError, PlacerOptions, resolve
    from meshplace.planning import plan_report, run_placers

    names = resolve(args.placer)  # unknown or no names: one sentence, with "did you mean"
    if args.finetune is not None and "gnn" not in names:
        raise PlacerError("--finetune trains the gnn placer only; add gnn to --placer")
    if args.runnable_stages and "pipeline" not in names:
        raise PlacerError(
            "--runnable-stages applies to the pipeline placer only; add pipeline to --placer"
        )
    if args.resume and not args.checkpoint_dir:
        raise PlacerError("--resume needs --checkpoint-dir, the folder holding the checkpoints")
    for flag, folder in (("--checkpoint-dir", args.checkpoint_dir), ("--out-all", args.out_all)):
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            raise PlacerError(f"{flag} {folder} is not a folder")
    cluster = _with_transfers(load_cluster(args.cluster), args)
    cost_model = _cost_model(args, cluster)
    err = Console(stderr=True)
    source = _load_model(args, args.model, err)
    graph = source.graph
    with _status(err, "grouping and preparing the simulator…"):
        problem = PlacementProblem.build(
            graph, cluster, args.objective, args.groups, cost_model=cost_model
        )
    problem.check_fits_somewhere()
    if args.checkpoint_dir:  # made only now that every input is known to be good
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    with Progress(
        *Progress.get_default_columns(),
        TextColumn("{task.fields[best]}"),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("placing", total=len(names), best="")
        training: dict[str, Any] = {}

        def tick(name: str) -> None:
            progress.update(task, description=f"placing with {name}")
            training["name"] = name

        def trained(done: int, total: int, best_s: float) -> None:
            # a learned placer's own bar: its updates and the best step time so far
            if "task" not in training:
                training["task"] = progress.add_task(training["name"], total=total, best="")
            progress.update(
                training["task"],
                description=f"training {training['name']}",
                completed=done,
                total=total,
                best=f"best {best_s * 1e3:,.1f} ms" if math.isfinite(best_s) else "",
            )

        def finished(_: Any) -> None:
            progress.advance(task)
            if "task" in training:
                progress.remove_task(training.pop("task"))

        options = PlacerOptions(
            checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
            resume=args.resume,
            finetune_s=args.finetune,
            progress=trained,
            runnable_stages=args.runnable_stages,
        )
        results = run_placers(
            problem,
            names,
            args.budget,
            args.seed,
            on_start=tick,
            on_done=finished,
            options=options,
        )
    report = plan_report(problem, results, args)
    if source.cache is not None:
        report["cache"] = source.cache
    if args.out and report["best"] is not None:
        from meshplace.plan.placement import save_plan
        from meshplace.planning import best_plan

        save_plan(best_plan(problem, results, args.budget, args.seed), args.out)
        report["out"] = args.out
    if args.out_all:
        from meshplace.plan.placement import save_plan
        from meshplace.planning import result_plan

        folder = Path(args.out_all)
        folder.mkdir(parents=True, exist_ok=True)
        for r in results:
            save_plan(result_plan(problem, r, args.budget, args.seed), folder / f"{r.placer}.json")
        report["out_all"] = [str(folder / f"{r.placer}.json") for r in results]
    if args.html:
        from meshplace.report.cli import write_plan_report

        write_plan_report(problem, results, report, args)
    failure = None
    if report["best"] is None and args.out:
        failure = (
            "no placer found a plan that fits in memory and runs every op where it can "
            f"run, so {args.out} was not written"
        )
        report["error"] = failure
    if args.result:
        write_text_atomic(args.result, json.dumps(finite_or_none(report), indent=1))
    if args.json:
        print_json(report)
    else:
        _print_plan_report(Console(), report)
    if failure:  # the table (or JSON) above says which devices ran out of memory
        raise PlacerError(failure)
    return 0


def _print_plan_report(console: Console, r: dict[str, Any]) -> None:
    from meshplace.graph.summary import human

    title = (
        f"{r['graph']} on {r['cluster']}: {r['ops']:,} ops in {r['groups']} groups, "
        f"objective {r['objective']}"
    )
    table = Table(title=title, title_justify="left")
    throughput = r["objective"] == "throughput"
    for col in (
        "placer",
        r["objective"] + " time",
        *(["micro-batches"] if throughput else []),
        "vs single",
        "vs expert",
        "peak memory / OOM",
        "search",
        "evals",
    ):
        table.add_column(col, justify="left" if col == "placer" else "right")
    best = r["best"]
    for row in r["results"]:
        mem = (
            "[red]OOM " + ", ".join(row["oom_devices"]) + "[/red]"
            if row["oom"]
            else human(max(row["peak_memory_bytes"].values(), default=0), "B") + " max"
        )
        name = (
            f"[bold green]{row['placer']}[/bold green]" if row["placer"] == best else row["placer"]
        )
        table.add_row(
            name,
            f"{row['objective_value_s'] * 1e3:,.1f} ms",
            *([str(row.get("micro_batches", 1))] if throughput else []),
            f"{row['speedup_vs_single']:.2f}×" if row.get("speedup_vs_single") else "–",
            f"{row['speedup_vs_expert']:.2f}×" if row.get("speedup_vs_expert") else "–",
            mem,
            f"{row['search_time_s']:.2f} s",
            f"{row['evaluations']:,}",
        )
    console.print(table)
    if throughput:
        console.print(
            "throughput time: one training step with the batch split into the micro-batches "
            "shown, run as 1F1B where the plan is a pipeline (as `meshplace simulate` runs "
            "the written plan); 1 means one plain step",
            highlight=False,
        )
    console.print(f"lower bound: {r['lower_bound_s'] * 1e3:,.1f} ms", highlight=False)
    if best is None:
        console.print(
            "[red]no placer found a plan that fits in memory and runs every op where it "
            "can run[/red]"
        )
    else:
        b = next(x for x in r["results"] if x["placer"] == best)
        gap = b["objective_value_s"] / r["lower_bound_s"] if r["lower_bound_s"] else float("nan")
        console.print(
            f"best: {best}, {b['objective_value_s'] * 1e3:,.1f} ms ({gap:.2f}× the lower bound)",
            highlight=False,
        )
    if r.get("out"):
        console.print(f"plan written to {r['out']}", highlight=False)


def _cmd_cluster(args: argparse.Namespace) -> int:
    from meshplace.hardware import describe, load_cluster, print_cluster

    cluster = load_cluster(args.cluster)
    if args.json:
        print_json(describe(cluster))
    else:
        print_cluster(Console(), cluster)
    return 0


_CALIBRATION_HELP = (
    "a calibration file (meshplace run --calibration-out): its measured efficiencies, "
    "launch and message costs replace the cost model's defaults on its device kind"
)


_TRANSFERS_HELP = (
    "occupy: every device is busy for the whole of each transfer it sends or receives (no "
    "copy engine: CPUs, FPGAs, host-driven accelerators); overlap: transfers run beside "
    "compute. Default: what the cluster says per device (presets: overlap)"
)


def _with_transfers(cluster: Any, args: argparse.Namespace) -> Any:
    """``cluster`` with ``--transfers`` applied to every device (unchanged without it)."""
    mode = getattr(args, "transfers", None)
    return cluster if mode is None else cluster.with_transfers(mode)


def _cost_model(args: argparse.Namespace, cluster: Any) -> Any:
    """The cost model ``--calibration`` asks for on ``cluster`` (``None``: the default)."""
    if not getattr(args, "calibration", None):
        return None
    from meshplace.cost.calibration import calibrated_cost_model, load_calibration

    return calibrated_cost_model(load_calibration(args.calibration), cluster)


def _cmd_simulate(args: argparse.Namespace) -> int:
    _check_model_flags(args, args.graph)
    check_output_paths(
        {"--trace": args.trace}, inputs=[args.graph, args.cluster, args.plan, args.calibration]
    )

    from meshplace.hardware import load_cluster
    from meshplace.plan.placement import load_plan
    from meshplace.sim.schedule import SCHEDULES
    from meshplace.sim.simulator import Simulator
    from meshplace.sim.trace import write_chrome_trace

    err = Console(stderr=True)
    plan = load_plan(args.plan)
    cluster = _with_transfers(load_cluster(args.cluster), args)
    cost_model = _cost_model(args, cluster)
    source = _load_model(args, args.graph, err, verb="loading")
    graph = source.graph
    placement = plan.device_indices(
        graph, {d.name: i for i, d in enumerate(cluster.devices)}, cluster.name, args.plan
    )
    sim = Simulator(graph, cluster, cost_model)
    sim.check_runnable(placement, args.plan)
    # the plan's objective, micro-batches and schedule unless the command names another
    objective = args.objective or plan.objective
    schedule = str(plan.meta.get("schedule", "1f1b")).lower()
    runs = [s for s in SCHEDULES if s != "interleaved"]  # a placement has no virtual stages
    if schedule not in runs:
        raise InputError(
            f"{args.plan}: meta.schedule {schedule!r} is not a schedule a placement plan runs "
            f"(one stage per device); allowed: {', '.join(runs)}"
        )
    result = sim.simulate(
        placement,
        objective=objective,
        micro_batches=plan.micro_batches if plan.micro_batches > 1 else None,
        pipelined=True,
        schedule=schedule,
    )
    if args.trace:
        write_chrome_trace(sim, result, args.trace)
    summary = {"graph": graph.name, "cluster": cluster.name, "plan": args.plan}
    if args.calibration:
        summary["calibration"] = args.calibration
    summary.update(result.to_dict())
    summary["pipeline"] = _pipelined(sim, placement, result)
    if source.cache is not None:
        summary["cache"] = source.cache
    if args.trace:
        summary["trace"] = args.trace
    if args.json:
        print_json(summary)
    else:
        _print_simulation(Console(), summary)
    return 0


def _pipelined(sim: Any, placement: Any, result: Any) -> dict[str, Any] | None:
    """The throughput objective's schedule of the simulated plan (its micro-batches, as
    the plan's ``meta.schedule``, default 1F1B), per stage device in pipeline order;
    ``None`` when one micro-batch is what it runs (a plan of one micro-batch that is not
    a pipeline, or faster as one step)."""
    if result.schedule is None:
        return None
    from meshplace.sim.schedule import pipeline_of_placement

    pipeline = pipeline_of_placement(sim, placement, result.micro_batches)
    if pipeline is None:  # pragma: no cover - the objective read it as one
        return None
    return {
        **result.schedule.to_dict(),
        "devices": [sim.device_names[d] for d in pipeline.devices],
        "memory_bytes": pipeline.memory_bytes(result.schedule),
        "memory_bytes_full_recompute": pipeline.memory_bytes(result.schedule, "full"),
        "memory_capacity_bytes": [float(sim.memory_capacity[d]) for d in pipeline.devices],
    }


def _print_simulation(console: Console, s: dict[str, Any]) -> None:
    from meshplace.graph.summary import human

    head = Table(title=f"{s['graph']} on {s['cluster']} ({s['plan']})", show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value")
    head.add_row("step time", f"{s['step_time_s'] * 1e3:,.3f} ms")
    pipe = s.get("pipeline")
    pipelined = f"{s['throughput_time_s'] * 1e3:,.3f} ms per step"
    if pipe:
        pipelined += f" over {pipe['micro_batches']} micro-batches"
    elif s.get("throughput_model") == "steady state":
        pipelined += " in the steady state (the graph's batch is unknown: no split)"
    else:
        pipelined += " as one step (not a pipeline, or fastest unsplit)"
    if s.get("time_per_sample_s"):
        pipelined += f", {s['time_per_sample_s'] * 1e6:,.1f} µs per sample"
    head.add_row("throughput objective", pipelined)
    head.add_row(
        "max-load steady state",
        f"{s['steady_state_s'] * 1e3:,.3f} ms per step (busiest device or link: a floor "
        "under the pipelined step)",
    )
    if pipe:
        head.add_row(
            f"{pipe['schedule'].upper()}, {pipe['micro_batches']} micro-batches",
            f"{pipe['step_s'] * 1e3:,.3f} ms per step over {pipe['stages']} stages "
            f"({', '.join(pipe['devices'])}), bubble {pipe['bubble_fraction']:.1%}, "
            f"micro-batches held per stage {pipe['peak_in_flight']}",
        )
        memory = ", ".join(
            f"{human(a, 'B')} ({human(b, 'B')} recomputing) of {human(c, 'B')}"
            for a, b, c in zip(
                pipe["memory_bytes"],
                pipe["memory_bytes_full_recompute"],
                pipe["memory_capacity_bytes"],
                strict=True,
            )
        )
        head.add_row("memory per stage", memory)
    measured = "step" if s["objective"] == "step" else "pipelined step"
    value = s["objective_value_s"]
    gap = value / s["lower_bound_s"] if s["lower_bound_s"] else float("nan")
    head.add_row(
        f"lower bound ({s['objective']})",
        f"{s['lower_bound_s'] * 1e3:,.3f} ms  ({measured} is {gap:.2f}× it)",
    )
    head.add_row("bytes moved", f"{human(s['bytes_moved'], 'B')} in {s['transfers']:,} transfers")
    oom = ", ".join(s["oom_devices"]) if s["oom"] else "no"
    head.add_row("out of memory", f"[red]{oom}[/red]" if s["oom"] else oom)
    if s.get("trace"):
        head.add_row("trace", f"{s['trace']} (open in ui.perfetto.dev)")
    console.print(head)
    dev = Table(title="devices")
    for col in ("device", "kind", "ops", "busy", "idle", "peak memory", "capacity"):
        dev.add_column(col, justify="left" if col in ("device", "kind") else "right")
    for d in s["devices"]:
        if not d["ops"]:
            continue
        style = "red" if d["oom"] else None
        dev.add_row(
            d["name"],
            d["kind"],
            f"{d['ops']:,}",
            f"{d['busy_s'] * 1e3:,.3f} ms",
            f"{(d['idle_s'] or 0) * 1e3:,.3f} ms",
            human(d["peak_memory_bytes"], "B"),
            human(d["memory_capacity_bytes"], "B"),
            style=style,
        )
    console.print(dev)
    if s["links"]:
        links = Table(title="busiest links")
        for col in ("link", "bytes", "busy"):
            links.add_column(col, justify="left" if col == "link" else "right")
        for link in sorted(s["links"], key=lambda x: -x["busy_s"])[:10]:
            links.add_row(
                link["name"], human(link["bytes"], "B"), f"{link['busy_s'] * 1e3:,.3f} ms"
            )
        console.print(links)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
