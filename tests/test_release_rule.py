"""The release rule: a release for every multiple of the interval a round crosses."""

from hypothesis import given
from hypothesis import strategies as st

from runner.release import ReleaseSchedule, boundaries_crossed

INTERVAL = 256


def run_schedule(round_sizes, interval=INTERVAL):
    released_in_round = []
    schedule = ReleaseSchedule(release=lambda: None, interval=interval)
    count = 0
    for size in round_sizes:
        released_in_round.append(schedule.after_round(count, count + size))
        count += size
    return schedule, released_in_round


@given(st.lists(st.integers(min_value=0, max_value=20), max_size=400))
def test_releases_equal_multiples_crossed_and_fire_in_the_crossing_round(round_sizes):
    schedule, released_in_round = run_schedule(round_sizes)
    assert schedule.count == sum(round_sizes) // INTERVAL
    count, expected_positions = 0, []
    for size, released in zip(round_sizes, released_in_round):
        crosses = (count + size) // INTERVAL > count // INTERVAL
        assert released == crosses
        count += size
        if crosses:
            expected_positions.append(count)
    assert schedule.positions == expected_positions


@given(st.integers(0, 10_000), st.integers(0, 300), st.integers(1, 1024))
def test_boundaries_crossed_counts_multiples_in_the_half_open_range(before, size, interval):
    after = before + size
    expected = sum(1 for m in range(before + 1, after + 1) if m % interval == 0)
    assert boundaries_crossed(before, after, interval) == expected


def exact_multiple_rule(count_after_round: int) -> bool:
    """The buggy check this project exists to avoid."""
    return count_after_round % INTERVAL == 0


@given(st.lists(st.integers(min_value=2, max_value=7), min_size=100, max_size=600))
def test_exact_multiple_check_misses_every_multiple_a_round_steps_over(round_sizes):
    schedule, _ = run_schedule(round_sizes)
    count, exact_releases, stepped_over = 0, 0, 0
    for size in round_sizes:
        before, count = count, count + size
        exact_releases += exact_multiple_rule(count)
        stepped_over += boundaries_crossed(before, count - 1, INTERVAL)  # multiples passed, not landed on
    assert exact_releases + stepped_over == schedule.count
    assert schedule.count - exact_releases == stepped_over


def test_exact_multiple_check_misses_a_typical_speculative_run():
    rounds = [3] * 1000  # k=2, every draft accepted: counts 3, 6, ..., 3000
    schedule, _ = run_schedule(rounds)
    exact = sum(exact_multiple_rule(3 * (i + 1)) for i in range(len(rounds)))
    assert schedule.count == 3000 // INTERVAL == 11
    assert exact == 3  # only 768, 1536, 2304 are multiples of 3 and 256
    assert exact < schedule.count


def test_disabled_schedule_never_releases():
    schedule = ReleaseSchedule(release=lambda: None, enabled=False)
    assert not schedule.after_round(250, 260)
    schedule.at_end()
    assert schedule.count == 0 and schedule.positions == []


def test_end_of_request_release_is_counted_but_not_a_boundary():
    calls = []
    schedule = ReleaseSchedule(release=lambda: calls.append(1))
    schedule.after_round(0, 10)
    schedule.at_end()
    assert schedule.count == 1 and calls == [1] and schedule.positions == []
