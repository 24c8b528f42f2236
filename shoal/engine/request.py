"""A request inside the engine: its sequences, how its sampled tokens become output. No torch.

The engine's step loop handles every request through one interface, `RequestState`:

    start(constraint)   make the request's sequences and add them to the scheduler
    on_sampled(seq, s)  take one sequence's sampled token (SampledToken) from the step
    settle()            after all of a step's tokens: is an output due now?
    end(reason)         finish every sequence still running (abort, failure)
    output(clock)       a RequestOutput snapshot the caller may keep

Two kinds implement it. `SampledChoices` (here) runs n independent choices: each
sampled token is appended, detokenized incrementally and checked against the stop
conditions. `BeamSearch` (`beam.py`) keeps a group of beams and picks the next ones
once all of them have sampled. The engine knows neither beyond this interface.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence
from shoal.engine.stats import EngineStats
from shoal.engine.structured import BudgetMatcher
from shoal.types import CompletionOutput, FinishReason, GenerationRequest, RequestMetrics, RequestOutput, SampledToken, TokenLogprobs

log = logging.getLogger("shoal.engine")


@dataclass(frozen=True)
class RequestContext:
    """What a request may use of its engine."""

    scheduler: Scheduler
    tokenizer: object
    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int
    stats: EngineStats
    causal: bool = True  # False: an encoder (BERT), whose inputs are computed whole and only embedded

    def constraint(self, params, grammar):
        """A new sequence's token constraint: its grammar's matcher, else its thinking budget, else none."""
        if grammar is not None:
            return grammar.matcher()
        if params.thinking_budget is not None:
            return BudgetMatcher(params.thinking_budget, self.vocab_size)
        return None


@dataclass
class Choice:
    seq: Sequence
    detok: IncrementalDetokenizer | None  # None: the text is final already (beam search)
    out: CompletionOutput
    delta_token_ids: list[int] = field(default_factory=list)


class RequestState:
    """What every kind of request shares: the request, its metrics, prompt logprobs, its error and its choices."""

    def __init__(self, request: GenerationRequest, metrics: RequestMetrics, ctx: RequestContext) -> None:
        self.request = request
        self.metrics = metrics
        self.ctx = ctx
        self.choices: list[Choice] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if request.params.prompt_logprobs is not None else None
        self.error: str | None = None  # set when this request alone failed

    # ------------------------------------------------------------ what a kind implements
    def start(self, grammar) -> None:
        raise NotImplementedError

    @property
    def seqs(self) -> list[Sequence]:
        """The request's sequences now (their first gives the cache and preemption facts)."""
        raise NotImplementedError

    def on_sampled(self, seq: Sequence, s: SampledToken) -> None:
        raise NotImplementedError

    def settle(self) -> bool:
        return True

    def end(self, reason: FinishReason) -> None:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    # ------------------------------------------------------------ shared
    def fail(self, message: str) -> None:
        """End the request with an error the client may see; its sequences release their blocks."""
        if self.error is not None:
            return
        log.error("request %s failed: %s", self.request.request_id, message)
        self.error = message
        self.end(FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        return self.error is not None or self.done

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens of the request that came from the prefix cache (or a fork)."""
        seqs = self.seqs
        return seqs[0].num_cached_tokens if seqs else 0

    @property
    def complete_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        plp = self.prompt_logprobs
        return plp if plp is not None and len(plp) == len(self.request.prompt_token_ids) else None

    def _finish(self, choice: Choice, reason: FinishReason) -> None:
        choice.out.finish_reason = reason
        self.ctx.scheduler.finish(choice.seq, reason)

    def output(self, clock) -> RequestOutput:
        """A snapshot: the caller may keep it while the engine goes on. `clock` times the finish."""
        outs = []
        for c in self.choices:
            o = c.out
            if self.error is not None:
                delta = ""  # the detokenizer may be what failed
            elif c.detok is not None:
                delta = c.detok.take_delta(finished=o.finished)
                o.text += delta
            else:
                delta = o.text
            outs.append(
                CompletionOutput(
                    index=o.index,
                    text=o.text,
                    token_ids=list(o.token_ids),
                    logprobs=list(o.logprobs) if o.logprobs is not None else None,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    delta_text=delta,
                    delta_token_ids=c.delta_token_ids,
                    cumulative_logprob=o.cumulative_logprob,
                )
            )
            c.delta_token_ids = []
        finished = self.finished
        return RequestOutput(
            request_id=self.request.request_id,
            prompt_token_ids=self.request.prompt_token_ids,  # a tuple: O(1) a step, however long the prompt
            outputs=outs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self._final_metrics(outs, clock) if finished else self.metrics,
            prompt_logprobs=self.complete_prompt_logprobs,
            error=self.error,
        )

    def _final_metrics(self, outs: list[CompletionOutput], clock) -> RequestMetrics:
        """The finished request's record, completed: a copy the caller may keep (live until then)."""
        m = self.metrics
        if m.finished_time is None:
            m.finished_time = clock()
            seqs = self.seqs
            m.cached_prompt_tokens = self.num_cached_tokens
            m.cache_hit_kind = seqs[0].cache_hit_kind if seqs else None
            m.preemptions = max((s.num_preemptions for s in seqs), default=0)
            m.generated_tokens = sum(len(o.token_ids) for o in outs)
            reasons = [o.finish_reason for o in outs if o.finish_reason is not None]
            m.finish_reason = FinishReason.ERROR.value if self.error is not None else (reasons[0].value if reasons else None)
        return replace(m, inter_token_latencies=list(m.inter_token_latencies))


class SampledChoices(RequestState):
    """n independent choices. Siblings wait for the first to compute the prompt, then share its KV."""

    def start(self, grammar) -> None:
        request, p, ctx = self.request, self.request.params, self.ctx
        first: Sequence | None = None
        for i in range(p.n):
            seq = Sequence(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                params=p,
                index=i,
                priority=request.priority,
                arrival=first.arrival if first else -1,
                fork_parent=first,
                seed=None if p.seed is None else p.seed + i,
                # Forks share the prompt: only the first choice computes its logprobs.
                num_prompt_logprobs=0 if first is None else len(request.prompt_token_ids),
                grammar=ctx.constraint(p, grammar),
                images=request.images,
            )
            first = first or seq
            detok = IncrementalDetokenizer(
                ctx.tokenizer,
                request.prompt_token_ids,
                stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output,
                skip_special_tokens=p.skip_special_tokens,
            )
            out = CompletionOutput(index=i, logprobs=[] if p.logprobs is not None else None)
            self.choices.append(Choice(seq, detok, out))
        for c in self.choices:
            ctx.scheduler.add(c.seq)

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.choices]

    @property
    def done(self) -> bool:
        return all(c.out.finished for c in self.choices)

    def end(self, reason: FinishReason) -> None:
        for c in self.choices:
            if not c.out.finished:
                self._finish(c, reason)

    def on_sampled(self, seq: Sequence, s: SampledToken) -> None:
        """Append the token (the scheduler put it in the sequence), its logprobs and text; stop if it ends the choice."""
        choice, ctx = self.choices[seq.index], self.ctx
        out, p = choice.out, seq.params
        tok = s.token_id
        out.token_ids.append(tok)
        choice.delta_token_ids.append(tok)
        out.cumulative_logprob += s.logprob
        if out.logprobs is not None:
            out.logprobs.append(TokenLogprobs(tok, s.logprob, list(s.top_logprobs[: p.logprobs])))
        ctx.stats.generated_tokens += 1
        n_out = len(out.token_ids)  # not the sequence's: a verified draft puts several tokens there at once
        reason = stop_reason = None
        # Nothing stops a choice before min_tokens (the sampler bans EOS and stop ids until then).
        may_stop = n_out > p.min_tokens
        if may_stop and not p.ignore_eos and tok in ctx.eos_token_ids:
            reason = FinishReason.STOP
        elif may_stop and tok in p.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, tok
        else:
            match = choice.detok.add_token(tok, check_stop=may_stop)
            if match is not None:
                reason, stop_reason = FinishReason.STOP, match.stop
        if reason is None:
            if p.max_tokens is not None and n_out >= p.max_tokens:
                reason = FinishReason.LENGTH
            elif seq.prompt_len + n_out >= ctx.max_model_len:
                reason = FinishReason.LENGTH
        if reason is None and seq.grammar is not None:
            seq.grammar.accept(tok)  # and computes the next step's mask
            if seq.grammar.done:  # complete: nothing but an end token could follow
                reason = FinishReason.STOP
        if reason is not None:
            out.stop_reason = stop_reason
            self._finish(choice, reason)
