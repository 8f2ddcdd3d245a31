"""Export a layout to JAX (``Mesh`` + ``PartitionSpec``) and PyTorch DTensor, and prove it.

Sources: GSPMD (Xu et al. 2021) / JAX ``jax.sharding``: an array is laid out over a device
mesh by a ``PartitionSpec`` naming, per array dimension, the mesh axis that splits it (or
``None``); PyTorch DTensor: per *mesh* dimension a placement, ``Shard(tensor_dim)`` or
``Replicate()``. A Mesh-TensorFlow layout (``rules``: dimension name -> mesh axis) gives
both directly, tensor by tensor, because every tensor of a :class:`Program` has named
dimensions.

:func:`verify_block` is the proof the tests run: a Transformer block (attention and MLP,
the program of :func:`meshplace.mesh.program.transformer_block`) is compiled by XLA's SPMD
partitioner under the layout on 8 virtual CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before JAX is imported; run it
in a fresh process), its results are compared with the unsharded run, and the collectives
in the compiled HLO are compared, kind by kind and mesh axis by mesh axis, with the ones
:mod:`meshplace.mesh.cost` charges. What XLA does differently, and what is therefore
compared: it **combines** the gradient reductions of a step into one tuple collective (its
all-reduce / reduce-scatter combiner passes), so gradients are compared by the number of
tensors reduced (the operands), which is what our per-layer bucket holds; and its CPU
pipeline may split an all-reduce into ``-start``/``-done`` halves, counted once.

JAX is optional: only :func:`jax_sharding` and :func:`verify_block` import it (lazily);
the plain-data exports work without it. Complexity: O(tensors x dims).

Example
-------
>>> from meshplace.mesh.program import transformer_block
>>> prog = transformer_block({"batch": 8, "seq": 16, "d_model": 32, "d_ff": 64,
...                           "heads": 8, "d_kv": 8})
>>> specs = partition_specs(prog, {"batch": "x", "heads": "y", "d_ff": "y"})
>>> specs["x"], specs["q_w"], specs["fc2_w"]
(('x', None, None), (None, 'y', None), ('y', None))
>>> dtensor_placements(prog, ("x", "y"), {"batch": "x", "d_ff": "y"})["placements"]["fc1_w"]
['Replicate()', 'Shard(1)']
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshplace.mesh.program import Program

HLO_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COST_KIND = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "collective_permute": "collective-permute",
}
BLOCK_DIMS = {"batch": 8, "seq": 16, "d_model": 32, "d_ff": 64, "heads": 8, "d_kv": 8}
BLOCK_RULES = {"batch": "x", "heads": "y", "d_ff": "y"}


def partition_specs(
    program: Program, rules: Mapping[str, str | None], tensors: Sequence[str] | None = None
) -> dict[str, tuple[str | None, ...]]:
    """Tensor name -> PartitionSpec as a tuple (mesh axis or None per dimension), for the
    program's inputs and parameters (or the given ``tensors``)."""
    names = (
        tensors
        if tensors is not None
        else [t.name for t in program.tensors.values() if t.kind in ("input", "param")]
    )
    return {n: tuple(rules.get(d) for d in program.tensors[n].names) for n in names}


def dtensor_placements(
    program: Program,
    axis_names: Sequence[str],
    rules: Mapping[str, str | None],
    mesh_shape: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A PyTorch DTensor description as plain data: the device mesh and, per input and
    parameter, one placement per mesh dimension (``"Shard(i)"`` or ``"Replicate()"``).
    Build real placements with ``torch.distributed.tensor.Shard(i)`` / ``Replicate()``."""
    out: dict[str, list[str]] = {}
    for name, spec in partition_specs(program, rules).items():
        place = []
        for axis in axis_names:
            dims = [i for i, a in enumerate(spec) if a == axis]
            place.append(f"Shard({dims[0]})" if dims else "Replicate()")
        out[name] = place
    return {
        "device_mesh": {
            "mesh_dim_names": list(axis_names),
            "shape": list(mesh_shape) if mesh_shape is not None else None,
        },
        "placements": out,
    }


def jax_sharding(
    program: Program,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    rules: Mapping[str, str | None],
    devices: Sequence[Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """``(jax.sharding.Mesh, {tensor: PartitionSpec})`` for the program's inputs and
    parameters. Needs JAX and ``prod(mesh_shape)`` JAX devices."""
    import jax
    from jax.sharding import Mesh as JaxMesh
    from jax.sharding import PartitionSpec

    n = int(np.prod(mesh_shape))
    devs = list(devices) if devices is not None else jax.devices()[:n]
    if len(devs) < n:
        raise RuntimeError(f"a {tuple(mesh_shape)} mesh needs {n} JAX devices, found {len(devs)}")
    mesh = JaxMesh(np.array(devs[:n]).reshape(tuple(mesh_shape)), tuple(axis_names))
    specs = {k: PartitionSpec(*v) for k, v in partition_specs(program, rules).items()}
    return mesh, specs


# ---------------------------------------------------------------------- HLO collectives
_HLO_RE = re.compile(r"=\s+(\(.*?\)|\S+)\s+(" + "|".join(HLO_KINDS) + r")(-start)?\((.*)$")


def hlo_collectives(
    hlo_text: str, mesh_devices: np.ndarray, axis_names: Sequence[str]
) -> list[dict[str, Any]]:
    """Collectives in compiled HLO text: kind, the mesh axes its replica groups span, and
    the number of tensors it moves (operands of a combined tuple collective).

    >>> text = ("%ar = (f32[2]{0}, f32[4]{0}) all-reduce(%a, %b), channel_id=1, "
    ...         "replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add")
    >>> hlo_collectives(text, np.arange(8).reshape(2, 4), ("x", "y"))
    [{'kind': 'all-reduce', 'axes': ('y',), 'operands': 2}]
    """
    out = []
    for line in hlo_text.splitlines():
        m = _HLO_RE.search(line)
        if not m or "-done" in line.split("=")[1][:60]:
            continue
        shape, kind, rest = m.group(1), m.group(2), m.group(4)
        operands = len(re.findall(r"[a-z]+\d*\[", shape)) if shape.startswith("(") else 1
        groups = _replica_groups(rest)
        out.append(
            {
                "kind": kind,
                "axes": _group_axes(groups, mesh_devices, axis_names),
                "operands": operands,
            }
        )
    return out


def _replica_groups(text: str) -> list[list[int]] | None:
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", text)
    if m:
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        arr = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            arr = arr.transpose([int(x) for x in m.group(4).split(",")])
        return arr.reshape(g, s).tolist()
    m = re.search(r"source_target_pairs=\{([^}]*(?:\},\{[^}]*)*)\}", text)
    if m:
        return [
            [int(x) for x in pair.split(",")] for pair in re.findall(r"\{?(\d+,\d+)\}?", m.group(1))
        ]
    return None


def _group_axes(
    groups: list[list[int]] | None, mesh_devices: np.ndarray, axis_names: Sequence[str]
) -> tuple[str, ...]:
    """Mesh axes along which the devices of the first group differ."""
    if not groups:
        return tuple(axis_names)
    pos = {
        int(d): np.unravel_index(i, mesh_devices.shape)
        for i, d in enumerate(mesh_devices.reshape(-1))
    }
    coords = np.array([pos[d] for d in groups[0]])
    return tuple(a for k, a in enumerate(axis_names) if len(set(coords[:, k])) > 1)


def charged_collectives(cost: Any, phases: Sequence[str] = ("forward", "backward")) -> list[dict]:
    """Our cost model's collectives in :func:`hlo_collectives`' form (one entry per call;
    a gradient bucket counts its tensors as operands)."""
    out = []
    for c in cost.collectives:
        if c.phase not in phases:
            continue
        for _ in range(c.count):
            out.append(
                {"kind": _COST_KIND[c.kind], "axes": tuple(c.axes), "operands": len(c.tensors) or 1}
            )
    return out


def summarize(colls: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """``{"all-reduce@y": {"count": 2, "operands": 2}, ...}`` for comparing two lists."""
    out: dict[str, dict[str, int]] = {}
    for c in colls:
        key = f"{c['kind']}@{','.join(c['axes'])}"
        e = out.setdefault(key, {"count": 0, "operands": 0})
        e["count"] += 1
        e["operands"] += c["operands"]
    return dict(sorted(out.items()))


def verify_block(
    dims: Mapping[str, int] | None = None,
    rules: Mapping[str, str | None] | None = None,
    mesh_shape: Sequence[int] = (2, 4),
    *,
    weight_update_sharding: bool = False,
) -> dict[str, Any]:
    """Run a Transformer block under a layout with JAX and compare with our cost model.

    Returns plain data: ``max_abs_error`` of the sharded forward output and gradients
    against the unsharded run, and the collectives (forward program and gradient program
    separately) found in the compiled HLO and charged by :mod:`meshplace.mesh.cost`,
    summarised per kind and mesh axes. Needs JAX with ``prod(mesh_shape)`` devices (set
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing JAX).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshplace.hardware.topology import torus
    from meshplace.mesh.cost import evaluate
    from meshplace.mesh.layout import build_mesh
    from meshplace.mesh.program import transformer_block

    dims = dict(dims or BLOCK_DIMS)
    rules = dict(rules if rules is not None else BLOCK_RULES)
    axis_names = ("x", "y", "z")[: len(mesh_shape)]
    prog = transformer_block(dims)
    cluster = torus(tuple(mesh_shape), device_kind="tpu-v3")
    cost = evaluate(
        prog,
        build_mesh(cluster, tuple(mesh_shape), axis_names),
        rules,
        weight_update_sharding=weight_update_sharding,
    )
    jmesh, specs = jax_sharding(prog, mesh_shape, axis_names, rules)
    param_names = ["q_w", "k_w", "v_w", "o_w", "fc1_w", "fc2_w"]
    rng = np.random.default_rng(0)
    values = {
        n: jnp.asarray(
            rng.standard_normal([s for _, s in prog.tensors[n].dims]) * 0.1, dtype=jnp.float32
        )
        for n in ["x", *param_names]
    }

    def norm(v):
        return v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6)

    def block(x, wq, wk, wv, wo, w1, w2):
        xn = norm(x)
        q = jnp.einsum("bsd,dhk->bshk", xn, wq)
        k = jnp.einsum("btd,dhk->bthk", xn, wk)
        v = jnp.einsum("btd,dhk->bthk", xn, wv)
        p = jax.nn.softmax(jnp.einsum("bshk,bthk->bhst", q, k), axis=-1)
        x = x + jnp.einsum("bshk,hkd->bsd", jnp.einsum("bhst,bthk->bshk", p, v), wo)
        h = jax.nn.relu(jnp.einsum("bsd,df->bsf", norm(x), w1))
        return x + jnp.einsum("bsf,fd->bsd", h, w2)

    def loss(params, x):
        return jnp.sum(block(x, *params) ** 2) * 0.5

    def sharding(spec):
        return NamedSharding(jmesh, P(*spec))

    in_sh = [sharding(specs[n]) for n in ["x", *param_names]]
    x_sh = in_sh[0]
    out_sh = sharding(tuple(rules.get(d) for d in prog.tensors["x"].names))
    fwd = jax.jit(block, in_shardings=in_sh, out_shardings=out_sh)
    grad_specs = []
    for n in param_names:
        spec = list(specs[n])
        if weight_update_sharding:  # gradients stay sharded over the data axes
            for axis in _grad_axes(cost, n):
                for k, (a, (_, size)) in enumerate(zip(spec, prog.tensors[n].dims)):
                    if a is None and size % dict(zip(axis_names, mesh_shape))[axis] == 0:
                        spec[k] = axis
                        break
        grad_specs.append(sharding(tuple(spec)))
    grad = jax.jit(jax.grad(loss), in_shardings=(in_sh[1:], x_sh), out_shardings=grad_specs)
    args = [values[n] for n in ["x", *param_names]]
    params = args[1:]
    out = fwd(*args)
    ref = block(*args)
    grads = grad(params, args[0])
    ref_grads = jax.grad(loss)(params, args[0])
    err = float(np.max(np.abs(np.asarray(out) - np.asarray(ref))))
    gerr = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(grads, ref_grads)
    )
    devices = np.array([d.id for d in jmesh.devices.reshape(-1)]).reshape(tuple(mesh_shape))
    fwd_hlo = fwd.lower(*args).compile().as_text()
    grad_hlo = grad.lower(params, args[0]).compile().as_text()
    fwd_only = evaluate(prog, build_mesh(cluster, tuple(mesh_shape), axis_names), rules)
    return {
        "devices": jax.device_count(),
        "max_abs_error": err,
        "max_abs_grad_error": gerr,
        "forward": {
            "hlo": summarize(hlo_collectives(fwd_hlo, devices, axis_names)),
            "charged": summarize(charged_collectives(fwd_only, ("forward",))),
        },
        "gradient": {
            "hlo": summarize(hlo_collectives(grad_hlo, devices, axis_names)),
            "charged": summarize(
                [c for c in charged_collectives(cost) if c["kind"] != "all-gather"]
            ),
        },
    }


def _grad_axes(cost: Any, param: str) -> tuple[str, ...]:
    for c in cost.collectives:
        if param in c.tensors and c.kind in ("all_reduce", "reduce_scatter"):
            return tuple(c.axes)
    return ()
