"""Split a thinking model's `<think>...</think>` text out of its answer.

One small state machine serves streaming and non-streaming alike (the whole
text is just one delta), so a streamed answer joined is the non-streamed one.

- `deepseek_r1`: the chat template usually opens `<think>` itself, so the
  output starts inside the reasoning; a leading `<think>` is dropped if the model
  writes it anyway. Everything up to `</think>` is reasoning.
- `qwen3`: the output is answer text until the model writes `<think>`
  (with `enable_thinking=False` it never does).

A tag split across deltas ("</th" + "ink>") is held back until it is complete
or can no longer be one.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.types import ThinkingBudget

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, parser: str) -> None:
        if parser not in ("deepseek_r1", "qwen3"):
            raise ValueError(f"unknown reasoning parser {parser!r} (deepseek_r1 or qwen3)")
        self.in_reasoning = parser == "deepseek_r1"
        self._strip_start = parser == "deepseek_r1"  # drop a leading <think> the template already opened
        self._done = False  # after </think> everything is content
        self._held = ""

    def feed(self, delta: str, final: bool = False) -> Split:
        out = Split()
        text = self._held + delta
        self._held = ""
        while text:
            if self._strip_start:
                stripped = text.lstrip()
                if START.startswith(stripped) and not final:  # maybe the start of "<think>"
                    self._held = text
                    return out
                self._strip_start = False
                if stripped.startswith(START):
                    text = stripped[len(START) :]
                    continue
            if self._done:
                out.content += text
                break
            tag = END if self.in_reasoning else START
            i = text.find(tag)
            if i >= 0:
                self._emit(out, text[:i])
                text = text[i + len(tag) :]
                if self.in_reasoning:
                    self._done = True
                self.in_reasoning = not self.in_reasoning
                continue
            keep = 0 if final else _partial_suffix(text, tag)
            self._emit(out, text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return out

    def _emit(self, out: Split, text: str) -> None:
        if self.in_reasoning:
            out.reasoning += text
        else:
            out.content += text


def split_reasoning(parser: str, text: str) -> Split:
    """The whole output at once."""
    return ReasoningSplitter(parser).feed(text, final=True)


def thinking_budget(served, tokens: int) -> ThinkingBudget | None:
    """A cap of `tokens` on the reasoning, for a model whose reasoning tags the server knows (--reasoning-parser);
    None where it does not (the template's thinking switch alone applies). The engine ends the reasoning by
    forcing its closing tag's tokens once the cap is reached."""
    parser = served.settings.reasoning_parser
    if parser is None:
        return None
    encode = served.engine.tokenizer.encode
    start = () if parser == "deepseek_r1" else tuple(encode(START, add_special_tokens=False))  # R1 opens it in the template
    return ThinkingBudget(tokens, tuple(encode(END, add_special_tokens=False)), start)
