"""Engine: add_request / abort / step. One step is schedule, run, postprocess.

The engine is stateless per request beyond the request's own lifetime: no
sessions. It is driven by one thread (the AsyncEngine's loop, or the caller of
`LLM.generate`); nothing here is thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from shoal.config import EngineConfig, SchedulerConfig
from shoal.engine.block_pool import KVBlockPool
from shoal.engine.detokenizer import IncrementalDetokenizer
from shoal.engine.prefix_cache import PrefixCache
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence
from shoal.engine.stats import EngineStats, StatsMonitor
from shoal.engine.structured import BudgetMatcher, GrammarCompiler, GrammarError
from shoal.types import (
    CompletionOutput,
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    SampledToken,
    StepOutput,
    TokenLogprobs,
)

log = logging.getLogger("shoal.engine")

OUTPUT_FAILED = "the server failed while processing this request's output"


@dataclass
class _Choice:
    seq: Sequence
    detok: IncrementalDetokenizer | None  # None: the text is final already (beam search)
    out: CompletionOutput
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Hypothesis:
    score: float  # cumulative logprob / generated_len ** length_penalty
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason


@dataclass
class _BeamGroup:
    """Beam search over one request (HF's classic BeamSearchScorer rules)."""

    live: list[Sequence]
    scores: dict[int, float]  # seq_id -> cumulative logprob
    candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    hyps: list[_Hypothesis] = field(default_factory=list)
    done: bool = False

    def add(self, hyp: _Hypothesis, num_beams: int) -> None:
        self.hyps.append(hyp)
        self.hyps.sort(key=lambda h: -h.score)
        del self.hyps[num_beams:]


@dataclass
class _RequestState:
    request: GenerationRequest
    choices: list[_Choice]
    metrics: RequestMetrics
    beam: _BeamGroup | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled as the prefill goes
    error: str | None = None  # set when this request alone failed

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens of the request that came from the prefix cache (or a fork)."""
        seqs = [c.seq for c in self.choices] or (self.beam.live if self.beam else [])
        return seqs[0].num_cached_tokens if seqs else 0

    @property
    def complete_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        plp = self.prompt_logprobs
        return plp if plp is not None and len(plp) == len(self.request.prompt_token_ids) else None

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        if self.beam is not None and not self.beam.done:
            return False
        return all(c.out.finished for c in self.choices)


class Engine:
    def __init__(
        self, executor, tokenizer, eos_token_ids: tuple[int, ...], config: EngineConfig, max_model_len: int, clock=time.monotonic
    ) -> None:
        """executor: how the engine reaches the model (shoal/executor): `execute(plan)`, `runner`
        (this process's ModelRunner), `cluster()`, `close()`. A bare ModelRunner is taken as a local one."""
        from shoal.executor import LocalExecutor  # noqa: PLC0415 (the executor imports torch; the engine's bookkeeping does not)

        if not hasattr(executor, "runner"):
            executor = LocalExecutor(executor)
        self.config = config
        self.weight_format = "none"  # the projections' format as built (quant.WeightFormat): the builder sets it
        self.clock = clock  # every timing in RequestMetrics and the snapshot; tests pass a fake one
        self.executor = executor
        runner = self.runner = executor.runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = runner.config.vocab_size
        self.pool = KVBlockPool(runner.num_blocks, runner.block_size)
        cache = config.cache
        self.prefix_cache = PrefixCache(self.pool, ttl=cache.prefix_cache_ttl, block_bytes=runner.bytes_per_block) if cache.enable_prefix_cache else None
        sched = config.scheduler
        self.scheduler = Scheduler(
            SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, max_model_len), self.pool, self.prefix_cache
        )
        # Structured output: constraints compiled once and cached; the server compiles in a
        # worker thread (`validate`), so add_request finds them ready.
        self.grammars = GrammarCompiler(tokenizer, tuple(sorted(self.eos_token_ids)), self.vocab_size)
        self.stats = EngineStats()
        self.monitor = StatsMonitor(self)  # publishes `snapshot` after every step (engine/stats.py)
        self._requests: dict[str, _RequestState] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._in_flight: deque = deque()  # (SchedulerOutput, the executor's ticket, when submitted): steps not back yet

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        from shoal.engine.builder import build_engine

        return build_engine(config)

    # ------------------------------------------------------------ requests
    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError with a message for the user if the request cannot run."""
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context is {self.max_model_len} tokens "
                f"(the prompt plus at least one output token must fit)"
            )
        p = request.params
        bad_bias = [t for t in (p.logit_bias or {}) if not 0 <= int(t) < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if p.structured is not None:
            self.grammars.compile(p.structured)  # GrammarError (a ValueError) names the problem
        budget = p.thinking_budget
        if budget is not None and not all(0 <= t < self.vocab_size for t in budget.end_ids + budget.start_ids):
            raise ValueError(f"the thinking budget's tag token ids are outside the vocabulary [0, {self.vocab_size})")

    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.validate(request)
        p = request.params
        now = self.clock()
        grammar = self.grammars.compile(p.structured) if p.structured is not None else None
        if p.use_beam_search:
            self._add_beam_request(request, now, grammar)
            return
        choices = []
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
                grammar=self._constraint(p, grammar),
            )
            first = first or seq
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output,
                skip_special_tokens=p.skip_special_tokens,
            )
            out = CompletionOutput(index=i, logprobs=[] if p.logprobs is not None else None)
            choices.append(_Choice(seq, detok, out))
        state = _RequestState(request, choices, self._new_metrics(request, now))
        state.prompt_logprobs = [None] if p.prompt_logprobs is not None else None
        self._requests[request.request_id] = state
        for c in choices:
            self.scheduler.add(c.seq)
        self.stats.requests_added += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)

    def _add_beam_request(self, request: GenerationRequest, now: float, grammar) -> None:
        p = request.params
        seq = Sequence(request.request_id, list(request.prompt_token_ids), p, priority=request.priority, seed=p.seed)
        seq.grammar = self._constraint(p, grammar)
        state = _RequestState(request, [], self._new_metrics(request, now))
        state.beam = _BeamGroup(live=[seq], scores={seq.seq_id: 0.0})
        state.prompt_logprobs = [None] if p.prompt_logprobs is not None else None
        self._requests[request.request_id] = state
        self.scheduler.add(seq)
        self.stats.requests_added += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)

    @staticmethod
    def _new_metrics(request: GenerationRequest, now: float) -> RequestMetrics:
        arrival = request.arrival_time if request.arrival_time is not None else now
        return RequestMetrics(arrival_time=arrival, prompt_tokens=len(request.prompt_token_ids))

    def _constraint(self, p, grammar):
        """A new sequence's token constraint: its grammar's matcher, else its thinking budget, else none."""
        if grammar is not None:
            return grammar.matcher()
        if p.thinking_budget is not None:
            return BudgetMatcher(p.thinking_budget, self.vocab_size)
        return None

    def abort(self, request_id: str, client_disconnected: bool = False) -> bool:
        """Stop a request now; its output (finish_reason abort) comes with the next step().
        `client_disconnected`: its consumer went away (recorded in its RequestMetrics)."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        state.metrics.client_disconnected = client_disconnected
        self._end(state, FinishReason.ABORT)
        self.stats.requests_aborted += 1
        self._pending.append(self._output(state))
        self._retire(state)
        return True

    def recover(self) -> None:
        """After the executor lost a rank and every request was ended: bring the ranks back (--restart-workers)
        and forget the prefix cache, whose blocks' KV lived partly on the lost ranks."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("end the requests in flight before restarting the ranks")
        self.executor.restart()
        dropped = self.clear_prefix_cache()
        if dropped:
            log.info("forgot %d prefix-cache blocks: the restarted ranks start with an empty KV cache", dropped)

    def discard_pending_outputs(self) -> None:
        """After a failed step: forget the outputs waiting to be returned and the steps in flight."""
        self._pending.clear()
        for out, _, _ in self._in_flight:
            for seq, _ in out.scheduled:
                seq.in_flight = False
        self._in_flight.clear()

    def close(self) -> None:
        """Release what the executor holds beyond this process (the other ranks of a distributed model)."""
        self.executor.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def snapshot(self):
        """The numbers as of the last step (`engine/stats.py`): safe to read from any thread."""
        return self.monitor.snapshot

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Submit steps until the executor's depth is in flight, then take the oldest one's outcome. One
        process or tensor parallel: depth 1, a step at a time. Pipeline stages: one micro-batch per stage."""
        outputs, self._pending = self._pending, []
        self._fill_pipeline()
        if not self._in_flight:
            self.monitor.publish(outputs)
            return outputs
        sched, ticket, now = self._in_flight.popleft()
        result: StepOutput = self.executor.collect(ticket)
        for seq, _ in sched.scheduled:
            seq.in_flight = False
        if sched.empty:  # only block copies, promised to sequences that run later
            self.monitor.publish(outputs)
            return outputs
        self.scheduler.on_step_done(sched, result.sampled)
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        for seq_id, entries in result.prompt_logprobs.items():
            seq = self.scheduler.get(seq_id)
            if seq is not None:  # not aborted while in flight
                self._requests[seq.request_id].prompt_logprobs.extend(entries)
        outputs.extend(self._postprocess(result.sampled))
        if self.config.check_integrity:
            self.check_integrity()
        self.monitor.step_done(sched, now)
        self.monitor.publish(outputs)
        return outputs

    def _fill_pipeline(self) -> None:
        """Schedule and submit steps until `executor.depth` are in flight, or nothing more can run."""
        depth = self.executor.depth
        scheduler = self.scheduler
        while len(self._in_flight) < depth:
            # a micro-batch's share: the sequences spread over the stages (a sequence is in one at a time)
            share = None if depth == 1 else max(1, -(-(len(scheduler.running) + len(scheduler.waiting)) // depth))
            out = scheduler.schedule(share)
            if out.empty and not out.plan.block_copies:
                return
            now = self.clock()
            ticket = self.executor.submit(out.plan)
            for seq, _ in out.scheduled:
                seq.in_flight = True
                m = self._requests[seq.request_id].metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
            self._in_flight.append((out, ticket, now))
            if out.empty:
                return

    def _postprocess(self, sampled: list[SampledToken]) -> list[RequestOutput]:
        """Apply the step's tokens. A failure that belongs to one request (its sampling
        row, detokenizer, stop strings) ends that request alone, with an error."""
        touched: dict[str, _RequestState] = {}
        got_tokens: dict[str, _RequestState] = {}
        now = self.clock()
        for s in sampled:
            seq = self.scheduler.get(s.seq_id)
            if seq is None:
                continue  # its request failed earlier in this loop
            state = self._requests[seq.request_id]
            touched[seq.request_id] = state
            if s.error is not None:
                self._fail(state, s.error)
                continue
            try:
                if state.beam is not None:
                    # -inf: a token the grammar or a ban rules out, listed only because fewer were allowed
                    state.beam.candidates[seq.seq_id] = [(t.token_id, t.logprob) for t in s.top_logprobs if t.logprob > float("-inf")]
                    seq.paused = True
                else:
                    self._accept_token(state.choices[seq.index], s)
            except GrammarError as e:
                self._fail(state, f"structured output: {e}")
                continue
            except Exception:
                log.exception("request %s: applying its sampled token failed", seq.request_id)
                self._fail(state, OUTPUT_FAILED)
                continue
            got_tokens[seq.request_id] = state
        for state in got_tokens.values():
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            elif state.error is None:
                m.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
        outputs = []
        for state in touched.values():
            try:
                if state.beam is not None and state.error is None:
                    if len(state.beam.candidates) < len(state.beam.live):
                        continue  # some beams of the group have not sampled yet
                    self._beam_step(state)
                    if not state.beam.done:
                        continue  # beams are not streamed: only the final answer
                out = self._output(state)
            except GrammarError as e:
                self._fail(state, f"structured output: {e}")
                out = self._output(state)
            except Exception:
                log.exception("request %s: building its output failed", state.request.request_id)
                self._fail(state, OUTPUT_FAILED)
                out = self._output(state)
            outputs.append(out)
            if state.finished:
                self.stats.requests_finished += 1
                self._retire(state)
        return outputs

    def _fail(self, state: _RequestState, message: str) -> None:
        """End the request with an error the client may see; its sequences release their blocks."""
        if state.error is not None:
            return
        log.error("request %s failed: %s", state.request.request_id, message)
        state.error = message
        self._end(state, FinishReason.ERROR)

    def _end(self, state: _RequestState, reason: FinishReason) -> None:
        """Finish every unfinished choice and live beam of the request; their sequences release their blocks."""
        for c in state.choices:
            if not c.out.finished:
                self._finish(c, reason)
        if state.beam is not None and not state.beam.done:
            for seq in state.beam.live:
                self.scheduler.finish(seq, reason)
            state.beam.done = True

    def _accept_token(self, choice: _Choice, s: SampledToken) -> None:
        seq, out, p = choice.seq, choice.out, choice.seq.params
        tok = s.token_id
        out.token_ids.append(tok)
        choice.delta_token_ids.append(tok)
        out.cumulative_logprob += s.logprob
        if out.logprobs is not None:
            out.logprobs.append(TokenLogprobs(tok, s.logprob, list(s.top_logprobs[: p.logprobs])))
        self.stats.generated_tokens += 1
        n_out = seq.num_output_tokens
        reason = stop_reason = None
        # Nothing stops a choice before min_tokens (the sampler bans EOS and stop ids until then).
        may_stop = n_out > p.min_tokens
        if may_stop and not p.ignore_eos and tok in self.eos_token_ids:
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
            elif seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is None and seq.grammar is not None:
            seq.grammar.accept(tok)  # and computes the next step's mask
            if seq.grammar.done:  # complete: nothing but an end token could follow
                reason = FinishReason.STOP
        if reason is not None:
            out.stop_reason = stop_reason
            self._finish(choice, reason)

    def _beam_step(self, state: _RequestState) -> None:
        """Pick the next beams among the top 2*num_beams continuations of each beam."""
        g, p = state.beam, state.request.params
        K = p.num_beams
        cands = sorted(
            ((g.scores[b.seq_id] + lp, b, tok) for b in g.live for tok, lp in g.candidates[b.seq_id]),
            key=lambda c: -c[0],
        )
        gen_len = g.live[0].num_output_tokens + 1  # after this step
        nxt = []
        for rank, (score, beam, tok) in enumerate(cands):
            is_eos = tok in self.eos_token_ids and not p.ignore_eos and gen_len > p.min_tokens
            if is_eos or tok in p.stop_token_ids and gen_len > p.min_tokens:
                if rank < K:  # an ending only counts if it would have been a top beam
                    hyp_len = gen_len - 1 if is_eos else gen_len  # HF scores the hypothesis without its EOS
                    g.add(_Hypothesis(score / max(hyp_len, 1) ** p.length_penalty, beam.output_token_ids + [tok], score, FinishReason.STOP), K)
                continue
            nxt.append((score, beam, tok))
            if len(nxt) == K:
                break
        at_limit = (p.max_tokens is not None and gen_len >= p.max_tokens) or g.live[0].num_tokens + 1 >= self.max_model_len
        best = nxt[0][0] if nxt else float("-inf")
        enough = len(g.hyps) >= K and (p.early_stopping or g.hyps[-1].score >= best / gen_len**p.length_penalty)
        if at_limit or enough or not nxt:
            if not enough:
                for score, beam, tok in nxt:
                    g.add(_Hypothesis(score / gen_len**p.length_penalty, beam.output_token_ids + [tok], score, FinishReason.LENGTH), K)
            for b in g.live:
                self.scheduler.finish(b, FinishReason.STOP)
            g.done = True
            self._beam_outputs(state)
            return
        new_live: list[Sequence] = []
        try:
            for _, beam, tok in nxt:
                new_live.append(self.scheduler.fork_beam(beam, tok))
        except Exception:
            for b in new_live:  # the request fails: no half-made group may stay scheduled
                self.scheduler.finish(b, FinishReason.ERROR)
            raise
        g.scores = {b.seq_id: score for b, (score, _, _) in zip(new_live, nxt)}
        for b in g.live:
            self.scheduler.finish(b, FinishReason.STOP)
        g.live, g.candidates = new_live, {}
        self.stats.generated_tokens += len(new_live)

    def _beam_outputs(self, state: _RequestState) -> None:
        p = state.request.params
        for i, h in enumerate(state.beam.hyps[: p.n]):
            text = self.tokenizer.decode(h.token_ids, skip_special_tokens=p.skip_special_tokens)
            out = CompletionOutput(index=i, text=text, token_ids=h.token_ids, finish_reason=h.finish_reason, cumulative_logprob=h.cumulative_logprob)
            state.choices.append(_Choice(state.beam.live[0], None, out, delta_token_ids=list(h.token_ids)))

    def _finish(self, choice: _Choice, reason: FinishReason) -> None:
        choice.out.finish_reason = reason
        self.scheduler.finish(choice.seq, reason)

    def _output(self, state: _RequestState) -> RequestOutput:
        """A snapshot: the caller may keep it while the engine goes on."""
        outs = []
        for c in state.choices:
            o = c.out
            if state.error is not None:
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
        finished = state.finished
        metrics = state.metrics
        if finished:
            metrics = self._final_metrics(state, outs)
        return RequestOutput(
            request_id=state.request.request_id,
            prompt_token_ids=list(state.request.prompt_token_ids),
            outputs=outs,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
            prompt_logprobs=state.complete_prompt_logprobs,
            error=state.error,
        )

    def _final_metrics(self, state: _RequestState, outs: list[CompletionOutput]) -> RequestMetrics:
        """The finished request's record, completed: a copy the caller may keep (live until then)."""
        m = state.metrics
        if m.finished_time is None:
            m.finished_time = self.clock()
            seqs = [c.seq for c in state.choices] or (state.beam.live if state.beam else [])
            m.cached_prompt_tokens = state.num_cached_tokens
            m.cache_hit_kind = seqs[0].cache_hit_kind if seqs else None
            m.preemptions = max((s.num_preemptions for s in seqs), default=0)
            m.generated_tokens = sum(len(o.token_ids) for o in outs)
            reasons = [o.finish_reason for o in outs if o.finish_reason is not None]
            m.finish_reason = FinishReason.ERROR.value if state.error is not None else (reasons[0].value if reasons else None)
        return replace(m, inter_token_latencies=list(m.inter_token_latencies))

    def _retire(self, state: _RequestState) -> None:
        self._requests.pop(state.request.request_id, None)
        self.stats.cached_prompt_tokens += state.num_cached_tokens

    def clear_prefix_cache(self) -> int:
        """Forget all cached prefixes (e.g. after the weights changed); returns blocks dropped."""
        return self.prefix_cache.clear() if self.prefix_cache is not None else 0

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.scheduler.held_block_tables())
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
