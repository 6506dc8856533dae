"""Every number a user gives is bounded, and ordinary bad input is an error that says what
is wrong (issue 23, points 5 and 8).

Point 5: the mesh (at most 65,536 devices and 3 axes, on the command line and in a .flow
program), pipeline stages, micro-batches, --search-nodes, --mem-limit, --seed, --tol,
--jobs, --arch, --prefix, the cost profile's fields and .npy headers. Point 8: ranks above
NumPy's 64, opset versions past an int32, a write error on stdout, --weights nobody reads,
eval --pipeline. Each was an internal error (exit 70), a crash, gigabytes of work, or taken
silently; each is now exit 2 (stdout: 74) with a message naming the culprit.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REPO, run_cli
from onnx import helper

from flowc.cli.options import MAX_BYTES, parse_bytes
from flowc.errors import FlowcError, InputError
from flowc.frontend.dsl import parse_program
from flowc.frontend.npy import load_npy, load_npz
from flowc.parallel.cost import DEFAULT_PROFILE, load_profile

MLP = str(REPO / "examples" / "mlp.flow")


def refused(code: int, text: str, *fragments: str) -> None:
    assert code == 2, text
    assert "internal error" not in text and "Traceback" not in text, text
    for f in fragments:
        assert f in text, f"{f!r} not in {text!r}"


# -- point 5: the mesh and the counts of the pipeline ----------------------------------------


@pytest.mark.parametrize(
    "mesh, says",
    [
        # 24 GB of compile and the OOM killer; 64 s then a failure; an internal error
        ("2147483648", "2147483648 devices; flowc supports at most 65536"),
        ("1048576", "1048576 devices"),
        ("1" * 40, "more than 10^30 devices"),
        ("65537", "65537 devices"),
        ("256x257", "65792 devices"),
        # the search is exponential in the axes: minutes and gigabytes from four on
        ("2x2x2x2", "4 axes; flowc supports at most 3"),
    ],
)
def test_mesh_is_bounded(mesh: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(*run_cli(["inspect", MLP, "--mesh", mesh], capsys), f"--mesh '{mesh}'", says)


@pytest.mark.parametrize(
    "header, says",
    [
        ("mesh gpus[2147483648]", "2147483648 devices; flowc supports at most 65536"),
        ("mesh gpus[" + "9" * 40 + "]", "more than 10^30 devices"),
        ("mesh gpus[2, 2, 2, 2]", "4 axes; flowc supports at most 3"),
    ],
)
def test_program_mesh_is_bounded(header: str, says: str) -> None:
    text = f"{header}\ngraph g(x: f32[8]) -> (y: f32[8]) {{\n    y = relu(x)\n    return y\n}}\n"
    with pytest.raises(FlowcError, match=r"t\.flow:1:1: ") as e:
        parse_program(text, "t.flow")
    assert says in str(e.value)


def test_program_stage_number_is_bounded() -> None:
    text = (
        "graph g(x: f32[8]) -> (y: f32[8]) {\n    stage 2147483648 {\n        y = relu(x)\n"
        "    }\n    return y\n}\n"
    )
    with pytest.raises(FlowcError, match=r"t\.flow:2:11: stage 2147483648: a pipeline has at"):
        parse_program(text, "t.flow")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--pipeline", "2147483648"], "2147483648 is not in the range 1<=x<=65536"),
        # each stage's program unrolls its micro-batches: 65,536 took minutes
        (["--pipeline", "2", "--microbatches", "2147483648"], "1<=x<=1024"),
        (["--pipeline", "2", "--microbatches", "1025"], "1<=x<=1024"),
        # HiGHS counts nodes in a C int: a TypeError in its option check
        (["--mesh", "2", "--search-nodes", "2147483648"], "0<=x<=2147483647"),
    ],
)
def test_pipeline_and_search_counts_are_bounded(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(*run_cli(["inspect", MLP, *args], capsys), says)


# -- point 5: byte counts, seeds, tolerances, jobs ---------------------------------------------


def test_byte_counts_are_exact_and_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_bytes("1.5GB", "--mem-limit") == 1_500_000_000
    assert parse_bytes("64MiB", "--mem-limit") == 64 << 20
    assert parse_bytes(str(MAX_BYTES), "--mem-limit") == MAX_BYTES
    for text in (str(MAX_BYTES + 1), "9" * 400, "9" * 20 + ".5TiB"):
        with pytest.raises(InputError, match="more than 9223372036854775807 bytes"):
            parse_bytes(text, "--mem-limit")
    # 400 digits were an OverflowError (float infinity to int): exit 70
    refused(
        *run_cli(["inspect", MLP, "--mesh", "2", "--mem-limit", "9" * 400], capsys),
        "--mem-limit '99999",
        "more than 9223372036854775807 bytes",
    )


def test_seed_tol_and_jobs_are_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o.npz")
    # NumPy refuses a negative seed: it was an internal error
    refused(*run_cli(["eval", MLP, "--random-inputs", "--seed", "-1", "-o", out], capsys), "--seed")
    for tol in ("nan", "-1", "inf"):  # never passes, or always does
        refused(
            *run_cli(["verify", MLP, "--target", "host", "--tol", tol], capsys),
            "expected an error bound of 0 or more",
        )
    # the process pool forks every worker up front
    refused(*run_cli(["conformance", "-j", "1" + "0" * 20], capsys), "from 1 to 256")


# -- point 5: the cost profile ---------------------------------------------------------------


@pytest.mark.parametrize(
    "line, new, says",
    [
        # a division by zero in the simulator once 0.5 was rounded to 0
        ("sms = 132", "sms = 0.5", "sms must be a whole number of streaming multiprocessors"),
        ("sms = 132", "sms = 1.5", "got 1.5"),
        ("blocks_per_sm = 8", "blocks_per_sm = 0.2", "blocks_per_sm must be a whole number"),
        ("workspace = 33554432", "workspace = 1e23", "workspace must be a whole number of bytes"),
        # past int64 in the memory plan: an OverflowError
        ("workspace = 33554432", "workspace = 100000000000000000000000", "from 0 to 1099511627776"),
        ("bandwidth = 450e9", "bandwidth = 1e-300", "bandwidth must be a number from 1 to 1e+21"),
        # infinite times: the schedule's simulation found no order (internal error)
        ("event_overhead = 2e-6", "event_overhead = 1e308", "from 1e-12 to 3600"),
        ("f32 = 67e12", "f32 = nan", "[compute] f32 must be a number"),
    ],
)
def test_cost_profile_fields_are_checked(tmp_path: Path, line: str, new: str, says: str) -> None:
    text = DEFAULT_PROFILE.read_text()
    assert line in text
    path = tmp_path / "p.toml"
    path.write_text(text.replace(line, new, 1))
    with pytest.raises(InputError) as e:
        load_profile(path)
    assert says in str(e.value)


def test_cost_profile_with_half_an_sm_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.toml"
    path.write_text(DEFAULT_PROFILE.read_text().replace("sms = 132", "sms = 0.5"))
    args = ["inspect", MLP, "--mesh", "2", "--cost-profile", str(path), "--schedule"]
    refused(*run_cli(args, capsys), "p.toml: [device] sms", "got 0.5")


# -- point 5: --arch and --prefix ------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_0", "sm_7", "sm_49", "sm_1000", "sm_" + "9" * 50])
def test_arch_is_a_cuda_architecture(
    arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["compile", MLP, "-o", str(tmp_path / "p"), "--arch", arch, "--target", "host"]
    refused(*run_cli(args, capsys), "expected a CUDA architecture sm_NN from sm_50")
    assert not (tmp_path / "p").exists()


def test_prefix_fits_a_file_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # lib<prefix>_model.so and CMake's <prefix>_model.dir: 250 characters failed the build
    args = ["compile", MLP, "-o", str(tmp_path / "p"), "--prefix", "a" * 201, "--target", "host"]
    refused(*run_cli(args, capsys), "--prefix: 201 characters; a prefix has at most 200")
    assert not (tmp_path / "p").exists()


def test_default_prefix_of_a_long_name_is_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = tmp_path / "long.flow"
    program.write_text(
        f"graph {'g' * 300}(x: f32[8]) -> (y: f32[8]) {{\n    y = relu(x)\n    return y\n}}\n"
    )
    code, text = run_cli(
        ["compile", str(program), "-o", str(tmp_path / "p"), "--target", "host"], capsys
    )
    assert code == 0, text
    cmake = (tmp_path / "p" / "CMakeLists.txt").read_text()
    assert f"add_library({'g' * 200}_model SHARED" in cmake


# -- point 5 and 8: .npy headers -------------------------------------------------------------


def _npy(header: str, data: bytes = b"\0" * 12) -> bytes:
    h = header.encode()
    h += b" " * (64 - (10 + len(h) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data


@pytest.mark.parametrize(
    "shape, says",
    [
        # NumPy: OverflowError "Python int too large to convert to C long"
        ("(99999999999999999999999,)", "dimension 0 of the .npy header's shape is 9999"),
        # NumPy: "malformed node or string on line 1: <ast.Call object at 0x...>"
        ("(f(1),)", "the .npy header holds 'f(1)', which is no plain value"),
        ("(n,)", "holds 'n'"),
        ("(-1,)", "is -1, outside 0 to 9223372036854775807"),
        ("[3]", "shape [3] is not a tuple of integers"),
        ("(1,) * 65", "holds '(1,) * 65'"),
        ("(" + "1, " * 65 + ")", "65 dimensions; flowc holds tensors of rank at most 64"),
        # NumPy allocates 4 TiB before it finds the data missing (in a .npz member)
        ("(1099511627776,)", "declares float32[1099511627776] (4398046511104 bytes of data), but"),
    ],
)
def test_npy_headers_are_checked(tmp_path: Path, shape: str, says: str) -> None:
    data = _npy(f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}")
    (tmp_path / "a.npy").write_bytes(data)
    with zipfile.ZipFile(tmp_path / "w.npz", "w") as z:
        z.writestr("w.npy", data)
    for read in (
        lambda: load_npy(tmp_path / "a.npy", "--input x"),
        lambda: load_npz(tmp_path / "w.npz", "weights file w.npz"),
    ):
        with pytest.raises(InputError) as e:
            read()
        assert says in str(e.value) and "<ast." not in str(e.value)


def test_npy_reader_reads_what_numpy_writes(tmp_path: Path) -> None:
    arrays: dict[str, np.ndarray] = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.asfortranarray(np.ones((3, 2), np.int64)),
        "c": np.zeros((0, 4), np.uint8),
        "d": np.array(2.5),
    }
    np.savez(tmp_path / "w.npz", **arrays)
    got = load_npz(tmp_path / "w.npz", "w.npz")
    assert set(got) == set(arrays)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and np.array_equal(got[k], a)
    np.save(tmp_path / "a.npy", arrays["a"])
    assert np.array_equal(load_npy(tmp_path / "a.npy", "a.npy"), arrays["a"])


def test_weights_npz_with_a_call_in_a_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = tmp_path / "p.flow"
    program.write_text(
        'graph g(x: f32[3]) -> (y: f32[3]) {\n    param w: f32[3] = load("w")\n'
        "    y = x + w\n    return y\n}\n"
    )
    with zipfile.ZipFile(tmp_path / "w.npz", "w") as z:
        z.writestr("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (f(1),), }"))
    args = ["inspect", str(program), "--weights", str(tmp_path / "w.npz")]
    refused(*run_cli(args, capsys), "p.flow:2:23: weights file", "array 'w'", "holds 'f(1)'")


# -- point 8: ranks above 64 and opset versions past an int32 --------------------------------


def _onnx(path: Path, nodes: list[onnx.NodeProto], rank: int, opset: int = 17, **kw: object) -> str:
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1] * rank)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        **kw,  # type: ignore[arg-type]
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), path)
    return str(path)


def test_rank_above_64_is_refused_at_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NumPy holds at most 64 axes: eval made the arrays and failed with a ValueError
    (exit 70), or blamed the input data."""
    out = ["--random-inputs", "-o", str(tmp_path / "o.npz")]
    ones = ", ".join(["1"] * 65)
    flow = tmp_path / "r.flow"
    flow.write_text(
        f"graph g(x: f32[{ones}]) -> (y: f32[{ones}]) {{\n    y = relu(x)\n    return y\n}}\n"
    )
    refused(*run_cli(["eval", str(flow), *out], capsys), "r.flow:1:12: a tensor of rank 65")
    ones64 = ", ".join(["1"] * 64)
    flow.write_text(
        f"graph g(x: f32[{ones64}]) -> (y: f32[{ones64}]) {{\n    t = unsqueeze(x, [0])\n"
        "    y = squeeze(t, [0])\n    return y\n}\n"
    )
    refused(*run_cli(["eval", str(flow), *out], capsys), "r.flow:2:9: output 0 would have rank 65")
    relu = _onnx(tmp_path / "relu.onnx", [helper.make_node("Relu", ["x"], ["y"])], 65)
    refused(*run_cli(["eval", relu, *out], capsys), "graph input 'x' has rank 65")
    unsq = _onnx(
        tmp_path / "unsq.onnx",
        [helper.make_node("Unsqueeze", ["x", "ax"], ["y"])],
        64,
        initializer=[onnx.numpy_helper.from_array(np.array([0], np.int64), "ax")],
    )
    refused(*run_cli(["eval", unsq, *out], capsys), "would have rank 65; flowc holds tensors")


@pytest.mark.parametrize("version", [2**31, 2**40, 2**63 - 1])
def test_opset_version_past_an_int32(
    version: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a TypeError in onnx's schema lookup (its version is an int32)
    model = _onnx(tmp_path / "m.onnx", [helper.make_node("Relu", ["x"], ["y"])], 2, opset=version)
    refused(*run_cli(["inspect", model], capsys), f"opset version {version} of domain 'ai.onnx'")


# -- point 8: stdout, --weights nobody reads, eval --pipeline --------------------------------


def test_write_error_on_stdout_is_an_io_error() -> None:
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "flowc", "ops"], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert r.returncode == 74, r.stderr
    assert "cannot write the output to stdout: No space left on device" in r.stderr
    assert "internal error" not in r.stderr and "Exception ignored" not in r.stderr


class _Failing:
    def __init__(self, code: int) -> None:
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, "failed")

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("code, exit_code, says", [(errno.EIO, 74, "failed"), (errno.EPIPE, 1, "")])
def test_stdout_failures_in_process(
    code: int,
    exit_code: int,
    says: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--help and --version too (click probes and swallows the first error); a closed pipe
    (`flowc ops | head -1`) ends quietly, as before."""
    for args in (["ops"], ["--help"], ["--version"], ["inspect", MLP, "--print-ir"]):
        monkeypatch.setattr(sys, "stdout", _Failing(code))
        got, text = run_cli(args, capsys)
        monkeypatch.undo()
        assert got == exit_code, (args, text)
        assert says in text and "internal error" not in text, text
        if not says:
            assert text == "" or "error" not in text, text


def test_weights_nobody_reads_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "w.npz", w=np.ones(3, np.float32))
    args = ["eval", MLP, "--weights", str(tmp_path / "w.npz"), "--random-inputs"]
    refused(
        *run_cli([*args, "-o", str(tmp_path / "o.npz")], capsys),
        "weights",
        "are given, but the program loads no parameter",
    )
    assert not (tmp_path / "o.npz").exists()


def test_eval_with_a_pipeline_says_it_does_not_simulate_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an AttributeError ('PipelineSpec' object has no attribute 'method')
    args = ["eval", MLP, "--random-inputs", "--pipeline", "2", "-o", str(tmp_path / "o.npz")]
    refused(*run_cli(args, capsys), "--pipeline: flowc eval does not simulate pipeline stages")
