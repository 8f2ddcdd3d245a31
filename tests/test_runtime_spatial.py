"""Spatially partitioned convolutions on DTensor (meshplace.runtime.spatial): an image
split along height, width or both (evenly or not, beside a batch split) convolves as the
whole image does, forward and backward, on 4 gloo ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshplace.errors import InputError
from meshplace.runtime.spatial import use_spatial_convolutions

# (convolution, input shape, mesh shape, input placements)
CASES: list[tuple[Any, tuple[int, ...], tuple[int, ...], tuple[str, ...]]] = [
    (lambda: torch.nn.Conv2d(3, 4, 5, padding=2), (1, 3, 9, 14), (4,), ("w",)),  # 4,4,4,2
    (lambda: torch.nn.Conv2d(3, 4, 3, padding=2, dilation=2), (1, 3, 12, 7), (4,), ("h",)),
    (lambda: torch.nn.Conv2d(3, 4, 3, padding=1), (2, 3, 8, 8), (2, 2), ("n", "w")),
    (lambda: torch.nn.Conv2d(3, 4, 3, padding=1, groups=1), (1, 3, 8, 10), (2, 2), ("h", "w")),
    (lambda: torch.nn.Conv1d(3, 4, 3, padding=1), (2, 3, 16), (4,), ("w",)),
    (lambda: torch.nn.Conv3d(2, 2, 3, padding=1), (1, 2, 4, 4, 8), (4,), ("w",)),
]


def _placement(label: str, ndim: int) -> Any:
    from torch.distributed.tensor import Shard

    return Shard({"n": 0, "h": ndim - 2, "w": ndim - 1}[label])


def _check_cases(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    for k, (make, shape, mesh_shape, labels) in enumerate(CASES):
        torch.manual_seed(k)
        whole = make()
        x = torch.randn(shape, requires_grad=True)
        weight_of_loss = torch.randn((shape[0], whole.out_channels, *shape[2:]))
        (whole(x) * weight_of_loss).sum().backward()

        mesh = init_device_mesh("cpu", mesh_shape)
        split = make()
        split.load_state_dict(whole.state_dict())
        use_spatial_convolutions(split)
        for name, p in list(split.named_parameters()):
            placed = distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim)
            setattr(split, name, torch.nn.Parameter(placed))
        places = [_placement(label, len(shape)) for label in labels]
        xd = distribute_tensor(x.detach(), mesh, places).requires_grad_()
        out = split(xd)
        assert out.placements == tuple(places), (k, out.placements)
        (out * distribute_tensor(weight_of_loss, mesh, places)).sum().backward()
        pairs = [
            ("output", out.full_tensor(), whole(x)),
            ("input grad", xd.grad.full_tensor(), x.grad),
            ("weight grad", split.weight.grad.full_tensor(), whole.weight.grad),
            ("bias grad", split.bias.grad.full_tensor(), whole.bias.grad),
        ]
        for what, got, want in pairs:
            # float32 sums in another order: equal to 1e-5 relative
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (k, what, rank)


def _rank(rank: int, store: str) -> None:
    # forked: one thread, as the parent's OpenMP pool does not survive the fork (and the
    # host's cores are shared by 4 ranks anyway)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4)
    _check_cases(rank)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalisation with gloo threads alive (pytorch#179291)


def test_split_images_convolve_as_the_whole_image_forward_and_backward(tmp_path: Path) -> None:
    # forked, not spawned: a spawned rank's fresh interpreter importing torch was most of
    # this test's time; the convolutions and their checks are the same in either
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"))) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


class _SplitInput:
    """Stands for a DTensor split along its width, for the checks made before any message."""

    def __init__(self) -> None:
        from torch.distributed.tensor import Shard

        self.placements = (Shard(3),)
        self.ndim = 4


@pytest.mark.parametrize(
    ("conv", "problem"),
    [
        (torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), "stride (2, 2)"),
        (torch.nn.Conv2d(3, 4, 3), "kernel 3, dilation 1 and padding 0 along dimension 3"),
        (torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), "padding mode 'reflect'"),
        (torch.nn.Conv2d(3, 4, 3, padding="same"), "padding 'same'"),
    ],
)
def test_a_convolution_a_split_image_cannot_run_is_one_sentence(conv: Any, problem: str) -> None:
    from meshplace.runtime.spatial import _same_padding, spatial_dims

    x = _SplitInput()
    with pytest.raises(InputError, match=r"^a Conv2d with ") as caught:
        _same_padding(conv, spatial_dims(x.placements, x.ndim), x)
    assert problem in str(caught.value) and "\n" not in str(caught.value)


CONV_NET = """\
import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.conv3 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width, 10)

    def forward(self, x, y):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return nn.functional.cross_entropy(self.head(x.mean(dim=(2, 3))), y)


def build():
    return ConvNet(), (torch.randn(1, 3, 512, 512), torch.tensor([3]))
"""


def test_the_solvers_spatial_plan_of_a_conv_net_trains_under_torchrun_like_one_process(
    tmp_path: Path,
) -> None:
    """One 512x512 image through three 3x3 convolutions on 2 H100s: the sharding solver
    splits the image (height or width) at every convolution rather than the batch of one
    or the 16 channels; under torchrun (2 CPU ranks, gloo) the losses and every parameter
    after 3 Adam steps are one process's within 1e-5, and each rank holds the plan's
    parameter, gradient and optimizer-state bytes exactly."""
    import json

    from meshplace.graph.capture import capture
    from meshplace.graph.sources import load_build_function
    from meshplace.hardware import load_cluster
    from meshplace.parallel.search import shard_graph
    from tests.forked_ranks import run_forked_ranks
    from tests.test_runtime_torchrun import one_process_losses

    (tmp_path / "convnet.py").write_text(CONV_NET)
    source = f"{tmp_path / 'convnet.py'}:build"
    torch.manual_seed(0)
    model, args = load_build_function(source)()
    graph = capture(model, args, training=True)
    plan = shard_graph(graph, load_cluster("dgx-h100"), chips=2).best.plan_file(source, "dgx-h100")
    assert plan["inputs"]["x"]["placements"] in (["Shard(2)"], ["Shard(3)"]), plan["inputs"]
    convolutions = {op: s for op, s in plan["ops"].items() if op.startswith("convolution")}
    assert len(convolutions) == 6 and set(convolutions.values()) <= {"h@x", "w@x"}, convolutions
    (tmp_path / "plan.json").write_text(json.dumps(plan))

    done = run_forked_ranks(
        tmp_path, 2, "--plan", "plan.json", "--steps", "3", "--warmup", "1", "--json",
        "--checkpoint-dir", "ck",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    expected, trained = one_process_losses(source, 3)
    assert torch.allclose(
        torch.tensor(report["measured"]["losses"]), torch.tensor(expected), rtol=0, atol=1e-5
    )
    saved = torch.load(tmp_path / "ck" / "rank0.pt")
    reference = dict(trained.named_parameters())
    assert sorted(saved) == sorted(reference)
    for name, value in saved.items():
        assert torch.allclose(value, reference[name].detach(), rtol=0, atol=1e-5), name
    for kind in ("parameters", "gradients", "optimizer_state"):
        memory = report["memory_per_rank"][kind]
        assert memory["measured"] == [memory["predicted"]] * 2, kind
