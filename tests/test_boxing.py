"""Boxing: every layout pair converts correctly in the multi-rank simulator, and each step
costs what DESIGN.md's table says."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flowc.ir.dtype import DType
from flowc.ir.layout import all_coords, fits, nd_sbps, shard, unshard
from flowc.ir.types import Mesh, NdSbp, Sbp, TensorType
from flowc.parallel import boxing as bx
from flowc.parallel.lower import lower_boxing
from flowc.parallel.simulate import run_physical


def convert(x: np.ndarray, mesh: Mesh, src: NdSbp, dst: NdSbp, seed: int = 0) -> np.ndarray:
    """Shard x as src (random partial parts for P), run the lowered boxing on every rank,
    and read the result back as dst."""
    t = TensorType(x.shape, DType.from_numpy(x.dtype))
    phys = lower_boxing(t, mesh, src, dst)
    rng = np.random.default_rng(seed)
    coords = all_coords(mesh)
    feeds = {phys.graph.inputs[0]: {c: shard(x, src, mesh, c, rng) for c in coords}}
    env = run_physical(phys, feeds)
    out = {c: env[c][phys.graph.outputs[0]] for c in coords}
    return unshard(out, dst, mesh)


def layouts(rank: int, mesh: Mesh, shape: tuple[int, ...]) -> list[NdSbp]:
    return [s for s in nd_sbps(rank, mesh) if fits(shape, s, mesh)]


def test_all_pairs_2x2_rank2() -> None:
    mesh = Mesh("m", (2, 2))
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    pairs = list(itertools.product(layouts(2, mesh, x.shape), repeat=2))
    assert len(pairs) == 16 * 16
    for src, dst in pairs:
        y = convert(x, mesh, src, dst)
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5, err_msg=f"{src} -> {dst}")


@pytest.mark.parametrize(
    "mesh_shape,shape", [((4,), (8, 12)), ((2, 3), (6, 12)), ((3, 2), (12, 6))]
)
def test_all_pairs_other_meshes(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> None:
    mesh = Mesh("m", mesh_shape)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    for src, dst in itertools.product(layouts(2, mesh, shape), repeat=2):
        np.testing.assert_allclose(
            convert(x, mesh, src, dst), x, atol=1e-5, err_msg=f"{src} -> {dst}"
        )


def test_sample_of_3d_mesh_rank3() -> None:
    mesh = Mesh("m", (2, 2, 2))
    shape = (8, 4, 4)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    all_pairs = list(itertools.product(layouts(3, mesh, shape), repeat=2))
    rng = np.random.default_rng(4)
    for k in rng.choice(len(all_pairs), size=300, replace=False):
        src, dst = all_pairs[int(k)]
        np.testing.assert_allclose(
            convert(x, mesh, src, dst), x, atol=1e-5, err_msg=f"{src} -> {dst}"
        )


def test_integer_tensors_convert_exactly() -> None:
    mesh = Mesh("m", (2, 2))
    x = np.arange(32, dtype=np.int64).reshape(4, 8)
    for src, dst in itertools.product(layouts(2, mesh, x.shape), repeat=2):
        assert np.array_equal(convert(x, mesh, src, dst), x), f"{src} -> {dst}"


S0, S1, B, P = Sbp("S", 0), Sbp("S", 1), Sbp("B"), Sbp("P")


@pytest.mark.parametrize(
    "src,dst,collective,factor",
    [
        (P, B, bx.ALL_REDUCE, (2, 3, 4)),  # 2(p-1)/p T
        (P, S0, bx.REDUCE_SCATTER, (1, 3, 4)),  # (p-1)/p T
        (S0, B, bx.ALL_GATHER, (1, 3, 4)),
        (S0, S1, bx.ALL_TO_ALL, (1, 3, 16)),  # (p-1)/p^2 T
        (B, S1, bx.LOCAL_SLICE, (0, 1, 1)),
        (B, P, bx.B_TO_P, (0, 1, 1)),
    ],
)
def test_one_step_costs_follow_the_table(
    src: Sbp, dst: Sbp, collective: str, factor: tuple[int, int, int]
) -> None:
    mesh = Mesh("m", (4,))
    t = TensorType((64, 32), DType.F32)
    steps = bx.boxing_steps(t, mesh, NdSbp((src,)), NdSbp((dst,)))
    assert [s.collective for s in steps] == [collective]
    k, num, den = factor
    assert steps[0].bytes_per_rank == k * num * t.nbytes // den


def test_nd_chunk_order_needs_inner_axis_first() -> None:
    # (S(0), S(0)) -> (B, S(0)): gathering along mesh axis 0 first would interleave chunks,
    # so the sound path gathers the inner axis and re-slices.
    mesh = Mesh("m", (2, 2))
    t = TensorType((8, 4), DType.F32)
    steps = bx.boxing_steps(t, mesh, NdSbp((S0, S0)), NdSbp((B, S0)))
    assert steps and steps[0].mesh_axis == 1
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert np.array_equal(convert(x, mesh, NdSbp((S0, S0)), NdSbp((B, S0))), x)


def test_same_layout_needs_nothing_and_bad_layouts_fail() -> None:
    mesh = Mesh("m", (2,))
    t = TensorType((3, 4), DType.F32)
    assert bx.boxing_steps(t, mesh, NdSbp((B,)), NdSbp((B,))) == []
    with pytest.raises(bx.BoxingError, match="does not fit"):
        bx.boxing_steps(t, mesh, NdSbp((B,)), NdSbp((S0,)))
