"""The delta pipeline every protocol streams through: reasoning split -> tool-call parsing -> text.

`feed(delta, final)` takes a choice's newest text and returns what it holds: reasoning,
answer text and whole tool calls. Calls are parsed from the answer only, never from the
reasoning. A whole reply fed at once (`final=True`) gives what its pieces give.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.server.chat.reasoning import ReasoningSplitter
from shoal.server.chat.tools import ToolCall, make_parser


@dataclass
class Delta:
    reasoning: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class DeltaPipeline:
    def __init__(self, reasoning_parser: str | None, tool_parser: str | None) -> None:
        self._splitter = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self._tools = make_parser(tool_parser) if tool_parser else None

    def feed(self, delta: str, final: bool = False) -> Delta:
        out = Delta()
        if self._splitter is not None:
            split = self._splitter.feed(delta, final=final)
            out.reasoning, delta = split.reasoning, split.content
        if self._tools is None:
            out.text = delta
            return out
        parsed = self._tools.feed(delta)
        if final:
            parsed += self._tools.finish()
        out.text, out.calls = parsed.text, parsed.calls
        return out
