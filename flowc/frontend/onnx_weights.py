"""Reading an .onnx file's weights without copying them.

``onnx.load`` reads the whole file into memory and parses it into a ModelProto that holds
every initializer's bytes; turning those into arrays copies them once more, and loading
external data reads each file into the protobuf as well. For a model of a few GB that is
several times the weights in RAM. ``read_lean`` instead

- memory-maps the .onnx file and walks its protobuf wire format just far enough to find
  the main graph's initializers (ModelProto field 7, GraphProto field 5) and, in each, the
  span of its ``raw_data`` (TensorProto field 9);
- parses a copy of the file with those initializers replaced by *placeholders* (name and
  element type, dims ``[0]``, no data), so the ModelProto is small and everything that
  checks names, nodes and types sees the same model;
- gives each replaced initializer its data as a read-only NumPy view: over the mapped .onnx
  file for embedded data, over a mapping of the external data file (opened with onnx's own
  checks: inside the model's folder, a regular file) for external data. Mapped pages are
  read on first touch and may be dropped again by the kernel, so the weights are in memory
  at most once.

The replaced initializers are checked here as ``onnx_validate.check_tensor`` checks the
rest: a known element type and dims, and exactly the bytes those dims need (an external
data file too short for its tensor is an error naming the file, the tensor and both sizes).
Tensors this reader leaves in the protobuf (packed 4-, 2- and 6-bit types, strings, segments,
subgraph initializers, tensor attributes) take the ordinary path. A file whose wire format
this reader does not follow (a group field, the graph split over several fields) is
returned as None, and the caller falls back to ``onnx.load``, which reports what is wrong.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper

from flowc.errors import ModelLoadError
from flowc.frontend.onnx_validate import _expected_raw_bytes, element_count, element_type
from flowc.ir.mapped_files import register_mapped_file

# Element types whose raw bytes NumPy reads as they are (numpy_helper.to_array's frombuffer
# path); packed sub-byte types and strings are unpacked by onnx, so they stay in the proto.
_PACKED_OR_TEXT = {
    TensorProto.UNDEFINED,
    TensorProto.STRING,
    TensorProto.INT4,
    TensorProto.UINT4,
    TensorProto.FLOAT4E2M1,
    *(
        getattr(TensorProto, n)
        for n in ("INT2", "UINT2", "FLOAT6E2M3", "FLOAT6E3M2")
        if hasattr(TensorProto, n)
    ),
}

_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer
_TENSOR_RAW_DATA = 9  # TensorProto.raw_data


class _WireError(Exception):
    """The file's wire format is not one this reader follows (the caller uses onnx.load)."""


@dataclass
class LeanModel:
    """A model whose main-graph initializers in ``weights`` are placeholders in ``model``."""

    model: onnx.ModelProto
    weights: dict[str, np.ndarray] = field(default_factory=dict)


def _varint(buf: mmap.mmap, pos: int, end: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _WireError("bad varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: mmap.mmap, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, value end) of each field."""
    while pos < end:
        start = pos
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, stop = _varint(buf, pos, end)
        elif wire == 1:
            stop = pos + 8
        elif wire == 5:
            stop = pos + 4
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            stop = pos + n
        else:
            raise _WireError(f"wire type {wire}")
        if stop > end or number == 0:
            raise _WireError("field past its message")
        yield number, wire, start, pos, stop
        pos = stop


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _length_delimited(number: int, payload: bytes | bytearray) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.base_dir = str(path.parent)
        # One mapping per external data file (an array keeps its mapping alive).
        self.maps: dict[str, mmap.mmap] = {}
        self.sizes: dict[str, int] = {}
        self.weights: dict[str, np.ndarray] = {}

    def model_bytes(self, buf: mmap.mmap) -> bytes:
        out = bytearray()
        graphs = 0
        for number, wire, start, lo, hi in _fields(buf, 0, len(buf)):
            if number == _MODEL_GRAPH and wire == 2:
                graphs += 1
                out += _length_delimited(number, self.graph_bytes(buf, lo, hi))
            else:
                out += buf[start:hi]
        if graphs != 1:
            raise _WireError("not one graph field")  # protobuf would merge them
        return bytes(out)

    def graph_bytes(self, buf: mmap.mmap, lo: int, hi: int) -> bytearray:
        out = bytearray()
        for number, wire, start, vlo, vhi in _fields(buf, lo, hi):
            if number == _GRAPH_INITIALIZER and wire == 2:
                out += self.initializer_bytes(buf, start, vlo, vhi)
            else:
                out += buf[start:vhi]
        return out

    def initializer_bytes(self, buf: mmap.mmap, start: int, lo: int, hi: int) -> bytes:
        """The initializer's field as it goes into the parsed copy: a placeholder when this
        reader takes its data, else its own bytes."""
        meta = bytearray()
        raw: list[tuple[int, int]] = []
        for number, wire, fstart, vlo, vhi in _fields(buf, lo, hi):
            if number == _TENSOR_RAW_DATA and wire == 2:
                raw.append((vlo, vhi))
            else:
                meta += buf[fstart:vhi]
        t = TensorProto.FromString(bytes(meta))
        external = t.data_location == TensorProto.EXTERNAL
        if (
            (not raw and not external)
            or len(raw) > 1
            or t.data_type in _PACKED_OR_TEXT
            or t.HasField("segment")
            or sys.byteorder != "little"
        ):
            return bytes(buf[start:hi])
        what = f"initializer {t.name!r}"
        dtype = element_type(t.data_type, what)
        n = element_count(t.dims, what)
        want = _expected_raw_bytes(t.data_type, n)
        if want is None:
            return bytes(buf[start:hi])
        if external:
            data, offset = self.external_map(t, what, want, dtype)
        else:
            (vlo, vhi), data, offset = raw[0], buf, raw[0][0]
            if vhi - vlo != want:
                raise ModelLoadError(
                    f"{what} holds {vhi - vlo} bytes of data, but {dtype} dims "
                    f"{list(t.dims)} need {want}",
                    hint="the file may be truncated or corrupt",
                )
        np_dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        dims = tuple(int(d) for d in t.dims)
        if n:
            array = np.frombuffer(data, dtype=np_dtype, count=n, offset=offset).reshape(dims)
        else:
            array = np.zeros(dims, dtype=np_dtype)
        self.weights[t.name] = array
        placeholder = TensorProto(name=t.name, data_type=t.data_type, dims=[0])
        return _length_delimited(_GRAPH_INITIALIZER, placeholder.SerializeToString())

    def external_map(
        self, t: TensorProto, what: str, want: int, dtype: object
    ) -> tuple[mmap.mmap, int]:
        """The mapping of ``t``'s external data file and the tensor's offset in it."""
        from onnx import external_data_helper as edh

        try:
            info = edh.ExternalDataInfo(t)
        except ValueError as e:
            raise ModelLoadError(f"{self.path}: cannot read external weights: {e}") from None
        location = str(info.location)
        offset = int(info.offset or 0)
        if location not in self.maps:
            try:
                fd = edh._open_external_data_fd(self.base_dir, location, t.name, True)
            except (OSError, ValueError, onnx.checker.ValidationError) as e:
                raise ModelLoadError(
                    f"{self.path}: cannot read external weights: {e}",
                    hint="external data files must sit beside the model, as the model names them",
                ) from None
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # An empty file cannot be mapped; it holds data only for empty tensors.
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
                if mapped is not None:
                    register_mapped_file(mapped, f.fileno())  # weights copied file to file
            self.maps[location] = mapped if mapped is not None else mmap.mmap(-1, 1)
            self.sizes[location] = size
        size = self.sizes[location]
        file = Path(self.base_dir) / location
        length = size - offset if info.length is None else int(info.length)
        if offset + length > size or offset > size:
            there = max(size - offset, 0)
            raise ModelLoadError(
                f"{what}: its external data file {file} holds {size} bytes, but the tensor "
                f"needs {length} bytes at offset {offset} (only {there} there)",
                hint="the external data file may be truncated; copy it again beside the model",
            )
        if length != want:
            raise ModelLoadError(
                f"{what}: its external data in {file} is {length} bytes (offset {offset}), "
                f"but {dtype} dims {list(t.dims)} need {want}",
                hint="the external data file or the model may be corrupt",
            )
        return self.maps[location], offset


def read_lean(path: Path) -> LeanModel | None:
    """The model at ``path`` with its main-graph weights as views (see the module
    docstring); None when the wire format is one to leave to ``onnx.load``."""
    reader = _Reader(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return None
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            register_mapped_file(buf, f.fileno())  # embedded weights copied file to file
    except (OSError, ValueError):
        return None
    try:
        data = reader.model_bytes(buf)
        model = onnx.ModelProto.FromString(data)
    except (_WireError, DecodeError):
        return None  # what onnx.load would refuse too: let it say why
    return LeanModel(model, reader.weights)
