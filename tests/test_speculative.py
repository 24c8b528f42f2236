"""Speculative decoding (engine/speculative.py, engine/draft.py): drafts change how many tokens a step
yields, never which. Every engine test compares an engine with speculation to one without it, token for
token and logprob for logprob, in the dtype users run, and checks that drafts were in fact verified."""

from __future__ import annotations

import json

import pytest
from tiny_models import ARCHS, make_tiny_model

from shoal.config import SpeculativeConfig
from shoal.engine.llm import LLM
from shoal.engine.sequence import Sequence
from shoal.engine.speculative import PROBE_TOKENS, NgramProposer, ProposerStats, SpecState, Speculator, accepted_length, best_k
from shoal.types import SamplingParams, StructuredOutput

CODE = '''def merge_settings(defaults, overrides):
    merged = dict(defaults)
    for name, value in overrides.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged
'''
TOOL_RESULT = json.dumps({"city": "Lisbon", "temperature_c": 19, "conditions": "partly cloudy", "wind_kph": 14,
                          "humidity": 0.62, "forecast": ["sun", "rain", "sun"]})
PROMPTS = [
    [{"role": "user", "content": "Rewrite this function, renaming `merged` to `result`. Reply with the code only.\n\n" + CODE}],
    [{"role": "user", "content": f"Repeat this JSON tool result with temperature_c set to 21:\n{TOOL_RESULT}"}],
    [{"role": "user", "content": "Quote this paragraph, correcting the year: 'The bridge opened in 1886 and carried "
                                 "trams until 1959, when buses replaced them across the whole city.'"}],
    [{"role": "user", "content": "Write a haiku about rain."}],
]


def _choices(outs) -> list[tuple]:
    return [(c.token_ids, [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in c.logprobs or []], c.finish_reason)
            for o in outs for c in o.outputs]


def _seq(tokens: list[int], max_tokens: int | None = None) -> Sequence:
    s = Sequence("r", tokens[:1], SamplingParams(max_tokens=max_tokens))
    s.token_ids = list(tokens)
    s.num_computed_tokens = len(tokens) - 1
    return s


def _grow(seq: Sequence, n: int) -> None:
    """n more tokens, all computed but the newest (a decoding sequence)."""
    seq.token_ids += [9] * n
    seq.num_computed_tokens = len(seq.token_ids) - 1


# ---------------------------------------------------------------- plain bookkeeping


def test_ngram_proposer_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = NgramProposer(min_n=2, max_n=3)
    state = SpecState()
    #        0  1  2  3  4  5  6  7  8  9 10 11
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # suffix (6, 7): latest earlier occurrence ends at 8 -> 3, 4, 6, 7; (10, 6, 7) never occurred
    assert p.propose(_seq(toks), state, 4) == [3, 4, 6, 7]
    toks += [3]  # suffix (6, 7, 3) occurred at 6..8 -> 4, 6, 7, 3
    assert p.propose(_seq(toks), state, 3) == [4, 6, 7]
    assert state.indexed == len(toks) - 1  # indexed incrementally: the newest n-gram is the key, never indexed
    assert p.propose(_seq([1, 2, 3, 4]), SpecState(), 4) == []  # no repeat: no draft


def test_accepted_length_keeps_the_targets_tokens_up_to_the_first_disagreement():
    assert accepted_length((4, 5, 6), [4, 5, 6, 7]) == 4  # all agree: the bonus token too
    assert accepted_length((4, 5, 6), [4, 9, 6, 7]) == 2  # t_1 != d_1: t_0 and t_1 kept
    assert accepted_length((4, 5, 6), [1, 5, 6, 7]) == 1  # the first disagrees: one token, as a plain decode
    assert accepted_length((4, 5), [4, None, 3]) == 2  # a row that failed (None) ends what is kept, and is kept


def test_best_k_maximizes_tokens_per_unit_of_step_time():
    # a = 0.5, a drafted position at 8% of a step: k = 3 gives 1.875 tokens for 1.24 steps (1.512), k = 2 1.509, k = 4 1.468
    assert best_k(0.5, 0.08, 8) == 3
    assert best_k(1.0, 0.08, 8) == 8 and best_k(0.75, 0.0, 8) == 8  # certain agreement, or free positions: as long as allowed
    assert best_k(0.05, 0.08, 8) == 0  # 1.05 tokens for 1.08 steps: no draft pays
    assert best_k(0.9, 0.5, 8) == 3  # costly positions: a short draft (3.44 / 2.5 beats 2.71 / 2.0 and 4.10 / 3.0)
    # beside 7 other decodes the step yields 8 tokens for 1.56 (5.13 a step): at a = 0.5 one drafted token still pays
    # (8.5 for 1.64, 5.18; three would give 8.875 for 1.80, 4.93), at a = 0.3 none does (8.3 for 1.64, 5.06), and a
    # likely draft is shorter than alone (a = 0.9: k = 6, 12.22 for 2.04, where alone k = 8 is best)
    assert best_k(0.5, 0.08, 8, others=7) == 1 and best_k(0.3, 0.08, 8, others=7) == 0
    assert best_k(0.9, 0.08, 8, others=7) == 6 and best_k(0.9, 0.08, 8) == 8


def test_speculator_adapts_k_to_acceptance_and_probes_a_sequence_whose_drafts_do_not_pay():
    class Fixed(NgramProposer):  # the proposers' interface, with a draft of ones
        name = "fixed"

        def propose(self, seq, state, k):
            return [1] * k

    sp = Speculator(Fixed(), max_tokens=8, max_batch=2, max_model_len=100, draft_cost=0.08)
    seq = _seq([3, 4, 5], max_tokens=50)
    seq.status = seq.status.RUNNING
    sp.propose([seq])
    assert seq.spec.acceptance == 0.75 and seq.draft == (1,) * best_k(0.75, 0.08, 8) == (1,) * 5  # the prior's length
    for _ in range(6):
        sp.observe(seq, 5, 5)
    assert sp.stats.accepted_tokens == sp.stats.drafted_tokens == 30
    sp.propose([seq])
    assert len(seq.draft) == 8  # always right: as long as allowed
    while best_k(seq.spec.acceptance, 0.08, 8):
        sp.observe(seq, 2, 0)
    _grow(seq, 3)  # three output tokens
    sp.propose([seq])
    assert seq.draft == (1,) and seq.spec.next_probe == seq.num_output_tokens + PROBE_TOKENS  # a one-token probe
    _grow(seq, PROBE_TOKENS - 1)
    sp.propose([seq])
    assert seq.draft == ()  # the next probe comes PROBE_TOKENS tokens after the last
    _grow(seq, 1)
    sp.propose([seq])
    assert seq.draft == (1,)
    others = [_seq([1, 2, 3]) for _ in range(3)]
    steps_off = sp.steps_off
    sp.propose(others)  # three decoding sequences > max_batch 2: nobody drafts
    assert sp.steps_off == steps_off + 1 and all(s.draft == () for s in others)
    near_end = _seq([3, 4, 5], max_tokens=3)  # 2 tokens out of 3: only the next token may come, no draft
    _grow(near_end, 2)
    sp.propose([near_end])
    assert near_end.draft == ()


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(num_tokens=0)


# ---------------------------------------------------------------- the default model, in its default dtype


@pytest.fixture(scope="module")
def pair(default_gguf_path):
    """The default model served as users get it (auto: speculation on), and the same without speculation."""
    on = LLM(str(default_gguf_path), check_integrity=True, max_model_len=2048)
    off = LLM(str(default_gguf_path), speculative="off", max_model_len=2048)
    assert on.engine.speculator is not None and on.engine.speculator.name == "ngram"  # auto's choice
    assert off.engine.speculator is None
    yield on, off
    on.close()
    off.close()


def _drafted(llm) -> tuple[int, int]:
    st = llm.engine.speculator.stats
    return st.drafted_tokens, st.accepted_tokens


def _assert_same(on, off, run):
    before = _drafted(on)
    got, want = _choices(run(on)), _choices(run(off))
    assert got == want
    drafted, accepted = (a - b for a, b in zip(_drafted(on), before))
    assert drafted > 0 and accepted > 0  # speculation did run, and kept tokens
    return got


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=56, temperature=0, logprobs=3),
    SamplingParams(max_tokens=56, temperature=0.3, top_p=0.95, seed=11, logprobs=2),
    SamplingParams(max_tokens=40, temperature=0.3, seed=5, n=3, logprobs=1, repetition_penalty=1.05, frequency_penalty=0.1),
], ids=["greedy", "seeded", "n3-penalties"])
def test_alone_and_in_a_batch_the_tokens_and_logprobs_are_those_without_speculation(pair, params):
    on, off = pair
    alone = _assert_same(on, off, lambda llm: llm.chat(PROMPTS[0], params))
    batch = _assert_same(on, off, lambda llm: llm.chat(PROMPTS, params))
    assert batch[: params.n] == alone
    assert on.engine.pool.num_free == on.engine.pool.num_blocks  # every block back (cached ones count as free)


def test_beside_requests_that_do_not_speculate_and_after_a_prefix_hit(pair):
    on, off = pair
    greedy = SamplingParams(max_tokens=40, temperature=0)
    beam = SamplingParams(max_tokens=20, num_beams=2)  # beams never draft
    with_prompt_lp = SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=1)  # no draft until the prompt's are out

    def run(llm):
        return llm.chat(PROMPTS[:3], [greedy, beam, with_prompt_lp])
    first = _assert_same(on, off, run)
    hits = on.engine.prefix_cache.stats.hit_tokens
    assert _assert_same(on, off, run) == first
    assert on.engine.prefix_cache.stats.hit_tokens > hits  # the second run's prompts came from the prefix cache


def test_stop_strings_max_and_min_tokens_and_logit_bias(pair):
    """A stop string or max_tokens may end a reply inside an accepted draft; min_tokens and a logit bias apply at every
    verified position."""
    on, off = pair
    full = off.chat(PROMPTS[1], SamplingParams(max_tokens=80, temperature=0))[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 6]  # a string the reply writes mid-way
    assert stop.strip()
    params = [SamplingParams(max_tokens=80, temperature=0, stop=(stop,), logprobs=1),
              SamplingParams(max_tokens=13, temperature=0, logprobs=1),
              SamplingParams(max_tokens=40, temperature=0, min_tokens=35),
              SamplingParams(max_tokens=40, temperature=0, logit_bias={on.tokenizer.encode(":")[0]: -2.0}, logprobs=1)]
    got = _assert_same(on, off, lambda llm: llm.chat([PROMPTS[1]] * 4, params))
    assert got[0][2] == "stop" and got[1][2] == "length" and len(got[1][0]) == 13


def test_structured_output_drafts_stay_inside_the_grammar(pair):
    on, off = pair
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temperature_c": {"type": "integer"},
                                               "conditions": {"type": "string"}},
              "required": ["city", "temperature_c", "conditions"]}
    params = SamplingParams(max_tokens=80, temperature=0, logprobs=1,
                            structured=StructuredOutput(json_schema=json.dumps(schema)))
    got = _assert_same(on, off, lambda llm: llm.chat(PROMPTS[1], params))
    text = on.tokenizer.decode(got[0][0])
    assert set(json.loads(text)) == {"city", "temperature_c", "conditions"}


def test_preemption_mid_draft_changes_nothing_and_leaks_no_block(default_gguf_path):
    """A pool of 24 blocks of 16 tokens for four prompts of 30 to 110 tokens growing by 72: sequences are
    preempted (their drafts dropped) and recomputed; the pool's exact counts are checked after every step."""
    params = SamplingParams(max_tokens=72, temperature=0, logprobs=1, ignore_eos=True)
    outs = {}
    for method in ("ngram", "off"):
        with LLM(str(default_gguf_path), speculative=method, num_blocks=24, check_integrity=True, max_model_len=256) as llm:
            outs[method] = _choices(llm.chat(PROMPTS, params))
            assert llm.engine.scheduler.num_preemptions > 0
            assert llm.engine.pool.num_free == 24
            if method == "ngram":
                assert llm.engine.speculator.stats.accepted_tokens > 0
    assert outs["ngram"] == outs["off"]


# ---------------------------------------------------------------- constructed proposers: the counters


class _Oracle(NgramProposer):
    """Proposes the reply decoding without speculation gives (right every time), or that reply's tokens
    shifted by one (`wrong`: never right)."""

    name = "oracle"

    def __init__(self, prompt_len: int, reply: list[int], wrong: bool, vocab: int) -> None:
        self.prompt_len, self.reply, self.wrong, self.vocab = prompt_len, reply, wrong, vocab

    def propose(self, seq, state, k):
        n = seq.num_tokens - self.prompt_len
        draft = self.reply[n : n + k]
        return [(t + 1) % self.vocab for t in draft] if self.wrong else draft


@pytest.mark.parametrize("wrong", [False, True], ids=["all-right", "all-wrong"])
def test_acceptance_counters_on_drafts_all_right_and_all_wrong(pair, wrong):
    on, off = pair
    prompt = on.apply_chat_template(PROMPTS[3])
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reply = off.generate(prompt, params)[0].outputs[0].token_ids
    sp = on.engine.speculator
    saved = sp.proposer, sp.stats, sp.draft_cost
    # drafts judged free, so the draft length is the longest whatever the host's timing at start (the calibration
    # measures it; on a busy host a dear draft made the length 1 and the step count this test bounds grew)
    sp.proposer, sp.stats, sp.draft_cost = _Oracle(len(prompt), reply, wrong, on.engine.vocab_size), ProposerStats(), 0.0
    steps = on.engine.stats.steps
    try:
        got = on.generate(prompt, params)[0].outputs[0].token_ids
        stats = sp.stats
    finally:
        sp.proposer, sp.stats, sp.draft_cost = saved
    steps = on.engine.stats.steps - steps
    assert got == reply
    assert stats.drafts > 0 and stats.drafted_tokens >= stats.drafts
    if wrong:
        assert stats.accepted_tokens == 0 and stats.acceptance_rate == 0.0
        assert steps >= len(reply)  # a token a step, as without drafts
    else:
        assert stats.accepted_tokens == stats.drafted_tokens and stats.acceptance_rate == 1.0
        # the first token from the prompt's step, then up to 8 + 1 a step
        assert steps <= 1 + -(-(len(reply) - 1) // 9) + 1


# ---------------------------------------------------------------- tiny models of each architecture, and a draft model


REPEATING = "one two three four five one two three four five one two three"


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    return {arch: make_tiny_model(arch, tmp_path_factory.mktemp(f"spec-{arch}")) for arch in ARCHS}


def _tiny(path, speculative, **kw) -> LLM:
    return LLM(str(path), speculative=speculative, attention="invariant", check_integrity=True, num_blocks=256,
               block_size=8, **kw)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_models_of_each_architecture_decode_the_same_with_ngram_drafts(tiny_paths, arch):
    params = [SamplingParams(max_tokens=48, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0.9, seed=2, logprobs=1, ignore_eos=True)]
    outs = {}
    for method in ("ngram", "off"):
        with _tiny(tiny_paths[arch], method) as llm:
            outs[method] = _choices(llm.generate([REPEATING, "a b a b a b a b"], params))
            if method == "ngram":
                assert llm.engine.speculator.stats.drafted_tokens > 0
            assert llm.engine.pool.num_free == 256
    assert outs["ngram"] == outs["off"]


def test_a_draft_model_changes_no_answer_and_returns_its_blocks(tiny_paths):
    """A tiny qwen2 drafts for a tiny llama (the same tokenizer): few drafts agree, and no answer changes;
    the llama drafting for itself agrees on every greedy token."""
    params = [SamplingParams(max_tokens=40, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=9, n=2, ignore_eos=True)]
    prompts = [REPEATING, "Hello, world! The quick brown fox"]
    with _tiny(tiny_paths["llama"], "off") as llm:
        want = _choices(llm.generate(prompts, params))
    for draft in ("qwen2", "llama"):
        spec = SpeculativeConfig(method="draft", model=str(tiny_paths[draft]))
        with _tiny(tiny_paths["llama"], spec) as llm:
            sp = llm.engine.speculator
            assert sp.name == "draft"
            assert _choices(llm.generate(prompts, params)) == want
            assert sp.stats.drafted_tokens > 0
            assert sp.proposer.pool.num_free == sp.proposer.pool.num_blocks and sp.proposer.num_tracked == 0
            if draft == "llama":
                greedy = llm.generate(prompts[0], params[0])[0].outputs[0].token_ids
                before = sp.stats.drafted_tokens, sp.stats.accepted_tokens
                assert llm.generate(prompts[0], params[0])[0].outputs[0].token_ids == greedy
                drafted, accepted = sp.stats.drafted_tokens - before[0], sp.stats.accepted_tokens - before[1]
                assert drafted > 0 and accepted == drafted


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_paths, tmp_path):
    from tiny_models import make_tokenizer

    other = make_tiny_model("llama", tmp_path / "other")
    tok = make_tokenizer(vocab_size=300)
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizer"):
        _tiny(tiny_paths["llama"], SpeculativeConfig(method="draft", model=str(other)))


def _every_case(llm) -> list[tuple]:
    """One batch of every kind of request, then the same batch again (its prompts now prefix-cache hits)."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]})
    params = [
        SamplingParams(max_tokens=40, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=4, n=3, logprobs=1, ignore_eos=True, presence_penalty=0.3),
        SamplingParams(max_tokens=40, temperature=0, stop=("three four",), ignore_eos=True, logit_bias={5: 2.0}),
        SamplingParams(max_tokens=30, temperature=0, structured=StructuredOutput(json_schema=schema), logprobs=1),
        SamplingParams(max_tokens=12, num_beams=2),
        SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=1, min_tokens=15),
    ]
    prompts = [REPEATING, "a b a b a b a b", REPEATING + " one two", "Hello, world! " * 3, "The quick brown fox", REPEATING]
    return _choices(llm.generate(prompts, params)) + _choices(llm.generate(prompts, params))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_every_kind_of_request_on_a_tiny_model_under_preemption_and_after_prefix_hits(tiny_paths, proposer):
    """n-gram drafts and a tiny Qwen2 drafting for a tiny Llama: greedy, seeded n=3 with a penalty, a stop string with
    a logit bias, a JSON schema, beam search and a prompt-logprobs request with min_tokens, in one batch over a pool
    of 22 blocks of 8 tokens (sequences are preempted), then again from the prefix cache: the tokens and logprobs of
    no speculation, and every block back."""
    spec = SpeculativeConfig(method="draft", model=str(tiny_paths["qwen2"])) if proposer == "draft" else "ngram"
    got = {}
    for name, method in (("on", spec), ("off", "off")):
        with LLM(str(tiny_paths["llama"]), speculative=method, attention="invariant", check_integrity=True,
                 num_blocks=22, block_size=8, max_model_len=160) as llm:
            got[name] = _every_case(llm)
            eng = llm.engine
            assert eng.scheduler.num_preemptions > 0 and eng.pool.num_free == 22
            if name == "on":
                assert eng.speculator.stats.drafted_tokens > 0
                if proposer == "draft":
                    assert eng.speculator.proposer.pool.num_free == eng.speculator.proposer.pool.num_blocks
    assert got["on"] == got["off"]


def test_an_aborted_request_mid_draft_returns_its_blocks_and_changes_no_other(tiny_paths):
    from shoal.types import GenerationRequest

    params = SamplingParams(max_tokens=40, temperature=0, logprobs=1, ignore_eos=True)
    prompts = [REPEATING, "a b a b a b a b", REPEATING + " one"]
    with _tiny(tiny_paths["llama"], "off") as llm:
        want = _choices(llm.generate([prompts[0], prompts[2]], params))
    spec = SpeculativeConfig(method="draft", model=str(tiny_paths["llama"]))  # itself: every greedy draft agrees
    with _tiny(tiny_paths["llama"], spec) as llm:
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(GenerationRequest(f"r{i}", tuple(llm.tokenizer.encode(p)), params))
        done = {}
        for _ in range(3):
            for out in eng.step():
                done[out.request_id] = out
        assert eng.speculator.stats.drafts > 0  # drafts are being verified
        assert eng.abort("r1")
        while eng.has_unfinished():
            for out in eng.step():
                done[out.request_id] = out
        assert done["r1"].outputs[0].finish_reason == "abort"
        assert _choices([done["r0"], done["r2"]]) == want
        assert eng.pool.num_free == eng.pool.num_blocks
        assert eng.speculator.proposer.pool.num_free == eng.speculator.proposer.pool.num_blocks
