"""Storage-only element types (float16, bfloat16, float8/6/4, 2- and 4-bit integers) in
generated code: runtime_cpp/flowc/narrow.h's conversions against ml_dtypes and ONNX's own
saturating casts, bit for bit, and the widen_types pass against onnxruntime."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from opcheck import run_onnxruntime

from flowc.compiler import compile_graph
from flowc.frontend.onnx import import_model
from flowc.harness.build import build, run
from flowc.ir.dtype import DType
from flowc.ops.registry import get_op
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

FLOAT8 = [DType.F8E4M3FN, DType.F8E4M3FNUZ, DType.F8E5M2, DType.F8E5M2FNUZ]
NARROW_FLOATS = [DType.F16, DType.BF16, *FLOAT8, DType.F4E2M1, DType.F8E8M0]
NARROW_INTS = [DType.I4, DType.U4, DType.I2, DType.U2]


def _sweep() -> np.ndarray:
    """float32 values that exercise every rounding path: specials, each format's limits and
    the midpoints between neighbours (ties to even), subnormals, random magnitudes."""
    rng = np.random.default_rng(7)
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38]
    for dt in [*NARROW_FLOATS, DType.F6E2M3, DType.F6E3M2]:
        if dt == DType.F8E8M0:
            continue
        info = ml_dtypes.finfo(dt.np)
        grid = np.arange(256 if dt.itemsize == 1 else 65536, dtype=np.uint32)
        if dt.itemsize == 1:
            grid = grid[grid < (1 << (info.bits))]
            f = grid.astype(np.uint8).view(dt.np).astype(np.float32)
        else:
            f = grid.astype(np.uint16).view(dt.np).astype(np.float32)
        f = np.unique(f[np.isfinite(f)])
        mids = (f[:-1].astype(np.float64) + f[1:]) / 2
        vals += [*f[:: max(1, len(f) // 300)], *mids[:: max(1, len(mids) // 300)]]
        vals += [float(info.max) * 1.01, -float(info.max) * 1.01, float(info.max) * 1.2]
    vals += list(rng.standard_normal(400) * 10.0 ** rng.integers(-9, 9, 400))
    with np.errstate(over="ignore"):  # bfloat16's max * 1.2 is infinity in float32: wanted
        return np.array(vals, np.float32)


def _model(nodes: list[onnx.NodeProto], inputs: list, outputs: list) -> onnx.ModelProto:
    m = helper.make_model(
        helper.make_graph(nodes, "narrow", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 25)],
    )
    m.ir_version = 11
    return m


def _build_and_run(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], tmp_path: Path, target: str = "host"
) -> dict[str, np.ndarray]:
    g = PassManager(COMPILE_PIPELINE).run(import_model(model))
    out = tmp_path / target
    compile_graph(g, out, poison=True)
    bdir = build(out, target, quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    if target != "host":
        return {}
    got, _ = run(out, feeds, target=target)
    return got


def _cast_model(n: int) -> tuple[onnx.ModelProto, list[tuple[str, DType, int]]]:
    """x (f32) cast to every narrow type (float8 with saturate on and off) and back; and every
    bit pattern of each 8-bit type read as float32."""
    nodes, outs, meta = [], [], []
    for dt in [*NARROW_FLOATS, *NARROW_INTS]:
        for sat in (1, 0) if dt in FLOAT8 or dt == DType.F8E8M0 else (1,):
            name = f"to_{dt}_{sat}"
            nodes.append(helper.make_node("Cast", ["x"], [name], to=dt.onnx, saturate=sat))
            outs.append(helper.make_tensor_value_info(name, dt.onnx, [n]))
            meta.append((name, dt, sat))
    for dt in [*FLOAT8, DType.F4E2M1, DType.F8E8M0]:
        name = f"bits_{dt}"
        nodes.append(helper.make_node("Cast", [f"p_{dt}"], [name], to=TensorProto.FLOAT))
        outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [256]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])]
    inputs += [
        helper.make_tensor_value_info(f"p_{dt}", dt.onnx, [256])
        for dt in [*FLOAT8, DType.F4E2M1, DType.F8E8M0]
    ]
    return _model(nodes, inputs, outs), meta


def _patterns(dt: DType) -> np.ndarray:
    bits = np.arange(256, dtype=np.uint8)
    if dt == DType.F4E2M1:
        bits = bits & 0xF
    return bits.view(dt.np)


def test_casts_match_ml_dtypes_and_onnx_bit_for_bit(tmp_path: Path) -> None:
    from flowc.ops.elementwise import _cast_to

    x = _sweep()
    model, meta = _cast_model(len(x))
    feeds = {"x": x, **{f"p_{dt}": _patterns(dt) for dt in [*FLOAT8, DType.F4E2M1, DType.F8E8M0]}}
    got = _build_and_run(model, feeds, tmp_path)
    for name, dt, sat in meta:
        want = _cast_to(x, dt, sat)
        assert got[name].dtype == want.dtype, name
        gb, wb = (
            got[name].view(np.uint8 if dt.itemsize == 1 else np.uint16),
            want.view(np.uint8 if dt.itemsize == 1 else np.uint16),
        )
        if dt.is_float:
            # Any NaN is a NaN: compare the rest bit for bit.
            nan = np.isnan(want.astype(np.float32))
            assert np.array_equal(np.isnan(got[name].astype(np.float32)), nan), name
            gb, wb = gb[~nan], wb[~nan]
        bad = np.flatnonzero(gb != wb)
        assert bad.size == 0, (
            f"{name}: {bad.size} values differ, e.g. x={x[~nan][bad[:5]] if dt.is_float else x[bad[:5]]}"
            f" -> {gb[bad[:5]]} want {wb[bad[:5]]}"
        )
    for dt in [*FLOAT8, DType.F4E2M1, DType.F8E8M0]:
        want = _patterns(dt).astype(np.float32)
        np.testing.assert_array_equal(got[f"bits_{dt}"], want, err_msg=str(dt))


def _f16_graph() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8)).astype(np.float16)
    w = rng.standard_normal((8, 6)).astype(np.float16)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Relu", ["mm"], ["r"]),
        helper.make_node("Softmax", ["r"], ["sm"], axis=-1),
        helper.make_node("Transpose", ["sm"], ["t"], perm=[1, 0]),
        helper.make_node("ReduceSum", ["t", "axes"], ["s"], keepdims=1),
        helper.make_node("Add", ["x", "x"], ["xx"]),
        helper.make_node("Cast", ["xx"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["xb"], ["y_bf"], to=TensorProto.FLOAT),
    ]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 8])],
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT16, [6, 1]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT16, [6, 4]),
            helper.make_tensor_value_info("y_bf", TensorProto.FLOAT, [4, 8]),
        ],
    )
    m.graph.initializer.extend([axes, onnx.numpy_helper.from_array(w, "w")])
    m.opset_import[0].version = 21
    m.ir_version = 10
    return m, {"x": x}


def test_float16_graph_runs_in_float32_on_the_host(tmp_path: Path) -> None:
    model, feeds = _f16_graph()
    g = PassManager(COMPILE_PIPELINE).run(import_model(model))
    # Kernels never see float16: casts up front, casts back, f32 in between -- except the ops
    # that compute it themselves (OpDef.narrow: GEMMs on tensor cores, fp32 accumulation).
    for node in g.nodes:
        if node.op not in ("Cast", "FusedElementwise") and not get_op(node.op).narrow:
            assert all(v is None or not v.type.dtype.storage_only for v in node.inputs), node
    ref = run_onnxruntime(model, feeds)
    got = _build_and_run(model, feeds, tmp_path)
    for name, r in ref.items():
        assert got[name].dtype == r.dtype, name
        np.testing.assert_allclose(
            got[name].astype(np.float32), r.astype(np.float32), rtol=2e-3, atol=2e-3
        )


def test_narrow_types_cuda_build_compiles(tmp_path: Path) -> None:
    from test_runtime import CUDA

    missing = CUDA.missing(["cublasLt"])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} here: the CUDA build is not checked")
    model, _ = _cast_model(16)
    _build_and_run(model, {}, tmp_path, target="cuda")
    f16, _ = _f16_graph()
    _build_and_run(f16, {}, tmp_path / "f16", target="cuda")
