"""The precomputed SSE chunk encoder and the reasoning splitter (no server, no model)."""

import json

import pytest

from shoal.server.chat.reasoning import ReasoningSplitter, split_reasoning
from shoal.server.sse import DeltaEncoder, encode_event

TEXTS = [
    "",
    "hello",
    " Paris.",
    'quote " and backslash \\ and slash /',
    "new\nline\ttab\rreturn\x00nul\x1fus\x7fdel",
    "héllo naïve café 日本語 🙂 \u2028\u2029",
    "</script><!-- & -->",
    "\ud7ff\ue000\uffff",
]


def _chat_chunk(index, text, model="tiny \"model\" ü"):
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
    }


@pytest.mark.parametrize("text", TEXTS)
def test_delta_encoder_is_byte_for_byte_json_dumps(text):
    enc = DeltaEncoder(_chat_chunk)
    for index in (0, 3):
        fast = enc.encode(index, text)
        assert fast == encode_event(_chat_chunk(index, text))
        assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
        assert json.loads(fast[6:-2]) == _chat_chunk(index, text)


def test_delta_encoder_with_a_sentinel_like_text_and_completions_shape():
    def chunk(i, t):
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": None}]}

    enc = DeltaEncoder(chunk)
    for text in ["\x00shoal-delta\x00", "data: [DONE]\n\n"] + TEXTS:
        assert enc.encode(1, text) == encode_event(chunk(1, text))


# ---------------------------------------------------------------- reasoning


def _stream(parser, text, cut):
    """Feed `text` in pieces of `cut` characters; return the joined (reasoning, content)."""
    s = ReasoningSplitter(parser)
    r = c = ""
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)] or [""]
    for k, piece in enumerate(pieces):
        out = s.feed(piece, final=k == len(pieces) - 1)
        r, c = r + out.reasoning, c + out.content
    return r, c


@pytest.mark.parametrize(
    "parser, text, reasoning, content",
    [
        ("deepseek_r1", "I should say hi.</think>Hello!", "I should say hi.", "Hello!"),
        ("deepseek_r1", "<think>plan</think>\n\nanswer", "plan", "\n\nanswer"),
        ("deepseek_r1", "still thinking when cut off", "still thinking when cut off", ""),
        ("qwen3", "<think>\nhmm\n</think>\n\nParis", "\nhmm\n", "\n\nParis"),
        ("qwen3", "no thinking at all", "", "no thinking at all"),
        ("qwen3", "a < b and </thin is not a tag", "", "a < b and </thin is not a tag"),
        ("qwen3", "<think>x</think>y <think> stays", "x", "y <think> stays"),
    ],
)
def test_reasoning_split_is_the_same_whole_or_in_any_pieces(parser, text, reasoning, content):
    whole = split_reasoning(parser, text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cut in range(1, len(text) + 1):
        assert _stream(parser, text, cut) == (reasoning, content), cut


def test_a_partial_tag_is_held_back_until_it_resolves():
    s = ReasoningSplitter("deepseek_r1")
    assert s.feed("thought</th").reasoning == "thought"
    out = s.feed("ink>answer")
    assert (out.reasoning, out.content) == ("", "answer")
