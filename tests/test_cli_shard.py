"""`meshplace shard` through the command line: the acceptance command and bad input."""

from __future__ import annotations

import json
import time

from meshplace.cli import main


def test_5b_transformer_on_512_chips_within_a_minute_and_fits(capsys) -> None:
    start = time.perf_counter()
    code = main(
        [
            "shard",
            "transformer",
            "--size",
            "5b",
            "--cluster",
            "tpu-v3-pod",
            "--chips",
            "512",
            "--json",
        ]
    )
    elapsed = time.perf_counter() - start
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"mesh", "rules", "step_time_s", "peak_memory_bytes", "collectives"} <= set(out)
    assert elapsed < 60
    capacity = 32 * 2**30  # one TPU-v3 chip's HBM
    assert 0 < out["peak_memory_bytes"] <= capacity
    assert out["mesh"]["shape"][0] * out["mesh"]["shape"][1] == 512


def test_mesh_shape_that_does_not_match_the_chips_exits_2(capsys) -> None:
    code = main(
        [
            "shard",
            "transformer",
            "--size",
            "5b",
            "--cluster",
            "tpu-v3-pod",
            "--chips",
            "512",
            "--mesh",
            "16x16",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("meshplace: error: ") and err.count("\n") == 1
