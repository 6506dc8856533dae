"""DeformConv: flowc's NumPy reference against onnxruntime (2-D, the only rank it runs), 1-D
through its 2-D embedding, 3-D against a scalar loop written from the specification, the
shape errors, and the kernel in host builds (2-D against onnxruntime, 1-D and 3-D against the
reference)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from opcheck import Case, check_compiled, check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.ir.graph import Attrs
from flowc.ops.registry import get_op

RNG = np.random.default_rng(19)


def rand(*shape: int, scale: float = 1.0, dtype: type = np.float32) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def unit(*shape: int) -> np.ndarray:
    return RNG.uniform(0.0, 1.0, shape).astype(np.float32)


# 2-D with everything: two groups, two offset groups, strides, uneven pads, dilations.
X2 = rand(2, 4, 7, 6)
W2 = rand(6, 2, 3, 2)
FULL = {"group": 2, "offset_group": 2, "strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}
OFF2 = rand(2, 2 * 6 * 2, 4, 5, scale=2.0)  # output 4 x 5
MASK2 = unit(2, 2 * 6, 4, 5)
B2 = rand(6)


@pytest.mark.parametrize(
    "inputs",
    [
        [X2, W2, OFF2, B2, MASK2],
        [X2, W2, OFF2, None, MASK2],
        [X2, W2, OFF2, B2],
        [X2, W2, OFF2],
    ],
    ids=["bias_mask", "mask", "bias", "plain"],
)
def test_deform_conv_2d(inputs: list[np.ndarray | None]) -> None:
    check_op("DeformConv", inputs, FULL, opset=19, tol=1e-4)


def test_deform_conv_2d_defaults_and_far_offsets() -> None:
    # Offsets that send taps well outside the input (all corners read 0) and onto exact
    # integer positions (one corner only), without pads.
    off = rand(1, 2 * 4, 3, 3, scale=4.0)
    off[0, :4] = np.round(off[0, :4])
    check_op("DeformConv", [rand(1, 3, 4, 4), rand(2, 3, 2, 2), off], {}, opset=19, tol=1e-4)


def test_deform_conv_1d_is_2d_of_height_one() -> None:
    x, w, off = rand(2, 2, 9), rand(3, 2, 3), rand(2, 3, 7, scale=2.0)
    mask = unit(2, 3, 7)
    a = Attrs({"offset_group": 1})
    got = get_op("DeformConv").evaluate([x, w, off, None, mask], a)[0]
    # The same convolution in 2-D: height 1, kernel height 1, no vertical offset.
    off2 = np.stack([np.zeros_like(off), off], axis=2).reshape(2, 6, 1, 7)
    want = check_op(
        "DeformConv",
        [x[:, :, None], w[:, :, None], off2, None, mask[:, :, None]],
        opset=19,
        tol=1e-4,
    )["out0"]
    np.testing.assert_allclose(got, want[:, :, 0], rtol=1e-5, atol=1e-5)


def _loop_deform(
    x: np.ndarray,
    w: np.ndarray,
    off: np.ndarray,
    mask: np.ndarray,
    og: int,
    strides: tuple[int, ...],
    pads: tuple[int, ...],
) -> np.ndarray:
    """DeformConv one output element at a time (group 1, dilation 1), straight from the
    specification's words."""
    n, c = x.shape[:2]
    spatial, kernel = x.shape[2:], w.shape[2:]
    nd = len(spatial)
    out = off.shape[2:]
    taps = list(itertools.product(*(range(k) for k in kernel)))
    y = np.zeros((n, w.shape[0], *out))

    def read(img: int, ch: int, at: tuple[int, ...]) -> float:
        if all(0 <= a < s for a, s in zip(at, spatial, strict=True)):
            return float(x[(img, ch, *at)])
        return 0.0

    for img, m, *o in itertools.product(range(n), range(w.shape[0]), *(range(s) for s in out)):
        total = 0.0
        for ch in range(c):
            g = ch // (c // og)
            for t, k in enumerate(taps):
                p = [
                    o[d] * strides[d]
                    - pads[d]
                    + k[d]
                    + off[(img, (g * len(taps) + t) * nd + d, *o)]
                    for d in range(nd)
                ]
                base = [math.floor(v) for v in p]
                val = 0.0
                for corner in itertools.product((0, 1), repeat=nd):
                    wt = math.prod(
                        (p[d] - base[d]) if corner[d] else (1 - (p[d] - base[d])) for d in range(nd)
                    )
                    val += wt * read(
                        img, ch, tuple(b + s for b, s in zip(base, corner, strict=True))
                    )
                total += val * mask[(img, g * len(taps) + t, *o)] * w[(m, ch, *k)]
        y[(img, m, *o)] = total
    return y


def test_deform_conv_3d_against_loop() -> None:
    x, w = rand(1, 2, 4, 3, 5), rand(2, 2, 2, 2, 2)
    strides, pads = (1, 2, 1), (1, 0, 0)
    # Output: (4+1+0-2)/1+1 = 4, (3-2)/2+1 = 1, 5-2+1 = 4.
    off = rand(1, 2 * 8 * 3, 4, 1, 4, scale=1.5)
    mask = unit(1, 2 * 8, 4, 1, 4)
    a = Attrs({"offset_group": 2, "strides": strides, "pads": [*pads, 0, 0, 0]})
    got = get_op("DeformConv").evaluate([x, w, off, None, mask], a)[0]
    want = _loop_deform(x, w, off, mask, 2, strides, pads)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "inputs, attrs, message",
    [
        ([X2, W2, rand(2, 24, 4, 4)], FULL, "offset must have shape"),
        ([X2, W2, OFF2, None, unit(2, 12, 4, 4)], FULL, "mask must have shape"),
        ([X2, W2, OFF2, rand(5)], FULL, "B must have shape"),
        ([X2, W2, OFF2], {**FULL, "offset_group": 3}, "offset_group 3"),
        ([X2, W2, OFF2], {**FULL, "group": 3}, "group 3"),
        ([X2, W2, OFF2], {**FULL, "kernel_shape": [3, 3]}, "kernel_shape"),
    ],
)
def test_deform_conv_errors(
    inputs: list[np.ndarray | None], attrs: dict[str, object], message: str
) -> None:
    model, _ = make_op_model("DeformConv", inputs, attrs, opset=19, const_inputs=range(5))
    with pytest.raises(ShapeError, match=message):
        import_model(model)


def test_deform_conv_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cases = [
        Case("DeformConv", [X2, W2, OFF2, B2, MASK2], FULL, tol=1e-4),
        Case("DeformConv", [X2, W2, OFF2, None, MASK2], FULL, tol=1e-4),
        Case("DeformConv", [X2, W2, OFF2], FULL, tol=1e-4, const_inputs=(1,)),
        Case(
            "DeformConv",
            [rand(1, 3, 4, 4), rand(2, 3, 2, 2), rand(1, 8, 3, 3, scale=4.0), rand(2)],
            tol=1e-4,
        ),
        Case(
            "DeformConv",
            [
                rand(1, 2, 5, 5, dtype=np.float64),
                rand(2, 2, 3, 3, dtype=np.float64),
                rand(1, 18, 5, 5, scale=1.5, dtype=np.float64),
            ],
            {"pads": [1, 1, 1, 1]},
            tol=1e-9,
        ),
    ]
    check_compiled(cases, tmp_path, opset=19)
    log = tmp_path / "project" / "build-host" / "flowc-build.log"
    assert "warning" not in log.read_text().lower()


def test_deform_conv_compiled_1d_3d(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Ranks onnxruntime does not run: the kernel against flowc's reference (checked above
    against the 2-D embedding and the scalar loop), both nodes in one host build."""
    from onnx import helper

    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run
    from flowc.harness.compare import compare
    from flowc.interpreter import evaluate
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    cases = [
        (
            [rand(2, 2, 9), rand(3, 2, 3), rand(2, 3, 4, scale=2.0), rand(3), unit(2, 3, 4)],
            {"strides": [2], "pads": [1, 0]},
        ),
        (
            [
                rand(1, 2, 4, 3, 5),
                rand(2, 2, 2, 2, 2),
                rand(1, 48, 4, 1, 4, scale=1.5),
                None,
                unit(1, 16, 4, 1, 4),
            ],
            {"offset_group": 2, "strides": [1, 2, 1], "pads": [1, 0, 0, 0, 0, 0]},
        ),
    ]
    nodes, vis, feeds = [], [], {}
    for k, (inputs, attrs) in enumerate(cases):
        names = []
        for i, a in enumerate(inputs):
            names.append(f"c{k}_in{i}" if a is not None else "")
            if a is not None:
                vis.append(helper.make_tensor_value_info(names[-1], 1, a.shape))
                feeds[names[-1]] = a
        nodes.append(helper.make_node("DeformConv", names, [f"c{k}_out"], **attrs))
    outs = [helper.make_empty_tensor_value_info(f"c{k}_out") for k in range(len(cases))]
    model = helper.make_model(
        helper.make_graph(nodes, "deform", vis, outs),
        opset_imports=[helper.make_opsetid("", 19)],
    )
    want = evaluate(import_model(model), feeds)
    graph = PassManager(COMPILE_PIPELINE).run(import_model(model))
    project = tmp_path / "project"
    compile_graph(graph, project, poison=True)
    bdir = build(project, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    got, _ = run(project, feeds, target="host")
    for name, w in want.items():
        c = compare(name, got[name], w, 1e-5)
        assert c.ok, f"{name}: {c.reason or c.error}"
