"""Index notation for ops: which tensor dimensions an op lets a mesh split, and how.

Every captured op gets an *index notation* in the spirit of an einsum (and of nnScaler's
dimension annotations, Lin et al., OSDI 2024, Sec. 3): one label per dimension of each
tensor operand and each output. A label shared by operands and an output is an
*iteration* dimension — split it over a mesh axis and every tensor carrying it is split
there, each device computing its block. A label of the operands that an output sums over
is a *contracted* dimension — split it and that output is a partial sum (a later
all-reduce or reduce-scatter completes it). Labels that must stay whole (a softmax's
normalised dimension) are listed as such; convolutions' spatial labels carry a halo.

Text form (stored in graph files as the op's ``einsum`` field)::

    INPUTS "->" OUTPUTS [";" "whole" LABEL ...] [";" "halo" LABEL "=" K ...]

    INPUTS, OUTPUTS: tensors separated by ","; a tensor is its labels separated by spaces,
    "()" for a 0-dimensional tensor (an op without operands has nothing before "->");
    "_" marks a dimension that is never split (size 1, a broadcast, or one no rule
    explains). An output may end with "|" and the labels it sums.

``mm`` is ``"m k,k n->m n|k"``; a softmax over the last dimension ``"a b c->a b c; whole
c"``; a 3x3 convolution ``"n i h w,o i _ _,o->n o h w|i; halo h=1 w=1"``.

Views are folded into edges at capture (``meshplace.graph.capture``), so an operand is
described by the op that produced the underlying tensor, which of its outputs it is, and
a *dimension map*: for each dimension of the operand as the consumer sees it, the
producer's output dimension whose block split is the same split, or -1 (:func:`view_map`).
``[B*S, D]`` viewed as ``[B, S, D]`` maps to ``[0, -1, 1]``: splitting the first producer
dimension in ``n`` blocks splits ``B`` in ``n`` blocks when ``n`` divides ``B``.

Rules cover matrix products, convolutions and their gradients, pooling, normalisations,
softmax, embeddings, fused attention and its gradient, losses, reductions, concatenation
and every op PyTorch tags ``pointwise``; :func:`op_einsum` returns ``None`` for the rest
(the sharding solver keeps such ops replicated and lists them).

Example
-------
>>> d = OpDims.parse("m k,k n->m n|k")
>>> d.inputs, d.outputs, d.sums
([['m', 'k'], ['k', 'n']], [['m', 'n']], [['k']])
>>> str(d)
'm k,k n->m n|k'
>>> view_map([32, 768], [4, 8, 768])
[0, -1, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshplace.errors import InputError

#: the label of a dimension that is never split
FIXED = "_"


class NotationError(InputError):
    """An index notation that does not parse or does not match the op's tensors."""


@dataclass
class OpDims:
    """Parsed index notation of one op (see the module docstring)."""

    inputs: list[list[str]]
    outputs: list[list[str]]
    sums: list[list[str]]
    whole: list[str] = field(default_factory=list)
    halo: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> OpDims:
        """Parse the text form; :class:`NotationError` names what is wrong."""
        if not isinstance(text, str) or "->" not in text:
            raise NotationError(f"index notation {text!r} has no '->'")
        head, *extras = text.split(";")
        lhs, _, rhs = head.partition("->")
        inputs = [_labels(t) for t in lhs.split(",")] if lhs.strip() else []
        outputs: list[list[str]] = []
        sums: list[list[str]] = []
        for part in rhs.split(","):
            labels, _, summed = part.partition("|")
            outputs.append(_labels(labels))
            sums.append(summed.split())
        whole: list[str] = []
        halo: dict[str, int] = {}
        for extra in extras:
            words = extra.split()
            if not words:
                continue
            if words[0] == "whole":
                whole.extend(words[1:])
            elif words[0] == "halo":
                for w in words[1:]:
                    name, _, k = w.partition("=")
                    if not k.isdigit():
                        raise NotationError(f"index notation {text!r}: bad halo {w!r}")
                    halo[name] = int(k)
            else:
                raise NotationError(
                    f"index notation {text!r}: unknown section {words[0]!r} (allowed: whole, halo)"
                )
        seen = {lab for t in (*inputs, *outputs) for lab in t}
        for lab in [*whole, *halo, *(s for ss in sums for s in ss)]:
            if lab not in seen:
                raise NotationError(f"index notation {text!r}: label {lab!r} is on no tensor")
        return cls(inputs, outputs, sums, whole, halo)

    def __str__(self) -> str:
        ins = ",".join(" ".join(t) or "()" for t in self.inputs)
        outs = ",".join(
            (" ".join(t) or "()") + ("|" + " ".join(s) if s else "")
            for t, s in zip(self.outputs, self.sums, strict=True)
        )
        text = f"{ins}->{outs}"
        if self.whole:
            text += "; whole " + " ".join(self.whole)
        if self.halo:
            text += "; halo " + " ".join(f"{k}={v}" for k, v in self.halo.items())
        return text

    def labels(self) -> list[str]:
        """Every label except ``_``, in first-seen order."""
        out: dict[str, None] = {}
        for t in (*self.inputs, *self.outputs):
            for lab in t:
                if lab != FIXED:
                    out[lab] = None
        return list(out)

    def splittable(self) -> list[str]:
        """Labels a mesh axis may split (not ``_``, not whole)."""
        whole = set(self.whole)
        return [lab for lab in self.labels() if lab not in whole]

    def check_shapes(
        self, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]
    ) -> None:
        """:class:`NotationError` unless ranks match the tensors and every label names
        dimensions of one size (halo labels: input and output sizes may differ)."""
        if len(in_shapes) != len(self.inputs) or len(out_shapes) != len(self.outputs):
            raise NotationError(
                f"index notation '{self}' has {len(self.inputs)} operands and "
                f"{len(self.outputs)} outputs, but the op has {len(in_shapes)} and "
                f"{len(out_shapes)}"
            )
        for labels, shape in zip([*self.inputs, *self.outputs], [*in_shapes, *out_shapes]):
            if len(labels) != len(shape):
                raise NotationError(
                    f"index notation '{self}' labels a {len(shape)}-dimensional tensor "
                    f"with {len(labels)} labels"
                )


def _labels(text: str) -> list[str]:
    text = text.strip()
    return [] if text == "()" else text.split()


def label_sizes(
    dims: OpDims, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]
) -> dict[str, list[int]]:
    """Every size each label takes on the op's tensors (several for halo labels)."""
    sizes: dict[str, list[int]] = {}
    for labels, shape in zip([*dims.inputs, *dims.outputs], [*in_shapes, *out_shapes]):
        for lab, n in zip(labels, shape, strict=True):
            if lab != FIXED and n not in sizes.setdefault(lab, []):
                sizes[lab].append(int(n))
    return sizes


# ------------------------------------------------------------------ views
def view_map(src: Sequence[int], dst: Sequence[int]) -> list[int]:
    """Dimension map of a reshape from ``src`` to ``dst`` (see the module docstring).

    Dimensions are matched in groups of equal products; in each group the leading
    non-unit dimensions correspond (a block split of one is a block split of the other
    when the split divides both), the others map to -1. O(rank).

    >>> view_map([4, 8, 16], [32, 16])
    [0, 2]
    >>> view_map([6], [2, 3])
    [0, -1]
    """
    out = [-1] * len(dst)
    i = j = 0
    while True:
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) or j >= len(dst):
            return out
        i0, j0, ps, pd = i, j, src[i], dst[j]
        while ps != pd:
            if ps < pd:
                i += 1
                if i >= len(src):
                    return out
                ps *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return out
                pd *= dst[j]
        out[j0] = i0
        i += 1
        j += 1


def alias_map(
    name: str, args: Sequence[Any], in_shape: Sequence[int], out_shapes: list[list[int]]
) -> list[list[int]]:
    """Dimension maps (one per output of the alias op) from its input to each output.

    ``name`` is the aten op's packet name (``view``, ``permute``, ``split``…), ``args`` its
    arguments after the input tensor; unknown aliases map every dimension to -1.
    """
    rank = len(in_shape)
    unknown = [[-1] * len(s) for s in out_shapes]
    if name in ("split", "split_with_sizes", "chunk"):
        dim = _dim(args[1] if len(args) > 1 else 0, rank)
        return [
            [d if (d != dim or s[d] == in_shape[d]) else -1 for d in range(rank)]
            for s in out_shapes
        ]
    if name == "unbind":
        dim = _dim(args[0] if args else 0, rank)
        return [[d for d in range(rank) if d != dim] for _ in out_shapes]
    if len(out_shapes) != 1:
        return unknown
    out = out_shapes[0]
    if name in ("view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "lift_fresh"):
        return [view_map(in_shape, out)]
    if name in ("detach", "alias", "_conj", "_neg_view", "lift_fresh_copy"):
        return [list(range(rank))] if len(out) == rank else unknown
    if name in ("t", "numpy_T"):
        return [list(reversed(range(rank)))]
    if name == "transpose":
        a, b = _dim(args[0], rank), _dim(args[1], rank)
        m = list(range(rank))
        m[a], m[b] = m[b], m[a]
        return [m]
    if name == "permute":
        return [[_dim(d, rank) for d in args[0]]]
    if name in ("expand", "expand_as"):
        lead = len(out) - rank
        return [
            [
                -1 if k < lead or (in_shape[k - lead] == 1 and out[k] != 1) else k - lead
                for k in range(len(out))
            ]
        ]
    if name == "unsqueeze":
        d = _dim(args[0], rank + 1)
        return [[*range(d), -1, *range(d, rank)]]
    if name == "squeeze":
        if args:
            given = args[0] if isinstance(args[0], list | tuple) else [args[0]]
            removed = {_dim(d, rank) for d in given if in_shape[_dim(d, rank)] == 1}
        else:
            removed = {d for d in range(rank) if in_shape[d] == 1}
        kept = [d for d in range(rank) if d not in removed]
        return [kept] if len(kept) == len(out) else unknown
    if name == "select":
        d = _dim(args[0], rank)
        return [[k for k in range(rank) if k != d]]
    if name in ("slice", "narrow"):
        d = _dim(args[0] if args else 0, rank)
        return [[k if (k != d or out[k] == in_shape[k]) else -1 for k in range(rank)]]
    return unknown


def compose(outer: Sequence[int], inner: Sequence[int] | None) -> list[int]:
    """The map of a view of a view: ``inner`` maps the middle tensor to the producer,
    ``outer`` the consumer's operand to the middle tensor."""
    if inner is None:
        return [-1] * len(outer)
    return [inner[d] if 0 <= d < len(inner) else -1 for d in outer]


def _dim(d: Any, rank: int) -> int:
    d = int(d)
    return d + rank if d < 0 else d


# ------------------------------------------------------------------ rules
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _fresh(n: int, taken: str = "") -> list[str]:
    return [c for c in _LETTERS if c not in taken][:n]


def _broadcast(shape: Sequence[int], out_labels: Sequence[str], out: Sequence[int]) -> list[str]:
    """Labels of an operand broadcast against an output labelled ``out_labels``."""
    lead = len(out) - len(shape)
    if lead < 0:
        return [FIXED] * len(shape)
    return [out_labels[lead + k] if shape[k] == out[lead + k] else FIXED for k in range(len(shape))]


Shape = list[int]
Rule = Callable[[list[Any], list[Shape | None], list[Shape | None]], OpDims | None]


def _pointwise(args_shapes: list[Shape | None], outs: list[Shape | None]) -> OpDims | None:
    real = [s for s in outs if s is not None]
    if not real or any(s != real[0] for s in real):
        return None
    out = real[0]
    labels = _fresh(len(out))
    labels = [lab if n != 1 else FIXED for lab, n in zip(labels, out, strict=True)]
    ins = []
    for s in args_shapes:
        if s is None:
            continue
        if len(s) > len(out) or any(
            a not in (1, b) for a, b in zip(reversed(s), reversed(out), strict=False)
        ):
            return None  # not a broadcast of the output: no pointwise rule
        ins.append(_broadcast(s, labels, out))
    return OpDims(ins, [list(labels) for _ in real], [[] for _ in real])


def _matmul(a: Shape, b: Shape, bias: Shape | None, out: Shape) -> OpDims | None:
    if len(a) == 2 and len(b) == 2:
        m, k, n = "m", "k", "n"
        ins = [[m, k], [k, n]]
        outl = [m, n]
    elif len(a) == 3 and len(b) == 3:
        ins = [["b", "m", "k"], ["b", "k", "n"]]
        outl = ["b", "m", "n"]
    else:
        return None
    if bias is not None:
        ins = [_broadcast(bias, outl, out), *ins]
    return OpDims(ins, [outl], [["k"]])


def _conv_labels(x: Shape, w: Shape, out: Shape, args: list[Any]) -> tuple[list[str], ...] | None:
    """Spatial labels of a convolution: shared by input and output (with a halo of half
    the kernel) where input size = stride x output size, else fixed."""
    spatial = len(x) - 2
    if spatial < 1 or len(w) != len(x) or len(out) != len(x):
        return None
    names = ["h", "w", "d"][:spatial] if spatial <= 3 else None
    if names is None:
        return None
    stride = _seq(args[3] if len(args) > 3 else 1, spatial)
    dilation = _seq(args[5] if len(args) > 5 else 1, spatial)
    sx, so = [], []
    halo = {}
    for k in range(spatial):
        if x[2 + k] == stride[k] * out[2 + k]:
            sx.append(names[k])
            so.append(names[k])
            kk = (w[2 + k] - 1) * dilation[k]
            if kk > 0:
                halo[names[k]] = (kk + 1) // 2
        else:
            sx.append(FIXED)
            so.append(FIXED)
    return sx, so, halo  # type: ignore[return-value]


def _seq(v: Any, n: int) -> list[int]:
    if isinstance(v, list | tuple):
        vals = [int(x) for x in v]
        return vals if len(vals) == n else (vals * n)[:n]
    return [int(v)] * n


def _rule_conv(args: list[Any], ins: list[Shape | None], outs: list[Shape | None]) -> OpDims | None:
    x, w, bias = ins[0], ins[1], ins[2] if len(ins) > 2 else None
    out = outs[0]
    if x is None or w is None or out is None:
        return None
    transposed = bool(args[6]) if len(args) > 6 else False
    groups = int(args[8]) if len(args) > 8 else 1
    sp = _conv_labels(x, w, out, args)
    if sp is None or transposed:
        return None
    sx, so, halo = sp
    if groups == 1:
        xi, wl, ol, sums = ["n", "i", *sx], ["o", "i"], ["n", "o", *so], [["i"]]
    elif groups == x[1] == out[1]:  # depthwise: channels are an iteration dimension
        xi, wl, ol, sums = ["n", "c", *sx], ["c", FIXED], ["n", "c", *so], [[]]
    else:
        xi, wl, ol, sums = ["n", FIXED, *sx], [FIXED, FIXED], ["n", FIXED, *so], [[]]
    wl = wl + [FIXED] * (len(w) - 2)
    operands = [xi, wl]
    if bias is not None:
        operands.append([ol[1]])
    return OpDims(operands, [ol], sums, [], halo)


def _rule_conv_backward(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    go, x, w = ins[0], ins[1], ins[2]
    if go is None or x is None or w is None:
        return None
    transposed = bool(args[7]) if len(args) > 7 else False
    groups = int(args[9]) if len(args) > 9 else 1
    sp = _conv_labels(x, w, go, [None, None, None, args[4], None, args[6]] if len(args) > 6 else [])
    if sp is None or transposed or groups != 1:
        return None
    sx, so, halo = sp
    spatial = [s for s in so if s != FIXED]
    gi = (["n", "i", *sx], ["o"])
    gw = (["o", "i", *[FIXED] * (len(w) - 2)], ["n", *spatial])
    gb = (["o"], ["n", *spatial])
    mask = args[10] if len(args) > 10 else [True, True, True]
    chosen = [r for r, m in zip((gi, gw, gb), mask, strict=False) if m]
    if len(chosen) != len([o for o in outs if o is not None]):
        return None
    return OpDims(
        [["n", "o", *so], ["n", "i", *sx], ["o", "i", *[FIXED] * (len(w) - 2)]],
        [list(c[0]) for c in chosen],
        [list(c[1]) for c in chosen],
        [],
        halo,
    )


def _channels_only(ins: list[Shape | None], outs: list[Shape | None]) -> OpDims | None:
    """Pooling and its gradient: batch and channels split, spatial dimensions whole."""
    tensors = [s for s in (*ins, *outs) if s is not None]
    if any(len(s) < 3 or s[:2] != tensors[0][:2] for s in tensors):
        return None

    def lab(s: Shape) -> list[str]:
        return ["n", "c", *[FIXED] * (len(s) - 2)]

    real_outs = [s for s in outs if s is not None]
    return OpDims(
        [lab(s) for s in ins if s is not None], [lab(s) for s in real_outs], [[] for _ in real_outs]
    )


def _rule_reduce(linear: bool) -> Rule:
    def rule(args: list[Any], ins: list[Shape | None], outs: list[Shape | None]) -> OpDims | None:
        x, out = ins[0], outs[0]
        if x is None or out is None:
            return None
        rank = len(x)
        dims_arg = args[1] if len(args) > 1 else None
        if (
            not isinstance(dims_arg, list | tuple | int)
            or isinstance(dims_arg, bool)
            or dims_arg == []
        ):
            reduced = set(range(rank))
        else:
            seq = dims_arg if isinstance(dims_arg, list | tuple) else [dims_arg]
            reduced = {_dim(d, rank) for d in seq}
        keep = bool(args[2]) if len(args) > 2 and isinstance(args[2], bool) else False
        labels = _fresh(rank)
        labels = [lab if n != 1 else FIXED for lab, n in zip(labels, x, strict=True)]
        outl = [
            labels[d] if d not in reduced else FIXED
            for d in range(rank)
            if keep or d not in reduced
        ]
        if len(outl) != len(out):
            return None
        red = [labels[d] for d in sorted(reduced) if labels[d] != FIXED]
        if linear:
            return OpDims([labels], [outl], [red])
        return OpDims(
            [labels],
            [outl for _ in outs if _ is not None],
            [[] for _ in outs if _ is not None],
            red,
        )

    return rule


def _rule_softmax(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    shapes = [s for s in ins if s is not None]
    out = outs[0]
    if out is None or any(s != out for s in shapes):
        return None
    rank = len(out)
    dim_arg = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), -1)
    d = _dim(dim_arg, rank)
    labels = [lab if n != 1 else FIXED for lab, n in zip(_fresh(rank), out, strict=True)]
    whole = [labels[d]] if labels[d] != FIXED else []
    return OpDims([list(labels) for _ in shapes], [labels], [[]], whole)


def _rule_layer_norm(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    x = ins[0]
    if x is None:
        return None
    k = len(args[1]) if len(args) > 1 and isinstance(args[1], list | tuple) else 1
    rank = len(x)
    labels = [lab if n != 1 else FIXED for lab, n in zip(_fresh(rank), x, strict=True)]
    lead, norm = labels[: rank - k], labels[rank - k :]
    operands = [labels] + [list(norm) for s in ins[1:] if s is not None]
    stat = [*lead, *[FIXED] * k]
    outl = [labels, stat, stat][: len([o for o in outs if o is not None])]
    return OpDims(
        operands, [list(o) for o in outl], [[] for _ in outl], [n for n in norm if n != FIXED]
    )


def _rule_layer_norm_backward(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)
    x = ins[0]
    if x is None:
        return None
    k = len(args[2]) if len(args) > 2 and isinstance(args[2], list | tuple) else 1
    rank = len(x)
    labels = [lab if n != 1 else FIXED for lab, n in zip(_fresh(rank), x, strict=True)]
    lead, norm = labels[: rank - k], labels[rank - k :]
    stat = [*lead, *[FIXED] * k]
    per_arg = {0: labels, 1: labels, 3: stat, 4: stat, 5: norm, 6: norm}
    operands = [list(per_arg[i]) for i, s in enumerate(ins) if s is not None and i in per_arg]
    if len(operands) != len([s for s in ins if s is not None]):
        return None
    mask = args[7] if len(args) > 7 else [True, True, True]
    cand = [
        (labels, []),
        (norm, [x for x in lead if x != FIXED]),
        (norm, [x for x in lead if x != FIXED]),
    ]
    chosen = [c for c, m in zip(cand, mask, strict=False) if m]
    if len(chosen) != len([o for o in outs if o is not None]):
        return None
    return OpDims(
        operands,
        [list(c[0]) for c in chosen],
        [list(c[1]) for c in chosen],
        [n for n in norm if n != FIXED],
    )


def _rule_batch_norm(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    # (input, weight, bias, running_mean, running_var, training, momentum, eps)
    x = ins[0]
    if x is None or len(x) < 2:
        return None
    xl = ["n", "c", *[s if n != 1 else FIXED for s, n in zip(["h", "w", "d"], x[2:], strict=False)]]
    if len(xl) != len(x):
        return None
    stats = [lab for lab in xl if lab not in ("c", FIXED)]
    operands = [xl] + [["c"] for s in ins[1:] if s is not None]
    real = [o for o in outs if o is not None]
    outl = [xl] + [["c"] if (o and len(o) == 1) else [FIXED] * len(o) for o in real[1:]]
    sums = [[]] + [stats if len(o) == 1 else [] for o in outl[1:]]
    return OpDims(operands, [list(o) for o in outl], sums)


def _rule_batch_norm_backward(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    # (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask)
    x = ins[1] if len(ins) > 1 else None
    if x is None or len(x) < 2:
        return None
    xl = ["n", "c", *[s if n != 1 else FIXED for s, n in zip(["h", "w", "d"], x[2:], strict=False)]]
    stats = [lab for lab in xl if lab not in ("c", FIXED)]
    operands = [xl, xl] + [
        ["c"] if len(s) == 1 else [FIXED] * len(s) for s in ins[2:] if s is not None
    ]
    mask = args[9] if len(args) > 9 else [True, True, True]
    cand = [(xl, []), (["c"], stats), (["c"], stats)]
    chosen = [c for c, m in zip(cand, mask, strict=False) if m]
    if len(chosen) != len([o for o in outs if o is not None]):
        return None
    return OpDims(operands, [list(c[0]) for c in chosen], [list(c[1]) for c in chosen])


def _rule_embedding(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    w, idx, out = ins[0], ins[1], outs[0]
    if w is None or idx is None or out is None or len(w) != 2:
        return None
    il = [lab if n != 1 else FIXED for lab, n in zip(_fresh(len(idx), "vd"), idx, strict=True)]
    return OpDims([["v", "d"], il], [[*il, "d"]], [["v"]])


def _rule_embedding_backward(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    g, idx, out = ins[0], ins[1], outs[0]
    if g is None or idx is None or out is None or len(out) != 2:
        return None
    il = [lab if n != 1 else FIXED for lab, n in zip(_fresh(len(idx), "vd"), idx, strict=True)]
    return OpDims([[*il, "d"], il], [["v", "d"]], [[x for x in il if x != FIXED]])


def _rule_attention(backward: bool, causal_arg: int) -> Rule:
    """Fused attention (and its gradient). Query length ``s`` may be split — unless the
    attention is causal (``args[causal_arg]``): a block of queries then needs its offset
    into the causal mask, which the kernel does not take, so ``s`` stays whole."""

    def rule(args: list[Any], ins: list[Shape | None], outs: list[Shape | None]) -> OpDims | None:
        shapes = [s for s in ins if s is not None]
        off = 1 if backward else 0  # the backward takes grad_out first
        if len(shapes) < 3 + off:
            return None
        q, k, v = shapes[off], shapes[off + 1], shapes[off + 2]
        if len(q) != 4 or len(k) != 4 or len(v) != 4:
            return None
        h = "h" if q[1] == k[1] == v[1] else FIXED
        ql, kl, vl = ["b", h, "s", "e"], ["b", h, "t", "e"], ["b", h, "t", "f"]
        ol = ["b", h, "s", "f"]
        whole = ["t", "e", "f"]
        if len(args) > causal_arg and args[causal_arg] is True:
            whole.append("s")
        operands: list[list[str]] = []
        rest = shapes[off + 3 :]
        if backward:
            operands.append(ol)
        operands += [ql, kl, vl]
        for s in rest:  # out and logsumexp (backward), an attention mask
            if s == [q[0], q[1], q[2], v[3]]:
                operands.append(list(ol))
            elif len(s) == 3 and s == q[:3]:
                operands.append(["b", h, "s"])
            elif len(s) == 4:
                operands.append(_broadcast(s, ["b", h, "s", "t"], [q[0], q[1], q[2], k[2]]))
            else:
                operands.append([FIXED] * len(s))
        real = [o for o in outs if o is not None]
        if backward:
            want = [(ql, []), (kl, ["s"]), (vl, ["s"])]
            if len(real) < 3:
                return None
            outl = [list(w[0]) for w in want] + [[FIXED] * len(o) for o in real[3:]]
            sums = [list(w[1]) for w in want] + [[] for _ in real[3:]]
        else:
            outl, sums = [], []
            for i, o in enumerate(real):
                if i == 0:
                    outl.append(ol)
                elif i == 1 and len(o) == 3:
                    outl.append(["b", h, "s"])
                else:
                    outl.append([FIXED] * len(o))
                sums.append([])
        return OpDims(operands, outl, sums, [w for w in whole if w])

    return rule


def _rule_nll(backward: bool) -> Rule:
    def rule(args: list[Any], ins: list[Shape | None], outs: list[Shape | None]) -> OpDims | None:
        shapes = [s for s in ins if s is not None]
        off = 1 if backward else 0
        if len(shapes) < 2 + off:
            return None
        x, target = shapes[off], shapes[off + 1]
        if len(x) < 1 or len(target) != max(len(x) - 1, 0):
            return None
        xl = ["n", "c", *_fresh(len(x) - 2, "nc")] if len(x) >= 2 else ["c"]
        tl = [lab for i, lab in enumerate(xl) if i != (1 if len(x) >= 2 else 0)]
        reduction = args[3 + off] if len(args) > 3 + off else 1
        operands: list[list[str]] = []
        if backward:
            operands.append(tl if reduction == 0 else [FIXED] * len(shapes[0]))
        operands += [xl, tl]
        for s in shapes[2 + off :]:  # class weights, total_weight
            operands.append(
                ["c"] if len(s) == 1 and s[0] == x[1 if len(x) >= 2 else 0] else [FIXED] * len(s)
            )
        real = [o for o in outs if o is not None]
        if backward:
            return OpDims(operands, [xl], [[]])
        loss = tl if reduction == 0 else []
        sums = [["c"] if reduction == 0 else [lab for lab in xl]]
        outl = [loss] + [[] for _ in real[1:]]
        sums += [[lab for lab in tl] for _ in real[1:]]
        return OpDims(operands, outl, sums)

    return rule


def _rule_cat(args: list[Any], ins: list[Shape | None], outs: list[Shape | None]) -> OpDims | None:
    out = outs[0]
    shapes = [s for s in ins if s is not None]
    if out is None or not shapes or any(len(s) != len(out) for s in shapes):
        return None
    d = _dim(args[1] if len(args) > 1 else 0, len(out))
    labels = [lab if n != 1 else FIXED for lab, n in zip(_fresh(len(out)), out, strict=True)]
    labels[d] = FIXED
    return OpDims([list(labels) for _ in shapes], [labels], [[]])


def _rule_slice_backward(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    """``slice_backward(grad, input_sizes, dim, start, end, step)``: the gradient written
    into zeros of the input's shape — every dimension but the sliced one, which stays
    whole, passes through."""
    grad, out = ins[0] if ins else None, outs[0]
    if grad is None or out is None or len(grad) != len(out):
        return None
    labels = [lab if n != 1 else FIXED for lab, n in zip(_fresh(len(out)), out, strict=True)]
    labels[_dim(args[2] if len(args) > 2 else 0, len(out))] = FIXED
    return OpDims([list(labels)], [labels], [[]])


def _rule_factory(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    """Factory ops (``zeros``, ``arange``, ``new_zeros``…): each device makes its block of
    the output; a tensor operand (``new_*``) gives only dtype and device."""
    real = [o for o in outs if o is not None]
    if len(real) != 1:
        return None
    labels = [
        lab if n != 1 else FIXED for lab, n in zip(_fresh(len(real[0])), real[0], strict=True)
    ]
    return OpDims([[FIXED] * len(s) for s in ins if s is not None], [labels], [[]])


def _rule_copy_like(
    args: list[Any], ins: list[Shape | None], outs: list[Shape | None]
) -> OpDims | None:
    return _pointwise(ins, outs)


_RULES: dict[str, Rule] = {
    "convolution": _rule_conv,
    "convolution_backward": _rule_conv_backward,
    "sum": _rule_reduce(True),
    "mean": _rule_reduce(True),
    "amax": _rule_reduce(False),
    "amin": _rule_reduce(False),
    "_softmax": _rule_softmax,
    "_log_softmax": _rule_softmax,
    "_softmax_backward_data": _rule_softmax,
    "_log_softmax_backward_data": _rule_softmax,
    "native_layer_norm": _rule_layer_norm,
    "native_layer_norm_backward": _rule_layer_norm_backward,
    "native_batch_norm": _rule_batch_norm,
    "_native_batch_norm_legit": _rule_batch_norm,
    "_native_batch_norm_legit_functional": _rule_batch_norm,
    "_native_batch_norm_legit_no_training": _rule_batch_norm,
    "native_batch_norm_backward": _rule_batch_norm_backward,
    "embedding": _rule_embedding,
    "embedding_dense_backward": _rule_embedding_backward,
    "_scaled_dot_product_flash_attention_for_cpu": _rule_attention(False, 4),
    "_scaled_dot_product_flash_attention": _rule_attention(False, 4),
    "_scaled_dot_product_efficient_attention": _rule_attention(False, 6),
    "_scaled_dot_product_cudnn_attention": _rule_attention(False, 6),
    "_scaled_dot_product_flash_attention_for_cpu_backward": _rule_attention(True, 7),
    "_scaled_dot_product_flash_attention_backward": _rule_attention(True, 11),
    "_scaled_dot_product_efficient_attention_backward": _rule_attention(True, 11),
    "nll_loss_forward": _rule_nll(False),
    "nll_loss2d_forward": _rule_nll(False),
    "nll_loss_backward": _rule_nll(True),
    "nll_loss2d_backward": _rule_nll(True),
    "cat": _rule_cat,
    "slice_backward": _rule_slice_backward,
    "_to_copy": _rule_copy_like,
    "copy": _rule_copy_like,
    "copy_": _rule_copy_like,
    "native_dropout": _rule_copy_like,
    "zeros_like": _rule_copy_like,
    "ones_like": _rule_copy_like,
    "full_like": _rule_copy_like,
    "empty_like": _rule_copy_like,
    "fill": _rule_copy_like,
    # random fills (dropout masks): each device draws its block
    "bernoulli": _rule_copy_like,
    "bernoulli_": _rule_copy_like,
    "uniform": _rule_copy_like,
    "uniform_": _rule_copy_like,
    "normal": _rule_copy_like,
    "normal_": _rule_copy_like,
    "rand_like": _rule_copy_like,
    "randn_like": _rule_copy_like,
    "new_zeros": _rule_factory,
    "new_ones": _rule_factory,
    "new_empty": _rule_factory,
    "new_full": _rule_factory,
    "zeros": _rule_factory,
    "ones": _rule_factory,
    "full": _rule_factory,
    "empty": _rule_factory,
    "arange": _rule_factory,
    "scalar_tensor": _rule_factory,
}
_POOLS = {
    "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward",
    "max_pool3d_with_indices",
    "max_pool3d_with_indices_backward",
    "avg_pool2d",
    "avg_pool2d_backward",
    "avg_pool3d",
    "avg_pool3d_backward",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool2d_backward",
    "_adaptive_avg_pool3d",
    "_adaptive_avg_pool3d_backward",
}


def op_einsum(
    name: str,
    args: list[Any],
    in_shapes: list[Shape | None],
    out_shapes: list[Shape | None],
    *,
    pointwise: bool = False,
) -> OpDims | None:
    """The index notation of aten op ``name`` (its packet name), or ``None`` if no rule
    covers it.

    ``args`` are the op's positional arguments with tensors replaced by their shapes,
    ``in_shapes`` the shape of each positional argument (``None`` where it is not a
    tensor; a list of tensors contributes its shapes in order, flattened), ``out_shapes``
    one per output (``None`` for an output that is not a tensor). ``pointwise`` says
    PyTorch tags the op pointwise. The notation's operands are the tensors of
    ``in_shapes`` in order. O(rank x operands).

    >>> str(op_einsum("mm", [], [[4, 8], [8, 16]], [[4, 16]]))
    'm k,k n->m n|k'
    >>> str(op_einsum("add", [], [[4, 8], [8]], [[4, 8]], pointwise=True))
    'a b,b->a b'
    """
    try:
        if name in ("mm", "bmm"):
            a, b = in_shapes[0], in_shapes[1]
            if a is None or b is None or out_shapes[0] is None:
                return None
            return _matmul(a, b, None, out_shapes[0])
        if name in ("addmm", "baddbmm"):
            bias, a, b = in_shapes[0], in_shapes[1], in_shapes[2]
            if a is None or b is None or bias is None or out_shapes[0] is None:
                return None
            return _matmul(a, b, bias, out_shapes[0])
        if name in _POOLS:
            return _channels_only(in_shapes, out_shapes)
        rule = _RULES.get(name)
        if rule is not None:
            return rule(args, in_shapes, out_shapes)
        if pointwise:
            return _pointwise(in_shapes, out_shapes)
    except (IndexError, TypeError, ValueError):
        return None
    return None


__all__ = [
    "FIXED",
    "NotationError",
    "OpDims",
    "alias_map",
    "compose",
    "label_sizes",
    "op_einsum",
    "view_map",
]
