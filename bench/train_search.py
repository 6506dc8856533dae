"""The placement search on a GPT-2-small-size training step (issue 30's figure): the step
(forward, backward, AdamW) of bench/gpt2_graph.py's model placed by `--parallel auto` on
2x2 and 2x4 meshes, with and without a memory limit; per mesh, the search's wall time
(the ILP with the state constraint: each state input and its next value in one layout),
the plan's modeled step time beside the data plan's (SBP propagation), the state and
arena per rank, and the search's choice per parameter group; then again under a memory
limit halfway from the unlimited plan's stored bytes to the least any plan can store.

    .venv/bin/python bench/train_search.py                       # 12 layers, hidden 768
    .venv/bin/python bench/train_search.py --layers 2 --meshes 2x2

The model is GPT-2 small's twelve blocks (hidden 768, 12 heads, sequence 128; 85M
parameters; ``--vocab`` adds the embeddings and the tied head) with an MSE on the last
block's output: random weights (the search's costs read only shapes, but a training step's
parameters are the model's initializers). Results: bench/results/train_search.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt2_graph import gpt2_model

from flowc.api import compile_options
from flowc.compiler import load_training, parallelize, placement_target
from flowc.errors import FlowcWarning, InputError
from flowc.parallel.cost import evaluate_plan
from flowc.trainer import spec_from, state_placement
from flowc.training.zero import rank_state_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--meshes", default="2x2,2x4")
    ap.add_argument(
        "--mem-limit-frac",
        type=float,
        default=0.5,
        help="also search under a limit that takes this fraction of the way from the unlimited "
        "plan's stored bytes to the least possible (the state split over every device)",
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt2.onnx"
        t0 = time.perf_counter()
        model = gpt2_model(
            args.layers, args.hidden, args.heads, args.seq, args.batch, args.vocab,
            external=Path(tmp) / "gpt2.onnx.data",
        )  # fmt: skip
        onnx.save(model, str(path))
        out = "logits" if args.vocab else model.graph.output[0].name
        spec = spec_from(f"mse:{out},target", "adamw:lr=0.0001")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FlowcWarning)
            base = compile_options(path)
            step = load_training(base.model, spec, batch=args.batch)
        built = time.perf_counter() - t0
        n_params = sum(v.type.numel for v in step.graph.inputs if v.name in step.params)
        whole_p, whole_m = rank_state_bytes(step.graph, step)
        print(
            f"GPT-2 training step: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
            f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}: {len(step.graph.nodes)} "
            f"nodes, {n_params / 1e6:.1f}M parameters, state {(whole_p + whole_m) / 2**20:.0f} MiB "
            f"(built in {built:.1f} s)"
        )
        for mesh in args.meshes.split(","):
            limits: list[int | None] = [None]
            for limit in limits:
                opts = compile_options(
                    path, mesh=mesh, parallel="auto",
                    **({"mem_limit": str(limit)} if limit else {}),
                )  # fmt: skip
                placement = placement_target(opts.model, opts.parallel)
                assert placement is not None
                t0 = time.perf_counter()
                try:
                    placed = parallelize(step.graph, dataclasses.replace(placement, streams=1))
                except InputError as e:  # a limit the search cannot meet: reported
                    print(f"  mesh {mesh}, limit {limit}: {type(e).__name__}: {e}")
                    continue
                took = time.perf_counter() - t0
                if limit is None and args.mem_limit_frac:
                    # Then under a limit this plan does not meet, by its state (the search
                    # bounds stored bytes; activations it does not model): it must trade,
                    # down to the fraction of the way to the least any plan stores (the
                    # state split over every device).
                    stored_now = placed.memory.total - placed.memory.arena
                    least = (whole_p + whole_m) // placement.mesh.size
                    target = stored_now - args.mem_limit_frac * (stored_now - least)
                    limits.append(placed.memory.arena + int(target))
                cost = evaluate_plan(step.graph, placed.plan, placed.profile)
                data_opts = dataclasses.replace(placement, method="data", streams=1, mem_limit=None)
                data = parallelize(step.graph, data_opts)
                dcost = evaluate_plan(step.graph, data.plan, data.profile)
                params, moments = rank_state_bytes(placed.physical.graph, step)
                stats = placed.plan.stats
                shown = "none" if limit is None else f"{limit / 2**20:.0f} MiB"
                print(
                    f"  mesh {mesh}, --mem-limit {shown}: search + lowering {took:.1f} s "
                    f"(solve {stats.get('solve_s', 0.0):.2f} s, {int(stats.get('variables', 0))} ILP "
                    f"variables, optimal {bool(stats.get('optimal', 0))}, attempt {placed.attempts}); "
                    f"modeled step {cost.total_s * 1e3:.2f} ms (compute {cost.compute_s * 1e3:.2f}, "
                    f"comm {cost.comm_s * 1e3:.2f}) vs data plan {dcost.total_s * 1e3:.2f} ms; state "
                    f"per rank {(params + moments) / 2**20:.0f} MiB, arena {placed.memory.arena / 2**20:.0f} MiB"
                )
                for line in state_placement(step, placed.plan):
                    kind, names = line.split(": ", 1)
                    print(f"    {kind}: {len(names.split(', '))} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
