"""Sharded checkpoints (flowc/checkpoint.py, issue 30): the slices each rank saved, a
manifest written last, and any other cut of the tensors assembled from them at load
(compared with NumPy slicing of the whole tensor). A save cut short leaves the previous
checkpoint; damaged or foreign folders are refused with the file named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flowc import checkpoint
from flowc.api import StateShard, state_shard
from flowc.errors import InputError

WHOLE = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) * 0.5


def _save_split(folder: Path, step: int, chunks: int, axis: int, tag: str = "t") -> Path:
    """WHOLE saved as ``chunks`` slices along ``axis``, one part per rank, and a scalar."""
    files = []
    for r, piece in enumerate(np.split(WHOLE, chunks, axis=axis)):
        extra = {"train/step": np.asarray(step, np.int64)} if r == 0 else {}
        checkpoint.write_part(folder, f"{tag}{step}", r, step, {"w": piece, **extra})
        files.append(checkpoint.part_file(r))
    tensors = {
        "w": checkpoint.Saved(WHOLE.shape, WHOLE.dtype, axis, tuple(files)),
        "train/step": checkpoint.Saved((), np.dtype(np.int64), -1, (files[0],)),
    }
    return checkpoint.commit(folder, f"{tag}{step}", step, {"batch": 4}, tensors)


@pytest.mark.parametrize("saved_axis, saved_chunks", [(0, 4), (1, 3), (-1, 1)])
def test_every_cut_assembles_from_the_saved_slices(
    tmp_path: Path, saved_axis: int, saved_chunks: int
) -> None:
    _save_split(tmp_path, 7, saved_chunks, max(saved_axis, 0))
    ckpt = checkpoint.read(tmp_path)
    assert ckpt.step == 7 and ckpt.info["batch"] == 4
    assert np.array_equal(checkpoint.load_whole(ckpt)["w"], WHOLE)
    parts = checkpoint._Parts(ckpt)
    try:
        for axis, chunks in [(0, 2), (0, 8), (1, 2), (1, 4), (1, 6), (-1, 1)]:
            for c in range(chunks):
                shard = StateShard("w", WHOLE.shape, WHOLE.dtype, axis, chunks, c, True)
                start, size = shard.box(c)
                want = WHOLE[tuple(slice(a, a + n) for a, n in zip(start, size, strict=True))]
                assert np.array_equal(checkpoint.assemble(parts, "w", start, size), want)
    finally:
        parts.close()


def test_a_rank_of_a_mesh_holds_the_chunk_model_cu_gives_it() -> None:
    """Split over mesh axis 1 of a 2x2 mesh: ranks (0,0),(1,0) hold chunk 0, (0,1),(1,1)
    chunk 1; the ranks at coordinate 0 of axis 0 save them."""
    entry = {"name": "w", "shape": [8, 12], "dtype": "f32", "split_axis": 1, "split_mesh_axes": 2}
    got = [(s.chunk, s.chunks, s.saves) for s in (state_shard(entry, (2, 2), r) for r in range(4))]
    assert got == [(0, 2, True), (1, 2, True), (0, 2, False), (1, 2, False)]
    both = {**entry, "split_mesh_axes": 3}
    assert [state_shard(both, (2, 2), r).chunk for r in range(4)] == [0, 1, 2, 3]
    assert state_shard(both, (2, 2), 3).local_shape == (8, 3)


class _FakeModel:
    """What load_model asks of a Model: its state, this rank's cut, and a write."""

    def __init__(self, shards: dict[str, StateShard]) -> None:
        self.shards = shards
        self.written: dict[str, np.ndarray] = {}

    def state_names(self) -> list[str]:
        return list(self.shards)

    def write_local(self, values: dict[str, Any]) -> None:
        self.written.update(values)


def test_a_checkpoint_of_4_ranks_loads_on_2_ranks_split_another_way(tmp_path: Path) -> None:
    _save_split(tmp_path, 3, 4, 0)
    ckpt = checkpoint.read(tmp_path)
    for rank in range(2):
        model = _FakeModel(
            {
                "w": StateShard("w", WHOLE.shape, WHOLE.dtype, 1, 2, rank, True),
                "train/step": StateShard("train/step", (), np.dtype(np.int64), -1, 1, 0, True),
            }
        )
        checkpoint.load_model(ckpt, model)  # type: ignore[arg-type]
        assert np.array_equal(model.written["w"], WHOLE[:, rank * 6 : (rank + 1) * 6])
        assert int(model.written["train/step"]) == 3


def test_a_save_cut_short_leaves_the_last_checkpoint(tmp_path: Path) -> None:
    """Parts of step 10 written but no manifest (a rank died before the others finished):
    the checkpoint is still step 5's. Once step 10 commits, step 5's part files go and
    nothing else: a file of the user's in its folder keeps the folder."""
    _save_split(tmp_path, 5, 2, 0)
    checkpoint.write_part(tmp_path, "t10", 0, 10, {"w": np.zeros((4, 12), np.float32)})
    ckpt = checkpoint.read(tmp_path)
    assert ckpt.step == 5 and np.array_equal(checkpoint.load_whole(ckpt)["w"], WHOLE)
    (tmp_path / "t5" / "notes.txt").write_text("mine")
    (tmp_path / "keep.txt").write_text("mine too")
    _save_split(tmp_path, 10, 2, 0)
    assert checkpoint.read(tmp_path).step == 10
    assert sorted(p.name for p in (tmp_path / "t5").iterdir()) == ["notes.txt"]
    assert (tmp_path / "keep.txt").read_text() == "mine too"
    _save_split(tmp_path, 15, 1, 0, tag="u")
    assert not (tmp_path / "t10").exists()


def test_a_part_missing_or_of_another_step_is_refused(tmp_path: Path) -> None:
    _save_split(tmp_path, 5, 2, 0)
    part = tmp_path / "t5" / checkpoint.part_file(1)
    part.rename(tmp_path / "moved.npz")
    with pytest.raises(InputError, match=r"t5/rank-00001\.npz is missing"):
        checkpoint.load_whole(checkpoint.read(tmp_path))
    checkpoint.write_part(tmp_path, "t5", 1, 4, {"w": np.zeros((4, 12), np.float32)})
    with pytest.raises(InputError, match="holds step 4, the manifest step 5"):
        checkpoint.load_whole(checkpoint.read(tmp_path))
    part.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(InputError, match="is not readable"):
        checkpoint.load_whole(checkpoint.read(tmp_path))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.update(parts="../elsewhere"), "is not a name"),
        (lambda m: m["tensors"]["w"].update(files=["/etc/passwd"]), "are not names"),
        (lambda m: m["tensors"]["w"].update(shape=[7, 12]), r"2 slices of \[7, 12\]"),
        (lambda m: m.update(format=9), "not a flowc checkpoint manifest of format 2"),
        (lambda m: m.pop("step"), "not readable"),
    ],
)
def test_a_damaged_manifest_is_refused(tmp_path: Path, change: Any, message: str) -> None:
    _save_split(tmp_path, 5, 2, 0)
    path = tmp_path / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=message):
        checkpoint.read(tmp_path)


def test_no_manifest_is_no_checkpoint(tmp_path: Path) -> None:
    checkpoint.write_part(tmp_path, "t5", 0, 5, {"w": WHOLE})
    with pytest.raises(InputError, match="no checkpoint there"):
        checkpoint.read(tmp_path)
    (tmp_path / checkpoint.MANIFEST).write_text("{")
    with pytest.raises(InputError, match=r"checkpoint\.json is not readable"):
        checkpoint.read(tmp_path)


def test_a_format_1_checkpoint_still_loads(tmp_path: Path) -> None:
    meta = {"format": 1, "step": 4, "batch": 2}
    np.savez(
        tmp_path / checkpoint.LEGACY,
        __meta__=np.asarray(json.dumps(meta)),
        **{"state/w": WHOLE, "train/lr": np.float32(0.5)},  # type: ignore[arg-type]
    )
    ckpt = checkpoint.read(tmp_path)
    assert ckpt.step == 4
    state = checkpoint.load_whole(ckpt)
    assert np.array_equal(state["w"], WHOLE) and float(state["train/lr"]) == 0.5


class _FakeRank:
    """One rank of a 2-rank data-parallel model (everything whole: rank 0 saves it all),
    as save_model sees it."""

    def __init__(self, rank: int) -> None:
        self.rank, self.ranks = rank, 2
        self.shards = {"w": self.shard_on("w", rank)}

    def shard_on(self, name: str, rank: int) -> StateShard:
        return StateShard(name, WHOLE.shape, WHOLE.dtype, -1, 1, 0, rank == 0)

    def state_names(self) -> list[str]:
        return ["w"]

    def read_local(self, names: list[str]) -> dict[str, np.ndarray]:
        return {n: WHOLE for n in names}

    def all_ok(self, ok: bool) -> bool:
        return ok


def test_ranks_that_save_nothing_write_no_part_and_old_parts_go(tmp_path: Path) -> None:
    """A rank whose tensors another rank saves writes no file, so once a later checkpoint
    commits, the earlier one's folder is empty and removed (ranks called in turn, rank 0
    last: it writes the manifest after the others' parts)."""
    for step, run in ((5, "a"), (10, "a")):
        assert checkpoint.save_model(tmp_path, _FakeRank(1), step, {}, run) is None  # type: ignore[arg-type]
        assert (
            checkpoint.save_model(tmp_path, _FakeRank(0), step, {}, run)
            == tmp_path / checkpoint.MANIFEST
        )  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json", "step-00000010-a"]
    assert [p.name for p in (tmp_path / "step-00000010-a").iterdir()] == ["rank-00000.npz"]
    assert np.array_equal(checkpoint.load_whole(checkpoint.read(tmp_path))["w"], WHOLE)
