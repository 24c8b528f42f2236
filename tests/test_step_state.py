"""State kept from step to step: the native attention op's block tables (attention/invariant.py TableRows) equal a
from-scratch build after every step, in a seeded random walk of table changes and through the engine under
admissions, preemptions, aborts, beams and speculation's drafts; and outputs do not change with them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from shoal import kernels
from shoal.engine.llm import LLM
from shoal.model.attention.common import SeqSpan
from shoal.model.attention.invariant import InvariantAttention, TableRows
from shoal.types import GenerationRequest, SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
NULL = 999


def _assert_rows(got: torch.Tensor, spans: list[SeqSpan], null: int) -> None:
    assert got.dtype == torch.int32 and got.shape[0] == len(spans) and got.is_contiguous()
    for row, s in zip(got.tolist(), spans):
        n = len(s.block_table)
        assert tuple(row[:n]) == s.block_table and set(row[n:]) <= {null}, (row, s)


def test_rows_follow_every_kind_of_table_change_in_a_seeded_random_walk():
    """Appends, a changed last block (copy-on-write), freed blocks (a window), a restart (preemption), sequences that
    come and go, more of them than rows and tables wider than the columns: after every step each row is its table."""
    rng = random.Random(0)
    rows = TableRows(NULL, torch.device("cpu"), rows=4, columns=4)
    tables: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(600):
        while len(tables) < rng.randint(1, 9):
            tables[next_id] = [rng.randrange(500) for _ in range(rng.randint(0, 3))]
            next_id += 1
        for sid in list(tables):
            t = tables[sid]
            kind = rng.random()
            if kind < 0.5:
                t.extend(rng.randrange(500) for _ in range(rng.randint(0, 2)))
            elif kind < 0.6 and t:
                t[-1] = rng.randrange(500)
            elif kind < 0.67 and t:
                for i in range(rng.randrange(len(t))):
                    t[i] = NULL
            elif kind < 0.72:
                tables[sid] = [rng.randrange(500) for _ in range(rng.randint(0, 2))]
            elif kind < 0.8:
                del tables[sid]
        step = [sid for sid in tables if rng.random() < 0.7] or list(tables)[:1]
        spans = [SeqSpan(0, 1, tuple(tables[sid]), sid) for sid in step]
        _assert_rows(rows.tables(spans, set(step)), spans, NULL)
    assert rows.tensor.shape[0] > 4 and rows.tensor.shape[1] > 4  # it grew, rows and columns
    assert next_id > 10 * rows.tensor.shape[0]  # and rows were reused


@pytest.mark.skipif(not kernels.available(), reason="the tables are the native attention op's")
def test_the_engines_tables_equal_a_fresh_build_after_every_step_and_outputs_do_not_change(monkeypatch):
    """A tiny pool (preemption), n-gram drafts, beams, seeded sampling, requests added and aborted between steps: every
    step's kept tables equal the ones built from scratch, and every output equals the run that builds them afresh."""
    checked = []
    original = TableRows.tables

    def checking(self, spans, step):
        got = original(self, spans, step)
        _assert_rows(got, spans, self.null)
        checked.append(len(spans))
        return got

    monkeypatch.setattr(TableRows, "tables", checking)

    def run(keep: bool) -> list:
        monkeypatch.setattr(InvariantAttention, "keep_tables", keep)
        llm = LLM(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), num_blocks=28, block_size=4, max_model_len=64,
                  max_num_batched_tokens=24, speculative="ngram", check_integrity=True)
        eng = llm.engine
        rng = random.Random(3)
        outs, live, n = [], set(), 0
        for step in range(160):
            if n < 30 and rng.random() < 0.5:
                prompt = tuple(rng.choice((5, 6, 7, 8, 9, 10)) for _ in range(rng.randint(3, 30)))
                kind = n % 4
                params = (SamplingParams(num_beams=2, max_tokens=6, ignore_eos=True) if kind == 0
                          else SamplingParams(temperature=0.9, seed=n, max_tokens=rng.randint(4, 30), ignore_eos=True) if kind == 1
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
