"""The load sweep's noise interval: what a reader of bench/results/load_sweep.md relies on to tell a
real difference between speculation on and off from the machine's drift between passes."""

from __future__ import annotations

import math

import pytest

from bench.load_sweep import ratio_interval, steady_window


def test_interval_is_the_t_interval_of_the_log_ratios() -> None:
    ratios = [0.81, 1.05, 0.93, 0.92]  # the draft c = 16 passes of the bbd5233 sweep
    logs = [math.log(x) for x in ratios]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    lo, hi = ratio_interval(ratios)
    assert lo == pytest.approx(math.exp(mean - 3.18 * sd / 2))
    assert hi == pytest.approx(math.exp(mean + 3.18 * sd / 2))
    assert lo < 1.0 < hi  # that cell's 0.92 was within the noise of its own passes


def test_steady_passes_give_a_narrow_interval_and_one_pass_none() -> None:
    lo, hi = ratio_interval([1.20, 1.21, 1.19, 1.20])
    assert 1.18 < lo < 1.20 < hi < 1.22  # a real gain stands clear of 1
    assert ratio_interval([1.3]) == []  # one pass: no spread to judge the noise by


def _request(first: bool, arrivals: list[float]) -> dict[str, object]:
    return {"first": first, "arrivals": arrivals}


def test_steady_window_starts_after_the_cold_start_burst() -> None:
    # Two clients start at 0; their first requests' first tokens come at 3 and 5 (the burst of both
    # prompts), later requests' at 9; the first client runs out at 12.
    results = [_request(True, [3.0, 4.0]), _request(True, [5.0, 6.0]), _request(False, [9.0, 10.0])]
    assert steady_window(results, exits=[12.0, 14.0], start=0.0) == (5.0, 12.0)


def test_steady_window_leaves_the_burst_out_however_soon_a_client_finishes() -> None:
    # A window from the start would keep the whole burst of an arm whose quick client runs out sooner in
    # a shorter window, weighing it more. The steady window drops the burst in both arms alike.
    burst = [_request(True, [4.0]), _request(True, [4.0])]
    slow_begin, slow_until = steady_window(burst, exits=[20.0, 24.0], start=0.0)
    fast_begin, fast_until = steady_window(burst, exits=[16.0, 24.0], start=0.0)
    assert slow_begin == fast_begin == 4.0
    assert (slow_until, fast_until) == (20.0, 16.0)


def test_steady_window_falls_back_to_the_start_when_no_span_is_left() -> None:
    results = [_request(True, [3.0, 8.0]), _request(True, [5.0])]  # one request per client: exits at 4
    assert steady_window(results, exits=[4.0, 9.0], start=0.0) == (0.0, 4.0)
