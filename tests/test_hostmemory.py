"""meshplace.hostmemory: glibc told to keep freed memory, so a step's megabyte-sized
temporaries are not faulted in again every step."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from meshplace.hostmemory import KEEP_FREED_MEMORY_ENV, keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A step's allocation pattern that glibc's defaults return to the system every time:
# two 4 MiB gradients, their 8 MiB flat bucket, its reduced copy (what a functional
# all-reduce returns), an update's temporaries. Prints the minor page faults per step.
STEP = """
import resource, sys
import torch
from meshplace.hostmemory import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
torch.set_num_threads(1)
params = [torch.ones(2**20) for _ in range(2)]
def step():
    grads = [p * 2 for p in params]
    flat = torch.cat(grads)
    reduced = flat * 0.5
    del grads, flat
    moments = torch._foreach_mul(list(reduced.split(2**20)), 0.9)
    return float(moments[0][0])
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults_per_step(keep: bool) -> tuple[float, str]:
    env = {**os.environ, KEEP_FREED_MEMORY_ENV: "1" if keep else "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", STEP], capture_output=True, text=True, env=env, check=True
    )
    return float(done.stdout.strip()), done.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_kept_memory_is_not_faulted_in_again_each_step() -> None:
    """The same step in two fresh processes: with glibc's defaults each step faults in
    about its 8 MiB of temporaries again (~2,000 pages of 4 KiB); with freed memory kept,
    under a tenth of that."""
    default, applied_default = _faults_per_step(keep=False)
    kept, applied_kept = _faults_per_step(keep=True)
    assert (applied_default, applied_kept) == ("False", "True")
    assert default > 1000, default
    assert kept * 10 < default, (kept, default)


def test_the_environment_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "0")
    assert keep_freed_memory() is False


def test_benchmark_results_say_whether_memory_was_kept() -> None:
    from meshplace.provenance import provenance

    assert isinstance(provenance()["keeps_freed_memory"], bool)
