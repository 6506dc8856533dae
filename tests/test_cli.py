"""The `flowc` command: inspect, eval, ops, and its error paths (message, exit code, no traceback)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS
from onnx import TensorProto, helper

from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime


def flowc(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowc", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def assert_clean_error(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert "\nerror: " in "\n" + r.stderr, r.stderr
    for f in fragments:
        assert f in r.stderr, f"{f!r} not in {r.stderr!r}"


def test_inspect_summarizes_a_model() -> None:
    r = flowc("inspect", str(SHARED_MODELS / "mlp.onnx"))
    assert r.returncode == 0, r.stderr
    assert "opset 17" in r.stdout
    assert "input" in r.stdout and "x" in r.stdout and "f32[8, 64]" in r.stdout
    assert "f32[8, 10]" in r.stdout
    assert "Gemm" in r.stdout and "Softmax" in r.stdout
    # Linear(64, 256) + Linear(256, 10): (64*256 + 256 + 256*10 + 10) float32 parameters.
    params = (64 * 256 + 256 + 256 * 10 + 10) * 4
    assert f"4 tensors, {params / 1024:.2f} KiB" in r.stdout
    assert "estimated FLOPs" in r.stdout


def test_inspect_print_ir_writes_dsl_to_stdout() -> None:
    r = flowc("inspect", str(SHARED_MODELS / "gpt2_tiny.onnx"), "--print-ir")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        "graph gpt2_tiny(input_ids: i64[1, 32]) -> (logits: f32[1, 32, 1000]) {"
    )
    assert r.stdout.rstrip().endswith("return logits\n}".rstrip())
    assert "gpt2_tiny.onnx" in r.stderr  # the summary goes to stderr
    from lark import Lark

    from flowc.resources import grammar_file

    Lark(grammar_file().read_text(), parser="lalr").parse(r.stdout)


def test_eval_writes_outputs_keyed_by_name(tmp_path: Path) -> None:
    io = np.load(SHARED_MODELS / "bert_tiny.io.npz")
    ids, mask = tmp_path / "ids.npy", tmp_path / "mask.npy"
    np.save(ids, io["in:input_ids"])
    np.save(mask, io["in:attention_mask"])
    out = tmp_path / "out.npz"
    r = flowc(
        "eval", str(SHARED_MODELS / "bert_tiny.onnx"), "--dim", "batch=2", "--dim", "seq=32",
        "--input", f"input_ids={ids}", "--input", f"attention_mask={mask}", "-o", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = np.load(out)
    assert sorted(got.files) == ["last_hidden_state", "pooler_output"]
    for k in got.files:
        assert max_rel_error(got[k], io[f"out:{k}"]) <= 1e-4
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_eval_random_inputs_match_onnxruntime(tmp_path: Path) -> None:
    out = tmp_path / "o.npz"
    model = SHARED_MODELS / "vit_tiny.onnx"
    r = flowc("eval", str(model), "--random-inputs", "--seed", "3", "-o", str(out))
    assert r.returncode == 0, r.stderr
    from flowc.frontend.onnx import import_onnx
    from flowc.interpreter import random_inputs

    feeds = random_inputs(import_onnx(model), seed=3)
    ref = run_onnxruntime(str(model), feeds)
    got = np.load(out)
    assert max_rel_error(got["last_hidden_state"], ref["last_hidden_state"]) <= 1e-4


def test_ops_lists_the_registry() -> None:
    r = flowc("ops")
    assert r.returncode == 0
    for op in ("Conv", "MatMul", "LayerNormalization", "Resize", "TopK", "Trilu", "CumSum"):
        assert f" {op}" in r.stdout
    # Ops handled at import: control flow, and function ops through their ONNX bodies.
    assert "If Loop Scan" in r.stdout
    funcs = next(line for line in r.stdout.splitlines() if line.startswith("function ops"))
    assert " RMSNormalization" in funcs and " SoftmaxCrossEntropyLoss" in funcs
    assert " Conv " not in funcs


# -- error paths ---------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    assert_clean_error(flowc("inspect", str(tmp_path / "nope.onnx")), "no such file")


def test_corrupt_and_truncated_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\xffnot a protobuf at all" * 10)
    assert_clean_error(flowc("inspect", str(bad)), "not a valid ONNX model")
    cut = tmp_path / "cut.onnx"
    cut.write_bytes((SHARED_MODELS / "resnet_tiny.onnx").read_bytes()[:5000])
    assert_clean_error(flowc("inspect", str(cut)), "cut.onnx")


def test_unknown_format(tmp_path: Path) -> None:
    p = tmp_path / "m.pt"
    p.write_bytes(b"x")
    assert_clean_error(flowc("inspect", str(p)), "unknown model format '.pt'")


def test_unsupported_ops_are_all_listed(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("StringNormalizer", ["a"], ["b"], name="sn_first"),
        helper.make_node("StringNormalizer", ["a"], ["c"], name="sn_second"),
        helper.make_node("FancyOp", ["a"], ["d"], name="fancy", domain="com.example"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("b", "c", "d")],
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    p = tmp_path / "u.onnx"
    onnx.save(m, str(p))
    r = flowc("inspect", str(p))
    assert_clean_error(
        r,
        "2 unsupported op type(s)",
        "StringNormalizer: 2 node(s), opset 17, first: sn_first",
        "com.example.FancyOp: 1 node(s), domain 'com.example' opset 1, first: fancy",
    )


def test_missing_dynamic_dim_names_input_and_symbol() -> None:
    r = flowc("inspect", str(SHARED_MODELS / "bert_tiny.onnx"))
    assert_clean_error(
        r,
        "input 'input_ids' has a dynamic dimension 0 ('batch') with no value",
        "--dim batch=<size>",
    )


def test_bad_shape_options() -> None:
    model = str(SHARED_MODELS / "mlp.onnx")
    assert_clean_error(flowc("inspect", model, "--shape", "y=8x64"), "no input named 'y'", "'x'")
    assert_clean_error(flowc("inspect", model, "--shape", "x=8xq"), "is not a shape")
    assert_clean_error(flowc("inspect", model, "--shape", "x=4x64"), "dim 0 is fixed to 8")
    assert_clean_error(
        flowc("inspect", model, "--dim", "batch=2"), "no symbolic dimension named 'batch'"
    )


def test_eval_input_errors(tmp_path: Path) -> None:
    model = str(SHARED_MODELS / "mlp.onnx")
    out = str(tmp_path / "o.npz")
    assert_clean_error(
        flowc("eval", model, "-o", out), "input 'x' (f32[8, 64]) is not given", "--random-inputs"
    )
    wrong = tmp_path / "x.npy"
    np.save(wrong, np.zeros((8, 65), np.float32))
    assert_clean_error(
        flowc("eval", model, "--input", f"x={wrong}", "-o", out),
        "expected shape [8, 64], got [8, 65]",
    )
    np.save(wrong, np.zeros((8, 64), np.float64))
    assert_clean_error(
        flowc("eval", model, "--input", f"x={wrong}", "-o", out), "expected dtype f32, got float64"
    )
    assert_clean_error(
        flowc("eval", model, "--input", f"z={wrong}", "-o", out), "no input named 'z'"
    )
    assert_clean_error(
        flowc("eval", model, "--input", "x=/nonexistent.npy", "-o", out), "no such file"
    )
    assert not Path(out).exists()


def test_usage_errors_exit_2() -> None:
    r = flowc("eval", str(SHARED_MODELS / "mlp.onnx"))
    assert r.returncode == 2 and "Missing option '-o'" in r.stderr


@pytest.mark.parametrize(
    "args", [["--help"], ["inspect", "--help"], ["eval", "--help"], ["--version"]]
)
def test_help(args: list[str]) -> None:
    r = flowc(*args)
    assert r.returncode == 0 and r.stdout


def _relu_model(tmp_path: Path, out_name: str, opset: int = 17) -> Path:
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], [out_name])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, [3])],
    )
    p = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), str(p))
    return p


def test_any_output_name_is_an_npz_key(tmp_path: Path) -> None:
    model = _relu_model(tmp_path, "file")
    r = flowc("eval", str(model), "--random-inputs", "-o", str(tmp_path / "o.npz"))
    assert r.returncode == 0, r.stderr
    assert list(np.load(tmp_path / "o.npz").files) == ["file"]


def test_unwritable_output_fails_before_work(tmp_path: Path) -> None:
    model = _relu_model(tmp_path, "y")
    assert_clean_error(
        flowc("eval", str(model), "--random-inputs", "-o", "/proc/o.npz"), "cannot write there"
    )
    assert_clean_error(
        flowc("eval", str(model), "--random-inputs", "-o", str(tmp_path / "no" / "o.npz")),
        "does not exist",
    )


def test_newer_opset_than_onnx_knows(tmp_path: Path) -> None:
    model = _relu_model(tmp_path, "y", opset=onnx.defs.onnx_opset_version() + 1)
    assert_clean_error(flowc("inspect", str(model)), "knows opsets up to")


def test_bad_input_data_is_a_user_error(tmp_path: Path) -> None:
    ids = tmp_path / "ids.npy"
    np.save(ids, np.full((1, 32), 10**6, np.int64))
    r = flowc(
        "eval",
        str(SHARED_MODELS / "gpt2_tiny.onnx"),
        "--input",
        f"input_ids={ids}",
        "-o",
        str(tmp_path / "o.npz"),
    )
    assert_clean_error(r, "Gather node", "out of range")


def test_symbols_bind_across_inputs() -> None:
    model = str(SHARED_MODELS / "bert_tiny.onnx")
    r = flowc("inspect", model, "--shape", "input_ids=2x32")
    assert r.returncode == 0 and "i64[2, 32]" in r.stdout  # attention_mask shares batch and seq
    assert_clean_error(
        flowc("inspect", model, "--shape", "input_ids=2x32", "--dim", "batch=4"),
        "symbol 'batch' is 2 from --shape input_ids but 4 from --dim batch",
    )
    assert_clean_error(
        flowc("inspect", model, "--dim", "batch=1"), "('seq') with no value", "--dim seq=<size>"
    )


def test_the_demo_mesh_limit_splits_the_bundled_model() -> None:
    # `make demo` runs its mesh step under this limit: it must still fit, and split.
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("demo", root / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    r = flowc("inspect", str(root / "examples" / "models" / "resnet_tiny.onnx"), *demo.MESH_LIMIT)
    assert r.returncode == 0, r.stderr
    m = re.search(r"per rank: (\d+) collectives", r.stdout)
    assert m and int(m.group(1)) > 0, r.stdout


def test_inspect_memory_prints_arena_bound_and_naive() -> None:
    r = flowc("inspect", str(SHARED_MODELS / "resnet_tiny.onnx"), "--memory")
    assert r.returncode == 0, r.stderr
    m = re.search(r"memory plan: arena (\d+) B .*lower bound (\d+) B .*naive sum (\d+) B", r.stdout)
    assert m, r.stdout
    arena, lower, naive = (int(x) for x in m.groups())
    assert 0 < lower <= arena <= naive
    # resnet_tiny's convolutions and its Gemm call the libraries: their streams' workspaces,
    # each what its calls can use (under the profile's 32 MiB), on top of the host's arena.
    w = re.search(r"library workspaces \(cuda target only\): (.*) \(cuBLASLt", r.stdout)
    assert w and w.group(1).startswith("stream 0 "), r.stdout
    h = re.search(r"host target arena (\d+) B", r.stdout)
    assert h and 0 < int(h.group(1)) < arena, r.stdout


def test_verify_host_prints_the_table(tmp_path: Path) -> None:
    r = flowc(
        "verify", str(SHARED_MODELS / "mlp.onnx"), "--target", "host", "-o", str(tmp_path / "out")
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"y\s+│\s+\[8, 10\]\s+│\s+\d\.\d\de-\d\d\s+│\s+PASS", r.stdout), r.stdout
    assert (tmp_path / "out" / "model.cu").is_file() and "compile and link (host)" in r.stderr


def test_pass_dumps_and_times() -> None:
    r = flowc(
        "inspect",
        str(SHARED_MODELS / "mlp.onnx"),
        "--dump-ir-after",
        "simplify",
        "--print-pass-times",
    )
    assert r.returncode == 0, r.stderr
    assert "# IR after simplify\ngraph mlp(x: f32[8, 64])" in r.stderr
    assert re.search(
        r"pass times: import [\d.]+ ms\n  fold_constants: [\d.]+ ms\n  simplify: [\d.]+ ms",
        r.stderr,
    )
    assert_clean_error(
        flowc("inspect", str(SHARED_MODELS / "mlp.onnx"), "--dump-ir-after", "nope"),
        "unknown pass(es): nope",
    )


def test_the_demo_plan_comparison_says_what_memory_counts() -> None:
    # `make demo` prints the plan comparison of `flowc inspect ... --mesh 2 --mem-limit`:
    # under it, what the memory/device column counts; the chosen plan's figure is the
    # parameters plus the arena of the line above it. Nodes are named by their labels.
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("demo", root / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    r = flowc("inspect", str(root / "examples" / "models" / "resnet_tiny.onnx"), *demo.MESH_LIMIT)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    m = re.search(r"memory per device: (\d+) B .* = parameters (\d+) B \+ arena (\d+) B", text)
    assert m and int(m.group(1)) == int(m.group(2)) + int(m.group(3)), text
    row = re.search(r"^ auto .*│ (\d+) B\s*$", text, re.M)
    assert row and row.group(1) == m.group(1), text
    note = text[text.index("compared with") :]
    for fragment in (
        "memory/device = the bytes one device holds for its rank program: parameters",
        "+ arena (every intermediate value",
        "cuBLASLt/cuDNN workspaces",
        "not counted: the model's inputs and outputs",
        "--mem-limit bounds this number",
    ):
        assert fragment in note, fragment
    # The collective's consumer is the model's node, by its label (no leading "/m/").
    assert re.search(r"last_hidden_state\s+│ pooler/GlobalAveragePool\s+│ all-gather", text)
