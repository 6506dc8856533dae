"""A classifier over many classes, trained with its weight split by classes ("partial FC",
as face recognition trains one): its logits are never gathered.

    python examples/huge_classifier.py OUT       # OUT/classifier.onnx, OUT/faces.npz
    flowc train OUT/classifier.onnx --loss cross_entropy:logits,labels \\
        --optimizer adamw:lr=0.01 --data OUT/faces.npz --steps 20 --batch 64 \\
        --mesh 4 --parallel auto --mem-limit 4MB

The model: x [batch, 32] -> a Linear to 32 features -> a Linear to 16,384 classes (the
classifier's weight is 2 MB; with AdamW and the [64, 16384] logits, their exponentials and
gradient, one device needs about 13 MB). Under --mem-limit 4MB one device is refused; on 4
ranks the search splits the classifier by columns (4,096 classes each, S(1)), and the loss
runs on each rank's logits: on a mesh flowc writes the cross-entropy's log-sum-exp in blocks
of classes (flowc/ops/loss.py), so only each block's row maximum ([64, 4] values) is
gathered, the exponentials' and the label's sums are all-reduced ([64] each), and the
logits' gradient is made where the logits are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INPUT, FEATURES, CLASSES, EXAMPLES = 32, 32, 16384, 128


def model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(
            (rng.standard_normal((INPUT, FEATURES)) * 0.2).astype(np.float32), "embed.weight"
        ),
        numpy_helper.from_array(
            (rng.standard_normal((FEATURES, CLASSES)) * 0.05).astype(np.float32), "fc.weight"
        ),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "embed.weight"], ["features"]),
        helper.make_node("MatMul", ["features", "fc.weight"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", INPUT])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(proto)
    return proto


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((EXAMPLES, INPUT)).astype(np.float32)
    return {"x": x, "labels": rng.integers(0, CLASSES, EXAMPLES).astype(np.int64)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for classifier.onnx and faces.npz")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    onnx.save(model(), str(args.out / "classifier.onnx"))
    np.savez(args.out / "faces.npz", **data())  # type: ignore[arg-type]
    print(f"wrote {args.out / 'classifier.onnx'} and {args.out / 'faces.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
