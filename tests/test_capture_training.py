"""Capturing what training runs use (issue 16): activation checkpointing, keyword inputs and
output objects with a loss, precision (--dtype/--autocast), fused attention with dropout,
torch.compile'd modules, and the file.py:build capture cache."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshplace.cli import main
from meshplace.graph import CaptureError, capture, graph_from_json, graph_to_json


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    """Two residual blocks after an input layer (so the reentrant variant's block inputs
    require grad, as the hidden states of a real model do)."""

    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
        return h.pow(2).mean()


def _recomputed(g) -> list:
    names = g.meta.get("recomputed", {})
    return [o for o in g.ops if o.name in names]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_the_forward_in_backward(reentrant: bool) -> None:
    x = (torch.randn(4, 8),)
    plain = capture(_Stack(), x)
    ckpt = capture(_Stack(reentrant), x)
    assert "recomputed" not in plain.meta
    assert ckpt.meta["checkpoint"] == ("reentrant" if reentrant else "non-reentrant")
    recomputed = _recomputed(ckpt)
    assert {o.phase for o in recomputed} == {"backward"}
    # each block's first linear (and its relu) runs again, linked to the op it re-runs;
    # the reentrant variant also re-runs the second linear (no early stop)
    for block in ("blocks.0", "blocks.1"):
        up = [o for o in recomputed if o.module == f"{block}.up" and o.kind == "matmul"]
        assert len(up) == 1
        original = ckpt.op(up[0].forward_op)
        assert original.phase == "forward" and original.module == f"{block}.up"
        assert original.flops == up[0].flops
    n_down = sum(o.module.endswith(".down") and o.kind == "matmul" for o in recomputed)
    assert n_down == (2 if reentrant else 0)
    # the step's cost grows by exactly the recomputed ops; the forward stays the same
    extra = sum(o.flops for o in recomputed)
    assert extra > 0
    assert ckpt.total_flops("forward") == plain.total_flops("forward")
    assert ckpt.total_flops() == pytest.approx(plain.total_flops() + extra)
    # gradient ops still point at forward ops, and fewer activations are kept for backward
    for o in ckpt.ops:
        if o.phase == "backward" and o.forward_op is not None:
            assert ckpt.op(o.forward_op).phase == "forward"
    from meshplace.graph.summary import summarize

    assert summarize(ckpt)["activation_bytes"] < summarize(plain)["activation_bytes"]
    # the mark survives the graph file
    again = graph_from_json(graph_to_json(ckpt))
    assert again.meta["recomputed"] == ckpt.meta["recomputed"]
    assert [o.forward_op for o in again.ops] == [o.forward_op for o in ckpt.ops]


@dataclass
class _Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class _LM(nn.Module):
    """A Hugging Face-style model: keyword inputs, an output object, attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> _Output:
        h = self.emb(input_ids)
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        logits = self.head(h + a.transpose(1, 2).reshape(b, s, 16))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return _Output(logits, loss)


class _Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.emb(ids)}


def _ids() -> torch.Tensor:
    return torch.zeros(2, 8, dtype=torch.long)


def test_keyword_inputs_and_output_loss() -> None:
    g = capture(_LM(), (), example_kwargs={"input_ids": _ids(), "labels": _ids()})
    assert [o.name for o in g.ops if o.kind == "input"] == ["input:input_ids", "input:labels"]
    assert g.meta["loss"] == "output.loss"
    assert g.count_by("kind")["loss"] == 1
    # attention with dropout is captured as the fused kernel, not the CPU math fallback
    assert g.count_by("kind")["attention"] == 1
    assert g.meta["fused_attention_dropout"] == 1
    unfused = capture(
        _LM(), (), example_kwargs={"input_ids": _ids(), "labels": _ids()}, fused_attention=False
    )
    assert "attention" not in unfused.count_by("kind")
    # a dict alone is taken as the keyword inputs
    assert capture(_LM(), {"input_ids": _ids(), "labels": _ids()}).num_ops == g.num_ops


def test_an_output_without_a_loss_is_refused() -> None:
    with pytest.raises(CaptureError) as info:
        capture(_LM(), (), example_kwargs={"input_ids": _ids()})
    message = str(info.value)
    assert "(_Output) has loss None" in message and "pass labels" in message
    assert "\n" not in message
    with pytest.raises(CaptureError, match=r"output \(dict\) has no loss"):
        capture(_Logits(), (_ids(),))
    # a loss_fn supplies the loss
    g = capture(
        _LM(),
        (),
        example_kwargs={"input_ids": _ids()},
        loss_fn=lambda out: out.logits.logsumexp(-1).mean(),
    )
    assert g.meta["loss"] == "loss_fn"


def test_a_tensor_output_uses_its_mean_as_a_noted_stand_in() -> None:
    g = capture(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
    assert g.meta["loss"] == "mean"
    assert any("not a loss" in n for n in g.meta["notes"])
    scalar = capture(_Stack(), (torch.randn(4, 8),))
    assert scalar.meta["loss"] == "output" and "notes" not in scalar.meta


def test_dtype_and_autocast() -> None:
    kwargs = {"input_ids": _ids(), "labels": _ids()}
    fp32 = capture(_LM(), (), example_kwargs=kwargs)
    bf16 = capture(_LM(), (), example_kwargs=kwargs, dtype="bf16")
    assert bf16.meta["dtype"] == "bfloat16" and fp32.meta["dtype"] is None
    assert bf16.param_bytes() * 2 == fp32.param_bytes()
    weight = bf16.op("param:head.weight")
    assert weight.output_dtypes == ["bfloat16"] and weight.state_bytes == 2 * 50 * 16 * 2
    mixed = capture(_LM(), (), example_kwargs=kwargs, autocast="bf16")
    assert mixed.meta["autocast"] == "bfloat16"
    assert mixed.param_bytes() == fp32.param_bytes()  # fp32 master weights
    forward_mm = [o for o in mixed.ops if o.phase == "forward" and o.kind == "matmul"]
    assert forward_mm and all(o.output_dtypes[0] == "bfloat16" for o in forward_mm)
    with pytest.raises(CaptureError, match="unknown dtype 'int8'"):
        capture(_LM(), (), example_kwargs=kwargs, dtype="int8")


def test_a_compiled_module_is_captured_through_its_original() -> None:
    model = _Stack()
    g = capture(torch.compile(model), (torch.randn(4, 8),))
    assert g.meta["params"] == sum(p.numel() for p in model.parameters())
    assert "param:inp.weight" in g  # names of the original module, no _orig_mod prefix
    assert any("torch.compile" in n for n in g.meta["notes"])


MODEL_FILE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.emb(input_ids))
            if labels is None:
                return {"logits": logits}
            return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}

    def build():
        ids = torch.zeros(2, 8, dtype=torch.long)
        return LM(), (), {"input_ids": ids, "labels": ids}

    def no_labels():
        return LM(), (), {"input_ids": torch.zeros(2, 8, dtype=torch.long)}

    def bad_kwargs():
        return LM(), (), [1]
    """
)


def _graph_json(capsys, *argv: str) -> tuple[int, dict, str]:
    code = main(["graph", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_cli_caches_file_captures(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MESHPLACE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "lm.py").write_text(MODEL_FILE)
    spec = f"{tmp_path / 'lm.py'}:build"
    code, first, err = _graph_json(capsys, spec)
    assert code == 0 and first["cache"]["status"] == "stored"
    assert "from cache" not in err
    assert first["meta"]["loss"] == "output.loss"
    assert "elementwise_targets" in first
    code, second, err = _graph_json(capsys, spec)
    assert code == 0 and second["cache"]["status"] == "hit"
    assert "captured graph from cache" in err
    assert second["cache"]["path"] == first["cache"]["path"]
    same = ("ops", "edges", "params", "flops_total", "activation_bytes")
    assert {k: second[k] for k in same} == {k: first[k] for k in same}
    # other arguments, another key; --no-cache captures afresh
    code, bf16, _ = _graph_json(capsys, spec, "--dtype", "bf16")
    assert bf16["cache"]["status"] == "stored" and bf16["meta"]["dtype"] == "bfloat16"
    code, fresh, err = _graph_json(capsys, spec, "--no-cache")
    assert fresh["cache"]["status"] == "off" and "from cache" not in err
    # an edited file is captured again
    edited_file = MODEL_FILE.replace("nn.Embedding(50, 16)", "nn.Embedding(60, 16)")
    (tmp_path / "lm.py").write_text(edited_file)
    code, edited, _ = _graph_json(capsys, spec)
    assert edited["cache"]["status"] == "stored" and edited["params"] != first["params"]
    assert len(list((tmp_path / "cache" / "graphs").glob("*.json"))) == 3


def test_cli_refuses_a_model_without_loss_and_bad_flags(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MESHPLACE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "lm.py").write_text(MODEL_FILE)
    code, out, err = _graph_json(capsys, f"{tmp_path / 'lm.py'}:no_labels")
    assert code == 2
    assert "(dict) has no loss" in out["error"] and "pass labels" in out["error"]
    assert err.count("\n") == 1
    code, out, _ = _graph_json(capsys, f"{tmp_path / 'lm.py'}:bad_kwargs")
    assert code == 2 and "third item must be the dict of keyword inputs" in out["error"]
    (tmp_path / "g.json").write_text("{}")
    code, out, _ = _graph_json(capsys, str(tmp_path / "g.json"), "--autocast", "bf16")
    assert code == 2 and "--autocast applies to models captured here" in out["error"]
    assert not (tmp_path / "cache").exists()
