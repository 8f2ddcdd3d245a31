"""Complete a partial placement the way frameworks co-locate ops.

Placers that reason about the forward pass (the human expert, pipeline stages) decide
where forward ops run and let everything else follow, as TensorFlow's
``colocate_gradients_with_ops`` and variable co-location did for the ColocRL baselines:

* a backward op runs with the forward op it differentiates (``Op.forward_op``);
* a parameter runs with its first forward consumer, and its optimizer-update ops (which
  share its ``param:NAME`` co-location key) with the parameter;
* an input runs with its first consumer;
* anything still unplaced joins the device of its first placed producer, else of its first
  placed consumer, else ``default``.

Complexity: O(V + E) per pass, at most a few passes.

Example
-------
>>> from meshplace.graph.ir import Op, OpGraph
>>> g = OpGraph("g")
>>> _ = g.add_op(Op("w", "parameter", colocation="param:w"))
>>> _ = g.add_op(Op("mm", "matmul"))
>>> _ = g.add_op(Op("mm_grad", "matmul", phase="backward", forward_op="mm"))
>>> _ = g.add_op(Op("upd", "elementwise", phase="update", colocation="param:w"))
>>> g.add_edge("w", "mm", 4); g.add_edge("mm", "mm_grad", 4); g.add_edge("mm_grad", "upd", 4)
>>> complete_placement(g, np.array([-1, 2, -1, -1])).tolist()
[2, 2, 2, 2]
"""

from __future__ import annotations

import numpy as np

from meshplace.graph.ir import OpGraph


def complete_placement(graph: OpGraph, partial: np.ndarray, default: int = 0) -> np.ndarray:
    """Fill every ``-1`` in ``partial`` (device index per op) by co-location rules."""
    dev = np.array(partial, dtype=np.int64, copy=True)
    ops = graph.ops
    a = graph.arrays()
    order = a.topo_order.tolist()
    succ_ptr, succ_idx = a.succ_ptr, a.succ_idx
    pred_ptr, pred_idx = a.pred_ptr, a.pred_idx

    # Parameters and inputs: with their first consumer that is placed (prefer forward).
    for i, o in enumerate(ops):
        if dev[i] >= 0 or o.kind not in ("parameter", "buffer", "input"):
            continue
        consumers = succ_idx[succ_ptr[i] : succ_ptr[i + 1]]
        placed = [c for c in consumers if dev[c] >= 0]
        forward = [c for c in placed if ops[c].phase == "forward"]
        pick = forward or placed
        if pick:
            dev[i] = dev[min(pick)]
    by_key: dict[str, int] = {}
    for i, o in enumerate(ops):
        if o.colocation and dev[i] >= 0 and o.colocation not in by_key:
            by_key[o.colocation] = int(dev[i])
    for _ in range(3):
        changed = False
        for i in order:
            if dev[i] >= 0:
                continue
            o = ops[i]
            if o.forward_op is not None and dev[graph.index(o.forward_op)] >= 0:
                dev[i] = dev[graph.index(o.forward_op)]
            elif o.colocation in by_key:
                dev[i] = by_key[o.colocation]  # type: ignore[index]
            else:
                preds = [p for p in pred_idx[pred_ptr[i] : pred_ptr[i + 1]] if dev[p] >= 0]
                if preds:
                    dev[i] = dev[max(preds, key=lambda p: graph.edge_bytes_at(p, i))]
                else:
                    continue
            if o.colocation and o.colocation not in by_key:
                by_key[o.colocation] = int(dev[i])
            changed = True
        if not changed:
            break
    for i in reversed(order):  # sources with no placed producer: follow a consumer
        if dev[i] < 0:
            succs = [s for s in succ_idx[succ_ptr[i] : succ_ptr[i + 1]] if dev[s] >= 0]
            if succs:
                dev[i] = dev[min(succs)]
    dev[dev < 0] = default
    return dev
