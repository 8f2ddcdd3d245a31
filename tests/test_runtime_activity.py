"""What a rank publishes about where it is (meshplace.runtime.activity), read back after
it was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from meshplace.runtime.activity import (
    NODE,
    RankActivity,
    last_activity,
    module_places,
    watch_modules,
)


class _Probe(torch.autograd.Function):
    """Identity whose backward records the place the rank has published at that moment."""

    seen: list[int] = []  # noqa: RUF012 - a test's record
    activity: RankActivity | None = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        assert _Probe.activity is not None
        _Probe.seen.append(int(_Probe.activity.status[NODE]))
        return grad


class _ProbeModule(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Probe.seen.append(int(_Probe.activity.status[NODE]))  # its own forward
        return _Probe.apply(x)


def test_watched_modules_publish_each_forward_and_the_backward_that_runs() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), _ProbeModule(), torch.nn.Linear(3, 1))
    places = module_places(model)
    activity = RankActivity(0, 1, places, directory="")
    _Probe.activity, _Probe.seen = activity, []
    leaves: list[int] = []
    handles = watch_modules(
        model,
        activity,
        on_leaf=lambda: leaves.append(int(activity.status[NODE])),
        backward_depth=1,
    )
    model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    forward, backward = (places[i] for i in _Probe.seen)
    assert forward == "the forward of module '1' (_ProbeModule)"
    assert backward == "the backward of module '1' (_ProbeModule)"
    # by default only the model's own backward is marked: the probe's backward then runs
    # under the model's mark (the sum after the model has no mark of its own)
    for handle in handles:
        handle.remove()
    _Probe.seen = []
    watch_modules(model, activity)
    model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert [places[i] for i in _Probe.seen] == [
        "the forward of module '1' (_ProbeModule)",
        "the backward of the model (Sequential)",
    ]
    # every leaf module's forward, in the order they ran
    assert [places[i] for i in leaves] == [
        "the forward of module '0' (Linear)",
        "the forward of module '1' (_ProbeModule)",
        "the forward of module '2' (Linear)",
    ]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_modules_below_the_forward_depth_are_not_watched() -> None:
    """Depth 1 the blocks, 2 their Sequential, 3 its Linear and Tanh: down to depth 2, the
    Sequentials are the watched modules none of whose children is, and the modules below
    run on PyTorch's hook-free path; ``forward_depth=None`` watches every module."""
    model = torch.nn.Sequential(_Block(), _Block())
    places = module_places(model)
    activity = RankActivity(0, 1, places, directory="")
    leaves: list[int] = []
    handles = watch_modules(
        model,
        activity,
        on_leaf=lambda: leaves.append(int(activity.status[NODE])),
        forward_depth=2,
    )
    model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert [places[i] for i in leaves] == [
        "the forward of module '0.inner' (Sequential)",
        "the forward of module '1.inner' (Sequential)",
    ]
    assert len(handles) == 2 * 5  # the model, two blocks, two Sequentials: pre and post
    assert not model[0].inner[0]._forward_pre_hooks and not model[0].inner[0]._forward_hooks
    for handle in handles:
        handle.remove()
    leaves.clear()
    watch_modules(
        model,
        activity,
        on_leaf=lambda: leaves.append(int(activity.status[NODE])),
        forward_depth=None,
    )
    model(torch.randn(2, 3))
    assert [places[i] for i in leaves] == [
        f"the forward of module '{b}.inner.{k}' ({kind})"
        for b in (0, 1)
        for k, kind in ((0, "Linear"), (1, "Tanh"))
    ]


KILLED = """\
import os, signal, sys
from meshplace.runtime.activity import RECV, RankActivity
activity = RankActivity(1, 2, ["op 'mm'", "op 'add'"], directory=sys.argv[1])
activity.start_step(2)
activity.at(0)
activity.at(1)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_killed_outright_is_read_back_from_its_files(tmp_path: Path) -> None:
    """SIGKILL runs no handler: what the rank published is in the mapped file already."""
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], check=False)
    assert done.returncode == -signal.SIGKILL
    assert last_activity(tmp_path, 1) == "running op 'add' in step 3"
    assert last_activity(tmp_path, 0) is None  # published nothing: no phrase
    (tmp_path / "rank1.status").write_bytes(b"\x00" * 8)  # cut short: no phrase either
    assert last_activity(tmp_path, 1) is None


def test_without_a_folder_the_status_is_private(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MESHPLACE_ACTIVITY_DIR", raising=False)
    activity = RankActivity(0, 2, ["op 'mm'"])
    activity.at(0)
    assert isinstance(activity.status, list) and len(activity.status) == 32
    monkeypatch.setenv("MESHPLACE_ACTIVITY_DIR", str(tmp_path))
    RankActivity(1, 2, ["op 'mm'"]).start_step(0)
    assert sorted(os.listdir(tmp_path)) == ["rank1.places.json", "rank1.status"]
    assert last_activity(tmp_path, 1) == "running op 'mm' in step 1"
