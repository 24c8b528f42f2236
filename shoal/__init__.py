"""shoal: a fast, correct, easy-to-run LLM inference server."""

import os

# SHOAL_CPU_ISA=avx2|baseline forces shoal's native kernels onto that path (shoal/kernels). torch's own
# kernels are capped with it: ATen's dispatch and oneDNN read these variables once, when torch loads or first
# computes, which is why they are set here, before anything imports torch (MKL honours its variable on Intel
# CPUs only; shoal's default configuration uses no MKL). A value already set wins.
_TORCH_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
               "baseline": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}
for _name, _value in _TORCH_CAPS.get(os.environ.get("SHOAL_CPU_ISA", "").strip().lower(), {}).items():
    os.environ.setdefault(_name, _value)

from shoal.types import FinishReason, GenerationRequest, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationRequest", "RequestOutput", "FinishReason"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the engine (and torch) only when it is asked for.
    if name == "LLM":
        from shoal.engine.llm import LLM

        return LLM
    raise AttributeError(name)
