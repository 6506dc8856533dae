"""Validation of an ONNX model before the importer reads any of it.

The importer and the ops' inference assume a well-formed model: names are text, element types
are ones flowc has, dimensions are not negative, tensors hold as many elements as their dims
say, attributes have the types the ONNX schema gives them, required inputs are there, and
local function bodies are sound. A model off the disk promises none of that, so this module
checks all of it once, up front, and reports the first problem as a FlowcError naming the
node, input, attribute or initializer at fault: the importer never meets malformed data.

The checks follow the ONNX specification (and onnx.checker), against the schema of the
model's own opset; what the schema allows passes, so valid models are never refused. Ops
ONNX has no schema for are left to their "unsupported op" report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.defs
from onnx import AttributeProto, TensorProto, numpy_helper

from flowc.errors import ModelLoadError, ShapeError
from flowc.ir.builder import MAX_ELEMENTS
from flowc.ir.dtype import DType
from flowc.ir.types import MAX_RANK

# A sparse tensor is made dense at import; past this many bytes the dense form is refused
# (a sparse initializer of a few bytes may declare a dense shape of terabytes).
MAX_DENSE_SPARSE_BYTES = 1 << 30
# OperatorSetIdProto.version is an int64, but onnx's schema lookup takes an int32.
MAX_OPSET_VERSION = (1 << 31) - 1

_ONNX_DOMAINS = ("", "ai.onnx")
_A = AttributeProto
_ATTR_TYPE_NAMES = {v: k for k, v in AttributeProto.AttributeType.items()}
# Element types packed below a byte: elements per byte in raw_data.
_PACKED: dict[int, int] = {
    TensorProto.INT4: 2,
    TensorProto.UINT4: 2,
    TensorProto.FLOAT4E2M1: 2,
    TensorProto.INT2: 4,
    TensorProto.UINT2: 4,
}


def _type_name(code: int) -> str:
    return _ATTR_TYPE_NAMES.get(code, str(code))


def _text(value: Any, what: str) -> str:
    """A name the protobuf runtime handed over as bytes is not valid UTF-8: ONNX names are."""
    if isinstance(value, str):
        return value
    raise ModelLoadError(
        f"{what} {value!r} is not valid UTF-8 text",
        hint="ONNX names are UTF-8 strings; the file may be corrupt",
    )


def element_type(code: int, what: str) -> DType:
    """The flowc DType of an ONNX element type code, or an error naming ``what``."""
    if code == TensorProto.STRING:
        raise ModelLoadError(
            f"{what} is a string tensor; flowc compiles numeric tensors only",
            hint="move string processing (tokenization, labels) out of the model",
        )
    try:
        return DType.from_onnx(code)
    except ValueError:
        name = TensorProto.DataType.Name(code) if code in TensorProto.DataType.values() else None
        known = f" ({name})" if name else ""
        raise ModelLoadError(
            f"{what} has element type {code}{known}, which flowc does not support"
            if name
            else f"{what} has an unknown element type code {code}",
            hint="see docs for the supported element types" if name else "the file may be corrupt",
        ) from None


def element_count(dims: Sequence[int], what: str) -> int:
    if len(dims) > MAX_RANK:
        raise ModelLoadError(
            f"{what} has rank {len(dims)}; flowc holds tensors of rank at most {MAX_RANK}"
        )
    n = 1
    for k, d in enumerate(dims):
        if d < 0:
            raise ModelLoadError(f"{what} has a negative dimension {k} ({d})")
        n *= int(d)
    # a dimension past the bound is refused even when another one is 0: NumPy cannot even
    # describe such an empty array
    if n > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in dims):
        raise ModelLoadError(
            f"{what} has {n} elements (dims {list(dims)}), more than flowc supports "
            f"({MAX_ELEMENTS})"
        )
    return n


def _expected_raw_bytes(code: int, n: int) -> int | None:
    if code in _PACKED:
        per = _PACKED[code]
        return (n + per - 1) // per
    try:
        return n * DType.from_onnx(code).itemsize
    except ValueError:
        return None


# The typed field each element type stores its data in, and how many entries per element
# (complex numbers take two; packed types share int32 entries by the byte).
def _typed_field(code: int) -> str:
    T = TensorProto
    if code in (T.FLOAT, T.COMPLEX64):
        return "float_data"
    if code in (T.DOUBLE, T.COMPLEX128):
        return "double_data"
    if code == T.INT64:
        return "int64_data"
    if code in (T.UINT32, T.UINT64):
        return "uint64_data"
    return "int32_data"


def check_tensor(t: TensorProto, what: str) -> DType:
    """A tensor's element type, dims and data length (after external data is loaded)."""
    dtype = element_type(t.data_type, what)
    n = element_count(t.dims, what)
    if t.data_location == TensorProto.EXTERNAL:
        raise ModelLoadError(f"{what}: its external data was not loaded")
    if t.HasField("raw_data"):
        want = _expected_raw_bytes(t.data_type, n)
        if want is not None and len(t.raw_data) != want:
            raise ModelLoadError(
                f"{what} holds {len(t.raw_data)} bytes of data, but {dtype} dims "
                f"{list(t.dims)} need {want}",
                hint="the file may be truncated or corrupt",
            )
        return dtype
    field = _typed_field(t.data_type)
    have = len(getattr(t, field))
    per = 2 if t.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128) else 1
    want = n * per
    if t.data_type in _PACKED:
        want = (n + _PACKED[t.data_type] - 1) // _PACKED[t.data_type]
    if have != want:
        raise ModelLoadError(
            f"{what} holds {have} value(s) in {field}, but {dtype} dims {list(t.dims)} need {want}",
            hint="the file may be truncated or corrupt",
        )
    return dtype


def tensor_array(t: TensorProto, what: str) -> np.ndarray:
    """A checked tensor's values as an array."""
    check_tensor(t, what)
    try:
        return numpy_helper.to_array(t)
    except (ValueError, TypeError, KeyError) as e:  # a layout the length checks let through
        raise ModelLoadError(f"{what} cannot be read: {e}") from None


def sparse_array(sp: onnx.SparseTensorProto, what: str) -> np.ndarray:
    """A sparse tensor made dense. Indices are flat positions (1-D) or one coordinate row
    per value (2-D); every one must lie inside the dense shape."""
    values = tensor_array(sp.values, f"{what} (its values)")
    if values.ndim != 1:
        raise ModelLoadError(f"{what}: its values must be 1-D, got dims {list(values.shape)}")
    dims = tuple(int(d) for d in sp.dims)
    n = element_count(dims, what)
    if n * values.itemsize > MAX_DENSE_SPARSE_BYTES:
        raise ModelLoadError(
            f"{what}: its dense form {list(dims)} would take {n * values.itemsize} bytes, more "
            f"than the {MAX_DENSE_SPARSE_BYTES} flowc makes dense"
        )
    if sp.indices.data_type != TensorProto.INT64:
        raise ModelLoadError(f"{what}: its indices must be int64")
    idx = tensor_array(sp.indices, f"{what} (its indices)")
    nnz = values.shape[0]
    full = np.zeros(dims, dtype=values.dtype)
    if idx.ndim == 1 and idx.shape[0] == nnz:
        if nnz and (idx.min() < 0 or idx.max() >= n):
            raise ModelLoadError(f"{what}: an index lies outside the {n} elements of {list(dims)}")
        full.reshape(-1)[idx] = values
    elif idx.ndim == 2 and idx.shape == (nnz, len(dims)):
        if nnz and ((idx < 0).any() or (idx >= np.array(dims, np.int64)).any()):
            raise ModelLoadError(f"{what}: an index lies outside the dims {list(dims)}")
        if nnz:
            full[tuple(idx.T)] = values
    else:
        raise ModelLoadError(
            f"{what}: {nnz} values need indices of dims [{nnz}] or [{nnz}, {len(dims)}], "
            f"got {list(idx.shape)}"
        )
    return full


# -- the model ---------------------------------------------------------------------------------


def validate_model(model: onnx.ModelProto) -> None:
    """Every check, on the main graph, its subgraphs and the local functions."""
    versions = _opsets(model.opset_import, "the model")
    functions = _check_functions(model, versions)
    _check_graph(model.graph, versions, functions, outer=set(), where="")


def _opsets(imports: Iterable[onnx.OperatorSetIdProto], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in imports:
        domain = _text(o.domain, f"{what}: an opset import's domain")
        if o.version <= 0:
            raise ModelLoadError(
                f"{what} imports opset version {o.version} of domain {domain or 'ai.onnx'!r}; "
                "versions start at 1"
            )
        if o.version > MAX_OPSET_VERSION:
            raise ModelLoadError(
                f"{what} imports opset version {o.version} of domain {domain or 'ai.onnx'!r}; "
                f"ONNX numbers opset versions up to {MAX_OPSET_VERSION} (a 32-bit int)",
                hint="the file may be corrupt, or the exporter wrote a wrong version",
            )
        key = "" if domain in _ONNX_DOMAINS else domain
        if key in out and out[key] != o.version:
            raise ModelLoadError(
                f"{what} imports domain {domain or 'ai.onnx'!r} twice, as versions "
                f"{out[key]} and {o.version}"
            )
        out[key] = int(o.version)
    return out


def _schema(op: str, domain: str, versions: Mapping[str, int]) -> Any:
    key = "" if domain in _ONNX_DOMAINS else domain
    if key not in versions and key != "":
        return None
    try:
        return onnx.defs.get_schema(op, versions.get(key, 9), key)
    except onnx.defs.SchemaError:
        pass
    # An op newer than the model's opset, which flowc still imports when it knows the op:
    # its attributes are checked against the op's newest schema.
    try:
        return onnx.defs.get_schema(op, onnx.defs.onnx_opset_version(), key)
    except onnx.defs.SchemaError:
        return None


def _node_name(n: onnx.NodeProto, k: int) -> str:
    _text(n.op_type, f"the op type of node #{k}")
    name = _text(n.name, f"the name of node #{k} ({n.op_type!r})")
    return f"node {name!r} ({n.op_type})" if name else f"node #{k} ({n.op_type}, unnamed)"


def _check_value_info(v: onnx.ValueInfoProto, what: str, is_input: bool) -> None:
    name = _text(v.name, what)
    what = f"{what} {name!r}"
    if not name:
        raise ModelLoadError(f"{what} has no name")
    kind = v.type.WhichOneof("value")
    if kind is None and not is_input:
        return  # an output of unspecified type: inference gives it one
    if kind != "tensor_type":
        raise ModelLoadError(
            f"{what} is a {kind or 'value of no type'}, not a tensor (sequences, maps and "
            "optionals are not supported)"
        )
    tt = v.type.tensor_type
    if tt.elem_type != TensorProto.UNDEFINED or is_input:
        element_type(tt.elem_type, what)
    if tt.HasField("shape"):
        for k, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value < 0:
                raise ModelLoadError(
                    f"{what}: dimension {k} is {d.dim_value}; a dimension is a size >= 0 or "
                    "a symbol",
                    hint="write a dynamic dimension as a dim_param (a name), not as -1",
                )
            _text(d.dim_param, f"{what}: the symbol of dimension {k}")
        if is_input and all(d.HasField("dim_value") for d in tt.shape.dim):
            element_count([d.dim_value for d in tt.shape.dim], what)


def _check_graph(
    g: onnx.GraphProto,
    versions: Mapping[str, int],
    functions: Mapping[tuple[str, str], onnx.FunctionProto],
    outer: set[str],
    where: str,
) -> None:
    """Names, types and tensors of a graph (``where`` names the node holding a subgraph),
    and each node's attributes and inputs."""
    at = f" in the subgraph of {where}" if where else ""
    defined = set(outer)
    for t in g.initializer:
        name = _text(t.name, f"an initializer's name{at}")
        check_tensor(t, f"initializer {name!r}{at}")
        defined.add(name)
    for sp in g.sparse_initializer:
        name = _text(sp.values.name, f"a sparse initializer's name{at}")
        sparse_array(sp, f"sparse initializer {name!r}{at}")
        defined.add(name)
    inputs: set[str] = set()
    for v in g.input:
        _check_value_info(v, f"graph input{at}", is_input=not where)
        if v.name in inputs:
            raise ModelLoadError(f"graph input {v.name!r}{at} is declared twice")
        inputs.add(v.name)
        defined.add(v.name)
    produced: dict[str, str] = {}
    for k, n in enumerate(g.node):
        what = _node_name(n, k) + at
        _text(n.op_type, f"the op type of node #{k}{at}")
        _text(n.domain, f"the domain of {what}")
        for i in n.input:
            _text(i, f"an input name of {what}")
        for o in n.output:
            _text(o, f"an output name of {what}")
            if not o:
                continue
            if o in produced or o in defined:
                first = produced.get(o, "an input or initializer")
                raise ModelLoadError(
                    f"{what} computes {o!r}, which {first} already defines",
                    hint="ONNX values are assigned once; the model is malformed",
                )
            produced[o] = what
        _check_node(n, what, versions, functions)
        for a in n.attribute:
            if a.type == _A.GRAPH:
                _check_graph(a.g, versions, functions, defined | set(produced), what)
            elif a.type == _A.GRAPHS:
                for sg in a.graphs:
                    _check_graph(sg, versions, functions, defined | set(produced), what)
    for v in g.output:
        _check_value_info(v, f"graph output{at}", is_input=False)


def _check_node(
    n: onnx.NodeProto,
    what: str,
    versions: Mapping[str, int],
    functions: Mapping[tuple[str, str], onnx.FunctionProto],
) -> None:
    _text(n.op_type, f"the op type of {what}")
    _text(n.domain, f"the domain of {what}")
    seen: set[str] = set()
    for a in n.attribute:
        name = _text(a.name, f"an attribute name of {what}")
        if not name:
            raise ModelLoadError(f"{what} has an attribute with no name")
        if name in seen:
            raise ModelLoadError(f"{what} sets attribute {name!r} twice")
        seen.add(name)
        _check_attribute_value(a, f"{what}, attribute {name!r}")
    fn = functions.get(("" if n.domain in _ONNX_DOMAINS else n.domain, n.op_type))
    if fn is not None:
        if len(n.input) > len(fn.input) or len(n.output) > len(fn.output):
            raise ModelLoadError(
                f"{what} passes {len(n.input)} input(s) and {len(n.output)} output(s) to "
                f"local function {fn.domain}.{fn.name}, which takes {len(fn.input)} and "
                f"gives {len(fn.output)}"
            )
        return
    schema = _schema(n.op_type, n.domain, versions)
    if schema is None:
        return  # reported as an unsupported op (or flowc's own, checked by its inference)
    opset = f"opset {versions.get('' if n.domain in _ONNX_DOMAINS else n.domain, '?')}"
    for a in n.attribute:
        spec = schema.attributes.get(a.name)
        if spec is None:
            raise ShapeError(
                f"{what}: {a.name!r} is not an attribute of {n.op_type} in {opset}",
                hint="its attributes: " + (", ".join(sorted(schema.attributes)) or "none"),
            )
        if int(spec.type) != a.type:
            raise ShapeError(
                f"{what}: attribute {a.name!r} is {_type_name(a.type)}, but {n.op_type} "
                f"takes it as {_type_name(int(spec.type))}"
            )
    for name, spec in schema.attributes.items():
        if spec.required and name not in seen:
            raise ShapeError(f"{what}: the required attribute {name!r} is not set")
    _check_arity(n, what, schema)


def _check_arity(n: onnx.NodeProto, what: str, schema: Any) -> None:
    Option = onnx.defs.OpSchema.FormalParameterOption
    given = list(n.input)
    while given and not given[-1]:
        given.pop()  # trailing omitted optional inputs
    if len(given) > schema.max_input:
        raise ShapeError(
            f"{what} has {len(given)} inputs; {n.op_type} takes at most {schema.max_input}"
        )
    for k, formal in enumerate(schema.inputs):
        if formal.option == Option.Variadic:
            present = [i for i in given[k:] if i]
            if len(present) < formal.min_arity:
                raise ShapeError(
                    f"{what}: needs at least {formal.min_arity} input(s) {formal.name!r}, "
                    f"got {len(present)}"
                )
            break
        if formal.option == Option.Single and (k >= len(given) or not given[k]):
            raise ShapeError(
                f"{what}: the required input {k} ({formal.name!r}) is missing",
                hint=f"{n.op_type} needs at least {schema.min_input} input(s)",
            )
    if len(n.output) > schema.max_output:
        raise ShapeError(
            f"{what} has {len(n.output)} outputs; {n.op_type} gives at most {schema.max_output}"
        )
    outs = list(n.output)
    if len(outs) < schema.min_output or not any(outs):
        raise ShapeError(f"{what} has no output; {n.op_type} gives at least {schema.min_output}")


def _check_attribute_value(a: AttributeProto, what: str) -> None:
    """The attribute's value is of its declared type and, for tensors, well formed."""
    if a.ref_attr_name:
        raise ModelLoadError(
            f"{what} refers to the function attribute {a.ref_attr_name!r} outside a function"
        )
    t = a.type
    if t == _A.UNDEFINED:
        raise ModelLoadError(f"{what} has no type", hint="the file may be corrupt")
    if t == _A.TENSOR:
        check_tensor(a.t, what)
    elif t == _A.SPARSE_TENSOR:
        sparse_array(a.sparse_tensor, what)
    elif t == _A.TENSORS:
        for k, x in enumerate(a.tensors):
            check_tensor(x, f"{what}, tensor {k}")
    elif t in (_A.TYPE_PROTO, _A.TYPE_PROTOS, _A.SPARSE_TENSORS):
        raise ModelLoadError(f"{what}: attributes of type {_type_name(t)} are not supported")


# -- local functions ------------------------------------------------------------------------


def _check_functions(
    model: onnx.ModelProto, versions: Mapping[str, int]
) -> dict[tuple[str, str], onnx.FunctionProto]:
    """Local functions: unique ids, bodies that define what they read and compute their
    outputs, calls within their arity, no recursion. Attribute references inside bodies are
    the inliner's to resolve."""
    functions: dict[tuple[str, str], onnx.FunctionProto] = {}
    for f in model.functions:
        domain = _text(f.domain, "a local function's domain")
        name = _text(f.name, "a local function's name")
        key = ("" if domain in _ONNX_DOMAINS else domain, name)
        if key in functions:
            raise ModelLoadError(f"local function {domain}.{name} is defined twice")
        functions[key] = f
    for key, f in functions.items():
        what = f"local function {key[0]}.{key[1]}"
        fv = {**versions, **_opsets(f.opset_import, what)}
        defined = {_text(i, f"an input name of {what}") for i in f.input}
        for k, n in enumerate(f.node):
            nw = f"{_node_name(n, k)} in {what}"
            for i in n.input:
                _text(i, f"an input name of {nw}")
                if i and i not in defined:
                    raise ModelLoadError(
                        f"{nw} reads {i!r}, which the function body does not define before it"
                    )
            for o in n.output:
                defined.add(_text(o, f"an output name of {nw}"))
            callee = functions.get(("" if n.domain in _ONNX_DOMAINS else n.domain, n.op_type))
            if callee is not None and len(n.input) > len(callee.input):
                raise ModelLoadError(f"{nw} passes more inputs than {callee.name} takes")
            for a in n.attribute:
                if not a.ref_attr_name:
                    _check_attribute_value(a, f"{nw}, attribute {a.name!r}")
            if callee is None and not any(a.ref_attr_name for a in n.attribute):
                _check_node(n, nw, fv, functions)
        for o in f.output:
            if _text(o, f"an output name of {what}") not in defined:
                raise ModelLoadError(f"{what} never computes its output {o!r}")
    _check_recursion(functions)
    return functions


def _check_recursion(functions: Mapping[tuple[str, str], onnx.FunctionProto]) -> None:
    calls = {
        key: {
            ("" if n.domain in _ONNX_DOMAINS else n.domain, n.op_type)
            for n in f.node
            if ("" if n.domain in _ONNX_DOMAINS else n.domain, n.op_type) in functions
        }
        for key, f in functions.items()
    }
    state: dict[tuple[str, str], int] = {}

    def visit(key: tuple[str, str], path: list[str]) -> None:
        if state.get(key) == 2:
            return
        if state.get(key) == 1:
            raise ModelLoadError(
                "local functions call themselves: " + " -> ".join([*path, f"{key[0]}.{key[1]}"]),
                hint="ONNX functions may not be recursive",
            )
        state[key] = 1
        for c in sorted(calls[key]):
            visit(c, [*path, f"{key[0]}.{key[1]}"])
        state[key] = 2

    for key in sorted(functions):
        visit(key, [])
