"""meshplace.hostmemory: glibc told to keep freed memory, so a step's megabyte-sized
temporaries are not faulted in again every step."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import subprocess
import sys

import pytest

from meshplace.hostmemory import KEEP_FREED_MEMORY_ENV, keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A training step's allocation pattern — two 4 MiB gradients, their 8 MiB flat bucket,
# its reduced copy (what a functional all-reduce returns), an update's temporaries — run
# 60 times, with glibc's own account of its memory (mallinfo2, glibc 2.33+): MiB in the
# heap (and used in it) and MiB mapped on their own (the blocks glibc unmaps on free), after the two
# 4 MiB parameters are allocated and after each step. Allocator state, unlike page-fault
# counts, does not change with the host's transparent-huge-page setting.
STEPS = """
import ctypes, ctypes.util, json
import torch
from meshplace.hostmemory import keep_freed_memory
applied = keep_freed_memory()
torch.set_num_threads(1)
class MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallocInfo
def account():
    info = libc.mallinfo2()
    return {"heap": info.arena / 2**20, "used_in_heap": info.uordblks / 2**20,
            "mapped": info.hblkhd / 2**20}
before = account()
params = [torch.ones(2**20) for _ in range(2)]
with_params = account()
after_step = []
for _ in range(60):
    grads = [p * 2 for p in params]
    flat = torch.cat(grads)
    reduced = flat * 0.5
    del grads, flat
    moments = torch._foreach_mul(list(reduced.split(2**20)), 0.9)
    del moments, reduced
    after_step.append(account())
print(json.dumps({"applied": applied, "before": before, "with_params": with_params,
                  "after_step": after_step}))
"""


def _allocator_account(keep: bool) -> dict:
    env = {**os.environ, KEEP_FREED_MEMORY_ENV: "1" if keep else "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", STEPS], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c") if GLIBC else None
    return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="mallopt and mallinfo2 are glibc's (2.33+)")
def test_a_steps_blocks_come_from_a_heap_that_stops_growing() -> None:
    """glibc's defaults map a 4 MiB block on its own (and unmap it on free, so the next
    step faults its pages in again); with freed memory kept, every block of the step comes
    from the heap, none is mapped on its own, and the heap levels off — what a step frees,
    the next reuses — instead of growing step after step."""
    default, kept = _allocator_account(keep=False), _allocator_account(keep=True)
    assert (default["applied"], kept["applied"]) == (False, True)
    assert default["with_params"]["mapped"] - default["before"]["mapped"] >= 8

    assert kept["with_params"]["used_in_heap"] - kept["before"]["used_in_heap"] >= 8
    assert all(step["mapped"] == kept["before"]["mapped"] for step in kept["after_step"])
    # fragmentation (PyTorch's 64-byte-aligned blocks) may add a block now and then (12 MiB
    # over these 50 steps in one clean-clone run, where 8 had been the bound); a heap that
    # never reused what a step freed would grow by a step's 32 MiB every step, 1,600 MiB
    # in all: over the 50 steps it grows by less than one step's allocations
    step_mib = 2 * 4 + 8 + 8 + 2 * 4  # the gradients, the bucket, its copy, the moments
    assert kept["after_step"][59]["heap"] - kept["after_step"][9]["heap"] < step_mib


def test_the_environment_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "0")
    assert keep_freed_memory() is False


def test_benchmark_results_say_whether_memory_was_kept() -> None:
    from meshplace.provenance import provenance

    assert isinstance(provenance()["keeps_freed_memory"], bool)
