"""LangChain's ChatOpenAI and ChatAnthropic, unmodified, against a tiny-model shoal server:
plain replies, streaming, and bound tools with a forced choice coming back as tool calls."""

from __future__ import annotations

import jsonschema
import langchain_anthropic
import langchain_openai
import pytest

from server_utils import LiveServer, tiny_engine
from tiny_models import TOOLS_TEMPLATE, make_tiny_model

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
ADD_TOOL = {"name": "add", "description": "Add two integers", "input_schema": ADD}
OPENAI_ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("langchain"), chat_template=TOOLS_TEMPLATE, max_position_embeddings=2048)
    with LiveServer(tiny_engine(path, max_model_len=2048, num_blocks=1024)) as s:
        yield s


def models(srv, max_tokens=24):
    name = srv.state.model_name
    return [
        langchain_openai.ChatOpenAI(model=name, base_url=srv.url + "/v1", api_key="unused", max_tokens=max_tokens, temperature=1.0, seed=5, max_retries=0),
        langchain_anthropic.ChatAnthropic(model=name, base_url=srv.url, api_key="unused", max_tokens=max_tokens, max_retries=0,
                                          model_kwargs={"extra_body": {"temperature": 1.0, "seed": 5}}),
    ]


def test_invoke_and_stream_give_the_same_text(srv):
    for chat in models(srv):
        whole = chat.invoke("What is 2 + 3?")
        assert isinstance(whole.content, (str, list)) and whole.text
        streamed = "".join(chunk.text for chunk in chat.stream("What is 2 + 3?"))
        assert streamed == whole.text, type(chat).__name__


def test_bound_tools_with_a_forced_choice_return_valid_tool_calls(srv):
    openai_chat, anthropic_chat = models(srv, max_tokens=200)
    for bound in (openai_chat.bind_tools([OPENAI_ADD], tool_choice="add"), anthropic_chat.bind_tools([ADD_TOOL], tool_choice="add")):
        msg = bound.invoke("Add 2 and 3.")
        assert [c["name"] for c in msg.tool_calls] == ["add"], msg
        jsonschema.validate(msg.tool_calls[0]["args"], ADD)
