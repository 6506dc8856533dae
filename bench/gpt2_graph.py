"""A GPT-2 model of any size as ONNX, for the placement search and later benchmarks.

The layers follow Hugging Face's GPT2LMHeadModel as PyTorch exports it: token and position
embeddings; per block a pre-norm attention (LayerNorm, one fused q/k/v projection as a Gemm
on [batch * seq, hidden] then split, heads by Reshape/Transpose, scaled scores plus a causal
mask, softmax, the weighted sum, the output projection, the residual) and a pre-norm MLP
(LayerNorm, Gemm to 4 x hidden, GELU in its tanh form, Gemm back, the residual); then the
final LayerNorm and the language-model head tied to the token embedding. ``--vocab 0``
leaves out the embeddings, the final LayerNorm and the head: the input is then the hidden
states ``x: f32[batch, seq, hidden]`` and the output the last block's.

    python bench/gpt2_graph.py --layers 12 --hidden 768 --heads 12 --seq 128 --batch 1 \\
        --vocab 50257 -o gpt2_small.onnx

``--weights random`` (the default) stores seeded normal weights (GPT-2 small is about 500 MB
then); ``--weights fill`` makes every weight a ConstantOfShape node (a file of a few KB,
which flowc folds into fills), enough for anything that looks only at shapes (the search).
``--external-data`` writes the random weights beside the model in ``OUTPUT.data`` (ONNX
external data, one file), appended as they are drawn, so a 48-layer model never sits in
memory whole.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18


class _Builder:
    def __init__(self, weights: str, seed: int, external: Path | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.weights = weights
        self.rng = np.random.default_rng(seed)
        self.count = 0
        # Where random weights go as external data (None: embedded in the model).
        self.external = external
        self.external_bytes = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def op(self, op: str, inputs: list[str], hint: str, **attrs: object) -> str:
        out = self.name(hint)
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"node_{out}", **attrs))
        return out

    def const(self, name: str, array: np.ndarray) -> str:
        """A small constant that must hold exact values (shapes, the mask, scalars)."""
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def external_const(self, name: str, data: np.ndarray) -> str:
        """A parameter appended to the external data file (offsets 4096-aligned, as onnx's
        own writer aligns large tensors)."""
        assert self.external is not None
        offset = -(-self.external_bytes // 4096) * 4096
        with open(self.external, "r+b" if self.external_bytes else "wb") as f:
            f.seek(offset)
            f.write(data.tobytes())
        self.external_bytes = offset + data.nbytes
        t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=data.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.external.name), ("offset", offset), ("length", data.nbytes)):
            t.external_data.add(key=k, value=str(v))
        self.inits.append(t)
        return name

    def weight(self, name: str, shape: tuple[int, ...], std: float, fill: float) -> str:
        """A parameter: seeded normal values, or one ``fill`` value as ConstantOfShape."""
        if self.weights == "random":
            data = (fill + std * self.rng.standard_normal(shape, dtype=np.float32)).astype(
                np.float32
            )
            if self.external is None:
                return self.const(name, data)
            return self.external_const(name, data)
        shape_name = self.const(f"{name}.shape", np.array(shape, dtype=np.int64))
        value = helper.make_tensor("value", TensorProto.FLOAT, [1], [fill if std == 0 else std])
        self.nodes.append(
            helper.make_node("ConstantOfShape", [shape_name], [name], name=name, value=value)
        )
        return name


def gpt2_model(
    layers: int = 12,
    hidden: int = 768,
    heads: int = 12,
    seq: int = 128,
    batch: int = 1,
    vocab: int = 50257,
    weights: str = "random",
    seed: int = 0,
    external: Path | None = None,
) -> onnx.ModelProto:
    """The ONNX model; see the module docstring. ``vocab`` 0: no embeddings and no head.
    ``external``: write the random weights to this file (external data named by its file
    name, so it must sit beside the model)."""
    if hidden % heads:
        raise ValueError(f"hidden {hidden} does not divide into {heads} heads")
    if min(layers, hidden, heads, seq, batch) < 1 or vocab < 0:
        raise ValueError("layers, hidden, heads, seq and batch must be >= 1, vocab >= 0")
    if weights not in ("random", "fill"):
        raise ValueError(f"weights must be 'random' or 'fill', not {weights!r}")
    b = _Builder(weights, seed, external)
    d = hidden // heads
    std = 0.02
    flat = b.const("shape.flat", np.array([batch * seq, hidden], dtype=np.int64))
    unflat = b.const("shape.hidden", np.array([batch, seq, hidden], dtype=np.int64))
    unflat3 = b.const("shape.qkv", np.array([batch, seq, 3 * hidden], dtype=np.int64))
    split_heads = b.const("shape.heads", np.array([batch, seq, heads, d], dtype=np.int64))
    sizes = b.const("split.qkv", np.array([hidden] * 3, dtype=np.int64))
    # 0 on and below the diagonal, a large negative number above it (as HF's finfo.min).
    causal = np.triu(np.full((seq, seq), -1e9, dtype=np.float32), k=1)
    mask = b.const("causal_mask", causal.reshape(1, 1, seq, seq))
    scale = b.const("attn.scale", np.array(1.0 / math.sqrt(d), dtype=np.float32))
    half = b.const("gelu.half", np.array(0.5, dtype=np.float32))
    one = b.const("gelu.one", np.array(1.0, dtype=np.float32))
    cube = b.const("gelu.three", np.array(3.0, dtype=np.float32))
    coef = b.const("gelu.coef", np.array(0.044715, dtype=np.float32))
    root = b.const("gelu.root", np.array(math.sqrt(2.0 / math.pi), dtype=np.float32))

    if vocab:
        ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])
        wte = b.weight("transformer.wte.weight", (vocab, hidden), std, 0.0)
        wpe = b.weight("transformer.wpe.weight", (seq, hidden), std / 2, 0.0)
        tok = b.op("Gather", [wte, "input_ids"], "embedding")
        x = b.op("Add", [tok, wpe], "add")
        graph_input = ids
    else:
        graph_input = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])
        x = "x"

    def layer_norm(v: str, prefix: str) -> str:
        g = b.weight(f"{prefix}.weight", (hidden,), 0.0, 1.0)
        beta = b.weight(f"{prefix}.bias", (hidden,), 0.0, 0.0)
        return b.op("LayerNormalization", [v, g, beta], "layer_norm", axis=-1, epsilon=1e-5)

    def linear(v2d: str, prefix: str, n_in: int, n_out: int) -> str:
        # HF's Conv1D: weight [in, out], exported as addmm (a Gemm) on the flattened tokens.
        w = b.weight(f"{prefix}.weight", (n_in, n_out), std, 0.0)
        bias = b.weight(f"{prefix}.bias", (n_out,), 0.0, 0.0)
        return b.op("Gemm", [v2d, w, bias], "addmm")

    for i in range(layers):
        p = f"transformer.h.{i}"
        h = layer_norm(x, f"{p}.ln_1")
        qkv = linear(b.op("Reshape", [h, flat], "view"), f"{p}.attn.c_attn", hidden, 3 * hidden)
        qkv = b.op("Reshape", [qkv, unflat3], "view")
        q, k, v = (b.name("split") for _ in range(3))
        b.nodes.append(
            helper.make_node(
                "Split", [qkv, sizes], [q, k, v], name=f"node_split_{b.count}", axis=-1
            )
        )
        qh = b.op(
            "Transpose", [b.op("Reshape", [q, split_heads], "view")], "permute", perm=[0, 2, 1, 3]
        )
        kt = b.op(
            "Transpose", [b.op("Reshape", [k, split_heads], "view")], "permute", perm=[0, 2, 3, 1]
        )
        vh = b.op(
            "Transpose", [b.op("Reshape", [v, split_heads], "view")], "permute", perm=[0, 2, 1, 3]
        )
        scores = b.op("Mul", [b.op("MatMul", [qh, kt], "matmul"), scale], "mul")
        probs = b.op("Softmax", [b.op("Add", [scores, mask], "add")], "softmax", axis=-1)
        att = b.op(
            "Transpose", [b.op("MatMul", [probs, vh], "matmul")], "permute", perm=[0, 2, 1, 3]
        )
        att = b.op("Reshape", [att, flat], "view")
        proj = linear(att, f"{p}.attn.c_proj", hidden, hidden)
        x = b.op("Add", [x, b.op("Reshape", [proj, unflat], "view")], "add")

        h2 = b.op("Reshape", [layer_norm(x, f"{p}.ln_2"), flat], "view")
        fc = linear(h2, f"{p}.mlp.c_fc", hidden, 4 * hidden)
        # GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
        inner = b.op("Add", [fc, b.op("Mul", [b.op("Pow", [fc, cube], "pow"), coef], "mul")], "add")
        t = b.op("Tanh", [b.op("Mul", [inner, root], "mul")], "tanh")
        gelu = b.op("Mul", [b.op("Mul", [fc, half], "mul"), b.op("Add", [t, one], "add")], "mul")
        out = linear(gelu, f"{p}.mlp.c_proj", 4 * hidden, hidden)
        x = b.op("Add", [x, b.op("Reshape", [out, unflat], "view")], "add")

    if vocab:
        x = layer_norm(x, "transformer.ln_f")
        # The head is tied to the token embedding: logits = x @ wte^T.
        x = b.op(
            "MatMul", [x, b.op("Transpose", ["transformer.wte.weight"], "t", perm=[1, 0])], "matmul"
        )
        out_info = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq, vocab])
        b.nodes.append(helper.make_node("Identity", [x], ["logits"], name="output"))
    else:
        out_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])
        b.nodes.append(helper.make_node("Identity", [x], ["y"], name="output"))
    graph = helper.make_graph(
        b.nodes, f"gpt2_l{layers}_h{hidden}", [graph_input], [out_info], initializer=b.inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.producer_name = "flowc bench/gpt2_graph.py"
    if external is None:  # the checker resolves external data against the working folder
        onnx.checker.check_model(model, full_check=False)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=50257, help="0: no embeddings, no LM head")
    ap.add_argument("--weights", choices=("random", "fill"), default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--external-data",
        action="store_true",
        help="write the random weights to OUTPUT.data beside the model (ONNX external data)",
    )
    ap.add_argument("-o", "--output", type=Path, required=True)
    a = ap.parse_args(argv)
    external = a.output.with_name(a.output.name + ".data") if a.external_data else None
    try:
        model = gpt2_model(
            a.layers, a.hidden, a.heads, a.seq, a.batch, a.vocab, a.weights, a.seed, external
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    onnx.save(model, str(a.output))
    print(f"wrote {a.output} ({len(model.graph.node)} nodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
