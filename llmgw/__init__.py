"""llmgw: a fleet manager and OpenAI-compatible gateway for LLM inference on GPU machines."""

__version__ = "0.1.0"

__all__ = ["__version__"]
