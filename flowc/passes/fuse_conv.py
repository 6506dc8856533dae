"""fuse_conv: a Conv and the element-wise ops real exporters put after it become one FusedConv,
y = act(conv(x, W) + b + z): one library call (cuDNN's cudnnConvolutionBiasActivationForward)
instead of a convolution and one or two element-wise kernels.

Matched after the Conv, each step only when the value so far feeds nothing else (and is not a
graph output):

- an Add of a per-channel constant (an exporter that keeps the bias apart: shape [K, 1, ...]
  or [1, K, 1, ...]) joins the bias;
- an Add or a two-input Sum of a value of exactly the result's type: the residual z (ResNet's
  shortcut, whichever operand is not the convolution);
- a Relu: the activation. Other activations stay separate ops (fuse_elementwise then puts them
  in one kernel with their neighbours): cuDNN's fused call knows only ReLU and the identity.

A FusedConv always has a bias (zeros where the Conv had none), which cuDNN's fused call needs.
Runs after fold_batchnorm (a BN between the Conv and its Add/Relu is gone by then) and before
widen_types, so a float16/bfloat16 group stays one node (FusedConv handles those types itself).
"""

from __future__ import annotations

import numpy as np

from flowc.ir.graph import Graph, Node, Value, make_splat
from flowc.passes.fold_batchnorm import channel_vector
from flowc.passes.manager import register_pass


@register_pass("fuse_conv")
def fuse_conv(graph: Graph) -> Graph:
    users = graph.users()
    outputs = graph.kept()
    claimed: set[Node] = set()
    fused_at: dict[Node, Node] = {}
    for conv in graph.nodes:
        if conv.op != "Conv" or conv in claimed or not conv.outputs[0].type.dtype.is_float:
            continue

        def sole_user(v: Value, conv: Node = conv) -> Node | None:
            us = users.get(v, [])
            if v in outputs or len(us) != 1 or us[0] in claimed or us[0].stage != conv.stage:
                return None
            return us[0]

        x, w = conv.inputs[0], conv.inputs[1]
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        y = conv.outputs[0]
        k, rank = y.type.shape[1], y.type.rank
        members = [conv]
        cur = y
        nxt = sole_user(cur)
        extra: np.ndarray | None = None
        if nxt is not None and nxt.op == "Add" and (bias is None or bias.const is not None):
            other = nxt.inputs[1] if nxt.inputs[0] is cur else nxt.inputs[0]
            extra = channel_vector(other, k, rank)
            if extra is not None and nxt.outputs[0].type == cur.type:
                members.append(nxt)
                cur = nxt.outputs[0]
                nxt = sole_user(cur)
            else:
                extra = None
        z: Value | None = None
        if nxt is not None and nxt.op in ("Add", "Sum") and len(nxt.inputs) == 2:
            a, b = nxt.inputs
            other = b if a is cur else a
            if (
                other is not None
                and other is not cur
                and other.type == cur.type
                and nxt.outputs[0].type == cur.type
            ):
                z = other
                members.append(nxt)
                cur = nxt.outputs[0]
                nxt = sole_user(cur)
        relu = nxt is not None and nxt.op == "Relu" and nxt.outputs[0].type == cur.type
        if relu:
            assert nxt is not None
            members.append(nxt)
            cur = nxt.outputs[0]
        if len(members) == 1:
            continue  # a lone Conv (its bias is fused into its call already)
        dt = y.type.dtype.np
        if extra is not None:
            b64 = extra.astype(np.float64)
            if bias is not None:
                assert bias.const is not None
                b64 = b64 + bias.const.astype(np.float64)
            bias = graph.add_constant(f"{w.name if w else conv.name}.bias", b64.astype(dt))
        elif bias is None:
            bias = graph.add_constant(f"{conv.name}.zero_bias", make_splat(0, (k,), dt))
        fused = Node(
            "FusedConv",
            [x, w, bias, *([z] if z is not None else [])],
            [cur],
            {**conv.attrs, "activation": "Relu" if relu else ""},
            name=conv.name,
        )
        fused.stage = conv.stage
        claimed.update(members)
        fused_at[members[-1]] = fused
    if fused_at:
        graph.nodes = [fused_at.get(n, n) for n in graph.nodes if n not in claimed or n in fused_at]
        graph.remove_unused()
    return graph
