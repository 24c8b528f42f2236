"""The server on the real default model (SmolLM2-135M-Instruct): a question with a known answer."""

from typing import Literal

import pydantic
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


def test_anthropic_messages_on_the_real_model(srv):
    import anthropic

    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    kw = dict(model="smollm2", max_tokens=32, messages=QUESTION, extra_body={"temperature": 0})
    r = client.messages.create(**kw)
    assert "Paris" in r.content[0].text and r.stop_reason == "end_turn"
    assert client.messages.count_tokens(model="smollm2", messages=QUESTION).input_tokens == r.usage.input_tokens
    with client.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == r.content[0].text


def test_forced_tool_call_on_the_real_model_through_the_manual_format(srv):
    assert not srv.state.renderer.supports_tools  # SmolLM2's template has no tools: shoal's own format
    client = srv.openai()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"], "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smollm2", messages=ask, tools=tools, tool_choice="required", temperature=0, max_tokens=64)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in call.function.arguments
    assert r.choices[0].finish_reason == "tool_calls"


# ---------------------------------------------------------------- structured output, as the SDKs' docs use it


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


class Pet(pydantic.BaseModel):
    name: str
    species: Literal["cat", "dog", "fish", "bird"]


class Person(pydantic.BaseModel):
    name: str
    age: int
    pets: list[Literal["cat", "dog", "fish", "bird"]]


class Owner(pydantic.BaseModel):
    name: str
    pets: list[Pet]


PROMPTS = [("Describe Paris.", City), ("Describe Tokyo.", City), ("Invent a person.", Person), ("Invent a pet owner.", Owner)]


def test_openai_sdk_parse_finishes_on_the_default_model(srv):
    """`chat.completions.parse` as OpenAI's docs call it: no temperature, no max_tokens (the context is the bound)."""
    client = srv.openai()
    for prompt, model in PROMPTS:
        r = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": prompt}], response_format=model)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(r.choices[0].message.parsed, model)


def test_langchain_with_structured_output_finishes_on_the_default_model(srv):
    """LangChain's docs build the chat model with temperature 0; a reply that ran out would raise LengthFinishReasonError."""
    import langchain_openai

    chat = langchain_openai.ChatOpenAI(model="smollm2", base_url=srv.url + "/v1", api_key="unused", temperature=0, max_retries=0)
    for prompt, model in PROMPTS:
        out = chat.with_structured_output(model, method="json_schema").invoke(prompt)
        assert isinstance(out, model), out
    paris = chat.with_structured_output(City, method="json_schema").invoke("Describe Paris.")
    assert paris.name == "Paris" and -(2**63) <= paris.population < 2**63
