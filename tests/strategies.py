"""Hypothesis strategies shared by the tests: random op DAGs."""

from __future__ import annotations

from hypothesis import strategies as st

from meshplace.graph.ir import PHASES, Op, OpGraph

_finite = st.floats(min_value=0, max_value=1e15, allow_nan=False, allow_infinity=False)
_kinds = st.sampled_from(["matmul", "conv", "elementwise", "parameter", "input", "softmax"])


@st.composite
def random_dags(draw, max_ops: int = 40, with_keys: bool = True) -> OpGraph:
    """An OpGraph with random costs whose edges all go from a lower to a higher index."""
    n = draw(st.integers(min_value=1, max_value=max_ops))
    graph = OpGraph(draw(st.text(min_size=1, max_size=8)), meta={"seed": draw(st.integers())})
    keys = [None, None, "k0", "k1", "k2"] if with_keys else [None]
    for i in range(n):
        ndim = draw(st.integers(0, 3))
        shape = draw(st.lists(st.integers(0, 64), min_size=ndim, max_size=ndim))
        graph.add_op(
            Op(
                name=f"op{i}",
                kind=draw(_kinds),
                phase=draw(st.sampled_from(PHASES)),
                module=draw(st.sampled_from(["", "a", "a.b", "c.0"])),
                output_shapes=[shape],
                output_dtypes=[draw(st.sampled_from(["float32", "bfloat16", "int64"]))],
                flops=draw(_finite),
                bytes_read=draw(_finite),
                bytes_written=draw(_finite),
                param_bytes=draw(st.integers(0, 10**9)),
                measured_time=draw(
                    st.dictionaries(st.sampled_from(["cpu", "k80"]), _finite, max_size=2)
                ),
                colocation=draw(st.sampled_from(keys)),
            )
        )
    pairs = draw(
        st.lists(
            st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
            max_size=3 * n,
        )
    )
    for a, b in pairs:
        if a != b:
            lo, hi = min(a, b), max(a, b)
            graph.add_edge(lo, hi, draw(_finite))
    return graph
