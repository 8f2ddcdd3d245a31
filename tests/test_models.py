"""Tests for the reference workloads in ``meshplace.models`` (all on the meta device, fast)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshplace.models import UnknownWorkloadError, Workload, available, get
from meshplace.models.dmcca import DeepMultisetCCA
from meshplace.models.lstm import LSTMCell
from meshplace.models.nmt import GNMT
from meshplace.models.rnnlm import RNNLanguageModel

ALL = [(name, size) for name, sizes in available().items() for size in sizes]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def trace_training_step(w: Workload) -> torch.fx.GraphModule:
    names = [n for n, _ in w.model.named_parameters()]
    params = [p.detach().requires_grad_(True) for _, p in w.model.named_parameters()]
    buffers = dict(w.model.named_buffers())

    def step(params: list[torch.Tensor], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss = functional_call(
            w.model, {**dict(zip(names, params, strict=True)), **buffers}, inputs
        )
        return torch.autograd.grad(loss, params)

    return make_fx(step)(params, *w.example_inputs)


def test_available_lists_every_workload_with_default_first() -> None:
    got = available()
    assert list(got) == [
        "rnnlm",
        "nmt",
        "inception_v3",
        "resnet50",
        "transformer",
        "gpt",
        "dmcca",
    ]
    assert got["nmt"] == ["2layer", "4layer"]
    assert got["transformer"] == ["base", "big", "mtf-5b"]
    assert got["gpt"] == ["124m", "350m", "774m", "1.5b", "2.7b", "6.7b", "13b", "175b"]
    assert got["dmcca"] == ["4view", "8view"]
    for name, sizes in got.items():
        assert get(name).size == sizes[0]
    got["gpt"].append("bogus")  # callers get a copy
    assert "bogus" not in available()["gpt"]


class RealAllocations(TorchDispatchMode):
    """Counts the bytes of every tensor an op creates anywhere but on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.bytes += t.numel() * t.element_size()
        return out


def test_real_allocations_are_counted() -> None:
    with RealAllocations() as counter:
        nn.Linear(100, 100)
    assert counter.bytes >= 100 * 100 * 4


@pytest.mark.parametrize(("name", "size"), ALL)
def test_builds_fast_on_meta_and_returns_scalar_loss(name: str, size: str) -> None:
    # Fast because nothing is materialised: not one byte of the (up to 27 GB of) weights
    # is allocated on a real device while the workload is built.
    with RealAllocations() as counter:
        w = get(name, size=size)
    assert counter.bytes == 0
    assert isinstance(w, Workload)
    assert (w.name, w.size) == (name, size)
    assert w.model.training
    assert all(p.device.type == "meta" for p in w.model.parameters())
    assert all(t.device.type == "meta" for t in w.example_inputs)
    assert w.dims["batch"] == w.example_inputs[0].shape[0]
    assert w.description
    assert "\n" not in w.description
    assert w.source
    if w.tokens is not None:
        assert w.tokens == w.dims["batch"] * w.dims["seq"]
    loss = w.model(*w.example_inputs)
    assert loss.device.type == "meta"
    assert loss.dim() == 0
    assert loss.dtype == torch.float32


def test_get_leaves_the_default_device_alone() -> None:
    get("resnet50")
    assert torch.empty(1).device.type == "cpu"


@pytest.mark.parametrize(
    ("name", "size", "expected"),
    [
        ("resnet50", None, 25_557_032),
        ("inception_v3", None, 27_161_264),
        ("gpt", "124m", 124_439_808),
    ],
)
def test_exact_parameter_counts(name: str, size: str | None, expected: int) -> None:
    assert n_params(get(name, size=size).model) == expected


@pytest.mark.parametrize(
    ("name", "size", "low", "high"),
    [
        ("transformer", "base", 63e6, 65e6),
        ("transformer", "big", 210e6, 215e6),
        ("transformer", "mtf-5b", 4.90e9 * 0.97, 4.90e9 * 1.03),
        ("gpt", "350m", 350e6, 360e6),
        ("gpt", "774m", 770e6, 780e6),
        ("gpt", "1.5b", 1.5e9, 1.6e9),
        ("gpt", "2.7b", 2.7e9 * 0.97, 2.7e9 * 1.03),
        ("gpt", "6.7b", 6.7e9 * 0.97, 6.7e9 * 1.03),
        ("gpt", "13b", 13.0e9 * 0.97, 13.0e9 * 1.03),
        ("gpt", "175b", 175.0e9 * 0.99, 175.0e9 * 1.01),
    ],
)
def test_parameter_counts_match_the_papers(name: str, size: str, low: float, high: float) -> None:
    assert low <= n_params(get(name, size=size).model) <= high


def test_inception_v3_macs_match_torchvision() -> None:
    w = get("inception_v3", batch=2)
    total = 0

    def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1]
            total += out.numel() * module.in_channels // module.groups * k
        else:
            total += out.numel() * module.in_features

    for m in w.model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            m.register_forward_hook(hook)
    w.model.eval()  # torchvision's 5.71 GFLOPS figure is for inference (no auxiliary head)
    w.model(*w.example_inputs)
    assert total / 2 == pytest.approx(5.71e9, rel=0.005)


def test_module_paths_are_meaningful() -> None:
    def paths(name: str, size: str | None = None) -> set[str]:
        return {n for n, _ in get(name, size=size).model.named_modules()}

    assert {"embedding", "lstm.0", "lstm.1", "softmax"} <= paths("rnnlm")
    assert {
        "encoder.lstm.0.fw",
        "encoder.lstm.0.bw",
        "encoder.lstm.3",
        "decoder.lstm.3",
        "decoder.attention",
        "decoder.softmax",
    } <= paths("nmt", "4layer")
    assert {"Mixed_5b", "Mixed_7c.branch3x3dbl_3b.conv", "AuxLogits.fc", "fc"} <= paths(
        "inception_v3"
    )
    assert {"conv1", "bn1", "layer1.0.conv1", "layer3.2.conv1", "layer4.0.downsample.0", "fc"} <= (
        paths("resnet50")
    )
    assert {
        "encoder.layers.3.self_attn",
        "decoder.layers.0.cross_attn",
        "decoder.layers.0.ffn",
    } <= (paths("transformer"))
    assert {"decoder.layers.5.self_attn", "decoder.layers.5.ffn", "softmax"} <= paths(
        "transformer", "mtf-5b"
    )
    assert {"layers.11.attn", "layers.11.mlp", "ln_f", "lm_head"} <= paths("gpt")
    assert {f"encoders.{i}" for i in range(8)} <= paths("dmcca", "8view")


def test_configured_dimensions() -> None:
    mtf = get("transformer", size="mtf-5b")
    assert mtf.dims["heads"] * mtf.dims["d_kv"] == 65_536
    assert (mtf.dims["batch"], mtf.dims["seq"], mtf.dims["d_ff"]) == (256, 256, 262_144)
    assert mtf.model.softmax.weight is not mtf.model.embedding.weight
    gpt = get("gpt")
    assert gpt.model.lm_head.weight is gpt.model.embedding.weight
    base = get("transformer")
    assert base.model.softmax.weight is base.model.embedding.weight
    assert get("rnnlm").dims["batch"] == 64
    assert get("nmt").dims["batch"] == 64
    assert get("inception_v3").example_inputs[0].shape == (32, 3, 299, 299)
    assert get("resnet50").example_inputs[0].shape == (32, 3, 224, 224)
    assert get("dmcca").dims["views"] == 4
    assert [t.shape[1] for t in get("dmcca", size="8view").example_inputs] == [
        784,
        512,
        1024,
        300,
        2048,
        128,
        40,
        256,
    ]


def test_batch_override() -> None:
    w = get("gpt", batch=2, size="350m")
    assert w.example_inputs[0].shape == (2, 1024)
    assert w.tokens == 2048
    assert w.dims["batch"] == 2
    assert get("transformer", size="mtf-5b", batch=3).tokens == 3 * 256
    assert get("rnnlm", batch=1).model(*get("rnnlm", batch=1).example_inputs).dim() == 0


def _assert_one_sentence(message: str, *needles: str) -> None:
    assert message.endswith(".")
    assert ". " not in message
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_unknown_name_is_one_sentence_listing_choices() -> None:
    with pytest.raises(UnknownWorkloadError) as err:
        get("vgg16")
    _assert_one_sentence(str(err.value), "'vgg16'", *(repr(n) for n in available()))
    assert isinstance(err.value, ValueError)


def test_unknown_size_is_one_sentence_listing_choices() -> None:
    with pytest.raises(UnknownWorkloadError) as err:
        get("gpt", size="530b")
    _assert_one_sentence(str(err.value), "'530b'", "'gpt'", "'124m'", "'1.5b'", "'6.7b'")
    with pytest.raises(UnknownWorkloadError):
        get("resnet50", size="101")


@pytest.mark.parametrize("batch", [0, -3, 2.0, True, "8", None])
def test_bad_batch_is_rejected(batch: object) -> None:
    if batch is None:
        assert get("dmcca", batch=batch).dims["batch"] == 256
        return
    with pytest.raises(UnknownWorkloadError) as err:
        get("dmcca", batch=batch)  # type: ignore[arg-type]
    _assert_one_sentence(str(err.value), repr(batch), "'dmcca'")


def test_batch_of_one_is_rejected_where_statistics_need_two() -> None:
    with pytest.raises(UnknownWorkloadError) as err:
        get("dmcca", batch=1)
    _assert_one_sentence(str(err.value), ">= 2")
    w = get("inception_v3", batch=1)  # fine for inference, BatchNorm needs 2 to train
    assert w.model.eval()(*w.example_inputs).dim() == 0


# No wall-clock limits: neither per example (deadline) nor on generating data (too_slow).
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=2, max_value=10_000))
def test_any_positive_batch_is_accepted(batch: int) -> None:
    w = get("dmcca", batch=batch)
    assert [t.shape[0] for t in w.example_inputs] == [batch] * 4


@pytest.mark.parametrize(
    ("name", "size"), [("resnet50", None), ("transformer", "mtf-5b"), ("dmcca", "4view")]
)
def test_training_step_traces_with_make_fx(name: str, size: str | None) -> None:
    gm = trace_training_step(get(name, size=size))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert len(gm.graph.nodes) > 300
    assert any("backward" in t for t in targets) or "aten.mm.default" in targets


def test_lstm_cell_matches_torch_lstm_cell() -> None:
    torch.manual_seed(0)
    ours = LSTMCell(5, 7)
    ref = nn.LSTMCell(5, 7)
    with torch.no_grad():
        ref.weight_ih.copy_(ours.gates.weight[:, :5])
        ref.weight_hh.copy_(ours.gates.weight[:, 5:])
        ref.bias_ih.copy_(ours.gates.bias)
        ref.bias_hh.zero_()
    x, h, c = torch.randn(3, 5), torch.randn(3, 7), torch.randn(3, 7)
    h1, c1 = ours(x, (h, c))
    h2, c2 = ref(x, (h, c))
    torch.testing.assert_close(h1, h2)
    torch.testing.assert_close(c1, c2)


def test_small_recurrent_models_run_on_cpu() -> None:
    torch.manual_seed(0)
    lm = RNNLanguageModel(vocab=50, embed=8, hidden=8, layers=2)
    ids = torch.randint(0, 50, (3, 6))
    loss = lm(ids, ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert lm.lstm[0].gates.weight.grad is not None
    nmt = GNMT(vocab=30, embed=8, hidden=8, layers=4, attention=6)
    src, tgt = torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 4))
    loss = nmt(src, tgt, tgt)
    loss.backward()
    assert torch.isfinite(loss)
    assert nmt.decoder.attention.key_proj.weight.grad is not None
    assert loss.item() == pytest.approx(torch.log(torch.tensor(30.0)).item(), rel=0.3)


def test_dmcca_loss_is_minus_one_for_identical_views() -> None:
    torch.manual_seed(0)
    model = DeepMultisetCCA((6, 6, 6), hidden=16, out_dim=4, eps=1e-10).double()
    for enc in model.encoders[1:]:
        enc.load_state_dict(model.encoders[0].state_dict())
    x = torch.randn(64, 6, dtype=torch.float64)
    assert model(x, x, x).item() == pytest.approx(-1.0, abs=1e-3)
    loss = model(x, torch.randn_like(x), torch.randn_like(x))
    assert -1.0 < loss.item() < 0.5
