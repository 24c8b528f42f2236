"""One request's failure ends that request alone: the others in the step go on unchanged.

Four ordinary greedy requests share every step with one poison request; each
test breaks the poison a different way (its detokenizer, its sampling row, its
logits, its own bans) and checks that the four give exactly the tokens they give
alone, that the poison ends with an error a client may see, and that no block
leaks (the integrity check runs after every step).
"""

import asyncio
import math

import pytest

from shoal import LLM, SamplingParams
from shoal.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from shoal.runner import model_runner
from shoal.runner import sampler as sampler_mod
from shoal.runner.kept import TokenHistory
from shoal.types import FinishReason, GenerationRequest
from server_utils import LiveServer

NUM_BLOCKS = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 390 + 5 for j in range(3 + 5 * i)] for i in range(4)]
POISON_PROMPT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), dtype="float32", num_blocks=NUM_BLOCKS, block_size=4, max_model_len=512,
               max_num_batched_tokens=32, check_integrity=True)


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def run_with_poison(llm, poison_params, before_steps=None) -> tuple[list, object]:
    """The four normal requests and the poison in one engine; their final outputs."""
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(GenerationRequest(f"ok{i}", tuple(p), GREEDY))
    eng.add_request(GenerationRequest("poison", tuple(POISON_PROMPT), poison_params))
    if before_steps is not None:
        before_steps(eng)
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert eng.pool.num_free == NUM_BLOCKS and not eng.scheduler.running and not eng.scheduler.waiting
    return [done[f"ok{i}"] for i in range(4)], done["poison"]


def assert_failed(out, message):
    assert out.finished and out.error == message
    assert all(o.finish_reason is FinishReason.ERROR for o in out.outputs)


def poison_row_logits(llm, monkeypatch, value):
    """Make compute_logits give `value` in every entry of the poison's sampled row."""
    runner = llm.engine.runner
    prepare, compute_logits = model_runner.forward_batch, runner.model.compute_logits
    order = []

    def remember(plan):
        out = prepare(plan)
        order[:] = [s.seq_id for s in out[1] if s.sample]  # the sampled rows' order
        return out

    def logits(hidden):
        out = compute_logits(hidden)
        poison = llm.engine._requests.get("poison")
        if poison is not None and len(out) == len(order):
            seq_id = poison.choices[0].seq.seq_id
            if seq_id in order:
                out[order.index(seq_id)] = value
        return out

    monkeypatch.setattr(model_runner, "forward_batch", remember)
    monkeypatch.setattr(runner.model, "compute_logits", logits)


def test_a_detokenizer_that_raises_fails_only_its_request(llm, alone):
    def break_detokenizer(eng):
        def boom(*a, **k):
            raise RuntimeError("internal detokenizer state")

        eng._requests["poison"].choices[0].detok.add_token = boom

    outs, poison = run_with_poison(llm, GREEDY, break_detokenizer)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_failed(poison, "the server failed while processing this request's output")


def test_a_sampling_row_that_raises_fails_only_its_request(llm, alone, monkeypatch):
    real = TokenHistory.ngram_bans

    def raising(self, extra=()):
        if self.ngram == 3:
            raise IndexError("internal sampler state")
        return real(self, extra)

    monkeypatch.setattr(TokenHistory, "ngram_bans", raising)
    poison = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, no_repeat_ngram_size=3)
    outs, bad = run_with_poison(llm, poison)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_failed(bad, "sampling failed for this request's parameters")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_fail_only_their_request(llm, alone, monkeypatch, value):
    poison_row_logits(llm, monkeypatch, value)
    for params in (GREEDY, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True)):
        outs, bad = run_with_poison(llm, params)
        assert [o.outputs[0].token_ids for o in outs] == alone
        assert_failed(bad, "the model produced non-finite logits for this request")
        assert bad.outputs[0].token_ids == []  # no token was made up


def test_bans_that_cover_the_vocabulary_are_an_error_not_a_pick(llm, alone):
    """no_repeat_ngram_size=1 over a prompt holding every token id bans them all."""
    eng = llm.engine
    everything = tuple(range(eng.vocab_size))
    for i, p in enumerate(PROMPTS):
        eng.add_request(GenerationRequest(f"ok{i}", tuple(p), GREEDY))
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=4, no_repeat_ngram_size=1)
        eng.add_request(GenerationRequest(f"all-banned-{temperature}", everything, params))
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[f"ok{i}"].outputs[0].token_ids for i in range(4)] == alone
    for temperature in (0.0, 1.0):
        assert_failed(done[f"all-banned-{temperature}"], sampler_mod.ROW_ERRORS[sampler_mod.ROW_ALL_BANNED])
    assert eng.pool.num_free == NUM_BLOCKS


def test_extreme_admitted_parameters_run_beside_others(llm, alone):
    """The issue's poison values: top_p 1e-46, temperature 1e-40, repetition_penalty 1e-45."""
    base = dict(max_tokens=8, ignore_eos=True)
    for params, same_as in [
        (SamplingParams(top_p=1e-46, **base), GREEDY),  # keeps only the top token
        (SamplingParams(temperature=1e-40, **base), GREEDY),  # greedy
        (SamplingParams(temperature=0.0, repetition_penalty=1e-45, **base),  # clamped to 1e-20
         SamplingParams(temperature=0.0, repetition_penalty=1e-20, **base)),
    ]:
        outs, poison = run_with_poison(llm, params)
        assert [o.outputs[0].token_ids for o in outs] == alone
        assert poison.error is None and poison.outputs[0].finish_reason is FinishReason.LENGTH
        assert poison.outputs[0].token_ids == llm.generate([POISON_PROMPT], same_as)[0].outputs[0].token_ids
    # Sampled, with penalties that divide logits by ~1e-20: still real tokens, no error.
    outs, poison = run_with_poison(llm, SamplingParams(temperature=0.5, repetition_penalty=1e-45, top_k=10**9, seed=3, **base))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert poison.error is None and len(poison.outputs[0].token_ids) == 8


def test_async_engine_raises_request_failed_for_the_poison_only(llm, alone, monkeypatch):
    poison_row_logits(llm, monkeypatch, math.nan)
    engine = AsyncEngine(llm.engine)

    async def collect(request):
        async for out in engine.generate(request):
            pass
        return out.outputs[0].token_ids

    async def main():
        requests = [GenerationRequest(f"ok{i}", tuple(p), GREEDY) for i, p in enumerate(PROMPTS)]
        requests.append(GenerationRequest("poison", tuple(POISON_PROMPT), GREEDY))
        return await asyncio.gather(*(collect(r) for r in requests), return_exceptions=True)

    try:
        *outs, poison = asyncio.run(main())
        assert outs == alone
        assert isinstance(poison, RequestFailed) and str(poison) == "the model produced non-finite logits for this request"
        LiveServer.wait_until(lambda: llm.engine.pool.num_free == NUM_BLOCKS and not llm.engine.has_unfinished(), what="the blocks back")
    finally:
        engine.shutdown()


def test_a_failed_forward_fails_every_request_without_exposing_the_exception(llm, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(llm.engine.runner, "model", _Broken(llm.engine.runner.model, broken))
    engine = AsyncEngine(llm.engine)

    async def main():
        async for _ in engine.generate(GenerationRequest("a", (5, 6, 7), GREEDY)):
            pass

    try:
        with pytest.raises(EngineDeadError) as err:
            asyncio.run(main())
        assert "secret" not in str(err.value) and "server log" in str(err.value)
        LiveServer.wait_until(lambda: llm.engine.pool.num_free == NUM_BLOCKS and not llm.engine.has_unfinished(), what="the blocks back")
    finally:
        engine.shutdown()


class _Broken:
    """The model with a forward that raises."""

    def __init__(self, model, forward):
        self._model, self._forward = model, forward

    def __call__(self, *a, **k):
        return self._forward(*a, **k)

    def __getattr__(self, name):
        return getattr(self._model, name)

