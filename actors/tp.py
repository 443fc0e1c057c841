"""Tensor parallelism for one target replica: the process group and the sharded model.

`join_group` makes the calling process rank `rank` of a `torch.distributed` group (gloo on CPU,
NCCL on GPU) through DeepSpeed, which also builds its CPU shared-memory all-reduce op: that
compile happens once per `TORCH_EXTENSIONS_DIR` and is cached (docs/models.md).
`shard` splits the model: DeepSpeed AutoTP (`init_inference(tensor_parallel=...)`) for the
architectures it knows (Llama, Qwen2, ...), else the plain column/row split below for GPT-2,
which AutoTP refuses. Every rank then holds 1/tp of the attention heads and MLP columns; the
outputs of the row-parallel projections are all-reduced, so every rank ends each layer with the
full hidden state and computes identical logits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def join_group(rank: int, world: int, address: str, port: int, device: str, extensions_dir: str) -> None:
    """Initialize the default process group of a TP group whose rank 0 listens on address:port."""
    env = {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": rank,
        "LOCAL_SIZE": world,  # else DeepSpeed's shm all-reduce segfaults on the first forward
        "MASTER_ADDR": address,  # also names the shm segments, so two groups on a node stay apart
        "MASTER_PORT": port,
        "TORCH_EXTENSIONS_DIR": str(Path(extensions_dir).expanduser()),
    }
    os.environ.update({k: str(v) for k, v in env.items()})
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # by configuration, not by what GPUs Ray declared
    import deepspeed  # imported here: it reads the environment above at import time

    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", auto_mpi_discovery=False)
    if device == "cpu":
        _unlink_shm_names(address, port, rank)


def _unlink_shm_names(address: str, port: int, rank: int) -> None:
    """Remove this rank's name of DeepSpeed's shared-memory all-reduce segment once all ranks mapped it.

    `init_distributed` maps every rank's segment (/dev/shm/deepspeed_allreduce_buffer_..._<address>_
    <port>_<rank>, 64 MB) before it returns, so after a barrier the names are no longer needed. Left in
    place they outlive their processes whenever a shard is killed (replica replaced, node lost, test
    teardown) and pin their memory until reboot; unlinked, the kernel frees it with the last mapping.
    """
    dist.barrier()
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{address}_{port}_{rank}"):
        path.unlink(missing_ok=True)


def shard(model: PreTrainedModel, world: int) -> PreTrainedModel:
    """The model split over the current process group (identity at world 1)."""
    if world == 1:
        return model
    if model.config.model_type == "gpt2":
        return shard_gpt2(model, dist.get_rank(), world)
    import deepspeed

    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": world}, dtype=model.dtype, replace_with_kernel_inject=False
    )
    return engine.module


class RowParallel(nn.Module):
    """y = all_reduce(x_r @ W_r) + b: a Conv1D / Linear whose input features are split over ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [in / tp, out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in / tp]
        y = x @ self.weight  # [..., out], a partial sum
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _columns(conv: Any, index: torch.Tensor) -> None:
    """Keep these output columns of a GPT-2 Conv1D (weight [in, out])."""
    conv.weight = nn.Parameter(conv.weight.data[:, index].contiguous(), requires_grad=False)
    conv.bias = nn.Parameter(conv.bias.data[index].contiguous(), requires_grad=False)
    conv.nf = index.numel()


def shard_gpt2(model: Any, rank: int, world: int) -> PreTrainedModel:
    """Megatron-style split of every GPT-2 block: heads and MLP columns by rank."""
    config = model.config
    heads, embed = config.n_head, config.n_embd
    if heads % world or (config.n_inner or 4 * embed) % world:
        raise ValueError(f"tp_size {world} must divide the heads ({heads}) and the MLP width")
    head_dim = embed // heads
    mine = torch.arange(rank * embed // world, (rank + 1) * embed // world)  # this rank's head features
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        _columns(attn.c_attn, torch.cat([mine, mine + embed, mine + 2 * embed]))  # q, k, v of my heads
        attn.num_heads, attn.split_size = heads // world, embed // world
        assert attn.head_dim == head_dim
        attn.c_proj = RowParallel(attn.c_proj.weight.data[mine].contiguous(), attn.c_proj.bias.data)
        inner = mlp.c_fc.weight.shape[1]
        cols = torch.arange(rank * inner // world, (rank + 1) * inner // world)
        _columns(mlp.c_fc, cols)
        mlp.c_proj = RowParallel(mlp.c_proj.weight.data[cols].contiguous(), mlp.c_proj.bias.data)
    return model
