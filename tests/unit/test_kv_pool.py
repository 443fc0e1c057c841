"""One KV pool per process: runners' cache buffers counted in bytes, within the pool, exact outputs throughout."""

from __future__ import annotations

import pytest
import torch

from speculative.engine.kv_budget import kv_bytes_per_token
from speculative.engine.kv_cache import preallocated
from speculative.engine.kv_pool import KvPool, KvPoolFull, pool_bytes
from speculative.engine.runner import ModelRunner
from tests.tiny_models import ARCHS, full_logits, padded_forward, tiny_model


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


def pool_of(model, tokens: int) -> KvPool:
    return KvPool(tokens, kv_bytes_per_token(model.config, torch.float32), "target_pool.kv_budget_tokens")


def held(runners: list[ModelRunner]) -> int:
    """Bytes the runners' buffers really hold."""
    return sum(r.cache.nbytes() for r in runners)


def next_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:  # [B, V]: each row's next token's logits
    logits = padded_forward(runner, [[t] for t in tokens], [[-1]] * len(tokens), [[0]] * len(tokens))
    assert logits is not None
    return logits[:, 0]


def test_the_pool_holds_its_budget_and_a_quarter_for_padding() -> None:
    assert pool_bytes(1024, 46_080) == 58_982_400  # the module docstring's example (SmolLM2-135M in float32)


def test_runners_preallocate_only_where_the_pool_has_room(model) -> None:
    """Each runner asks for `preallocated` rows and columns at start: granted while the pool has room, and a
    runner that would pass it starts empty and grows within it. What the pool counts is what the buffers hold."""
    pool = pool_of(model, 4096)  # 5,120 cells: room for one runner's preallocation of 8 x 512, not two
    reserve = preallocated(4096, 512)
    assert reserve == (8, 512)
    first, second = (ModelRunner(model, reserve, pool=pool) for _ in range(2))
    assert (first.cache.slots, first.cache.capacity) == reserve and second.cache.cells() == 0
    for runner in (first, second):
        runner.add_rows(["a", "b"])
        runner.extend([[3, 4, 5], [6, 7]])
    assert [r.cache.nbytes() for r in (first, second)] == [r.kv_bytes() for r in (first, second)]
    assert pool.held() == held([first, second]) <= pool.capacity


def test_a_forward_trims_the_other_runners_and_they_stay_exact(model) -> None:
    """Runner `done` held long rows, now left; `idle` doubled past what it uses. A forward of `busy` that needs
    more than the pool has left takes it back from them: `done` gives back everything, `idle` its unused columns
    and rows. Every row left continues exactly."""
    pool = pool_of(model, 400)  # 500 cells
    done, idle, busy = (ModelRunner(model, pool=pool) for _ in range(3))
    done.add_rows(["x", "y"])
    done.extend([[3 + i % 90 for i in range(150)], [4, 5]])  # 2 x 160 cells
    done.remove_rows(["x", "y"])
    idle.add_rows(["a", "b"])
    idle.extend([[5, 6, 7], [8, 9]])
    idle.add_rows(["c"])  # slots doubled: 4 of 32 columns
    idle.extend([[], [], [10]])
    idle.remove_rows(["b", "c"])  # row a uses 1 x 32
    busy.add_rows(["p"])
    assert pool.held() == held([done, idle, busy]) == (2 * 160 + 4 * 32) * pool.token_bytes
    prompt = [3 + i % 50 for i in range(300)]
    busy.extend([prompt])  # 1 x 320 cells: past what the pool has left without the others' 448
    assert done.cache.cells() == 0 and idle.cache.cells() == 32
    assert pool.held() == held([done, idle, busy]) == (32 + 320) * pool.token_bytes <= pool.capacity
    torch.testing.assert_close(next_logits(idle, [11])[0], full_logits(model, [5, 6, 7, 11]), atol=2e-5, rtol=1e-5)
    logits = next_logits(busy, [12])[0]
    torch.testing.assert_close(logits, full_logits(model, [*prompt, 12]), atol=5e-5, rtol=1e-5)


def test_a_forward_past_the_pool_fails_naming_it_and_allocates_nothing(model) -> None:
    pool = pool_of(model, 200)  # 250 cells
    other, runner = ModelRunner(model, pool=pool), ModelRunner(model, pool=pool)
    other.add_rows(["a"])
    other.extend([[3 + i % 90 for i in range(100)]])  # 128 cells in use: nothing to trim
    runner.add_rows(["b"])
    before = pool.held()
    with pytest.raises(KvPoolFull, match=r"KV pool full: .*target_pool\.kv_budget_tokens 200 tokens"):
        runner.extend([[3 + i % 90 for i in range(150)]])  # 160 cells: 128 + 160 > 250
    assert pool.held() == before == held([other, runner])


def test_a_dropped_runner_gives_its_bytes_back(model) -> None:
    pool = pool_of(model, 1000)
    kept, dropped = ModelRunner(model, pool=pool), ModelRunner(model, pool=pool)
    kept.add_rows(["a"])
    dropped.add_rows(["a"])
    kept.extend([[3, 4, 5, 6]])
    dropped.extend([[3, 4, 5, 6]])
    assert pool.held() == 2 * kept.kv_bytes() > 0
    del dropped
    assert pool.held() == kept.kv_bytes()
