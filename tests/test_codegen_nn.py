"""MatMul/Gemm, convolution, pooling and normalization kernels in the compiled host build,
against onnxruntime: one build per op family (all of a family's cases in one program)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from opcheck import Case, check_compiled

from flowc.compiler import compile_graph
from flowc.frontend.onnx import import_model
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

RNG = np.random.default_rng(11)


def rand(*shape: int, lo: float = -1.0, hi: float = 1.0, dtype: type = np.float32) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(dtype)


def ints(*shape: int, dtype: type = np.int64) -> np.ndarray:
    return RNG.integers(-5, 6, shape).astype(dtype)


def test_matmul_gemm_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cases = [
        Case("MatMul", [rand(5, 7), rand(7, 3)]),
        Case("MatMul", [rand(33, 65), rand(65, 17)]),
        # Batched: both operands batched, one broadcast (folded into M / stride 0), partial
        # broadcasting on several axes (a loop of strided calls).
        Case("MatMul", [rand(2, 3, 5, 7), rand(2, 3, 7, 4)]),
        Case("MatMul", [rand(2, 3, 5, 7), rand(7, 4)]),
        Case("MatMul", [rand(5, 7), rand(2, 3, 7, 4)]),
        Case("MatMul", [rand(2, 1, 5, 7), rand(3, 7, 4)]),
        Case("MatMul", [rand(3, 1, 5, 7), rand(1, 2, 7, 4)]),
        Case("MatMul", [rand(2, 3, 1, 5, 7), rand(1, 3, 4, 7, 6)]),
        # 1-D operands.
        Case("MatMul", [rand(7), rand(7, 3)]),
        Case("MatMul", [rand(4, 5, 7), rand(7)]),
        Case("MatMul", [rand(7), rand(7)]),
        Case("MatMul", [rand(7), rand(2, 7, 3)]),
        # Types the GEMM wrapper does not compute: the direct kernel.
        Case("MatMul", [rand(2, 33, 5, dtype=np.float64), rand(5, 17, dtype=np.float64)]),
        Case("MatMul", [ints(2, 3, 4, dtype=np.int32), ints(4, 5, dtype=np.int32)]),
        Case("MatMul", [ints(3, 4), ints(2, 1, 4, 5)]),
        Case("MatMul", [ints(4), ints(3, 4, 2)]),
        # Gemm: transposes, alpha/beta, C broadcast from every shape, C dropped by beta = 0.
        Case("Gemm", [rand(5, 7), rand(7, 3)]),
        Case("Gemm", [rand(7, 5), rand(7, 3), rand(3)], {"transA": 1}),
        Case("Gemm", [rand(5, 7), rand(3, 7), rand(5, 1)], {"transB": 1, "beta": -1.5}),
        Case(
            "Gemm",
            [rand(7, 5), rand(3, 7), rand(5, 3)],
            {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
        ),
        Case("Gemm", [rand(5, 7), rand(7, 3), rand(1, 1)], {"alpha": 3.0}),
        Case("Gemm", [rand(5, 7), rand(7, 3), np.float32(0.25)]),
        Case("Gemm", [rand(5, 7), rand(7, 3), rand(5, 3)], {"beta": 0.0}),
        Case("Gemm", [rand(40, 70), rand(70, 30), rand(30)], const_inputs=(1, 2)),
        Case(
            "Gemm",
            [rand(7, 5, dtype=np.float64), rand(3, 7, dtype=np.float64), rand(3, dtype=np.float64)],
            {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
        ),
    ]
    check_compiled(cases, tmp_path)


def test_conv_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = rand(2, 3, 9, 11)
    cases = [
        # 2-D through the conv wrapper: bias, groups, depthwise, strides, dilations.
        Case("Conv", [x, rand(4, 3, 3, 3), rand(4)]),
        Case("Conv", [x, rand(4, 3, 3, 3), rand(4)], const_inputs=(1, 2)),
        Case(
            "Conv",
            [rand(1, 4, 9, 11), rand(6, 2, 3, 2), rand(6)],
            {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 0], "dilations": [1, 2]},
        ),
        Case("Conv", [rand(1, 4, 9, 11), rand(4, 1, 3, 3)], {"group": 4, "pads": [1, 1, 1, 1]}),
        Case("Conv", [x, rand(5, 3, 1, 1)]),
        # Uneven pads whose extra end pad no window reaches: still the wrapper.
        Case(
            "Conv", [rand(1, 3, 9, 9), rand(5, 3, 3, 3)], {"pads": [1, 1, 2, 2], "strides": [2, 2]}
        ),
        # Asymmetric pads and SAME_* with an odd total: the direct kernel.
        Case("Conv", [rand(1, 3, 9, 11), rand(5, 3, 3, 3), rand(5)], {"pads": [0, 1, 2, 1]}),
        Case(
            "Conv",
            [rand(1, 3, 10, 10), rand(5, 3, 3, 3)],
            {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        ),
        Case(
            "Conv",
            [rand(1, 6, 8, 7), rand(6, 1, 3, 2), rand(6)],
            {"group": 6, "auto_pad": "SAME_LOWER"},
        ),
        # 1-D (as a 2-D of height 1 through the wrapper, or direct) and 3-D (direct).
        Case("Conv", [rand(2, 3, 13), rand(4, 3, 3), rand(4)], {"pads": [1, 1], "strides": [2]}),
        Case(
            "Conv", [rand(2, 4, 13), rand(4, 2, 3)], {"pads": [2, 0], "group": 2, "dilations": [2]}
        ),
        Case(
            "Conv",
            [rand(1, 2, 5, 6, 7), rand(3, 2, 2, 3, 2), rand(3)],
            {"pads": [1, 0, 1, 0, 1, 1], "strides": [1, 2, 2]},
        ),
        # ConvTranspose: strides, groups, pads, output_padding, output_shape, dilations.
        Case("ConvTranspose", [rand(1, 3, 5, 6), rand(3, 2, 3, 3), rand(2)]),
        Case(
            "ConvTranspose",
            [rand(2, 4, 5, 6), rand(4, 3, 3, 2), rand(6)],
            {"group": 2, "strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
        ),
        Case("ConvTranspose", [rand(1, 2, 7), rand(2, 3, 3)], {"strides": [2], "dilations": [2]}),
        Case(
            "ConvTranspose",
            [rand(1, 2, 3, 4, 3), rand(2, 2, 2, 2, 3)],
            {"strides": [2, 1, 2], "auto_pad": "SAME_UPPER"},
        ),
        Case(
            "ConvTranspose",
            [rand(1, 2, 4, 4), rand(2, 1, 3, 3)],
            {"strides": [2, 2], "output_shape": [9, 10]},
        ),
    ]
    check_compiled(cases, tmp_path)


def test_pool_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = rand(2, 3, 9, 11)
    cases = [
        Case("MaxPool", [x], {"kernel_shape": [3, 3]}),
        Case(
            "MaxPool",
            [x],
            {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]},
            num_outputs=2,
        ),
        Case(
            "MaxPool",
            [x],
            {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "storage_order": 1},
            num_outputs=2,
        ),
        Case(
            "MaxPool",
            [x],
            {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]},
            num_outputs=2,
        ),
        Case(
            "MaxPool",
            [rand(2, 3, 10)],
            {"kernel_shape": [3], "strides": [2], "auto_pad": "SAME_UPPER"},
            num_outputs=2,
        ),
        Case(
            "MaxPool",
            [rand(1, 2, 5, 6, 7)],
            {"kernel_shape": [2, 3, 2], "strides": [2, 1, 2]},
            num_outputs=2,
        ),
        Case(
            "MaxPool",
            [RNG.integers(-128, 128, (1, 2, 6, 7)).astype(np.int8)],
            {"kernel_shape": [2, 2], "pads": [1, 1, 0, 0]},
        ),
        Case(
            "MaxPool",
            [RNG.integers(0, 256, (1, 2, 6, 7)).astype(np.uint8)],
            {"kernel_shape": [3, 3], "strides": [2, 2]},
        ),
        Case("AveragePool", [x], {"kernel_shape": [3, 3]}),
        Case("AveragePool", [x], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
        Case(
            "AveragePool",
            [x],
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
        ),
        Case(
            "AveragePool",
            [x],
            {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [0, 1, 1, 0], "ceil_mode": 1},
        ),
        Case(
            "AveragePool",
            [x],
            {
                "kernel_shape": [3, 2],
                "strides": [2, 3],
                "pads": [0, 1, 1, 0],
                "ceil_mode": 1,
                "count_include_pad": 1,
            },
        ),
        Case(
            "AveragePool",
            [rand(2, 3, 10)],
            {"kernel_shape": [4], "strides": [3], "auto_pad": "SAME_LOWER", "count_include_pad": 1},
        ),
        Case(
            "AveragePool",
            [rand(1, 2, 5, 6, 7)],
            {"kernel_shape": [2, 2, 3], "pads": [1, 0, 1, 0, 1, 1]},
        ),
        Case(
            "AveragePool", [x], {"kernel_shape": [2, 2], "dilations": [2, 1], "pads": [1, 1, 0, 0]}
        ),
        Case("LpPool", [x], {"kernel_shape": [3, 3], "p": 2}),
        Case(
            "LpPool", [x], {"kernel_shape": [2, 3], "p": 3, "strides": [2, 2], "pads": [1, 1, 1, 1]}
        ),
        Case("LpPool", [rand(2, 3, 10)], {"kernel_shape": [3], "p": 1}),
        Case("GlobalAveragePool", [x]),
        Case("GlobalAveragePool", [rand(2, 3, 4, 3, 5)]),
        Case("GlobalMaxPool", [x]),
        Case("GlobalMaxPool", [rand(2, 5, 7)]),
        Case("GlobalLpPool", [x]),
        Case("GlobalLpPool", [rand(2, 3, 7)], {"p": 3}),
    ]
    check_compiled(cases, tmp_path)


def test_norm_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = rand(2, 3, 9, 11)

    def var(n: int) -> np.ndarray:
        return rand(n, lo=0.5, hi=2.0)

    cases = [
        Case("BatchNormalization", [x, rand(3), rand(3), rand(3), var(3)], {"epsilon": 1e-3}),
        Case("BatchNormalization", [rand(5, 7), rand(7), rand(7), rand(7), var(7)]),
        Case(
            "BatchNormalization",
            [rand(2, 4, 3, 2, 2), rand(4), rand(4), rand(4), var(4)],
            const_inputs=(1, 2, 3, 4),
        ),
        # Planes of a multiple of 4 elements (four at a time), and more planes than a grid's
        # y dimension holds (the blocks stride over them).
        Case("BatchNormalization", [rand(2, 3, 4, 6), rand(3), rand(3), rand(3), var(3)]),
        Case(
            "BatchNormalization",
            [rand(2, 33000, 1), rand(33000), rand(33000), rand(33000), var(33000)],
        ),
        # Rows shorter and longer than a block, Scale/B broadcast inside the normalized shape,
        # the optional Mean and InvStdDev outputs.
        Case("LayerNormalization", [rand(4, 7, 33), rand(33), rand(33)]),
        Case("LayerNormalization", [rand(3, 300) + 5, rand(300), rand(300)], num_outputs=3),
        Case(
            "LayerNormalization",
            [rand(4, 7, 33), rand(7, 33)],
            {"axis": 1, "epsilon": 1e-3},
            num_outputs=3,
        ),
        Case("LayerNormalization", [rand(2, 3, 4, 5), rand(1, 5), rand(4, 1)], {"axis": 2}),
        Case("LayerNormalization", [rand(6, 1000), rand(6, 1000)], {"axis": 0}),
        Case("InstanceNormalization", [x, rand(3), rand(3)]),
        Case("InstanceNormalization", [rand(2, 4, 50), rand(4), rand(4)], {"epsilon": 1e-2}),
        Case("GroupNormalization", [rand(2, 6, 5, 7), rand(6), rand(6)], {"num_groups": 3}),
        Case("GroupNormalization", [rand(2, 4, 9), rand(4), rand(4)], {"num_groups": 1}),
        Case(
            "GroupNormalization",
            [rand(1, 4, 3, 3), rand(4), rand(4)],
            {"num_groups": 4, "epsilon": 1e-3},
        ),
        Case("LRN", [x], {"size": 3}),
        Case("LRN", [rand(2, 7, 4, 5)], {"size": 5, "alpha": 0.01, "beta": 0.5, "bias": 2.0}),
        Case("LRN", [rand(2, 5, 1, 6)], {"size": 1}),
        Case("MeanVarianceNormalization", [x]),
        Case("MeanVarianceNormalization", [x], {"axes": [2, 3]}),
        Case("MeanVarianceNormalization", [rand(3, 4, 5)], {"axes": [1]}),
        Case("MeanVarianceNormalization", [rand(3, 4, 5)], {"axes": [0, 2]}),
        # Rows within a warp and wider than one (the cross-warp step), along an inner axis.
        Case("LpNormalization", [rand(3, 40)]),
        Case("LpNormalization", [rand(2, 300, 3)], {"axis": 1, "p": 1}),
    ]
    check_compiled(cases, tmp_path)


def test_float16_matmul_is_a_narrow_gemm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # float16 once had no MatMul kernel (a clear error); it is a tensor-core GEMM now
    # (OpDef.narrow), planned with the narrow type, with no casts around it.
    a = helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT16, [2, 3])
    b = helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT16, [3, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, [2, 4])
    node = helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")
    model = helper.make_model(
        helper.make_graph([node], "g", [a, b], [y]),
        opset_imports=[helper.make_opsetid("", 21)],
    )
    graph = PassManager(COMPILE_PIPELINE).run(import_model(model))
    assert [n.op for n in graph.nodes] == ["MatMul"]
    compile_graph(graph, tmp_path / "out")
    assert "DataType::kF16" in (tmp_path / "out" / "model.cu").read_text()
