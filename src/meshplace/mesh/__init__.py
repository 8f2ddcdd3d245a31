"""Mesh layouts: named-dimension sharding, its SPMD lowering cost, layout search, JAX export.

Sources: Shazeer et al., "Mesh-TensorFlow: Deep Learning for Supercomputers" (NeurIPS 2018)
for meshes, layout rules and how einsums lower to local compute plus collectives; Kumar et
al., "Scale MLPerf-0.6 models on Google TPU-v3 Pods" (2019) for weight-update sharding,
spatial partitioning and the 2D-torus all-reduce. See ``docs/mesh.md``. Complexity: a
layout costs O(ops of one layer + layers); a search O(meshes x legal layouts) of those.

=================  =========================================================================
module             what it holds
=================  =========================================================================
``layout``         :class:`Mesh` over a cluster's devices (axes aligned with torus
                   dimensions), :func:`check_tensor` (Mesh-TensorFlow legality),
                   :class:`LayoutError`
``program``        :class:`Program`: a training step as named-dimension ops (Transformer,
                   GPT, ResNet-50, a detection net), with generated backward and update ops
``cost``           :func:`evaluate`: compute per op, the collectives a layout implies,
                   weight-update sharding, halo exchange, memory, exposed vs overlapped
``search``         :func:`search`: mesh shapes x layout rules, fastest layouts that fit
``jax_export``     JAX ``PartitionSpec`` / DTensor placements, and the JAX equivalence check
``cli``            ``meshplace shard`` (:func:`cmd_shard`)
=================  =========================================================================

Example
-------
>>> from meshplace.hardware import load_cluster
>>> prog = transformer_lm({"batch": 32, "seq": 64, "d_model": 256, "d_ff": 1024,
...                        "heads": 8, "d_kv": 32, "layers": 2, "vocab": 4096})
>>> best = search(prog, load_cluster("tpu-v3-8"), chips=4).best
>>> best.fits, best.step_time_s > 0
(True, True)
"""

from meshplace.mesh.cost import Collective, Evaluator, LayoutCost, evaluate
from meshplace.mesh.layout import LayoutError, Mesh, MeshAxis, build_mesh, check_tensor
from meshplace.mesh.program import (
    Program,
    ProgramBuilder,
    detection,
    program_for,
    resnet50,
    transformer_block,
    transformer_encdec,
    transformer_lm,
)
from meshplace.mesh.search import SearchResult, evaluate_layout, hand_layout, search

__all__ = [
    "Collective",
    "Evaluator",
    "LayoutCost",
    "LayoutError",
    "Mesh",
    "MeshAxis",
    "Program",
    "ProgramBuilder",
    "SearchResult",
    "build_mesh",
    "check_tensor",
    "detection",
    "evaluate",
    "evaluate_layout",
    "hand_layout",
    "program_for",
    "resnet50",
    "search",
    "transformer_block",
    "transformer_encdec",
    "transformer_lm",
]
