"""PooledRequest: a prompt-only request that asks for its pooled hidden state (an embedding). No torch.

The third kind of request behind `RequestState` (beside `SampledChoices` and `BeamSearch`). It is one sequence
that computes its prompt like any prefill (the scheduler's token budget, chunked prefill, beside decodes) and
samples nothing: each chunk's step gives its part of the vector (`ScheduledSeq.pool`, reduced by the runner in
`runner/pooling.py`), and the step that computes the last prompt token ends it:

    last   the final chunk's last row (the final norm's output at the last prompt token)
    mean   every chunk's row sum, added up here in float64, divided by the prompt's length at the end
    cls    an encoder's first row (its input computed whole, in one step: Sequence.whole)
    score  a cross-encoder's classifier scores on its (query, document) pair, computed whole as cls is (reranking)

then, in this order, the first `dimensions` values (Matryoshka) and the L2 normalization. A chunked prompt thereby
gets the vector of the unchunked one (up to float32's rounding of each chunk's sum), and a batch gives each prompt
what it gets alone (the forward's rows do not depend on each other where the attention is batch-invariant).

The sequence keeps no KV: its blocks go back to the pool when it ends, and none is indexed in the prefix cache
(documents to embed are seldom asked again, and would push chats' prefixes out). Last-token pooling still starts
from a cached prefix where one matches (a causal decoder's KV of a prefix is the same whoever computed it); mean
pooling needs every row's hidden state, so it takes no hit (Sequence.needs_every_row).
"""

from __future__ import annotations

import math

from shoal.engine.request import RequestState
from shoal.engine.sequence import Sequence
from shoal.types import FinishReason, RequestOutput, SampledToken


class PooledRequest(RequestState):
    def start(self, grammar) -> None:
        request = self.request
        self.seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=request.params,
            priority=request.priority,
            pooling=request.pooling.mode,
            whole=not self.ctx.causal,
        )
        self._sum: list[float] | None = None  # float64 running sum of the chunks' parts
        self._preemptions = 0  # the sequence's preemptions when the sum was last added to
        self.embedding: list[float] | None = None
        self.reason: FinishReason | None = None
        self.ctx.scheduler.add(self.seq)

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]

    @property
    def done(self) -> bool:
        return self.reason is not None

    def settle(self) -> bool:
        return self.done  # nothing to stream: one output, at the end

    def end(self, reason: FinishReason) -> None:
        if self.reason is None:
            self.reason = reason
            self.ctx.scheduler.finish(self.seq, reason)

    def on_sampled(self, seq: Sequence, s: SampledToken) -> None:
        raise AssertionError("a pooling request samples nothing")

    def on_pooled(self, seq: Sequence, part: list[float]) -> None:
        """One chunk's part (the scheduler has counted its tokens computed); the last chunk's ends the request.
        A preempted sequence computes its prompt again from the start: the parts before it are dropped."""
        if seq.num_preemptions != self._preemptions:
            self._sum, self._preemptions = None, seq.num_preemptions
        if self._sum is None:
            self._sum = [float(x) for x in part]
        else:
            total = self._sum
            for i, x in enumerate(part):
                total[i] += x
        if seq.num_computed_tokens < seq.prompt_len:
            return
        p = self.request.pooling
        vec = self._sum
        if p.mode == "mean":
            n = seq.prompt_len
            vec = [x / n for x in vec]
        self.embedding = finish_vector(vec, p.dimensions, p.normalize)
        self.end(FinishReason.STOP)

    def output(self, clock) -> RequestOutput:
        finished = self.finished
        metrics = self.metrics
        if finished:
            metrics = self._final_metrics([], clock)
            if metrics.finish_reason is None and self.reason is not None:  # no choice carries it: the request does
                metrics.finish_reason = self.metrics.finish_reason = self.reason.value
        return RequestOutput(
            request_id=self.request.request_id,
            prompt_token_ids=list(self.request.prompt_token_ids),
            outputs=[],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=metrics,
            error=self.error,
            embedding=self.embedding if self.error is None else None,
        )


def finish_vector(vec: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The pooled vector as served: its first `dimensions` values (all: None), then L2-normalized when `normalize`
    or when it was cut (OpenAI's `dimensions`: a cut vector is renormalized). A zero vector stays zero."""
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize or dimensions is not None:
        norm = math.sqrt(math.fsum(x * x for x in vec))
        if norm > 0:
            vec = [x / norm for x in vec]
    return vec
