"""A real learning task for `flowc train`: scikit-learn's bundled handwritten digits (1,797
8x8 images, no download) and a small MLP written as ONNX.

    python examples/digits.py prepare OUT      # OUT/digits_{mlp,cnn}.onnx, digits_{train,test}.npz
    flowc train OUT/digits_mlp.onnx --loss cross_entropy:logits,labels \\
        --optimizer adamw:lr=0.01,weight_decay=0.0001 --data OUT/digits_train.npz \\
        --steps 300 --batch 64 --export OUT/digits_mlp_trained.onnx
    python examples/digits.py evaluate OUT     # held-out accuracy of each exported model

The same command trains the small CNN (digits_cnn.onnx -> digits_cnn_trained.onnx).

The split is seeded (1,437 images to train on, 360 held out); pixels are scaled to [0, 1].
`evaluate` runs the exported model with onnxruntime, so the figure is not flowc's own word.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 128
HELD_OUT = 360


def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    return x[train], y[train], x[test], y[test]


def _mlp() -> onnx.ModelProto:
    """64 -> 128 (ReLU) -> 10 logits, He-initialized from a fixed seed, biases zero."""
    rng = np.random.default_rng(1)
    inits = {
        "fc1.weight": rng.standard_normal((64, HIDDEN)) * np.sqrt(2.0 / 64),
        "fc1.bias": np.zeros(HIDDEN),
        "fc2.weight": rng.standard_normal((HIDDEN, 10)) * np.sqrt(2.0 / HIDDEN),
        "fc2.bias": np.zeros(10),
    }
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _cnn() -> onnx.ModelProto:
    """x [B, 64] as 1x8x8 images -> Conv 3x3 (16) -> ReLU -> AveragePool 2x2 -> Conv 3x3 (32)
    -> ReLU -> GlobalAveragePool -> Gemm (10 logits), He-initialized from a fixed seed."""
    rng = np.random.default_rng(2)
    inits = {
        "image_shape": np.array([-1, 1, 8, 8], np.int64),
        "conv1.weight": rng.standard_normal((16, 1, 3, 3)) * np.sqrt(2.0 / 9),
        "conv1.bias": np.zeros(16),
        "conv2.weight": rng.standard_normal((32, 16, 3, 3)) * np.sqrt(2.0 / 144),
        "conv2.bias": np.zeros(32),
        "fc.weight": rng.standard_normal((32, 10)) * np.sqrt(2.0 / 32),
        "fc.bias": np.zeros(10),
    }
    nodes = [
        helper.make_node("Reshape", ["x", "image_shape"], ["img"]),
        helper.make_node("Conv", ["img", "conv1.weight", "conv1.bias"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("AveragePool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [
            numpy_helper.from_array(v if v.dtype == np.int64 else v.astype(np.float32), k)
            for k, v in inits.items()
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def prepare(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    x_train, y_train, x_test, y_test = _split()
    np.savez(out / "digits_train.npz", x=x_train, labels=y_train)
    np.savez(out / "digits_test.npz", x=x_test, labels=y_test)
    onnx.save(_mlp(), str(out / "digits_mlp.onnx"))
    onnx.save(_cnn(), str(out / "digits_cnn.onnx"))
    print(
        f"wrote {out}/digits_mlp.onnx, digits_cnn.onnx, digits_train.npz ({len(y_train)}), "
        f"digits_test.npz ({len(y_test)})"
    )


def accuracy(model: Path, test: Path) -> float:
    """Held-out accuracy of ``model`` (onnxruntime) on ``test`` (x, labels)."""
    import onnxruntime as ort

    data = np.load(test)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(None, {"x": data["x"]})
    return float((np.asarray(logits).argmax(axis=1) == data["labels"]).mean())


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("command", choices=["prepare", "evaluate"])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    if args.command == "prepare":
        prepare(args.out)
        return 0
    found = False
    for kind in ("mlp", "cnn"):
        trained = args.out / f"digits_{kind}_trained.onnx"
        if not trained.is_file():
            continue
        found = True
        before = accuracy(args.out / f"digits_{kind}.onnx", args.out / "digits_test.npz")
        after = accuracy(trained, args.out / "digits_test.npz")
        print(f"{kind}: held-out accuracy {after:.1%} (untrained: {before:.1%}; {HELD_OUT} images)")
    if not found:
        print(
            f"error: no digits_*_trained.onnx in {args.out}; train first (see --help)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
