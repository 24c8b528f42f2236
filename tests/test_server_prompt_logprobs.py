"""Prompt logprobs over HTTP: `echo` + `logprobs` on completions (how evaluation harnesses score
log-likelihoods) and vLLM's `prompt_logprobs`, checked against transformers on the same weights.
"""

import pytest
import torch

from server_utils import LiveServer, tiny_engine
from test_prompt_logprobs import prompt, reference
from test_server_errors import check

K = 3


@pytest.fixture(scope="module")
def srv(tiny_llama_path):
    with LiveServer(tiny_engine(tiny_llama_path, check_integrity=True)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return srv.openai()


def assert_echoed_prompt_matches(lp, ids, logp, text_of, k):
    """The first len(ids) entries of a completions logprobs object are the prompt's."""
    assert lp.tokens[: len(ids)] == [text_of(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-4)
        top = lp.top_logprobs[i]
        best = logp[i - 1].topk(k)
        expected = {text_of(t): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
        expected.setdefault(text_of(ids[i]), logp[i - 1, ids[i]].item())
        assert top.keys() == expected.keys()
        for token, value in expected.items():
            assert top[token] == pytest.approx(value, abs=1e-4)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


def test_echo_logprobs_are_the_prompts_then_the_generated(client, srv, tiny_llama_hf):
    """lm-evaluation-harness's local-completions request: token ids, echo, max_tokens 1, logprobs 1."""
    ids = prompt(24, seed=0)
    r = client.completions.create(model=srv.state.model_name, prompt=ids, echo=True, max_tokens=1, logprobs=1, temperature=0)
    (choice,) = r.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert_echoed_prompt_matches(lp, ids, reference(tiny_llama_hf, ids), srv.state.token_strings, 1)
    logp_next = reference(tiny_llama_hf, ids)[-1]
    assert lp.token_logprobs[-1] == pytest.approx(logp_next.max().item(), abs=1e-4)  # greedy: the top token
    assert choice.text == srv.engine.tokenizer.decode(ids) + lp.tokens[-1]
    assert r.usage.completion_tokens == 1


def test_a_cached_prompt_keeps_them_right(client, srv, tiny_llama_hf):
    """The prompt's head is in the prefix cache (an earlier request put it there): its logprobs are still right."""
    first = prompt(40, seed=1)
    longer = first + prompt(12, seed=2)
    params = dict(model=srv.state.model_name, max_tokens=1, temperature=0)
    client.completions.create(prompt=first, **params)
    assert client.completions.create(prompt=longer, **params).usage.prompt_tokens_details.cached_tokens >= 32
    r = client.completions.create(prompt=longer, echo=True, logprobs=K, **params)
    assert_echoed_prompt_matches(r.choices[0].logprobs, longer, reference(tiny_llama_hf, longer), srv.state.token_strings, K)


def test_max_tokens_0_gives_the_prompt_part_only(client, srv, tiny_llama_hf):
    ids = prompt(16, seed=3)
    r = client.completions.create(model=srv.state.model_name, prompt=[ids, ids[:8]], echo=True, max_tokens=0, logprobs=2)
    assert [len(c.logprobs.tokens) for c in r.choices] == [16, 8]
    assert [c.text for c in r.choices] == [srv.engine.tokenizer.decode(ids), srv.engine.tokenizer.decode(ids[:8])]
    assert {c.finish_reason for c in r.choices} == {"length"}
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 24
    assert_echoed_prompt_matches(r.choices[0].logprobs, ids, reference(tiny_llama_hf, ids), srv.state.token_strings, 2)


def assert_vllm_format(entries, ids, logp, text_of, k):
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e = entries[i]
        own = e[str(ids[i])]
        assert own["logprob"] == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-4)
        assert own["decoded_token"] == text_of(ids[i])
        best = logp[i - 1].topk(k)
        for rank, (t, v) in enumerate(zip(best.indices.tolist(), best.values.tolist()), 1):
            assert e[str(t)]["rank"] == rank and e[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
        assert set(e) == {str(t) for t in best.indices.tolist()} | {str(ids[i])}


def test_vllm_prompt_logprobs_on_completions_and_chat(client, srv, tiny_llama_hf):
    ids = prompt(20, seed=4)
    r = client.completions.create(model=srv.state.model_name, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": K})
    assert r.choices[0].logprobs is None  # not asked for
    assert_vllm_format(r.choices[0].model_extra["prompt_logprobs"], ids, reference(tiny_llama_hf, ids), srv.state.token_strings, K)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with srv.http() as h:
        chat_ids = h.post("/tokenize", json={"messages": messages}).json()["tokens"]
    c = client.chat.completions.create(model=srv.state.model_name, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    assert_vllm_format(c.model_extra["prompt_logprobs"], chat_ids, reference(tiny_llama_hf, chat_ids), srv.state.token_strings, 0)


def test_prompt_logprobs_with_stream_are_refused(srv):
    with srv.http() as h:
        r = h.post("/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 1, "stream": True})
        check(r, 400, "invalid_request_error", "stream", param="echo")
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True})
        check(r, 400, "invalid_request_error", "stream", param="prompt_logprobs")
