"""The PyTorch side of the training check (bench/gpu/train_check.py): a GPT-2 (GPT2LMHeadModel,
seeded random weights, dropout off) exported to ONNX for flowc, then trained with PyTorch
eager on the same batches: the loss of each step and each step's time.

Runs under a Python that has torch and transformers (python3 on the GPU machine), in a
process of its own so that the flowc side needs neither.

    torch_train.py --out-dir DIR [--layers 12] [--seq 512] [--batch 8] [--steps 20]
                   [--precisions fp32,tf32] [--lr 1e-4] [--tiny]

Writes DIR/gpt2_train.onnx (input_ids [batch, seq] -> logits), DIR/tokens.npz (input_ids and
the next-token labels, the last position -100: ignored, steps * batch rows) and
DIR/torch_train.json: per precision, the losses and per-step times (CUDA events), the
optimizer AdamW(lr, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01) on every parameter,
each precision from the same initial weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers as T


class Logits(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids).logits


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precisions", default="fp32,tf32")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tiny", action="store_true", help="n_embd 64, 2 heads: the dry run's size")
    a = ap.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    size = {"n_embd": 64, "n_head": 2} if a.tiny else {}
    cfg = T.GPT2Config(
        n_layer=a.layers,
        n_positions=max(1024, a.seq),
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **size,
    )
    model = Logits(T.GPT2LMHeadModel(cfg)).eval()
    initial = copy.deepcopy(model.state_dict())
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (a.steps * a.batch, a.seq + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:].copy()
    labels[:, -1] = -100  # as flowc's data: the last position counts for nothing
    np.savez(a.out_dir / "tokens.npz", input_ids=inputs, labels=labels)
    t0 = time.time()
    with torch.no_grad():
        torch.onnx.export(
            model,
            (torch.from_numpy(inputs[: a.batch]),),
            str(a.out_dir / "gpt2_train.onnx"),
            input_names=["input_ids"],
            output_names=["logits"],
            opset_version=18,
            dynamo=True,
            optimize=True,
            external_data=False,
        )
    info: dict[str, object] = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": T.__version__,
        "export_s": round(time.time() - t0, 1),
        "layers": a.layers,
        "seq": a.seq,
        "batch": a.batch,
        "lr": a.lr,
        "results": {},
    }
    for precision in a.precisions.split(","):
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        model.load_state_dict(initial)
        m = model.to(dev).train()
        opt = torch.optim.AdamW(
            m.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
        )
        losses, times = [], []
        for s in range(a.steps):
            x = torch.from_numpy(inputs[s * a.batch : (s + 1) * a.batch]).to(dev)
            y = torch.from_numpy(labels[s * a.batch : (s + 1) * a.batch]).to(dev)
            start, end = (
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                if dev == "cuda"
                else (None, None)
            )
            wall = time.perf_counter()
            if start is not None:
                start.record()
            opt.zero_grad(set_to_none=True)
            logits = m(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100
            )
            loss.backward()
            opt.step()
            if end is not None:
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))  # type: ignore[union-attr]
            else:
                times.append((time.perf_counter() - wall) * 1e3)
            losses.append(float(loss))
            print(f"torch {precision} step {s + 1}: loss {losses[-1]:.6f} ({times[-1]:.2f} ms)")
        info["results"][precision] = {  # type: ignore[index]
            "losses": losses,
            "step_ms": times,
            # The first steps warm the allocator and cuBLAS up.
            "median_step_ms": statistics.median(times[3:] or times),
        }
        model = m.cpu()
    (a.out_dir / "torch_train.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
