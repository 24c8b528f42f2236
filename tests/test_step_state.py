"""State kept from step to step: the native attention op's block tables (attention/invariant.py TableRows) equal a
from-scratch build after every step, in a seeded random walk of table changes and through the engine under
admissions, preemptions, aborts, beams and speculation's drafts; the plans' diffs of block tables and histories
(runner/kept.py); the sampling batch kept while its rows stay; and outputs do not change with any of them."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from shoal import kernels
from shoal.engine.llm import LLM
from shoal.engine.scheduler import _table_diffs
from shoal.runner.kept import KeptHistories, KeptLists, OutOfStep, TokenHistory
from shoal.runner.model_runner import ModelRunner
from shoal.runner.sampler import SamplingBatch, no_repeat_ngram_bans
from shoal.model.attention.common import SeqSpan
from shoal.model.attention.invariant import InvariantAttention, TableRows
from shoal.types import GenerationRequest, SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
NULL = 999


def _assert_rows(got: torch.Tensor, spans: list[SeqSpan], null: int) -> None:
    assert got.dtype == torch.int32 and got.shape[0] == len(spans) and got.is_contiguous()
    for row, s in zip(got.tolist(), spans):
        n = len(s.block_table)
        assert row[:n] == list(s.block_table) and set(row[n:]) <= {null}, (row, s)


def test_diffs_and_rows_follow_every_kind_of_table_change_in_a_seeded_random_walk():
    """The scheduler's tables (BlockTable) changed by every mutation the KV manager makes: appends, a changed block
    (copy-on-write's swap), freed blocks (a window), a trimmed tail (a rejected draft), a table made anew
    (preemption, admission), sequences that come and go, more of them than rows and tables wider than the columns.
    Each step sends only the diffs; after it the runner's kept table (KeptLists) and the attention op's row
    (TableRows) are the scheduler's table, and what went out is no more than what changed."""
    rng = random.Random(0)
    rows = TableRows(NULL, torch.device("cpu"), rows=4, columns=4)
    kept = KeptLists("table")
    tables: dict[int, list[int]] = {}
    low: dict[int, int] = {}  # the first entry changed since the table last went out
    sent_len: dict[int, int] = {}  # its length then
    next_id, sent, whole_sent = 0, 0, 0
    for _ in range(600):
        while len(tables) < rng.randint(1, 9):
            tables[next_id] = [rng.randrange(500) for _ in range(rng.randint(0, 3))]
            low[next_id], sent_len[next_id] = 0, 0
            next_id += 1
        for sid in list(tables):
            t = tables[sid]
            kind = rng.random()
            at = len(t)
            if kind < 0.5:
                t.extend(rng.randrange(500) for _ in range(rng.randint(0, 2)))
            elif kind < 0.58 and t:
                at = rng.randrange(len(t))
                t[at] = rng.randrange(500)
            elif kind < 0.65 and t:
                at = rng.randrange(len(t))
                end = rng.randint(at, len(t))
                t[at:end] = [NULL] * (end - at)
            elif kind < 0.7 and t:
                at = rng.randrange(len(t))
                del t[at:]
            elif kind < 0.75:
                tables[sid], at = [rng.randrange(500) for _ in range(rng.randint(0, 2))], 0
            elif kind < 0.8:
                del tables[sid]
                kept.drop([sid])
                continue
            low[sid] = min(low[sid], at)
        step = [sid for sid in tables if rng.random() < 0.7] or list(tables)[:1]
        spans = []
        for sid in step:
            held = [tables[sid]]
            starts, tails = _table_diffs(held)
            tables[sid] = held[0]
            assert starts[0] == min(low[sid], sent_len[sid])  # what changed since it last went out, nothing more
            assert tails[0] == tuple(tables[sid][starts[0]:])
            low[sid], sent_len[sid] = len(tables[sid]), len(tables[sid])
            sent += len(tails[0])
            whole_sent += len(tables[sid])
            whole = kept.put(sid, starts, tails)[0]
            assert whole == tables[sid]
            spans.append(SeqSpan(0, 1, whole, sid, starts[0]))
        _assert_rows(rows.tables(spans, set(step)), spans, NULL)
    assert rows.tensor.shape[0] > 4 and rows.tensor.shape[1] > 4  # it grew, rows and columns
    assert next_id > 10 * rows.tensor.shape[0]  # and rows were reused
    assert sent < whole_sent / 2  # the diffs were far less than the whole tables


@pytest.mark.skipif(not kernels.available(), reason="the tables are the native attention op's")
def test_the_engines_tables_equal_a_fresh_build_after_every_step_and_outputs_do_not_change(monkeypatch):
    """A tiny pool (preemption), n-gram drafts, beams, seeded sampling, penalties and bans, requests added and aborted
    between steps. Every step's plan carries diffs; after them the runner's tables and histories are the scheduler's,
    the attention op's kept tables equal the ones built from scratch, and every output equals the run that builds
    them afresh."""
    checked = []
    original = TableRows.tables

    def checking(self, spans, step):
        got = original(self, spans, step)
        _assert_rows(got, spans, self.null)
        checked.append(len(spans))
        return got

    monkeypatch.setattr(TableRows, "tables", checking)
    engines = []
    diffs = {"tables": [0, 0], "history": [0, 0]}  # entries sent, entries the whole state has

    def spans_checked(self, batch):  # the runner's tables after the plan's diffs are the scheduler's
        got = spans(self, batch)
        for s in got[0] if engines and getattr(engines[-1].executor, "runner", None) is self else ():
            seq = engines[-1].scheduler.get(s.seq_id)
            assert list(s.block_table) == list(seq.block_table), (s, seq.block_tables)
            diffs["tables"][0] += len(next(t for t in batch.decodes + batch.chunks if t.seq_id == s.seq_id).block_table)
            diffs["tables"][1] += len(s.block_table)
        return got

    def history_checked(self, seq_id, start, tail, prompt_len, ngram):
        got = put(self, seq_id, start, tail, prompt_len, ngram)
        # a sequence with penalties or bans: its kept history is all its tokens, and its views are those of a fresh one
        seq = engines[-1].scheduler.get(seq_id)
        assert got.tokens == seq.token_ids
        fresh = TokenHistory.of(seq.prompt_token_ids, seq.output_token_ids, ngram)
        assert (got.seen, got.counts, got.index) == (fresh.seen, fresh.counts, fresh.index)
        diffs["history"][0] += len(tail)
        diffs["history"][1] += len(got.tokens)
        return got

    spans, put = ModelRunner._spans, KeptHistories.put
    monkeypatch.setattr(ModelRunner, "_spans", spans_checked)
    monkeypatch.setattr(KeptHistories, "put", history_checked)

    def run(keep: bool) -> list:
        monkeypatch.setattr(InvariantAttention, "keep_tables", keep)
        llm = LLM(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), num_blocks=28, block_size=4, max_model_len=64,
                  max_num_batched_tokens=24, speculative="ngram", check_integrity=True)
        eng = llm.engine
        engines.append(eng)
        rng = random.Random(3)
        outs, live, n = [], set(), 0
        for step in range(160):
            if n < 30 and rng.random() < 0.5:
                prompt = tuple(rng.choice((5, 6, 7, 8, 9, 10)) for _ in range(rng.randint(3, 30)))
                kind = n % 5
                params = (SamplingParams(num_beams=2, max_tokens=6, ignore_eos=True) if kind == 0
                          else SamplingParams(temperature=0.9, seed=n, max_tokens=rng.randint(4, 30), ignore_eos=True) if kind == 1
                          else SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                              max_tokens=rng.randint(4, 30), ignore_eos=True) if kind == 2
                          else SamplingParams(temperature=0.0, no_repeat_ngram_size=2, max_tokens=rng.randint(4, 30)) if kind == 3
                          else SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 30), ignore_eos=True, logprobs=2))
                eng.add_request(GenerationRequest(f"r{n}", prompt, params))
                live.add(f"r{n}")
                n += 1
            if live and rng.random() < 0.04:
                victim = sorted(live)[rng.randrange(len(live))]
                eng.abort(victim)
            for out in eng.step():
                if out.finished:
                    live.discard(out.request_id)
                    outs.append((out.request_id, [(c.token_ids, [lp.logprob for lp in c.logprobs or []]) for c in out.outputs]))
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs.append((out.request_id, [(c.token_ids, [lp.logprob for lp in c.logprobs or []]) for c in out.outputs]))
        assert eng.stats.preemptions > 0 or eng.scheduler.num_preemptions > 0  # the pool was tight enough
        return sorted(outs)

    kept = run(True)
    assert len(checked) > 50  # the check ran on the engine's steps
    assert kept == run(False)
    for what, (sent, whole) in diffs.items():  # the plans carried diffs: far less than the whole state
        assert 0 < sent < whole / 3, (what, sent, whole)
    assert len(engines[-1].executor.runner.kept_tables) <= len(engines[-1].scheduler.running)  # the gone were dropped


def test_a_kept_sampling_batch_gives_the_tokens_of_one_built_every_step(monkeypatch):
    """Greedy, seeded, top-p and unseeded rows that come and go: the step's SamplingBatch is built again only when its
    rows change, and the seeded rows' tokens and every row's logprobs equal those of a run that builds it every step."""
    builds = []
    build = SamplingBatch.build.__func__

    def counting(cls, rows, vocab_size, device):
        builds.append(len(rows))
        return build(cls, rows, vocab_size, device)

    monkeypatch.setattr(SamplingBatch, "build", classmethod(counting))

    def run(keep: bool):
        if not keep:
            sampling_batch = ModelRunner._sampling_batch

            def fresh(self, seqs, vocab_size, histories):
                self._kept_sampling = None
                return sampling_batch(self, seqs, vocab_size, histories)

            monkeypatch.setattr(ModelRunner, "_sampling_batch", fresh)
        builds.clear()
        llm = LLM(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), num_blocks=64, block_size=4, max_model_len=64, speculative="off")
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1),
                  SamplingParams(temperature=0.8, seed=7, max_tokens=48, ignore_eos=True, logprobs=1),
                  SamplingParams(temperature=1.0, top_p=0.8, seed=11, max_tokens=30, ignore_eos=True),
                  SamplingParams(temperature=0.7, min_p=0.1, seed=3, n=2, max_tokens=44, ignore_eos=True)]
        outs = llm.generate([[5, 6, 7, 8, 9], [6, 6, 7], [9, 8, 7, 6, 5, 4], [7, 7]], params)
        steps = llm.engine.stats.steps
        return [[(c.token_ids, [lp.logprob for lp in c.logprobs or []]) for c in o.outputs] for o in outs], len(builds), steps

    kept, kept_builds, steps = run(True)
    fresh, fresh_builds, _ = run(False)
    assert kept == fresh
    assert fresh_builds >= steps - 1 and kept_builds < fresh_builds / 3, (kept_builds, fresh_builds, steps)


def test_a_kept_historys_views_are_those_of_the_whole_history_as_tokens_come():
    """TokenHistory's distinct tokens, output counts and n-gram bans, brought up to date token by token and with a
    draft's extra tokens on top, equal those counted from the whole history (sampler.no_repeat_ngram_bans is
    HF's, tests/test_sampler.py); a diff that starts past what is kept raises, one that starts earlier rebuilds."""
    rng = random.Random(1)
    for _ in range(2000):
        n, V = rng.randint(0, 5), rng.randint(1, 6)
        prompt = [rng.randrange(V) for _ in range(rng.randint(0, 8))]
        kept = KeptHistories()
        h = kept.put(1, 0, prompt, len(prompt), n)
        out: list[int] = []
        for _ in range(rng.randint(0, 10)):
            new = [rng.randrange(V) for _ in range(rng.randint(0, 3))]
            h = kept.put(1, len(prompt) + len(out), new, len(prompt), n)
            out += new
            extra = tuple(rng.randrange(V) for _ in range(rng.randint(0, 4)))
            whole = prompt + out + list(extra)
            bans = h.ngram_bans(extra)
            assert (sorted(bans) if n == 1 else bans) == (sorted(no_repeat_ngram_bans(whole, n)) if n == 1 else no_repeat_ngram_bans(whole, n))
            assert sorted(h.seen_tokens(extra)) == sorted(set(whole))
            assert dict(zip(*h.output_counts(extra))) == dict(Counter(out + list(extra)))
            assert h.num_output(extra) == len(out) + len(extra)
        assert h.tokens == prompt + out  # the extras were never kept
        if out:
            with pytest.raises(OutOfStep, match="starts at"):
                kept.put(1, len(h.tokens) + 1, [0], len(prompt), n)
            again = kept.put(1, len(prompt), out[:1], len(prompt), n)  # rewritten from the output's start
            fresh = TokenHistory.of(prompt, out[:1], n)
            assert (again.tokens, again.seen, again.counts, again.index) == (fresh.tokens, fresh.seen, fresh.counts, fresh.index)
    kept.drop([1])
    assert len(kept) == 0


def test_a_requests_outputs_share_its_prompt_not_a_copy_a_step():
    """Each step's RequestOutput names the request's own prompt ids (a tuple), so a long prompt costs nothing per step;
    the outputs are still snapshots of the choices (a kept output's tokens do not grow with the next step)."""
    llm = LLM(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), num_blocks=64, block_size=4, max_model_len=64, speculative="off")
    prompt = tuple(range(5, 25))
    llm.engine.add_request(GenerationRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    outs = []
    while llm.engine.has_unfinished():
        outs += [o for o in llm.engine.step() if o.request_id == "r"]
    assert len(outs) >= 3 and all(o.prompt_token_ids is outs[0].prompt_token_ids == prompt for o in outs)
    # each kept output has the tokens of its own step (a step of decodes alone may give several: decode runs)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == list(itertools.accumulate(len(o.outputs[0].delta_token_ids) for o in outs)) and lengths[-1] == 6
    assert lengths == sorted(set(lengths))
