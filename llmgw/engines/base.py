"""Names of the inference engines llmgw knows how to run."""

from __future__ import annotations

ENGINES: tuple[str, ...] = ("sim", "vllm", "sglang", "llamacpp")


def engine_names() -> tuple[str, ...]:
    """The known engine names, ``sim`` (built in) first."""
    return ENGINES
