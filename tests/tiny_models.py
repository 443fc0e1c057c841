"""Tiny seeded random models (fp32) for exactness tests: they say nothing about acceptance rates."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedModel, Qwen2Config

from speculative.drafters.eagle import EagleModel
from speculative.drafters.medusa import MedusaHeads
from speculative.train.fit import eagle_shape

VOCAB = 96
ARCHS = ("llama", "qwen2", "gpt2")


def tiny_config(arch: str, layers: int = 2):
    if arch in ("llama", "qwen2"):
        config_class = LlamaConfig if arch == "llama" else Qwen2Config
        return config_class(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=1024, bos_token_id=0, eos_token_id=1
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, layers: int = 2) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers), attn_implementation="sdpa").eval()
    # Sharpen the output so greedy choices are far from ties and drafts can agree with the target.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


def noisy_copy(model: PreTrainedModel, noise: float, seed: int = 1) -> PreTrainedModel:
    """A draft that agrees with `model` often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    return draft


def reference_greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's own `generate(do_sample=False)`, one sequence at a time."""
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def padded_forward(runner, tokens, parents, logits_at=None) -> torch.Tensor | None:
    """`ModelRunner.forward`'s packed logits laid out as [B, m, V] float32 on the CPU (pads zero)."""
    flat = runner.forward(tokens, parents, logits_at)
    if flat is None or logits_at is None:
        return None
    out = torch.zeros(len(logits_at), max(max(len(a) for a in logits_at), 1), flat.shape[-1])
    start = 0
    for b, at in enumerate(logits_at):
        out[b, : len(at)] = flat[start : start + len(at)].float().cpu()
        start += len(at)
    return out


def full_logits(model, tokens: list[int]) -> torch.Tensor:  # [V] the model's next-token logits after `tokens`
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def joined_mid_stream(decoder, prompts: list[list[int]], params, steps_first: int = 3) -> list[list[int]]:
    """Outputs in prompt order when the first prompt runs `steps_first` steps alone and the rest join then
    (continuous batching); `decoder`: a `SpeculativeDecoder`."""
    first = decoder.add(prompts[0], params)
    for _ in range(steps_first):
        decoder.step()
    later = [decoder.add(p, params) for p in prompts[1:]]
    while decoder.has_work:
        decoder.step()
    by_id = {s.seq_id: s.output for s in decoder.finished}
    return [by_id[i] for i in [first, *later]]


def heads_for(target: torch.nn.Module, heads: int = 4, seed: int = 0) -> MedusaHeads:
    """Random heads laid out as Medusa initialises them: each projection a noisy copy of the target's LM
    head (so a head's guesses are sometimes right), the residual blocks random and small."""
    torch.manual_seed(seed)
    lm_head = target.get_output_embeddings().weight
    module = MedusaHeads(lm_head.shape[1], lm_head.shape[0], heads)
    with torch.no_grad():
        for head in module.medusa_head:
            head[0].linear.weight.mul_(0.1)
            head[-1].weight.copy_(lm_head + 0.3 * lm_head.std() * torch.randn_like(lm_head))
    return module.eval()


def eagle_for(target: torch.nn.Module, seed: int = 0) -> EagleModel:
    """A random EAGLE head shaped for `target` (its attention and MLP sizes; qkv biases for Qwen2): fc passes
    the target's feature through beside a little of the token's embedding, the layer's weights small, so its
    guess of the next feature is near the target's own and its drafts are sometimes right."""
    shape = eagle_shape(target.config)
    torch.manual_seed(seed)
    model = EagleModel(shape)
    h = shape.hidden
    with torch.no_grad():
        model.fc.weight.mul_(0.1)
        model.fc.weight[:, h:] += torch.eye(h)
        for p in model.layers.parameters():
            if p.dim() > 1:
                p.mul_(0.1)
    return model.eval()
