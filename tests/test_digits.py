"""Training II's learning task: scikit-learn's handwritten digits (examples/digits.py), an MLP
and a small CNN written as ONNX, each trained by `flowc train` as the README says, to at least
95% held-out accuracy, measured by onnxruntime on the exported model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits.py"


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_model_learns_the_digits(kind: str, tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import digits
    finally:
        sys.path.remove(str(EXAMPLE.parent))

    digits.prepare(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "train", str(tmp_path / f"digits_{kind}.onnx"),
         "--loss", "cross_entropy:logits,labels",
         "--optimizer", "adamw:lr=0.01,weight_decay=0.0001",
         "--data", str(tmp_path / "digits_train.npz"), "--steps", "300", "--batch", "64",
         "--export", str(tmp_path / f"digits_{kind}_trained.onnx"), "--target", "host"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    test = tmp_path / "digits_test.npz"
    before = digits.accuracy(tmp_path / f"digits_{kind}.onnx", test)
    after = digits.accuracy(tmp_path / f"digits_{kind}_trained.onnx", test)
    assert before < 0.3 and after >= 0.95, (before, after)
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "evaluate", str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 0 and f"{kind}: held-out accuracy {after:.1%}" in r.stdout, r.stdout
