"""DiLoCo's schedule (torchacco/parallel/diloco/schedule.py): which fragment syncs after which inner update, QSR's
growing periods, warm start, the outer momentum's schedule and balance_replicas' slots, against values worked out by
hand."""

import pytest

from torchacco.config import DiLoCo as Options
from torchacco.parallel.diloco.schedule import WARM_START, Schedule


def outer_steps(schedule: Schedule, lrs: list[float]) -> list:
    return [schedule.advance(lr) for lr in lrs]


def test_streaming_fragments_take_turns_every_h_over_p_updates():
    # H = 4, P = 2: a fragment every 2 updates, 0 then 1
    s = Schedule(Options(sync_every=4, fragments=2), replicas=2)
    assert outer_steps(s, [1.0] * 8) == [None, 0, None, 1, None, 0, None, 1]
    assert s.due() == 1 and s.next_outer == 10


def test_the_fragment_due_after_an_update():
    s = Schedule(Options(sync_every=6, fragments=3), replicas=2)
    s.updates = 6  # the third period: (6 / 2 − 1) mod 3
    assert s.due() == 2
    s.updates = 8
    assert s.due() == 0


def test_warm_start_averages_each_update_then_the_outer_steps_begin_with_a_whole_period():
    # warm_start 4 = two periods of 2: updates 1-4 average; the next outer step follows update 6, fragment 2 mod 2
    s = Schedule(Options(sync_every=4, fragments=2, warm_start=4), replicas=2)
    assert outer_steps(s, [1.0] * 8) == [WARM_START] * 4 + [None, 0, None, 1]


def test_qsr_grows_the_period_as_the_learning_rate_falls():
    # H = 2, sync_every_max 8: H_t = min(8, max(2, ⌊2·(η_peak / η_t)²⌋))
    s = Schedule(Options(sync_every=2, sync_every_max=8), replicas=2)
    assert outer_steps(s, [1.0, 1.0]) == [None, 0] and s.next_outer == 4  # 2·1² = 2
    assert outer_steps(s, [0.5, 0.5]) == [None, 0] and s.next_outer == 12  # 2·2² = 8
    assert s.active == [8, 8]  # every replica computes the whole of the longer period
    assert outer_steps(s, [0.9] * 8)[-1] == 0 and s.next_outer == 14  # ⌊2·(1/0.9)²⌋ = ⌊2.47⌋ = 2
    assert outer_steps(s, [0.0, 0.0])[-1] == 0 and s.next_outer == 22  # η_t = 0: the longest, 8
    assert s.state_dict()["qsr"] == [4, 22, 1.0]


def test_qsr_periods_are_split_over_the_fragments():
    s = Schedule(Options(sync_every=4, fragments=2, sync_every_max=16), replicas=2)
    assert s.next_interval(0.5) == 2  # no update yet: η_peak 0, H_t = max(4, ⌊4·0⌋) = 4, over 2 fragments
    s.peak_lr = 1.0
    assert s.next_interval(0.5) == 8  # min(16, 4·2²) = 16, over 2 fragments
    assert s.next_interval(1.0) == 2  # H / P


@pytest.mark.parametrize(
    "n, expected",
    [(1, 0.45), (2, 0.45), (3, 0.9), (4, 0.9), (5, 0.9)],  # P = 2, W = 2: the k-th step of a fragment, μ·min(1, k/2)
)
def test_outer_momentum_warms_up_over_each_fragments_steps(n, expected):
    s = Schedule(Options(outer_momentum=0.9, outer_momentum_warmup=2, fragments=2, sync_every=4), replicas=2)
    assert s.momentum(n) == pytest.approx(expected)


def test_outer_momentum_decays_with_the_learning_rate():
    s = Schedule(Options(outer_momentum=0.9, outer_momentum_decay=True), replicas=2)
    assert s.momentum(1) == 0.9  # no learning rate yet
    outer_steps(s, [1.0, 0.25])
    assert s.momentum(1) == pytest.approx(0.9 * 0.25)


@pytest.mark.parametrize(
    "seconds, expected",
    [
        ([1.0, 2.0, 3.0], [10, 5, 3]),  # ⌊10·1/2⌋, ⌊10·1/3⌋
        ([1.0, 1.5, 1.0], [10, 6, 10]),  # ⌊6.67⌋
        ([1.0, 100.0, 1.0], [10, 1, 10]),  # at least one update
        ([0.0, 0.0, 0.0], [10, 10, 10]),  # no timings yet: H / P each
    ],
)
def test_balance_replicas_gives_each_as_many_updates_as_fit_in_the_fastest_ones_period(seconds, expected):
    assert Schedule(Options(sync_every=10), replicas=3).balanced(seconds) == expected


def test_a_slow_replica_sits_out_the_slots_past_its_share():
    s = Schedule(Options(sync_every=4, balance_replicas=True), replicas=2)
    s.active = [4, 2]
    outer_steps(s, [1.0, 1.0])
    assert (s.idle(0), s.idle(1), s.computing()) == (False, True, 1)
    assert outer_steps(s, [1.0, 1.0]) == [None, 0]  # the period still ends after H updates


def test_a_fixed_schedule_resumes_from_the_updates_alone():
    s = Schedule(Options(sync_every=4, fragments=2), replicas=2)
    outer_steps(s, [1.0] * 5)
    resumed = Schedule(Options(sync_every=4, fragments=2), replicas=2)
    resumed.load_state_dict(s.state_dict())
    assert (resumed.period, resumed.next_outer) == (s.period, s.next_outer) == (2, 6)
    assert "qsr" not in s.state_dict() and "peak_lr" not in s.state_dict()
