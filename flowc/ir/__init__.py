"""The typed graph IR."""

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Graph, Node, Value
from flowc.ir.types import BROADCAST, PARTIAL, Mesh, NdSbp, Sbp, TensorType

__all__ = [
    "BROADCAST",
    "PARTIAL",
    "Attrs",
    "DType",
    "Graph",
    "Mesh",
    "NdSbp",
    "Node",
    "Sbp",
    "TensorType",
    "Value",
]
