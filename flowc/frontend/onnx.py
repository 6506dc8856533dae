"""ONNX -> IR.

Reads the model (external data included), fixes every dynamic dimension from the user's
``--shape``/``--dim`` values, and converts node by node through the GraphBuilder, so shape
subgraphs fold to constants as soon as the input shapes are known. Ops whose spelling
changed between opsets are rewritten to flowc's canonical form by the adapter their OpDef
declares. Every unsupported op is reported at once, before any conversion work.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from flowc.errors import FlowcError, InputError, ModelLoadError, ShapeError, UnsupportedOpError
from flowc.frontend.files import check_regular_file
from flowc.frontend.onnx_control import CONTROL_OPS, convert_control
from flowc.frontend.onnx_functions import (
    ONNX_DOMAINS,
    canonical_domain,
    expand,
    function_body,
    has_function,
)
from flowc.frontend.onnx_validate import element_type, sparse_array, tensor_array, validate_model
from flowc.frontend.onnx_weights import LeanModel, read_lean
from flowc.ir.builder import AdapterNode, GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Value
from flowc.ir.types import TensorType
from flowc.ops.registry import find_op


@dataclass
class ImportOptions:
    """Values for dynamic dimensions: whole input shapes by name, or symbols by name."""

    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    # A weights file (.npz or .safetensors) for a DSL program's load(...) params.
    weights: str | None = None
    # Training: the float initializers of rank >= 1 become parameters (graph inputs with
    # their data in Graph.params), so import folds nothing computed from them (a tied
    # weight's Transpose stays a node the gradient flows through).
    trainable: bool = False
    # A .flow program's symbols at the sizes of this reading (symbolic dims: each at its
    # bound unless given; ir/fit_dims.py reads a program at several sizes).
    sizes: Mapping[str, int] = field(default_factory=dict)
    # --bound NAME=K: the rows of the data-dependent output NAME
    bounds: Mapping[str, int] = field(default_factory=dict)
    # A build at probe sizes (ir/fit_dims.py): the rows of each computed count (n0, n1, ...),
    # and the bound build's constant-folding choices to repeat.
    counts: Mapping[str, int] = field(default_factory=dict)
    # ... and each computed count's bound in the build at the bound: the buffer it keeps at
    # every size, also where its op bounds it by a size that changes.
    count_bounds: Mapping[str, int] = field(default_factory=dict)
    fold_as: Mapping[str, bool] | None = None
    # Training's --batch B: axis 0 of every input is B (static or symbolic, the symbol then
    # bound to B wherever else it appears).
    batch: int | None = None


def load_model(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The whole model, its external data loaded into it (``import_onnx`` reads lean)."""
    return _load(path, lean=False).model


def load_model_lean(path: str | os.PathLike[str]) -> LeanModel:
    """The model with its main graph's weights as read-only views over the memory-mapped
    model and external data files (frontend/onnx_weights.py): for import_model's
    ``weights``."""
    return _load(path, lean=True)


def _load(path: str | os.PathLike[str], lean: bool) -> LeanModel:
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file", hint="check the path to the model")
    if p.is_dir():
        raise ModelLoadError(f"{p}: is a directory, expected an .onnx file")
    check_regular_file(p, "model")
    found = read_lean(p) if lean else None
    if found is not None:
        model, weights = found.model, found.weights
    else:  # not lean, or a wire format the lean reader leaves to onnx (which says what's wrong)
        weights = {}
        try:
            model = onnx.load(str(p), load_external_data=False)
        except (DecodeError, ValueError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{p}: not a valid ONNX model ({type(e).__name__}: "
                f"{str(e).strip() or 'parse error'})",
                hint="the file may be truncated or not an ONNX protobuf",
            ) from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelLoadError(
            f"{p}: the file parses but holds no ONNX graph", hint="is it an ONNX model?"
        )
    try:
        from onnx.external_data_helper import load_external_data_for_model

        # What the lean reader left external (subgraphs, attributes, packed types).
        load_external_data_for_model(model, str(p.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        raise ModelLoadError(
            f"{p}: cannot read external weights: {e}",
            hint="external data files must sit beside the model, as the model names them",
        ) from None
    validate_model(model)
    if model.functions:
        from onnx import inliner

        try:
            model = inliner.inline_local_functions(model)
        except (RuntimeError, onnx.checker.ValidationError) as e:
            # validate_model checked the bodies; this is what onnx's inliner alone objects to
            raise ModelLoadError(
                f"{p}: the model's local functions cannot be inlined: {e}"
            ) from None
    return LeanModel(model, weights)


def _opset_of(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ONNX_DOMAINS:
            return int(o.version)
    # ONNX's own rule: a model that imports no default-domain opset uses opset 1 semantics,
    # but in practice such files come from old exporters; take the oldest opset flowc knows.
    return 9


def _check_supported(model: onnx.ModelProto, opset: int) -> None:
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise ModelLoadError(
            f"the model uses ONNX opset {opset}; the installed onnx {onnx.__version__} knows "
            f"opsets up to {newest}",
            hint="upgrade the onnx package, or export the model with an older opset",
        )
    domain_versions = {o.domain: int(o.version) for o in model.opset_import}
    missing: dict[tuple[str, str], list[Any]] = {}
    counts: Counter[tuple[str, str]] = Counter()
    for node in model.graph.node:
        key = (node.domain, node.op_type)
        if node.domain not in ONNX_DOMAINS and find_op(_registry_name(node)) is not None:
            continue
        if node.domain in ONNX_DOMAINS and (
            find_op(node.op_type) is not None or node.op_type in CONTROL_OPS
        ):
            continue
        version = opset if node.domain in ONNX_DOMAINS else domain_versions.get(node.domain, 0)
        if has_function(node.op_type, node.domain, version):
            continue  # expanded into its ONNX function body while converting
        counts[key] += 1
        missing.setdefault(key, [node.name or f"(unnamed, outputs {list(node.output)})"])
    if not missing:
        return
    lines = []
    for (domain, op), first in sorted(missing.items()):
        dom = f"{domain}." if domain not in ONNX_DOMAINS else ""
        ver = (
            f"opset {opset}"
            if domain in ONNX_DOMAINS
            else f"domain {domain!r} opset {domain_versions.get(domain, '?')}"
        )
        lines.append(f"  {dom}{op}: {counts[(domain, op)]} node(s), {ver}, first: {first[0]}")
    raise UnsupportedOpError(
        f"the model uses {len(missing)} unsupported op type(s):\n" + "\n".join(lines),
        hint="run `flowc ops` to list the supported ops",
    )


def _input_dtype(vi: onnx.ValueInfoProto) -> DType:
    if not vi.type.HasField("tensor_type"):
        raise ModelLoadError(
            f"input {vi.name!r} is not a tensor (sequences and maps are not supported)"
        )
    return element_type(vi.type.tensor_type.elem_type, f"input {vi.name!r}")


def _bind_symbols(inputs: Sequence[onnx.ValueInfoProto], opts: ImportOptions) -> dict[str, int]:
    """Symbol values from --dim, and from the --shape of any input declared with that symbol;
    a symbol given two different values is an error naming both sources."""
    bound: dict[str, tuple[int, str]] = {k: (int(v), f"--dim {k}") for k, v in opts.dims.items()}
    for vi in inputs:
        if vi.name not in opts.shapes:
            continue
        given = [int(d) for d in opts.shapes[vi.name]]
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        model_dims = list(tt.shape.dim)
        if len(model_dims) != len(given):
            raise InputError(
                f"--shape {vi.name}: the model declares rank {len(model_dims)}, "
                f"got {len(given)} dims ({'x'.join(map(str, given))})"
            )
        for k, (d, g) in enumerate(zip(model_dims, given, strict=True)):
            if d.HasField("dim_value") and d.dim_value != g:
                raise InputError(
                    f"--shape {vi.name}: dim {k} is fixed to {d.dim_value} by the model, got {g}"
                )
            if d.HasField("dim_param") and d.dim_param:
                prev = bound.get(d.dim_param)
                if prev is not None and prev[0] != g:
                    raise InputError(
                        f"symbol {d.dim_param!r} is {g} from --shape {vi.name} but {prev[0]} "
                        f"from {prev[1]}",
                        hint="inputs that share a symbolic dimension must agree on its value",
                    )
                bound.setdefault(d.dim_param, (g, f"--shape {vi.name}"))
    return {k: v for k, (v, _) in bound.items()}


def _input_types(
    inputs: Sequence[onnx.ValueInfoProto], opts: ImportOptions
) -> dict[str, TensorType]:
    symbols = _bind_symbols(inputs, opts)
    if opts.batch is not None:
        for vi in inputs:
            dims0 = vi.type.tensor_type.shape.dim
            if len(dims0) and dims0[0].HasField("dim_param") and dims0[0].dim_param:
                symbols[dims0[0].dim_param] = opts.batch
    types: dict[str, TensorType] = {}
    missing: list[str] = []
    missing_syms: list[str] = []
    hints: list[str] = []
    for vi in inputs:
        dtype = _input_dtype(vi)
        tt = vi.type.tensor_type
        if vi.name in opts.shapes:
            types[vi.name] = TensorType(tuple(int(d) for d in opts.shapes[vi.name]), dtype)
            continue
        if not tt.HasField("shape"):
            missing.append(f"input {vi.name!r} has no declared shape")
            hints.append(f"--shape {vi.name}=D0xD1x...")
            continue
        dims = []
        for k, d in enumerate(tt.shape.dim):
            if k == 0 and opts.batch is not None:
                dims.append(opts.batch)
            elif d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param in symbols:
                dims.append(symbols[d.dim_param])
            else:
                sym = d.dim_param if d.HasField("dim_param") else "?"
                missing.append(
                    f"input {vi.name!r} has a dynamic dimension {k} ({sym!r}) with no value"
                )
                if d.HasField("dim_param") and d.dim_param:
                    if sym not in missing_syms:
                        missing_syms.append(sym)
                        hints.append(f"--dim {sym}=<size>")
                else:
                    hints.append(f"--shape {vi.name}=D0xD1x...")
                dims.append(-1)
        if -1 not in dims:
            types[vi.name] = TensorType(tuple(dims), dtype)
    if missing:
        more = (
            f" (and {len(missing) - 1} more: " + "; ".join(missing[1:]) + ")"
            if len(missing) > 1
            else ""
        )
        raise InputError(missing[0] + more, hint="fix with " + " ".join(dict.fromkeys(hints)))
    return types


def _f32(x: float) -> float:
    """An ONNX float attribute (a float32) as the float64 of its shortest decimal text, so
    1e-5 prints as 1e-05 rather than 9.999999747378752e-06 and reads back the same."""
    return float(str(np.float32(x)))


def _attr_value(a: onnx.AttributeProto) -> Any:
    t = a.type
    A = onnx.AttributeProto
    if t == A.FLOAT:
        return _f32(a.f)
    if t == A.INT:
        return int(a.i)
    if t == A.STRING:
        return a.s.decode("utf-8", errors="replace")
    if t == A.TENSOR:
        return tensor_array(a.t, f"attribute {a.name!r}")
    if t == A.FLOATS:
        return tuple(_f32(x) for x in a.floats)
    if t == A.INTS:
        return tuple(int(x) for x in a.ints)
    if t == A.STRINGS:
        return tuple(x.decode("utf-8", errors="replace") for x in a.strings)
    if t == A.SPARSE_TENSOR:
        return sparse_array(a.sparse_tensor, f"attribute {a.name!r}")
    raise ShapeError(f"attribute {a.name!r} of type {A.AttributeType.Name(t)} is not supported")


def _topo_order(nodes: Sequence[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """ONNX requires topological order; some exporters break it, so restore it (stably)."""
    ready = set(available)
    pending = list(nodes)
    ordered: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for n in pending:
            if all(i == "" or i in ready for i in n.input):
                ordered.append(n)
                ready.update(o for o in n.output if o)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            n = rest[0]
            missing = [i for i in n.input if i and i not in ready]
            raise ModelLoadError(
                f"node {n.name or n.op_type!r} ({n.op_type}) reads {missing}, which no node, "
                "input or initializer defines (or the graph has a cycle)"
            )
        pending = rest
    return ordered


def import_model(
    model: onnx.ModelProto,
    opts: ImportOptions | None = None,
    name: str = "",
    weights: Mapping[str, np.ndarray] | None = None,
) -> Graph:
    """The IR of ``model``. ``weights``: the data of the main graph's initializers that
    ``load_model_lean`` left as placeholders in the model, by name."""
    opts = opts or ImportOptions()
    weights = weights or {}
    validate_model(model)
    opset = _opset_of(model)
    _check_supported(model, opset)
    og = model.graph
    graph = Graph(name or og.name or "main")
    graph.meta = {
        "format": "onnx",
        "opset": str(opset),
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
    }
    builder = GraphBuilder(graph)
    builder.training = opts.trainable
    builder.bounds = dict(opts.bounds)
    graph.count_sizes = dict(opts.counts)
    graph.count_bounds = dict(opts.count_bounds)
    graph.fold_as = dict(opts.fold_as) if opts.fold_as is not None else None
    env: dict[str, Value] = {}

    init_names = {t.name for t in og.initializer} | {s.values.name for s in og.sparse_initializer}
    real_inputs = [vi for vi in og.input if vi.name not in init_names]
    known = {vi.name for vi in real_inputs}
    for n in opts.shapes:
        if n not in known:
            raise InputError(
                f"--shape {n}: the model has no input named {n!r}",
                hint="its inputs are: " + ", ".join(repr(k) for k in sorted(known)),
            )
    symbols = {
        d.dim_param
        for vi in real_inputs
        for d in vi.type.tensor_type.shape.dim
        if d.HasField("dim_param")
    }
    for s in opts.dims:
        if s not in symbols:
            raise InputError(
                f"--dim {s}: the model has no symbolic dimension named {s!r}",
                hint=("its symbols are: " + ", ".join(sorted(symbols)))
                if symbols
                else "its inputs have static shapes",
            )
    input_types = _input_types(real_inputs, opts)
    for vi in real_inputs:
        env[vi.name] = graph.add_input(vi.name, input_types[vi.name])
    for t in og.initializer:
        data = weights.get(t.name)
        if data is None:
            data = tensor_array(t, f"initializer {t.name!r}")
        if opts.trainable and data.dtype.kind == "f" and data.ndim >= 1:
            env[t.name] = graph.add_input(
                t.name, TensorType(tuple(data.shape), DType.from_numpy(data.dtype))
            )
            graph.params[t.name] = np.asarray(data)
            continue
        env[t.name] = builder.constant(t.name, data)
    for sp in og.sparse_initializer:
        env[sp.values.name] = builder.constant(
            sp.values.name, sparse_array(sp, f"sparse initializer {sp.values.name!r}")
        )

    domains = {canonical_domain(o.domain): int(o.version) for o in model.opset_import}
    domains[""] = opset
    for node in _topo_order(og.node, set(env)):
        try:
            _convert_node(builder, node, domains, env)
        except FlowcError as e:
            if not isinstance(e, ShapeError) or (node.name and node.name in e.message):
                raise
            raise ShapeError(
                f"while importing node {node.name or node.op_type!r}: {e.message}", e.hint
            ) from None

    for vo in og.output:
        if vo.name not in env:
            raise ModelLoadError(f"graph output {vo.name!r} is never computed")
        v = env[vo.name]
        if v.name != vo.name:
            v = _name_output(graph, builder, v, vo.name)
        tt = vo.type.tensor_type
        declared = element_type(tt.elem_type, f"output {vo.name!r}") if tt.elem_type else None
        if declared is not None and declared != v.type.dtype:
            raise ShapeError(
                f"output {vo.name!r}: the model declares {declared} but the graph computes "
                f"{v.type.dtype}"
            )
        graph.outputs.append(v)
    graph.remove_unused()
    builder.flush_warnings()
    _check_bounds(graph, opts.bounds)
    return graph


def _check_bounds(graph: Graph, bounds: Mapping[str, int]) -> None:
    """Every --bound names a data-dependent output of the graph."""
    computed = {s for s, r in graph.symbols.items() if r.computed}
    counted = {
        v.name
        for v in graph.values()
        if v.type.sym is not None
        and any(d is not None and d.symbols & computed for d in v.type.sym)
    }
    for name in bounds:
        if name not in counted:
            raise InputError(
                f"--bound {name}: the model has no data-dependent output named {name!r}",
                hint=(
                    "its data-dependent outputs are: " + ", ".join(sorted(counted))
                    if counted
                    else "the model has no output whose size depends on its data"
                ),
            )


def _name_output(graph: Graph, builder: GraphBuilder, v: Value, name: str) -> Value:
    """Give an output value the output's name: rename an inner value, else add an Identity."""
    inner = (
        v.producer is not None
        and v not in graph.outputs
        and name not in {x.name for x in graph.values()}
    )
    if inner:
        v.name = name
        graph._names.add(name)
        return v
    if v.const is not None and name not in {x.name for x in graph.values()}:
        return builder.constant(name, v.const)
    return builder.emit("Identity", [v], name=name, output_names=[name])[0]


def _registry_name(node: onnx.NodeProto) -> str:
    """The registry name of a node's op: the op type in the default domain; in another
    domain (ai.onnx.preview.training's optimizers) the qualified ``domain.op_type``."""
    return node.op_type if node.domain in ONNX_DOMAINS else f"{node.domain}.{node.op_type}"


def _convert_node(
    builder: GraphBuilder, node: onnx.NodeProto, domains: dict[str, int], env: dict[str, Value]
) -> None:
    opset = domains[""]
    if node.domain in ONNX_DOMAINS and node.op_type in CONTROL_OPS:
        convert_control(builder, node, domains, env, _convert_node, _topo_order)
        return
    opdef = find_op(_registry_name(node))
    if opdef is None:
        _expand_function(builder, node, domains, env)
        return
    inputs: list[Value | None] = [env[i] if i else None for i in node.input]
    attrs = {a.name: _attr_value(a) for a in node.attribute}
    out_names = list(node.output)
    onode = AdapterNode(builder, node.op_type, opset, node.name, inputs, attrs, out_names)
    outs: list[Value] | None = None
    if opdef.onnx_import is not None:
        outs = opdef.onnx_import(onode)
    if outs is None:
        outs = builder.emit(
            opdef.name,
            onode.inputs,
            onode.attrs,
            name=node.name,
            output_names=[
                n or f"{node.name or node.op_type}:unused{i}" for i, n in enumerate(out_names)
            ],
        )
    for n, v in zip(out_names, outs, strict=False):
        if n:
            env[n] = v


def _expand_function(
    builder: GraphBuilder, node: onnx.NodeProto, domains: dict[str, int], env: dict[str, Value]
) -> None:
    """Convert a function op flowc has no kernel for through its ONNX function body."""
    what = node.op_type if node.domain in ONNX_DOMAINS else f"{node.domain}.{node.op_type}"
    version = domains.get(canonical_domain(node.domain), 0)
    types = [env[i].type if i else None for i in node.input]
    body = function_body(node, version, types)
    if body is None:
        raise UnsupportedOpError(
            f"the model uses 1 unsupported op type(s):\n  {what}: node "
            f"{node.name or '(unnamed)'!r}; flowc has no kernel for it and ONNX defines no "
            "function body for these inputs",
            hint="run `flowc ops` to list the supported ops",
        )
    nodes, imports = expand(node, version, body)
    scope = {f: env[a] for f, a in zip(body.input, node.input, strict=False) if a}
    inner = {**domains, **imports}
    for n in nodes:
        try:
            _convert_node(builder, n, inner, scope)
        except UnsupportedOpError as e:
            raise UnsupportedOpError(
                f"{e.message}\n  (used by the ONNX function body of {what}, which flowc "
                "expands because it has no kernel of its own for it)",
                e.hint,
            ) from None
    for formal, actual in zip(body.output, node.output, strict=False):
        if actual:
            if formal not in scope:
                raise ModelLoadError(f"the ONNX function body of {what} never computes {formal!r}")
            env[actual] = scope[formal]


def input_dim_symbols(path: str | os.PathLike[str]) -> dict[str, list[str | None]]:
    """Each graph input's dims by the symbols the model names them with (None: a size, or an
    unnamed dim): how a range in --shape finds the symbol it sets."""
    model = _load(path, lean=True).model
    init = {t.name for t in model.graph.initializer}
    return {
        vi.name: [
            d.dim_param if d.HasField("dim_param") and d.dim_param else None
            for d in vi.type.tensor_type.shape.dim
        ]
        for vi in model.graph.input
        if vi.name not in init
    }


def import_onnx(path: str | os.PathLike[str], opts: ImportOptions | None = None) -> Graph:
    """Load and import an .onnx file (its weights read lean: views, not copies)."""
    lean = load_model_lean(path)
    return import_model(lean.model, opts, name=Path(path).stem, weights=lean.weights)
