"""``meshplace profile``: leveled profile of a model's training step on this machine's
devices, side by side, or a comparison of saved profiles (``--compare``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshplace.argtypes import positive_int, positive_seconds
from meshplace.errors import InputError
from meshplace.runtime.cli import DEFAULT_BUILD_TIMEOUT_S


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
        "--threads",
        type=positive_int,
        default=None,
        help="CPU intra-op threads (default: torch's)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="PROFILE",
        default=None,
        help="put saved profiles (single or combined files, e.g. from other machines) side "
        "by side instead of profiling",
    )
    parser.add_argument(
        "--runs", type=positive_int, default=3, help="timed runs per level (default 3)"
    )
    parser.add_argument("--batch", type=positive_int, default=None)
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
    parser.add_argument(
        "--top", type=positive_int, default=15, help="rows in the top-ops table (default 15)"
    )
    parser.add_argument(
        "--build-timeout",
        type=positive_seconds,
        default=DEFAULT_BUILD_TIMEOUT_S,
        metavar="SECONDS",
        help="give up on a FILE.py:FN model whose import or build function does not return "
        f"within this long (default {DEFAULT_BUILD_TIMEOUT_S:g})",
    )
    parser.add_argument("--json", action="store_true", help="print the profile JSON")


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric options, also when ``args`` was built by hand: one sentence each."""
    for flag, value in (
        ("--runs", args.runs),
        ("--threads", args.threads),
        ("--batch", args.batch),
        ("--top", args.top),
    ):
        if value is None and flag in ("--threads", "--batch"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{flag} must be a positive integer, got {value}")
    timeout = getattr(args, "build_timeout", DEFAULT_BUILD_TIMEOUT_S)
    if not (isinstance(timeout, int | float) and 0 < timeout < float("inf")):
        raise InputError(f"--build-timeout must be a positive number of seconds, got {timeout}")


def _output_paths(args: argparse.Namespace, devices: list[str]) -> tuple[Path, list[Path]]:
    """The profile file and the Chrome trace file(s) a profile of ``devices`` writes."""
    out = Path(args.out or "profile.json")
    if len(devices) == 1:
        return out, [Path(args.trace) if args.trace else out.with_suffix(".trace.json")]
    stem = Path(args.trace).with_suffix("") if args.trace else out.with_suffix("")
    return out, [Path(f"{stem}.{d.replace(':', '')}.trace.json") for d in devices]


def cmd_profile(args: argparse.Namespace) -> int:
    """Run ``meshplace profile``; returns the exit code. Every argument (numbers, levels,
    devices, output paths) is checked before anything is measured."""
    from meshplace.profile.profiler import (
        compare_profiles,
        format_tables,
        load_profiles,
        local_devices,
        parse_devices,
        parse_levels,
        save_profiles,
    )
    from meshplace.util import check_output_paths, print_json, write_text_atomic

    _check_numbers(args)
    if args.compare:
        if args.model:
            raise InputError("give either a MODEL to profile or --compare FILES, not both")
        if args.trace:
            raise InputError("--trace applies to profiling a MODEL, not to --compare")
        check_output_paths({"--out": args.out}, inputs=args.compare)
        profiles, labels = [], []
        for path in args.compare:
            for p in load_profiles(path):
                profiles.append(p)
                labels.append(f"{p.label} [{Path(path).name}]")
        if args.out:
            save_profiles(profiles, args.out)
        if args.json:
            print_json({"profiles": [p.to_dict() for p in profiles]})
            return 0
        print(compare_profiles(profiles, labels, args.top))
        if args.out:
            print(f"\nwrote {args.out}")
        return 0
    if not args.model:
        raise InputError("meshplace profile needs a MODEL, or --compare FILE [FILE ...]")
    levels = parse_levels(args.levels)
    devices = parse_devices(args.devices) if args.devices else local_devices()
    if "kernel" in levels and any(not d.startswith("cuda") for d in devices):
        if args.devices:
            raise InputError("the kernel level needs CUDA devices only; drop cpu from --devices")
        devices = [d for d in devices if d.startswith("cuda")]
        if not devices:
            raise InputError("the kernel level needs a CUDA device, and this machine has none")
    # the given paths first: the trace files' names derive from them
    check_output_paths({"--out": args.out or "profile.json", "--trace": args.trace})
    out, traces = _output_paths(args, devices)
    flags = {"--out": out, **{f"--trace ({d})": t for d, t in zip(devices, traces)}}
    if len(devices) == 1:
        flags = {"--out": out, "--trace": traces[0]}
    check_output_paths(flags, inputs=[args.model])
    profiles = [_profile_on(args, levels, d) for d in devices]
    if len(profiles) == 1:
        profiles[0].save(out, traces[0])
    else:
        save_profiles(profiles, out)
        for p, trace in zip(profiles, traces):
            write_text_atomic(trace, json.dumps(p.chrome_trace()))
    if args.json:
        data = profiles[0].to_dict() if len(profiles) == 1 else [p.to_dict() for p in profiles]
        print_json(data)
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

    spec = ModelSpec(
        args.model,
        batch=args.batch,
        size=args.size,
        build_timeout_s=getattr(args, "build_timeout", DEFAULT_BUILD_TIMEOUT_S),
    )
    try:
        model, example, name = spec.build()
    except InputError:
        raise
    except Exception as exc:  # building a named model failed: one sentence
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
