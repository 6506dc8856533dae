"""BERT-base (Hugging Face transformers' BertModel at its default sizes, no pooler, random
weights with a fixed seed; nothing is downloaded) exported to ONNX with a dynamic batch and
sequence, the way bench/gpu/gpu_check.py's `dynamic` command compiles it: the TorchScript
exporter, opset 17, `input_ids` and `attention_mask` int64 [batch, seq], output
`last_hidden_state` [batch, seq, 768] (the recipe of tests/data/models/bert_tiny.onnx).

    python3 export_dynamic.py OUT.onnx [--tiny]

Runs where torch and transformers are (the GPU machine); --tiny: BERT's tiny sizes, to
check the script on a CPU.
"""

import argparse

import torch
import transformers as T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = (
        T.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
        )
        if a.tiny
        else T.BertConfig()
    )
    model = T.BertModel(cfg, add_pooling_layer=False).eval()

    class Out(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(
            Out().eval(),
            (ids, mask),
            a.out,
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes},
            opset_version=17,
            dynamo=False,
        )
    print(f"wrote {a.out} (vocab {cfg.vocab_size}, hidden {cfg.hidden_size})")


if __name__ == "__main__":
    main()
