"""`meshplace shard` through the command line: the acceptance command and bad input."""

from __future__ import annotations

import json

from meshplace.cli import main


def test_5b_transformer_on_512_chips_within_a_minute_and_fits(capsys) -> None:
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
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"mesh", "rules", "step_time_s", "peak_memory_bytes", "collectives"} <= set(out)
    # Within a minute as fixed work: each legal layout is costed at most twice (weight-update
    # sharding off and on); the search's seconds are reported, not timed here.
    assert 0 < out["search"]["evaluations"] <= 2 * out["search"]["layouts_legal"]
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
