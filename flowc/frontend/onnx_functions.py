"""ONNX function ops: ops the ONNX standard defines as a body of other ops.

Many newer ops (RMSNormalization, SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss, Swish,
Celu, CenterCropPad, ...) come with a function body in their schema, sometimes one that depends
on the node's attributes and input types. When flowc has no kernel of its own for such an op,
the importer expands the node into its body, so the model compiles from ops flowc does know:
the same rewrite onnxruntime applies to function ops it does not implement. A native op in the
registry always wins; expansion is the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import onnx.defs
from onnx import helper

from flowc.ir.types import TensorType

ONNX_DOMAINS = ("", "ai.onnx")


def canonical_domain(domain: str) -> str:
    return "" if domain in ONNX_DOMAINS else domain


def schema_of(op_type: str, domain: str, version: int) -> Any:
    """The schema in effect for ``op_type`` at ``version`` of ``domain`` (an OpSchema, whose
    function accessors the onnx stubs do not declare), or None if ONNX defines none."""
    try:
        return onnx.defs.get_schema(op_type, version, canonical_domain(domain))
    except onnx.defs.SchemaError:
        return None


def has_function(op_type: str, domain: str, version: int) -> bool:
    """Whether the op at this opset has a function body flowc could expand it into."""
    s = schema_of(op_type, domain, version)
    return s is not None and (s.has_function or s.has_context_dependent_function)


def _pick(versions: Sequence[int], version: int) -> int | None:
    usable = [v for v in versions if v <= version]
    return max(usable) if usable else None


def function_body(
    node: onnx.NodeProto, version: int, input_types: Sequence[TensorType | None]
) -> onnx.FunctionProto | None:
    """The body ONNX gives for ``node`` at ``version`` of its domain, or None if it has none."""
    s = schema_of(node.op_type, node.domain, version)
    if s is None:
        return None
    fp = onnx.FunctionProto()
    if s.has_function:
        v = _pick(list(s.function_opset_versions), version)
        if v is not None:
            fp.ParseFromString(s.get_function_with_opset_version(v))
            return fp
    if s.has_context_dependent_function:
        v = _pick(list(s.context_dependent_function_opset_versions), version)
        if v is not None:
            types = [
                helper.make_tensor_type_proto(t.dtype.onnx, list(t.shape)).SerializeToString()
                if t is not None
                else onnx.TypeProto().SerializeToString()
                for t in input_types
            ]
            data = s.get_context_dependent_function_with_opset_version(
                v, node.SerializeToString(), types
            )
            if not data:
                return None
            fp.ParseFromString(data)
            return fp
    return None


def expand(
    node: onnx.NodeProto, version: int, body: onnx.FunctionProto
) -> tuple[list[onnx.NodeProto], dict[str, int]]:
    """The body's nodes with attribute references resolved from ``node`` (or the schema's
    defaults), and the body's opset imports. The nodes keep the body's value names: the
    caller imports them in a scope of their own (a function sees only its formal inputs),
    where a formal input the node omits is absent, so reads of it become omitted inputs."""
    omitted = set(body.input[len(node.input) :]) | {
        formal for formal, actual in zip(body.input, node.input, strict=False) if not actual
    }
    given = {a.name: a for a in node.attribute}
    schema = schema_of(node.op_type, node.domain, version)
    defaults: Mapping[str, onnx.AttributeProto] = {}
    if schema is not None:
        defaults = {
            k: a.default_value
            for k, a in schema.attributes.items()
            if a.default_value.type != onnx.AttributeProto.UNDEFINED
        }
    for ap in body.attribute_proto:
        defaults = {**defaults, ap.name: ap}

    out: list[onnx.NodeProto] = []
    for inner in body.node:
        n = onnx.NodeProto()
        n.CopyFrom(inner)
        del n.input[:]
        n.input.extend("" if i in omitted else i for i in inner.input)
        n.name = f"{node.name or node.op_type}/{inner.name or inner.op_type}"
        del n.attribute[:]
        for a in inner.attribute:
            if a.ref_attr_name:
                src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
                if src is None:
                    continue  # an optional attribute the node leaves unset
                b = onnx.AttributeProto()
                b.CopyFrom(src)
                b.name = a.name
                n.attribute.append(b)
            else:
                n.attribute.append(a)
        out.append(n)
    imports = {canonical_domain(o.domain): int(o.version) for o in body.opset_import}
    return out, imports


def expandable_ops(known: set[str]) -> list[str]:
    """Default-domain op types (newest opset) that flowc imports through their ONNX function
    body because ``known`` (the registry) has no kernel of their own."""
    names = set()
    schemas: Sequence[Any] = onnx.defs.get_all_schemas()  # stubs lack the function accessors
    for s in schemas:
        own = canonical_domain(s.domain) == "" and s.name not in known and not s.deprecated
        if own and (s.has_function or s.has_context_dependent_function):
            names.add(s.name)
    return sorted(names)
