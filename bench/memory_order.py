"""The memory-aware node order (``--schedule-for memory``) against the exporter's order.

Per model, on the graph code generation uses (after the compile passes, fp32), on one
stream and without the library workspace (the activations alone, which is what the order
changes): the peak of live bytes the order search minimizes (the memory plan's lower bound
without Concat/Split/Slice aliases) and the memory plan as compiled (arena and lower bound,
aliases where free), for the graph's own node order and for the order
flowc.schedule.memory_order chooses; whether the search was exact (then no order has a
lower peak); the cut points' segments; the search's seconds. A second table does the same
on the imported graph before fusion, which has more nodes and wider segments. A third gives
the arena of the program as compiled (streams, library workspaces and all) with
--schedule-for latency and memory (where the memory order's arena would be larger, the
compiler keeps the exporter's order).

    .venv/bin/python bench/memory_order.py [-o bench/results/memory_order.txt]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from flowc.compiler import plan_schedule, schedule_graph  # noqa: E402
from flowc.frontend.onnx import ImportOptions, import_model, import_onnx  # noqa: E402
from flowc.ir.graph import Graph  # noqa: E402
from flowc.memory.plan import Order, plan_memory  # noqa: E402
from flowc.passes.manager import DEFAULT_PIPELINE, PassManager, compile_pipeline  # noqa: E402
from flowc.schedule.memory_order import memory_order  # noqa: E402

SHARED = ROOT / "tests" / "data" / "models"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
SHARED_MODELS = ["mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny"]


def models() -> Iterator[tuple[str, Graph]]:
    """Each model as imported (no passes yet)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in SHARED_MODELS:
            dims = {"batch": 2, "seq": 32} if name == "bert_tiny" else {}
            yield name, import_onnx(SHARED / f"{name}.onnx", ImportOptions(dims=dims))
        for path in sorted(LIGHT.glob("*.onnx")):
            yield path.stem.removeprefix("light_"), import_onnx(path)
        import gpt2_graph

        model = gpt2_graph.gpt2_model(
            layers=12, hidden=768, heads=12, seq=128, batch=1, vocab=50257, weights="fill"
        )
        yield "gpt2_small (12 layers)", import_model(model)


def order_row(name: str, graph: Graph) -> tuple[str, bool]:
    """One table row: exporter vs chosen order; and whether the chosen arena is no larger."""
    t0 = time.perf_counter()
    mo = memory_order(graph)
    seconds = time.perf_counter() - t0
    exporter, chosen = Order.linear(graph), Order.linear(graph, mo.nodes)
    # The order's cost model: no Concat/Split/Slice aliases.
    ex0 = plan_memory(graph, exporter, alias=False)
    ch0 = plan_memory(graph, chosen, alias=False)
    assert ch0.lower_bound == mo.peak and ex0.lower_bound == mo.exporter_peak
    # The plan as compiled: aliases where they are free.
    ex, ch = plan_memory(graph, exporter), plan_memory(graph, chosen)
    ok = ch.arena_bytes <= ex.arena_bytes
    row = (
        f"{name:24} {len(ex.steps):6} {mo.segments:5} {mo.largest_segment:5} {mo.states:8}"
        f" {ex0.lower_bound:10} {ch0.lower_bound:10} {ch0.lower_bound / ex0.lower_bound:6.3f}"
        f" {ex.arena_bytes:10} {ex.lower_bound:10} {ch.arena_bytes:10} {ch.lower_bound:10}"
        f" {ch.arena_bytes / ex.arena_bytes:6.3f} {'yes' if mo.exact else 'no':>5} {seconds:7.3f}"
    )
    return row, ok


HEADER = (
    f"{'model':24} {'actors':>6} {'segs':>5} {'max':>5} {'states':>8}"
    f" {'exp peak':>10} {'mem peak':>10} {'ratio':>6}"
    f" {'exp arena':>10} {'exp bound':>10} {'mem arena':>10} {'mem bound':>10} {'ratio':>6}"
    f" {'exact':>5} {'seconds':>7}"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "bench/results/memory_order.txt")
    a = ap.parse_args(argv)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    tables = [
        ("compiled graph (after the fp32 compile passes: what flowc compile orders)", "compiled"),
        ("imported graph before fusion (more nodes, wider segments)", "default"),
    ]
    all_ok = True
    compiled_graphs: list[tuple[str, Graph]] = []
    for title, kind in tables:
        say(f"# {title}")
        say(
            "# one stream, no library workspace, bytes. peak: the order's cost model (no "
            "Concat/Split/Slice aliases); arena, bound: the memory plan (aliases where free); "
            "ratio: memory order / exporter's; seconds: the order search"
        )
        say(HEADER)
        for name, imported in models():
            passes = compile_pipeline("fp32") if kind == "compiled" else DEFAULT_PIPELINE
            graph = PassManager(passes).run(imported)
            if kind == "compiled":
                compiled_graphs.append((name, graph))
            row, ok = order_row(name, graph)
            all_ok &= ok
            say(row)
        say()
    say("# as compiled: arena of the program (streams, library workspaces), bytes")
    say(f"{'model':24} {'latency':>11} {'streams':>7} {'memory':>11} {'streams':>7} {'ratio':>6}")
    for name, graph in compiled_graphs:
        lat = schedule_graph(graph)
        mem = schedule_graph(graph, schedule_for="memory")
        la, ma = plan_schedule(lat).arena_bytes, plan_schedule(mem).arena_bytes
        say(f"{name:24} {la:11} {lat.num_compute:7} {ma:11} {mem.num_compute:7} {ma / la:6.3f}")
    say()
    say("memory order's arena <= exporter order's on every model: " + ("yes" if all_ok else "NO"))
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.output}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
