"""Prompt logprobs against transformers' log_softmax of the same prompt, on the same weights.

Entry i (i >= 1) is prompt token i's logprob given tokens < i, with the top k at
that position; entry 0 is None. They come from the prefill's own forward, so
they must stay right when the prefill is chunked, when the prompt was cached by
an earlier request, with n > 1 and after preemption.
"""

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.types import GenerationRequest

K = 5


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(tiny_llama_hf, ids) -> torch.Tensor:
    """transformers' log_softmax at every prompt position, [P, V]."""
    with torch.no_grad():
        return tiny_llama_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_matches_transformers(tiny_llama_hf, ids, entries, k=K):
    logp = reference(tiny_llama_hf, ids)
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e = entries[i]
        assert e.token_id == ids[i]
        assert e.logprob == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-4)
        top = logp[i - 1].topk(k)
        assert [t.token_id for t in e.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in e.top]), top.values, atol=1e-4, rtol=0)


def test_chunked_prefill_gives_transformers_prompt_logprobs(tiny_llama_path, tiny_llama_hf):
    """A 70-token prompt over 16-token steps: five chunks, each giving its positions' logprobs."""
    llm = LLM(str(tiny_llama_path), dtype="float32", num_blocks=128, block_size=4, max_num_batched_tokens=16,
              enable_prefix_cache=False, check_integrity=True)
    ids = prompt(70)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
    out = llm.generate([ids], params)[0]
    assert_matches_transformers(tiny_llama_hf, ids, out.prompt_logprobs)
    plain = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids  # sampling is unaffected


def test_every_output_after_the_prefill_carries_them_complete(tiny_llama_path, tiny_llama_hf):
    llm = LLM(str(tiny_llama_path), dtype="float32", num_blocks=128, block_size=4, max_num_batched_tokens=8)
    ids = prompt(20, seed=1)
    eng = llm.engine
    eng.add_request(GenerationRequest("r", tuple(ids), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)))
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    # nothing is output during the prefill: every output carries new tokens (one, or a decode run's several)
    assert all(o.outputs[0].delta_token_ids for o in outs) and sum(len(o.outputs[0].delta_token_ids) for o in outs) == 4
    for o in outs:
        assert_matches_transformers(tiny_llama_hf, ids, o.prompt_logprobs, k=0)
        assert all(e.top == [] for e in o.prompt_logprobs[1:])


def test_a_prefix_cache_hit_does_not_skip_prompt_logprobs(tiny_llama_path, tiny_llama_hf):
    """The prompt was cached by an earlier request: a request wanting prompt logprobs still
    computes the whole prompt (and gets transformers' values); one that does not takes the hit."""
    llm = LLM(str(tiny_llama_path), dtype="float32", num_blocks=128, block_size=4, max_num_batched_tokens=32,
              check_integrity=True)
    ids = prompt(45, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate([ids], greedy)[0]
    assert first.num_cached_tokens == 0
    wants = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K))[0]
    assert wants.num_cached_tokens == 0  # no hit taken
    assert_matches_transformers(tiny_llama_hf, ids, wants.prompt_logprobs)
    assert wants.outputs[0].token_ids == first.outputs[0].token_ids
    again = llm.generate([ids], greedy)[0]
    assert again.num_cached_tokens > 0  # the cache still serves requests without prompt logprobs
    # and a longer prompt whose head is cached: the cached head gets its logprobs too
    longer = ids + prompt(10, seed=3)
    out = llm.generate([longer], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K))[0]
    assert_matches_transformers(tiny_llama_hf, longer, out.prompt_logprobs)


def test_n_choices_and_preemption_give_each_entry_once(tiny_llama_path, tiny_llama_hf, monkeypatch):
    """n = 3 forks share the prompt: one list. A pool too small for the batch preempts
    sequences halfway through their prompt logprobs and recomputes them; no entry is
    computed twice or lost."""
    from shoal.engine.scheduler import Scheduler

    halfway = []
    preempt = Scheduler._preempt

    def record(self, seq):
        halfway.append(seq.wants_prompt_logprobs and seq.num_prompt_logprobs > 0)
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", record)
    llm = LLM(str(tiny_llama_path), dtype="float32", num_blocks=40, block_size=4, max_model_len=96,
              max_num_batched_tokens=24, check_integrity=True)
    forked = llm.generate([prompt(30, seed=4)], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=2))[0]
    assert len(forked.outputs) == 3
    assert_matches_transformers(tiny_llama_hf, prompt(30, seed=4), forked.prompt_logprobs, k=2)

    prompts = [prompt(30 + 5 * i, seed=10 + i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(prompts, params)
    assert any(halfway)
    for ids, out in zip(prompts, outs):
        assert_matches_transformers(tiny_llama_hf, ids, out.prompt_logprobs)
    assert llm.engine.pool.num_free == 40


def test_beam_search_and_one_token_prompts(tiny_llama_path, tiny_llama_hf):
    llm = LLM(str(tiny_llama_path), dtype="float32", num_blocks=64, block_size=4, max_model_len=128)
    ids = prompt(12, seed=6)
    out = llm.generate([ids], SamplingParams(num_beams=2, max_tokens=3, ignore_eos=True, prompt_logprobs=K))[0]
    assert_matches_transformers(tiny_llama_hf, ids, out.prompt_logprobs)
    one = llm.generate([[7]], SamplingParams(max_tokens=2, prompt_logprobs=K))[0]
    assert one.prompt_logprobs == [None]


def test_prompt_logprobs_beyond_20_are_rejected():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
