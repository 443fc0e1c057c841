"""The load sweep's noise interval: what a reader of bench/results/load_sweep.md relies on to tell a
real difference between speculation on and off from the machine's drift between passes."""

from __future__ import annotations

import math

import pytest

from bench.load_sweep import ratio_interval


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
