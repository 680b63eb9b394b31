"""How one recorded op carries a split tensor (Note [derived tensor-parallel plans]).

A tensor's state is None (whole on every rank) or a Split: under tensor parallelism rank r would hold
the r-th of tp contiguous blocks along `dim`, and nothing else. Each rule maps the states of an op's
inputs to those of its outputs, or raises Blocked when the op would need the whole of a split tensor
(a norm over the split features, a residual add, a loss, an op it does not know).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.tensor_parallel.derive.trace import Op, Ref


@dataclass(frozen=True)
class Split:
    dim: int
    sources: frozenset  # the column-parallel layers whose split this is
    fresh: bool = False  # their output through elementwise ops only: a later split into n fused parts may follow


class Blocked(Exception):
    def __init__(self, sources: frozenset, reason: str, kind: str = "op"):
        super().__init__(reason)
        self.sources, self.reason, self.kind = sources, reason, kind


UNARY = {"to", "type", "float", "half", "bfloat16", "double", "contiguous", "clone", "detach", "type_as",
         "requires_grad", "cpu", "cuda", "data", "positive"}
ELEMENTWISE = {
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv", "pow", "neg", "abs", "exp",
    "log", "log1p", "expm1", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "erf", "sign", "square",
    "relu", "relu6", "gelu", "silu", "mish", "softplus", "elu", "selu", "celu", "leaky_relu", "hardtanh",
    "hardswish", "hardsigmoid", "logsigmoid", "tanhshrink", "where", "masked_fill", "clamp", "clip", "maximum",
    "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "and", "or", "xor",
    "invert", "bitwise_and", "bitwise_or", "lerp", "addcmul", "addcdiv", "nan_to_num", "rsub", "mod", "fmod",
    "remainder", "dropout", "alpha_dropout", "feature_alpha_dropout", "zeros_like", "ones_like", "full_like",
    "empty_like", "copy"}  # not rand_like / randn_like: their noise would need a per-rank stream
DROPOUT = {"dropout", "alpha_dropout", "feature_alpha_dropout"}
REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod", "any", "all",
          "argmax", "argmin", "count_nonzero", "nansum", "nanmean", "median"}
ALONG = {"softmax", "log_softmax", "cumsum", "cumprod", "normalize"}  # act along one dim, keep the shape
RESHAPE = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze"}
EXPAND = {"expand", "expand_as", "broadcast_to"}
PERMUTES = {"transpose", "swapaxes", "swapdims", "t", "T", "mT", "permute", "movedim"}
SPLITS = {"split": 2, "chunk": 2, "tensor_split": 2, "split_with_sizes": 2, "unbind": 1}
KEEPS_FUSED_PARTS = ELEMENTWISE | UNARY | set(SPLITS)  # a fresh split through any other op is one part
# ops that move or select values without computing new ones: token ids stay token ids through them
MOVES_VALUES = UNARY | RESHAPE | EXPAND | PERMUTES | set(SPLITS) | {"getitem", "narrow", "select", "repeat", "cat"}
LOSSES = {"cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
          "binary_cross_entropy", "binary_cross_entropy_with_logits", "soft_margin_loss", "cosine_embedding_loss"}


def drops(op: Op) -> bool:
    """Whether a dropout op draws a mask: p > 0, in training (F.dropout's defaults: p 0.5, training True)."""
    p = arg(op, 1, "p", 0.5)
    training = op.args[2] if len(op.args) > 2 else op.kwargs.get("training", op.kwargs.get("train", True))
    return not isinstance(p, (int, float)) or (p > 0 and bool(training))


def tensor_args(op: Op) -> list[Ref]:
    def walk(value):
        if isinstance(value, Ref):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                yield from walk(v)
    return list(walk((op.args, op.kwargs)))


def arg(op: Op, position: int, name: str, default=None):
    if len(op.args) > position:
        return op.args[position]
    if name == "dim" and "axis" in op.kwargs:  # numpy's spelling, which torch accepts too
        return op.kwargs["axis"]
    return op.kwargs.get(name, default)


def sources_of(states) -> frozenset:
    return frozenset().union(*(s.sources for s in states if s is not None))


def _block(states, reason: str, kind: str = "op"):
    raise Blocked(sources_of(states), reason, kind)


def elementwise(op: Op, states: dict[int, Split | None]) -> list[Split]:
    """Broadcasting op: every split input on the same (right-aligned) dim; a whole input spans it only with size 1."""
    out = op.outputs[0].shape
    refs = tensor_args(op)
    split = [(r, states[r.id]) for r in refs if states.get(r.id) is not None]
    dims = {s.dim + len(out) - len(r.shape) for r, s in split}
    if len(dims) != 1:
        _block([s for _, s in split], f"{op.name} combines tensors split along different dims")
    dim = dims.pop()
    for r in refs:
        aligned = dim - (len(out) - len(r.shape))
        if states.get(r.id) is None and aligned >= 0 and r.shape[aligned] != 1:
            _block([s for _, s in split], f"{op.name} combines a split tensor with a whole one of shape "
                                          f"{list(r.shape)} (a residual connection, or a bias over the split features)")
    state = Split(dim, sources_of(s for _, s in split), all(s.fresh for _, s in split))
    return [state for _ in op.outputs]


def unary(op: Op, state: Split) -> list[Split]:
    return [state for _ in op.outputs]


def _dims(value, ndim: int) -> set[int] | None:
    if isinstance(value, int):
        return {value % ndim}
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return {v % ndim for v in value}
    return None


DIM_POSITION = {"normalize": 2, "norm": 2}  # (input, p, dim, ...); the others take dim second
KEEPDIM_POSITION = {"norm": 3, "var": 3, "std": 3}  # (input, dim, unbiased, keepdim) for var/std; else third


def reduce(op: Op, state: Split, keep_shape: bool) -> list[Split]:
    src = op.args[0]
    dims = _dims(arg(op, DIM_POSITION.get(op.name, 1), "dim", 1 if op.name == "normalize" else None), len(src.shape))
    if dims is None or state.dim in dims:
        _block([state], f"{op.name} reduces over the split dim", "loss" if op.name in ("log_softmax",) else "op")
    keep = keep_shape or bool(arg(op, KEEPDIM_POSITION.get(op.name, 2), "keepdim", False))
    dim = state.dim if keep else state.dim - sum(d < state.dim for d in dims)
    return [Split(dim, state.sources) for _ in op.outputs]


def norm(op: Op, state: Split) -> list[Split]:
    shape = arg(op, 1, "normalized_shape")
    count = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (list, tuple)) else None
    if count is None or state.dim >= len(op.args[0].shape) - count:
        _block([state], f"{op.name} normalizes over the split features")
    return [Split(state.dim, state.sources) for _ in op.outputs]


def reshaped_dim(src: tuple, out: tuple, dim: int, tp: int) -> int | None:
    """The dim of `out` that holds `dim`'s contiguous blocks after a reshape: the one whose trailing product
    equals that of `dim` (the same elements follow each block), of a size tp divides."""
    trailing = math.prod(src[dim:])
    for j in range(len(out)):
        rest = math.prod(out[j:])
        if rest == trailing and out[j] > 1:
            return j if out[j] % tp == 0 else None
        if rest < trailing:
            return None
    return None


def reshape(op: Op, state: Split, tp: int) -> list[Split]:
    src, out = op.args[0].shape, op.outputs[0].shape
    dim = reshaped_dim(src, out, state.dim, tp)
    if dim is None:
        _block([state], f"{op.name} from {list(src)} to {list(out)} mixes the split dim {state.dim} with others")
    return [Split(dim, state.sources)]


def expand(op: Op, state: Split) -> list[Split]:
    src, out = op.args[0].shape, op.outputs[0].shape
    if op.name == "repeat":
        sizes = op.args[1] if len(op.args) == 2 and isinstance(op.args[1], (list, tuple)) else op.args[1:]
        dim = state.dim + len(out) - len(src)
        if sizes[dim] != 1:
            _block([state], "repeat along the split dim")
        return [Split(dim, state.sources)]
    dim = state.dim + len(out) - len(src)
    if out[dim] != src[state.dim]:
        _block([state], f"{op.name} along the split dim")
    return [Split(dim, state.sources)]


def _permutation(op: Op, ndim: int) -> list[int] | None:
    """perm with out dim i = in dim perm[i]."""
    perm = list(range(ndim))
    if op.name in ("transpose", "swapaxes", "swapdims"):
        a, b = op.args[1] % ndim, op.args[2] % ndim
        perm[a], perm[b] = perm[b], perm[a]
    elif op.name == "t" or op.name == "T":
        perm.reverse()
    elif op.name == "mT":
        perm[-2], perm[-1] = perm[-1], perm[-2]
    elif op.name == "permute":
        dims = op.args[1] if len(op.args) == 2 and isinstance(op.args[1], (list, tuple)) else op.args[1:]
        perm = [d % ndim for d in dims]
    elif op.name == "movedim":
        src, dst = op.args[1], op.args[2]
        src = [s % ndim for s in (src if isinstance(src, (list, tuple)) else [src])]
        dst = [d % ndim for d in (dst if isinstance(dst, (list, tuple)) else [dst])]
        perm = [None] * ndim
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter(i for i in range(ndim) if i not in src)
        perm = [p if p is not None else next(rest) for p in perm]
    else:
        return None
    return perm


def permute(op: Op, state: Split) -> list[Split]:
    perm = _permutation(op, len(op.args[0].shape))
    return [Split(perm.index(state.dim), state.sources)]


def _full_slice(index: slice, size: int) -> bool:
    return index.start in (None, 0) and (index.stop is None or index.stop >= size) and index.step in (None, 1)


def getitem(op: Op, state: Split) -> list[Split]:
    src, index = op.args[0], op.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    if any(type(i) not in (int, slice, type(None), type(Ellipsis)) for i in items):
        _block([state], "indexing a split tensor with tensors or sequences")
    taking = sum(i is not None and i is not Ellipsis for i in items)
    expanded = []
    for item in items:
        expanded += [slice(None)] * (len(src.shape) - taking) if item is Ellipsis else [item]
    expanded += [slice(None)] * (len(src.shape) - sum(i is not None for i in expanded))
    in_dim = out_dim = 0
    for item in expanded:
        if item is None:
            out_dim += 1
            continue
        if in_dim == state.dim:
            if not isinstance(item, slice) or not _full_slice(item, src.shape[in_dim]):
                _block([state], "indexing into the split dim")
            return [Split(out_dim, state.sources)]
        out_dim += not isinstance(item, int)
        in_dim += 1
    _block([state], "indexing a split tensor")


def narrow(op: Op, state: Split) -> list[Split]:
    dim = arg(op, 1, "dim") % len(op.args[0].shape)
    if dim == state.dim:
        _block([state], f"{op.name} along the split dim")
    return [Split(state.dim - (op.name == "select" and dim < state.dim), state.sources)]


def split(op: Op, state: Split, tp: int, require_parts) -> list[Split]:
    """Along another dim each piece keeps the split; along the split dim a fresh output may be n fused parts of
    equal size (q, k, v), each then split in its own blocks."""
    src = op.args[0].shape
    dim = arg(op, SPLITS[op.name], "dim", 0) % len(src)
    if dim != state.dim:
        new = state.dim - (op.name == "unbind" and dim < state.dim)
        return [Split(new, state.sources, state.fresh) for _ in op.outputs]
    sizes = {o.shape[dim] for o in op.outputs} if op.name != "unbind" else {1}
    if not state.fresh or len(sizes) != 1 or sizes.pop() % tp:
        _block([state], f"{op.name} along the split dim into pieces other than equal fused parts")
    require_parts(state.sources, len(op.outputs))
    return [Split(dim, state.sources) for _ in op.outputs]


def cat(op: Op, states: dict[int, Split | None]) -> list[Split]:
    tensors = op.args[0] if op.args else op.kwargs.get("tensors")
    split_states = [states.get(t.id) for t in tensors]
    if any(s is None for s in split_states) or len({s.dim for s in split_states}) != 1:
        _block(split_states, f"{op.name} of split and whole tensors")
    ndim = len(op.outputs[0].shape)
    dim = arg(op, 1, "dim", 0) % ndim
    first = split_states[0].dim
    if op.name == "stack":
        new = first + (dim <= first)
    elif dim == first:
        _block(split_states, f"{op.name} along the split dim")
    else:
        new = first
    return [Split(new, sources_of(split_states))]


def matmul(op: Op, states: dict[int, Split | None]) -> list[Split]:
    """Batch dims split alike (heads), or a's rows, or b's columns; never the contracted dim."""
    a, b = op.args[0], op.args[1]
    sa, sb = states.get(a.id), states.get(b.id)
    n = len(op.outputs[0].shape)
    if len(a.shape) < 2 or len(b.shape) < 2:
        _block([sa, sb], f"{op.name} of a vector")
    wanted = []
    for ref, st, contracted, own, own_out in ((a, sa, -1, -2, n - 2), (b, sb, -2, -1, n - 1)):
        if st is None:
            continue
        if st.dim == len(ref.shape) + contracted:
            _block([sa, sb], f"{op.name} contracts the split dim")
        wanted.append(own_out if st.dim == len(ref.shape) + own else st.dim + n - len(ref.shape))
    if len(set(wanted)) != 1 or (len(wanted) == 2 and wanted[0] >= n - 2):
        _block([sa, sb], f"{op.name} of tensors split along different dims")
    dim = wanted[0]
    if dim < n - 2:
        for ref, st in ((a, sa), (b, sb)):
            aligned = dim - (n - len(ref.shape))
            if st is None and aligned >= 0 and ref.shape[aligned] != 1:
                _block([sa, sb], f"{op.name} of a split tensor with a whole one along the split dim")
    return [Split(dim, sources_of([sa, sb]))]


def attention(op: Op, states: dict[int, Split | None]) -> tuple[list[Split], bool]:
    """scaled_dot_product_attention: q, k, v split along the same batch dim (heads); the mask broadcast over it.
    Also says whether it drops out."""
    q, k, v = (arg(op, i, name) for i, name in enumerate(("query", "key", "value")))
    sq, sk, sv = (states.get(r.id) for r in (q, k, v))
    if sq is None or sk is None or sv is None or len({sq.dim, sk.dim, sv.dim}) != 1 \
            or sq.dim >= len(q.shape) - 2:
        _block([sq, sk, sv], "attention over split features, or with q, k and v split differently")
    mask = arg(op, 3, "attn_mask")
    if isinstance(mask, Ref):
        aligned = sq.dim - (len(q.shape) - len(mask.shape))
        sm = states.get(mask.id)
        if (sm is None and aligned >= 0 and mask.shape[aligned] != 1) or (sm is not None and sm.dim != aligned):
            _block([sq, sk, sv, sm], "an attention mask that differs along the split heads")
    dropout = arg(op, 4, "dropout_p", 0.0)
    state = Split(sq.dim + len(op.outputs[0].shape) - len(q.shape), sources_of([sq, sk, sv]))
    return [state], not isinstance(dropout, (int, float)) or dropout > 0


def linear_function(op: Op, state: Split) -> list[Split]:
    """F.linear outside a linear module (its weight is someone's parameter): rows stay split, features may not."""
    if state.dim == len(op.args[0].shape) - 1:
        _block([state], "linear() contracts the split features")
    return [Split(state.dim, state.sources)]
