"""Engine: add_request / abort / step. One step is schedule, run, postprocess.

The engine is stateless per request beyond the request's own lifetime: no
sessions. It is driven by one thread (the AsyncEngine's loop, or the caller of
`LLM.generate`); nothing here is thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from shoal import multimodal
from shoal.config import EngineConfig
from shoal.engine.beam import BeamSearch
from shoal.engine.block_pool import KVBlockPool
from shoal.engine.kv_manager import KVCacheManager
from shoal.engine.pooled import PooledRequest
from shoal.engine.prefix_cache import PrefixCache
from shoal.engine.request import RequestContext, RequestState, SampledChoices
from shoal.engine.scheduler import MAX_DECODE_RUN, Scheduler, chunk_cost
from shoal.engine.stats import EngineFacts, EngineStats, StatsMonitor
from shoal.engine.structured import GrammarCompiler, GrammarError
from shoal.types import FinishReason, GenerationRequest, RequestMetrics, RequestOutput, SampledToken, StepOutput

log = logging.getLogger("shoal.engine")

OUTPUT_FAILED = "the server failed while processing this request's output"
CLOSE_SPILL_BLOCKS = 256  # blocks copied out and queued at once when the engine closes with a second tier


class Engine:
    def __init__(
        self,
        executor,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        config: EngineConfig,
        max_model_len: int,
        clock=time.monotonic,
        facts: EngineFacts | None = None,
        tier=None,
        speculator=None,
        vision=None,
        pooling=None,
    ) -> None:
        """executor: how the engine reaches the model (shoal/executor): `submit(plan)` up to `depth` steps in flight, `collect(ticket)`, `failure`, `runner`
        (this process's ModelRunner), `cluster()`, `close()`. A bare ModelRunner is taken as a local one.
        facts: what is served (the builder knows the checkpoint); by default what the runner tells.
        tier: the prefix cache's second tier (engine/kv_tier.py), or None; it needs the KV in this process.
        speculator: speculative decoding (engine/speculative.py), or None.
        vision: a vision-language model's image preparation (model/vision.ImagePreparer), which the server uses
        to turn images into prompt tokens; None for a text-only model.
        pooling: how the model embeds (types.Pooling: its files', or --embeddings'), or None: it does not."""
        from shoal.executor import LocalExecutor  # noqa: PLC0415 (the executor imports torch; the engine's bookkeeping does not)

        if not hasattr(executor, "runner"):
            executor = LocalExecutor(executor)
        self.config = config
        self.clock = clock  # every timing in RequestMetrics and the snapshot; tests pass a fake one
        self.executor = executor
        runner = self.runner = executor.runner
        self.facts = facts or EngineFacts.of(config.model, runner)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = runner.config.vocab_size
        self.vision = vision
        self.pooling = pooling
        # a pool per KV group (types.KVGroup: the full-attention layers, the layers of each sliding window)
        groups = getattr(runner, "kv_groups", None) or ()
        pools = [KVBlockPool(n, runner.block_size) for n in getattr(runner, "group_blocks", None) or (runner.num_blocks,)]
        windows = tuple(g.window for g in groups) or None
        cache = config.cache
        self.causal = getattr(runner, "causal", True)  # an encoder's prefix has no KV of its own to reuse
        prefix_cache = PrefixCache(pools, windows=windows, ttl=cache.prefix_cache_ttl, block_bytes=runner.bytes_per_block) \
            if cache.enable_prefix_cache and self.causal else None
        self.kv = KVCacheManager(pools, prefix_cache, tier, windows)
        self.tier = self.kv.tier
        sched = config.scheduler
        self.scheduler = Scheduler(dataclasses.replace(sched, max_model_len=max_model_len), self.kv)
        # Structured output: constraints compiled once and cached; the server compiles in a
        # worker thread (`validate`), so add_request finds them ready.
        self.grammars = GrammarCompiler(tokenizer, tuple(sorted(self.eos_token_ids)), self.vocab_size)
        self.speculator = speculator
        self.stats = EngineStats()
        self.monitor = StatsMonitor(self)  # publishes `snapshot` after every step (engine/stats.py)
        self._ctx = RequestContext(self.scheduler, tokenizer, self.eos_token_ids, max_model_len, self.vocab_size, self.stats,
                                   self.causal)
        self._requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._in_flight: deque = deque()  # (SchedulerOutput, the executor's ticket, when submitted): steps not back yet
        # Decode runs (engine/scheduler.py): as many forwards a step as fit in decode_run_ms, from how long the last
        # step of decodes alone took a forward (real time, whatever the clock); 0: none (or an executor without them)
        self._run_budget = sched.decode_run_ms / 1000 if getattr(executor, "decode_runs", False) else 0.0
        self._run_steps = 1
        self._decode_time: float | None = None  # how long the step of decodes alone in flight took (_size_runs)
        self.timer = time.perf_counter  # what times a forward for them (tests pass a fake one)

    def interrupt_run(self) -> None:
        """Something waits for the engine thread (an arrival, an abort): a decode run under way ends after its current
        forward, so it waits one forward, not the run, and runs take one forward until resume_runs. Thread-safe: the
        AsyncEngine calls it as it puts a command in its inbox."""
        if self._run_budget:
            self.runner.interrupt_run(True)

    def resume_runs(self) -> None:
        """The engine thread takes in what waited (the AsyncEngine, before it reads its inbox): runs may go on again."""
        if self._run_budget:
            self.runner.interrupt_run(False)

    # ------------------------------------------------------------ requests
    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError with a message for the user if the request cannot run."""
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if request.pooling is not None:
            self._validate_pooling(request)
            return
        if not self.causal:
            raise ValueError("this model is an encoder: it serves embeddings only, not text")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context is {self.max_model_len} tokens "
                f"(the prompt plus at least one output token must fit)"
            )
        if self.vision is not None:  # every placeholder token belongs to an image, and every image has its own
            multimodal.check_spans(request.images, ids, self.vision.spec.image_token_id)
        elif request.images:
            raise ValueError("this model does not take images")
        p = request.params
        bad_bias = [t for t in (p.logit_bias or {}) if not 0 <= int(t) < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if p.structured is not None:
            self.grammars.compile(p.structured)  # GrammarError (a ValueError) names the problem
        budget = p.thinking_budget
        if budget is not None and not all(0 <= t < self.vocab_size for t in budget.end_ids + budget.start_ids):
            raise ValueError(f"the thinking budget's tag token ids are outside the vocabulary [0, {self.vocab_size})")

    def _validate_pooling(self, request: GenerationRequest) -> None:
        """A pooling request: a model that embeds, a prompt within the context, a length its vectors may be cut to."""
        if self.pooling is None:
            raise ValueError("this model does not serve embeddings: its files name no pooling (sentence-transformers' "
                             "modules.json, a GGUF's pooling_type), and it was not served with --embeddings")
        if request.pooling.mode != self.pooling.mode:  # a cross-encoder's "score" is not an embedding, nor the reverse
            raise ValueError(f"this model pools by {self.pooling.mode!r}, not {request.pooling.mode!r}")
        n = len(request.prompt_token_ids)
        if n > self.max_model_len:
            raise ValueError(f"the input has {n} tokens but the context is {self.max_model_len} tokens")
        if request.images:
            raise ValueError("embeddings take text only")
        budget = self.scheduler.config.max_num_batched_tokens
        if not self.causal and n > budget:
            raise ValueError(f"the input has {n} tokens, but an encoder computes an input whole, in one step of at "
                             f"most {budget} tokens (--max-num-batched-tokens)")
        self.pooling.check_dimensions(request.pooling.dimensions)

    def add_request(self, request: GenerationRequest, checked: bool = False) -> None:
        """Start `request`. checked: it has passed `validate` (AsyncEngine.check at the server's edge), so it
        is not scanned again; only what the running engine alone knows (its id) is checked here."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if not checked:
            self.validate(request)
        p = request.params
        now = self.clock()
        grammar = self.grammars.compile(p.structured) if p.structured is not None else None
        arrival = request.arrival_time if request.arrival_time is not None else now
        metrics = RequestMetrics(arrival_time=arrival, prompt_tokens=len(request.prompt_token_ids))
        kind = PooledRequest if request.pooling is not None else BeamSearch if p.use_beam_search else SampledChoices
        state = kind(request, metrics, self._ctx)
        state.start(grammar)
        self._requests[request.request_id] = state
        self.stats.requests_added += 1
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        self.stats.images += len(request.images)

    def abort(self, request_id: str, client_disconnected: bool = False) -> bool:
        """Stop a request now; its output (finish_reason abort) comes with the next step().
        `client_disconnected`: its consumer went away (recorded in its RequestMetrics)."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        state.metrics.client_disconnected = client_disconnected
        state.end(FinishReason.ABORT)
        self.stats.requests_aborted += 1
        self._pending.append(state.output(self.clock))
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
        self._decode_time = None
        for out, _, _ in self._in_flight:
            for seq, _ in out.scheduled:
                seq.in_flight = False
        self._in_flight.clear()

    def close(self) -> None:
        """Release what the executor holds beyond this process (the other ranks of a distributed model); with a
        second tier, keep what the prefix cache holds in it first, so that a restart finds it."""
        if self.tier is not None:
            tier, spills = self.tier, self.kv.spill_all()
            self.tier = self.kv.tier = None
            try:
                if spills:
                    log.info("prefix-cache tier: keeping %d cached blocks (%.0f MiB) for the next start",
                             len(spills), sum(tier.block_bytes[s.group] for s in spills) / 2**20)
                for i in range(0, len(spills), CLOSE_SPILL_BLOCKS):  # a piece at a time: the write queue is bounded
                    piece = spills[i : i + CLOSE_SPILL_BLOCKS]
                    tier.spill(piece, self._read_spills(piece))
                    tier.drain(60)
            finally:
                tier.close()
        self.executor.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def snapshot(self):
        """The numbers as of the last step (`engine/stats.py`): safe to read from any thread."""
        return self.monitor.snapshot

    @property
    def pool(self):
        return self.kv.pool

    @property
    def prefix_cache(self):
        return self.kv.cache

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
        if self.tier is not None:
            self.tier.poll()
        self._fill_pipeline()
        if not self._in_flight:
            if self.tier is not None and not outputs:
                self.tier.wait(0.05)  # nothing to run but what waits on the tier: until a read is in, not a spin
            self.monitor.publish(outputs)
            return outputs
        sched, ticket, now = self._in_flight.popleft()
        result: StepOutput = self.executor.collect(ticket)
        if self._decode_time is not None:
            self._size_runs(self._decode_time, result.sampled)
        for seq, _ in sched.scheduled:
            seq.in_flight = False
        if sched.empty:  # only block copies, promised to sequences that run later
            self.monitor.publish(outputs)
            return outputs
        if self.tier is not None:
            self._observe_prefill(sched, now)
        sampled, verified = self.scheduler.on_step_done(sched, result.sampled)
        for seq, drafted, accepted in verified:
            self.speculator.observe(seq, drafted, accepted)
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        for seq_id, entries in result.prompt_logprobs.items():
            seq = self.scheduler.get(seq_id)
            if seq is not None:  # not aborted while in flight
                self._requests[seq.request_id].prompt_logprobs.extend(entries)
        outputs.extend(self._postprocess(sampled, result.pooled or {}))
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
            if self.speculator is not None:
                self.speculator.propose(scheduler.running)
            out = scheduler.schedule(share, self._run_steps)
            if self.tier is not None:
                out.plan = self._move_tier_blocks(out.plan)
            if out.empty and not out.plan.block_copies and not out.plan.finished:
                return
            now = self.clock()
            started = self.timer()
            ticket = self.executor.submit(out.plan)
            if self._run_budget and out.plan.seqs and all(len(s.token_ids) == 1 for s in out.plan.seqs):  # decodes alone
                self._decode_time = self.timer() - started  # (an executor with decode runs has run the step by now)
            for seq, _ in out.scheduled:
                seq.in_flight = True
                m = self._requests[seq.request_id].metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
            self._in_flight.append((out, ticket, now))
            if out.empty:
                return

    def _size_runs(self, elapsed: float, sampled: list[SampledToken]) -> None:
        """The next decode runs' length from a step of decodes alone that took `elapsed`: as many forwards as fit in
        decode_run_ms at its time a forward (the most tokens one sequence got: a run cut short ran fewer than planned)."""
        self._decode_time = None
        counts: dict[int, int] = {}
        for t in sampled:
            counts[t.seq_id] = counts.get(t.seq_id, 0) + 1
        forward = elapsed / max(counts.values(), default=1)
        self._run_steps = max(1, min(MAX_DECODE_RUN, int(self._run_budget / forward) if forward > 0 else MAX_DECODE_RUN))

    def _move_tier_blocks(self, plan):
        """Before the plan's forward, in this order: copy out the blocks the schedule evicted (anything may
        overwrite them now); run the plan's copy-on-write copies (a source may be a block this schedule
        evicted and handed to a restore); write in the blocks restored from the tier. Returns the plan, its
        copies taken out when they ran here."""
        spills = self.kv.take_spills()
        if spills:
            self.tier.spill(spills, self._read_spills(spills))
        restores = self.kv.take_restores()
        if restores:
            if plan.block_copies:
                self.runner.copy_blocks(plan.block_copies)
                plan = dataclasses.replace(plan, block_copies=())
            for g in sorted({g for g, _, _ in restores}):
                self.runner.write_blocks([b for gg, b, _ in restores if gg == g], [p for gg, _, p in restores if gg == g], g)
        return plan

    def _read_spills(self, spills) -> list:
        """The spilled blocks' bytes, read group by group, in the spills' order."""
        payloads = [None] * len(spills)
        for g in sorted({s.group for s in spills}):
            rows = [i for i, s in enumerate(spills) if s.group == g]
            for i, p in zip(rows, self.runner.read_blocks([spills[i].block_id for i in rows], g)):
                payloads[i] = p
        return payloads

    def _observe_prefill(self, sched, started: float) -> None:
        """A step with a prefill's worth of tokens tells the tier's policy how fast this host computes them."""
        if sched.plan.num_tokens < self.runner.block_size * 4:
            return
        cost = sum(chunk_cost(n, seq.num_computed_tokens) for seq, n in sched.scheduled)
        self.tier.policy.observe_prefill(cost, self.clock() - started)

    def _postprocess(self, sampled: list[SampledToken], pooled: dict[int, list[float]]) -> list[RequestOutput]:
        """Apply the step's tokens, and its pooling requests' parts (engine/pooled.py). A failure that belongs to
        one request (its sampling row, detokenizer, stop strings) ends that request alone, with an error."""
        touched: dict[str, RequestState] = {}
        got_tokens: dict[str, RequestState] = {}
        counts: dict[int, int] = {}  # seq_id -> tokens this step
        several: dict[str, int] = {}  # request -> the most tokens one of its sequences got, where more than one
        now = self.clock()
        for seq_id, part in pooled.items():
            seq = self.scheduler.get(seq_id)
            if seq is None:
                continue  # aborted while in flight
            state = self._requests[seq.request_id]
            touched[seq.request_id] = state
            try:
                state.on_pooled(seq, part)
            except Exception as e:
                _fail_by(state, e, "pooling its hidden states")
        for s in sampled:
            seq = self.scheduler.get(s.seq_id)
            if seq is None:
                continue  # its request failed earlier in this loop
            state = self._requests[seq.request_id]
            touched[seq.request_id] = state
            if s.error is not None:
                state.fail(s.error)
                continue
            try:
                state.on_sampled(seq, s)
            except Exception as e:
                _fail_by(state, e, "applying its sampled token")
                continue
            got_tokens[seq.request_id] = state
            k = counts[s.seq_id] = counts.get(s.seq_id, 0) + 1
            if k > 1:
                several[seq.request_id] = max(k, several.get(seq.request_id, 0))
        for rid, state in got_tokens.items():
            # a step that gave several tokens (a decode run, a verified draft) splits its gap evenly over them: one
            # latency per token after the first, summing to the decode's time
            m = state.metrics
            k = several.get(rid, 1) if several else 1
            if m.first_token_time is None:
                m.first_token_time = now
                m.inter_token_latencies.extend([0.0] * (k - 1))
            elif state.error is None:
                gap = now - m.last_token_time
                if k == 1:
                    m.inter_token_latencies.append(gap)
                else:
                    m.inter_token_latencies.extend([gap / k] * k)
            m.last_token_time = now
        outputs = []
        for state in touched.values():
            try:
                if state.error is None and not state.settle():
                    continue  # no output due yet (a beam group waiting for its other beams)
                out = state.output(self.clock)
            except Exception as e:
                _fail_by(state, e, "building its output")
                out = state.output(self.clock)
            outputs.append(out)
            if state.finished:
                self.stats.requests_finished += 1
                self._retire(state)
        return outputs

    def _retire(self, state: RequestState) -> None:
        self._requests.pop(state.request.request_id, None)
        if self.speculator is not None:
            self.speculator.release(state.seqs)
        self.stats.cached_prompt_tokens += state.num_cached_tokens

    def clear_prefix_cache(self) -> int:
        """Forget all cached prefixes (e.g. after the weights changed); returns blocks dropped."""
        return self.kv.clear_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity(*(self.scheduler.held_block_tables(g) for g in self.kv.groups))


def _fail_by(state: RequestState, e: Exception, doing: str) -> None:
    """Fail the request alone, inside the except clause that caught `e`: a GrammarError's message is
    the client's; anything else is logged with its traceback and reported as OUTPUT_FAILED."""
    if isinstance(e, GrammarError):
        state.fail(f"structured output: {e}")
    else:
        log.exception("request %s: %s failed", state.request.request_id, doing)
        state.fail(OUTPUT_FAILED)
