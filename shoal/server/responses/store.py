"""Stored responses: a bounded map from a response's id to what continuing it needs. Plain Python.

A stored response keeps its body (what `GET /v1/responses/{id}` answers), its own input items
(`GET .../input_items`) and its context: every item that came before its output, previous turns included,
so `previous_response_id` rebuilds the whole conversation from one record even after the earlier
records have gone.

Two bounds, checked on every `put`: a number of responses and a number of bytes (each record counted as
the length of its JSON). The least recently used records go first; reading one (`get`, as a GET or a
continued turn does) makes it the most recent. A record larger than the byte bound alone is not kept.
The store lives on the app (`app.state.responses`), one per server; everything touches it from the event
loop, so it needs no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object as the client got it
    input_items: list[dict]  # this turn's input items, each with its id
    context: list[dict]  # the conversation before this turn's output: earlier turns' items, then input_items
    instructions: str | None  # not carried into a continued turn (OpenAI's rule), kept for GET
    nbytes: int

    @property
    def conversation(self) -> list[dict]:
        """What a continued turn starts from: the context and this turn's output."""
        return [*self.context, *self.body["output"]]


def record(body: dict, input_items: list[dict], context: list[dict], instructions: str | None = None) -> StoredResponse:
    """A record, with its size: the bytes of its JSON."""
    size = sum(len(json.dumps(part, ensure_ascii=False, separators=(",", ":")).encode()) for part in (body, input_items, context))
    return StoredResponse(body, input_items, context, instructions, size + len((instructions or "").encode()))


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        """The bounds: --responses-store-max and --responses-store-bytes (ServerSettings)."""
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response and one byte")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, rid: str) -> bool:
        return rid in self._records

    def ids(self) -> list[str]:
        """The stored ids, least recently used first."""
        return list(self._records)

    def put(self, rid: str, rec: StoredResponse) -> bool:
        """Keep `rec` as the most recent, evicting the least recently used until both bounds hold. False (and
        nothing changed) when the record alone is larger than the byte bound."""
        if rec.nbytes > self.max_bytes:
            return False
        self.delete(rid)
        self._records[rid] = rec
        self.nbytes += rec.nbytes
        while len(self._records) > self.max_responses or self.nbytes > self.max_bytes:
            _, old = self._records.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evicted += 1
        return True

    def get(self, rid: str) -> StoredResponse | None:
        """The record, now the most recently used; None if it is not (or no longer) stored."""
        rec = self._records.get(rid)
        if rec is not None:
            self._records.move_to_end(rid)
        return rec

    def delete(self, rid: str) -> bool:
        rec = self._records.pop(rid, None)
        if rec is None:
            return False
        self.nbytes -= rec.nbytes
        return True
