"""Narrow types on a mesh: a bf16/fp16 partial sum is held in float32 until its reduction
and rounded once after it (docs/parallel.md, "Narrow types on a mesh"), so every rank
computes what one device computes; checked in the multi-rank simulator against the
one-device NumPy reference of the same narrow graph."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_MODELS

from flowc.compiler import load_model, place, simulate_ranks
from flowc.errors import FlowcWarning
from flowc.interpreter import evaluate, random_inputs
from flowc.ir.dtype import DType
from flowc.ir.types import NdSbp, Sbp
from flowc.options import ModelArgs
from flowc.parallel import ParallelOptions, parse_mesh
from flowc.parallel.cost import boxing_time, load_profile

REDUCING = ("AllReduce", "ReduceScatter")


def megatron_mlp(precision: str, mesh: str, gather: bool = False) -> tuple[object, object]:
    """mlp with its first projection's columns and second projection's rows split on the
    last mesh axis: the second GEMM (with a bias) leaves partial sums. ``gather``: the
    second projection whole instead, so the hidden activation is all-gathered."""
    short = DType.BF16.short if precision == "bf16" else DType.F16.short
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        g = load_model(ModelArgs(SHARED_MODELS / "mlp.onnx"), precision=precision)
    m = parse_mesh(mesh)
    last = m.ndim - 1

    def on_last(axis: int) -> NdSbp:
        return NdSbp(tuple(Sbp("S", axis) if a == last else Sbp("B") for a in range(m.ndim)))

    fixed = {f"m.0.weight.{short}": on_last(0), f"m.2.weight.{short}": on_last(1)}
    if gather:
        whole = NdSbp((Sbp("B"),) * m.ndim)
        fixed = {
            f"m.0.weight.{short}": on_last(0),
            f"m.2.weight.{short}": whole,
            "/m/m.1/Relu_output_0": on_last(1),
        }
    return g, place(g, ParallelOptions(m, "auto", fixed))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("mesh", ["2", "4", "2x2"])
def test_a_narrow_partial_sum_is_reduced_in_float32(precision: str, mesh: str) -> None:
    g, result = megatron_mlp(precision, mesh)
    narrow = DType.BF16 if precision == "bf16" else DType.F16
    phys = result.physical.graph  # type: ignore[attr-defined]
    reductions = [n for n in phys.nodes if n.op in REDUCING]
    assert reductions, "the plan leaves no partial sum to reduce"
    for n in reductions:
        assert n.inputs[0].type.dtype == DType.F32, f"{n.op} reduces {n.inputs[0].type}"
    # The bias is P (one rank adds it): its shard is stored widened, the narrow one dropped.
    names = {c.name for c in phys.constants}
    assert f"m.2.weight.{narrow.short}/f32" in names
    assert f"m.2.weight.{narrow.short}" not in names
    feeds = random_inputs(g, seed=4)
    ref = evaluate(g, feeds)
    got = simulate_ranks(result, feeds)  # type: ignore[arg-type]
    for (name, r), x in zip(ref.items(), got, strict=True):
        # One rounding after the sum, as on one device: equal up to float32 summation order.
        np.testing.assert_allclose(x, r, rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_narrow_partial_sum_is_priced_at_float32_bytes() -> None:
    from flowc.ir.types import Mesh, TensorType

    profile = load_profile()
    mesh = Mesh("m", (4,))
    p, b = NdSbp((Sbp("P"),)), NdSbp((Sbp("B"),))
    shape = (1024, 1024)
    f32 = boxing_time(TensorType(shape, DType.F32), mesh, p, b, profile)
    bf16 = boxing_time(TensorType(shape, DType.BF16), mesh, p, b, profile)
    gather_f32 = boxing_time(TensorType(shape, DType.F32), mesh, NdSbp((Sbp("S", 0),)), b, profile)
    gather_bf16 = boxing_time(
        TensorType(shape, DType.BF16), mesh, NdSbp((Sbp("S", 0),)), b, profile
    )
    assert bf16 == f32  # the all-reduce moves float32
    assert gather_bf16 < gather_f32  # an all-gather moves the narrow bytes


@pytest.mark.parametrize(
    ("gather", "collective", "nbytes", "dtype"),
    [(False, "all-reduce", 8 * 10 * 4, 1), (True, "all-gather", 8 * 128 * 2, 16)],
    ids=["partial-sum-in-float32", "activation-in-bf16"],
)
def test_the_host_program_moves_what_the_rule_says(
    gather: bool, collective: str, nbytes: int, dtype: int, tmp_path: Path
) -> None:
    """The generated rank programs on two host ranks: a partial sum is all-reduced as
    float32 (ONNX type 1, 4 bytes an element), a bf16 activation is all-gathered as bf16
    (type 16, 2 bytes): the communication log of each rank names the bytes and the type;
    and the outputs match onnxruntime within bf16's tolerance."""
    import onnx

    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run
    from flowc.harness.ort import inference_mode, run_onnxruntime

    g, result = megatron_mlp("bf16", "2", gather)
    out = tmp_path / "out"
    compile_graph(
        result.physical.graph,  # type: ignore[attr-defined]
        out,
        prefix="mlp",
        physical=result.physical,  # type: ignore[attr-defined]
        precision="bf16",
    )
    build(out, "host", quick=True)
    feeds = random_inputs(g, seed=5)
    got, _ = run(out, feeds, target="host", env={"FLOWC_COMM_LOG": str(tmp_path / "comm")})
    ref = run_onnxruntime(inference_mode(onnx.load(str(SHARED_MODELS / "mlp.onnx"))), feeds)
    for name, r in ref.items():
        err = np.abs(got[name] - r).max() / np.abs(r).max()
        assert err < 5e-2, f"{name}: {err}"
    lines = [ln for p in sorted(tmp_path.glob("comm.rank*")) for ln in p.read_text().splitlines()]
    moved = [ln for ln in lines if ln.startswith(collective)]
    assert len(moved) == 2, lines  # one per rank
    # The bytes of a rank's send buffer: the [8, 10] partial sum, or its [8, 128] half of
    # the [8, 256] activation.
    assert all(ln.endswith(f"bytes={nbytes} dtype={dtype}") for ln in moved), moved
