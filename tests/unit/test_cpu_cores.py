"""Pinning a process to CPU cores (actors/cpu_cores.py): every thread moves, later threads inherit it, a core
the machine lacks leaves the process as it was, and tensor-parallel ranks split the cores evenly."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from actors.config import ModelConfig, TargetConfig
from actors.cpu_cores import pin_process, rank_cores, usable_cores


@pytest.fixture
def restored() -> Iterator[set[int]]:
    """This process's cores, given back after the test."""
    before = usable_cores()
    try:
        yield before
    finally:
        pin_process(before)


def thread_cores() -> set[int]:
    seen: set[int] = set()
    thread = threading.Thread(target=lambda: seen.update(usable_cores()))
    thread.start()
    thread.join()
    return seen


def test_pinning_moves_every_thread_and_the_threads_started_later(restored: set[int]) -> None:
    core = min(restored)
    waiting = threading.Event()
    seen: set[int] = set()
    earlier = threading.Thread(target=lambda: (waiting.wait(), seen.update(usable_cores())))
    earlier.start()  # a thread already running when the process is pinned
    assert pin_process({core})
    waiting.set()
    earlier.join()
    assert usable_cores() == {core} and seen == {core}
    assert thread_cores() == {core}
    assert pin_process(restored) and thread_cores() == restored


def test_a_core_the_machine_lacks_leaves_the_process_as_it_was(restored: set[int]) -> None:
    assert not pin_process({4_000})
    assert usable_cores() == restored


def test_tensor_parallel_ranks_take_equal_slices_in_order() -> None:
    assert [rank_cores((4, 5, 6, 7), r, 2) for r in range(2)] == [(4, 5), (6, 7)]
    assert rank_cores((3,), 0, 1) == (3,)
    model = ModelConfig(path="m")
    assert TargetConfig(model=model, tp_size=2, cpu_cores=(0, 1)).cpu_cores == (0, 1)
    with pytest.raises(ValidationError, match="3 cores do not split evenly over tp_size 2"):
        TargetConfig(model=model, tp_size=2, cpu_cores=(0, 1, 2))
    with pytest.raises(ValidationError):
        TargetConfig(model=model, cpu_cores=())


def test_borrowed_cores_need_own_cores_of_a_single_shard_and_not_the_same_ones() -> None:
    model = ModelConfig(path="m")
    assert TargetConfig(model=model, cpu_cores=(0,), borrow_cores=(1,)).borrow_cores == (1,)
    with pytest.raises(ValidationError, match="borrow_cores needs cpu_cores"):
        TargetConfig(model=model, borrow_cores=(1,))
    with pytest.raises(ValidationError, match="borrow_cores needs cpu_cores"):
        TargetConfig(model=model, tp_size=2, cpu_cores=(0, 1), borrow_cores=(2,))
    with pytest.raises(ValidationError, match=r"borrow_cores \[0, 1\] overlap cpu_cores \[0\]"):
        TargetConfig(model=model, cpu_cores=(0,), borrow_cores=(0, 1))
