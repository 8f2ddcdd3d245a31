"""Keep freed memory in the process, so a training step's large tensors are not faulted
in again every step (glibc hosts).

Why: glibc's ``malloc`` gives large blocks back to the operating system when they are
freed — blocks over its mmap threshold are unmapped, and free memory at the top of a heap
over the trim threshold is trimmed — so a step that allocates and frees the same
megabyte-sized tensors each step (a flat gradient bucket, its all-reduced copy, Adam's
temporaries) touches fresh pages every time and pays a page fault per 4 KiB page. On this
project's 2-core host an 8 MB ``torch.cat`` inside a training step took 4 ms instead of
0.6, and the fidelity MLP's data-parallel step on DTensor (one process on a fake process
group) 25-29 ms instead of 18-21 ms (docs/runtime.md, "Session 50"). jemalloc and
tcmalloc keep such memory; PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``)
preloads one of them for this reason. Without either, glibc's ``mallopt`` does the same
from inside the process: a fixed mmap threshold at glibc's maximum (32 MiB; a fixed one
also stops glibc raising it on its own) and a trim threshold of 2 GiB, so blocks up to
32 MiB come from the heap and what a step frees stays for the next. Between steps the
process keeps its high-water mark instead of returning it; its peak resident set (which
the runtime reports on CPU) is about the same — the memory was in use at the peak — but
not guaranteed equal: blocks freed in the heap's middle can fragment it.

:func:`keep_freed_memory` is called where meshplace starts a process that trains or
times a step — the ``meshplace`` command, each torchrun rank of ``python -m
meshplace.runtime``, the dry run's child — and forked workers inherit the setting.
``MESHPLACE_KEEP_FREED_MEMORY=0`` leaves glibc's defaults. Elsewhere (musl, macOS,
Windows) it does nothing. O(1).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: the environment variable that turns it off (``0``)
KEEP_FREED_MEMORY_ENV = "MESHPLACE_KEEP_FREED_MEMORY"
#: glibc's ``mallopt`` parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap (glibc's maximum on 64-bit hosts)
MMAP_THRESHOLD_BYTES = 32 * 2**20
#: free memory a heap keeps at its top before glibc returns it (``mallopt``'s value is a
#: C int: the largest it takes)
TRIM_THRESHOLD_BYTES = 2**31 - 1
_kept = [False]  # whether this process (or the one it was forked from) set it


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed memory in this process (module docstring);
    returns whether it did — ``False`` off glibc, where ``mallopt`` refuses, or with
    ``MESHPLACE_KEEP_FREED_MEMORY=0``. Idempotent. O(1).

    >>> keep_freed_memory() in (True, False)
    True
    """
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept[0] = bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _kept[0]


def keeps_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` took effect in this process (or in the process
    it was forked from): benchmarks record it with their results. O(1)."""
    return _kept[0]
