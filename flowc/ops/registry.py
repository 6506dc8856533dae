"""The op registry: every op is declared once, with everything flowc knows about it.

An OpDef holds, side by side: the attribute defaults, shape/dtype inference, the NumPy
reference (flowc's own, written from the ONNX specification), the FLOP estimate and, when an
ONNX opset spells the op differently from flowc's canonical form, the adapter that rewrites
it on import. Later stages add SBP signatures, cost and the kernel template here too.

Canonical op semantics follow the newest ONNX opset: inputs that were once attributes
(Squeeze axes, Split sizes, Pad pads, Clip bounds, ...) are inputs, and an adapter converts
older forms.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Graph, Node
from flowc.ir.types import Sbp, TensorType

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value
    from flowc.ops.grad import VjpFn


_T = TypeVar("_T")


class InferCtx:
    """What shape/dtype inference sees of a node: input types, constant inputs, attributes."""

    def __init__(
        self,
        op: str,
        node_name: str,
        types: Sequence[TensorType | None],
        consts: Sequence[np.ndarray | None],
        attrs: Attrs,
        num_outputs: int,
    ) -> None:
        self.op = op
        self.node_name = node_name
        self.types = list(types)
        self.consts = list(consts)
        self.attrs = attrs
        self.num_outputs = num_outputs

    @property
    def num_inputs(self) -> int:
        return len(self.types)

    def has(self, i: int) -> bool:
        return i < len(self.types) and self.types[i] is not None

    def type(self, i: int) -> TensorType:
        if not self.has(i):
            raise self.fail(f"input {i} is required")
        t = self.types[i]
        assert t is not None
        return t

    def shape(self, i: int) -> tuple[int, ...]:
        return self.type(i).shape

    def dtype(self, i: int) -> DType:
        return self.type(i).dtype

    def const(self, i: int, what: str = "") -> np.ndarray:
        """The value of constant input i; an error if it is only known at run time."""
        if not self.has(i):
            raise self.fail(f"input {i}{' (' + what + ')' if what else ''} is required")
        c = self.consts[i] if i < len(self.consts) else None
        if c is None:
            raise self.fail(
                f"input {i}{' (' + what + ')' if what else ''} must be known at compile time; "
                "it is computed from run-time data. Fix the input shapes with --shape/--dim so "
                "shape computations fold to constants"
            )
        return c

    def maybe_const(self, i: int) -> np.ndarray | None:
        if not self.has(i) or i >= len(self.consts):
            return None
        return self.consts[i]

    def attr(self, name: str) -> Any:
        return self.attrs[name]

    def axis(self, axis: int, rank: int, what: str = "axis") -> int:
        """Normalize a possibly negative axis, with a clear error when out of range."""
        if not -rank <= axis < max(rank, 1):
            raise self.fail(f"{what} {axis} is out of range for a rank-{rank} tensor")
        return axis % rank if rank else 0

    def fail(self, msg: str) -> ShapeError:
        where = f"{self.op} node {self.node_name!r}" if self.node_name else f"{self.op} node"
        return ShapeError(f"{where}: {msg}")

    def check(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)``, whose ValueError (an attribute or shape it rejects)
        becomes this node's ShapeError: the geometry helpers stay free of InferCtx."""
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise self.fail(str(e)) from None


InferFn = Callable[[InferCtx], list[TensorType]]
RefFn = Callable[[list[np.ndarray | None], Attrs], "np.ndarray | Sequence[np.ndarray]"]
FlopsFn = Callable[[list[TensorType | None], list[TensorType], Attrs], int]

# What every library call's workspace bound starts from: the library's own scratch (cuBLASLt's
# tile counters, cuDNN's index tables). flowc's figure, not NVIDIA's: an algorithm that wants
# more than its call's bound is left out of the library's choice, never a failed call.
LIBRARY_SCRATCH = 64 << 10
OnnxAdapter = Callable[["AdapterNode"], "list[Value] | None"]
SbpFn = Callable[[InferCtx, list[TensorType]], "list[SbpSignature]"]
LocalizeFn = Callable[[Node, list[TensorType], list[TensorType]], dict[int, np.ndarray]]
EmitFn = Callable[["Program", Node], None]
CExprFn = Callable[[Attrs, tuple[bool, ...]], str]


@dataclass(frozen=True)
class SbpSignature:
    """One way an op runs along one mesh axis: the Sbp each input must have (None for an
    omitted optional input) and the Sbp each output then has.

    ``physical`` names the op each rank runs instead when it differs from the logical one
    (a Gather whose table is split on the vocabulary axis runs the masked GatherShard).
    The all-B signature is implied for every op and need not be listed.
    """

    inputs: tuple[Sbp | None, ...]
    outputs: tuple[Sbp, ...]
    physical: str | None = None

    def __str__(self) -> str:
        ins = ", ".join("-" if s is None else str(s) for s in self.inputs)
        outs = ", ".join(str(s) for s in self.outputs)
        return f"({ins}) -> ({outs})" + (f" [{self.physical}]" if self.physical else "")


_DSL_EXCEPTIONS = {"IsNaN": "is_nan", "PRelu": "prelu", "TopK": "topk", "MatMul": "matmul"}


def _dsl_name(name: str) -> str:
    """CamelCase op name to the DSL's snake_case: LayerNormalization -> layer_normalization."""
    if name in _DSL_EXCEPTIONS:
        return _DSL_EXCEPTIONS[name]
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return s.lower()


@dataclass(frozen=True)
class OpDef:
    name: str
    family: str
    infer: InferFn
    reference: RefFn
    attrs: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[int, int] = (1, 1)
    outputs: tuple[int, int] = (1, 1)
    flops: FlopsFn | None = None
    # True when the reference reads only the input shapes (Shape, Size): such a node folds to
    # a constant even when its input is computed at run time.
    shape_only: bool = False
    # True when the output is the input's bytes under another shape (Reshape, Squeeze, ...):
    # memory planning makes it an alias, code generation emits no kernel.
    view: bool = False
    onnx_import: OnnxAdapter | None = None
    # Code generation: `emit` writes the node's kernels and launches into a Program; an
    # element-wise op instead gives `cexpr`, its scalar C++ expression ($0, $1: operands, $T:
    # the result type, $I: the first operand's type), and shares one fused-kernel emitter.
    emit: EmitFn | None = None
    cexpr: CExprFn | None = None
    # True when `emit` also writes the node of a program with symbolic dims (ir/symbolic.py):
    # kernels that read the run's sizes (Program.sized); a node of another op with a
    # symbolic type is refused, naming it.
    sized: bool = False
    # True when `emit` serves a node whose tensors are symbolic in their first dim only (the
    # batch of a convolution or a pool): its kernels walk the flat elements with every other
    # dim fixed, and Program.launch_numel gives them the run's count.
    sized_leading: bool = False
    # The node's attributes with the sizes some of them spell taken out (FusedElementwise's
    # step shapes, for its FLOP count): what must be the same at every size of a program
    # with symbolic dims (ir/fit_dims.py compares it across the sizes it builds at).
    sizeless: Callable[[Attrs], Attrs] | None = None
    dsl_name: str = ""
    # Parallel placement: the op's SBP signatures along one mesh axis, given the logical
    # input types (and constant inputs) and output types; None means only all-B.
    sbp: SbpFn | None = None
    # When a signature splits an axis whose size a constant input spells out (Reshape's or
    # Expand's target shape), the replacement constants for one rank's local types.
    localize: LocalizeFn | None = None
    # The library (Program.blas / Program.conv: "blas", "conv") `emit` may call on the node's
    # stream; memory planning then gives that stream a library workspace.
    library: str = ""
    # The most library workspace the node's call can use on the GPU (bytes, from the types:
    # the flops signature); the stream's workspace is the largest of its calls', capped by
    # the cost profile's. None with a library: the cap.
    workspace: FlopsFn | None = None
    # The narrow float types (float16, bfloat16) `emit` reads and writes itself (a GEMM or a
    # convolution on tensor cores with float32 accumulation, a kernel that loads narrow and
    # computes in float): widen_types leaves the node alone when its narrow values are all
    # of these types.
    narrow: frozenset[DType] = frozenset()
    # Reverse-mode autodiff: the gradients of the inputs from those of the outputs, as IR
    # nodes (flowc/ops/grad.py); None: no gradient flows through this op.
    vjp: VjpFn | None = None

    def ctx(self, node: Node) -> InferCtx:
        return InferCtx(
            node.op,
            node.name,
            [i.type if i is not None else None for i in node.inputs],
            [i.const if i is not None else None for i in node.inputs],
            node.attrs.merged(self.attrs),
            len(node.outputs),
        )

    def infer_types(self, node: Node) -> list[TensorType]:
        return self.infer(self.ctx(node))

    def count_flops(self, node: Node) -> int:
        if self.flops is None:
            return 0
        return int(
            self.flops(
                [i.type if i is not None else None for i in node.inputs],
                [o.type for o in node.outputs],
                node.attrs.merged(self.attrs),
            )
        )

    def workspace_bytes(self, node: Node, cap: int) -> int:
        """The library workspace ``node``'s call may use, at most ``cap`` (0 without a
        library)."""
        if not self.library:
            return 0
        if self.workspace is None:
            return cap
        need = self.workspace(
            [i.type if i is not None else None for i in node.inputs],
            [o.type for o in node.outputs],
            node.attrs.merged(self.attrs),
        )
        return min(cap, int(need))

    def evaluate(self, inputs: list[np.ndarray | None], attrs: Attrs) -> list[np.ndarray]:
        out = self.reference(inputs, attrs.merged(self.attrs))
        if isinstance(out, (np.ndarray, np.generic)):
            return [np.asarray(out)]
        return [np.asarray(o) for o in out]


_REGISTRY: dict[str, OpDef] = {}
_BY_DSL: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in _REGISTRY:
        raise ValueError(f"op {opdef.name} is registered twice")
    dsl = opdef.dsl_name or _dsl_name(opdef.name)
    if dsl in _BY_DSL:
        raise ValueError(f"ops {opdef.name} and {_BY_DSL[dsl].name} share the DSL name {dsl}")
    opdef = OpDef(**{**opdef.__dict__, "dsl_name": dsl})
    _REGISTRY[opdef.name] = opdef
    _BY_DSL[dsl] = opdef
    return opdef


def defop(
    name: str,
    family: str,
    *,
    infer: InferFn,
    reference: RefFn,
    attrs: Mapping[str, Any] | None = None,
    inputs: tuple[int, int] | int = 1,
    outputs: tuple[int, int] | int = 1,
    flops: FlopsFn | None = None,
    shape_only: bool = False,
    view: bool = False,
    onnx_import: OnnxAdapter | None = None,
    emit: EmitFn | None = None,
    cexpr: CExprFn | None = None,
    sized: bool = False,
    sized_leading: bool = False,
    sizeless: Callable[[Attrs], Attrs] | None = None,
    dsl_name: str = "",
    sbp: SbpFn | None = None,
    localize: LocalizeFn | None = None,
    library: str = "",
    workspace: FlopsFn | None = None,
    narrow: frozenset[DType] = frozenset(),
    vjp: VjpFn | None = None,
) -> OpDef:
    """Declare an op. ``inputs``/``outputs`` give (min, max) counts or one exact count."""
    return register(
        OpDef(
            name=name,
            family=family,
            infer=infer,
            reference=reference,
            attrs=dict(attrs or {}),
            inputs=inputs if isinstance(inputs, tuple) else (inputs, inputs),
            outputs=outputs if isinstance(outputs, tuple) else (outputs, outputs),
            flops=flops,
            shape_only=shape_only,
            view=view,
            onnx_import=onnx_import,
            emit=emit,
            cexpr=cexpr,
            sized=sized,
            sized_leading=sized_leading,
            sizeless=sizeless,
            dsl_name=dsl_name,
            sbp=sbp,
            localize=localize,
            library=library,
            workspace=workspace,
            narrow=narrow,
            vjp=vjp,
        )
    )


def get_op(name: str) -> OpDef:
    _load_families()
    return _REGISTRY[name]


def find_op(name: str) -> OpDef | None:
    _load_families()
    return _REGISTRY.get(name)


def op_by_dsl_name(name: str) -> OpDef | None:
    _load_families()
    return _BY_DSL.get(name)


def all_ops() -> list[OpDef]:
    _load_families()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


_loaded = False


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import flowc.ops  # noqa: F401  (importing the package registers every family)


# -- helpers shared by the op families ------------------------------------------------------


def broadcast_shapes(ctx: InferCtx, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    """ONNX multidirectional (NumPy-style) broadcasting, with an error naming the shapes."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = {s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ctx.fail(
                "shapes " + ", ".join(str(list(s)) for s in shapes) + " do not broadcast together"
            )
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def same_as_input(ctx: InferCtx) -> list[TensorType]:
    return [ctx.type(0)]


def elementwise_flops(per_element: int = 1) -> FlopsFn:
    def flops(ins: list[TensorType | None], outs: list[TensorType], attrs: Attrs) -> int:
        return per_element * sum(o.numel for o in outs)

    return flops


def first(xs: Sequence[np.ndarray | None]) -> np.ndarray:
    """The first (required) input of a reference call."""
    x = xs[0]
    if x is None:
        raise ValueError("input 0 is required")
    return x


def node_attrs(node: Node) -> Attrs:
    """A node's attributes with its op's defaults filled in."""
    return node.attrs.merged(get_op(node.op).attrs)


def row_major_strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a C-order (row-major) tensor."""
    out = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * shape[k + 1]
    return out


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def ints(a: np.ndarray | Sequence[int]) -> list[int]:
    return [int(x) for x in np.asarray(a).reshape(-1)]


def is_view(graph: Graph, node: Node) -> bool:
    """A view node that stays an alias of its input's bytes (it runs no code): a view whose
    result is a graph output must be copied into the caller's buffer instead."""
    return get_op(node.op).view and node.outputs[0] not in set(graph.outputs)


@dataclass
class StateWrite:
    """How a state output is written over its input's bytes (Graph.state): ``writer``
    writes ``output`` once every node of ``readers`` (those reading ``input``'s bytes,
    through views too, but the writer) has run. ``reads_input``: the writer itself reads
    ``input``, which is safe only element by element (an element-wise op reads each element
    before it writes it)."""

    input: Value
    output: Value
    writer: Node
    readers: list[Node]
    reads_input: bool

    @property
    def in_place(self) -> bool:
        return not self.reads_input or get_op(self.writer.op).family == "elementwise"


def state_writes(graph: Graph) -> list[StateWrite]:
    """The graph's state writes (Graph.state), each with the readers it must come after."""
    pairs = graph.state_pairs()
    if not pairs:
        return []
    users = graph.users()
    out = []
    for x, xn in pairs:
        writer = xn.producer
        assert writer is not None
        family = [x]
        readers: list[Node] = []
        reads = False
        k = 0
        while k < len(family):
            for n in users.get(family[k], []):
                if is_view(graph, n):
                    family.append(n.outputs[0])
                elif n is writer:
                    reads = True
                elif n not in readers:
                    readers.append(n)
            k += 1
        out.append(StateWrite(x, xn, writer, readers, reads))
    return out


def set_vjp(name: str, vjp: VjpFn) -> None:
    """Give the registered op ``name`` its VJP rule: for ops declared by a shared helper
    (a table of unary ops) whose rules are written after it, in the same family module."""
    opdef = _REGISTRY[name]
    if opdef.vjp is not None:
        raise ValueError(f"op {name} has a VJP rule already")
    new = OpDef(**{**opdef.__dict__, "vjp": vjp})
    _REGISTRY[name] = new
    _BY_DSL[new.dsl_name] = new
