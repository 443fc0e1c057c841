"""A verify forward's deadline (actors/verify_deadline.py): sized to its tokens by the seconds per token the
replica measured, never under the least deadline; a forward past it is overdue, and saying why."""

from __future__ import annotations

from actors.verify_deadline import VerifyDeadline, forward_tokens
from actors.wire import WireProposal, WireVerifyItem
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_forward_past_its_measured_deadline_is_overdue() -> None:
    clock = Clock()
    deadline = VerifyDeadline(factor=10.0, least_s=1.0, clock=clock)
    assert deadline.deadline_s(500) == 1.0, "nothing measured yet: the least deadline"
    deadline.start(100)
    clock.now = 2.0  # a first forward of 100 tokens in 2 s: 20 ms a token
    deadline.stop(2.0)
    assert deadline.per_token_s == 0.02
    assert deadline.deadline_s(100) == 20.0 and deadline.deadline_s(1) == 1.0  # 10 x expected, at least 1 s
    deadline.start(100)
    clock.now = 21.9
    assert deadline.overdue() is None
    clock.now = 22.5
    assert deadline.overdue() == "a verify forward has run 20.5 s, past its deadline of 20.0 s (100 tokens)"
    deadline.stop(None)  # failed: nothing measured, nothing running
    assert deadline.overdue() is None and deadline.per_token_s == 0.02


def test_a_forwards_tokens_are_bounded_by_the_prefill_chunk() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    tree = TokenTree(9, (5, 6, 7), (0, 1, 2))
    long = WireVerifyItem("a", tuple(range(4000)), params, WireProposal(TokenTree(3999, (), ()), None))
    drafted = WireVerifyItem("b", tuple(range(10)), params, WireProposal(tree, None))
    assert forward_tokens([long, drafted], chunk=64) == 64 + 1 + 4
    assert forward_tokens([drafted], chunk=None) == 10 + 4
