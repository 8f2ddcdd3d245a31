"""Hypothesis strategies shared by the tests: random op DAGs."""

from __future__ import annotations

from hypothesis import strategies as st

from meshplace.graph.ir import PHASES, Op, OpGraph

# Every strategy random_dags draws from, built once: hypothesis cannot cache a strategy
# whose arguments hold a list or another new strategy, so one built inside the loop is
# built and validated again for every op of every example (three quarters of the time of
# test_groups' properties before).
_finite = st.floats(min_value=0, max_value=1e15, allow_nan=False, allow_infinity=False)
_kinds = st.sampled_from(["matmul", "conv", "elementwise", "parameter", "input", "softmax"])
_ndims = st.integers(0, 3)
_shapes = [st.lists(st.integers(0, 64), min_size=k, max_size=k) for k in range(4)]
_phases = st.sampled_from(PHASES)
_modules = st.sampled_from(["", "a", "a.b", "c.0"])
_dtypes = st.sampled_from(["float32", "bfloat16", "int64"])
_param_bytes = st.integers(0, 10**9)
_measured = st.dictionaries(st.sampled_from(["cpu", "k80"]), _finite, max_size=2)
_keys = st.sampled_from([None, None, "k0", "k1", "k2"])
_no_keys = st.sampled_from([None])


@st.composite
def random_dags(draw, max_ops: int = 40, with_keys: bool = True) -> OpGraph:
    """An OpGraph with random costs whose edges all go from a lower to a higher index."""
    n = draw(st.integers(min_value=1, max_value=max_ops))
    graph = OpGraph(draw(st.text(min_size=1, max_size=8)), meta={"seed": draw(st.integers())})
    keys = _keys if with_keys else _no_keys
    for i in range(n):
        shape = draw(_shapes[draw(_ndims)])
        graph.add_op(
            Op(
                name=f"op{i}",
                kind=draw(_kinds),
                phase=draw(_phases),
                module=draw(_modules),
                output_shapes=[shape],
                output_dtypes=[draw(_dtypes)],
                flops=draw(_finite),
                bytes_read=draw(_finite),
                bytes_written=draw(_finite),
                param_bytes=draw(_param_bytes),
                measured_time=draw(_measured),
                colocation=draw(keys),
            )
        )
    index = st.integers(0, n - 1)
    for a, b in draw(st.lists(st.tuples(index, index), max_size=3 * n)):
        if a != b:
            graph.add_edge(min(a, b), max(a, b), draw(_finite))
    return graph
