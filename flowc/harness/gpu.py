"""GPU harnesses (the ``gpu`` extra: PyCUDA): the generated code checked on a real GPU.

Two levels, both against references nobody here wrote:

- **Kernels.** ``kernel_cubin`` builds the kernels of a generated ``model.cu`` into a cubin
  with nvcc (``-cubin``: device code only, exactly the source the CUDA build compiles). Its
  kernels are ``static __global__`` functions in an anonymous namespace; nvcc keeps every
  one of them as an entry of the cubin under a mangled name of internal linkage, which
  ``cubin_kernels`` reads from the cubin's ELF symbol table together with each kernel's
  parameter layout (``EIATTR_KPARAM_INFO``). ``launch_plan`` reads the program the
  generated code runs (the fills of ``create`` and the statements of ``run_stage_0``: kernel
  launches with their grid, block, dynamic shared memory and arguments, memsets and device
  copies) into data; ``run_plan`` executes it with PyCUDA (``module_from_buffer``, the
  launch configuration the generated code uses) on its own device buffers for the inputs,
  outputs, weights, arena and error flag. ``check_kernels`` does all of that for a model
  and compares every output with flowc's NumPy reference (``flowc.interpreter``). A program
  with a library call (GEMM, convolution) or a collective is refused by name: those are
  checked as whole programs.
- **Whole programs.** ``run_library`` loads the built library (``lib<prefix>model.so``)
  through ctypes and calls its C API (create, run on a stream, synchronize, destroy) on
  device buffers from a ``Backend``: PyCUDA (device buffers and a stream of its own), CuPy
  where PyCUDA is not installed (the fallback ``make gpu-check`` uses when PyCUDA does not
  build), or the host (plain memory: the host target's library, so the same path is
  checked on a machine without a GPU). ``check_program`` compares with onnxruntime.

Everything up to the launch (building the cubin, reading its symbols and parameter layouts,
reading the plan and packing the arguments) runs without a GPU, and the tests check it on
every machine with nvcc (tests/test_gpu_harness.py).

One idea: the generated code checked on a GPU; kept whole because the kernel level's
model.cu reader, argument packing and launches are one chain with no other user.
"""

from __future__ import annotations

import ctypes
import json
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flowc.errors import FlowcError
from flowc.harness.compare import Comparison, compare
from flowc.harness.processes import run_group

# -- errors ---------------------------------------------------------------------------------


class HarnessError(FlowcError):
    """The harness cannot check this program (or found it broken): the message says why."""


class NoDeviceError(HarnessError):
    """No usable GPU, or no Python package to reach it (PyCUDA, CuPy)."""


# -- cubin: build and read ------------------------------------------------------------------


def kernel_cubin(project: Path, arch: str = "sm_90", out: Path | None = None) -> Path:
    """Build ``project``'s model.cu into a cubin for ``arch`` (device code only) with nvcc;
    returns the cubin's path (``out``, default PROJECT/kernels-ARCH.cubin)."""
    from flowc.toolchain import find_cuda

    if re.fullmatch(r"sm_[0-9]+a?", arch) is None:
        raise HarnessError(f"arch {arch!r}: expected sm_NN, e.g. sm_90")
    source = project / "model.cu"
    if not source.is_file():
        raise HarnessError(
            f"{project}: no model.cu here", hint="create the project with `flowc compile`"
        )
    tk = find_cuda()
    if tk.nvcc is None:
        raise HarnessError("nvcc not found: the kernels cannot be built into a cubin")
    out = out or project / f"kernels-{arch}.cubin"
    # model.cu includes the runtime's library wrappers, whose headers come with the toolkit
    # or with NVIDIA's wheels (the same include directories the CUDA build uses).
    incs = sorted({str(lib.include_dir) for lib in tk.libs.values()})
    cmd = [str(tk.nvcc), "-cubin", f"-arch={arch}", "-std=c++17", "-O3", "-I", str(project)]
    for d in incs:
        cmd += ["-I", d]
    cmd += [str(source), "-o", str(out)]
    r = run_group(cmd)  # Ctrl-C ends nvcc and its cicc/ptxas too
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-30:])
        raise HarnessError(f"nvcc -cubin of {source} failed:\n{tail}")
    return out


@dataclass(frozen=True)
class CubinKernel:
    """One entry of a cubin: its symbol and its parameters' (offset, size) in bytes, in
    parameter order, as the compiled code reads them."""

    symbol: str
    params: tuple[tuple[int, int], ...]
    param_bytes: int


_SHT_SYMTAB = 2
_STT_FUNC = 2
_EIFMT_SVAL = 4
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_CBANK_PARAM_SIZE = 0x19


def cubin_kernels(data: bytes) -> dict[str, CubinKernel]:
    """The kernels (entry functions) of a cubin, by symbol: ELF64 function symbols that have
    a ``.nv.info.<symbol>`` section, with the parameter layout that section records."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise HarnessError("not a 64-bit little-endian ELF file (a cubin)")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]

    def cstr(base: int, off: int) -> str:
        end = data.index(b"\0", base + off)
        return data[base + off : end].decode("utf-8", "replace")

    shstr = sections[shstrndx][4]
    names = [cstr(shstr, s[0]) for s in sections]
    functions: set[str] = set()
    for s in sections:
        if s[1] != _SHT_SYMTAB:
            continue
        strtab = sections[s[6]][4]
        for k in range(s[5] // 24):
            st_name, st_info = struct.unpack_from("<IB", data, s[4] + 24 * k)
            if st_info & 0xF == _STT_FUNC and st_name:
                functions.add(cstr(strtab, st_name))
    kernels = {}
    for name, s in zip(names, sections, strict=True):
        if not name.startswith(".nv.info.") or name[9:] not in functions:
            continue
        body = data[s[4] : s[4] + s[5]]
        params: dict[int, tuple[int, int]] = {}
        total = 0
        i = 0
        while i + 4 <= len(body):
            fmt, attr = body[i], body[i + 1]
            if fmt == _EIFMT_SVAL:
                (size,) = struct.unpack_from("<H", body, i + 2)
                value = body[i + 4 : i + 4 + size]
                i += 4 + size
            else:
                value = body[i + 2 : i + 4]
                i += 4
            if attr == _EIATTR_KPARAM_INFO and len(value) >= 12:
                _, ordinal, offset, packed = struct.unpack_from("<IHHI", value)
                params[ordinal] = (offset, packed >> 18)
            elif attr == _EIATTR_CBANK_PARAM_SIZE and len(value) >= 2:
                (total,) = struct.unpack_from("<H", value)
        ordered = tuple(params[k] for k in sorted(params))
        kernels[name[9:]] = CubinKernel(name[9:], ordered, total)
    return kernels


def find_symbol(kernels: Mapping[str, CubinKernel], name: str) -> str:
    """The cubin symbol of the generated kernel ``name`` (a C identifier): its own symbol
    when it has external C linkage, else the mangled name whose nested name ends in it."""
    if name in kernels:
        return name
    pattern = re.compile(rf"(?<![0-9]){len(name)}{re.escape(name)}E")
    found = [s for s in kernels if pattern.search(s)]
    if len(found) != 1:
        raise HarnessError(
            f"kernel {name}: {'no' if not found else len(found)} matching entries in the cubin"
            + (f" ({', '.join(found)})" if found else "")
        )
    return found[0]


# -- the launch plan: model.cu's program as data ----------------------------------------------


@dataclass(frozen=True)
class Pointer:
    """A device address: ``base`` (input, output, weights, arena, error_flag) [index] +
    ``offset`` bytes; ``elem`` is the pointee's size in bytes (0: void, no arithmetic)."""

    base: str
    index: int = 0
    offset: int = 0
    elem: int = 1


@dataclass(frozen=True)
class Dim3:
    x: int
    y: int = 1
    z: int = 1


# C scalar types: struct format character and size.
_SCALARS = {
    "int64_t": "q",
    "long long": "q",
    "long": "q",
    "uint64_t": "Q",
    "unsigned long long": "Q",
    "unsigned long": "Q",
    "size_t": "Q",
    "int32_t": "i",
    "int": "i",
    "uint32_t": "I",
    "unsigned": "I",
    "unsigned int": "I",
    "int16_t": "h",
    "short": "h",
    "uint16_t": "H",
    "int8_t": "b",
    "signed char": "b",
    "uint8_t": "B",
    "unsigned char": "B",
    "char": "b",
    "bool": "?",
    "float": "f",
    "double": "d",
}
_TYPE_WORDS = {w for t in _SCALARS for w in t.split()} | {"const", "void", "volatile"}


def _type_size(text: str) -> int:
    """The size of a pointee type spelled ``text`` (0 for void or unknown)."""
    t = " ".join(w for w in text.replace("*", " ").split() if w not in ("const", "volatile"))
    return struct.calcsize(_SCALARS[t]) if t in _SCALARS else 0


@dataclass(frozen=True)
class Layout:
    """A C type's size, alignment and scalar leaves (offset, struct format character), as
    the CUDA ABI lays it out (natural alignment, structs padded to their alignment)."""

    size: int
    align: int
    leaves: tuple[tuple[int, str], ...]
    shape: tuple[Any, ...] = ()  # fields: (name, Layout, array dims), for aggregates

    @staticmethod
    def scalar(fmt: str) -> Layout:
        n = struct.calcsize(fmt)
        return Layout(n, n, ((0, fmt),))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _norm(t: str) -> str:
    """A type spelled without qualifiers and with canonical spacing."""
    t = re.sub(r"\b(const|volatile|__restrict__|struct)\b", " ", t)
    t = re.sub(r"\s*([<>,*])\s*", r"\1", t.strip())
    t = re.sub(r",", ", ", t)
    return re.sub(r"\s+", " ", t).strip()


class Types:
    """The layouts of the types kernels take by value: C scalars, pointers, and the structs
    (templates too) that model.cu defines, read from its text."""

    def __init__(self, text: str = "") -> None:
        self.structs: dict[str, tuple[list[str], list[tuple[str, str, list[str]]]]] = {}
        for m in re.finditer(r"(?:template\s*<([^<>]*)>\s*)?struct\s+(\w+)\s*\{", text):
            names = [w.split()[-1] for w in m.group(1).split(",")] if m.group(1) else []
            body = text[m.end() : _closing(text, m.end() - 1, "{", "}") - 1]
            self.structs.setdefault(m.group(2), (names, _fields(body)))

    def layout(self, t: str) -> Layout:
        t = _norm(t)
        if t.endswith("*"):
            return Layout.scalar("Q")
        if t in _SCALARS:
            return Layout.scalar(_SCALARS[t])
        m = re.fullmatch(r"(\w+)(?:<(.*)>)?", t)
        if m is None or m.group(1) not in self.structs:
            raise HarnessError(f"a kernel parameter of type {t!r}, which model.cu does not define")
        names, fields = self.structs[m.group(1)]
        args = [a.strip() for a in m.group(2).split(",")] if m.group(2) else []
        if len(args) != len(names):
            raise HarnessError(f"type {t!r}: {len(args)} template arguments for {len(names)}")
        env = dict(zip(names, args, strict=True))
        offset, align, leaves, shape = 0, 1, [], []
        for ftype, fname, dims_text in fields:
            ftype = re.sub(r"\b\w+\b", lambda w: env.get(w.group(0), w.group(0)), ftype)
            dims = [int(env.get(d, d)) for d in dims_text]
            inner = self.layout(ftype)
            count = int(np.prod(dims)) if dims else 1
            offset = _align(offset, inner.align)
            for k in range(count):
                leaves += [(offset + k * inner.size + o, f) for o, f in inner.leaves]
            shape.append((fname, inner, tuple(dims)))
            offset += count * inner.size
            align = max(align, inner.align)
        return Layout(_align(offset, align), align, tuple(leaves), tuple(shape))


def _closing(text: str, start: int, open_: str, close: str) -> int:
    """The index just past the ``close`` that matches the ``open_`` at ``start``."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == open_:
            depth += 1
        elif text[k] == close:
            depth -= 1
            if depth == 0:
                return k + 1
    raise HarnessError(f"unbalanced {open_}{close} in model.cu")


def _fields(body: str) -> list[tuple[str, str, list[str]]]:
    """A struct body's data members (type, name, array dims); member functions skipped."""
    chunks: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in body:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                chunks.append("(")  # the end of a member function: nothing to keep
                cur = []
                continue
        if depth == 0 and ch == ";":
            chunks.append("".join(cur))
            cur = []
        elif depth == 0:
            cur.append(ch)
    out = []
    for chunk in chunks:
        chunk = re.sub(r"//[^\n]*", "", chunk).strip()
        if not chunk or "(" in chunk or chunk.startswith(("static", "using", "typedef")):
            continue
        m = re.fullmatch(
            r"(.+?)\s+(\w+\s*(?:\[\s*\w+\s*\])*(?:\s*,\s*\w+\s*(?:\[\s*\w+\s*\])*)*)", chunk, re.S
        )
        if m is None:
            raise HarnessError(f"cannot read the struct member {chunk!r}")
        for decl in m.group(2).split(","):
            name = re.match(r"\s*(\w+)", decl)
            assert name is not None
            out.append((m.group(1), name.group(1), re.findall(r"\[\s*(\w+)\s*\]", decl)))
    return out


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # as written, without qualifiers
    pointer: bool
    layout: Layout


@dataclass(frozen=True)
class Aggregate:
    """A braced initializer (``T{a, b}`` or ``{a, b}``): its items, nested as written."""

    items: tuple[Any, ...]


@dataclass
class Launch:
    kernel: str
    grid: Dim3
    block: Dim3
    shared: int
    args: list[Any]


@dataclass
class Memset:
    ptr: Pointer
    value: int
    nbytes: int


@dataclass
class Copy:
    dst: Pointer
    src: Pointer
    nbytes: int


Op = Launch | Memset | Copy


def _scalar_value(fmt: str, a: Any, what: str) -> int | float | bool:
    if isinstance(a, Pointer | Aggregate):
        raise HarnessError(f"{what}: a scalar is expected")
    if fmt in "fd":
        return float(a)
    if fmt == "?":
        return bool(a)
    bits = 8 * struct.calcsize(fmt)
    v = int(a) & ((1 << bits) - 1)
    if fmt.islower() and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def _pack_value(
    buf: bytearray, at: int, layout: Layout, a: Any, addr: Callable[[Pointer], int], what: str
) -> None:
    if not layout.shape:  # a scalar or a pointer
        fmt = layout.leaves[0][1]
        if isinstance(a, Pointer):
            if fmt != "Q":
                raise HarnessError(f"{what}: a pointer where a {fmt} value is expected")
            struct.pack_into("<Q", buf, at, addr(a))
        else:
            struct.pack_into("<" + fmt, buf, at, _scalar_value(fmt, a, what))
        return
    if not isinstance(a, Aggregate) or len(a.items) != len(layout.shape):
        raise HarnessError(f"{what}: a braced initializer of {len(layout.shape)} members expected")
    offset = 0
    for (fname, inner, dims), item in zip(layout.shape, a.items, strict=True):
        offset = _align(offset, inner.align)
        elems = _flatten(item, dims, f"{what}.{fname}")
        for k, e in enumerate(elems):
            _pack_value(buf, at + offset + k * inner.size, inner, e, addr, f"{what}.{fname}")
        offset += len(elems) * inner.size


def _flatten(item: Any, dims: tuple[int, ...], what: str) -> list[Any]:
    """An array member's initializer (nested braces, one level per dim) as its elements."""
    if not dims:
        return [item]
    if not isinstance(item, Aggregate) or len(item.items) != dims[0]:
        raise HarnessError(f"{what}: {dims[0]} braced elements expected")
    return [e for sub in item.items for e in _flatten(sub, dims[1:], what)]


@dataclass
class Plan:
    """What a project's generated program does on the device, read from its model.cu."""

    kernels: dict[str, list[Param]]  # the launched kernels' parameters, by kernel name
    create: list[Op]  # the fills of create()
    run: list[Op]  # run_stage_0's operations, in issue order
    arena_bytes: int
    weight_bytes: int  # stored in the weights file
    device_weight_bytes: int  # plus fills
    info: dict[str, Any] = field(default_factory=dict)  # flowc_model.json

    def pack(self, launch: Launch, addr: Callable[[Pointer], int] = lambda p: 0) -> bytes:
        """The launch's parameter buffer (each argument at its offset, as the kernel reads
        it), with ``addr`` giving each pointer's device address."""
        params = self.kernels[launch.kernel]
        if len(params) != len(launch.args):
            raise HarnessError(
                f"{launch.kernel}: launched with {len(launch.args)} arguments, declared with "
                f"{len(params)}"
            )
        offsets = param_offsets([p.layout for p in params])
        size = offsets[-1][0] + offsets[-1][1] if offsets else 0
        buf = bytearray(_align(size, 8) if size else 0)
        for p, a, (at, _) in zip(params, launch.args, offsets, strict=True):
            if p.pointer and not isinstance(a, Pointer) and a != 0:
                raise HarnessError(f"{launch.kernel}: parameter {p.name} needs a pointer")
            _pack_value(buf, at, p.layout, a, addr, f"{launch.kernel}: parameter {p.name}")
        return bytes(buf[:size])


def param_offsets(layouts: Sequence[Layout]) -> list[tuple[int, int]]:
    """Each parameter's (offset, size) in the parameter buffer: one after another, each
    aligned to its type's alignment."""
    out, at = [], 0
    for lay in layouts:
        at = _align(at, lay.align)
        out.append((at, lay.size))
        at += lay.size
    return out


_TOKEN = re.compile(
    r"\s*(?:(?P<num>0[xX][0-9a-fA-F.]+[pP][+-]?\d+[fFlL]?|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fFlLuU]*"
    r"|0[xX][0-9a-fA-F]+[uUlL]*)|(?P<id>[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)"
    r"|(?P<op>->|[()\[\]{}<>,+\-*;&]))"
)


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise HarnessError(f"cannot read {text[pos : pos + 40]!r}")
        out.append(m.group(m.lastgroup or "op"))
        pos = m.end()
    return out


def _number(tok: str) -> int | float:
    t = tok.lower()
    if t.startswith("0x") and "p" in t:
        return float.fromhex(t.rstrip("fl"))
    if t.startswith("0x"):
        return int(t.rstrip("ul"), 16)
    stripped = t.rstrip("ulf") if not re.search(r"[.e]", t) else t.rstrip("lf")
    if re.search(r"[.e]", stripped):
        return float(stripped)
    return int(stripped)


class _Parser:
    """A reader of the C++ expressions generated code passes to kernels and runtime calls:
    casts, parentheses, + - *, integer and float literals, INFINITY/NAN, and the names of
    run_stage_0 and create (inputs[k], outputs[k], weights, arena, error_flag, streams[s],
    stream)."""

    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0

    def peek(self, k: int = 0) -> str:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else ""

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if want is not None and tok != want:
            raise HarnessError(f"expected {want!r}, found {tok!r} in {' '.join(self.toks)}")
        self.i += 1
        return tok

    def call(self) -> tuple[str, list[Any]]:
        """NAME(expr, ...) [;] as a whole statement."""
        name = self.take()
        self.take("(")
        args = self.args()
        if self.peek() == ";":
            self.take()
        if self.peek():
            raise HarnessError(f"unexpected {self.peek()!r} after {name}(...)")
        return name, args

    def args(self) -> list[Any]:
        out: list[Any] = []
        if self.peek() == ")":
            self.take()
            return out
        while True:
            out.append(self.expr())
            if self.take() == ")":
                return out

    def expr(self) -> Any:
        v = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            w = self.term()
            v = _add(v, w if op == "+" else _neg(w))
        return v

    def term(self) -> Any:
        v = self.unary()
        while self.peek() == "*":
            self.take()
            w = self.unary()
            if isinstance(v, Pointer) or isinstance(w, Pointer):
                raise HarnessError("a pointer in a product")
            v = v * w
        return v

    def unary(self) -> Any:
        if self.peek() == "-":
            self.take()
            return _neg(self.unary())
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.primary()

    def braced(self) -> Aggregate:
        self.take("{")
        items = []
        while self.peek() != "}":
            items.append(self.expr())
            if self.peek() == ",":
                self.take()
        self.take("}")
        return Aggregate(tuple(items))

    def type_until(self, close: str) -> str:
        words: list[str] = []
        depth = 0
        while True:
            tok = self.take()
            if tok == "<":
                depth += 1
            elif tok == ">" and depth:
                depth -= 1
            elif tok == close and depth == 0:
                return " ".join(words)
            if not tok:
                raise HarnessError("unterminated type")
            words.append(tok)

    def is_cast(self) -> bool:
        """At '(': is what follows a C-style cast's type?"""
        k = 1
        seen = False
        while self.peek(k) and self.peek(k) != ")":
            if self.peek(k) not in _TYPE_WORDS and self.peek(k) != "*":
                return False
            seen = True
            k += 1
        return seen and self.peek(k) == ")"

    def primary(self) -> Any:
        tok = self.peek()
        if tok == "(":
            if self.is_cast():
                self.take()
                t = self.type_until(")")
                return _cast(t, self.unary())
            self.take()
            v = self.expr()
            self.take(")")
            return v
        if tok == "{":
            return self.braced()
        if tok[:1].isdigit() or (tok[:1] == "." and len(tok) > 1):
            self.take()
            return _number(tok)
        if not re.fullmatch(r"[A-Za-z_][\w:]*", tok):
            raise HarnessError(f"unexpected {tok!r} in {' '.join(self.toks)}")
        self.take()
        if tok in ("reinterpret_cast", "static_cast", "const_cast"):
            self.take("<")
            t = self.type_until(">")
            self.take("(")
            v = self.expr()
            self.take(")")
            return _cast(t, v)
        if tok not in _SCALARS and self.peek() == "<":  # T<args>{...}: a struct value
            self.take()
            self.type_until(">")
            return self.braced()
        if self.peek() == "{":  # T{...}
            return self.braced()
        if tok == "dim3":
            self.take("(")
            dims = [int(x) for x in self.args()]
            return Dim3(*dims)
        if tok in ("inputs", "outputs", "streams", "events"):
            self.take("[")
            k = self.expr()
            self.take("]")
            if tok == "inputs":
                return Pointer("input", int(k), 0, 0)
            if tok == "outputs":
                return Pointer("output", int(k), 0, 0)
            return (tok, int(k))
        if tok in ("weights", "arena"):
            return Pointer(tok, 0, 0, 1)
        if tok == "error_flag":
            return Pointer("error_flag", 0, 0, 4)
        if tok in ("stream", "nullptr", "NULL"):
            return 0 if tok != "stream" else ("streams", 0)
        if tok in ("INFINITY", "HUGE_VALF"):
            return float("inf")
        if tok == "NAN":
            return float("nan")
        if tok in ("true", "false"):
            return tok == "true"
        if tok.startswith("cudaMemcpy"):
            return tok
        if tok in _SCALARS and self.peek() == "(":
            self.take()
            v = self.expr()
            self.take(")")
            return _cast(tok, v)
        raise HarnessError(f"unknown name {tok!r} in {' '.join(self.toks)}")


def _neg(v: Any) -> Any:
    if isinstance(v, Pointer):
        raise HarnessError("a negated pointer")
    return -v


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, Pointer) and isinstance(b, Pointer):
        raise HarnessError("a sum of two pointers")
    if isinstance(b, Pointer):
        a, b = b, a
    if isinstance(a, Pointer):
        if a.elem == 0:
            raise HarnessError("arithmetic on a void pointer")
        return Pointer(a.base, a.index, a.offset + int(b) * a.elem, a.elem)
    return a + b


def _cast(t: str, v: Any) -> Any:
    if "*" in t:
        if isinstance(v, Pointer):
            return Pointer(v.base, v.index, v.offset, _type_size(t))
        if v == 0:
            return 0
        raise HarnessError(f"a cast of {v!r} to {t}")
    if isinstance(v, Pointer):
        raise HarnessError(f"a pointer cast to {t}")
    words = " ".join(w for w in t.split() if w not in ("const", "volatile"))
    if words not in _SCALARS:
        raise HarnessError(f"a value of type {t!r}, which the kernel harness cannot pass")
    fmt = _SCALARS[words]
    if fmt in "fd":
        return float(np.float32(v)) if fmt == "f" else float(v)
    if fmt == "?":
        return bool(v)
    if isinstance(v, float) and not np.isfinite(v):
        raise HarnessError(f"a non-finite value cast to {t}")
    return int(v)


def _parse_params(text: str, types: Types) -> list[Param]:
    params = []
    depth = 0
    parts: list[str] = []
    cur: list[str] = []
    for ch in text:
        if ch in "(<":
            depth += 1
        elif ch in ")>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    for part in parts:
        words = part.replace("*", " * ").split()
        words = [w for w in words if w not in ("__restrict__", "const", "volatile")]
        if len(words) < 2:
            raise HarnessError(f"cannot read the kernel parameter {part.strip()!r}")
        name = words[-1]
        pointer = "*" in words
        ctype = _norm(" ".join(words[:-1]))
        params.append(Param(name, ctype, pointer, types.layout(ctype)))
    return params


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``start``."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == "(":
            depth += 1
        elif text[k] == ")":
            depth -= 1
            if depth == 0:
                return k + 1
    raise HarnessError("unbalanced parentheses in model.cu")


_KERNEL_DEF = re.compile(
    r"(?:static\s+)?__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+([A-Za-z_]\w*)\s*\("
)
# run_stage_0's own set-up, before the schedule's statements.
_PREAMBLE = ("[[maybe_unused]]", "cudaStream_t streams[", "for (int s = 1;")
_IGNORED_CALLS = ("trace_begin", "trace_end", "cudaStreamWaitEvent", "cudaEventRecord")


def _op(line: str, where: str) -> Op | None:
    """One statement of the generated program as an operation (None: nothing the device
    does that a one-stream replay needs)."""
    if not re.match(r"[A-Za-z_]\w*\(", line):
        raise HarnessError(
            f"{where}: a statement the kernel harness cannot execute: {line[:100]}",
            hint="a library call (GEMM, convolution) or collective: check this program with "
            "the whole-program harness (check_program)",
        )
    if line.startswith(tuple(c + "(" for c in _IGNORED_CALLS)):
        # Tracing, and the events that order the schedule's streams: replayed on one stream
        # in issue order (a topological order of the same program) they have nothing to order.
        return None
    kernel = ""
    if line.startswith("FLOWC_LAUNCH("):
        # The kernel is a name the expression reader does not resolve: read it here.
        m = re.match(r"FLOWC_LAUNCH\(\s*([A-Za-z_]\w*)\s*,", line)
        if m is None:
            raise HarnessError(
                f"{where}: a launch of a template kernel, which the kernel harness cannot "
                f"name: {line[:100]}"
            )
        kernel, line = m.group(1), "FLOWC_LAUNCH(0," + line[m.end() :]
    name, args = _Parser(line).call()
    if name == "FLOWC_LAUNCH":
        _, grid, block, shared, _stream, *kargs = args
        return Launch(kernel, _dim3(grid), _dim3(block), int(shared), kargs)
    if name == "cudaMemsetAsync":
        ptr, value, nbytes, _stream = args
        return Memset(_ptr(ptr, line), int(value) & 0xFF, int(nbytes))
    if name == "cudaMemcpyAsync":
        dst, src, nbytes, kind, _stream = args
        if kind != "cudaMemcpyDeviceToDevice":
            raise HarnessError(f"{where}: a {kind} copy in the program: {line[:100]}")
        return Copy(_ptr(dst, line), _ptr(src, line), int(nbytes))
    raise HarnessError(
        f"{where}: a statement the kernel harness cannot execute: {line[:100]}",
        hint="a library call or a runtime call it does not know: check this program with the "
        "whole-program harness (check_program)",
    )


def _dim3(v: Any) -> Dim3:
    return v if isinstance(v, Dim3) else Dim3(int(v))


def _ptr(v: Any, line: str) -> Pointer:
    if not isinstance(v, Pointer):
        raise HarnessError(f"expected a device pointer in {line[:100]}")
    return v


def _constant(text: str, name: str) -> int:
    m = re.search(rf"constexpr uint64_t {name} = (\d+)ULL;", text)
    if m is None:
        raise HarnessError(f"model.cu has no {name}; recreate the project with `flowc compile`")
    return int(m.group(1))


def launch_plan(project: Path) -> Plan:
    """Read ``project``'s model.cu into a Plan (see the module docstring). A program of
    several ranks or stages, or one that calls a library, is refused with a HarnessError
    naming the statement."""
    text = (project / "model.cu").read_text(encoding="utf-8")
    info = json.loads((project / "flowc_model.json").read_text(encoding="utf-8"))
    if "kMeshNdim" in text:
        raise HarnessError(
            f"{project}: a multi-rank program; the kernel harness runs one-device programs"
        )
    kernels: dict[str, list[Param]] = {}
    types = Types(text)
    for m in _KERNEL_DEF.finditer(text):
        open_at = m.end() - 1
        params = text[open_at + 1 : _balanced(text, open_at) - 1]
        kernels[m.group(1)] = _parse_params(params, types)
    stage = text.find("static int run_stage_0(")
    create = text.find("int " + str(info["prefix"]) + "create(")
    if stage < 0 or create < 0 or create > stage:
        raise HarnessError(f"{project}/model.cu: no create() and run_stage_0() where expected")
    create_ops: list[Op] = []
    for line in text[create:stage].splitlines():
        line = line.strip()
        if line.startswith("FLOWC_LAUNCH("):
            op = _op(line, "create()")
            if op is not None:
                create_ops.append(op)
    body_at = text.index("{\n", stage) + 2
    run_ops: list[Op] = []
    for line in text[body_at:].splitlines():
        if line == "}" or line.strip() == "return 0;":
            break
        line = line.strip()
        if not line or line.startswith(_PREAMBLE):
            continue
        op = _op(line, "run_stage_0()")
        if op is not None:
            run_ops.append(op)
    plan = Plan(
        {},
        create_ops,
        run_ops,
        _constant(text, "kCudaArenaBytes"),
        _constant(text, "kWeightBytes"),
        _constant(text, "kDeviceWeightBytes"),
        info,
    )
    for op in [*create_ops, *run_ops]:
        if isinstance(op, Launch):
            if op.kernel not in kernels:
                raise HarnessError(f"{project}/model.cu: launches {op.kernel}, defined nowhere")
            plan.kernels[op.kernel] = kernels[op.kernel]
            plan.pack(op)  # the arguments fit the parameters
    return plan


def check_cubin(plan: Plan, kernels: Mapping[str, CubinKernel]) -> dict[str, str]:
    """Every launched kernel's cubin symbol, after checking that its parameters as the
    harness packs them (offsets and sizes) are the compiled kernel's."""
    symbols = {}
    for name, params in plan.kernels.items():
        sym = find_symbol(kernels, name)
        ours = param_offsets([p.layout for p in params])
        theirs = list(kernels[sym].params)
        if ours != theirs:
            raise HarnessError(
                f"kernel {name}: parameters packed as {ours} (offset, size), compiled as {theirs}"
            )
        symbols[name] = sym
    return symbols


def read_weights(project: Path, plan: Plan) -> bytes:
    """The stored constants of ``project``'s weights.bin (after its 64-byte header)."""
    data = (project / "weights.bin").read_bytes()
    from flowc.codegen.program import WEIGHTS_MAGIC

    if data[:8] != WEIGHTS_MAGIC or len(data) < 64:
        raise HarnessError(f"{project}/weights.bin: not a flowc weights file")
    (stored,) = struct.unpack_from("<Q", data, 16)
    if stored != plan.weight_bytes or len(data) != 64 + stored:
        raise HarnessError(
            f"{project}/weights.bin: {stored} stored bytes, model.cu expects "
            f"{plan.weight_bytes}; recompile"
        )
    return data[64:]


# -- device access ----------------------------------------------------------------------------


def _feed_arrays(info: Mapping[str, Any], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    from flowc.ir.dtype import DType

    arrays = []
    for spec in info["inputs"]:
        if spec["name"] not in feeds:
            raise HarnessError(f"input {spec['name']!r} is not given")
        want = DType.from_short(spec["dtype"]).np
        a = np.ascontiguousarray(np.asarray(feeds[spec["name"]]), dtype=want)
        if list(a.shape) != list(spec["shape"]):
            raise HarnessError(
                f"input {spec['name']!r}: shape {list(a.shape)}, the model takes {spec['shape']}"
            )
        arrays.append(a)
    return arrays


def _output_specs(info: Mapping[str, Any]) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]]:
    from flowc.ir.dtype import DType

    return [
        (o["name"], DType.from_short(o["dtype"]).np, tuple(o["shape"])) for o in info["outputs"]
    ]


def _bytes_view(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes as a flat uint8 array (PyCUDA's copies take any buffer, but ml_dtypes
    arrays such as bfloat16 expose none of their own)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def have_gpu() -> str | None:
    """None when a CUDA GPU is usable here, else why not (a skip message)."""
    from flowc.toolchain import gpu_count

    if gpu_count() == 0:
        return "no CUDA GPU on this machine (the driver reports none)"
    return None


def _pycuda() -> Any:
    try:
        import pycuda.driver as drv
    except ImportError as e:
        raise NoDeviceError(
            f"PyCUDA is not installed ({e})", hint="pip install 'flowc[gpu]' (needs nvcc)"
        ) from None
    return drv


_PRIMARY: list[Any] = []


def pycuda_context() -> Any:
    """PyCUDA on device 0's primary context, made current once per process: the context
    the CUDA runtime (and so a flowc library, CuPy and PyTorch) uses, so their pointers and
    streams mix with PyCUDA's."""
    drv = _pycuda()
    if not _PRIMARY:
        drv.init()
        ctx = drv.Device(0).retain_primary_context()
        ctx.push()
        _PRIMARY.append(ctx)
    return drv


def device_arch() -> str:
    """sm_NN of device 0 (through PyCUDA, else CuPy)."""
    try:
        drv = pycuda_context()
        major, minor = drv.Device(0).compute_capability()
    except NoDeviceError:
        cp = _cupy()
        major, minor = divmod(int(cp.cuda.Device(0).compute_capability), 10)
    return f"sm_{major}{minor}"


# -- the kernel harness (PyCUDA) ------------------------------------------------------------


def run_plan(
    project: Path, plan: Plan, cubin: bytes, feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Execute ``plan`` with PyCUDA: the cubin's kernels launched as the generated code
    launches them, on one stream in issue order, on device buffers of the harness's own;
    returns the outputs by name. A raised error flag (an out-of-range index) is an error."""
    drv = pycuda_context()
    module = drv.module_from_buffer(cubin)
    symbols = check_cubin(plan, cubin_kernels(cubin))
    functions = {name: module.get_function(sym) for name, sym in symbols.items()}
    info = plan.info

    def upload(a: np.ndarray) -> Any:
        buf = drv.mem_alloc(max(a.nbytes, 1))  # no zero-byte allocations
        if a.nbytes:
            drv.memcpy_htod(buf, _bytes_view(a))
        return buf

    inputs = [upload(a) for a in _feed_arrays(info, feeds)]
    specs = _output_specs(info)
    outputs = [drv.mem_alloc(max(int(np.prod(s)) * d.itemsize, 1)) for _, d, s in specs]
    weights = drv.mem_alloc(max(plan.device_weight_bytes, 256))
    stored = read_weights(project, plan)
    if stored:
        drv.memcpy_htod(weights, stored)
    arena = drv.mem_alloc(max(plan.arena_bytes, 256))
    flag = drv.mem_alloc(4)
    drv.memset_d8(flag, 0, 4)
    bases = {"weights": [weights], "arena": [arena], "error_flag": [flag]}
    bases["input"], bases["output"] = inputs, outputs

    def addr(p: Pointer) -> int:
        return int(bases[p.base][p.index]) + p.offset

    stream = drv.Stream()
    for op in [*plan.create, *plan.run]:
        if isinstance(op, Memset):
            drv.memset_d8_async(addr(op.ptr), op.value, op.nbytes, stream)
        elif isinstance(op, Copy):
            drv.memcpy_dtod_async(addr(op.dst), addr(op.src), op.nbytes, stream)
        else:
            # The whole parameter buffer, packed here at the offsets check_cubin compared
            # with the compiled kernel's, passed as one block of bytes (PyCUDA hands it to
            # cuLaunchKernel as CU_LAUNCH_PARAM_BUFFER_POINTER).
            buf = plan.pack(op, addr)
            f = functions[op.kernel]
            f.prepare(f"{len(buf)}s" if buf else "")
            g, b = op.grid, op.block
            f.prepared_async_call(
                (g.x, g.y, g.z),
                (b.x, b.y, b.z),
                stream,
                *([buf] if buf else []),
                shared_size=op.shared,
            )
    stream.synchronize()
    raised = np.zeros(1, np.int32)
    drv.memcpy_dtoh(raised, flag)
    if raised[0] != 0:
        raise HarnessError(f"the program raised its error flag (code {raised[0]})")
    result = {}
    for (name, dtype, shape), buf in zip(specs, outputs, strict=True):
        host = np.empty(shape, dtype)
        if host.nbytes:
            drv.memcpy_dtoh(_bytes_view(host), buf)
        result[name] = host
    return result


def compile_for_harness(model: Any, project: Path, **compile_args: Any) -> Any:
    """``model`` (an ONNX ModelProto or a path) imported, through the compile pipeline, and
    written to ``project``; returns the imported (un-optimized) graph, the reference's input."""
    from flowc.compiler import compile_graph, pass_list
    from flowc.frontend.onnx import import_model
    from flowc.passes.manager import PassManager

    graph = import_model(model)
    compile_graph(PassManager(pass_list()).run(import_model(model)), project, **compile_args)
    return graph


def check_kernels(
    model: Any,
    feeds: Mapping[str, np.ndarray],
    workdir: Path,
    *,
    tol: float = 1e-4,
    tols: Mapping[str, float] | None = None,
) -> list[Comparison]:
    """Compile ``model``, build its kernels into a cubin for this GPU, run them with PyCUDA
    (run_plan) and compare each output with flowc's NumPy reference."""
    from flowc.interpreter import evaluate

    project = workdir / "project"
    graph = compile_for_harness(model, project)
    plan = launch_plan(project)
    cubin = kernel_cubin(project, device_arch()).read_bytes()
    got = run_plan(project, plan, cubin, feeds)
    ref = evaluate(graph, dict(feeds))
    return [compare(n, got[n], np.asarray(ref[n]), (tols or {}).get(n, tol)) for n in got]


# -- the whole-program harness (ctypes) -------------------------------------------------------


class Backend:
    """Device memory and a stream for a flowc library: ``alloc`` returns a device address
    (aligned to 256 bytes), ``upload``/``download`` copy, ``stream`` is the handle passed
    to run() (0 = the default stream)."""

    name = ""

    def alloc(self, nbytes: int) -> int:
        raise NotImplementedError

    def upload(self, a: np.ndarray) -> int:
        raise NotImplementedError

    def download(self, ptr: int, out: np.ndarray) -> None:
        raise NotImplementedError

    @property
    def stream(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass


class HostBackend(Backend):
    """Plain host memory: for the host target's library, whose device memory is the host's."""

    name = "host"

    def __init__(self) -> None:
        self._keep: list[np.ndarray] = []

    def alloc(self, nbytes: int) -> int:
        raw = np.zeros(max(nbytes, 1) + 256, np.uint8)
        self._keep.append(raw)
        return (raw.ctypes.data + 255) // 256 * 256

    def upload(self, a: np.ndarray) -> int:
        ptr = self.alloc(a.nbytes)
        ctypes.memmove(ptr, np.ascontiguousarray(a).ctypes.data, a.nbytes)
        return ptr

    def download(self, ptr: int, out: np.ndarray) -> None:
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)


class PyCudaBackend(Backend):
    """PyCUDA's device buffers and a stream of its own (on the primary context)."""

    name = "pycuda"

    def __init__(self) -> None:
        self.drv = pycuda_context()
        self._stream = self.drv.Stream()
        self._keep: list[Any] = []

    def alloc(self, nbytes: int) -> int:
        buf = self.drv.mem_alloc(max(nbytes, 1))
        self._keep.append(buf)
        return int(buf)

    def upload(self, a: np.ndarray) -> int:
        ptr = self.alloc(a.nbytes)
        if a.nbytes:
            self.drv.memcpy_htod(ptr, _bytes_view(a))
        return ptr

    def download(self, ptr: int, out: np.ndarray) -> None:
        if out.nbytes:
            self.drv.memcpy_dtoh(_bytes_view(out), ptr)

    @property
    def stream(self) -> int:
        return int(self._stream.handle)

    def synchronize(self) -> None:
        self._stream.synchronize()


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise NoDeviceError(f"CuPy is not installed ({e})") from None
    return cupy


class CupyBackend(Backend):
    """CuPy's device buffers and a non-blocking stream: the fallback where PyCUDA is not
    installed (or did not build)."""

    name = "cupy"

    def __init__(self) -> None:
        self.cp = _cupy()
        self.cp.cuda.Device(0).use()
        self._stream = self.cp.cuda.Stream(non_blocking=True)
        self._keep: list[Any] = []

    def alloc(self, nbytes: int) -> int:
        buf = self.cp.empty(max(nbytes, 1), dtype=self.cp.uint8)
        self._keep.append(buf)
        return int(buf.data.ptr)

    def upload(self, a: np.ndarray) -> int:
        buf = self.cp.asarray(_bytes_view(a))
        # The copy went on CuPy's current stream, not the one run() is given: wait for it.
        self.cp.cuda.get_current_stream().synchronize()
        self._keep.append(buf)
        return int(buf.data.ptr)

    def download(self, ptr: int, out: np.ndarray) -> None:
        if out.nbytes:
            self.cp.cuda.runtime.memcpy(out.ctypes.data, ptr, out.nbytes, 2)  # DeviceToHost

    @property
    def stream(self) -> int:
        return int(self._stream.ptr)

    def synchronize(self) -> None:
        self._stream.synchronize()


def gpu_backend(prefer: str = "auto") -> Backend:
    """A device backend: PyCUDA, or CuPy where PyCUDA is not installed (``prefer``:
    auto, pycuda or cupy)."""
    if prefer in ("auto", "pycuda"):
        try:
            return PyCudaBackend()
        except NoDeviceError:
            if prefer == "pycuda":
                raise
    if prefer in ("auto", "cupy"):
        return CupyBackend()
    raise HarnessError(f"backend {prefer!r}: expected auto, pycuda or cupy")


class Library:
    """A built flowc library (lib<prefix>model.so) through ctypes."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.prefix = prefix
        p = ctypes.c_void_p
        self._fn("create", ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(p)])
        self._fn("run", ctypes.c_int, [p, ctypes.POINTER(p), ctypes.POINTER(p), p])
        self._fn("synchronize", ctypes.c_int, [p])
        self._fn("destroy", None, [p])
        self._fn("last_error", ctypes.c_char_p, [p])

    def _fn(self, name: str, res: Any, args: list[Any]) -> None:
        f = getattr(self.lib, self.prefix + name)
        f.restype, f.argtypes = res, args
        setattr(self, name, f)

    def error(self, handle: Any) -> str:
        msg = self.last_error(handle)  # type: ignore[attr-defined]
        return msg.decode("utf-8", "replace") if msg else ""


def library_path(project: Path, target: str = "cuda") -> Path:
    from flowc.harness.build import build_dir, project_info

    prefix = str(project_info(project)["prefix"])
    path = build_dir(project, target) / f"lib{prefix}model.so"
    if not path.is_file():
        raise HarnessError(
            f"{project}: no {path.name} for {target}; run `flowc build {project} --target {target}`"
        )
    return path


def run_library(
    project: Path,
    feeds: Mapping[str, np.ndarray],
    backend: Backend,
    *,
    target: str = "cuda",
    runs: int = 1,
    on_run: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Run ``project``'s built library ``runs`` times on ``feeds`` through its C API, with
    ``backend``'s buffers and stream; returns the outputs of the last run by name."""
    from flowc.harness.build import project_info

    info = project_info(project)
    lib = Library(library_path(project, target), str(info["prefix"]))
    handle = ctypes.c_void_p()
    if lib.create(str(project / "weights.bin").encode(), ctypes.byref(handle)) != 0:  # type: ignore[attr-defined]
        raise HarnessError(f"{project}: create failed: {lib.error(None)}")
    try:
        arrays = _feed_arrays(info, feeds)
        specs = _output_specs(info)
        ins = (ctypes.c_void_p * max(len(arrays), 1))(*[backend.upload(a) for a in arrays])
        outs_host = [np.empty(s, d) for _, d, s in specs]
        outs = (ctypes.c_void_p * max(len(specs), 1))(*[backend.alloc(o.nbytes) for o in outs_host])
        for k in range(runs):
            if lib.run(handle, ins, outs, ctypes.c_void_p(backend.stream or None)) != 0:  # type: ignore[attr-defined]
                raise HarnessError(f"{project}: run failed: {lib.error(handle)}")
            if lib.synchronize(handle) != 0:  # type: ignore[attr-defined]
                raise HarnessError(f"{project}: the run failed: {lib.error(handle)}")
            if on_run is not None:
                on_run(k)
        backend.synchronize()
        for o, ptr in zip(outs_host, outs, strict=False):
            backend.download(int(ptr or 0), o)
        return {name: o for (name, _, _), o in zip(specs, outs_host, strict=True)}
    finally:
        lib.destroy(handle)  # type: ignore[attr-defined]


def check_program(
    model: Any,
    project: Path,
    feeds: Mapping[str, np.ndarray],
    backend: Backend,
    *,
    target: str = "cuda",
    tol: float = 1e-4,
    reference: Mapping[str, np.ndarray] | None = None,
) -> list[Comparison]:
    """``project`` (built for ``target``) run through its library with ``backend`` against
    onnxruntime on ``model`` (or against ``reference`` outputs, e.g. PyTorch's)."""
    from flowc.harness.ort import inference_mode, run_onnxruntime

    got = run_library(project, feeds, backend, target=target)
    if reference is None:
        import onnx

        m = onnx.load(str(model)) if isinstance(model, str | Path) else model
        reference = run_onnxruntime(inference_mode(m), feeds)
    return [compare(n, got[n], np.asarray(reference[n]), tol) for n in got]


def describe(results: Sequence[Comparison]) -> str:
    return "\n".join(
        f"{c.name}: error {c.error:.3g}{'' if c.ok else ' FAIL ' + c.reason}" for c in results
    )
