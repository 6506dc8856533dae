"""The pipeline on the command line: inspect's partition and micro-batch simulations, the
stage times of a compile, and clear errors for what cannot be pipelined."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SHARED_MODELS, run_cli

MLP = str(SHARED_MODELS / "mlp.onnx")
BERT = str(SHARED_MODELS / "bert_tiny.onnx")


def test_inspect_1f1b_keeps_at_most_p_minus_s_in_flight(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "1f1b.png"
    args = ["inspect", BERT, "--dim", "batch=8", "--dim", "seq=32", "--pipeline", "4"]
    code, text = run_cli(
        [
            *args,
            "--microbatches",
            "8",
            "--schedule",
            "--pipeline-schedule",
            "1f1b",
            "--gantt",
            str(png),
        ],
        capsys,
    )
    assert code == 0, text
    assert "4 stages (automatic)" in text
    for s in range(4):
        m = re.search(rf"stage {s}: forward .* at most (\d+) micro-batch", text)
        assert m is not None and int(m.group(1)) == 4 - s, text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # GPipe on the same stages: every forward of a stage before the next micro-batch's.
    code, text = run_cli([*args, "--microbatches", "8", "--schedule"], capsys)
    assert code == 0, text
    assert "order F0 F1 F2 F3 F4 F5 F6 F7" in text


def test_compile_prints_every_stage_time(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, text = run_cli(
        ["compile", MLP, "-o", str(tmp_path / "out"), "--pipeline", "2", "--print-pass-times"],
        capsys,
    )
    assert code == 0, text
    for stage in (
        "import",
        "pass fold_constants",
        "micro-batches",
        "stage partition",
        "schedule",
        "memory plan",
        "code generation",
        "write",
        "total",
    ):
        assert re.search(rf"^  {stage}: [0-9.]+ ms$", text, re.M), (stage, text)
    schedule = (tmp_path / "out" / "schedule.json").read_text()
    assert '"stage": 1' in schedule


STAGED = """graph mlp(x: f32[8, 64]) -> (y: f32[8, 10]) {
    param w1: f32[64, 256] = normal(0.0, 0.125)
    param w2: f32[256, 10] = normal(0.0, 0.0625)
    stage 0 {
        h = relu(x @ w1)
    }
    stage 1 {
        y = softmax(h @ w2, axis=-1)
    }
    return y
}
"""


def test_dsl_stage_blocks_are_the_cuts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    program = tmp_path / "staged.flow"
    program.write_text(STAGED)
    code, text = run_cli(
        ["inspect", str(program), "--pipeline", "2", "--microbatches", "2"], capsys
    )
    assert code == 0, text
    assert "2 stages (manual)" in text
    assert re.search(r"cut 0 -> 1: 1 values, 4096 B, .*: h$", text, re.M), text
    code, text = run_cli(["inspect", str(program), "--pipeline", "3"], capsys)
    assert code == 2 and "numbered 0, 1" in text, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--microbatches", "2"], "--microbatches need"),
        (["--pipeline", "3", "--mesh", "2x2"], "mesh axis 0 is the pipeline axis"),
        (["--pipeline", "2", "--microbatches", "3"], "does not split into 3 micro-batches"),
        (["--pipeline", "2", "--stage-boundary", "nope"], "nope"),
        (["--pipeline", "9"], "pipeline stages"),
        (["--pipeline-schedule", "1f1b"], "--pipeline-schedule needs"),
    ],
)
def test_pipeline_errors_are_clear(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cmd = "inspect" if "--pipeline-schedule" in args else "compile"
    extra = [] if cmd == "inspect" else ["-o", str(tmp_path / "out")]
    code, text = run_cli([cmd, MLP, *extra, *args], capsys)
    assert code == 2, text
    assert message in text, text
    assert "Traceback" not in text
    assert not (tmp_path / "out" / "model.cu").exists()
