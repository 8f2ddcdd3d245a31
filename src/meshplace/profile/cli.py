"""``meshplace profile``: leveled profile of a model's training step on this machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshplace.errors import InputError


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``meshplace profile``."""
    parser.add_argument(
        "model", help="reference workload, small runtime model (mlp, nmt-small…) or FILE.py:FN"
    )
    parser.add_argument(
        "--levels",
        default="model,module,op",
        help="comma-separated among model,module,op (a level implies those above it)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs per level (default 3)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", default=None)
    parser.add_argument("--out", default="profile.json", help="profile JSON (meshplace.profile)")
    parser.add_argument(
        "--trace", default=None, help="Chrome trace file (default: OUT with .trace.json)"
    )
    parser.add_argument("--top", type=int, default=15, help="rows in the top-ops table")
    parser.add_argument("--json", action="store_true", help="print the profile JSON")


def cmd_profile(args: argparse.Namespace) -> int:
    """Run ``meshplace profile``; returns the exit code."""
    import torch

    from meshplace.profile.calibrate import measure_device
    from meshplace.profile.profiler import parse_levels, profile_model
    from meshplace.runtime.program import ModelSpec, materialize, real_inputs, trace_step

    levels = parse_levels(args.levels)
    if args.runs is None or args.runs < 1:
        raise InputError(f"--runs must be a positive integer, got {args.runs}")
    spec = ModelSpec(args.model, batch=args.batch, size=args.size)
    try:
        model, example, name = spec.build()
    except InputError:
        raise
    except Exception as exc:  # the user's builder failed: one sentence
        raise InputError(f"{args.model}: building the model failed: {exc}") from None
    del trace_step
    model = materialize(model, spec.seed)
    inputs = real_inputs(example, spec.seed)
    device = measure_device(threads=torch.get_num_threads())
    device["threads"] = torch.get_num_threads()
    prof = profile_model(model, inputs, name=name, levels=levels, runs=args.runs, device=device)
    prof.meta.update({"model": args.model, "batch": args.batch, "size": args.size})
    out = Path(args.out)
    trace = Path(args.trace) if args.trace else out.with_suffix(".trace.json")
    prof.save(out, trace)
    if args.json:
        print(json.dumps(prof.to_dict(), indent=1))
        return 0
    from meshplace.profile.profiler import format_tables

    print(format_tables(prof, args.top))
    print(f"\nwrote {out} and {trace}")
    return 0
