"""Incremental detokenization and stop-string matching for one output sequence.

Plain bookkeeping over a tokenizer object (no torch). Per generated token the
cost is one `convert_ids_to_tokens` and one decode of a small window of token
strings, plus a stop-string search over the new tail only.

Detokenizing (the vLLM prefix_offset/read_offset technique): the token strings
of the output (seeded with a few prompt tokens) are kept in a list; the text of
`tokens[prefix_offset:read_offset]` is known, and each new token decodes
`tokens[prefix_offset:]`; whatever that text adds past the known prefix is the
new text. A decode that ends in U+FFFD means a byte-level token split a UTF-8
character: nothing is released until a later token completes it (on finish the
remainder is released as `decode` would show it). The window is re-anchored
every few tokens, always at a point where the text was complete, so it stays
small and never starts in the middle of a character.

The prompt seed makes tokenizers whose decoders strip the leading space of the
first token (SentencePiece/Metaspace) give " Paris" rather than "Paris" for an
output that continues a prompt, so prompt text + output text is the full text.

Stop strings: matched on the text, across token boundaries, searching only the
last `len(new text) + max stop length - 1` characters. The winning match is
the first one the character stream completes (earliest end; on a tie, the
earliest start), so the result does not depend on how the text was split into
tokens. The text is trimmed at the start of the match (anything after it,
also within the same token, is dropped), or after it with
`include_stop_str_in_output`. Until then, `take_delta` holds back the longest
tail that is still a proper prefix of a stop string, and only as long as it is.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["IncrementalDetokenizer", "StopMatch"]

_REPLACEMENT = "\ufffd"
# How many prompt tokens seed the window (vLLM uses 5).
_PROMPT_CONTEXT = 5
# Prompt tokens looked at (from the end) to find that many non-special ones.
_PROMPT_SCAN = 32
# Re-anchor the window once it holds more token strings than this.
_MAX_WINDOW = 6

# Modules whose `convert_tokens_to_string` is exactly `backend_tokenizer.decoder.decode`
# (or " ".join without a decoder); for those, the decoder is called directly.
_PLAIN_FAST_MODULES = frozenset(
    {"transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"}
)


@dataclass(frozen=True)
class StopMatch:
    """A stop string that matched: which one, and where it starts in the output text."""

    stop: str
    offset: int  # character offset of the match's start in the (untrimmed) output text


def _tokens_to_string_fn(tokenizer):
    """`tokenizer.convert_tokens_to_string`, or the equivalent direct decoder call."""
    fn = getattr(type(tokenizer), "convert_tokens_to_string", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if fn is not None and getattr(fn, "__module__", None) in _PLAIN_FAST_MODULES and backend is not None:
        decoder = backend.decoder
        if decoder is not None:
            return decoder.decode
        return " ".join
    return tokenizer.convert_tokens_to_string


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, a delta at a time.

    `add_token` per generated token (returns a `StopMatch` when a stop string
    completes; after that the sequence is done and further tokens are ignored),
    `take_delta` whenever text should be sent out, `text` for the whole output.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        self._id_to_token = tokenizer.convert_ids_to_tokens
        self._to_string = _tokens_to_string_fn(tokenizer)
        self._skip_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._stops = tuple(s for s in dict.fromkeys(stop) if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Quick rejects: any stop at all (one C-level search for all of them), and
        # the characters a held-back tail can end with.
        self._any_stop = re.compile("|".join(map(re.escape, self._stops))) if self._stops else None
        self._prefix_end_chars = frozenset(c for s in self._stops for c in s[:-1])
        self._include_stop = include_stop_str_in_output

        # Window state: token strings (seed, then output), offsets into them.
        self._tokens: list[str] = self._seed(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text = self._to_string(self._tokens) if self._tokens else ""

        # Text state: released chunks, then text not yet released.
        self._released: list[str] = []
        self._num_released = 0  # characters
        self._pending = ""
        self._stop_match: StopMatch | None = None
        self._flushed = False  # the finish flush happened; nothing more is added

    # ------------------------------------------------------------ public API

    def add_token(self, token_id: int, *, check_stop: bool = True) -> StopMatch | None:
        """Append one generated token; the stop string it completed, if any.

        `check_stop=False` (e.g. before min_tokens) adds the text without
        looking for stop strings in it. Once a stop string matched (or the
        sequence was finished by `take_delta(finished=True)`) tokens are ignored.
        """
        token_id = int(token_id)  # numpy/torch scalars would be taken for a list
        if self._stop_match is not None or self._flushed or token_id in self._skip_ids:
            return None
        token = self._id_to_token(token_id)
        if token is None:  # an id outside the vocabulary: no text
            return None
        tokens = self._tokens
        tokens.append(token)
        prefix_text = self._prefix_text
        new_text = self._to_string(tokens[self._prefix_offset :] if self._prefix_offset else tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing visible yet, or a UTF-8 character still incomplete: wait.
            return None
        delta = new_text[len(prefix_text) :]
        n = len(tokens)
        if n - self._prefix_offset > _MAX_WINDOW:
            # Re-anchor at the previous read point (text was complete there).
            start = self._read_offset
            if start > _MAX_WINDOW * 4:
                del tokens[:start]
                n -= start
                start = 0
            self._prefix_offset = start
            self._prefix_text = self._to_string(tokens[start:])
        else:
            self._prefix_text = new_text
        self._read_offset = n
        return self._append_text(delta, check_stop)

    def take_delta(self, finished: bool = False) -> str:
        """The text released since the last call.

        While not finished, a tail that could still become a stop string is
        held back. With `finished` (for any reason) everything that belongs in
        the output is released, including bytes of an incomplete character
        (as U+FFFD, like `decode`), and the detokenizer takes no more tokens.
        """
        if finished and not self._flushed:
            self._flush()
        pending = self._pending
        if not pending:
            return ""
        if finished or self._stop_match is not None or not self._stops:
            out = pending
        else:
            hold = self._hold_len(pending)
            if hold == len(pending):
                return ""
            out = pending[: len(pending) - hold] if hold else pending
        self._pending = pending[len(out) :]
        self._released.append(out)
        self._num_released += len(out)
        return out

    @property
    def text(self) -> str:
        """The whole output text so far, released or not (trimmed at a matched stop string)."""
        released = self._released
        if len(released) > 1:
            released[:] = ["".join(released)]
        return (released[0] if released else "") + self._pending

    @property
    def stop_match(self) -> StopMatch | None:
        return self._stop_match

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched."""
        return self._stop_match is not None

    @property
    def num_pending_chars(self) -> int:
        """Characters of `text` not yet released by `take_delta`."""
        return len(self._pending)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (for a sequence forked mid-generation)."""
        new = copy.copy(self)
        new._tokens = list(self._tokens)
        new._released = list(self._released)
        return new

    # ------------------------------------------------------------ internals

    def _seed(self, prompt_token_ids: Sequence[int]) -> list[str]:
        """Token strings of the last few prompt tokens, starting and ending on whole characters."""
        skip = self._skip_ids
        ids: list[int] = []
        for tid in reversed(list(prompt_token_ids[-_PROMPT_SCAN:])):
            if tid not in skip:
                ids.append(int(tid))
                if len(ids) == _PROMPT_CONTEXT:
                    break
        ids.reverse()
        if not ids:
            return []
        tokens = [t for t in self._id_to_token(ids) if t is not None]
        # Drop leading tokens that start in the middle of a character.
        while tokens:
            text = self._to_string(tokens)
            if not text.startswith(_REPLACEMENT):
                break
            tokens.pop(0)
        # A prompt that ends inside a character: decode the output on its own.
        if tokens and self._to_string(tokens).endswith(_REPLACEMENT):
            return []
        return tokens

    def _append_text(self, delta: str, check_stop: bool) -> StopMatch | None:
        old_len = len(self._pending)
        pending = self._pending + delta
        self._pending = pending
        if not (check_stop and self._stops):
            return None
        # A match must end inside `delta` (else it would have matched before) and
        # cannot start in released text (that is held back while it could).
        start = max(0, old_len - self._max_stop_len + 1)
        if self._any_stop.search(pending, start) is None:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            i = pending.find(s, start)
            if i != -1:
                key = (i + len(s), i, s)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, i, s = best
        self._pending = pending[: end if self._include_stop else i]
        self._stop_match = StopMatch(stop=s, offset=self._num_released + i)
        return self._stop_match

    def _flush(self) -> None:
        """Release into `pending` the text of tokens still waiting for a character to complete."""
        self._flushed = True
        if self._stop_match is not None or self._read_offset == len(self._tokens):
            return
        tokens = self._tokens
        new_text = self._to_string(tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(tokens)
        if len(new_text) > len(self._prefix_text):
            self._append_text(new_text[len(self._prefix_text) :], True)
        self._prefix_text = ""

    def _hold_len(self, pending: str) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop string."""
        last = pending[-1]
        if last not in self._prefix_end_chars:
            return 0
        best = 0
        n = len(pending)
        for s in self._stops:
            # Candidate prefix lengths k (k < len(s), k <= n) whose last char is `last`.
            k = s.rfind(last, 0, min(len(s) - 1, n))
            while k + 1 > best:
                if pending.endswith(s[: k + 1]):
                    best = k + 1
                    break
                k = s.rfind(last, 0, k)
        return best
