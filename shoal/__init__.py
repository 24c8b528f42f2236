"""shoal: a fast, correct, easy-to-run LLM inference server."""

from shoal.types import FinishReason, GenerationRequest, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationRequest", "RequestOutput", "FinishReason"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the engine (and torch) only when it is asked for.
    if name == "LLM":
        from shoal.engine.llm import LLM

        return LLM
    raise AttributeError(name)
