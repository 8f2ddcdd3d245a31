"""Every reference workload captures as a full training step with credible FLOPs.

One test per workload and size, so pytest-xdist spreads the captures over both cores.
"""

from __future__ import annotations

import networkx as nx
import pytest

from meshplace import models
from meshplace.graph.groups import group_ops
from meshplace.graph.sources import workload_graph
from meshplace.graph.summary import summarize

# Each workload's first size, and the largest Mesh-TensorFlow transformer (where 6ND is
# checked at scale): the other sizes differ only in their config numbers, and capturing
# them all (nmt-4layer alone is 12,000 ops, GPT-6.7B 12 s) would cost the suite a minute
# and a half; `benchmarks/capture.py` (make bench) captures every size.
LARGEST = {("transformer", "mtf-5b")}
ALL = [(name, sizes[0]) for name, sizes in models.available().items()] + sorted(LARGEST)
SEQUENCE_MODELS = {"transformer", "gpt"}


@pytest.mark.parametrize(("name", "size"), ALL, ids=[f"{n}-{s}" for n, s in ALL])
def test_training_step_capture(name: str, size: str) -> None:
    # a real capture by this code: the cache is keyed by the capturing code's version,
    # and shares the capture with the placer tests that need the same graph
    graph = workload_graph(name, size=size)
    s = summarize(graph)
    assert set(s["ops_by_phase"]) == {"forward", "backward", "update"}
    # Backward costs about twice the forward pass (Kaplan et al. 2020, §2.1).
    ratio = s["flops_total"] / s["flops_forward"]
    assert 2.55 <= ratio <= 3.45, f"{name} {size}: total/forward = {ratio:.3f}"
    if name in SEQUENCE_MODELS:
        tokens = graph.meta["tokens"]
        six_nd = 6 * s["params"] * tokens
        assert s["flops_total"] == pytest.approx(six_nd, rel=0.10), (
            f"{name} {size}: {s['flops_total'] / six_nd:.3f} x 6ND"
        )
    # Nearly every backward matmul/conv knows the forward op it differentiates.
    heavy = [o for o in graph.ops if o.phase == "backward" and o.kind in ("matmul", "conv_grad")]
    linked = [o for o in heavy if o.forward_op is not None]
    assert len(linked) >= 0.9 * len(heavy)
    # Groups: at most 256, acyclic.
    grouping = group_ops(graph, 256)
    assert grouping.num_groups <= 256
    assert nx.is_directed_acyclic_graph(grouping.group_graph().to_networkx())


def test_inception_v3_matches_published_size() -> None:
    # torchvision's documented figures at 299x299: 27,161,264 parameters (with the
    # auxiliary classifier) and 5.71 G multiply-adds for inference.
    graph = workload_graph("inception_v3", batch=1, training=False)
    s = summarize(graph)
    assert s["params"] == pytest.approx(27_161_264, rel=0.03)
    assert s["flops_forward"] == pytest.approx(2 * 5.71e9, rel=0.03)


def test_gpt_124m_has_gpt2_small_parameter_count() -> None:
    w = models.get("gpt", size="124m")
    assert sum(p.numel() for p in w.model.parameters()) == pytest.approx(124.44e6, rel=0.01)


def test_rnns_are_unrolled_over_time() -> None:
    graph = workload_graph("rnnlm", training=False)
    seq = graph.meta["dims"]["seq"]
    for layer in ("lstm.0", "lstm.1"):
        cell_matmuls = [o for o in graph.ops if o.kind == "matmul" and o.module.startswith(layer)]
        assert len(cell_matmuls) >= seq, f"{layer}: {len(cell_matmuls)} matmuls for {seq} steps"


def _capture_once_more(folder: str, calls: str) -> None:
    """A process asking for dmcca's graph with the cache in ``folder``, each capture
    recorded in ``calls`` and held a while (so that two processes overlap)."""
    import os
    import time

    from meshplace.graph import sources

    os.environ["MESHPLACE_CACHE_DIR"] = folder
    capture = sources._capture_workload

    def recorded(*args, **kwargs):
        with open(calls, "a") as out:
            out.write("capture\n")
        time.sleep(0.5)
        return capture(*args, **kwargs)

    sources._capture_workload = recorded
    sources.workload_graph("dmcca")


def test_two_processes_asking_for_the_same_graph_capture_it_once(tmp_path) -> None:
    """The second process waits on the first's lock on the cache entry and loads the graph
    it stored, instead of capturing it too (two test workers, two shells)."""
    import multiprocessing

    calls = tmp_path / "calls"
    context = multiprocessing.get_context("fork")
    procs = [
        context.Process(target=_capture_once_more, args=(str(tmp_path / "cache"), str(calls)))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert calls.read_text() == "capture\n"
    assert len(list((tmp_path / "cache" / "graphs").glob("*.json"))) == 1
