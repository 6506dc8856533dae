"""flowc.memory.placement: the placer against brute-force optima on small random instances,
the independent checker on hand-made bad placements, the MiniMalloc CSV mapping (half-open
lifetimes), `flowc plan-memory`, determinism, and that the module stands alone."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from flowc.memory.placement import (
    Interval,
    PlacementError,
    check_placement,
    lower_bound,
    place,
    read_csv,
)

# -- brute force (written apart from the placer: steps as sets, offsets enumerated) ----------


def steps(iv: Interval) -> set[int]:
    return set(range(iv.start, iv.end))


def brute_force_peak(ivs: list[Interval]) -> int:
    """The lowest peak over every assignment of aligned offsets (branch and bound on the
    peak: offsets are enumerated from 0 up to below the best peak found so far)."""
    order = sorted(ivs, key=lambda iv: -iv.size)
    best = sum(iv.size + iv.align for iv in ivs) + 1
    chosen: list[tuple[Interval, int]] = []

    def rec(k: int, peak: int) -> None:
        nonlocal best
        if k == len(order):
            best = min(best, peak)
            return
        iv = order[k]
        for off in range(0, best - iv.size, iv.align):
            clash = any(
                steps(iv) & steps(o) and off < oo + o.size and oo < off + iv.size
                for o, oo in chosen
            )
            if iv.size and clash:
                continue
            chosen.append((iv, off))
            rec(k + 1, max(peak, off + iv.size))
            chosen.pop()

    rec(0, 0)
    return best


def brute_force_lower_bound(ivs: list[Interval]) -> int:
    times = {t for iv in ivs for t in steps(iv)}
    return max((sum(iv.size for iv in ivs if t in steps(iv)) for t in times), default=0)


def random_instance(rng: random.Random, n: int, aligns: tuple[int, ...] = (1,)) -> list[Interval]:
    out = []
    for i in range(n):
        a = rng.randrange(0, 6)
        out.append(Interval(i, a, a + rng.randrange(1, 5), rng.randrange(1, 5), rng.choice(aligns)))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_exact_search_reaches_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    ivs = random_instance(rng, rng.randrange(1, 7), aligns=(1, 1, 2, 4) if seed % 2 else (1,))
    result = place(ivs, work_limit=20_000)
    check_placement(ivs, result.offsets)
    assert result.peak == max(result.offsets[iv.id] + iv.size for iv in ivs)
    assert result.peak == brute_force_peak(ivs)
    assert result.lower_bound == brute_force_lower_bound(ivs) == lower_bound(ivs)
    # Within the limit the search finishes, so the optimum is proven.
    assert result.optimal


@pytest.mark.parametrize("seed", range(20))
def test_greedy_alone_is_valid_and_not_below_the_optimum(seed: int) -> None:
    rng = random.Random(1000 + seed)
    ivs = random_instance(rng, 6, aligns=(1, 2))
    result = place(ivs, exact=False)
    check_placement(ivs, result.offsets)
    assert result.peak >= brute_force_peak(ivs) >= result.lower_bound


@pytest.mark.parametrize("seed", range(25))
def test_every_search_strategy_alone_is_exact(seed: int) -> None:
    # place() stops at the first strategy that finishes, on small instances always the
    # first; here each one (the dynamic ones restart split groups from their lowest
    # offsets with new ranks) must fit the brute-force optimum and prove the byte below
    # it impossible. Lifetimes spread over 10 steps so that placements split the rest.
    from flowc.memory.placement import _Problem, _Search

    rng = random.Random(5000 + seed)
    ivs = []
    for i in range(6):
        a = rng.randrange(0, 9)
        ivs.append(Interval(i, a, a + rng.randrange(1, 5), rng.randrange(1, 5)))
    p = _Problem(ivs)
    for group in p.components():
        search = _Search(p, group)
        members = search.members.tolist()
        group_opt = brute_force_peak([ivs[i] for i in members])
        for (names, dynamic), rank in zip(search.strategies, search.ranks, strict=True):
            keys = names if dynamic else None
            sol, _ = search._dfs(group_opt, 10_000, rank, keys)
            assert sol is not None, (names, dynamic)
            offsets = {ivs[i].id: o for i, o in zip(members, sol, strict=True)}
            check_placement([ivs[i] for i in members], offsets, capacity=group_opt)
            sol, exhausted = search._dfs(group_opt - 1, 10_000, rank, keys)
            assert sol is None and exhausted, (names, dynamic)


def test_search_closes_the_hole_greedy_leaves() -> None:
    # Found by random search: the best of the greedy orderings and the time sweeps is a
    # byte above the optimum.
    ivs = [
        Interval(0, 5, 6, 4),
        Interval(1, 4, 8, 1),
        Interval(2, 1, 5, 1),
        Interval(3, 2, 3, 4),
    ]
    opt = brute_force_peak(ivs)
    assert place(ivs, exact=False).peak > opt
    result = place(ivs)
    check_placement(ivs, result.offsets)
    assert result.peak == opt and result.optimal
    assert result.strategy == "canonical search"


def test_capacity_asked_for_is_met_when_possible() -> None:
    rng = random.Random(3)
    ivs = random_instance(rng, 6)
    opt = brute_force_peak(ivs)
    result = place(ivs, capacity=opt)
    check_placement(ivs, result.offsets, capacity=opt)
    # Below the optimum nothing fits: the best found is returned, above the capacity.
    result = place(ivs, capacity=opt - 1)
    assert result.peak == opt


def test_empty_and_zero_size_buffers() -> None:
    assert place([]).peak == 0
    ivs = [Interval(1, 0, 4, 0), Interval(2, 3, 3, 8), Interval(3, 0, 4, 16)]
    result = place(ivs)
    check_placement(ivs, result.offsets)
    assert result.peak == 16 and result.lower_bound == 16 and result.optimal


def test_bad_intervals_are_rejected() -> None:
    with pytest.raises(PlacementError, match="duplicate id"):
        place([Interval(1, 0, 1, 4), Interval(1, 1, 2, 4)])
    with pytest.raises(PlacementError, match="before start"):
        place([Interval(1, 3, 1, 4)])
    with pytest.raises(PlacementError, match="negative size"):
        place([Interval(1, 0, 1, -4)])
    with pytest.raises(PlacementError, match="alignment"):
        place([Interval(1, 0, 1, 4, 0)])


# -- the checker ---------------------------------------------------------------------------


def test_checker_catches_bad_placements() -> None:
    a = Interval(1, 0, 4, 8)
    b = Interval(2, 2, 6, 8, align=4)
    c = Interval(3, 4, 8, 8)
    check_placement([a, b, c], {1: 0, 2: 8, 3: 0})  # a and c meet at 4 only: may share
    with pytest.raises(PlacementError, match="buffers 2 and 1 are both live"):
        check_placement([a, b, c], {1: 0, 2: 7 + 1 - 4, 3: 16})
    with pytest.raises(PlacementError, match="not a multiple of 4"):
        check_placement([a, b, c], {1: 0, 2: 10, 3: 0})
    with pytest.raises(PlacementError, match="negative offset"):
        check_placement([a], {1: -8})
    with pytest.raises(PlacementError, match="exceed capacity 12"):
        check_placement([a, b, c], {1: 0, 2: 8, 3: 0}, capacity=12)
    with pytest.raises(PlacementError, match="no offset"):
        check_placement([a, b], {1: 0})
    # One step of overlap in time is enough to conflict.
    with pytest.raises(PlacementError, match="share bytes"):
        check_placement([Interval(1, 0, 3, 4), Interval(2, 2, 9, 4)], {1: 0, 2: 3})


@pytest.mark.parametrize("seed", range(40))
def test_checker_agrees_with_comparing_every_pair(seed: int) -> None:
    # The checker compares each new buffer with its neighbours in offset order only.
    rng = random.Random(9000 + seed)
    ivs = random_instance(rng, rng.randrange(2, 12))
    offsets = {iv.id: rng.randrange(0, 12) for iv in ivs}
    clash = any(
        steps(a) & steps(b)
        and offsets[a.id] < offsets[b.id] + b.size
        and offsets[b.id] < offsets[a.id] + a.size
        for k, a in enumerate(ivs)
        for b in ivs[k + 1 :]
    )
    if clash:
        with pytest.raises(PlacementError, match="share bytes"):
            check_placement(ivs, offsets)
    else:
        check_placement(ivs, offsets)


@pytest.mark.parametrize("seed", range(20))
def test_time_sweeps_alone_are_valid(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Past GREEDY_WORK buffers plus conflicting pairs only the time sweeps run.
    from flowc.memory import placement

    monkeypatch.setattr(placement, "GREEDY_WORK", 0)
    rng = random.Random(2000 + seed)
    ivs = random_instance(rng, 6, aligns=(1, 2, 4))
    result = place(ivs, exact=False)
    assert result.strategy.startswith("sweep")
    check_placement(ivs, result.offsets)
    assert result.peak >= brute_force_peak(ivs)


# -- the CSV mapping -----------------------------------------------------------------------


def write_csv(path: Path, rows: list[tuple[int, int, int, int]]) -> Path:
    path.write_text("id,lower,upper,size\n" + "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in rows))
    return path


def test_csv_lifetimes_are_half_open(tmp_path: Path) -> None:
    # [0, 2) and [2, 4) never live together: they share bytes. [0, 3) and [2, 4) do not.
    meet = read_csv(write_csv(tmp_path / "meet.csv", [(0, 0, 2, 5), (1, 2, 4, 5)]))
    assert place(meet).peak == 5
    cross = read_csv(write_csv(tmp_path / "cross.csv", [(0, 0, 3, 5), (1, 2, 4, 5)]))
    assert place(cross).peak == 10


@pytest.mark.parametrize("seed", range(15))
def test_csv_instances_against_brute_force(tmp_path: Path, seed: int) -> None:
    rng = random.Random(500 + seed)
    rows = []
    for i in range(rng.randrange(2, 7)):
        lo = rng.randrange(0, 5)
        rows.append((10 * i + 3, lo, lo + rng.randrange(1, 4), rng.randrange(1, 5)))
    ivs = read_csv(write_csv(tmp_path / "x.csv", rows))
    # The brute force reads the rows itself: buffer live at steps lower..upper-1.
    ref = [Interval(a, b, c, d) for a, b, c, d in rows]
    result = place(ivs)
    check_placement(ref, result.offsets)
    assert result.peak == brute_force_peak(ref)
    assert result.lower_bound == brute_force_lower_bound(ref)


# -- flowc plan-memory --------------------------------------------------------------------


def test_plan_memory_prints_the_summary_and_writes_offsets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(11)
    rows = [
        (i, a, a + rng.randrange(1, 4), rng.randrange(1, 5)) for i, a in enumerate([0, 1, 1, 2, 3])
    ]
    src = write_csv(tmp_path / "in.csv", rows)
    out_csv = tmp_path / "offsets.csv"
    code, text = run_cli(["plan-memory", str(src), "--offsets", str(out_csv)], capsys)
    assert code == 0, text
    ref = [Interval(a, b, c, d) for a, b, c, d in rows]
    opt, lb = brute_force_peak(ref), brute_force_lower_bound(ref)
    assert text.strip().splitlines()[-1] == f"peak {opt} lower_bound {lb} ratio {opt / lb:.4f}"
    lines = out_csv.read_text().splitlines()
    assert lines[0] == "id,lower,upper,size,offset"
    got = {int(r.split(",")[0]): int(r.split(",")[4]) for r in lines[1:]}
    assert [tuple(map(int, r.split(",")[:4])) for r in lines[1:]] == rows
    check_placement(ref, got)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_plan_memory_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_csv(tmp_path / "c.csv", [(0, 0, 2, 4), (1, 1, 3, 4), (2, 2, 4, 4)])
    code, text = run_cli(["plan-memory", str(src), "--capacity", "8"], capsys)
    assert code == 0, text
    assert "fits" in text
    code, text = run_cli(["plan-memory", str(src), "--capacity", "7"], capsys)
    assert code == 1
    # Below the lower bound no search can help: it says so, and not to search longer.
    assert "capacity 7 is below the lower bound 8" in text and "at least 8" in text
    assert "work-limit" not in text
    assert "peak 8 lower_bound 8 ratio 1.0000" in text


def test_plan_memory_takes_minimallocs_example_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The example input of MiniMalloc's README (string ids), solved at its capacity 12.
    src = tmp_path / "input.12.csv"
    src.write_text("id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n")
    offsets = tmp_path / "output.12.csv"
    code, text = run_cli(
        ["plan-memory", str(src), "--capacity", "12", "--offsets", str(offsets)], capsys
    )
    assert code == 0, text
    assert "peak 12 lower_bound 12" in text
    rows = [line.split(",") for line in offsets.read_text().splitlines()]
    assert rows[0] == ["id", "lower", "upper", "size", "offset"]
    assert [r[0] for r in rows[1:]] == ["b1", "b2", "b3", "b4", "b5"]
    placed = [tuple(int(x) for x in r[1:]) for r in rows[1:]]
    for i, (lo, hi, size, off) in enumerate(placed):
        assert off >= 0 and off + size <= 12
        for lo2, hi2, size2, off2 in placed[i + 1 :]:
            if lo < hi2 and lo2 < hi:  # live together: apart in memory
                assert off + size <= off2 or off2 + size2 <= off
    # Names repeat as numbers do.
    src.write_text("id,lower,upper,size\nb1,0,3,4\nb1,3,9,4\n")
    code, text = run_cli(["plan-memory", str(src)], capsys)
    assert code == 2 and ":3: buffer id b1 repeats (first on line 2)" in text, text


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("", "empty file"),
        ("id,lower,size\n0,0,1\n", "lacks column(s) upper"),
        ("id,lower,upper,size\n0,0,x,4\n", ":2: upper 'x' is not an integer"),
        ("id,lower,upper,size\n0,0,2,4\n1,3,3,4\n", ":3: buffer 1: lower 3 must be below upper 3"),
        ("id,lower,upper,size\n0,0,2,-4\n", ":2: buffer 0: negative size -4"),
        ("id,lower,upper,size\n0,0,2,4\n\n0,1,2,4\n", ":4: buffer id 0 repeats (first on line 2)"),
        ("id,lower,upper,size\n0,0,2\n", ":2: 3 field(s), the header has 4"),
    ],
)
def test_plan_memory_bad_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, fragment: str
) -> None:
    src = tmp_path / "bad.csv"
    src.write_text(body)
    code, text = run_cli(["plan-memory", str(src)], capsys)
    assert code == 2, text
    assert "error:" in text and "bad.csv" in text and fragment in text, text
    assert "Traceback" not in text


def test_plan_memory_errors_in_a_real_process(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "plan-memory", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "nope.csv" in r.stderr and "cannot read" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


# -- determinism and standing alone -------------------------------------------------------


def test_same_input_same_offsets() -> None:
    # Large enough that the search runs (and runs out of work) rather than greedy finishing.
    rng = random.Random(42)
    ivs = []
    for i in range(60):
        a = rng.randrange(0, 40)
        ivs.append(Interval(i, a, a + rng.randrange(1, 15), rng.randrange(1, 64) * 16, 16))
    first = place(ivs, work_limit=1500)
    second = place(list(ivs), work_limit=1500)
    check_placement(ivs, first.offsets)
    assert first.offsets == second.offsets and first.peak == second.peak
    assert first.strategy == second.strategy


def test_module_imports_without_the_rest_of_flowc() -> None:
    code = (
        "import json, sys; import flowc.memory.placement; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('flowc'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # flowc.version is the package's one other module `import flowc` loads (a constant).
    assert json.loads(r.stdout) == [
        "flowc",
        "flowc.memory",
        "flowc.memory.placement",
        "flowc.version",
    ]


# -- scale, integer bounds, argument bounds (issue 23, point 6) -----------------------------


def model_timeline(n: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """A compiled model's buffers: buffer i born at step i, most living 1-8 steps, 2% to
    the end (so one group spans the whole timeline)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        end = n + 1 if rng.random() < 0.02 else i + rng.randrange(1, 9)
        rows.append((i, i, end, rng.randrange(1, 64) * 256))
    return rows


def test_plan_memory_places_30000_buffers(tmp_path: Path) -> None:
    # Once a traceback after deep recursion in the search, or a MemoryError: conflict lists
    # (about 9 million pairs here) and a copy of the unplaced buffers per search level took
    # gigabytes (41 s where 8 GB were there to take). Now nothing of the square of the
    # buffers is kept: about 70 MB and 1.5 s, the checker included, in a process of its own.
    src = write_csv(tmp_path / "big.csv", model_timeline(30_000))
    out_csv = tmp_path / "offsets.csv"
    code = (
        "import sys\n"
        "from flowc.cli import main\n"
        "try:\n"
        f"    main(['plan-memory', {str(src)!r}, '--offsets', {str(out_csv)!r}])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        # VmHWM is this program's own peak: ru_maxrss would carry the peak of the pytest
        # worker it was forked from across the exec (Linux keeps the larger of the two).
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "print('maxrss', hwm.split()[1])\n"
    )
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    peak, lb = (int(w) for w in lines[-2].split()[1:4:2])
    assert lb <= peak <= 1.05 * lb
    assert int(lines[-1].split()[1]) < 400 * 1024, lines[-1]  # KiB
    assert seconds < 60, seconds
    rows = out_csv.read_text().splitlines()[1:]
    assert len(rows) == 30_000
    ivs = [Interval(*map(int, r.split(",")[:4])) for r in rows]
    check_placement(ivs, {int(r.split(",")[0]): int(r.split(",")[4]) for r in rows})


def test_search_depth_does_not_grow_with_the_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    # One dive places every buffer of a group, one search level each. The search keeps
    # its levels on a list, not on Python's stack: 3,000 buffers in one group place under
    # a recursion limit of a few dozen frames above the caller's (which the search may
    # not raise: it once raised it to 4 frames a buffer).
    import inspect

    from flowc.memory.placement import _Problem, _Search

    rng = random.Random(7)
    ivs = [
        Interval(i, i // 2, i // 2 + rng.randrange(2, 7), rng.randrange(1, 9) * 16)
        for i in range(3000)
    ]
    p = _Problem(ivs)
    (group,) = p.components()
    search = _Search(p, group)
    loose = sum(iv.size for iv in ivs)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 40)
    monkeypatch.setattr(sys, "setrecursionlimit", lambda n: None)
    try:
        sol, _ = search.solve(loose, 100_000)
    finally:
        monkeypatch.undo()
        sys.setrecursionlimit(old)
    assert sol is not None and search.nodes == 3000  # one dive, one node a buffer
    check_placement(ivs, {ivs[i].id: o for i, o in zip(group.tolist(), sol, strict=True)})


INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ("0,0,2,18446744073709551616", ":2: size 18446744073709551616 is outside the 64-bit"),
        ("0,-9223372036854775809,2,4", ":2: lower -9223372036854775809 is outside the 64-bit"),
        ("9223372036854775808,0,2,4", ":2: id 9223372036854775808 is outside the 64-bit"),
        ("0,0," + "9" * 5000 + ",4", "(5000 characters) is outside the 64-bit"),
    ],
)
def test_csv_values_outside_int64_are_input_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], row: str, fragment: str
) -> None:
    src = tmp_path / "wide.csv"
    src.write_text(f"id,lower,upper,size\n{row}\n")
    code, text = run_cli(["plan-memory", str(src)], capsys)
    assert code == 2, text
    assert "error:" in text and "wide.csv" in text and fragment in text, text
    assert "Traceback" not in text and "internal error" not in text


def test_int64_extremes_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Lifetimes across the whole int64 range (their lengths overflow int64) and the
    # largest ids are fine; only the bytes all the buffers could need must stay below 2^61.
    lo, hi = -(2**63), INT64_MAX
    rows = [(lo, lo, hi, 2**40), (INT64_MAX, lo, 0, 2**40), (0, 0, hi, 2**40), (1, -5, 5, 8)]
    src = write_csv(tmp_path / "extremes.csv", rows)
    code, text = run_cli(["plan-memory", str(src)], capsys)
    assert code == 0, text
    peak = 2 * 2**40 + 8  # the first buffer, one of the halves and the short one
    assert text.strip().splitlines()[-1] == f"peak {peak} lower_bound {peak} ratio 1.0000"
    huge = write_csv(tmp_path / "huge.csv", [(0, 0, 2, 2**62), (1, 1, 3, 2**62)])
    code, text = run_cli(["plan-memory", str(huge)], capsys)
    assert code == 2, text
    assert "huge.csv" in text and "at most 2305843009213693952 (2^61)" in text
    assert "Traceback" not in text
    with pytest.raises(PlacementError, match="does not fit int64"):
        place([Interval(0, 0, 1, 2**64)])


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--capacity", "1" * 400], ["--capacity 1111111111111111... (400 characters): at most"]),
        (["--capacity", "9223372036854775808"], ["at most 9223372036854775807 bytes"]),
        (["--capacity", "1" * 400 + "GiB"], ["(403 characters): at most 9223372036854775807"]),
        # With a unit the bound may come from parse_bytes, in its own words.
        (["--capacity", "9000000000TiB"], ["9000000000TiB", "9223372036854775807"]),
        (["--capacity", "-5"], ["expected a byte count"]),
        (["--work-limit", "1" * 400], ["--work-limit 1111111111111111... (400 characters)"]),
        (["--work-limit", "10000001"], ["at most 10000000 search nodes"]),
        (["--work-limit", "-1"], ["expected a whole number of search nodes, 0 to 10000000"]),
        (["--work-limit", "1e9"], ["expected a whole number of search nodes"]),
    ],
)
def test_plan_memory_bounds_its_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragments: list[str]
) -> None:
    src = write_csv(tmp_path / "c.csv", [(0, 0, 2, 4), (1, 1, 3, 4)])
    t0 = time.perf_counter()
    code, text = run_cli(["plan-memory", str(src), *args], capsys)
    assert time.perf_counter() - t0 < 10
    assert code == 2, text
    assert "error:" in text and all(f in text for f in fragments), text
    assert "Traceback" not in text and "internal error" not in text


def test_plan_memory_reads_a_capacity_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2^53 + 1 through a float would be 2^53: one byte short of the lower bound.
    src = write_csv(tmp_path / "c.csv", [(0, 0, 2, 2**53), (1, 1, 3, 1)])
    code, text = run_cli(["plan-memory", str(src), "--capacity", str(2**53 + 1)], capsys)
    assert code == 0, text
    assert f"{2**53 + 1} (fits)" in text


# -- quality without a capacity ------------------------------------------------------------

MINIMALLOC = Path(__file__).resolve().parent / "data" / "minimalloc"


@pytest.mark.parametrize(
    ("name", "with_capacity"),
    [
        # Without a capacity the search once went straight to a binary search from the
        # greedy peak and K ended at 1.122x its lower bound (1.000x with --capacity
        # 1048576). It now aims at the lower bound first.
        ("K", 1_048_576),
        # D's lower bound is out of reach: aiming at it took two thirds of the budget,
        # and the binary search from the greedy peak ended at 1,053,696 (1.0685x), above
        # the 1,048,576 (1.0633x) that --capacity 1048576 finds. The lower bound is now
        # given up once its dives stay under half the buffers, and a ladder of targets
        # above it meets 1,048,576 (the capacity mode's figure: running it here too would
        # add 2 s).
        ("D", 1_048_576),
    ],
)
def test_default_mode_does_as_well_as_with_a_capacity(name: str, with_capacity: int) -> None:
    # The whole set, both modes: bench/minimalloc_bench.py.
    path = MINIMALLOC / f"{name}.1048576.csv"
    if not path.exists():
        pytest.skip("no MiniMalloc data")
    ivs = read_csv(path)
    result = place(ivs)
    check_placement(ivs, result.offsets)
    assert result.peak <= 1.10 * result.lower_bound
    assert result.peak <= with_capacity  # what --capacity 1048576 finds
