"""JAX proof: a Transformer block under our layout on 8 virtual CPU devices equals the
unsharded run, and its compiled HLO has the collectives our cost model charges.

JAX runs in a fresh process so ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is
set before JAX is imported, whatever else this pytest process has imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

SCRIPT = """
import json
from meshplace.mesh.jax_export import verify_block
print(json.dumps([verify_block(), verify_block(weight_update_sharding=True)]))
"""


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def block(results) -> dict:
    return results[0]


def test_sharded_block_equals_unsharded(block):
    assert block["devices"] == 8
    assert block["max_abs_error"] < 1e-4
    assert block["max_abs_grad_error"] < 1e-3


def test_forward_collectives_match_the_cost_model(block):
    # batch over x, heads and d_ff over y: the attention output projection and the second
    # MLP matmul each all-reduce over y, nothing else
    assert block["forward"]["hlo"] == block["forward"]["charged"]
    assert block["forward"]["hlo"] == {"all-reduce@y": {"count": 2, "operands": 2}}


def test_gradient_collectives_match_the_cost_model(block):
    # forward (2) + the d_ff-contracting input gradient (1) over y; the six weight
    # gradients over x, which XLA's combiner fuses into one tuple all-reduce as our
    # per-layer gradient bucket does
    assert block["gradient"]["hlo"] == block["gradient"]["charged"]
    assert block["gradient"]["hlo"]["all-reduce@x"] == {"count": 1, "operands": 6}


def test_weight_update_sharding_reduces_the_same_gradients(results):
    res = results[1]
    assert res["max_abs_grad_error"] < 1e-3
    charged, hlo = res["gradient"]["charged"], res["gradient"]["hlo"]
    assert charged["reduce-scatter@x"] == {"count": 1, "operands": 6}
    # XLA's CPU pipeline lowers a sharded gradient as all-reduce + slice (its
    # reduce-scatter creator runs in the TPU/GPU pipelines): same axes, same tensors
    rs = hlo.get("reduce-scatter@x") or hlo.get("all-reduce@x")
    assert rs == {"count": 1, "operands": 6}
    assert hlo["all-reduce@y"] == charged["all-reduce@y"]
