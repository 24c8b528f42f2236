"""A model that fits starts with no flags: the KV pool and the context sized from the model and the machine
(runner/kv_sizing.py's arithmetic, wired in runner/build.py, the server's estimate in server/models.py).
The machine is faked: read_meminfo gives what a test says, so every size here is exact."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from server_utils import LiveServer, tiny_engine_config
from shoal.runner import model_runner
from shoal.runner.kv_sizing import MIN_MARGIN, WORKSPACE, GiB, Machine, MiB
from shoal.engine.builder import weight_file_bytes
from shoal.server.models import Lifecycle, ModelSpec

LONG = 131072  # a trained context as Llama 3.1's and Qwen3's
PER_TOKEN = 3 * 2 * 2 * 16 * 4  # the tiny llama in float32: layers x (K, V) x KV heads x head_dim x bytes


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny llama with a 128k trained context."""
    from tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("long-llama"), max_position_embeddings=LONG)


@pytest.fixture
def machine(monkeypatch):
    """Fake the machine: set `.available` (bytes) before building; total 8 GiB, so the margin is its 1 GiB floor."""

    class Fake:
        available = 64 * GiB

    monkeypatch.setattr(model_runner, "read_meminfo", lambda: Machine("cpu", Fake.available, 8 * GiB))
    return Fake


def config(path, **kw):
    kw.setdefault("num_blocks", None)  # tiny_engine_config's default pool is fixed: these tests size it
    return tiny_engine_config(path, **kw)


def test_a_tiny_model_with_a_128k_context_starts_with_no_flags(long_llama, machine, caplog):
    from shoal.engine.builder import build_engine

    with caplog.at_level(logging.INFO, logger="shoal.engine"):
        engine = build_engine(config(long_llama))
    assert engine.max_model_len == LONG
    assert engine.snapshot.kv_capacity_tokens == LONG  # one sequence of the context: more than 64 conversations of 1k
    assert engine.snapshot.kv_bytes_per_token == PER_TOKEN
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("context "))
    assert line.startswith(f"context {LONG} tokens (the model's trained length); KV pool 96 MiB = {LONG} tokens of "
                           f"float32 at {PER_TOKEN} bytes a token (auto: one sequence of the context, within the room")


def test_a_context_that_does_not_fit_the_machine_is_capped_and_served_so(long_llama, machine, caplog):
    machine.available = MIN_MARGIN + WORKSPACE + 40 * MiB  # room for 40 MiB of KV: 54,613 tokens of this model
    blocks = 40 * MiB // (PER_TOKEN * 8)  # tiny_engine_config's blocks hold 8 tokens
    with caplog.at_level(logging.INFO, logger="shoal.engine"), LiveServer(config(long_llama)) as srv, srv.http() as h:
        assert srv.engine.snapshot.kv_capacity_tokens == blocks * 8 == 54608
        assert srv.engine.max_model_len == blocks * 8
        card = h.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == blocks * 8
        too_long = h.post("/v1/completions", json={"prompt": [5] * (blocks * 8 + 1), "max_tokens": 1})
        assert too_long.status_code == 400 and str(blocks * 8) in too_long.json()["error"]["message"]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("context "))
    assert line.startswith(f"context {blocks * 8} tokens (the model's trained length is {LONG}; the pool holds one "
                           f"sequence of {blocks * 8}); KV pool 40 MiB")
    assert "(auto: the room, " in line


def test_a_machine_without_room_for_a_small_context_is_refused_in_words(long_llama, machine):
    from shoal.engine.builder import build_engine

    machine.available = MIN_MARGIN + WORKSPACE + 1 * MiB  # 1 MiB of room: 1,360 tokens
    with pytest.raises(ValueError, match=r"^not even a context of 2048 tokens fits the KV cache: the pool holds 1360 "
                                         r"tokens .* 2048 tokens need 2 MiB \(131072 tokens, the model's trained length, 96 MiB\)"):
        build_engine(config(long_llama))


def test_an_explicit_context_that_cannot_fit_is_a_clear_error_without_a_traceback(long_llama):
    run = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "serve", "--model", str(long_llama), "--port", "0", "--dtype", "float32",
         "--max-model-len", "100000", "--kv-cache-memory", "8MiB"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert ("shoal: the model failed to load: --max-model-len 100000 needs 73 MiB of KV cache for one sequence, and "
            "the pool holds 8 MiB (10912 tokens; --kv-cache-memory 8 MiB): lower --max-model-len to at most 10912, "
            "give --kv-cache-memory 74 MiB or more") in run.stderr


def test_the_servers_estimate_before_a_load_is_the_pool_the_load_takes(tiny_llama_path, long_llama, machine):
    specs = [ModelSpec("short", config(tiny_llama_path)), ModelSpec("long", config(long_llama))]
    budget = 2 * GiB
    with LiveServer(specs, lifecycle=Lifecycle(memory=budget, preload="none")) as srv, srv.http() as h:
        models = srv.state.models.models
        estimates = {name: m.memory for name, m in models.items()}
        assert not any(m.measured for m in models.values())
        for name in models:
            assert h.post("/v1/models", json={"model": name}).status_code == 200
        for name, m in models.items():
            assert m.loaded and m.measured
            assert estimates[name] == weight_file_bytes(m.config) + m.engine.snapshot.kv_total_bytes + WORKSPACE, name
        # the 512-position model aims at 64 conversations of 512 tokens (its whole context), the long one at one of 128k
        assert models["short"].engine.snapshot.kv_capacity_tokens == 64 * 512
        assert models["long"].engine.snapshot.kv_capacity_tokens == LONG


def test_a_memory_budget_caps_an_auto_pool(long_llama, machine):
    weights = weight_file_bytes(config(long_llama))
    budget = weights + WORKSPACE + 10 * MiB
    with LiveServer([ModelSpec("long", config(long_llama))], lifecycle=Lifecycle(memory=budget)) as srv:
        blocks = 10 * MiB // (PER_TOKEN * 8)
        assert srv.engine.snapshot.kv_capacity_tokens == blocks * 8 and srv.engine.max_model_len == blocks * 8


def test_a_draft_models_pool_holds_the_targets_tokens_beside_it(long_llama, tmp_path, machine):
    from shoal.config import SpeculativeConfig
    from shoal.engine.builder import build_engine
    from tiny_models import make_tiny_model

    draft = make_tiny_model("llama", tmp_path / "draft", max_position_embeddings=LONG, num_hidden_layers=1, seed=3)
    machine.available = MIN_MARGIN + WORKSPACE + 40 * MiB
    engine = build_engine(config(long_llama, speculative=SpeculativeConfig(method="draft", model=str(draft))))
    share = PER_TOKEN / (PER_TOKEN + PER_TOKEN // 3)  # the draft has one layer of the target's three
    blocks = int(40 * MiB * share) // (PER_TOKEN * 8)
    assert engine.runner.num_blocks == blocks == 5120
    assert engine.speculator.proposer.runner.num_blocks == blocks  # as many tokens, at a third of the bytes
    assert engine.max_model_len == blocks * 8


def test_the_device_side_reads_cudas_free_memory(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GiB, 80 * GiB))
    assert model_runner.machine_memory(torch.device("cuda")) == Machine("cuda", 30 * GiB, 80 * GiB)


def test_the_python_api_takes_auto_and_sizes_in_words(long_llama, machine):
    from shoal import LLM

    llm = LLM(str(long_llama), dtype="float32", kv_cache_memory="auto", max_model_len="auto")
    assert llm.engine.max_model_len == LONG
    sized = LLM(str(long_llama), dtype="float32", kv_cache_memory="32MiB")
    assert sized.engine.snapshot.kv_capacity_tokens == 32 * MiB // (PER_TOKEN * 16) * 16
    assert sized.engine.max_model_len == sized.engine.snapshot.kv_capacity_tokens  # the trained 128k capped to the pool
