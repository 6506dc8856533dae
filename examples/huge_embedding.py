"""A layer too large for one device, trained on four: an embedding bag (the ads-ranking
shape OneFlow's huge-embedding examples have) whose table does not fit one device under a
memory limit, so the placement search splits it by rows over the ranks.

    python examples/huge_embedding.py OUT        # OUT/embedding_bag.onnx, OUT/clicks.npz
    flowc train OUT/embedding_bag.onnx --loss cross_entropy:logits,labels \\
        --optimizer adamw:lr=0.05 --data OUT/clicks.npz --steps 20 --batch 16 \\
        --mesh 4 --parallel auto --mem-limit 4MB

The model: ids [batch, 4] -> Gather from the table [8192, 64] -> mean over the 4 ids -> a
Linear to 16 classes. With AdamW the table keeps 16 bytes per element (8.4 MB in all with
the batch and the rest); under --mem-limit 4MB one device is refused, and on 4 ranks the
search places the table and its moments S(0) (2,048 rows each): each rank looks up the rows
it holds (GatherShard: a partial sum, zeros for the others' rows), the pooled rows are
all-reduced once, and the table's gradient is scattered into the rank's own rows alone
(ScatterNDShard), where its update runs. The labels are a function of the first id, so the
loss falls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROWS, WIDTH, IDS, CLASSES, EXAMPLES = 8192, 64, 4, 16, 64


def model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(
            (rng.standard_normal((ROWS, WIDTH)) * 0.1).astype(np.float32), "table"
        ),
        numpy_helper.from_array(
            (rng.standard_normal((WIDTH, CLASSES)) * 0.2).astype(np.float32), "fc.weight"
        ),
        numpy_helper.from_array(np.zeros(CLASSES, np.float32), "fc.bias"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"]),
        helper.make_node("ReduceMean", ["rows", "axes"], ["pooled"], keepdims=0),
        helper.make_node("Gemm", ["pooled", "fc.weight", "fc.bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "embedding_bag",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", IDS])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(proto)
    return proto


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, ROWS, (EXAMPLES, IDS)).astype(np.int64)
    return {"ids": ids, "labels": (ids[:, 0] % CLASSES).astype(np.int64)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for embedding_bag.onnx and clicks.npz")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    onnx.save(model(), str(args.out / "embedding_bag.onnx"))
    np.savez(args.out / "clicks.npz", **data())  # type: ignore[arg-type]
    print(f"wrote {args.out / 'embedding_bag.onnx'} and {args.out / 'clicks.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
