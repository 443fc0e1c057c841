"""Tensor parallelism without Ray: 2 processes over gloo; sharded logits equal unsharded (fp32).

Covers DeepSpeed AutoTP (Llama; Qwen2 with tied embeddings, as the real Qwen2.5 models) and the
plain column/row split for GPT-2, which AutoTP refuses. Logits come from `ModelRunner`, the path
the target shards use: a batch of two prompts of different lengths, then a draft tree.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from actors import tp
from actors.config import ModelConfig
from actors.loading import load_lm
from speculative.engine.runner import ModelRunner
from speculative.rules.tree import TokenTree
from tests.actors.conftest import TORCH_EXTENSIONS, TinyPair
from tests.tiny_models import padded_forward

PROMPTS = [[5, 17, 33, 9, 101, 7], [44, 2 + 1, 250]]
TREE = TokenTree(7, (11, 12, 13, 14), (0, 0, 1, 1))  # root 7, two children, two grandchildren


def runner_logits(model: Any) -> torch.Tensor:  # [n+2, V] at the tree of row 0, then row 1's one decoded token
    runner = ModelRunner(model)
    runner.add_rows(["a", "b"])
    runner.extend([PROMPTS[0][:-1], PROMPTS[1][:-1]])
    tokens = [list(TREE.all_tokens), [PROMPTS[1][-1]]]
    parents = [TREE.runner_parents(), [-1]]
    logits = padded_forward(runner, tokens, parents, [list(range(TREE.size + 1)), [0]])  # [2, n+1, V], row 1 padded
    assert logits is not None
    return torch.cat([logits[0], logits[1, :1]])  # the logits asked for (pads are garbage)


def _shard_worker(rank: int, world: int, port: int, paths: list[str], out: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    tp.join_group(rank, world, "127.0.0.1", port, "cpu", str(TORCH_EXTENSIONS))
    for path in paths:
        model = tp.shard(load_lm(ModelConfig(path=path, dtype="float32")), world)
        out[path if rank == 0 else f"{path}#1"] = runner_logits(model)
        out[f"{path}#params{rank}"] = sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run on a machine compiles DeepSpeed's CPU all-reduce (~2 min)
def test_sharded_logits_equal_unsharded(
    shm_op_built: None, tiny_pair: TinyPair, tiny_qwen: str, tiny_gpt2: str
) -> None:
    paths = [tiny_pair.target, tiny_qwen, tiny_gpt2]
    port = _free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_shard_worker, args=(2, port, paths, out), nprocs=2, join=True)
        results = dict(out)
    leftovers = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not leftovers, f"shared-memory segments outlived the TP group: {leftovers}"
    for path in paths:
        full = load_lm(ModelConfig(path=path, dtype="float32"))
        n_full = sum(p.numel() for p in full.parameters())
        assert results[f"{path}#params0"] < n_full and results[f"{path}#params1"] < n_full, "not sharded"
        reference = runner_logits(full)
        for key in (path, f"{path}#1"):
            assert results[key].shape == reference.shape
            assert (results[key] - reference).abs().max() <= 1e-5, key
        assert torch.equal(results[path], results[f"{path}#1"]), "every rank must hold identical logits"


def test_gpt2_split_keeps_shapes(tiny_gpt2: str) -> None:
    """The plain split's bookkeeping, without a process group (rank 1 of 2)."""
    model: Any = load_lm(ModelConfig(path=tiny_gpt2, dtype="float32"))
    tp.shard_gpt2(model, rank=1, world=2)
    block = model.transformer.h[0]
    assert block.attn.c_attn.weight.shape == (64, 96) and block.attn.split_size == 32
    assert block.attn.c_proj.weight.shape == (32, 64)
    assert block.mlp.c_fc.weight.shape == (64, 128) and block.mlp.c_proj.weight.shape == (128, 64)
