"""ONNX conformance: run the node test cases of the installed ``onnx`` package through flowc.

The cases are materialized once into a cache (``$FLOWC_CACHE`` or ``~/.cache/flowc``, in
``onnx-node-<onnx version>/``: per case ``model.onnx`` and ``input_K.pb``/``output_K.pb``,
plus an ``index.json``), rebuilt when missing or stale. Each case is imported with its test
inputs' shapes, then either evaluated by flowc's NumPy reference (target ``ref``) or
compiled, built and run for the ``host`` target (several cases share one build; every
build's driver runs in its own process, and a group whose build or run fails is split until
the failure is down to one case). Outputs are compared like the ONNX backend tests do:
``np.testing.assert_allclose(actual, expected, rtol, atol)`` for floats, exact otherwise.

flowc specializes shapes at compile time. When an import fails because a node input must be
known at compile time (Reshape's shape, Reduce axes, Slice starts, ...) and that input is a
graph input, the runner binds it to its test value as a constant (an initializer in a copy
of the model): an ahead-of-time specialization like ``--shape``. Such cases are counted.

One idea: the ONNX node suite through flowc; kept whole because materializing, running
(ref, host batches, CUDA) and the results files share one case record and cache layout.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flowc.atomic_file import write_file_atomic
from flowc.errors import FlowcError, InputError

FORMAT = 1
TARGETS = ("ref", "host")
# Statuses of one case, in the order the summary shows them.
STATUSES = ("pass", "mismatch", "unsupported", "error")
# Largest integer input bound as a constant when no node input can be pinned down.
FREEZE_MAX_ELEMENTS = 64

# flowc claims an op type when at least this share of its cases passes on the host target.
CLAIM = 0.95

# Why cases fail, for every op type below CLAIM on the host: (category, what fails and why).
# tests/test_conformance.py requires an entry for each such op type and no stale ones.
_TENSORS_ONLY = "values other than tensors"
_DATA_SHAPES = "output shapes that depend on the data"
_RANDOM = "random numbers"
_ROUNDING = "the expected values' own rounding"
_SEQ = "sequence and optional values are not tensors; flowc's IR holds tensors only"
_STR = "string tensors are not supported"
GAPS: dict[str, tuple[str, str]] = {
    "Attention": (
        _ROUNDING,
        "the bfloat16/float16 cases' expected outputs were computed in NumPy in the narrow "
        "type step by step; flowc accumulates in float32 (as onnxruntime does) and differs by "
        "1-2 units in the last place, more than the cases' rtol of 1e-3",
    ),
    "DFT": (
        _ROUNDING,
        "the two inverse cases expect NumPy's float32 FFT roundoff (1.9e-7 where the exact "
        "value is 0) within an atol of 1e-7; flowc's result is exact there",
    ),
    "Bernoulli": (_RANDOM, "draws random numbers; the expected values come from NumPy's generator"),
    "Dropout": (
        _RANDOM,
        "training mode with ratio > 0 drops at random; flowc compiles inference and keeps "
        "every value (with a warning)",
    ),
    "ImageDecoder": (
        _DATA_SHAPES,
        "decoding JPEG/PNG/... needs an image codec, and the image's size comes from its bytes",
    ),
    "Equal": (_TENSORS_ONLY, "the two string cases: " + _STR),
    "LabelEncoder": (_TENSORS_ONLY, "every case maps strings: " + _STR),
    "RegexFullMatch": (_TENSORS_ONLY, _STR),
    "StringConcat": (_TENSORS_ONLY, _STR),
    "StringNormalizer": (_TENSORS_ONLY, _STR),
    "StringSplit": (_TENSORS_ONLY, _STR),
    "Identity": (_TENSORS_ONLY, "the sequence and optional cases: " + _SEQ),
    "If": (_TENSORS_ONLY, "the branches returning a sequence or an optional: " + _SEQ),
    "Loop": (_TENSORS_ONLY, "the loops carrying a sequence or an optional: " + _SEQ),
    "OptionalGetElement": (_TENSORS_ONLY, _SEQ),
    "OptionalHasElement": (_TENSORS_ONLY, _SEQ),
    "SequenceInsert": (_TENSORS_ONLY, _SEQ),
    "SequenceMap": (_TENSORS_ONLY, _SEQ),
    "SplitToSequence": (_TENSORS_ONLY, _SEQ),
}
CASE_TIMEOUT_S = 120


# -- the cache -------------------------------------------------------------------------------


@dataclass
class CaseInfo:
    name: str
    op: str  # the op type the case tests (expanded cases: the op they expand)
    rtol: float
    atol: float
    inputs: list[str]  # per data input: "tensor", "sequence", "optional" or "none"
    outputs: list[str]


def onnx_version() -> str:
    import onnx

    return str(onnx.__version__)


def cache_root() -> Path:
    base = os.environ.get("FLOWC_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "flowc"
    return root / f"onnx-node-{onnx_version()}"


def _snake(op: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", op).lower()


def _case_op(name: str, model: Any, ops_by_name: dict[str, str]) -> str:
    base = re.sub(r"_expanded(_ver\d+)?$", "", name)
    if base != name and base in ops_by_name:
        return ops_by_name[base]
    types = list(dict.fromkeys(n.op_type for n in model.graph.node))
    if len(types) == 1:
        return types[0]
    rest = name.removeprefix("test_")
    matching = [t for t in types if rest.startswith(_snake(t))]
    if matching:
        return max(matching, key=len)
    return types[0] if types else "(none)"


def _kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return "sequence"
    return "tensor"


def _to_tensor_proto(value: Any, name: str) -> Any:
    import onnx
    from onnx import numpy_helper

    if isinstance(value, onnx.TensorProto):
        t = onnx.TensorProto()
        t.CopyFrom(value)
        t.name = name
        return t
    return numpy_helper.from_array(np.asarray(value), name)


def _index_ok(root: Path) -> list[CaseInfo] | None:
    try:
        index = json.loads((root / "index.json").read_text())
    except (OSError, ValueError):
        return None
    if index.get("format") != FORMAT or index.get("onnx") != onnx_version():
        return None
    cases = [CaseInfo(**c) for c in index["cases"]]
    if not all((root / c.name / "model.onnx").is_file() for c in cases):
        return None
    return cases


def materialize(
    root: Path | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> tuple[Path, list[CaseInfo]]:
    """The cached cases (written when missing or stale); returns (root, cases)."""
    root = root or cache_root()
    cases = _index_ok(root)
    if cases is not None:
        return root, cases
    if progress:
        progress(f"collecting the ONNX {onnx_version()} node test cases into {root}")
    import warnings

    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        testcases = node.collect_testcases(None)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        ops_by_name: dict[str, str] = {}
        for tc in testcases:
            if "_expanded" not in tc.name:
                ops_by_name[tc.name] = _case_op(tc.name, tc.model, {})
        infos = []
        for tc in testcases:
            d = tmp / tc.name
            d.mkdir()
            assert tc.model is not None and tc.data_sets
            (d / "model.onnx").write_bytes(tc.model.SerializeToString())
            inputs, outputs = tc.data_sets[0]
            for prefix, values in (("input", inputs), ("output", outputs)):
                for k, v in enumerate(values):
                    if _kind(v) == "tensor":
                        t = _to_tensor_proto(v, f"{prefix}_{k}")
                        (d / f"{prefix}_{k}.pb").write_bytes(t.SerializeToString())
            infos.append(
                CaseInfo(
                    name=tc.name,
                    op=_case_op(tc.name, tc.model, ops_by_name),
                    rtol=float(tc.rtol),
                    atol=float(tc.atol),
                    inputs=[_kind(v) for v in inputs],
                    outputs=[_kind(v) for v in outputs],
                )
            )
        index = {"format": FORMAT, "onnx": onnx_version(), "cases": [asdict(c) for c in infos]}
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        # Several processes (test workers) may fill the cache at once: the first to finish
        # wins, the others keep its copy; a stale copy is moved aside before it is removed,
        # so no reader ever sees a half-deleted cache.
        if _index_ok(root) is None and root.exists():
            stale = root.with_name(f".{root.name}.stale.{os.getpid()}")
            os.replace(root, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, root)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            won = _index_ok(root)
            if won is None:
                raise
            return root, won
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root, infos


def select(cases: Sequence[CaseInfo], pattern: str | None) -> list[CaseInfo]:
    """Cases whose name matches ``pattern`` (a regular expression, searched)."""
    if pattern is None:
        return list(cases)
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise InputError(f"--filter {pattern!r}: not a regular expression ({e})") from None
    chosen = [c for c in cases if rx.search(c.name)]
    if not chosen:
        raise InputError(
            f"--filter {pattern!r} matches none of the {len(cases)} cases",
            hint="cases are named like test_add_bcast or test_reduce_sum_keepdims_example",
        )
    return chosen


# -- comparison ------------------------------------------------------------------------------


def _is_float(dt: np.dtype[Any]) -> bool:
    return dt.kind in "fc" or dt.name == "bfloat16" or dt.name.startswith(("float8", "float4"))


def compare_output(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """None when ``actual`` matches ``expected`` as the ONNX backend tests require (same
    dtype and shape; floats within ``assert_allclose(rtol, atol)``, the rest exact);
    otherwise what differs."""
    a, e = np.asarray(actual), np.asarray(expected)
    if a.dtype != e.dtype:
        return f"dtype {a.dtype} != expected {e.dtype}"
    if a.shape != e.shape:
        return f"shape {list(a.shape)} != expected {list(e.shape)}"
    if _is_float(e.dtype):
        wide = np.complex128 if e.dtype.kind == "c" else np.float64
        try:
            np.testing.assert_allclose(a.astype(wide), e.astype(wide), rtol=rtol, atol=atol)
        except AssertionError as err:
            lines = [s.strip() for s in str(err).strip().splitlines() if s.strip()]
            return "; ".join(lines[1:4]) or "values differ"
        return None
    if e.dtype.kind == "V":  # int4/uint4/int2...: compare the values
        a, e = a.astype(np.int64), e.astype(np.int64)
    if not np.array_equal(a, e):
        bad = int(np.count_nonzero(a != e)) if a.dtype.kind != "O" else -1
        return f"values differ ({bad} of {e.size} elements)" if bad >= 0 else "values differ"
    return None


# -- one case --------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    op: str
    status: str  # one of STATUSES
    message: str = ""
    folded: bool = False  # the whole graph folded to constants at compile time
    frozen: list[str] = field(default_factory=list)  # inputs bound to their test values
    seconds: float = 0.0


def load_case(root: Path, info: CaseInfo) -> tuple[Any, list[Any], list[Any]]:
    """The model and its data: numpy arrays for tensors, None for anything else."""
    import onnx
    from onnx import numpy_helper

    d = root / info.name
    model = onnx.load(str(d / "model.onnx"))

    def read(prefix: str, kinds: list[str]) -> list[Any]:
        values: list[Any] = []
        for k, kind in enumerate(kinds):
            if kind != "tensor":
                values.append(None)
                continue
            t = onnx.TensorProto()
            t.ParseFromString((d / f"{prefix}_{k}.pb").read_bytes())
            values.append(numpy_helper.to_array(t))
        return values

    return model, read("input", info.inputs), read("output", info.outputs)


@dataclass
class Prepared:
    """A case ready to run: its model (frozen inputs as initializers), feeds by input name,
    expected arrays by output name, and the graph after the pass pipeline."""

    model: Any
    feeds: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    frozen: list[str]
    graph: Any


class CaseFailure(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _freeze(model: Any, names: Iterable[str], values: dict[str, np.ndarray]) -> Any:
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = set(names)
    keep = [vi for vi in m.graph.input if vi.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    for n in sorted(names):
        m.graph.initializer.append(numpy_helper.from_array(values[n], n))
    return m


_COMPILE_TIME = re.compile(r"input (\d+)(?: \([^)]*\))? must be known at compile time")


def _needed_input(model: Any, message: str, candidates: set[str]) -> str | None:
    """The graph input a 'must be known at compile time' error is about, when a node that
    the message names reads it directly."""
    m = _COMPILE_TIME.search(message)
    if m is None:
        return None
    k = int(m.group(1))
    for node in model.graph.node:
        named = (node.name and node.name in message) or len(model.graph.node) == 1
        if named and k < len(node.input) and node.input[k] in candidates:
            return str(node.input[k])
    for node in model.graph.node:
        if k < len(node.input) and node.input[k] in candidates and node.op_type in message:
            return str(node.input[k])
    return None


def prepare(
    info: CaseInfo, model: Any, inputs: list[Any], outputs: list[Any], pipeline: Sequence[str]
) -> Prepared:
    """Bind the test inputs to the model's inputs, import (freezing inputs that must be
    known at compile time), and run ``pipeline``; CaseFailure when that is not possible."""
    from flowc.errors import UnsupportedOpError
    from flowc.frontend.onnx import ImportOptions, import_model
    from flowc.passes.manager import PassManager

    init_names = {t.name for t in model.graph.initializer}
    real = [vi.name for vi in model.graph.input if vi.name not in init_names]
    values = {n: v for n, v in zip(real, inputs, strict=False) if n}
    expected = {o.name: v for o, v in zip(model.graph.output, outputs, strict=False)}
    frozen: list[str] = []
    current = model
    while True:
        try:
            shapes = {
                n: tuple(v.shape) for n, v in values.items() if n not in frozen and v is not None
            }
            graph = import_model(current, ImportOptions(shapes=shapes))
            graph = PassManager(pipeline).run(graph)
            break
        except UnsupportedOpError as e:
            raise CaseFailure("unsupported", e.message) from None
        except FlowcError as e:
            if "must be known at compile time" not in e.message:
                raise CaseFailure("error", f"{type(e).__name__}: {e.message}") from None
            candidates = {n for n in values if n not in frozen and values[n] is not None}
            name = _needed_input(current, e.message, candidates)
            if name is not None:
                new = [name]
            else:
                new = [
                    n
                    for n in sorted(candidates)
                    if values[n].dtype.kind in "iu" and values[n].size <= FREEZE_MAX_ELEMENTS
                ]
            if not new:
                # Float scalars and vectors read as parameters (Resize scales, Range bounds).
                later = {i for n in current.graph.node for i in list(n.input)[1:]}
                new = [
                    n
                    for n in sorted(candidates)
                    if values[n].ndim == 0
                    or (
                        n in later and values[n].ndim == 1 and values[n].size <= FREEZE_MAX_ELEMENTS
                    )
                ]
            if not new:
                raise CaseFailure("error", f"{type(e).__name__}: {e.message}") from None
            frozen += new
            current = _freeze(model, frozen, values)
    missing = [k for k, kind in enumerate(info.inputs + info.outputs) if kind != "tensor"]
    if missing:
        kinds = sorted({kind for kind in info.inputs + info.outputs if kind != "tensor"})
        raise CaseFailure(
            "error", f"the test data holds {'/'.join(kinds)} values; flowc has tensors only"
        )
    feeds = {v.name: values[v.name] for v in graph.inputs}
    return Prepared(current, feeds, expected, frozen, graph)


def check_outputs(
    info: CaseInfo, got: dict[str, Any], expected: dict[str, np.ndarray]
) -> str | None:
    problems = []
    for name, e in expected.items():
        if name not in got:
            problems.append(f"{name}: not produced")
            continue
        msg = compare_output(got[name], e, info.rtol, info.atol)
        if msg:
            problems.append(f"{name}: {msg}")
    return "; ".join(problems) or None


def _timeout(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the case took more than {CASE_TIMEOUT_S} s")


def run_ref(root: Path, info: CaseInfo) -> Result:
    """One case through import and flowc's NumPy reference; never raises."""
    from flowc.interpreter import evaluate
    from flowc.passes.manager import DEFAULT_PIPELINE

    t0 = time.perf_counter()
    res = Result(info.name, info.op, "error")
    old = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        model, inputs, outputs = load_case(root, info)
        p = prepare(info, model, inputs, outputs, DEFAULT_PIPELINE)
        res.frozen = p.frozen
        res.folded = not p.graph.nodes
        got = evaluate(p.graph, p.feeds)
        msg = check_outputs(info, got, p.expected)
        res.status, res.message = ("mismatch", msg) if msg else ("pass", "")
    except CaseFailure as e:
        res.status, res.message = e.status, e.message
    except FlowcError as e:
        res.message = f"{type(e).__name__}: {e.message}"
    except Exception as e:
        res.message = f"{type(e).__name__}: {e}".strip()
        if os.environ.get("FLOWC_DEBUG"):
            res.message += "\n" + traceback.format_exc()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    res.message = _short(res.message)
    res.seconds = time.perf_counter() - t0
    return res


def _short(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the host target: cases side by side in shared builds -----------------------------------


@dataclass
class _HostCase:
    info: CaseInfo
    prepared: Prepared
    prefix: str


def _prefix_names(graph: Any, prefix: str) -> None:
    """Prefix every value and node name in ``graph`` and its subgraphs, in place. (onnx's
    compose.add_prefix misses subgraph reads of outer initializers.)"""

    def p(name: str) -> str:
        return prefix + name if name else name

    for vi in (*graph.input, *graph.output, *graph.value_info):
        vi.name = p(vi.name)
    for t in graph.initializer:
        t.name = p(t.name)
    for sp in graph.sparse_initializer:
        sp.values.name = p(sp.values.name)
        sp.indices.name = p(sp.indices.name)
    for n in graph.node:
        n.name = p(n.name)
        n.input[:] = [p(i) for i in n.input]
        n.output[:] = [p(o) for o in n.output]
        for a in n.attribute:
            if a.HasField("g"):
                _prefix_names(a.g, prefix)
            for sub in a.graphs:
                _prefix_names(sub, prefix)


def _merge(cases: Sequence[_HostCase]) -> Any:
    """One ONNX model holding every case's graph, values renamed by the case's prefix."""
    import onnx
    from onnx import helper

    graphs = []
    for c in cases:
        g0 = onnx.GraphProto()
        g0.CopyFrom(c.prepared.model.graph)
        _prefix_names(g0, c.prefix)
        graphs.append(g0)
    first = cases[0].prepared.model
    g = helper.make_graph(
        [n for gr in graphs for n in gr.node],
        "conformance",
        [i for gr in graphs for i in gr.input],
        [o for gr in graphs for o in gr.output],
        initializer=[t for gr in graphs for t in gr.initializer],
        value_info=[v for gr in graphs for v in gr.value_info],
    )
    g.sparse_initializer.extend(s for gr in graphs for s in gr.sparse_initializer)
    m = helper.make_model(g, opset_imports=list(first.opset_import))
    m.ir_version = max(c.prepared.model.ir_version for c in cases)
    assert isinstance(m, onnx.ModelProto)
    return m


def _host_group(workdir: str, group: list[_HostCase], build_jobs: int) -> dict[str, Result]:
    """Compile, build and run a group; splits it when any of that fails for the group as a
    whole, so a failure is charged to one case."""
    from flowc.compiler import compile_graph
    from flowc.frontend.onnx import ImportOptions, import_model
    from flowc.harness.build import build, run
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    results: dict[str, Result] = {}
    try:
        merged = _merge(group)
        shapes = {c.prefix + n: tuple(a.shape) for c in group for n, a in c.prepared.feeds.items()}
        graph = PassManager(COMPILE_PIPELINE).run(
            import_model(merged, ImportOptions(shapes=shapes))
        )
        project = Path(tempfile.mkdtemp(prefix="group-", dir=workdir))
        try:
            # A group is many unrelated cases side by side: one stream (no events, no
            # per-stream handles) checks the ops as well and builds and runs faster.
            compile_graph(graph, project, prefix="conformance", streams=1)
            build(project, "host", jobs=build_jobs, quick=True)
            feeds = {
                c.prefix + n: a
                for c in group
                for n, a in c.prepared.feeds.items()
                if c.prefix + n in {v.name for v in graph.inputs}
            }
            got, _ = run(project, feeds, target="host")
        finally:
            shutil.rmtree(project, ignore_errors=True)
    except Exception as e:
        if len(group) > 1:
            half = len(group) // 2
            results.update(_host_group(workdir, group[:half], build_jobs))
            results.update(_host_group(workdir, group[half:], build_jobs))
            return results
        c = group[0]
        msg = e.message if isinstance(e, FlowcError) else str(e)
        results[c.info.name] = Result(
            c.info.name,
            c.info.op,
            "error",
            _short(f"{type(e).__name__}: {msg}"),
            frozen=c.prepared.frozen,
        )
        return results
    for c in group:
        mine = {n: got[c.prefix + n] for n in c.prepared.expected if c.prefix + n in got}
        problem = check_outputs(c.info, mine, c.prepared.expected)
        results[c.info.name] = Result(
            c.info.name,
            c.info.op,
            "mismatch" if problem else "pass",
            _short(problem or ""),
            folded=not c.prepared.graph.nodes,
            frozen=c.prepared.frozen,
        )
    return results


def _host_prepare(root: Path, info: CaseInfo) -> tuple[Result | None, Any]:
    """Import one case for the host target: a failed Result, or (None, Prepared)."""
    from flowc.passes.manager import COMPILE_PIPELINE

    try:
        from flowc.compiler import generate_program

        model, inputs, outputs = load_case(root, info)
        p = prepare(info, model, inputs, outputs, COMPILE_PIPELINE)
        # Code generation on its own (cheap): a case it rejects never joins a build.
        generate_program(p.graph, prefix="conformance", streams=1)
        return None, p
    except CaseFailure as e:
        return Result(info.name, info.op, e.status, _short(e.message)), None
    except Exception as e:
        msg = e.message if isinstance(e, FlowcError) else str(e)
        return Result(info.name, info.op, "error", _short(f"{type(e).__name__}: {msg}")), None


def run_host_batch(root: Path, infos: list[CaseInfo], build_jobs: int = 1) -> list[Result]:
    """Prepare each case, then build the ones that imported as one group (split on
    failure); never raises."""
    t0 = time.perf_counter()
    out: list[Result] = []
    ready: list[_HostCase] = []
    for k, info in enumerate(infos):
        failed, prepared = _host_prepare(root, info)
        if failed is not None:
            out.append(failed)
        else:
            ready.append(_HostCase(info, prepared, f"c{k}_"))
    if ready:
        with tempfile.TemporaryDirectory(prefix="flowc-conformance-") as tmp:
            out += _host_group(tmp, ready, build_jobs).values()
    each = (time.perf_counter() - t0) / max(len(infos), 1)
    for r in out:
        r.seconds = each
    return out


def merge_graphs(graphs: Sequence[Any]) -> Any:
    """One IR graph holding every graph side by side, value names prefixed per graph (the
    graphs are consumed: their values move into the result)."""
    from flowc.ir.graph import Graph
    from flowc.ir.types import TensorType

    merged = Graph("conformance")
    for k, g in enumerate(graphs):
        # each graph's symbols (a data-dependent output's count) apart from the others'
        names = {s: f"c{k}_{s}" for s in g.symbols}
        merged.symbols.update({names[s]: r for s, r in g.symbols.items()})
        for v in g.values():
            v.name = merged.claim_name(f"c{k}_{v.name}")
            if v.type.sym is not None:
                sym = tuple(d.renamed(names) if d is not None else None for d in v.type.sym)
                v.type = TensorType(v.type.shape, v.type.dtype, sym)
        for n in g.nodes:
            n.name = f"c{k}_{n.name}"
        merged.inputs += g.inputs
        merged.constants += g.constants
        merged.nodes += g.nodes
        merged.outputs += [o for o in g.outputs if o not in merged.outputs]
    return merged


def cuda_build(root: Path, infos: Sequence[CaseInfo], out: Path, jobs: int = 2) -> Path:
    """Compile and link (not run) one CUDA program holding the compiled graphs of ``infos``:
    the check that every kernel flowc generates for them builds with nvcc. Raises on any
    case that does not compile for the host, and on a failed build."""
    from flowc.compiler import compile_graph
    from flowc.harness.build import build
    from flowc.passes.manager import COMPILE_PIPELINE

    graphs = []
    for info in infos:
        model, inputs, outputs = load_case(root, info)
        graphs.append(prepare(info, model, inputs, outputs, COMPILE_PIPELINE).graph)
    compile_graph(merge_graphs(graphs), out, prefix="conformance", streams=1)
    return build(out, "cuda", jobs=jobs, quick=True)


def _host_batches(infos: list[CaseInfo], root: Path, size: int) -> list[list[CaseInfo]]:
    """Cases that can share a model: same opset imports, grouped ``size`` at a time."""
    import onnx

    by_opset: dict[str, list[CaseInfo]] = {}
    for info in infos:
        m = onnx.load(str(root / info.name / "model.onnx"), load_external_data=False)
        key = ",".join(
            f"{o.domain}:{o.version}" for o in sorted(m.opset_import, key=lambda o: o.domain)
        )
        if m.functions:
            key += f"|{info.name}"  # local functions: alone
        by_opset.setdefault(key, []).append(info)
    batches = []
    for group in by_opset.values():
        for i in range(0, len(group), size):
            batches.append(group[i : i + size])
    return batches


# -- the run ---------------------------------------------------------------------------------


def _worker_init() -> None:
    import warnings

    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _ref_chunk(root: str, infos: list[CaseInfo]) -> list[Result]:
    return [run_ref(Path(root), i) for i in infos]


def run_cases(
    root: Path,
    infos: Sequence[CaseInfo],
    target: str,
    jobs: int = 1,
    on_result: Callable[[Result], None] | None = None,
    group_size: int = 120,
) -> list[Result]:
    """Run ``infos`` for ``target`` on ``jobs`` processes; results in ``infos`` order."""
    if target not in TARGETS:
        raise InputError(f"--target {target}: expected one of {', '.join(TARGETS)}")
    if target == "ref":
        chunks = [list(infos[i : i + 8]) for i in range(0, len(infos), 8)]
        work: list[tuple[Callable[..., list[Result]], tuple[Any, ...]]] = [
            (_ref_chunk, (str(root), c)) for c in chunks
        ]
    else:
        work = [
            (run_host_batch, (root, b, 1)) for b in _host_batches(list(infos), root, group_size)
        ]
    results: dict[str, Result] = {}

    def take(rs: list[Result]) -> None:
        for r in rs:
            results[r.name] = r
            if on_result:
                on_result(r)

    if jobs <= 1:
        _worker_init()
        for fn, args in work:
            take(fn(*args))
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=jobs, mp_context=ctx, initializer=_worker_init
        ) as pool:
            futures = {pool.submit(fn, *args): args for fn, args in work}
            try:
                done = concurrent.futures.as_completed(futures)
                for fut in done:
                    try:
                        take(fut.result())
                    except Exception as e:
                        batch = futures[fut][1]
                        take(
                            [
                                Result(i.name, i.op, "error", _short(f"{type(e).__name__}: {e}"))
                                for i in batch
                            ]
                        )
            except KeyboardInterrupt:
                # Ctrl-C sent to flowc alone: each worker is told too, so its build ends
                # its compilers (flowc/harness/processes.py) before the pool goes.
                for fut in futures:
                    fut.cancel()
                for proc in list(getattr(pool, "_processes", {}).values()):
                    if proc.is_alive() and proc.pid is not None:
                        os.kill(proc.pid, signal.SIGINT)
                raise
    return [results[i.name] for i in infos]


@dataclass
class Summary:
    total: int
    counts: dict[str, int]
    folded: int  # passes whose graph folded to constants
    frozen: int  # cases that needed inputs bound to constants

    @property
    def passed(self) -> int:
        return self.counts.get("pass", 0)


def summarize(results: Sequence[Result]) -> Summary:
    counts = Counter(r.status for r in results)
    return Summary(
        len(results),
        {s: counts.get(s, 0) for s in STATUSES},
        sum(1 for r in results if r.status == "pass" and r.folded),
        sum(1 for r in results if r.frozen),
    )


def failure_reason(r: Result) -> str:
    """A failure's reason, its message reduced to a category."""
    if r.status == "unsupported":
        m = re.findall(r"^\s*(\S+)", r.message.split(":", 1)[-1], re.M)
        return f"unsupported op {m[0].rstrip(':') if m else r.op}"
    if r.status == "mismatch":
        return f"mismatch ({r.op})"
    text = re.sub(
        r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\d+(\.\d+)?",
        "_",
        r.message.splitlines()[0] if r.message else "",
    )
    return f"{r.status}: {text[:100]}"


def failure_categories(results: Sequence[Result], top: int = 15) -> list[tuple[str, int]]:
    """The most common failure reasons, messages reduced to their first clause."""

    c = Counter(failure_reason(r) for r in results if r.status != "pass")
    return c.most_common(top)


def _write_text(path: Path, text: str) -> None:
    """Write through flowc.atomic_file: never half-written, never over a device or link."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, text.encode("utf-8"))


def write_results(path: Path, target: str, results: Sequence[Result], *, full: bool) -> None:
    data = {
        "onnx": onnx_version(),
        "target": target,
        "full": full,
        "results": [asdict(r) for r in results],
    }
    _write_text(path, json.dumps(data, indent=1))


def read_results(path: Path) -> list[Result] | None:
    """Full results of the installed onnx version saved at ``path``; None otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("onnx") != onnx_version() or not data.get("full"):
        return None
    return [Result(**r) for r in data["results"]]


# -- expected failures -----------------------------------------------------------------------


def read_expected_failures(path: Path) -> set[str]:
    """Case names, one per line; ``#`` starts a comment."""
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError(
            f"{path}: cannot read the expected-failure list ({e.strerror or e})"
        ) from None
    names = set()
    for line in text.splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.add(name)
    return names


def write_expected_failures(path: Path, target: str, results: Sequence[Result]) -> None:
    lines = [
        f"# ONNX {onnx_version()} node cases that fail on flowc's `{target}` target.",
        f"# Regenerate: flowc conformance --target {target} --update-expected {path.name}",
        "# CI fails when a case not listed here fails, and when a listed case passes.",
    ]
    for r in sorted(results, key=lambda r: r.name):
        if r.status != "pass":
            lines.append(f"{r.name}  # {failure_reason(r)[:100]}")
    _write_text(path, "\n".join(lines) + "\n")


def check_expected(
    expected: set[str], results: Sequence[Result], *, full: bool
) -> tuple[list[str], list[str]]:
    """(cases that fail but are not listed, listed cases that now pass). For a partial run,
    only the cases that ran are judged."""
    ran = {r.name for r in results}
    failed = {r.name for r in results if r.status != "pass"}
    new_failures = sorted(failed - expected)
    now_passing = sorted((expected & ran) - failed)
    if full:
        # A listed name that is no case at all is stale too.
        now_passing = sorted(set(now_passing) | (expected - ran))
    return new_failures, now_passing


# -- the support table -----------------------------------------------------------------------


def host_shortfalls(
    cases: Sequence[CaseInfo], host: Sequence[Result]
) -> dict[str, tuple[int, int]]:
    """Op types whose host pass rate is below CLAIM: op -> (passed, cases)."""
    passed = {r.name for r in host if r.status == "pass"}
    per: dict[str, list[str]] = {}
    for c in cases:
        per.setdefault(c.op, []).append(c.name)
    out = {}
    for op, names in per.items():
        ok = sum(1 for n in names if n in passed)
        if ok < CLAIM * len(names):
            out[op] = (ok, len(names))
    return out


def write_support_table(
    path: Path,
    cases: Sequence[CaseInfo],
    ref: Sequence[Result] | None,
    host: Sequence[Result] | None,
) -> None:
    _write_text(path, support_table(cases, ref, host))


def support_table(
    cases: Sequence[CaseInfo],
    ref: Sequence[Result] | None,
    host: Sequence[Result] | None,
) -> str:
    """docs/ONNX_SUPPORT.md: per op type, cases passed / total for ref and host."""
    total = len(cases)
    ops: dict[str, list[str]] = {}
    for c in cases:
        ops.setdefault(c.op, []).append(c.name)
    by = {
        t: ({r.name: r for r in rs} if rs is not None else None)
        for t, rs in (("ref", ref), ("host", host))
    }

    def overall(t: str) -> str:
        rs = by[t]
        if rs is None:
            return f"- {t}: not run"
        s = summarize(list(rs.values()))
        extra = f" ({s.folded} of them folded to constants at compile time)" if s.folded else ""
        return f"- {t}: {s.passed} / {total} passed{extra}"

    frozen = {r.name for rs in by.values() if rs for r in rs.values() if r.frozen}
    hs_all = by["host"]
    short = host_shortfalls(cases, list(hs_all.values())) if hs_all is not None else {}
    lines = [
        "# ONNX conformance",
        "",
        f"Generated by `flowc conformance --target ref|host --write-table` from the node test "
        f"cases of onnx {onnx_version()} ({total} cases). Do not edit by hand.",
        "",
        overall("ref"),
        overall("host"),
        *(
            [
                f"- op types: {len(ops)} in the suite, {len(ops) - len(short)} of them claimed "
                f"(at least {CLAIM:.0%} of their cases pass on the host); the others are listed "
                "at the end with the reason their cases fail"
            ]
            if hs_all is not None
            else []
        ),
        "",
        "A case passes when every output matches the expected one as the ONNX backend tests "
        "require: `np.testing.assert_allclose(actual, expected, rtol, atol)` with the case's "
        "tolerances for floating-point outputs, exact equality otherwise, same dtype and shape.",
        "",
        "flowc compiles ahead of time for fixed shapes, so every case is imported with its "
        "test inputs' shapes (like `--shape`). Where a node needs an input's value at compile "
        "time (Reshape's shape, Reduce axes, Slice starts, Resize sizes, ...) and the "
        "case feeds it as a graph input, the runner binds that input to its test value as a "
        f"constant: {len(frozen)} cases needed that. *folded* counts host passes whose whole "
        "graph folded to constants at compile time (no kernel ran).",
        "",
        "How flowc covers an op type: a kernel of its own (`flowc ops` lists them); an import "
        "lowering to other ops (RNN/GRU/LSTM unrolled over the static sequence length, DFT and "
        "antialiased Resize as constant matrix products, the integer matmul/conv forms); the "
        "op's ONNX function body, imported in its place when flowc has no kernel "
        "(RMSNormalization, SoftmaxCrossEntropyLoss, Attention, ...); or, for If/Loop/Scan, "
        "resolution at import (a known condition picks a branch, a run-time one selects with "
        "Where; loops and scans unroll). float16, bfloat16, float8/6/4 and int4/int2 tensors "
        "are stored as such and computed in float32/int32.",
        "",
        f"*status*: **supported** when at least {CLAIM:.0%} of the op type's cases pass on "
        "the host target, which is what flowc claims; otherwise the reason its cases fail.",
        "",
        "| op | cases | ref | host | host folded | status |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for op in sorted(ops, key=str.lower):
        names = ops[op]
        cells = []
        for t in ("ref", "host"):
            rs = by[t]
            if rs is None:
                cells.append("not run")
            else:
                cells.append(str(sum(1 for n in names if n in rs and rs[n].status == "pass")))
        hs = by["host"]
        folded = (
            str(sum(1 for n in names if n in hs and hs[n].status == "pass" and hs[n].folded))
            if hs is not None
            else ""
        )
        if hs is None:
            status = ""
        elif op not in short:
            status = "supported"
        else:
            status = GAPS[op][1] if op in GAPS else "(no reason recorded)"
        lines.append(f"| {op} | {len(names)} | {cells[0]} | {cells[1]} | {folded} | {status} |")
    if hs is not None and short:
        lines += ["", "## Op types flowc does not claim, by reason", ""]
        by_reason: dict[str, list[str]] = {}
        for op in short:
            by_reason.setdefault(GAPS[op][0] if op in GAPS else "unexplained", []).append(op)
        for reason in sorted(by_reason):
            ops_text = ", ".join(
                f"{op} ({short[op][0]}/{short[op][1]})"
                for op in sorted(by_reason[reason], key=str.lower)
            )
            lines.append(f"- **{reason}**: {ops_text}")
    return "\n".join(lines) + "\n"
