"""The DSL front end: a .flow program (grammar/flow.lark) to the IR.

The DSL is also the IR's printed form (flowc.ir.printer), so anything flowc imports can be
dumped, edited and read back. Types are checked while the program is read: every binding's
op runs its shape inference, and an annotated type or placement must agree. Errors name
file:line:col, show the line with a caret, and say what was expected and what was found.

Literals in expressions take their type from context: a number combined with a tensor by an
element-wise op (``x * 2``) gets that tensor's type; otherwise integers are i64 and floats
f32 (``reshape(x, [8, -1])`` passes an i64 shape). ``const`` declarations give exact types.

One idea: .flow text to IR; kept whole because most of it is one tree reader (_Reader)
whose checks and error positions need the parse state it carries.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import operator
import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from flowc.errors import FlowcError
from flowc.frontend.files import check_regular_file
from flowc.frontend.npy import load_npz
from flowc.ir.builder import MAX_ELEMENTS, GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.fit_dims import annotate_symbols
from flowc.ir.graph import Graph, Value, make_splat
from flowc.ir.layout import fits, split_factor
from flowc.ir.symbolic import MAX_SYMBOLS, DimRange
from flowc.ir.types import (
    MAX_MESH_DEVICES,
    MAX_RANK,
    Mesh,
    NdSbp,
    Sbp,
    TensorType,
    mesh_size_problem,
)
from flowc.ir.verify import verify_graph
from flowc.ops.registry import all_ops, get_op, op_by_dsl_name
from flowc.resources import grammar_file

# Words that are values in an expression: a value may have such a name only quoted.
VALUE_KEYWORDS = frozenset({"nan", "inf", "true", "false", "_"})


class DslError(FlowcError):
    """An error in a .flow program, with its position."""


@dataclass(frozen=True)
class Source:
    path: str
    text: str

    def error(self, line: int, col: int, message: str, hint: str | None = None) -> DslError:
        # Lark counts lines by "\n" alone; str.splitlines() also splits at \f, \v, \u2028 and
        # the like, and would show another line than the one the position is on.
        lines = self.text.split("\n")
        shown = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
        # Tabs stay tabs under the line, so the caret lines up however they are shown.
        pad = "".join(c if c == "\t" else " " for c in shown[: max(col - 1, 0)])
        caret = pad.ljust(max(col - 1, 0)) + "^"
        return DslError(f"{self.path}:{line}:{col}: {message}\n  {shown}\n  {caret}", hint=hint)


_PARSER: Lark | None = None


def parser() -> Lark:
    global _PARSER
    if _PARSER is None:
        _PARSER = Lark(
            grammar_file().read_text(),
            parser="lalr",
            propagate_positions=True,
            maybe_placeholders=True,
        )
    return _PARSER


# Token names in Lark's messages, as a reader would call them.
_TOKEN_WORDS = {
    "CNAME": "a name",
    "ESCAPED_STRING": "a quoted string",
    "SIGNED_NUMBER": "a number",
    "SIGNED_INT": "an integer",
    "INT": "an integer",
    "_NEWLINE": "a new line",
    "$END": "the end of the file",
}


def _expected(names: Any) -> str:
    """Lark's expected terminals as a reader would list them: words (a name, a number) first,
    then punctuation and keywords; at most eight."""
    words = sorted({_token_word(t) for t in names}, key=lambda w: (w[0] in "'\"", w))
    return ", ".join(words[:8]) + (" ..." if len(words) > 8 else "")


def _end(text: str) -> tuple[int, int]:
    """The line and column just past the last thing written (trailing blank lines would put
    the caret under an empty line)."""
    text = text.rstrip()
    return text.count("\n") + 1, len(text.rsplit("\n", 1)[-1]) + 1


def _token_word(name: str) -> str:
    if name in _TOKEN_WORDS:
        return _TOKEN_WORDS[name]
    # Anonymous tokens: Lark names them after their text (LPAR, __ANON_0, "graph", ...).
    pattern = parser().get_terminal(name).pattern.value if name else name
    return repr(pattern) if isinstance(pattern, str) else name


def parse_tree(src: Source) -> Tree:
    """The parse tree, or a DslError at the first offending character or token."""
    try:
        return parser().parse(src.text)
    except UnexpectedCharacters as e:
        pos = e.pos_in_stream or 0
        ch = src.text[pos] if pos < len(src.text) else ""
        allowed = f"; expected {_expected(e.allowed)}" if e.allowed else ""
        raise src.error(e.line, e.column, f"unexpected character {ch!r}{allowed}") from None
    except UnexpectedEOF as e:
        raise src.error(
            *_end(src.text), "the program ends too early; expected " + _expected(e.expected)
        ) from None
    except UnexpectedToken as e:
        # LALR merges states, so e.expected can list tokens that would fail one step later
        # (after `graph g(x` it offers '=' and a new line); accepts() tries each one.
        ip = getattr(e, "interactive_parser", None)
        if ip is not None:
            e.expected = ip.accepts() or e.expected
        if e.token.type == "$END":
            # Lark places the end at the last token; the caret belongs after it.
            raise src.error(
                *_end(src.text), "the program ends too early; expected " + _expected(e.expected)
            ) from None
        # A line break's text is a run of newlines and indentation: name it instead.
        found = "the end of the line" if e.token.type == "_NEWLINE" else repr(str(e.token))
        raise src.error(
            e.line if e.line > 0 else 1,
            e.column if e.column > 0 else 1,
            f"unexpected {found}; expected {_expected(e.expected)}",
        ) from None
    except UnexpectedInput as e:  # any other Lark complaint
        raise src.error(
            getattr(e, "line", 1), getattr(e, "column", 1), str(e).splitlines()[0]
        ) from None


# normal(...) and uniform(...) parameters are generated in float64 at compile time: past this
# many elements (1 GiB of float64) the program must load them from a file instead.
MAX_RANDOM_PARAM_ELEMENTS = 1 << 27

# -- weights files ---------------------------------------------------------------------------


class Weights:
    """Named arrays from a .npz or .safetensors file, read on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._arrays: dict[str, np.ndarray] | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = read_weights(self.path)
        return self._arrays


def read_weights(path: Path) -> dict[str, np.ndarray]:
    try:
        is_file = path.is_file()
    except OSError as e:  # a name too long for the file system, ...
        raise FlowcError(f"weights file {path} cannot be read: {e.strerror or e}") from None
    if not is_file and (path.is_dir() or not path.exists()):
        what = "is a directory" if path.is_dir() else "does not exist"
        raise FlowcError(f"weights file {path} {what}")
    check_regular_file(path, "weights file", FlowcError)  # a FIFO, a device, ...
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            return load_npz(path, f"weights file {path}", FlowcError)
        if suffix == ".safetensors":
            try:
                from safetensors.numpy import load_file
            except ImportError:
                raise FlowcError(
                    f"weights file {path}: reading .safetensors needs the safetensors package",
                    hint="pip install safetensors, or save the weights as .npz",
                ) from None
            return dict(load_file(str(path)))
    except FlowcError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise FlowcError(f"weights file {path} cannot be read: {e}") from None
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise FlowcError(f"weights file {path} cannot be read: {e}") from None
    raise FlowcError(
        f"weights file {path}: unknown format {suffix or '(no suffix)'!r}",
        hint="weights come as .npz or .safetensors",
    )


# -- literals --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Literal:
    """A number or a flat list of numbers not yet given a type."""

    value: Any  # int, float, complex, or a list of them

    @property
    def is_float(self) -> bool:
        vals = self.value if isinstance(self.value, list) else [self.value]
        return any(isinstance(v, (float, complex)) for v in vals)

    @property
    def is_complex(self) -> bool:
        vals = self.value if isinstance(self.value, list) else [self.value]
        return any(isinstance(v, complex) for v in vals)

    def __str__(self) -> str:
        try:
            text = str(self.value)
        except ValueError:  # an integer of more than 4300 digits has no str()
            return "(a very long integer)"
        return text if len(text) <= 40 else text[:37] + "..."


_ELEMENTWISE_LITERAL_OPS = frozenset({"elementwise"})


class _Reader:
    def __init__(
        self,
        src: Source,
        weights: Path | None,
        base_dir: Path,
        sizes: Mapping[str, int] | None = None,
    ) -> None:
        self.src = src
        # Symbolic dims: the declared symbols' ranges, and the size each takes in this
        # reading (its bound unless ``sizes`` names it: the symbolic-type fit reads the
        # program at several sizes, ir/fit_dims.py).
        self.symbols: dict[str, DimRange] = {}
        self.sizes = dict(sizes or {})
        self.weights_override = weights
        self.base_dir = base_dir
        self.weights: Weights | None = Weights(weights) if weights is not None else None
        self.graph = Graph("main")
        self.graph.count_sizes = dict(self.sizes)  # (the computed counts' among them)
        self.builder = GraphBuilder(self.graph, fold=False)
        self.scope: dict[str, Value] = {}
        self.bound: set[Value] = set()
        self.defined_at: dict[str, tuple[int, int]] = {}
        self.mesh: Mesh | None = None
        self.weights_declared = False
        self.stage: int | None = None
        self.counter = 0
        self.loads = False  # whether a param is load(...)ed: what a weights file is for

    # -- helpers ----------------------------------------------------------------------------

    def fail(self, where: Tree | Token | None, message: str, hint: str | None = None) -> DslError:
        line, col = _pos(where)
        return self.src.error(line, col, message, hint)

    def name(self, t: Tree | Token) -> str:
        tok = t.children[0] if isinstance(t, Tree) else t
        assert isinstance(tok, Token)
        if tok.type == "ESCAPED_STRING":
            return self.string(tok)
        return str(tok)

    def new_name(self, t: Tree | Token) -> str:
        """A name being defined: a bare nan, inf, true, false or _ would read back as that
        value where the name is used, so it must be quoted."""
        name = self.name(t)
        tok = t.children[0] if isinstance(t, Tree) else t
        if isinstance(tok, Token) and tok.type != "ESCAPED_STRING" and name in VALUE_KEYWORDS:
            raise self.fail(
                t,
                f"{name!r} is a keyword of the language and cannot name a value bare",
                hint=f"quote it: {json.dumps(name)}",
            )
        return name

    def string(self, tok: Tree | Token) -> str:
        """A quoted string's text. The grammar takes any backslash pair; JSON's escapes are
        the ones that mean something. strict=False lets a tab stand in a string as itself."""
        assert isinstance(tok, Token), "the grammar gives a string token here"
        try:
            return str(json.loads(str(tok), strict=False))
        except json.JSONDecodeError as e:
            # A string is one line: the caret goes under the offending escape.
            line, col = _pos(tok)
            raise self.src.error(
                line,
                col + e.pos,
                f"bad escape in a quoted string: {e.msg}",
                hint='strings use JSON escapes: \\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX',
            ) from None

    def integer(self, tok: Tree | Token) -> int:
        """An integer token; Python refuses to read more than 4300 digits."""
        assert isinstance(tok, Token), "the grammar gives an integer token here"
        try:
            return int(str(tok))
        except ValueError:
            raise self.fail(tok, f"the integer {str(tok)[:20]}... has too many digits") from None

    def tensor_type(self, t: Tree) -> TensorType:
        dt_tok, dims = t.children
        try:
            dtype = DType.from_short(str(dt_tok))
        except (KeyError, ValueError):
            shorts = sorted(d.short for d in DType)
            close = difflib.get_close_matches(str(dt_tok), shorts, n=3)
            raise self.fail(
                dt_tok,
                f"unknown element type {str(dt_tok)!r}",
                hint=("did you mean " + ", ".join(close) + "?")
                if close
                else "types: " + ", ".join(shorts),
            ) from None
        shape = [] if dims is None else [self.dim(d) for d in dims.children]
        if len(shape) > MAX_RANK:
            raise self.fail(
                t,
                f"a tensor of rank {len(shape)}: flowc holds tensors of rank at most {MAX_RANK}",
                hint="merge axes with reshape",
            )
        for d, node in zip(shape, dims.children if dims is not None else [], strict=True):
            if d < 0:
                raise self.fail(node, f"dimension {d} is negative")
        if any(d > MAX_ELEMENTS for d in shape) or math.prod(shape) > MAX_ELEMENTS:
            raise self.fail(
                t,
                f"{dtype.short}{list(shape)} has more elements than flowc supports "
                f"({MAX_ELEMENTS})",
            )
        return TensorType(tuple(shape), dtype)

    def dim(self, t: Tree) -> int:
        """A dim's size in this reading: a literal, or its polynomial of symbols at their
        sizes; ``batch<=64`` and ``batch:1..64`` declare the symbol where they stand."""
        if t.data in ("dim_le", "dim_range"):
            sym_t = t.children[0]
            if t.data == "dim_le":
                r = self.declare_symbol(sym_t, 1, t.children[1], None, t)
            else:
                lo_t, hi_t, at_t = t.children[1:]
                r = self.declare_symbol(sym_t, lo_t, hi_t, at_t, t)
            return self.sizes.get(str(sym_t), r.hi)
        total = 0
        for mono in t.children:
            value = 1
            for f in mono.children:
                assert isinstance(f, Token), "the grammar gives a factor token here"
                if f.type == "CNAME":
                    name = str(f)
                    if name not in self.symbols:
                        raise self.fail(
                            f,
                            f"unknown symbol {name!r} in a dimension",
                            hint=f"declare it with its sizes: dim {name}: 1..64 (before the "
                            "graph), or in place: [" + name + "<=64, ...]",
                        )
                    value *= self.sizes.get(name, self.symbols[name].hi)
                else:
                    value *= self.integer(f)
            total += value
        return total

    def declare_symbol(
        self,
        sym_t: Any,
        lo_t: Any,
        hi_t: Any,
        at_t: Any,
        where: Tree,
        computed: bool = False,
    ) -> DimRange:
        """Declare symbol ``sym_t`` (or check it against its declaration): tokens of the
        grammar's dim_decl/dim_le/dim_range, ``lo_t`` an int where the text gives none."""
        name = str(sym_t)
        lo = lo_t if isinstance(lo_t, int) else self.integer(lo_t)
        hi = self.integer(hi_t)
        try:
            r = DimRange(lo, hi, self.integer(at_t) if at_t is not None else None, computed)
        except ValueError as e:
            raise self.fail(where, f"symbol {name!r}: {e}") from None
        if hi > MAX_ELEMENTS:
            raise self.fail(where, f"symbol {name!r}: a bound above {MAX_ELEMENTS}")
        prev = self.symbols.get(name)
        if prev is not None and prev != r and (at_t is not None or (prev.lo, prev.hi) != (lo, hi)):
            raise self.fail(
                where,
                f"symbol {name!r} is {r} here but {prev} before",
                hint="a symbol has one range; give it once (dim NAME: LO..HI) and write the "
                "name alone in types",
            )
        if prev is None:
            if len(self.symbols) >= MAX_SYMBOLS:
                raise self.fail(where, f"a program has at most {MAX_SYMBOLS} symbols")
            self.symbols[name] = r
            self.graph.symbols[name] = r
            if computed and self.sizes:
                # a reading at probe sizes keeps the declared bound of a count (ir/graph.py)
                self.graph.count_bounds[name] = hi
        return self.symbols[name]

    def placement(self, t: Tree | None, ttype: TensorType, what: str) -> NdSbp | None:
        if t is None:
            return None
        parts = []
        for p in t.children:
            if p.data == "split":
                axis = self.integer(p.children[0])
                if axis >= ttype.rank:
                    raise self.fail(
                        p,
                        f"S({axis}) splits axis {axis}, but {what} has rank {ttype.rank} ({ttype})",
                    )
                parts.append(Sbp("S", axis))
            else:
                parts.append(Sbp("B" if p.data == "broadcast" else "P"))
        if self.mesh is None:
            raise self.fail(
                t, f"a placement on {what} needs a mesh", hint="declare one first: mesh gpus[4]"
            )
        if len(parts) != self.mesh.ndim:
            raise self.fail(
                t,
                f"placement of {what} has {len(parts)} entr{'y' if len(parts) == 1 else 'ies'}, "
                f"but mesh {self.mesh} has {self.mesh.ndim} axes",
                hint="give one S(i), B or P per mesh axis, in parentheses for several",
            )
        sbp = NdSbp(tuple(parts))
        if not fits(ttype.shape, sbp, self.mesh):
            axis = next(
                d for d in range(ttype.rank) if ttype.shape[d] % split_factor(sbp, self.mesh, d)
            )
            raise self.fail(
                t,
                f"{sbp} cuts axis {axis} of {what} ({ttype}) into "
                f"{split_factor(sbp, self.mesh, axis)} pieces, which does not divide "
                f"{ttype.shape[axis]}",
                hint="flowc splits only evenly: every device runs the same shapes",
            )
        return sbp

    def define(self, name: str, v: Value, where: Tree | Token) -> None:
        if name in self.scope:
            line, col = self.defined_at[name]
            raise self.fail(where, f"{name!r} is already defined (at line {line}, column {col})")
        self.scope[name] = v
        self.bound.add(v)
        self.defined_at[name] = _pos(where)

    def lookup(self, t: Tree) -> Value:
        name = self.name(t)
        v = self.scope.get(name)
        if v is None:
            close = difflib.get_close_matches(name, list(self.scope), n=3)
            raise self.fail(
                t,
                f"{name!r} is not defined",
                hint=("did you mean " + ", ".join(repr(c) for c in close) + "?") if close else None,
            )
        return v

    def number(self, t: Tree | Token) -> int | float | complex:
        if isinstance(t, Token):
            text = str(t)
            return self.integer(t) if text.lstrip("+-").isdigit() else float(text)
        kind = t.data
        if kind == "number":
            return self.number(t.children[0])
        if kind == "pos_inf":
            return float("inf")
        if kind == "neg_inf":
            return float("-inf")
        if kind == "nan":
            return float("nan")
        if kind == "complex":
            re_, im = (self.number(c) for c in t.children)
            return complex(re_.real, im.real)
        raise self.fail(t, "expected a number")

    def attr_value(self, t: Tree | Token) -> Any:
        if isinstance(t, Token) or t.data in ("number", "pos_inf", "neg_inf", "nan", "complex"):
            v = self.number(t)
            if isinstance(v, complex):
                # Attributes are ONNX's: ints, floats, strings, lists and tensors.
                raise self.fail(
                    t,
                    "an attribute cannot be a complex number",
                    hint="a complex constant is a tensor: tensor(c64[], complex(1, 2))",
                )
            return v
        if t.data == "string":
            return self.string(t.children[0])
        if t.data == "true":
            return 1
        if t.data == "false":
            return 0
        if t.data == "list":
            return [self.attr_value(c) for c in t.children if c is not None]
        if t.data == "tensor":
            ttype = self.tensor_type(t.children[0])
            return self.literal_array(t.children[1], ttype, t)
        raise self.fail(t, "expected an attribute value")

    def literal_array(self, t: Tree, ttype: TensorType, where: Tree) -> np.ndarray:
        values: list[Any] = (
            [t.data == "true"]
            if t.data in ("true", "false")
            else [
                c.data == "true"
                if isinstance(c, Tree) and c.data in ("true", "false")
                else self.number(c)
                for c in t.children
                if c is not None
            ]
        )
        if not (ttype.dtype.is_float or ttype.dtype.is_complex):
            for v in values:
                if isinstance(v, complex) or (isinstance(v, float) and not v.is_integer()):
                    raise self.fail(where, f"{v} is not a value of {ttype.dtype.short}")
        n = ttype.numel
        if len(values) != n and not (len(values) == 1 and n == 1):
            raise self.fail(where, f"{ttype} holds {n} element(s), but {len(values)} are given")
        try:
            # A float too big for the type is inf, as a cast would make it.
            with np.errstate(over="ignore"):
                a = np.array(values, dtype=ttype.dtype.np)
            # (reshape fails for a dimension NumPy cannot index: f32[0, 99999999999999999999])
            return a.reshape(ttype.shape)
        except (OverflowError, ValueError, TypeError) as e:
            raise self.fail(where, f"the values do not fit {ttype}: {e}") from None

    def temp(self) -> str:
        """A name for an unnamed intermediate; a later binding of the same name takes it
        over (see claim)."""
        self.counter += 1
        return self.graph.unique_name(f"_t{self.counter}")

    def claim(self, name: str, where: Tree | Token) -> None:
        """Free ``name`` for a binding: an unbound intermediate holding it is renamed."""
        if not self.graph.has_name(name):
            return
        holder = next(v for v in self.graph.values() if v.name == name)
        if holder in self.bound:
            raise self.fail(where, f"{name!r} is already defined")
        self.graph.rename(holder, self.temp())

    def new_constant(self, name: str, name_t: Tree, array: np.ndarray) -> Value:
        """A param or const named ``name``; an unbound intermediate holding the name gives it
        up. Added under a temporary name and renamed: Graph.add_constant would turn a taken
        name, or the empty name "", into another."""
        if name in self.scope:
            line, col = self.defined_at[name]
            raise self.fail(name_t, f"{name!r} is already defined (at line {line}, column {col})")
        self.claim(name, name_t)
        v = self.graph.add_constant(self.temp(), array)
        self.graph.rename(v, name)
        return v

    # -- declarations -----------------------------------------------------------------------

    def header(self, t: Tree) -> None:
        if t.data == "dim_decl":
            sym_t, lo_t, hi_t, at_t, computed_t = t.children
            if str(sym_t) in self.symbols:
                raise self.fail(t, f"symbol {str(sym_t)!r} is declared twice")
            self.declare_symbol(sym_t, lo_t, hi_t, at_t, t, computed=computed_t is not None)
        elif t.data == "mesh_decl":
            name_t, dims = t.children
            shape = tuple(self.integer(d.children[0]) for d in dims.children)
            problem = mesh_size_problem(shape)
            if problem is not None:
                raise self.fail(t, problem)
            if self.mesh is not None:
                raise self.fail(t, "the mesh is declared twice")
            self.mesh = Mesh(self.new_name(name_t), shape)
        elif t.data == "weights_decl":
            if self.weights_declared:
                raise self.fail(t, "the weights file is declared twice")
            self.weights_declared = True
            path = Path(self.string(t.children[0]))
            if self.weights_override is None:
                self.weights = Weights(path if path.is_absolute() else self.base_dir / path)

    def param(self, t: Tree) -> None:
        typed_t, init = t.children
        self.declare(typed_t, lambda name, ttype: self.initializer(init, name, ttype))

    def declare(self, typed_t: Tree, make: Callable[[str, TensorType], np.ndarray]) -> None:
        """A param or const: its name, type, data (from ``make``) and placement."""
        name_t, type_t, place_t = _parts(typed_t)
        name = self.new_name(name_t)
        ttype = self.tensor_type(_required(type_t))
        v = self.new_constant(name, name_t, make(name, ttype))
        v.sbp = self.placement(place_t, ttype, repr(name))
        self.define(name, v, name_t)

    def initializer(self, t: Tree, name: str, ttype: TensorType) -> np.ndarray:
        np_dtype = ttype.dtype.np
        if t.data == "init_load":
            self.loads = True
            key = self.string(t.children[0])
            if self.weights is None:
                raise self.fail(
                    t,
                    f"load({key!r}) needs a weights file",
                    hint='pass --weights FILE (.npz or .safetensors), or declare weights "FILE" '
                    "at the top of the program",
                )
            try:
                arrays = self.weights.arrays()
            except FlowcError as e:
                raise self.fail(t, e.message, e.hint) from None
            if key not in arrays:
                close = difflib.get_close_matches(key, list(arrays), n=3)
                raise self.fail(
                    t,
                    f"{self.weights.path} has no array named {key!r}",
                    hint=("did you mean " + ", ".join(repr(c) for c in close) + "?")
                    if close
                    else None,
                )
            a = np.asarray(arrays[key])
            if a.dtype.kind == "V" and a.dtype.itemsize == np_dtype.itemsize:
                # .npz keeps ml_dtypes arrays (bfloat16, float8) as raw bytes.
                a = a.view(np_dtype)
            if tuple(a.shape) != ttype.shape or a.dtype != np_dtype:
                found = f"{DType.from_numpy(a.dtype).short if _known(a.dtype) else a.dtype}{list(a.shape)}"
                raise self.fail(
                    t,
                    f"{key!r} in {self.weights.path} is {found}, but {name!r} is declared {ttype}",
                )
            return a
        if t.data == "init_fill":
            v = t.children[0]
            value: Any = (
                v.data == "true"
                if isinstance(v, Tree) and v.data in ("true", "false")
                else self.number(v)
            )
            try:
                return make_splat(value, ttype.shape, np_dtype)
            except (OverflowError, ValueError, TypeError) as e:
                raise self.fail(t, f"fill({value}) does not fit {ttype.dtype.short}: {e}") from None
        fn = str(t.children[0])
        args = (
            [self.attr_value(c) for c in t.children[1:] if c is not None]
            if t.data == "init_call"
            else []
        )
        if fn in ("zeros", "ones"):
            if args:
                raise self.fail(t, f"{fn} takes no arguments", hint=f"write {fn}, or {fn}()")
            try:
                return make_splat(0 if fn == "zeros" else 1, ttype.shape, np_dtype)
            except ValueError as e:  # a shape NumPy cannot index ("maximum allowed dimension")
                raise self.fail(t, f"{name!r} cannot be made: {e}") from None
        if fn in ("normal", "uniform"):
            if len(args) != 2 or not all(isinstance(a, (int, float)) for a in args):
                what = "mean, std" if fn == "normal" else "lo, hi"
                raise self.fail(t, f"{fn} takes two numbers ({what}), got {len(args)} argument(s)")
            if not ttype.dtype.is_float:
                raise self.fail(t, f"{fn}(...) makes floats, but {name!r} is {ttype}")
            # Seeded by the parameter's name: the same program gives the same weights.
            # (surrogatepass: a quoted name may hold a lone surrogate, "\ud800".)
            rng = np.random.default_rng(zlib.crc32(name.encode("utf-8", "surrogatepass")))
            if ttype.numel > MAX_RANDOM_PARAM_ELEMENTS:
                # random values are made in memory (in float64), unlike a fill's one element
                raise self.fail(
                    t,
                    f"{fn}(...) would make {ttype.numel} random values for {name!r} ({ttype}), "
                    f"more than the {MAX_RANDOM_PARAM_ELEMENTS} flowc generates",
                    hint="load such a parameter from a weights file, or use fill(...)",
                )
            try:
                if fn == "normal":
                    data = rng.normal(float(args[0]), float(args[1]), ttype.shape)
                else:
                    data = rng.uniform(float(args[0]), float(args[1]), ttype.shape)
                with np.errstate(over="ignore"):  # normal(0, 1e5) in f16: inf, as a cast
                    return np.asarray(data).astype(np_dtype)
            except (ValueError, OverflowError, MemoryError) as e:
                # normal(0, -1), uniform(-inf, inf), or more elements than memory holds
                raise self.fail(t, f"{fn}{tuple(args)} cannot make {ttype}: {e}") from None
        raise self.fail(
            t,
            f"unknown initializer {fn!r}",
            hint='initializers: zeros, ones, normal(mean, std), uniform(lo, hi), fill(v), load("name")',
        )

    def const(self, t: Tree) -> None:
        typed_t, lit = t.children
        self.declare(typed_t, lambda name, ttype: self.literal_array(lit, ttype, t))

    # -- expressions ------------------------------------------------------------------------

    def materialize(self, x: Value | Literal, like: Value | None, where: Tree) -> Value:
        if isinstance(x, Value):
            return x
        lt = like.type.dtype if like is not None else None
        if lt is not None and (lt.is_float or lt.is_complex or not x.is_float):
            dtype = lt.np
        elif x.is_complex:
            dtype = np.dtype(np.complex64)
        else:
            dtype = np.dtype(np.float32) if x.is_float else np.dtype(np.int64)
        try:
            with np.errstate(over="ignore"):  # 1e300 next to an f16 tensor: inf, as a cast
                array = np.array(x.value, dtype=dtype)
        except (OverflowError, ValueError, TypeError):
            # 300 for a u8 operand, 2**70 for i64, complex(1, 2) next to an f32 tensor
            raise self.fail(
                where, f"the literal {x} does not fit {DType.from_numpy(dtype).short}"
            ) from None
        return self.builder.constant(self.temp(), array)

    def emit(
        self,
        op: str,
        args: list[Value | Literal | None],
        attrs: dict[str, Any],
        where: Tree,
        n_out: int | None = None,
    ) -> list[Value]:
        opdef = get_op(op)
        # A literal takes the type of the data it meets: where(c, x, 0) types 0 like x, not
        # like the bool condition c.
        values = [a for a in args if isinstance(a, Value)]
        first = next((a for a in values if a.type.dtype is not DType.BOOL), None)
        first = first or (values[0] if values else None)
        like = first if opdef.family in _ELEMENTWISE_LITERAL_OPS else None
        ins = [None if a is None else self.materialize(a, like, where) for a in args]
        names = [self.temp() for _ in range(n_out or opdef.outputs[0])]
        try:
            outs = self.builder.emit(
                op, ins, attrs, name=names[0], output_names=names, num_outputs=n_out
            )
        except FlowcError as e:
            msg = e.message
            # The builder names the node; the program's position says more.
            raise self.fail(
                where, msg.split(": ", 1)[-1] if msg.startswith(op) else msg, e.hint
            ) from None
        except KeyError as e:
            # the op reads an attribute that has no default (all_gather's mesh, ...)
            raise self.fail(
                where,
                f"{opdef.dsl_name} needs the attribute {e}",
                hint=f"give it as a keyword: {opdef.dsl_name}(..., {e.args[0]}=...)",
            ) from None
        except (TypeError, ValueError, IndexError, ArithmeticError) as e:
            # An op's type inference assumes attributes of the kinds ONNX gives (an int
            # axis, a list of ints); a program can write anything (axis=[1, 2], perm="ab").
            wrong = attribute_kind_problem(op, attrs)
            if wrong is not None:
                raise self.fail(where, f"{opdef.dsl_name}: {wrong}") from None
            raise self.fail(
                where,
                f"{opdef.dsl_name} cannot take these inputs and attributes: {e}",
                hint="its attributes: " + (", ".join(sorted(known_attributes(op))) or "none"),
            ) from None
        for o in outs:
            if o.producer is not None:
                o.producer.stage = self.stage
        return outs

    def expr(self, t: Tree | Token) -> Value | Literal | None:
        if isinstance(t, Token) or t.data in ("number", "pos_inf", "neg_inf", "nan", "complex"):
            return Literal(self.number(t))
        kind = t.data
        if kind == "ref":
            return self.lookup(t.children[0])
        if kind == "omitted":
            return None
        if kind == "list_lit":
            return Literal([self.number(c) for c in t.children if c is not None])
        if kind in ("add", "sub", "mul", "div", "matmul"):
            a, b = (self.expr(c) for c in t.children)
            if isinstance(a, Literal) and isinstance(b, Literal) and kind != "matmul":
                try:
                    return _fold_literal(kind, a, b)
                except (ValueError, ArithmeticError, TypeError) as e:
                    raise self.fail(t, f"cannot compute {a} {_SYMBOL[kind]} {b}: {e}") from None
            if a is None or b is None:
                raise self.fail(t, "'_' (an omitted input) cannot be an operand")
            op = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "matmul": "MatMul"}[kind]
            like = a if isinstance(a, Value) else b if isinstance(b, Value) else None
            return self.emit(
                op, [self.materialize(a, like, t), self.materialize(b, like, t)], {}, t
            )[0]
        if kind == "neg":
            x = self.expr(t.children[0])
            if isinstance(x, Literal) and not isinstance(x.value, list):
                return Literal(-x.value)
            if x is None:
                raise self.fail(t, "'_' (an omitted input) cannot be negated")
            return self.emit("Neg", [x], {}, t)[0]
        if kind == "call":
            outs = self.call(t, None)
            if len(outs) != 1:
                raise self.fail(
                    t,
                    f"{self.op_of(t).dsl_name} gives {len(outs)} results here; bind them: a, b = ...",
                )
            return outs[0]
        raise self.fail(t, f"unexpected {kind}")

    def op_of(self, t: Tree) -> Any:
        fn_t = t.children[0]
        fn = str(fn_t)
        opdef = op_by_dsl_name(fn)
        if opdef is None:
            names = sorted(o.dsl_name for o in all_ops())
            close = difflib.get_close_matches(fn.lower(), names, n=3, cutoff=0.6)
            raise self.fail(
                fn_t,
                f"unknown op {fn!r}",
                hint=("did you mean " + ", ".join(close) + "?")
                if close
                else "`flowc ops` lists the ops; their DSL names are lowercase with underscores",
            )
        return opdef

    def call(self, t: Tree, n_out: int | None) -> list[Value]:
        opdef = self.op_of(t)
        args: list[Value | Literal | None] = []
        attrs: dict[str, Any] = {}
        for a in t.children[1:]:
            if a is None:
                continue
            if isinstance(a, Tree) and a.data == "kwarg":
                key = str(a.children[0])
                if key in attrs:
                    raise self.fail(a, f"attribute {key!r} is given twice")
                known = known_attributes(opdef.name)
                if key not in known:
                    close = difflib.get_close_matches(key, sorted(known), n=3)
                    raise self.fail(
                        a,
                        f"{opdef.dsl_name} has no attribute {key!r}",
                        hint=("did you mean " + ", ".join(close) + "?")
                        if close
                        else "its attributes: " + (", ".join(sorted(known)) or "none"),
                    )
                attrs[key] = self.attr_value(a.children[1])
            else:
                if attrs:
                    raise self.fail(a, "inputs come before attributes (name=value)")
                args.append(self.expr(a))
        given = attrs.get("num_outputs")
        if n_out is not None and isinstance(given, int) and given != n_out:
            names = ", ".join(chr(ord("a") + k) for k in range(min(given, 26)))
            raise self.fail(
                t,
                f"{opdef.dsl_name} gives {given} results (num_outputs={given}), but "
                f"{n_out} name{'s are' if n_out != 1 else ' is'} bound",
                hint=f"bind them all: {names} = {opdef.dsl_name}(...)",
            )
        return self.emit(opdef.name, args, attrs, t, n_out)

    # -- statements -------------------------------------------------------------------------

    def binding(self, t: Tree) -> None:
        *targets, rhs = t.children
        if isinstance(rhs, Tree) and rhs.data == "call":
            outs = self.call(rhs, len(targets))
        else:
            if len(targets) != 1:
                raise self.fail(t, f"{len(targets)} names, but the expression gives one result")
            v = self.expr(rhs)
            if v is None:
                raise self.fail(rhs, "'_' (an omitted input) cannot be bound")
            if isinstance(v, Literal):
                v = self.materialize(v, None, t)
            outs = [v]
        if len(outs) != len(targets):
            raise self.fail(
                t, f"{len(targets)} names, but the expression gives {len(outs)} results"
            )
        for target, v in zip(targets, outs, strict=True):
            name_t, type_t, place_t = _parts(target)
            name = self.new_name(name_t)
            if type_t is not None:
                want = self.tensor_type(type_t)
                if want != v.type.static():
                    raise self.fail(
                        target, f"{name!r} is declared {want}, but the expression gives {v.type}"
                    )
            if name in self.scope:
                line, col = self.defined_at[name]
                raise self.fail(
                    name_t, f"{name!r} is already defined (at line {line}, column {col})"
                )
            if v in self.bound:
                # A new name for an existing value (an input, a parameter, another binding).
                (v,) = self.emit("Identity", [v], {}, target)
            if v.name != name:
                self.claim(name, name_t)
                self.graph.rename(v, name)
            if place_t is not None:
                v.sbp = self.placement(place_t, v.type, repr(name))
            self.define(name, v, name_t)

    def state(self, t: Tree) -> None:
        """``state NAME = INIT [-> NEXT]``: input NAME is state the program keeps (Graph.state),
        its first value INIT, NEXT the output that is its next value (checked once the
        outputs are known)."""
        name_t, init, next_t = t.children
        name = self.name(name_t)
        v = self.scope.get(name)
        if v is None or v not in self.graph.inputs:
            raise self.fail(name_t, f"state {name!r} is not an input of the graph")
        if name in self.graph.state:
            raise self.fail(name_t, f"state {name!r} is declared twice")
        self.graph.params[name] = self.initializer(init, name, v.type)
        self.graph.state[name] = None if next_t is None else self.name(next_t)

    def train_block(self, t: Tree) -> dict[str, str]:
        """The train block as the command line's training options (Graph.train)."""
        out: dict[str, str] = {}
        for item in t.children:
            if not isinstance(item, Tree):
                continue
            key_t, value_t = item.children
            key = str(key_t)
            if key in out or (key == "schedule" and "lr_schedule" in out):
                raise self.fail(item, f"train: {key} is given twice")
            if key in ("loss", "optimizer", "schedule"):
                if not (isinstance(value_t, Tree) and value_t.data == "call"):
                    raise self.fail(item, f"train: {key} takes a call, e.g. {_TRAIN_EXAMPLES[key]}")
                fn = str(value_t.children[0])
                names, settings = [], []
                for a in value_t.children[1:]:
                    if a is None:
                        continue
                    if a.data == "kwarg":
                        k, v = str(a.children[0]), self.attr_value(a.children[1])
                        if key == "loss" and k in ("ignore_index", "label_smoothing"):
                            out[k] = _option_text(v)
                        else:
                            settings.append(f"{k}={_option_text(v)}")
                    elif key == "loss" and a.data == "ref":
                        names.append(self.name(a.children[0]))
                    else:
                        raise self.fail(
                            a,
                            f"train: {key}'s arguments are "
                            + ("value names" if key == "loss" else "name=value settings"),
                            hint=f"e.g. {_TRAIN_EXAMPLES[key]}",
                        )
                if key == "loss":
                    out[key] = f"{fn}:{','.join(names)}"
                else:
                    out["lr_schedule" if key == "schedule" else key] = (
                        f"{fn}:{','.join(settings)}" if settings else fn
                    )
            elif key in _TRAIN_SETTINGS:
                if isinstance(value_t, Tree) and value_t.data == "call":
                    raise self.fail(item, f"train: {key} takes a value, not a call")
                out[key] = _option_text(self.attr_value(value_t))
            else:
                raise self.fail(
                    item,
                    f"train: no setting {key!r}",
                    hint="loss, optimizer, schedule, " + ", ".join(sorted(_TRAIN_SETTINGS)),
                )
        return out

    def statement(self, t: Tree) -> None:
        kind = t.data
        if kind == "param_decl":
            self.param(t)
        elif kind == "state_decl":
            self.state(t)
        elif kind == "const_decl":
            self.const(t)
        elif kind == "binding":
            self.binding(t)
        elif kind == "stage_block":
            if self.stage is not None:
                raise self.fail(t, "stages do not nest")
            self.stage = self.integer(t.children[0])
            if self.stage >= MAX_MESH_DEVICES:
                # stage s runs on mesh axis 0's device s
                raise self.fail(
                    t.children[0],
                    f"stage {self.stage}: a pipeline has at most {MAX_MESH_DEVICES} stages, "
                    f"numbered from 0",
                )
            for s in t.children[1:]:
                if isinstance(s, Tree) and s.data == "return_stmt":
                    raise self.fail(s, "return belongs after the stages, not inside one")
                self.statement(s)
            self.stage = None
        else:
            raise self.fail(t, f"unexpected {kind}")

    def program(self, tree: Tree) -> Graph:
        items = [c for c in tree.children if isinstance(c, Tree)]
        at = next(k for k, c in enumerate(items) if c.data == "graph_def")
        for h in items[:at]:
            self.header(h)
        for extra in items[at + 1 :]:  # the train block
            self.graph.train = self.train_block(extra)
        g_t = items[at]
        name_t, ins_t, outs_t, *body = g_t.children
        self.graph.name = self.new_name(name_t)
        self.graph.mesh = self.mesh
        for typed_t in ins_t.children if ins_t is not None else []:
            n_t, type_t, place_t = _parts(typed_t)
            name = self.new_name(n_t)
            ttype = self.tensor_type(_required(type_t))
            if name in self.scope:
                raise self.fail(n_t, f"input {name!r} is declared twice")
            v = self.graph.add_input(name, ttype)
            v.sbp = self.placement(place_t, ttype, f"input {name!r}")
            self.define(name, v, n_t)
        declared = []
        for typed_t in outs_t.children if outs_t is not None else []:
            n_t, type_t, place_t = _parts(typed_t)
            ttype = self.tensor_type(_required(type_t))
            declared.append(
                (
                    self.new_name(n_t),
                    ttype,
                    self.placement(place_t, ttype, f"output {self.name(n_t)!r}"),
                )
            )
        ret: Tree | None = None
        for s in body:
            if s is None:
                continue
            if ret is not None:
                raise self.fail(s, "nothing may follow return")
            if s.data == "return_stmt":
                ret = s
                continue
            self.statement(s)
        if ret is None:
            raise self.fail(g_t, f"graph {self.graph.name!r} has no return statement")
        names = [c for c in ret.children if c is not None]
        if len(names) != len(declared):
            raise self.fail(
                ret, f"returns {len(names)} value(s), but the signature declares {len(declared)}"
            )
        outs = []
        for n_t, (oname, otype, osbp) in zip(names, declared, strict=True):
            v = self.lookup(n_t)
            if v.type.static() != otype:
                raise self.fail(
                    n_t, f"output {oname!r} is declared {otype}, but {self.name(n_t)!r} is {v.type}"
                )
            if v.name != oname:
                raise self.fail(
                    n_t,
                    f"the signature's output {oname!r} is returned as {self.name(n_t)!r}",
                    hint=f"bind the result to {oname!r}, or rename the output in the signature",
                )
            if osbp is not None:
                if v.sbp is not None and v.sbp != osbp:
                    raise self.fail(
                        n_t,
                        f"output {oname!r} is placed @ {osbp} in the signature, but @ {v.sbp} "
                        "where it is defined",
                        hint="give one placement, or the same in both places",
                    )
                v.sbp = osbp
            outs.append(v)
        self.graph.outputs = outs
        try:
            verify_graph(self.graph)
        except FlowcError as e:
            raise DslError(f"{self.src.path}: {e.message}", e.hint) from None
        return self.graph


# The train block's plain settings, as the command line's options spell them (--clip-norm ...).
_TRAIN_SETTINGS = frozenset(
    {"clip_norm", "accumulate", "freeze", "no_decay", "untie", "batch", "recompute", "mem_limit"}
)
_TRAIN_EXAMPLES = {
    "loss": "loss = cross_entropy(logits, labels, ignore_index=-100)",
    "optimizer": "optimizer = adamw(lr=0.001, weight_decay=0.01)",
    "schedule": "schedule = cosine(warmup=100, total=10000)",
}


def _option_text(v: Any) -> str:
    """A train block value as the command line writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def read_train_block(path: str | os.PathLike[str]) -> dict[str, str]:
    """A .flow program's train block (Graph.train), read without its weights."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise FlowcError(f"{p}: cannot read it ({e})") from None
    src = Source(str(p), text)
    tree = parse_tree(src)
    blocks = [c for c in tree.children if isinstance(c, Tree) and c.data == "train_def"]
    if not blocks:
        return {}
    return _Reader(src, None, p.parent).train_block(blocks[0])


@functools.cache
def known_attributes(op: str) -> frozenset[str]:
    """The attribute names an op takes: its registry defaults, and for ONNX ops every
    attribute of the ONNX schema (required ones have no default)."""
    import onnx.defs

    names = set(get_op(op).attrs)
    if onnx.defs.has(op):  # not FusedElementwise, the comm ops, ...
        names.update(onnx.defs.get_schema(op).attributes)
    if op == "FusedElementwise":
        names.add("program")
    return frozenset(names)


# What an attribute holds, by the type of its registry default or its ONNX schema type.
_KIND_OF_DEFAULT = {int: "int", float: "float", str: "string", tuple: "ints"}
_KIND_OF_SCHEMA = {
    "FLOAT": "float",
    "INT": "int",
    "STRING": "string",
    "TENSOR": "tensor",
    "FLOATS": "floats",
    "INTS": "ints",
    "STRINGS": "strings",
}
_KIND_TEXT = {
    "int": "an integer",
    "float": "a number",
    "string": "a string",
    "tensor": "a tensor(...)",
    "ints": "a list of integers",
    "floats": "a list of numbers",
    "strings": "a list of strings",
}


def _is_kind(v: Any, kind: str) -> bool:
    if kind in ("ints", "floats", "strings"):
        return isinstance(v, (list, tuple)) and all(_is_kind(x, kind[:-1]) for x in v)
    if kind == "int":
        return isinstance(v, (int, np.integer))
    if kind == "float":
        return isinstance(v, (int, float, np.integer, np.floating))
    if kind == "string":
        return isinstance(v, str)
    return isinstance(v, np.ndarray)


def attribute_kind_problem(op: str, attrs: Mapping[str, Any]) -> str | None:
    """Which attribute in ``attrs`` is not of the kind ``op`` takes (an integer, a list of
    integers, ...), said in words; None when each one is, or its kind is not known."""
    import onnx.defs

    defaults = get_op(op).attrs
    schema = onnx.defs.get_schema(op).attributes if onnx.defs.has(op) else {}
    for key, v in attrs.items():
        default = defaults.get(key)
        kind = _KIND_OF_DEFAULT.get(type(default))
        if isinstance(default, tuple) and not (default and _is_kind(default, "ints")):
            kind = None  # () or a tuple of floats: leave it to the schema
        if kind is None and key in schema:
            kind = _KIND_OF_SCHEMA.get(getattr(schema[key].type, "name", ""))
        if kind is None or _is_kind(v, kind):
            continue
        shown = "a tensor" if isinstance(v, np.ndarray) else repr(v)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        return f"attribute {key!r} takes {_KIND_TEXT[kind]}, got {shown}"
    return None


def _required(t: Tree | None) -> Tree:
    assert t is not None, "the grammar requires a type here"
    return t


def _parts(t: Tree) -> tuple[Tree, Tree | None, Tree | None]:
    """A typed name's (name, type, placement); the last two may be absent."""
    kids = list(t.children)
    name_t = kids[0]
    type_t = next((c for c in kids[1:] if isinstance(c, Tree) and c.data == "tensor_type"), None)
    place_t = next((c for c in kids[1:] if isinstance(c, Tree) and c.data == "placement"), None)
    return name_t, type_t, place_t


_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_FOLD = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


def _fold_literal(kind: str, a: Literal, b: Literal) -> Literal:
    """``2 * 3``, ``[1, 2] + 1``: computed now. Raises ValueError (lists that do not
    broadcast) or an ArithmeticError (an integer too big for a float)."""
    fn = _FOLD[kind]
    # Division by zero follows IEEE, as it would on tensors: 1 / 0 is inf, 0 / 0 is nan.
    with np.errstate(all="ignore"):
        if isinstance(a.value, list) or isinstance(b.value, list):
            return Literal(np.asarray(fn(np.array(a.value), np.array(b.value))).tolist())
        x, y = a.value, b.value
        if kind == "div" and y == 0:
            return Literal(np.divide(np.asarray(x), np.asarray(y)).item())
        return Literal(fn(x, y))


def _known(dtype: np.dtype) -> bool:
    try:
        DType.from_numpy(dtype)
        return True
    except (KeyError, ValueError):
        return False


def _pos(where: Tree | Token | None) -> tuple[int, int]:
    if isinstance(where, Token):
        return (where.line or 1, where.column or 1)
    if isinstance(where, Tree):
        meta = where.meta
        if not getattr(meta, "empty", True):
            return (meta.line, meta.column)
        for c in where.children:
            if isinstance(c, (Tree, Token)):
                p = _pos(c)
                if p != (1, 1):
                    return p
    return (1, 1)


def parse_program(
    text: str,
    path: str = "<program>",
    weights: str | os.PathLike[str] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> Graph:
    """Read a DSL program into a Graph (checked); ``weights`` overrides the program's own
    ``weights "FILE"`` for ``load(...)`` params. A program with symbolic dims is read with
    each symbol at its bound, or at the size ``sizes`` gives it; the graph's types are static
    (symbolic types come from reading it at several sizes: ir/fit_dims.py)."""
    src = Source(path, text)
    tree = parse_tree(src)
    reader = _Reader(
        src, Path(weights) if weights is not None else None, Path(base_dir or "."), sizes
    )
    try:
        graph = reader.program(tree)
    except RecursionError:
        raise src.error(1, 1, "the program nests too deeply") from None
    every = {**reader.symbols, **{k: r for k, r in graph.symbols.items() if r.computed}}
    if every and sizes is None:
        # symbolic types: the program read again at the fit's sizes (ir/fit_dims.py)
        graph = annotate_symbols(
            graph,
            every,
            lambda at: parse_program(text, path, weights, base_dir, at),
        )
    if weights is not None and not reader.loads:
        # Weights nobody reads are a mistake (another program meant, a load() forgotten),
        # not something to drop silently.
        raise DslError(
            f"{path}: weights {weights} are given, but the program loads no parameter",
            hint='leave out --weights, or declare the params it holds: param w: f32[...] = load("w")',
        )
    return graph


def load_program(
    path: str | os.PathLike[str],
    weights: str | os.PathLike[str] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> Graph:
    p = Path(path)
    if p.exists():  # a missing file keeps its own message below
        check_regular_file(p, "program", FlowcError)
    try:
        # utf-8-sig: an editor's byte order mark is not the program's first character
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FlowcError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlowcError(f"{p}: cannot read it ({e})") from None
    g = parse_program(text, str(p), weights, p.parent, sizes)
    g.meta = {"format": "flowc DSL", "file": p.name}
    return g
