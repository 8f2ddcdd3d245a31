"""A sharding plan runs on PyTorch DTensor (issue 14, correctness): 4 CPU ranks with gloo,
parameters and inputs placed as the plan says, the model's own forward and backward; loss
and gradients equal the unsharded step, and each rank's parameter bytes equal the plan's
prediction exactly — for an MLP and for the Llama-style decoder of ``examples/llama.py``
(embedding, RMSNorm, rotary, attention, tied loss)."""

from __future__ import annotations

import collections
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshplace.graph.capture import capture
from meshplace.hardware import load_cluster
from meshplace.mesh.layout import build_mesh
from meshplace.parallel.search import shard_graph
from meshplace.parallel.sharding import ShardingProblem
from meshplace.runtime.sharded import (
    HostAttention,
    apply_sharding_plan,
    device_mesh,
    distribute_inputs,
    host_attention_kernel,
    local_parameter_bytes,
    parallelize_module_plan,
    sharded_step,
)

LLAMA = Path(__file__).resolve().parents[1] / "examples" / "llama.py"


def build(which: str) -> tuple[torch.nn.Module, tuple, dict[str, Any]]:
    """The model, positional and keyword inputs; weights drawn from a fixed seed."""
    torch.manual_seed(0)
    if which == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        )
        return model, (torch.randn(32, 64),), {}
    module = sys.modules.get("llama_example")
    if module is None:  # registered before it runs: its dataclasses look themselves up
        spec = importlib.util.spec_from_file_location("llama_example", LLAMA)
        module = importlib.util.module_from_spec(spec)
        sys.modules["llama_example"] = module
        spec.loader.exec_module(module)
    model, args, kwargs = module.build_tiny()
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    return model, args, kwargs


def loss_of(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    out = model(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        return out.mean()
    return out["loss"] if isinstance(out, dict) else out.loss


def tight_plan(graph: Any, mesh_shape: tuple[int, ...] = (2, 2), slack: float = 1.02) -> Any:
    """The solver's plan on a mesh of H100s (2x2 unless told) under a memory limit just
    above the leanest plan's (``slack`` times it), so that weights and activations are
    split (no ZeRO)."""
    cluster = load_cluster("dgx-h100")
    mesh = build_mesh(cluster, mesh_shape)
    problem = ShardingProblem(graph, mesh, zero_stages=(0,))
    lean = problem.cost_tables().solve(None, minimise="memory").memory
    capacity = cluster.devices[int(mesh.devices.reshape(-1)[0])].spec.memory_bytes
    return shard_graph(
        graph,
        cluster,
        mesh_shape=mesh_shape,
        zero_stages=(0,),
        memory_fraction=slack * lean / capacity,
    ).best


def _rank(
    body: Any, rank: int, models: tuple[str, ...], plans: dict, store_path: str, out_dir: str
) -> None:
    """One forked rank: join the gloo group, run ``body(rank, models, plans, out_dir)``,
    leave the group and end the process without interpreter finalisation, where gloo's
    worker threads still holding finished work can abort it (pytorch/pytorch#179291).
    Forked, not spawned: a fresh interpreter importing torch was most of the test's time.
    One thread: the host's cores are shared by 4 ranks, and the OpenMP pool of the parent
    does not survive the fork."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    body(rank, models, plans, out_dir)
    leave_and_exit()


def leave_and_exit() -> None:
    """A test rank's end: the group's last barrier, then out of the process without
    interpreter finalisation, where gloo's threads still holding finished work can abort
    it (pytorch/pytorch#179291)."""
    import os

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def four_ranks(start_method: str, target: Any, args_of: Any) -> None:
    """Run ``target(*args_of(rank))`` in 4 processes started by ``start_method``; each
    must end cleanly (an exception in it exits non-zero)."""
    ctx = mp.get_context(start_method)
    procs = [ctx.Process(target=target, args=args_of(r)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def on_four_ranks(body: Any, models: tuple[str, ...], plans: dict, tmp_path: Path) -> None:
    """Run ``body(rank, models, plans, out_dir)`` on 4 forked gloo ranks; each must end
    cleanly (an exception in ``body`` exits non-zero)."""
    store = str(tmp_path / "store")
    four_ranks("fork", _rank, lambda r: (body, r, models, plans, store, str(tmp_path)))


MODELS = ("mlp", "llama")


def _worker(rank: int, models: tuple[str, ...], plans: dict, out_dir: str) -> None:
    for which in models:  # one set of processes for both models: start-up is the cost
        plan = plans[which]
        mesh = device_mesh(plan, "cpu")
        model, args, kwargs = build(which)
        apply_sharding_plan(model, plan, mesh)
        names = list(plan["inputs"])  # positional inputs first, then keywords, as captured
        placed = distribute_inputs(
            plan, dict(zip(names, [*args, *kwargs.values()], strict=True)), mesh
        )
        with sharded_step("cpu"):
            loss = loss_of(
                model,
                tuple(placed[n] for n in names[: len(args)]),
                {k: placed[k] for k in kwargs},
            )
            loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        result = {
            "loss": loss.full_tensor(),
            "grads": grads,
            "local": local_parameter_bytes(model),
        }
        torch.save(result, Path(out_dir) / f"{which}{rank}.pt")
    # the MLP plan's choices along axis x as parallelize_module styles, run by PyTorch's
    # tensor-parallel API on that axis of the mesh
    plan = plans["mlp"]
    mesh = device_mesh(plan, "cpu")
    model, args, _ = build("mlp")
    styles, _left = parallelize_module_plan(model, plan, "x")
    parallelize_module(model, mesh["x"], styles)
    with sharded_step("cpu"):
        loss = loss_of(model, args, {})
        loss.backward()
    full = {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for n, p in model.named_parameters()
    }
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    torch.save({"loss": loss, "grads": full}, Path(out_dir) / f"styles{rank}.pt")


def test_a_sharded_plan_runs_on_dtensor_and_matches_the_unsharded_step(tmp_path: Path) -> None:
    plans = {}
    for which in MODELS:
        model, args, kwargs = build(which)
        g = capture(model, args, example_kwargs=kwargs, training=True)
        # DTensor's own view rule mis-shapes a dimension split over two mesh axes that a
        # view then splits (pytorch/pytorch#177972): the 2x2 Llama plan does that to its
        # q/k/v projections, so the Llama runs on a 1-D mesh here (the 2x2 plan runs op by
        # op in tests/test_parallel_spmd.py, where the plan, not DTensor, picks the layouts)
        shape = (4,) if which == "llama" else (2, 2)
        plan = json.loads(json.dumps(tight_plan(g, shape).plan_file(which, "dgx-h100")))
        sharded = [n for n, p in plan["parameters"].items() if "Shard" in " ".join(p["placements"])]
        assert len(sharded) >= 2, (which, plan["parameters"])
        plans[which] = plan
    on_four_ranks(_worker, MODELS, plans, tmp_path)
    for which in MODELS:
        ref_model, ref_args, ref_kwargs = build(which)
        ref_loss = loss_of(ref_model, ref_args, ref_kwargs)
        ref_loss.backward()
        plan = plans[which]
        for rank in range(4):
            got = torch.load(tmp_path / f"{which}{rank}.pt")
            assert torch.allclose(got["loss"], ref_loss, rtol=1e-5, atol=1e-6), which
            for name, p in ref_model.named_parameters():
                assert torch.allclose(got["grads"][name], p.grad, rtol=1e-5, atol=1e-5), name
                # predicted bytes of this rank's block equal the DTensor's local shard exactly
                assert got["local"][name] == plan["parameters"][name]["local_bytes"], name
    # the parallelize_module export: each Linear's style follows its weight's split on x,
    # and PyTorch's tensor parallelism with those styles computes the same step
    model, args, _ = build("mlp")
    styles, left = parallelize_module_plan(model, plans["mlp"], "x")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            on_x = plans["mlp"]["parameters"][f"{name}.weight"]["placements"][0]
            expected = {"Shard(0)": ColwiseParallel, "Shard(1)": RowwiseParallel}.get(on_x)
            if name in styles:
                assert type(styles[name]) is expected, name
            else:  # replicated along x, or its bias split in a way no style expresses
                assert expected is None or f"{name}.weight" in left, name
    assert styles, plans["mlp"]["parameters"]  # the plan splits some Linear along x
    assert all(plans["mlp"]["parameters"][n]["placements"][0] != "Replicate()" for n in left)
    ref_model, ref_args, _ = build("mlp")
    ref_loss = loss_of(ref_model, ref_args, {})
    ref_loss.backward()
    for rank in range(4):
        got = torch.load(tmp_path / f"styles{rank}.pt")
        assert torch.allclose(got["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        for name, p in ref_model.named_parameters():
            assert torch.allclose(got["grads"][name], p.grad, rtol=1e-5, atol=1e-5), name


# the attention test's cases: placements of q, k, v on a 1-D mesh of 4; heads of the query
# and of key and value (fewer: grouped-query attention)
ATTENTION_CASES: dict[str, tuple[list[Any], int, int]] = {
    "alike": (["Shard(1)"] * 3, 4, 4),
    "unlike": (["Shard(1)", "Replicate()", "Replicate()"], 4, 4),
    # a key projected with its contracting dimension split: a partial sum
    "partial": (["Shard(1)", "Partial()", "Shard(1)"], 8, 4),
    "batch, query whole": (["Replicate()", "Shard(0)", "Shard(0)"], 4, 4),
    "plain": ([None] * 3, 4, 4),  # tensors the model makes itself
    "grouped": (["Shard(1)"] * 3, 8, 4),  # 2 query heads and their key/value head each
    "grouped, batch": (["Shard(0)"] * 3, 4, 2),
}


def attention_inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of the attention test (batch 4, 8 tokens, head dim 16) laid out (batch,
    sequence, heads, dim), as a model's projections make them (it views them as (batch,
    heads, ...)); and the weight the output is multiplied by."""
    torch.manual_seed(0)
    q = torch.randn(4, 8, heads, 16)
    k, v = (torch.randn(4, 8, kv_heads, 16) for _ in range(2))
    return q, k, v, torch.randn(4, 8, heads * 16)


def _attention_rank(rank: int, store_path: str, out_dir: str) -> None:
    """One forked rank of the attention test: each of ``ATTENTION_CASES``, forward and
    backward, two steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (4,))
    # the placements of the (batch, heads, ...) views on the (batch, sequence, heads, ...)
    # tensors they view
    named = {"Shard(0)": Shard(0), "Shard(1)": Shard(2), "Replicate()": Replicate()}
    result = {}
    for case, (placements, heads, kv_heads) in ATTENTION_CASES.items():
        *qkv, weight = attention_inputs(heads, kv_heads)
        inputs = [
            (
                t.clone()
                if p is None
                # each rank a quarter: the sum over ranks is the tensor
                else DTensor.from_local(t / 4, mesh, [Partial()])
                if p == "Partial()"
                else distribute_tensor(t, mesh, [named[p]])
            ).requires_grad_()
            for t, p in zip(qkv, placements, strict=True)
        ]
        attention = HostAttention()
        for _step in range(2):  # the first step decides, the second runs as decided
            for t in inputs:
                t.grad = None
            with torch.profiler.profile() as prof, sharded_step("cpu", attention):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in inputs),
                    is_causal=True,
                    enable_gqa=kv_heads != heads,
                )
                # the view that fails on a block laid out unlike its DTensor
                (out.transpose(1, 2).reshape(4, 8, heads * 16) * weight).sum().backward()
        kernels = {e.key for e in prof.key_averages()}
        whole = [
            x.full_tensor() if hasattr(x, "full_tensor") else x
            for x in (out, *(t.grad for t in inputs))
        ]
        result[case] = {
            "kernel": attention.kernel,
            "flash": "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels,
            "out": whole[0],
            "grads": whole[1:],
        }
    # 2 key/value heads over 4 devices: no equal blocks of them, so no flash kernel (and
    # DTensor cannot flatten the math kernel's views of them either: such a plan fails)
    *qkv, _weight = attention_inputs(8, 2)
    uneven = [distribute_tensor(t, mesh, [Shard(2)]).transpose(1, 2) for t in qkv]
    result["grouped, uneven"] = host_attention_kernel(uneven, {"enable_gqa": True})
    if rank == 0:
        torch.save(result, Path(out_dir) / "attention.pt")
    leave_and_exit()


def test_host_attention_runs_flash_on_blocks_split_alike_and_math_otherwise(
    tmp_path: Path,
) -> None:
    """``sharded_step`` on the host: query, key and value split alike over heads or batch
    run the CPU flash kernel under meshplace's sharding rule (DTensor has none for it),
    grouped-query attention included where the key/value heads split evenly; a key and
    value placed unlike a query so split (whole, or a partial sum) are moved to the
    query's placements and run it too; a query placed otherwise runs the math kernel (the
    flash kernel would lay a re-gathered query's output out unlike its DTensor), as
    key/value heads split unevenly would (the flash kernel would pair query heads with
    others' key/value heads); plain tensors keep PyTorch's choice (flash).
    All equal one process's attention, forward and backward, and the model's ``view``
    after it works."""
    store = str(tmp_path / "store")
    four_ranks("fork", _attention_rank, lambda r: (r, store, str(tmp_path)))
    got = torch.load(tmp_path / "attention.pt")
    # the first step decided the kernel of the later ones (the profiled second step)
    kernels = {case: got[case]["kernel"] for case in ATTENTION_CASES}
    assert kernels == {
        "alike": "flash",
        "unlike": "align",
        "partial": "align",
        "batch, query whole": "align",
        "plain": "flash",
        "grouped": "flash",
        "grouped, batch": "flash",
    }
    assert got["grouped, uneven"] == "math"
    for case, (_placements, heads, kv_heads) in ATTENTION_CASES.items():
        assert got[case]["flash"] == (kernels[case] in ("flash", "align")), case
        *qkv, weight = attention_inputs(heads, kv_heads)
        qkv = [t.requires_grad_() for t in qkv]
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in qkv), is_causal=True, enable_gqa=kv_heads != heads
        )
        (out.transpose(1, 2).reshape(4, 8, heads * 16) * weight).sum().backward()
        assert torch.allclose(got[case]["out"], out, rtol=1e-5, atol=1e-6), case
        for mine, theirs in zip(got[case]["grads"], (t.grad for t in qkv), strict=True):
            assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-5), case


# Megatron-LM's layout of the Llama example over the tensor axis (Shoeybi et al. 2019,
# Sec. 3): the layers that read a block's input split by output rows (column-parallel),
# the layers that write back into the residual stream by input columns (row-parallel),
# embedding and head split over the vocabulary
COLUMN_PARALLEL = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("attn.o_proj", "mlp.down_proj")


def megatron_plan(model: torch.nn.Module, inputs: tuple[str, ...]) -> dict[str, Any]:
    """The Megatron layout of the Llama example on a data x tensor mesh of 2 x 2, batch
    split over data, as a plan file: what a user who writes the plan torchtitan's
    ``parallelize_module`` styles express would give ``meshplace run``."""

    def on_tensor(name: str) -> str:
        owner = name.removesuffix(".weight")
        if owner in ("embed", "lm_head") or owner.endswith(COLUMN_PARALLEL):
            return "Shard(0)"
        return "Shard(1)" if owner.endswith(ROW_PARALLEL) else "Replicate()"

    return {
        "format": "meshplace.parallel_plan",
        "version": 1,
        "mesh": {"shape": [2, 2], "axes": ["data", "tensor"]},
        "parameters": {
            name: {"placements": ["Replicate()", on_tensor(name)], "zero": 0}
            for name, _ in model.named_parameters()
        },
        "inputs": {name: {"placements": ["Shard(0)", "Replicate()"]} for name in inputs},
    }


def megatron_case(tied: bool) -> tuple[torch.nn.Module, tuple, dict[str, Any]]:
    """The Llama example (untied, or its embedding tied to its head) with token ids and
    labels drawn over the whole vocabulary, so every rank's rows of a vocabulary-split
    table are read (the example's own inputs are all token 0)."""
    import dataclasses

    model, args, _kwargs = build("llama")
    if tied:
        torch.manual_seed(0)
        cfg = dataclasses.replace(model.cfg, tie_embeddings=True)
        model = type(model)(cfg)
        for p in model.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
    generator = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab
    ids, labels = (torch.randint(0, vocab, args[0].shape, generator=generator) for _ in "il")
    return model, (ids,), {"labels": labels}


def _megatron_worker(rank: int, models: tuple[str, ...], plans: dict, out_dir: str) -> None:
    """One rank's forward and backward of each Megatron plan, its collectives recorded."""
    from torch.distributed.tensor import DTensor

    from meshplace.runtime.dryrun import EngineProgram, mesh_axes, recorder

    mesh = device_mesh(plans[models[0]], "cpu")  # one mesh: every plan here is on 2 x 2
    for which in models:
        plan = plans[which]
        model, args, kwargs = megatron_case(which == "tied")
        apply_sharding_plan(model, plan, mesh)
        names = list(plan["inputs"])
        placed = distribute_inputs(
            plan, dict(zip(names, [*args, *kwargs.values()], strict=True)), mesh
        )
        program = EngineProgram(4)
        with recorder(program, mesh_axes(mesh)), sharded_step("cpu"):
            loss = loss_of(model, (placed["input_ids"],), {"labels": placed["labels"]})
            loss.backward()
        params = dict(model.named_parameters())
        torch.save(
            {
                "loss": loss.full_tensor(),
                "grads": {n: p.grad.full_tensor() for n, p in params.items()},
                # a gradient on the tensor axis as its weight is there: nothing to reduce
                "tensor_axis": {
                    n: (str(p.placements[1]), str(p.grad.placements[1]))
                    for n, p in params.items()
                    if isinstance(p.grad, DTensor)
                },
                "collectives": [(c.kind, tuple(c.axes)) for c in program.collectives],
            },
            Path(out_dir) / f"{which}{rank}.pt",
        )


def test_a_megatron_layout_runs_megatrons_collectives_and_matches_one_process(
    tmp_path: Path,
) -> None:
    """The Llama example under Megatron's tensor parallelism (column-parallel query, key,
    value, gate and up projections; row-parallel output and down projections; embedding
    and head split over the vocabulary) and data parallelism on 2 x 2 forked ranks, its
    token ids drawn over the whole vocabulary, untied and with the embedding tied to the
    head: the loss and every gradient equal one process's, and the tensor axis runs
    exactly Megatron's collectives — per block one all-reduce after each row-parallel
    layer in forward and one before each group of column-parallel layers in backward,
    plus the embedding's sum and the head's (its input's gradient, its logits gathered
    for the loss) — with every weight's gradient coming out as its block, the
    vocabulary-split embedding's included (``vocabulary_parallel_lookup``). Before the
    boundaries of ``tensor_parallel_boundaries`` the backward failed inside DTensor (a
    partial gradient into the vocabulary-split embedding), and after fixing only that,
    DTensor's own choices ran 68 collectives on a tensor axis of 2 where Megatron runs
    11."""
    cases = ("untied", "tied")
    plans = {}
    for which in cases:
        model, _args, kwargs = megatron_case(which == "tied")
        plans[which] = megatron_plan(model, ("input_ids", *kwargs))
    on_four_ranks(_megatron_worker, cases, plans, tmp_path)
    for which in cases:
        model, args, kwargs = megatron_case(which == "tied")
        ref_loss = loss_of(model, args, kwargs)
        ref_loss.backward()
        layers = len(model.layers)
        for rank in range(4):
            got = torch.load(tmp_path / f"{which}{rank}.pt")
            assert torch.allclose(got["loss"], ref_loss, rtol=1e-5, atol=1e-6), which
            for name, p in model.named_parameters():
                assert torch.allclose(got["grads"][name], p.grad, rtol=1e-5, atol=1e-5), name
            # the embedding's too: looked up as Megatron's vocabulary-parallel embedding
            # does, not by DTensor's rule, whose backward computes the whole table's gradient
            left = {n: wg for n, wg in got["tensor_axis"].items() if wg[0] != wg[1]}
            assert not left, (which, left)
            assert len(got["tensor_axis"]) == len(list(model.parameters()))
            on_tensor = collections.Counter(
                k for k, axes in got["collectives"] if axes == ("tensor",)
            )
            assert on_tensor == {"all_reduce": 4 * layers + 2, "all_gather": 1}, (which, on_tensor)
            assert not any(k == "reduce_scatter" for k, _ in got["collectives"]), which
