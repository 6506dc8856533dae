"""One compile path for one device or many: every --precision on one device, --mesh 2,
--mesh 2x2 and a two-stage pipeline, with one stream or the scheduler's choice, compiles the
shared models through the same pass list (the fused ops of one device are the fused ops of
every rank); an all-pairs subset is built and run on the host and compared with onnxruntime,
and built for CUDA (compile and link)."""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS, require_cuda_build_toolchain

from flowc.compiler import Compiled, CompiledPipeline, compile_model
from flowc.errors import FlowcWarning
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import inference_mode, round_to, rounded_model, run_onnxruntime
from flowc.interpreter import random_inputs
from flowc.ir.graph import Graph
from flowc.options import CompileOptions, ModelArgs, ParallelArgs, ScheduleArgs

MODELS = ["mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny"]
PRECISIONS = ["fp32", "tf32", "bf16", "fp16"]
STREAMS: list[int | None] = [1, None]  # None: the scheduler's choice
# The device layouts: one device, --mesh 2, --mesh 2x2, and --mesh 2 --pipeline 2
# --microbatches 2. Models whose batch is fixed to 1 run the pipeline cell with one micro-batch (the cut is
# still there); the others split their batch of 2 into two.
BATCH_ONE = {"gpt2_tiny", "resnet_tiny", "vit_tiny"}
FUSED = ("FusedGemm", "FusedConv", "FusedAttention")
# flowc verify's tolerances (flowc/cli/verify.py), for the programs run here.
TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}


def configs(model: str) -> dict[str, ParallelArgs]:
    return {
        "one": ParallelArgs(),
        "mesh2": ParallelArgs(mesh="2"),
        "mesh2x2": ParallelArgs(mesh="2x2"),
        "pipeline2": ParallelArgs(
            mesh="2", pipeline=2, microbatches=1 if model in BATCH_ONE else 2
        ),
    }


def model_args(name: str) -> ModelArgs:
    dims = ("batch=2", "seq=16") if name == "bert_tiny" else ()
    return ModelArgs(SHARED_MODELS / f"{name}.onnx", dims=dims)


def compile_cell(
    name: str, precision: str, par: ParallelArgs, streams: int | None, out: Path
) -> Compiled | CompiledPipeline:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        return compile_model(
            CompileOptions(
                model_args(name), ScheduleArgs(streams=streams, precision=precision), par
            ),
            out,
        )


def rank_graphs(c: Compiled | CompiledPipeline) -> list[Graph]:
    if isinstance(c, CompiledPipeline):
        return [s.graph for s in c.pipeline.stages]
    return [c.graph]


def fused_ops(graphs: list[Graph]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in graphs:
        for n in g.nodes:
            if n.op in FUSED:
                counts[n.op] = counts.get(n.op, 0) + 1
    return counts


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", MODELS)
def test_every_cell_compiles_with_the_fusions_of_one_device(
    name: str, precision: str, tmp_path: Path
) -> None:
    """Each (device layout, streams) cell compiles; a mesh's rank graph runs the fused ops
    one device runs (one pass list): the same attention and convolution kernels, and at
    least as many fused GEMMs (a mesh splits a fused q/k/v projection into three, so each
    splits by heads); a pipeline's stages together run them all."""
    one: dict[str, int] | None = None
    for label, par in configs(name).items():
        for streams in STREAMS:
            out = tmp_path / f"{label}-{streams}"
            c = compile_cell(name, precision, par, streams, out)
            assert (out / "flowc_model.json").is_file()
            got = fused_ops(rank_graphs(c))
            if one is None:
                one = got
                assert one, f"{name} has no fused op on one device"
            where = f"{label}, streams {streams}: {got} against one device's {one}"
            assert set(got) == set(one), where
            for op in ("FusedAttention", "FusedConv"):
                assert got.get(op) == one.get(op), where
            assert got.get("FusedGemm", 0) >= one.get("FusedGemm", 0), where


# All pairs of (precision, device layout, streams) at least once in 16 runs: every
# (precision, layout) pair, and streams alternating so that each precision and each
# layout runs with both.
LAYOUTS = ["one", "mesh2", "mesh2x2", "pipeline2"]
PAIRS = [
    (p, layout, STREAMS[(i + j) % 2])
    for i, p in enumerate(PRECISIONS)
    for j, layout in enumerate(LAYOUTS)
]
# Most runs use mlp (the quickest to build); an attention model takes one run per precision.
RUN_MODEL = {("bf16", "mesh2"): "bert_tiny", ("fp16", "mesh2x2"): "bert_tiny"}


@functools.cache
def reference(name: str, precision: str) -> tuple[dict[str, np.ndarray], dict, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        from flowc.compiler import load_model

        graph = load_model(model_args(name), compiled=False)
    feeds = random_inputs(graph, seed=3)
    model = inference_mode(onnx.load(str(SHARED_MODELS / f"{name}.onnx")))
    ref = run_onnxruntime(model, feeds)
    rounded = run_onnxruntime(
        rounded_model(model, precision), {k: round_to(v, precision) for k, v in feeds.items()}
    )
    return feeds, ref, rounded


@pytest.mark.parametrize(
    ("precision", "layout", "streams"), PAIRS, ids=[f"{p}-{lay}-{s}" for p, lay, s in PAIRS]
)
def test_all_pairs_run_on_the_host(
    precision: str, layout: str, streams: int | None, tmp_path: Path
) -> None:
    """Built with g++ and run on host ranks (mpirun for a mesh): every output within the
    precision's tolerance of onnxruntime, or (bf16/fp16) within twice what rounding the
    weights and inputs alone costs, as flowc verify judges."""
    name = RUN_MODEL.get((precision, layout), "mlp")
    out = tmp_path / "out"
    compile_cell(name, precision, configs(name)[layout], streams, out)
    build(out, "host", quick=True)
    feeds, ref, rounded = reference(name, precision)
    got, _ = run(out, feeds, target="host")
    for k, r in ref.items():
        err = max_rel_error(got[k], r)
        base = max_rel_error(rounded[k], r)
        bound = max(TOLERANCE[precision], 2 * base if precision in ("bf16", "fp16") else 0.0)
        assert err <= bound, f"{k}: error {err:.3g} > {bound:.3g} (rounding alone {base:.3g})"


@pytest.mark.parametrize(
    ("precision", "layout", "streams"), PAIRS, ids=[f"{p}-{lay}-{s}" for p, lay, s in PAIRS]
)
def test_all_pairs_build_for_cuda(
    precision: str, layout: str, streams: int | None, tmp_path: Path
) -> None:
    """The same cells built for CUDA (nvcc, cuBLASLt, cuDNN, NCCL and MPI): compiled and
    linked without a warning (they run where a GPU is: make gpu-check)."""
    require_cuda_build_toolchain()
    name = RUN_MODEL.get((precision, layout), "mlp")
    out = tmp_path / "out"
    compile_cell(name, precision, configs(name)[layout], streams, out)
    bdir = build(out, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()


MLP = str(SHARED_MODELS / "mlp.onnx")


def test_sbp_with_a_pipeline_fixes_a_layout_on_its_stage(tmp_path: Path) -> None:
    """--sbp with --pipeline 2 on mesh 2x2: the layout is on each stage's two devices, and
    the stage holding the value keeps it."""
    par = ParallelArgs(mesh="2x2", pipeline=2, sbps=("m.0.weight=S(0)",))
    c = compile_cell("mlp", "fp32", par, None, tmp_path / "out")
    assert isinstance(c, CompiledPipeline)
    held = {
        v.name: str(p.plan.value_sbp[v])
        for p in c.pipeline.placements
        for v in p.plan.value_sbp
        if v.name == "m.0.weight"
    }
    assert held == {"m.0.weight": "S(0)"}, held


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--mesh", "2x2", "--pipeline", "2", "--sbp", "nope=S(0)"], ["no value named 'nope'"]),
        (
            ["--pipeline", "2", "--sbp", "m.0.weight=S(0)"],
            ["each stage runs on one device", "--mesh 2x2"],
        ),
        (
            ["--mesh", "2", "--pipeline", "2", "--schedule-for", "memory"],
            ["scheduled for latency only", "hint"],
        ),
    ],
    ids=["unknown-value", "one-device-stages", "schedule-for-memory"],
)
def test_what_stays_refused_says_why(
    args: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from conftest import run_cli

    code, text = run_cli(["compile", MLP, "-o", str(tmp_path / "out"), *args], capsys)
    assert code == 2, text
    for f in fragments:
        assert f in text, text
    assert "Traceback" not in text
    assert not (tmp_path / "out").exists()


def test_schedule_for_memory_on_a_mesh(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from conftest import run_cli

    par = ParallelArgs(mesh="2", sbps=("m.0.weight=S(0)",))
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        c = compile_model(
            CompileOptions(model_args("mlp"), ScheduleArgs(schedule_for="memory"), par), out
        )
    assert isinstance(c, Compiled) and c.physical is not None
    assert c.schedule.num_compute == 1  # the order of least peak memory, on one stream
    code, text = run_cli(
        ["inspect", MLP, "--mesh", "2", "--schedule", "--schedule-for", "memory"], capsys
    )
    assert code == 0, text
    assert "the order of least peak memory on one compute stream" in text


def test_report_with_a_pipeline_draws_the_stages(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from conftest import run_cli

    report = tmp_path / "r"
    code, text = run_cli(
        [
            "inspect",
            MLP,
            "--mesh",
            "2",
            "--pipeline",
            "2",
            "--microbatches",
            "2",
            "--report",
            str(report),
        ],
        capsys,
    )
    assert code == 0, text
    page = (report / "index.html").read_text()
    assert "stage 0" in page and "stage 1" in page
    assert "stage 0&#x27;s program" in page or "stage 0's program" in page


def test_verify_judges_bf16_by_the_rounding_baseline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """mlp in bf16 on two host ranks under a tolerance of 1e-9 (which no bf16 program
    meets): the verdict is the rounding baseline's, error <= 2 x baseline, and the table
    shows both figures."""
    from conftest import run_cli

    code, text = run_cli(
        ["verify", MLP, "--target", "host", "--precision", "bf16", "--mesh", "2", "--tol", "1e-9"],
        capsys,
    )
    assert "rounding to bf16 alone" in text, text
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("y "))
    err, base = (float(x) for x in re.findall(r"\d\.\d\de-\d\d", row)[:2])
    assert err > 1e-9 and 0 < base < 5e-2, row
    passes = err <= 2 * base
    assert ("PASS" in row) == passes and code == (0 if passes else 2), text


GEMMS = ("MatMul", "Gemm", "FusedGemm")
CONVS = ("Conv", "FusedConv")


def megatron(graph: Graph, mesh_shape: tuple[int, ...]) -> dict[str, object]:
    """A hand-set Megatron-style plan of the fused graph on the last mesh axis: a GEMM that
    reads the result of a column-split GEMM (directly, through views and element-wise ops,
    or through the attention of column-split projections) splits its weight's rows and
    leaves partial sums (its bias and residual epilogue taken as P); any other GEMM splits
    its weight's columns; convolutions split output channels."""
    from flowc.ir.layout import fits
    from flowc.ir.types import Mesh, NdSbp, Sbp

    mesh = Mesh("m", mesh_shape)
    last = mesh.ndim - 1
    fixed: dict[str, object] = {}
    by_column: set[object] = set()  # values that carry column-split results

    def put(name: str, shape: tuple[int, ...], axis: int) -> bool:
        sbp = NdSbp(tuple(Sbp("S", axis) if a == last else Sbp("B") for a in range(mesh.ndim)))
        if name not in fixed and fits(shape, sbp, mesh):
            fixed[name] = sbp
            return True
        return False

    for node in graph.nodes:
        w = node.inputs[1] if len(node.inputs) > 1 else None
        data = node.inputs[0] if node.inputs else None
        if node.op == "FusedAttention":
            if any(i in by_column for i in node.inputs[:3]):
                by_column.update(node.outputs)
        elif w is None or w.const is None or node.op not in GEMMS + CONVS:
            # Views and element-wise ops carry a column-split result on.
            if data in by_column:
                by_column.update(node.outputs)
            continue
        elif node.op in CONVS and int(node.attrs.get("group", 1)) == 1:
            put(w.name, w.type.shape, 0)
        elif node.op in GEMMS and w.type.rank == 2:
            if node.attrs.get("b_view"):
                continue
            trans = int(node.attrs.get("transB", 0)) == 1
            n_axis, k_axis = (0, 1) if trans else (1, 0)
            if data in by_column:
                if (
                    put(w.name, w.type.shape, k_axis)
                    and node.attrs.get("activation", "none") == "none"
                ):
                    # Its result as partial sums, reduced once after the epilogue.
                    fixed[node.outputs[0].name] = NdSbp(
                        tuple(Sbp("P") if a == last else Sbp("B") for a in range(mesh.ndim))
                    )
            elif put(w.name, w.type.shape, n_axis):
                by_column.update(node.outputs)
    assert fixed, "the hand-set plan splits nothing"
    return fixed


@pytest.mark.parametrize("mesh", ["2", "2x2"])
@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_fused_graph_in_the_simulator(name: str, mesh: str) -> None:
    """The fused graph (what every compile places) under a Megatron-style plan: every rank
    in the multi-rank simulator, the outputs against onnxruntime; real collectives run."""
    from flowc.compiler import load_model, place, simulate_ranks
    from flowc.parallel import ParallelOptions, parse_mesh

    m = parse_mesh(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        g = load_model(model_args(name), placed=True)
    result = place(g, ParallelOptions(m, "auto", megatron(g, m.shape)))  # type: ignore[arg-type]
    assert any(not st.is_local for _, _, st in result.cost.boxing)
    feeds, ref, _ = reference(name, "bf16")
    outs = simulate_ranks(result, feeds)
    for o, got in zip(g.outputs, outs, strict=True):
        err = max_rel_error(got, ref[o.name])
        assert err < 1e-4, f"{o.name}: error {err:.2e} against onnxruntime"


def test_tensor_parallel_bf16_attention_on_host_ranks(tmp_path: Path) -> None:
    """bert_tiny in bf16 under the Megatron-style plan on two host ranks: attention split by
    heads, a row-split GEMM's partial sums reduced in float32; within bf16's tolerance of
    onnxruntime, or twice the rounding baseline."""
    from flowc.compiler import compile_graph, load_model, place
    from flowc.parallel import ParallelOptions, parse_mesh

    m = parse_mesh("2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        g = load_model(model_args("bert_tiny"), precision="bf16", placed=True)
    result = place(g, ParallelOptions(m, "auto", megatron(g, m.shape)))  # type: ignore[arg-type]
    ops = result.physical.graph.op_counts()
    assert ops.get("FusedAttention") == 2 and ops.get("AllReduce", 0) >= 2, ops
    heads = [
        n.inputs[0].type.shape for n in result.physical.graph.nodes if n.op == "FusedAttention"
    ]
    logical_heads = [n.inputs[0].type.shape for n in g.nodes if n.op == "FusedAttention"]
    assert heads != logical_heads, "attention is not split"
    out = tmp_path / "out"
    compile_graph(
        result.physical.graph, out, prefix="bert", physical=result.physical, precision="bf16"
    )
    build(out, "host", quick=True)
    feeds, ref, rounded = reference("bert_tiny", "bf16")
    got, _ = run(out, feeds, target="host")
    for k, r in ref.items():
        err = max_rel_error(got[k], r)
        base = max_rel_error(rounded[k], r)
        assert err <= max(TOLERANCE["bf16"], 2 * base), f"{k}: {err:.3g} (rounding {base:.3g})"
