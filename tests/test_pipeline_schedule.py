"""Micro-batch schedules (flowc/schedule/pipeline.py): the GPipe and 1F1B orders, the event
simulator's bubble against the closed form (P-1)/(M+P-1), activations in flight, and every
simulated firing checked against its dependencies by an independent replay here."""

from __future__ import annotations

import random

import pytest

from flowc.schedule.pipeline import (
    Actor,
    Firing,
    Phase,
    PipelineRun,
    Schedule,
    gpipe,
    one_f_one_b,
    simulate,
)

SIZES = [(1, 1), (1, 5), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (5, 16), (8, 3)]


def text(order: list[Actor]) -> str:
    return " ".join(f"{a.phase.value}{a.microbatch}" for a in order)


def check_firings(
    run: PipelineRun,
    schedule: Schedule,
    f_s: list[float],
    b_s: list[float],
    x_s: list[float],
) -> None:
    """Every firing lasts its stage's time, follows the schedule's order without overlapping
    the one before it, and starts only after what it reads has arrived."""
    stages = len(schedule)
    end: dict[tuple[int, int, Phase], float] = {}
    for s, fs in enumerate(run.firings):
        assert [Actor(f.stage, f.microbatch, f.phase) for f in fs] == schedule[s]
        for k, f in enumerate(fs):
            want = f_s[s] if f.phase is Phase.F else b_s[s]
            assert f.end - f.start == pytest.approx(want)
            if k:
                assert f.start >= fs[k - 1].end - 1e-12
            end[(s, f.microbatch, f.phase)] = f.end
    for fs in run.firings:
        for f in fs:
            s, m = f.stage, f.microbatch
            if f.phase is Phase.F and s > 0:
                assert f.start >= end[(s - 1, m, Phase.F)] + x_s[s - 1] - 1e-12
            if f.phase is Phase.B:
                assert f.start >= end[(s, m, Phase.F)] - 1e-12
                if s < stages - 1:
                    assert f.start >= end[(s + 1, m, Phase.B)] + x_s[s] - 1e-12
    assert run.makespan == pytest.approx(max(f.end for fs in run.firings for f in fs))


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_bubble_of_equal_stages_is_the_closed_form(p: int, m: int) -> None:
    want = (p - 1) / (m + p - 1)
    inference = simulate(gpipe(p, m), m, 1.0)
    assert inference.bubble == pytest.approx(want)
    assert inference.makespan == pytest.approx(m + p - 1)
    for schedule in (one_f_one_b(p, m), gpipe(p, m, backward=True)):
        for backward in (1.0, 2.0):
            run = simulate(schedule, m, 1.0, backward)
            assert run.bubble == pytest.approx(want)
            assert run.makespan == pytest.approx((1.0 + backward) * (m + p - 1))
            assert run.busy_s == pytest.approx([(1.0 + backward) * m] * p)
            assert sum(run.idle_s) == pytest.approx(want * p * run.makespan)


def test_transfers_delay_the_pipeline_fill() -> None:
    p, m, t, x = 4, 6, 1.0, 0.25
    run = simulate(gpipe(p, m), m, t, 0.0, x)
    assert run.makespan == pytest.approx((m + p - 1) * t + (p - 1) * x)
    # With a transfer, a stage's output register is held until it has reached the next stage,
    # while the stage already computes the next micro-batch: two registers.
    assert run.max_in_flight == [2, 2, 2, 1]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight(p: int, m: int) -> None:
    run = simulate(one_f_one_b(p, m), m, 1.0, 2.0, 0.1)
    assert run.max_in_flight == [min(p - s, m) for s in range(p)]
    assert max(run.max_in_flight) <= p
    # GPipe with backward stashes every micro-batch on every stage.
    assert simulate(gpipe(p, m, True), m, 1.0, 2.0, 0.1).max_in_flight == [m] * p


def test_1f1b_order() -> None:
    orders = [text(o) for o in one_f_one_b(4, 6)]
    assert orders == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    # Fewer micro-batches than warm-up slots: all forwards first.
    assert text(one_f_one_b(4, 2)[0]) == "F0 F1 B0 B1"
    assert [text(o) for o in gpipe(2, 3, backward=True)] == ["F0 F1 F2 B2 B1 B0"] * 2


@pytest.mark.parametrize("seed", range(6))
def test_simulated_firings_respect_dependencies(seed: int) -> None:
    rng = random.Random(seed)
    p, m = rng.randint(1, 6), rng.randint(1, 9)
    f_s = [rng.uniform(0.1, 2.0) for _ in range(p)]
    b_s = [rng.uniform(0.1, 4.0) for _ in range(p)]
    x_s = [rng.uniform(0.0, 1.0) for _ in range(p - 1)]
    for schedule, backward in (
        (gpipe(p, m), False),
        (gpipe(p, m, True), True),
        (one_f_one_b(p, m), True),
    ):
        run = simulate(schedule, m, f_s, b_s if backward else 0.0, x_s)
        check_firings(run, schedule, f_s, b_s, x_s)
        assert all(isinstance(f, Firing) for fs in run.firings for f in fs)
        assert 0.0 <= run.bubble < 1.0


def test_invalid_schedules_are_refused() -> None:
    bad = one_f_one_b(2, 2)
    bad[1] = [Actor(1, 0, Phase.B), Actor(1, 0, Phase.F), *bad[1][2:]]  # B before its own F
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad, 2, 1.0, 1.0)
    missing = gpipe(2, 3)
    missing[0] = missing[0][:2]
    with pytest.raises(
        ValueError, match="stage 0: the schedule must list F0@s0, F1@s0, F2@s0 once each"
    ):
        simulate(missing, 3, 1.0)
    with pytest.raises(ValueError, match="one per stage"):
        simulate(gpipe(3, 2), 2, [1.0, 1.0])
    with pytest.raises(ValueError, match="microbatches >= 1"):
        gpipe(2, 0)
