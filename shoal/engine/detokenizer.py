"""Incremental detokenization and stop-string matching for one output sequence.

Plain bookkeeping over a tokenizer object (no torch). Per generated token the
cost is one small decode, plus a stop-string search over the new tail only.

Detokenizing (the vLLM prefix/read-offset technique): the text of a few tokens
before the read point is known; each new token decodes those tokens and the
unread ones, and whatever that text adds past the known prefix is the new text.
A decode that ends in U+FFFD means a byte-level token split a UTF-8 character:
nothing is released until a later token completes it (on finish the remainder
is released as `decode` would show it). Two windows do this:

- `_StreamWindow`, for transformers' fast tokenizers (decode is their
  `tokenizers.Tokenizer`'s): tokenizers' `DecodeStream` (Rust, as in vLLM v1),
  one call per token. Measured against `_TokenWindow` on the default model's
  tokenizer (3,000 tokens, paired and alternated, median of 30 rounds, run 3
  times): 0.60-0.72x the time per token, 0.76-0.85x with three stop strings.
  Token for token the same deltas wherever decode never takes back a
  character it showed (tests/test_detokenizer.py compares both windows).
- `_TokenWindow`, kept for what DecodeStream cannot serve: a tokenizer with no
  `tokenizers` backend (or its own decode), and tokenizers before 0.23, whose
  DecodeStream cannot be copied for a fork. The token strings of the window
  are kept in a list and decoded by the tokenizer, re-anchored every few
  tokens where the text was complete.

Decode can take back a character it showed only with byte fallback: bytes
that made "日", then a stray byte, and every byte of the run shows as U+FFFD.
What was sent stays sent; both windows go on with the text past the length
of the known prefix, so the character count stays decode's.

The window is seeded with the last few prompt tokens (starting and ending on
whole characters), so tokenizers whose decoders strip the leading space of the
first token (SentencePiece/Metaspace) give " Paris" rather than "Paris" for an
output that continues a prompt: prompt text + output text is the full text.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["IncrementalDetokenizer", "StopMatch"]

_REPLACEMENT = "\ufffd"
# How many prompt tokens seed the window (vLLM uses 5).
_PROMPT_CONTEXT = 5
# Prompt tokens looked at (from the end) to find that many non-special ones.
_PROMPT_SCAN = 32
# `_TokenWindow`: re-anchor the window once it holds more token strings than this.
_MAX_WINDOW = 6
# `_StreamWindow`: drop the ids before the window once this many have gone by.
_MAX_KEPT_IDS = 64
# How tokenizers' DecodeStream reports text that no longer starts with what it released.
_INVALID_PREFIX = "Invalid prefix encountered"

# Modules whose `convert_tokens_to_string` is exactly `backend_tokenizer.decoder.decode`
# (or " ".join without a decoder), and whose `_decode` is `backend_tokenizer.decode`
# (the module of transformers' `decode` that only calls `_decode`: `_BASE_MODULE`).
_PLAIN_FAST_MODULES = frozenset(
    {"transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"}
)
_BASE_MODULE = "transformers.tokenization_utils_base"


@dataclass(frozen=True)
class StopMatch:
    """A stop string that matched: which one, and where it starts in the output text."""

    stop: str
    offset: int  # character offset of the match's start in the (untrimmed) output text


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
        self._skip_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._stops = tuple(s for s in dict.fromkeys(stop) if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Quick rejects: any stop at all (one C-level search for all of them), and
        # the characters a held-back tail can end with.
        self._any_stop = re.compile("|".join(map(re.escape, self._stops))) if self._stops else None
        self._prefix_end_chars = frozenset(c for s in self._stops for c in s[:-1])
        self._include_stop = include_stop_str_in_output

        window = _StreamWindow if _StreamWindow.fits(tokenizer) else _TokenWindow
        self._window: _StreamWindow | _TokenWindow = window(tokenizer, skip_special_tokens, prompt_token_ids, self._skip_ids)

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
        delta = self._window.step(token_id)
        if delta is None:  # nothing visible yet, or a UTF-8 character still incomplete
            return None
        return self._append_text(delta, check_stop)

    def take_delta(self, finished: bool = False) -> str:
        """The text released since the last call.

        While not finished, a tail that could still become a stop string is
        held back. With `finished` (for any reason) everything that belongs in
        the output is released, including bytes of an incomplete character
        (as U+FFFD, like `decode`), and the detokenizer takes no more tokens.
        """
        if finished and not self._flushed:
            self._flushed = True
            if self._stop_match is None:
                rest = self._window.flush()
                if rest:
                    self._append_text(rest, True)
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
        new._window = self._window.fork()
        new._released = list(self._released)
        return new

    # ------------------------------------------------------------ internals

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


def _seed_ids(prompt_token_ids: Sequence[int], skip_ids: frozenset[int], decode: Callable[[list[int]], str]) -> list[int]:
    """The last few non-skipped prompt ids, starting and ending on whole characters (else none)."""
    ids: list[int] = []
    for tid in reversed(list(prompt_token_ids[-_PROMPT_SCAN:])):
        if tid not in skip_ids:
            ids.append(int(tid))
            if len(ids) == _PROMPT_CONTEXT:
                break
    ids.reverse()
    # Drop leading tokens that start in the middle of a character.
    while ids and decode(ids).startswith(_REPLACEMENT):
        ids.pop(0)
    # A prompt that ends inside a character: decode the output on its own.
    if ids and decode(ids).endswith(_REPLACEMENT):
        return []
    return ids


class _StreamWindow:
    """The window of tokenizers' `DecodeStream`: one Rust call per token.

    The stream keeps the ids of the last chunk it released text for (its
    text, the prefix, is known) and the ids after it; each step decodes them
    all. Its state cannot be read back, so the same ids are kept here, for the
    finish flush (ids never completed) and the resync below:

        ids[prev:read]   the last chunk read: its text is the stream's prefix
        ids[read:]       not read yet (a character still incomplete)

    Special ids in `skip_ids` (transformers' list) never reach it; the stream
    itself skips the backend's special tokens (the same ones for the
    tokenizers shoal builds, and what `tokenizer.decode` skips).
    """

    @staticmethod
    def fits(tokenizer) -> bool:
        """Whether `tokenizer.decode` is its `tokenizers` backend's and `DecodeStream` can be copied (0.23+)."""
        cls = type(tokenizer)
        if getattr(getattr(cls, "decode", None), "__module__", None) != _BASE_MODULE:
            return False
        if getattr(getattr(cls, "_decode", None), "__module__", None) not in _PLAIN_FAST_MODULES:
            return False
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            return False
        from tokenizers.decoders import DecodeStream  # loaded already: the tokenizer is built on it

        return hasattr(DecodeStream, "__copy__")

    def __init__(self, tokenizer, skip_special_tokens: bool, prompt_token_ids: Sequence[int], skip_ids: frozenset[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._new_stream = lambda ids=None: DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
        backend = tokenizer.backend_tokenizer
        self._backend = backend
        self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        seed = _seed_ids(prompt_token_ids, skip_ids, self._decode)
        self._stream = self._new_stream(seed)
        self._ids = seed
        self._prev = 0
        self._read = len(seed)

    def step(self, token_id: int) -> str | None:
        """The text `token_id` adds, or None while there is none (or a character is incomplete)."""
        ids = self._ids
        ids.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            text = self._resync()
        if text is None:
            return None
        prev = self._read
        if prev > _MAX_KEPT_IDS:
            del ids[:prev]
            prev = 0
        self._prev, self._read = prev, len(ids)
        return text

    def _resync(self) -> str:
        """The new text when the window's text no longer starts with the known prefix.

        Byte-fallback bytes that made a character, then one that makes the run
        invalid: decode shows every byte of it as U+FFFD, and the character was
        sent already. As the hand-written window does, release what the text
        has past the prefix's length; the stream restarts at the read point.
        """
        ids, prev, read = self._ids, self._prev, self._read
        known = self._decode(ids[prev:read])
        text = self._decode(ids[prev:])
        self._stream = self._new_stream(ids[read:])
        return text[len(known) :]

    def flush(self) -> str:
        """The text of the unread ids, incomplete characters as U+FFFD; the window is spent."""
        ids, prev, read = self._ids, self._prev, self._read
        if read == len(ids):
            return ""
        known = self._decode(ids[prev:read])
        text = self._decode(ids[prev:])
        self._read = len(ids)
        return text[len(known) :]

    def fork(self) -> _StreamWindow:
        new = copy.copy(self)
        new._stream = copy.copy(self._stream)
        new._ids = list(self._ids)
        return new


class _TokenWindow:
    """A hand-written window over token strings, for tokenizers `_StreamWindow` does not fit.

    The token strings of the output (after the seed) are kept in a list; the
    text of `tokens[prefix_offset:read_offset]` is known, and each new token
    decodes `tokens[prefix_offset:]`. The window is re-anchored every few
    tokens, always at a point where the text was complete, so it stays small
    and never starts in the middle of a character.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, prompt_token_ids: Sequence[int], skip_ids: frozenset[int]) -> None:
        self._id_to_token = tokenizer.convert_ids_to_tokens
        self._to_string = _tokens_to_string_fn(tokenizer)
        seed = _seed_ids(prompt_token_ids, skip_ids, self._decode)
        self._tokens: list[str] = self._strings(seed)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text = self._to_string(self._tokens) if self._tokens else ""

    def _strings(self, ids: list[int]) -> list[str]:
        return [t for t in self._id_to_token(ids) if t is not None] if ids else []

    def _decode(self, ids: list[int]) -> str:
        return self._to_string(self._strings(ids))

    def step(self, token_id: int) -> str | None:
        """The text `token_id` adds, or None while there is none (or a character is incomplete)."""
        token = self._id_to_token(token_id)
        if token is None:  # an id outside the vocabulary: no text
            return None
        tokens = self._tokens
        tokens.append(token)
        prefix_text = self._prefix_text
        new_text = self._to_string(tokens[self._prefix_offset :] if self._prefix_offset else tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
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
        return delta

    def flush(self) -> str:
        """The text of the unread tokens, incomplete characters as U+FFFD; the window is spent."""
        tokens = self._tokens
        if self._read_offset == len(tokens):
            return ""
        new_text = self._to_string(tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(tokens)
        rest = new_text[len(self._prefix_text) :]
        self._prefix_text = ""
        return rest

    def fork(self) -> _TokenWindow:
        new = copy.copy(self)
        new._tokens = list(self._tokens)
        return new


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
