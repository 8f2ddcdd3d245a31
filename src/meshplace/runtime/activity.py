"""Where each rank is, so that a rank that dies can be named with what it was running.

A rank publishes four status words — the place it is at, its state, its step (1-based;
0 while setting up) and, while receiving, the place whose value it awaits — in a status
array. :func:`run_placement <meshplace.runtime.executor.run_placement>` shares that array
between its worker processes; under torchrun (``meshplace run --launcher torchrun`` or a
sharding plan) each rank writes it to a small memory-mapped file in the folder named by
``MESHPLACE_ACTIVITY_DIR``, beside the names of its places (written once, at setup), and
the launcher reads the dead rank's file after torchrun has stopped the job
(:func:`last_activity`). A write is a store into shared memory, no system call, so ranks
publish every op (placements) or the forward of every module down to three levels and the
model's backward (sharded and pipelined plans, :func:`watch_modules`: what costs is the
Python hooks, not the writes — about 0.06 ms of the Llama example's 3.5-4.3 ms step in
one process, from its parts' measured costs).
A rank killed outright (``SIGKILL``, the kernel's OOM killer) can still be named: the
words are in the page cache, not in the process.

Each rank's words sit in their own 128 bytes (``SLOT`` words) of the array: with every
rank's words in one cache line, each write would take the line from the other ranks' cores.

Example (one rank, no folder: a private array)::

    >>> activity = RankActivity(0, 1, ["op 'mm'", "op 'add'"])
    >>> activity.start_step(0); activity.at(1)
    >>> activity.status[STEP], activity.status[NODE]
    (1, 1)
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

#: The folder where torchrun ranks publish their status files (set by ``meshplace run``).
ACTIVITY_ENV = "MESHPLACE_ACTIVITY_DIR"

# rank states
SETUP, COMPUTE, RECV, SYNC, DONE = 0, 1, 2, 3, 4
STATE_NAMES = {
    SETUP: "setting up",
    COMPUTE: "computing",
    RECV: "waiting to receive",
    SYNC: "synchronizing",
    DONE: "done",
}
#: words per rank, and the words' positions inside a rank's slot
SLOT = 16
NODE, STATE, STEP, AWAITED = 0, 1, 2, 3
_WORD = 8  # bytes of a signed 64-bit word


class RankActivity:
    """The status words of rank ``rank`` of ``world`` and the names of its ``places``.

    ``status`` is a mutable sequence of ``SLOT * world`` integers (only this rank's slot,
    from ``SLOT * rank``, is written): a private list, or — with ``directory`` (default:
    the ``MESHPLACE_ACTIVITY_DIR`` environment variable) — a memory-mapped file
    ``rank{R}.status`` there, with ``rank{R}.places.json`` beside it. O(world) memory.
    """

    def __init__(
        self, rank: int, world: int, places: Sequence[str], directory: str | None = None
    ) -> None:
        self.rank, self.places, self.base = rank, list(places), SLOT * rank
        folder = directory if directory is not None else os.environ.get(ACTIVITY_ENV)
        self.status: Any
        if not folder:
            self.status = [0] * (SLOT * world)
            return
        path = Path(folder)
        names = path / f"rank{rank}.places.json"
        names.with_suffix(".tmp").write_text(json.dumps(self.places))
        names.with_suffix(".tmp").replace(names)  # a reader never sees half a list
        status = path / f"rank{rank}.status"
        status.write_bytes(bytes(SLOT * world * _WORD))
        with status.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), SLOT * world * _WORD)
        self.status = memoryview(self._map).cast("q")

    def start_step(self, step: int) -> None:
        """Step ``step`` (0-based) begins."""
        self.status[self.base + STEP] = step + 1
        self.status[self.base + STATE] = COMPUTE

    def meet_for_step(self, step: int) -> None:
        """Step ``step`` (0-based) begins: the rank publishes that it waits for the other
        ranks, meets them at a barrier of the default process group
        (``torch.distributed`` initialised), and is then at place 0."""
        import torch.distributed as dist

        self.start_step(step)
        self.at(0, SYNC)
        dist.barrier()
        self.at(0)

    def at(self, place: int, state: int = COMPUTE) -> None:
        """The rank is at place number ``place`` (an index into ``places``), in ``state``."""
        self.status[self.base + NODE] = place
        self.status[self.base + STATE] = state


def describe(places: Sequence[str], words: Sequence[int]) -> str:
    """What a rank with these four status words was doing, as a phrase after "while".

    >>> describe(["op 'mm'", "op 'add'"], [1, COMPUTE, 3, 0])
    "running op 'add' in step 3"
    >>> describe(["op 'mm'", "op 'add'"], [1, RECV, 3, 0])
    "waiting to receive op 'mm' (for op 'add') in step 3"
    >>> describe([], [0, SETUP, 0, 0])
    'setting up (before the first step)'
    """
    node, state, step, awaited = (int(w) for w in words[:4])
    if step == 0:
        return "setting up (before the first step)"

    def name(i: int) -> str:
        return places[i] if 0 <= i < len(places) else f"place {i}"

    if state == RECV:
        return f"waiting to receive {name(awaited)} (for {name(node)}) in step {step}"
    if state == SYNC:
        return f"synchronizing with the other ranks in step {step}"
    if state == DONE:
        return "finishing (after the last step)"
    return f"running {name(node)} in step {step}"


def last_activity(directory: str | Path, rank: int) -> str | None:
    """What rank ``rank`` was last doing, from its files in ``directory``
    (:func:`describe`), or None when it published nothing there (it died before setup)."""
    path = Path(directory)
    try:
        places = json.loads((path / f"rank{rank}.places.json").read_text())
        raw = (path / f"rank{rank}.status").read_bytes()
    except (OSError, ValueError):
        return None
    base = SLOT * rank * _WORD
    if len(raw) < base + 4 * _WORD:
        return None
    words = memoryview(raw[base : base + 4 * _WORD]).cast("q").tolist()
    return describe(places, words)


def module_places(model: Any) -> list[str]:
    """The places of a module tree: the forward and the backward of every module, in
    ``named_modules`` order (``2k``: forward of module k, ``2k + 1``: its backward), then
    the optimizer step. O(modules).

    >>> import torch
    >>> for place in module_places(torch.nn.Sequential(torch.nn.Linear(2, 2))):
    ...     print(place)
    the forward of the model (Sequential)
    the backward of the model (Sequential)
    the forward of module '0' (Linear)
    the backward of module '0' (Linear)
    the optimizer step
    """
    places = []
    for name, module in model.named_modules():
        what = f"module {name!r}" if name else "the model"
        kind = type(module).__name__
        places += [f"the forward of {what} ({kind})", f"the backward of {what} ({kind})"]
    return [*places, "the optimizer step"]


def watch_modules(
    model: Any,
    activity: RankActivity,
    on_leaf: Callable[[], None] | None = None,
    backward_depth: int = 0,
    forward_depth: int | None = 3,
) -> list[Any]:
    """Publish the module whose forward or backward this rank runs (the places of
    :func:`module_places`): for the modules at most ``forward_depth`` levels below the
    model (``None``: every module), a forward pre-hook marks a module's forward and a
    forward hook marks its parent's again; for those at most ``backward_depth`` levels
    below (0, the default: the model itself; 2: its children and theirs, a transformer's
    blocks), the forward hook also hooks the autograd node that made the module's output,
    which marks the module's backward as it starts. ``on_leaf`` is called at the forward
    of every watched module none of whose children is watched (fault injection in tests).
    Returns the hook handles.

    Cost per step: two Python calls per watched module and one Python autograd hook per
    marked backward — about 20 µs each on this host, an empty hook as much as ours, against
    ~4 µs for a module's two forward hooks. Why the defaults, measured on the Llama
    example's half-batch step (29 modules, 14 of them the linear layers at depth 4;
    3.5-5 ms of CPU; 300 steps paired in one process, session 49, docs/runtime.md): every
    module's forward and the backward marks down to depth 2 cost 0.25-0.34 ms (6-8 %);
    the forward down to depth 3 (the blocks' attention, MLP and norms, not their linear
    layers) 1-1.5 % alone, 4.2-4.6 % with the backward marks down to depth 2. Under
    torchrun, against DDP and FSDP2 written by hand step by step
    (``benchmarks/sharded_overhead.py --interleaved --without-hooks``), the hooks were the
    whole of the runtime's overhead: with the backward marks down to depth 2, +5.5 % and
    +8.4 % of the wall-clock step (+2.6 % and +0.6 % without any hook, the same run);
    with the model's backward marked alone, +0.8 / −2.9 % and +4.6 / −1.6 % in two runs
    (−3.9 / −3.9 % and −1.3 / −0.9 % without). A tensor hook on every output cost 0.46 ms
    of a 3.1 ms step, node pre-hooks on every module 0.28 ms. So a rank that dies in the
    backward is named "the backward of the model" unless a larger ``backward_depth`` is
    asked for (a long step pays for it less).
    """
    stack: list[int] = []
    handles = []

    for k, (name, module) in enumerate(model.named_modules()):
        depth = name.count(".") + 1 if name else 0
        if forward_depth is not None and depth > forward_depth:
            continue
        leaf = forward_depth == depth or next(module.children(), None) is None

        def pre(_module: Any, _args: Any, forward: int = 2 * k, leaf: bool = leaf) -> None:
            stack.append(forward)
            activity.at(forward)
            if leaf and on_leaf is not None:
                on_leaf()

        def mark(_grads: Any, backward: int = 2 * k + 1) -> None:
            activity.at(backward)

        def post(_module: Any, _args: Any, output: Any, mark: Any = mark) -> None:
            stack.pop()
            if stack:
                activity.at(stack[-1])
            if mark is not None:
                node = getattr(output, "grad_fn", None)  # a tensor output (the usual case)
                if node is None and isinstance(output, tuple | list) and output:
                    node = getattr(output[0], "grad_fn", None)
                if node is not None:
                    node.register_prehook(mark)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(
            module.register_forward_hook(
                post if depth <= backward_depth else partial(post, mark=None)
            )
        )
    return handles
