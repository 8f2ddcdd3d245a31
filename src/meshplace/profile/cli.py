"""``meshplace profile``: leveled profile of a model's training step on this machine's
devices, side by side, or a comparison of saved profiles (``--compare``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshplace.errors import InputError


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``meshplace profile``."""
    parser.add_argument(
        "model",
        nargs="?",
        help="reference workload, small runtime model (mlp, nmt-small…) or FILE.py:FN",
    )
    parser.add_argument(
        "--levels",
        default="model,module,op",
        help="comma-separated among model,module,op,kernel (a level implies those above "
        "it; kernel needs CUDA)",
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="comma-separated torch devices to profile on, side by side (default: every "
        "local device: cpu and each cuda:i)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="PROFILE",
        default=None,
        help="put saved profiles (single or combined files, e.g. from other machines) side "
        "by side instead of profiling",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs per level (default 3)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", default=None)
    parser.add_argument(
        "--out",
        default=None,
        help="profile JSON (default profile.json; a combined meshplace.profiles file when "
        "there are several devices; with --compare, written only when given)",
    )
    parser.add_argument(
        "--trace", default=None, help="Chrome trace file (default: OUT with .trace.json)"
    )
    parser.add_argument("--top", type=int, default=15, help="rows in the top-ops table")
    parser.add_argument("--json", action="store_true", help="print the profile JSON")


def cmd_profile(args: argparse.Namespace) -> int:
    """Run ``meshplace profile``; returns the exit code."""
    from meshplace.profile.profiler import (
        compare_profiles,
        format_tables,
        load_profiles,
        local_devices,
        parse_devices,
        parse_levels,
        save_profiles,
    )

    if args.compare:
        if args.model:
            raise InputError("give either a MODEL to profile or --compare FILES, not both")
        profiles, labels = [], []
        for path in args.compare:
            for p in load_profiles(path):
                profiles.append(p)
                labels.append(f"{p.label} [{Path(path).name}]")
        if args.out:
            save_profiles(profiles, args.out)
        if args.json:
            print(json.dumps({"profiles": [p.to_dict() for p in profiles]}, indent=1))
            return 0
        print(compare_profiles(profiles, labels, args.top))
        if args.out:
            print(f"\nwrote {args.out}")
        return 0
    if not args.model:
        raise InputError("meshplace profile needs a MODEL, or --compare FILE [FILE ...]")
    levels = parse_levels(args.levels)
    if args.runs is None or args.runs < 1:
        raise InputError(f"--runs must be a positive integer, got {args.runs}")
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads must be a positive integer, got {args.threads}")
    devices = parse_devices(args.devices) if args.devices else local_devices()
    if "kernel" in levels and any(not d.startswith("cuda") for d in devices):
        if args.devices:
            raise InputError("the kernel level needs CUDA devices only; drop cpu from --devices")
        devices = [d for d in devices if d.startswith("cuda")]
        if not devices:
            raise InputError("the kernel level needs a CUDA device, and this machine has none")
    profiles = [_profile_on(args, levels, d) for d in devices]
    out = Path(args.out or "profile.json")
    if len(profiles) == 1:
        trace = Path(args.trace) if args.trace else out.with_suffix(".trace.json")
        profiles[0].save(out, trace)
        traces = [trace]
    else:
        save_profiles(profiles, out)
        stem = Path(args.trace).with_suffix("") if args.trace else out.with_suffix("")
        traces = []
        for d, p in zip(devices, profiles):
            trace = Path(f"{stem}.{d.replace(':', '')}.trace.json")
            trace.write_text(json.dumps(p.chrome_trace()))
            traces.append(trace)
    if args.json:
        data = profiles[0].to_dict() if len(profiles) == 1 else [p.to_dict() for p in profiles]
        print(json.dumps(data, indent=1))
        return 0
    if len(profiles) == 1:
        print(format_tables(profiles[0], args.top))
    else:
        print(compare_profiles(profiles, top=args.top))
    print(f"\nwrote {out} and {', '.join(map(str, traces))}")
    return 0


def _profile_on(args: argparse.Namespace, levels: list[str], device: str):
    """One device's profile of ``args.model`` (built afresh, so devices do not share
    optimizer state)."""
    import torch

    from meshplace.profile.calibrate import measure_device
    from meshplace.profile.profiler import profile_model
    from meshplace.runtime.program import ModelSpec, materialize, real_inputs

    spec = ModelSpec(args.model, batch=args.batch, size=args.size)
    try:
        model, example, name = spec.build()
    except InputError:
        raise
    except Exception as exc:  # the user's builder failed: one sentence
        raise InputError(f"{args.model}: building the model failed: {exc}") from None
    model = materialize(model, spec.seed)
    inputs = real_inputs(example, spec.seed)
    threads = args.threads or torch.get_num_threads()
    info = measure_device(threads=threads, device=device)
    prof = profile_model(
        model,
        inputs,
        name=name,
        levels=levels,
        runs=args.runs,
        device=info,
        on=device,
        threads=threads,
    )
    prof.meta.update({"model": args.model, "batch": args.batch, "size": args.size})
    return prof
