"""Training II's learning task: scikit-learn's handwritten digits (examples/digits.py), an MLP
written as ONNX, trained by `flowc train` exactly as the README says, to at least 95%
held-out accuracy, measured by onnxruntime on the exported model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits.py"


def test_an_mlp_learns_the_digits(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import digits
    finally:
        sys.path.remove(str(EXAMPLE.parent))

    digits.prepare(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "train", str(tmp_path / "digits_mlp.onnx"),
         "--loss", "cross_entropy:logits,labels",
         "--optimizer", "adamw:lr=0.01,weight_decay=0.0001",
         "--data", str(tmp_path / "digits_train.npz"), "--steps", "300", "--batch", "64",
         "--export", str(tmp_path / "digits_trained.onnx"), "--target", "host"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    before = digits.accuracy(tmp_path / "digits_mlp.onnx", tmp_path / "digits_test.npz")
    after = digits.accuracy(tmp_path / "digits_trained.onnx", tmp_path / "digits_test.npz")
    assert before < 0.3 and after >= 0.95, (before, after)
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "evaluate", str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 0 and f"{after:.1%}" in r.stdout, r.stdout + r.stderr
