"""The model files in ``examples/``: they capture through the command line a user runs,
with exact parameter counts and training FLOPs near ``6 N T`` (N: the parameters that
multiply every token, ``examples/flops_check.py``).

The plain-PyTorch Llama runs everywhere; the Hugging Face and timm files are skipped when
``transformers`` / ``timm`` are not importable (they are not meshplace dependencies, and CI
does not install them). No timing assertions.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from meshplace.graph.capture import capture
from meshplace.runtime.program import ModelSpec, RuntimeInputError
from tests.forked_cli import run_meshplace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _example(name: str) -> ModuleType:
    """Import ``examples/NAME.py`` by path (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"meshplace_example_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _graph_json(spec: str) -> dict[str, Any]:
    """``meshplace graph SPEC --json --no-cache`` run from the repository root."""
    done = run_meshplace(["graph", spec, "--json", "--no-cache"], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _total_flops(graph: Any) -> float:
    return float(sum(op.flops for op in graph.ops))


# ------------------------------------------------------------------ plain PyTorch Llama
def test_llama_tiny_captures_through_the_command_line() -> None:
    llama = _example("llama")
    cfg = llama.CONFIGS["tiny"]
    model, _, _ = llama.build_tiny()
    summary = _graph_json("examples/llama.py:build_tiny")
    assert (
        summary["params"]
        == llama.parameter_count(cfg)
        == sum(p.numel() for p in model.parameters())
    )
    assert summary["meta"]["loss"] == "output"  # the model's own cross-entropy, no stand-in
    assert not summary["meta"].get("notes")
    assert summary["ops_by_kind"]["attention"] == cfg.n_layers  # fused, grouped-query SDPA
    ratio = summary["flops_total"] / llama.flops_estimate(cfg)["six_nt"]
    assert 1.0 <= ratio <= 1.15, ratio


def test_llama_tied_embeddings_count_once() -> None:
    llama = _example("llama")
    flops_check = _example("flops_check")
    cfg = llama.LlamaConfig(**{**vars(llama.CONFIGS["tiny"]), "tie_embeddings": True})
    model = llama.Llama(cfg)
    ids = torch.zeros(cfg.batch, cfg.seq, dtype=torch.int64)
    graph = capture(model, (ids,), example_kwargs={"labels": ids})
    untied = llama.parameter_count(llama.CONFIGS["tiny"])
    assert graph.meta["params"] == llama.parameter_count(cfg) == untied - cfg.vocab * cfg.d_model
    counts = flops_check.active_params(model)
    assert counts["matmul"] == counts["total"]  # the tied table is the output projection
    assert 1.0 <= _total_flops(graph) / llama.flops_estimate(cfg)["six_nt"] <= 1.15


def test_llama_7b_and_70b_configs_have_the_published_sizes_on_meta() -> None:
    llama = _example("llama")
    for build, size, expected in (
        (llama.build_7b, "llama2-7b", 6_738_415_616),
        (llama.build_70b, "llama2-70b", 68_976_648_192),
    ):
        model, (ids,), kwargs = build()
        assert all(p.is_meta for p in model.parameters())  # nothing allocated
        assert sum(p.numel() for p in model.parameters()) == expected
        assert llama.parameter_count(llama.CONFIGS[size]) == expected
        assert ids.shape == kwargs["labels"].shape == (1, 4096)


def test_the_runtime_takes_a_build_with_keyword_inputs(tmp_path: Path) -> None:
    _, inputs, name = ModelSpec(str(EXAMPLES / "llama.py") + ":build_tiny").build()
    assert name == "llama" and [tuple(t.shape) for t in inputs] == [(2, 32), (2, 32)]

    (tmp_path / "gap.py").write_text(
        "import torch\n\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x, mask=None, labels=None, *, scale=1.0):\n"
        "        return x\n\n"
        "def build():\n"
        "    return M(), (torch.zeros(2),), {'labels': torch.zeros(2)}\n\n"
        "def keyword_only():\n"
        "    return M(), (torch.zeros(2),), {'scale': 2.0}\n"
    )
    _, inputs, _ = ModelSpec(f"{tmp_path / 'gap.py'}:build").build()
    assert len(inputs) == 3 and inputs[1] is None  # skipped parameters take their None default
    with pytest.raises(RuntimeInputError, match=r"scale that M\.forward takes by keyword only"):
        ModelSpec(f"{tmp_path / 'gap.py'}:keyword_only").build()


# ------------------------------------------------------------------ Hugging Face
@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "t5"])
def test_hugging_face_tiny_models_capture_with_exact_params(name: str) -> None:
    pytest.importorskip("transformers")
    hf = _example("hf_models")
    flops_check = _example("flops_check")
    model, args, kwargs = getattr(hf, f"{name}_tiny")()
    graph = capture(model, args, example_kwargs=kwargs)
    counts = flops_check.active_params(model)
    assert graph.meta["params"] == counts["total"] == sum(p.numel() for p in model.parameters())
    assert graph.meta["loss"] == "output.loss"
    ratio = _total_flops(graph) / (6 * counts["active"] * kwargs["labels"].numel())
    assert 1.0 <= ratio <= 1.15, ratio
    if name == "mixtral":
        assert graph.meta["expert_params"]  # experts marked for expert parallelism
        assert counts["active"] < counts["matmul"]


def test_hugging_face_graph_command_gpt2_tiny() -> None:
    pytest.importorskip("transformers")
    hf = _example("hf_models")
    model, _, _ = hf.gpt2_tiny()
    summary = _graph_json("examples/hf_models.py:gpt2_tiny")
    assert summary["params"] == sum(p.numel() for p in model.parameters())
    assert summary["meta"]["loss"] == "output.loss"
    assert summary["meta"]["fused_attention_dropout"] == 2  # GPT-2's attention dropout, fused


# ------------------------------------------------------------------ timm
def test_timm_resnet50_and_vit_match_published_sizes() -> None:
    pytest.importorskip("timm")
    timm_models = _example("timm_models")
    # (params, forward multiply-adds per 224x224 image: timm's results tables)
    for build, params, gmacs in (
        (timm_models.build, 25_557_032, 4.11),
        (timm_models.vit, 86_567_656, 16.87),
    ):
        model, (images,) = build(batch=1)
        graph = capture(model, (images,), training=False)
        assert graph.meta["params"] == params == sum(p.numel() for p in model.parameters())
        forward = graph.total_flops("forward")
        assert abs(forward / (2 * gmacs * 1e9) - 1) < 0.05, forward


def test_timm_logits_get_a_noted_stand_in_or_a_real_loss() -> None:
    pytest.importorskip("timm")
    timm_models = _example("timm_models")
    model, inputs = timm_models.build(batch=2, image=64)
    graph = capture(model, inputs)
    assert graph.meta["loss"] == "mean" and "stand-in" in " ".join(graph.meta["notes"])
    model, inputs = timm_models.build_with_loss(batch=2, image=64)
    graph = capture(model, inputs)
    assert graph.meta["loss"] == "output" and not graph.meta.get("notes")
    assert graph.count_by("kind").get("loss") == 1
