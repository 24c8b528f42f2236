"""The engine end to end on a tiny model: batching, chunking, preemption, n, seeds, stops, aborts.

The pool's integrity check runs after every step (check_integrity=True).
"""

import asyncio
import time

import pytest

from shoal import LLM, SamplingParams
from shoal.engine.async_engine import AsyncEngine
from shoal.types import FinishReason, GenerationRequest
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def prompts(n):
    # Mixed lengths, 2..41 tokens, all distinct.
    return [[(7 * i + 3 * j) % 390 + 5 for j in range(2 + (i * 13) % 40)] for i in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def alone(llm, ps, params=GREEDY):
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in ps]


def test_batch_with_chunked_prefill_gives_the_same_greedy_tokens_as_alone(model_path):
    llm = LLM(model_path, dtype="float32", max_num_batched_tokens=24, num_blocks=256, block_size=4, check_integrity=True)
    ps = prompts(16)
    batched = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    assert batched == alone(llm, ps)
    assert llm.engine.pool.num_free == 256


def test_the_scheduler_gets_every_scheduling_setting_and_the_models_context(model_path):
    """The engine once rebuilt the scheduler's settings from three of them, and --max-prefill-beside-decodes never
    reached the scheduler (a benchmark of it measured the default twice)."""
    llm = LLM(model_path, dtype="float32", num_blocks=64, max_num_seqs=5, max_num_batched_tokens=24,
              max_prefill_beside_decodes=7, follow_up_window=0.5, max_model_len=100, decode_run_ms=3.0)
    got = llm.engine.scheduler.config
    assert (got.max_num_seqs, got.max_num_batched_tokens, got.max_prefill_beside_decodes, got.follow_up_window,
            got.max_model_len, got.decode_run_ms, llm.engine._run_budget) == (5, 24, 7, 0.5, 100, 3.0, 0.003)


def test_preemption_under_a_tiny_pool_gives_uncontended_outputs_and_frees_everything(model_path):
    big = LLM(model_path, dtype="float32", num_blocks=512, block_size=4)
    small = LLM(model_path, dtype="float32", num_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=64, check_integrity=True)
    ps = prompts(32)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in big.generate(ps, params)]
    got = [o.outputs[0].token_ids for o in small.generate(ps, params)]
    assert got == want
    assert small.engine.stats.preemptions > 0  # the pool really was too small
    assert small.engine.pool.num_free == 24


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=16)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    p = prompts(3)[2]
    solo = llm.generate([p], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(prompts(6) + [p], [noise] * 6 + [seeded])[-1].outputs[0].token_ids
    assert mixed == solo
    other = llm.generate([p], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True))
    assert other[0].outputs[0].token_ids != solo


def test_n_choices_share_the_prompt_blocks_and_differ(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128, check_integrity=True)
    p = prompts(4)[3]  # 41 tokens: the shared prefix ends mid-block
    out = llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # With greedy, every choice equals the single greedy answer: the fork's copied
    # partial block and shared full blocks hold the right KV.
    g = llm.generate([p], SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in g.outputs] == [alone(llm, [p], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]] * 3
    assert llm.engine.pool.num_free == 64


def test_n_choices_seeded_are_reproducible(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    a = [o.token_ids for o in llm.generate([prompts(1)[0]], params)[0].outputs]
    b = [o.token_ids for o in llm.generate([prompts(1)[0]], params)[0].outputs]
    assert a == b and a[0] != a[1]


def test_priority_runs_lower_numbers_first(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    order = []
    eng = llm.engine
    from shoal.types import GenerationRequest

    for rid, prio in [("late", 5), ("urgent", -1), ("normal", 0)]:
        eng.add_request(GenerationRequest(rid, (5, 6, 7), params, priority=prio))
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["urgent", "normal", "late"]


def test_stop_token_ids_max_tokens_and_eos_finish_reasons(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    p = prompts(2)[1]
    free = alone(llm, [p], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert (out.finish_reason, len(out.token_ids)) == (FinishReason.LENGTH, 8)
    stop_tok = free[3]
    first = free.index(stop_tok)
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == (FinishReason.STOP, stop_tok, free[: first + 1])
    # min_tokens holds the stop token back until reached.
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok], min_tokens=first + 2))[0].outputs[0]
    assert stop_tok not in out.token_ids[: first + 2]


def test_eos_ends_generation_unless_ignored(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    p = prompts(3)[0]
    # Force EOS (id 0 in the tiny model) with logit_bias, then check both modes.
    forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={0: 100.0})
    out = llm.generate([p], forced)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.text) == ([0], FinishReason.STOP, "")
    ignored = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={0: 100.0}, ignore_eos=True)
    out = llm.generate([p], ignored)[0].outputs[0]
    assert out.finish_reason is FinishReason.LENGTH and 0 not in out.token_ids
    # generation_config's eos list ([0, 2]) counts too: <|im_end|> (2) stops.
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=5, logit_bias={2: 100.0}))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([2], FinishReason.STOP)


def test_stop_string_is_trimmed_from_text(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    p = prompts(2)[0]
    full = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_logprobs_are_reported_and_consistent(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    out = llm.generate([prompts(1)[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok and lp.top[0].logprob == pytest.approx(lp.logprob)  # greedy = top-1
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_bad_requests_are_rejected_before_they_reach_the_loop(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=64)
    eng = llm.engine
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 400\)"):
        eng.add_request(GenerationRequest("a", (5, 4000), GREEDY))
    with pytest.raises(ValueError, match="prompt has 64 tokens but the context is 64"):
        eng.add_request(GenerationRequest("b", tuple([5] * 64), GREEDY))
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request(GenerationRequest("c", (), GREEDY))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    assert not eng.has_unfinished()


def test_context_limit_finishes_with_length(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=20)
    out = llm.generate([[5] * 15], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert (out.finish_reason, len(out.token_ids)) == (FinishReason.LENGTH, 5)


def test_kv_budget_too_small_for_one_sequence_refuses_to_start(model_path):
    with pytest.raises(ValueError, match=r"^--max-model-len 512 needs .* for one sequence, and the pool holds .* \(128 tokens; "
                       r"8 blocks, as configured\): lower --max-model-len to at most 128"):
        LLM(model_path, dtype="float32", num_blocks=8, block_size=16, max_model_len=512)


def test_a_client_whose_event_loop_closes_mid_stream_is_aborted_and_the_engine_serves_on(model_path):
    """A client that runs its own loop (asyncio.run) and leaves without closing its stream: the engine's next output
    for it finds that loop closed. The request is aborted as a disconnect and its blocks come back; the engine's
    thread lives on and serves the next client. (Before, the closed loop's RuntimeError ended the engine's thread.)"""
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    engine = AsyncEngine(llm.engine)
    try:
        loop = asyncio.new_event_loop()
        stream = engine.generate(GenerationRequest("gone", (5, 6, 7), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)))
        first = loop.run_until_complete(stream.__anext__())
        assert first.request_id == "gone" and not first.finished
        loop.close()  # the stream is never closed, so no abort is sent
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (llm.engine.has_unfinished() or llm.engine.pool.num_free != 64):
            time.sleep(0.02)
        assert llm.engine.pool.num_free == 64 and not llm.engine.has_unfinished()
        assert llm.engine.stats.requests_aborted == 1

        async def one():
            async for out in engine.generate(GenerationRequest("next", (8, 9), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))):
                last = out
            return last

        last = asyncio.run(one())
        assert last.finished and len(last.outputs[0].token_ids) == 5
    finally:
        engine.shutdown()


def test_async_engine_streams_and_abort_frees_blocks(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    engine = AsyncEngine(llm.engine)

    async def main():
        long = GenerationRequest("long", (5, 6, 7), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        short = GenerationRequest("short", (8, 9), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        deltas = []

        async def consume_short():
            async for out in engine.generate(short):
                deltas.append(out.outputs[0].delta_token_ids)
            return out

        async def consume_two_then_leave():
            n = 0
            async for _ in engine.generate(long):
                n += 1
                if n == 2:
                    break  # the client goes away: the iterator's cleanup aborts
            return n

        last, n = await asyncio.gather(consume_short(), consume_two_then_leave())
        return last, deltas, n

    try:
        last, deltas, n = asyncio.run(main())
        assert n == 2
        assert last.finished and len(last.outputs[0].token_ids) == 5
        assert sum(deltas, []) == last.outputs[0].token_ids
        deadline = time.monotonic() + 30  # the abort lands at the loop's next step (later on a busy machine)
        while time.monotonic() < deadline:
            if llm.engine.pool.num_free == 64 and not llm.engine.has_unfinished():
                break
            time.sleep(0.02)
        assert llm.engine.pool.num_free == 64
        assert llm.engine.stats.requests_aborted == 1
    finally:
        engine.shutdown()


def test_beam_search_matches_transformers(model_path):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    llm = LLM(model_path, dtype="float32", num_blocks=128, block_size=4, max_model_len=128, max_num_batched_tokens=16, check_integrity=True)
    for p in prompts(3):
        params = SamplingParams(num_beams=3, n=2, max_tokens=8, ignore_eos=True, temperature=0.0)
        out = llm.generate([p], params)[0]
        ref = hf.generate(
            torch.tensor([p]), num_beams=3, num_return_sequences=2, max_new_tokens=8, do_sample=False,
            eos_token_id=None, pad_token_id=0, early_stopping=False, length_penalty=1.0,
        )[:, len(p):].tolist()
        assert [o.token_ids for o in out.outputs] == ref
        assert all(o.finish_reason is FinishReason.LENGTH for o in out.outputs)
    assert llm.engine.pool.num_free == 128


def test_beam_search_ends_hypotheses_at_a_stop_token(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    p = prompts(1)[0]
    first = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0].outputs[0].token_ids[0]
    # The best first token ends a hypothesis at once; with length_penalty 0 (raw sums
    # of negative logprobs) no longer hypothesis can beat it.
    params = SamplingParams(num_beams=2, max_tokens=6, stop_token_ids=[first], length_penalty=0.0, ignore_eos=True)
    out = llm.generate([p], params)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([first], FinishReason.STOP)
    assert llm.engine.pool.num_free == 64


def test_aborting_a_beam_search_request_frees_its_beams(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128, check_integrity=True)
    eng = llm.engine
    eng.add_request(GenerationRequest("beam", (5, 6, 7, 8, 9), SamplingParams(num_beams=3, max_tokens=20, ignore_eos=True)))
    for _ in range(3):
        eng.step()
    assert eng.abort("beam")
    (out,) = eng.step()
    assert out.finished and out.request_id == "beam"
    assert not eng.has_unfinished() and eng.pool.num_free == 64


def test_beam_search_applies_logits_processors_like_transformers(model_path):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    llm = LLM(model_path, dtype="float32", num_blocks=128, block_size=4, max_model_len=128)
    p = prompts(2)[1]
    params = SamplingParams(num_beams=3, n=2, max_tokens=8, ignore_eos=True, no_repeat_ngram_size=1, repetition_penalty=1.5)
    out = llm.generate([p], params)[0]
    ref = hf.generate(
        torch.tensor([p]), num_beams=3, num_return_sequences=2, max_new_tokens=8, do_sample=False, eos_token_id=None,
        pad_token_id=0, early_stopping=False, no_repeat_ngram_size=1, repetition_penalty=1.5,
    )[:, len(p):].tolist()
    assert [o.token_ids for o in out.outputs] == ref
    assert all(len(set(o.token_ids) | set(p)) == len(p) + 8 for o in out.outputs)  # really no repeats
    # A bias that makes EOS the best continuation ends the best hypothesis at once.
    eos = llm.generate([p], SamplingParams(num_beams=2, max_tokens=6, logit_bias={0: 50.0}))[0].outputs[0]
    assert (eos.token_ids, eos.finish_reason) == ([0], FinishReason.STOP)


def _record_adds_and_steps(engine) -> list[str]:
    """Wrap the engine's add_request and step (called on the AsyncEngine's thread) to log their order."""
    events: list[str] = []
    add, step = engine.add_request, engine.step

    def logged_add(request, checked=False):
        events.append(f"add {request.request_id}")
        return add(request, checked=checked)

    def logged_step():
        outputs = step()
        if outputs:
            events.append("step")
        return outputs

    engine.add_request, engine.step = logged_add, logged_step
    return events


def test_clients_that_finish_together_come_back_into_one_step(model_path):
    """Three requests finish in one step and leave the engine idle: the next arrivals, 150 ms apart (a 2 s
    window here), are all admitted before the next step. After a step that finished one request, a follow-up
    is stepped at once."""
    llm = LLM(model_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128, follow_up_window=2.0)
    events = _record_adds_and_steps(llm.engine)
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def run(ids, gap):
        async def one(i, rid):
            await asyncio.sleep(i * gap)
            async for out in engine.generate(GenerationRequest(rid, (5, 6, 7 + i), params)):
                pass
            return out

        return await asyncio.gather(*(one(i, rid) for i, rid in enumerate(ids)))

    try:
        asyncio.run(run(["a0", "a1", "a2"], 0.0))  # together: they finish in the same step
        start = len(events)
        outs = asyncio.run(run(["b0", "b1", "b2"], 0.15))
        assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)
        assert events[start:start + 4] == ["add b0", "add b1", "add b2", "step"]

        asyncio.run(run(["c0"], 0.0))  # the b's finished together too: c0 is their lone follow-up, held ~2 s
        start = len(events)
        asyncio.run(run(["d0", "d1"], 0.3))  # c0 finished alone: d0 is stepped without waiting for d1
        assert events[start:start + 2] == ["add d0", "step"]
        assert "add d1" in events[start + 2:]
    finally:
        engine.shutdown()


def test_same_prompt_computed_twice_in_one_step_leaves_the_cache_evictable(model_path):
    """Two requests with the same head admitted in one step both compute it; the second holds
    the first's cached blocks from then on, so when the first finishes, a newcomer that needs
    every free block can evict what it left (before: no unreferenced leaf, the step failed)."""
    llm = LLM(model_path, dtype="float32", num_blocks=12, block_size=4, max_model_len=48, check_integrity=True)
    eng = llm.engine
    head = list(range(5, 14))  # 2 full blocks + 1 token
    eng.add_request(GenerationRequest("a", tuple(head), SamplingParams(temperature=0.0, max_tokens=1)))
    b_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request(GenerationRequest("b", tuple(head + list(range(50, 58))), b_params))
    done = {o.request_id: o for o in eng.step() if o.finished}
    assert "a" in done and eng.pool.num_free == 12 - 5  # b holds 5 blocks, a's 3 are cached and free
    eng.add_request(GenerationRequest("c", tuple(range(100, 124)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert done["b"].outputs[0].token_ids == alone(llm, [head + list(range(50, 58))], b_params)[0]
    assert len(done["c"].outputs[0].token_ids) == 2 and eng.pool.num_free == 12
