"""``meshplace shard``: search a model's layout on a (possibly hypothetical) mesh and explain it.

Source: the layout search of :mod:`meshplace.mesh.search` (Mesh-TensorFlow layouts costed for
time and memory, with MLPerf-style weight-update sharding); this module only turns command
line arguments into a search and prints the result: the chosen layout, its cost breakdown
(compute, each collective, exposed vs overlapped communication), memory per device and the
runner-up layouts, as rich tables or, with ``--json``, one JSON object with the keys
``mesh``, ``rules``, ``step_time_s``, ``peak_memory_bytes`` and ``collectives`` (and more).

Bad input (a mesh shape that does not match the chip count, an unknown dimension in a rule,
a model that fits no layout) raises :class:`~meshplace.errors.InputError` with one
sentence; the ``meshplace`` command turns it into exit status 2. Complexity: that of the
search (seconds for the 5B Transformer on 512 chips).

Example
-------
>>> import argparse, contextlib, io, json
>>> ns = argparse.Namespace(model="transformer", size="base", batch=64, cluster="tpu-v3-8",
...                         mesh="4", chips=None, json=True)
>>> buf = io.StringIO()
>>> with contextlib.redirect_stdout(buf):
...     code = cmd_shard(ns)
>>> data = json.loads(buf.getvalue())
>>> code, data["mesh"]["shape"], data["fits"], "step_time_s" in data
(0, [4], True, True)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from meshplace.argtypes import positive_int
from meshplace.errors import InputError
from meshplace.mesh.cost import LayoutCost
from meshplace.mesh.layout import AXIS_NAMES, mesh_and_chips
from meshplace.mesh.program import OPTIMIZERS, PROGRAM_MODELS, program_for
from meshplace.mesh.search import WUS_MODES, SearchResult, search
from meshplace.util import check_output_paths, dumps_strict_json, print_json, write_text_atomic


def add_shard_arguments(parser: argparse.ArgumentParser, model_help: str | None = None) -> None:
    """The ``shard`` subcommand's arguments (what ``meshplace shard --help`` shows)."""
    parser.add_argument("model", help=model_help or f"one of: {', '.join(PROGRAM_MODELS)}")
    parser.add_argument("--cluster", required=True, help="preset name or cluster.yaml")
    parser.add_argument("--mesh", help="mesh shape, e.g. 16x32 (default: search all shapes)")
    parser.add_argument(
        "--chips", type=positive_int, help="devices to use (default: all accelerators)"
    )
    parser.add_argument(
        "--weight-update-sharding",
        default="auto",
        choices=list(WUS_MODES),
        help="shard the optimizer update over data-parallel replicas",
    )
    parser.add_argument("--size", help="model size, e.g. 5b or base")
    parser.add_argument("--batch", type=positive_int, help="global batch size")
    parser.add_argument(
        "--rules",
        action="append",
        metavar="DIM=AXIS[,DIM=AXIS]",
        help="pin layout rules (AXIS x/y/z, or - to keep DIM whole)",
    )
    parser.add_argument(
        "--max-axes", type=positive_int, default=2, help="mesh axes to try (default 2)"
    )
    parser.add_argument("--top", type=positive_int, default=5, help="layouts to list (default 5)")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), help="optimizer to cost")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def parse_rules(items: Sequence[str] | None) -> dict[str, str | None]:
    """``["batch=x,d_ff=y", "heads=-"]`` -> ``{"batch": "x", "d_ff": "y", "heads": None}``.

    >>> parse_rules(["batch=x,d_ff=y", "heads=-"])
    {'batch': 'x', 'd_ff': 'y', 'heads': None}
    """
    out: dict[str, str | None] = {}
    for item in items or []:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            dim, sep, axis = part.partition("=")
            if not sep or not dim.strip() or not axis.strip():
                raise InputError(
                    f"--rules entry {part!r} is not of the form DIM=AXIS, e.g. batch=x"
                )
            axis = axis.strip()
            if axis not in (*AXIS_NAMES, "-", "none"):
                raise InputError(
                    f"--rules entry {part!r} names mesh axis {axis!r}; mesh axes are "
                    f"{', '.join(AXIS_NAMES)} (or - to keep {dim.strip()!r} whole)"
                )
            out[dim.strip()] = None if axis in ("-", "none") else axis
    return out


def shard(args: argparse.Namespace) -> tuple[SearchResult, dict[str, Any]]:
    """Run the search ``args`` describe; returns the result and its JSON-ready summary."""
    from meshplace.hardware import load_cluster

    get = getattr
    cluster = load_cluster(args.cluster)
    cost_model = None
    if get(args, "calibration", None):
        from meshplace.cost.calibration import calibrated_cost_model, load_calibration

        cost_model = calibrated_cost_model(load_calibration(args.calibration), cluster)
    program = program_for(
        args.model,
        size=get(args, "size", None),
        batch=get(args, "batch", None),
        optimizer=get(args, "optimizer", None),
    )
    chips = get(args, "chips", None)
    shape = mesh_and_chips(get(args, "mesh", None), chips)
    console = Console(stderr=True)
    with console.status(
        f"searching layouts of {program.name} on {cluster.name}…", spinner="dots"
    ) as status:
        result = search(
            program,
            cluster,
            chips=chips,
            mesh_shape=shape,
            max_axes=get(args, "max_axes", 2) or 2,
            pinned=parse_rules(get(args, "rules", None)),
            weight_update_sharding=get(args, "weight_update_sharding", "auto") or "auto",
            top_k=max(1, get(args, "top", 5) or 5),
            progress=lambda m: status.update(f"searching layouts of {program.name}: {m}…"),
            cost_model=cost_model,
        )
    best = result.best
    data: dict[str, Any] = {
        "model": args.model,
        "size": program.meta.get("size"),
        "program": program.name,
        "cluster": cluster.name,
        "chips": result.chips,
        "parameters": program.param_count(),
        "optimizer": program.optimizer.name,
        **best.to_dict(),
        "runners_up": [_summary(c, best) for c in result.ranked[1:]],
        "search": {
            "seconds": result.seconds,
            "layouts_legal": result.legal,
            "evaluations": result.evaluated,
            "mesh_shapes": ["x".join(map(str, s)) for s in result.mesh_shapes],
        },
    }
    return result, data


def cmd_shard(args: argparse.Namespace) -> int:
    """``meshplace shard``: print the chosen layout (table, or JSON with ``--json``)."""
    out = getattr(args, "out", None)
    check_output_paths({"--out": out}, inputs=[args.model, args.cluster])
    result, data = shard(args)
    if out:
        write_text_atomic(out, dumps_strict_json(data) + "\n")
    if getattr(args, "json", False):
        print_json(data)
    else:
        print_result(Console(), result, data)
    return 0


def _summary(c: LayoutCost, best: LayoutCost) -> dict[str, Any]:
    return {
        "mesh": "x".join(map(str, c.mesh.shape)),
        "rules": dict(sorted(c.rules.items())),
        "weight_update_sharding": c.weight_update_sharding,
        "step_time_s": c.step_time_s,
        "slowdown": c.step_time_s / best.step_time_s if best.step_time_s else 0.0,
        "peak_memory_bytes": c.peak_memory_bytes,
        "exposed_comm_s": c.exposed_comm_s,
        "fits": c.fits,
    }


_SHORT = {
    "weight_gather": "weights",
    "forward": "fwd",
    "backward": "bwd",
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "collective_permute": "permute",
}


def format_ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms"


def format_gib(b: float) -> str:
    return f"{b / 2**30:,.2f} GiB"


def peak_row(peak: float, capacity: float, fits: bool) -> tuple[str, str]:
    """The last row of the memory table: peak of capacity, fits or OOM."""
    word = "[green]fits[/green]" if fits else "[red]OOM[/red]"
    return "[bold]peak[/bold]", f"[bold]{format_gib(peak)}[/bold] of {format_gib(capacity)} {word}"


def mesh_table(title: str, mesh: Any) -> Table:
    """The head table of ``meshplace shard``: the mesh, its mapping and each axis's links
    (rows for the rest are added by the caller)."""
    head = Table(title=title, show_header=False, title_justify="left")
    head.add_column("what", style="bold")
    head.add_column("value")
    head.add_row("mesh", f"{mesh.label} ({mesh.mapping})")
    for ax in mesh.axes:
        links = "; ".join(
            f"{st.desc}: {st.bandwidth / 1e9:,.0f} GB/s, {st.latency * 1e6:.1f} us/step"
            for st in ax.stages
        )
        head.add_row(f"  axis {ax.name} ({ax.size})", links or "-")
    return head


def _bytes(b: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:,.1f} {unit}"
    return f"{b:,.0f} B"


def print_result(console: Console, result: SearchResult, data: dict[str, Any]) -> None:
    """The tables of ``meshplace shard``."""
    best = result.best
    mesh = best.mesh
    head = mesh_table(f"{data['program']} on {data['chips']} chips of {data['cluster']}", mesh)
    head.add_row("layout rules", best.rules_label())
    head.add_row("weight-update sharding", "on" if best.weight_update_sharding else "off")
    head.add_row(
        "step time",
        f"[bold]{format_ms(best.step_time_s)}[/bold]  ({data['samples_per_s']:,.1f} samples/s)",
    )
    head.add_row(
        "search",
        f"{data['search']['layouts_legal']:,} legal layouts, "
        f"{data['search']['evaluations']:,} evaluations on meshes "
        f"{', '.join(data['search']['mesh_shapes'])} in {result.seconds:.2f} s",
    )
    console.print(head)

    cost = Table(title="step time breakdown (per device)", title_justify="left")
    for col in ("part", "time", "exposed", "overlapped"):
        cost.add_column(col, justify="left" if col == "part" else "right")
    for phase, t in best.compute_s.items():
        cost.add_row(f"compute {phase}", format_ms(t), format_ms(t), "")
    for cat, t in best.comm_s.items():
        if t > 0:
            exp = best.exposed_s.get(cat, 0.0)
            cost.add_row(
                f"comm {cat.replace('_', ' ')}", format_ms(t), format_ms(exp), format_ms(t - exp)
            )
    cost.add_row("[bold]step[/bold]", f"[bold]{format_ms(best.step_time_s)}[/bold]", "", "")
    console.print(cost)

    coll = Table(title="collectives (per device, per step)", title_justify="left")
    for col in ("category", "phase", "kind", "axes", "calls", "bytes/call", "time"):
        coll.add_column(
            col,
            justify="right" if col in ("calls", "bytes/call", "time") else "left",
            no_wrap=True,
        )
    agg: dict[tuple, list[float]] = {}
    for c in best.collectives:
        key = (c.category, c.phase, c.kind, ",".join(c.axes))
        e = agg.setdefault(key, [0, 0.0, 0.0])
        e[0] += c.count
        e[1] += c.nbytes * c.count
        e[2] += c.time_s
    for (cat, phase, kind, axes), (n, nbytes, t) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        coll.add_row(
            _SHORT.get(cat, cat),
            _SHORT.get(phase, phase),
            _SHORT.get(kind, kind),
            axes,
            f"{int(n):,}",
            _bytes(nbytes / max(n, 1)),
            format_ms(t),
        )
    if not agg:
        coll.add_row("(none)", "", "", "", "", "", "")
    console.print(coll)

    mem = Table(title="memory per device", title_justify="left")
    mem.add_column("part")
    mem.add_column("bytes", justify="right")
    for k, v in best.memory.items():
        mem.add_row(k, format_gib(v))
    mem.add_row(*peak_row(best.peak_memory_bytes, best.memory_capacity_bytes, best.fits))
    console.print(mem)

    if result.ranked[1:]:
        ru = Table(title="runner-up layouts", title_justify="left")
        for col in ("#", "mesh", "rules", "WUS", "step", "vs best", "peak memory"):
            ru.add_column(
                col, justify="right" if col in ("#", "step", "vs best", "peak memory") else "left"
            )
        for k, c in enumerate(result.ranked[1:], start=2):
            ru.add_row(
                str(k),
                c.mesh.label,
                c.rules_label(),
                "on" if c.weight_update_sharding else "off",
                format_ms(c.step_time_s),
                f"{c.step_time_s / best.step_time_s:.3f}x",
                format_gib(c.peak_memory_bytes),
            )
        console.print(ru)
