"""The server on the real default model (SmolLM2-135M-Instruct): a question with a known answer."""

import pytest

from server_utils import LiveServer
from shoal.config import EngineConfig

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv(default_gguf_path):
    # Loaded the way `shoal serve` loads it: from a config, in the background.
    with LiveServer(EngineConfig(model="smollm2", max_model_len=1024)) as s:
        yield s


def test_capital_of_france_is_paris(srv):
    client = srv.openai()
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    answer = r.choices[0].message.content
    assert "Paris" in answer
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=32, stream=True) if ch.choices)
    assert streamed == answer


def test_second_turn_reports_cached_prompt_tokens(srv):
    client = srv.openai()
    first = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16)
    convo = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And of Germany?"}]
    second = client.chat.completions.create(model="smollm2", messages=convo, temperature=0, max_tokens=16)
    assert "Berlin" in second.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached < second.usage.prompt_tokens
    if getattr(srv.engine, "prefix_cache", None) is not None:
        assert cached >= first.usage.prompt_tokens // 2  # the first turn's prompt was reused
