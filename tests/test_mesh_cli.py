"""`meshplace shard` through mesh.cli.cmd_shard: JSON keys, tables, bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from meshplace.errors import InputError
from meshplace.mesh.cli import add_shard_arguments, cmd_shard


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_shard_arguments(parser)
    return parser.parse_args(list(argv))


def _json(capsys, *argv: str) -> dict:
    assert cmd_shard(_args(*argv, "--json")) == 0
    return json.loads(capsys.readouterr().out)


def test_json_keys(capsys):
    data = _json(capsys, "transformer", "--size", "base", "--cluster", "tpu-v3-8")
    for key in (
        "mesh",
        "rules",
        "step_time_s",
        "peak_memory_bytes",
        "collectives",
        "runners_up",
        "exposed_comm_s",
        "overlapped_comm_s",
        "memory_bytes",
    ):
        assert key in data
    assert data["mesh"]["shape"] in ([4], [2, 2])
    assert all({"kind", "axes", "bytes", "time_s"} <= set(c) for c in data["collectives"])


def test_5b_on_512_chips_within_target(capsys):
    data = _json(capsys, "transformer", "--size", "5b", "--cluster", "tpu-v3-pod", "--chips", "512")
    assert data["fits"] and data["peak_memory_bytes"] <= data["memory_capacity_bytes"]
    assert data["chips"] == 512 and data["mesh"]["shape"][0] * data["mesh"]["shape"][1] == 512
    # Within target as fixed work: every legal layout costed at most twice (weight-update
    # sharding off and on), on the five 512-chip meshes; the seconds are reported, not tested.
    search = data["search"]
    assert 0 < search["evaluations"] <= 2 * search["layouts_legal"]
    assert search["mesh_shapes"] == ["512", "2x256", "4x128", "8x64", "16x32"]
    assert isinstance(search["seconds"], float)


def test_table_output_and_out_file(capsys, tmp_path):
    out = tmp_path / "shard.json"
    assert cmd_shard(_args("resnet50", "--cluster", "tpu-v3-8", "--out", str(out))) == 0
    text = capsys.readouterr().out
    assert "step time breakdown" in text and "memory per device" in text
    assert json.loads(out.read_text())["model"] == "resnet50"


def test_weight_update_sharding_flag(capsys):
    off = _json(
        capsys,
        "resnet50",
        "--cluster",
        "tpu-v3-8",
        "--mesh",
        "4",
        "--weight-update-sharding",
        "off",
    )
    on = _json(
        capsys, "resnet50", "--cluster", "tpu-v3-8", "--mesh", "4", "--weight-update-sharding", "on"
    )
    assert not off["weight_update_sharding"] and on["weight_update_sharding"]
    assert {c["kind"] for c in on["collectives"]} == {"reduce_scatter", "all_gather"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "16x16", "--chips", "512"], "must equal the chip count"),
        (["--mesh", "16x32", "--rules", "hidden=x"], "dimension 'hidden'"),
        (["--mesh", "16x32", "--rules", "batch"], "DIM=AXIS"),
        (["--chips", "4096"], "cannot use 4096 chips"),
    ],
)
def test_bad_input_is_one_sentence(argv, message):
    with pytest.raises(InputError, match=message) as err:
        cmd_shard(_args("transformer", "--size", "5b", "--cluster", "tpu-v3-pod", *argv))
    assert "\n" not in str(err.value)


def test_model_without_program_and_model_that_fits_nowhere():
    with pytest.raises(InputError, match="supports: transformer"):
        cmd_shard(_args("rnnlm", "--cluster", "tpu-v3-8"))
    with pytest.raises(InputError, match="fits no layout"):
        cmd_shard(_args("transformer", "--size", "5b", "--cluster", "tpu-v3-8"))
