"""What the host attention choices of ``meshplace.runtime.sharded`` cost a DTensor step.

The Llama example at batch 8 (``benchmarks/fidelity_models.py:build_llama_batch8``) with
every parameter and input a replicated DTensor on a 1-rank gloo mesh, one thread, a
forward and backward under ``implicit_replication`` three ways, in alternation:

* **math**: every attention call on PyTorch's math kernel (``sdpa_kernel(MATH)``), what
  ``sharded_step`` forced on the host before session 41;
* **flash, watched**: the CPU flash kernel under meshplace's sharding rule
  (``register_cpu_attention_sharding``) inside ``CpuAttentionKernel``, the
  ``TorchFunctionMode`` that ``HostAttention`` keeps for a run's first step only;
* **flash**: the flash kernel under the rule, no mode: a run's later steps when its
  first step needed no math kernel.

Each variant's median step over ``--steps`` rounds (after 3 untimed), the rounds
interleaved so that the host's drift touches all three alike.

Usage: ``python benchmarks/host_attention.py [--steps 15]`` (about 30 s;
``benchmarks/results/host_attention.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCE = str(ROOT / "benchmarks" / "fidelity_models.py") + ":build_llama_batch8"


def measure(steps: int) -> dict[str, float]:
    """Median seconds per step of each variant (module docstring)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from meshplace.graph.capture import as_loss
    from meshplace.graph.sources import build_from_seed
    from meshplace.runtime.processes import one_rank_world
    from meshplace.runtime.sharded import CpuAttentionKernel, register_cpu_attention_sharding

    with one_rank_world():
        mesh = init_device_mesh("cpu", (1,))
        model, args, kwargs = build_from_seed(SOURCE)
        for name, param in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            placed = distribute_tensor(param.detach(), mesh, [Replicate()])
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(placed))

        def replicate(x: Any) -> Any:
            return distribute_tensor(x, mesh, [Replicate()]) if isinstance(x, torch.Tensor) else x

        args = tuple(replicate(a) for a in args)
        kwargs = {k: replicate(v) for k, v in kwargs.items()}
        register_cpu_attention_sharding()
        variants = {
            "math": lambda: sdpa_kernel(SDPBackend.MATH),
            "flash, watched": CpuAttentionKernel,
            "flash": contextlib.nullcontext,
        }

        def step(context: Any) -> float:
            start = time.perf_counter()
            with implicit_replication(), context():
                loss, _how = as_loss(model(*args, **kwargs))
                loss.backward()
            model.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(steps + 3):
            for name, context in variants.items():
                seconds = step(context)
                if round_ >= 3:
                    times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="timed rounds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/host_attention.json"))
    args = parser.parse_args(argv)
    from meshplace.provenance import write_result

    medians = measure(args.steps)
    print("| attention | ms a step | vs math |\n|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {1e3 * seconds:.1f} | {100 * (seconds / medians['math'] - 1):+.1f} % |")
    write_result(
        args.out,
        {"model": SOURCE, "steps": args.steps, "median_step_s": medians},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
