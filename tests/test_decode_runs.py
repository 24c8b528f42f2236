"""Decode runs (engine/scheduler.py): a step of decodes alone runs several one-token forwards back to back. Each is
the forward a step of its own would run, so every token, logprob and finish is the same as a token a step, for greedy
and seeded sampling, batched, beside speculation's drafts, beams and prefix-cache hits; a run stops at a token that
ends its sequence, so it runs no forward a token a step would not; the engine sizes runs from a forward's time."""

from __future__ import annotations

import pytest
import torch

from shoal import kernels
from shoal.engine.llm import LLM
from shoal.model.layers import DecoderForCausalLM
from shoal.runner.model_runner import ModelRunner
from shoal.types import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the default model runs on shoal's native kernels")

KW = dict(num_blocks=160, block_size=4, max_model_len=200, max_num_batched_tokens=32, check_integrity=True)
CHATS = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Say hi.", "Name a colour.", "What is 2 + 2?")]


def _spy(monkeypatch, forward_ms: float = 0.0, now: list | None = None) -> dict:
    """Counts the rows of the model's forwards (a native run's too: a pick per row), the plans' longest runs, and the
    steps with runs that ran natively (ModelRunner._native_run: the whole step, or a run's rest) or a forward at a
    time. forward_ms: what each forward adds to the fake clock `now`."""
    seen = {"rows": 0, "runs": [], "native": 0, "sampler": 0, "calls": 0, "done": set()}
    forward, execute, native_run = DecoderForCausalLM.forward, ModelRunner.execute, ModelRunner._native_run

    def counted(self, input_ids, *a, **k):
        seen["rows"] += len(input_ids)
        if now is not None:
            now[0] += forward_ms / 1000
        return forward(self, input_ids, *a, **k)

    def runs(self, plan):
        seen["runs"].append(plan.run_steps)
        calls = seen["calls"]
        out = execute(self, plan)
        if plan.run_steps > 1:
            seen["native" if seen["calls"] > calls else "sampler"] += 1
        return out

    def native(self, seqs, *a):
        got = native_run(self, seqs, *a)
        seen["calls"] += 1
        seen["done"].add(a[1])  # 0: a whole step; 1: the rest of runs after the general way's first forward
        seen["rows"] += len(got)
        if now is not None and got:  # its forwards: as many as the longest run's picks
            now[0] += forward_ms / 1000 * max(sum(t.seq_id == s.seq_id for t in got) for s in seqs)
        return got

    monkeypatch.setattr(DecoderForCausalLM, "forward", counted)
    monkeypatch.setattr(ModelRunner, "execute", runs)
    monkeypatch.setattr(ModelRunner, "_native_run", native)
    return seen


def _answers(outs) -> list:
    return [[(c.token_ids, [(lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for lp in c.logprobs or []],
              c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outs]


def _workload(llm: LLM) -> list:
    """Chats that end on the model's own end token, alone and four at once, with logprobs and without; a seeded sampled
    pair (n=2) with logprobs; a stop token id and a stop string; uneven max_tokens; the same prompts again (prefix-cache
    hits); beams beside a greedy chat; greedy chats beside one with a penalty (no runs for it)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    outs = [llm.chat(CHATS[0], greedy)[0]]
    outs += llm.chat(CHATS, [greedy, SamplingParams(temperature=0.0, max_tokens=5), greedy,
                             SamplingParams(temperature=0.9, top_k=40, seed=11, n=2, max_tokens=23, logprobs=1)])
    tokens = outs[0].outputs[0].token_ids
    outs += llm.chat(CHATS[:2], [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[tokens[3]]),
                                 SamplingParams(temperature=0.0, max_tokens=40, stop=[outs[2].outputs[0].text[4:9]])])
    outs += llm.chat(CHATS[2:], SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True))
    plain = SamplingParams(temperature=0.0, max_tokens=50)  # greedy rows the native run takes, ending apart
    outs += llm.chat(CHATS, plain)
    outs += llm.chat(CHATS, [plain, plain, SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3), plain])
    # a row that leaves a native run before one with bans (ignore_eos), whose bans move up a row
    outs += llm.chat(CHATS[:2], [SamplingParams(temperature=0.0, max_tokens=3), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)])
    outs += llm.chat(CHATS[:2], [SamplingParams(num_beams=2, n=2, max_tokens=6), greedy])
    return _answers(outs)


def test_decode_runs_give_a_token_a_steps_tokens_logprobs_and_finishes(monkeypatch, default_gguf_path):
    seen = _spy(monkeypatch)
    for speculative in ("off", "ngram"):
        seen["runs"].clear()
        with LLM(str(default_gguf_path), speculative=speculative, decode_run_ms=0, **KW) as llm:
            ref = _workload(llm)
        assert set(seen["runs"]) == {1}
        seen.update(runs=[], native=0, sampler=0, done=set())
        with LLM(str(default_gguf_path), speculative=speculative, decode_run_ms=15, **KW) as llm:
            llm.engine.timer = lambda: 0.0  # forwards that take no time: runs of the most, however busy the machine
            got = _workload(llm)
            assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # every block held by a run came back
        assert max(seen["runs"]) == 8 and seen["native"] > 4 and seen["sampler"] > 4 and seen["done"] == {0, 1}  # every way
        assert got == ref
        reasons = {c[2].value for o in ref for c in o}
        assert {"stop", "length"} <= reasons  # ends of every kind were in the workload


def test_a_run_stops_where_its_sequence_ends_so_it_computes_no_more_rows(monkeypatch, default_gguf_path):
    seen = _spy(monkeypatch)
    counts = []
    for ms in (0, 15):
        seen["rows"] = 0
        with LLM(str(default_gguf_path), speculative="off", decode_run_ms=ms, **KW) as llm:
            llm.engine.timer = lambda: 0.0
            outs = llm.chat(CHATS, [SamplingParams(temperature=0.0, max_tokens=60),
                                    SamplingParams(temperature=0.0, max_tokens=7),
                                    SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[30]),
                                    SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)])
        counts.append((seen["rows"], [o.outputs[0].finish_reason for o in outs]))
    assert counts[0][1][0].value == "stop" and counts[0][1][1].value == "length"
    assert counts[0][0] > 4 * 20  # the prompts' rows and every decode's
    assert counts[1] == counts[0]  # an end token, a stop id, max_tokens: each run ended with its sequence


def test_a_raised_flag_ends_a_native_run_before_its_next_forward(monkeypatch, default_gguf_path):
    """The native run reads the runner's flag (ModelRunner.interrupt_run) before each forward: raised as a run starts,
    it computes only the step's own forward (or nothing, for a run's rest), the steps after it make the tokens, and
    they are a token a step's."""
    params = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3)]  # no runs: the others' rest alone
    with LLM(str(default_gguf_path), speculative="off", decode_run_ms=0, **KW) as llm:
        ref = _answers(llm.chat(CHATS[:3], params))
    native_run, rests = ModelRunner._native_run, []

    def interrupted(self, seqs, tokens, done, tables):
        self.interrupt_run(True)  # (another thread does this in the server: an arrival)
        try:
            got = native_run(self, seqs, tokens, done, tables)
        finally:
            self.interrupt_run(False)
        rests.append((done, len(seqs), len(got)))
        return got

    monkeypatch.setattr(ModelRunner, "_native_run", interrupted)
    with LLM(str(default_gguf_path), speculative="off", decode_run_ms=15, **KW) as llm:
        llm.engine.timer = lambda: 0.0
        got = _answers(llm.chat(CHATS[:3], params))
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    # native runs, each stopped before its first forward but a step's own (done 0: one pick a sequence)
    assert {done for done, _, _ in rests} == {0, 1} and all(picks == (rows if done == 0 else 0) for done, rows, picks in rests)
    assert got == ref


def test_the_native_run_refuses_inputs_outside_its_tables(default_gguf_path):
    """DecoderPlan.greedy_run checks what it reads before it reads it: a negative position, one past the sequence's
    block table, stop ends that fall or pass the stop ids, a ban outside the rows' logits, a tensor of another type.
    A good call computes the asked forwards."""
    with LLM(str(default_gguf_path), speculative="off", **KW) as llm:
        runner = llm.engine.runner
        forward, head = runner.model.model.native_forward, runner.greedy_head
        tables = torch.tensor([[0, 1], [2, runner.num_blocks]], dtype=torch.int32)  # the second: one block, then null

        def run(positions=(0, 1), steps=(2, 2), ids=(5, 6), stop_ends=(0, 0), bans=None, stop_ids=(), flag=None):
            return forward.greedy_run(torch.tensor(ids), torch.tensor(positions), list(steps), tables, runner.attention, head,
                                      bans, list(stop_ids), list(stop_ends), torch.zeros(1, dtype=torch.int32) if flag is None else flag, 1)

        rows, tokens, logprobs = run()
        assert rows == [0, 1, 0, 1] and len(tokens) == len(logprobs) == 4
        bad = [(dict(positions=(-1, 1)), "negative positions"),
               (dict(positions=(0, 3)), "a position past its sequence's block table"),  # its second forward, at 4: past its block
               (dict(stop_ends=(1, 0), stop_ids=(7,)), "stop ends, rising"),
               (dict(stop_ends=(0, 2), stop_ids=(7,)), "stop ends, rising"),
               (dict(bans=torch.tensor([2 * head[1]])), "a ban outside the run's logits"),
               (dict(flag=torch.zeros(1)), "interrupt flag, int32"),
               (dict(steps=(1,)), "one of each a sequence")]
        for kwargs, message in bad:
            with pytest.raises(RuntimeError, match=message):
                run(**kwargs)


def test_runs_are_as_long_as_fit_in_decode_run_ms(monkeypatch, default_gguf_path):
    """The engine times a step of decodes alone (its `timer`, real time, not its clock) and gives the next step as
    many forwards as fit in decode_run_ms: 4 ms forwards and 15 ms make runs of 3."""
    now = [0.0]
    seen = _spy(monkeypatch, forward_ms=4, now=now)
    with LLM(str(default_gguf_path), speculative="off", decode_run_ms=15, **KW) as llm:
        llm.engine.timer = lambda: now[0]
        out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 20
    # the prompt, a first decode (no time known yet), then runs of 3: 18 tokens in 6 runs
    assert seen["runs"] == [1, 1, 3, 3, 3, 3, 3, 3]


def test_the_flag_reaches_the_scheduler_config_and_bad_values_are_refused():
    from shoal import cli  # noqa: PLC0415
    from shoal.config import SchedulerConfig  # noqa: PLC0415

    parse = cli.build_parser().parse_args
    assert cli.engine_config(cli.serve_values(parse(["serve"]))).scheduler.decode_run_ms == 25.0
    assert cli.engine_config(cli.serve_values(parse(["serve", "--decode-run-ms", "0"]))).scheduler.decode_run_ms == 0.0
    with pytest.raises(ValueError, match=r"decode_run_ms must be in \[0, 1000\] milliseconds, got -1"):
        SchedulerConfig(decode_run_ms=-1)


def test_runs_over_two_kv_groups_give_a_token_a_steps_tokens(monkeypatch, tmp_path):
    """A tiny Gemma 3 in int8 (local layers of an 8-token window beside global ones: two KV groups, the windowed one
    freeing blocks as the window passes them) decodes past several windows with runs of the most, greedy and seeded,
    in a batch, under the integrity check: the tokens and logprobs of a token a step, and every block back."""
    from tiny_models import make_tiny_model  # noqa: PLC0415

    path = str(make_tiny_model("gemma3", tmp_path / "gemma3"))
    prompts = [[(5 * i + 3 * j) % 390 + 5 for i in range(n)] for j, n in enumerate((3, 21, 9))]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=37, ignore_eos=True)]
    seen = _spy(monkeypatch)
    answers = []
    for ms in (0, 15):
        # int8: shoal's row-invariant kernels (float weights' GEMMs differ in the last bits between batch shapes)
        with LLM(path, dtype="float32", quantization="int8", num_blocks=96, block_size=4, max_model_len=128, check_integrity=True) as llm:
            assert len(llm.engine.runner.kv_groups) == 2
            llm.engine.timer = lambda: 0.0
            llm.engine._run_budget = ms / 1000
            answers.append(_answers(llm.generate(prompts, params)))
            assert all(p.num_free == p.num_blocks for p in llm.engine.kv.pools)
    assert max(seen["runs"]) == 8 and seen["sampler"] > 0
    assert answers[1] == answers[0]


def test_a_gemma_gguf_in_one_kv_group_runs_natively_over_its_two_windows(monkeypatch, tmp_path):
    """A Gemma 3 GGUF in Q8_0 (local layers of an 8-token window beside global ones) with its KV in one group, as a
    draft model's pool keeps it (kv_groups off): every layer reads the one group's tables, whatever its window, so a
    native run gives a token a step's tokens and logprobs, greedy, with ignore_eos's bans, past several windows."""
    import gguf  # noqa: PLC0415
    from test_families import write_family_gguf  # noqa: PLC0415
    from tiny_models import make_tiny_model  # noqa: PLC0415

    folder = make_tiny_model("gemma3", tmp_path / "hf")
    path = str(tmp_path / "gemma3.gguf")
    write_family_gguf(folder, path, "gemma3", quantize=gguf.GGMLQuantizationType.Q8_0)
    prompts = [[(5 * i + 3 * j) % 390 + 5 for i in range(n)] for j, n in enumerate((3, 21, 9))]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=33),
              SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True)]
    seen = _spy(monkeypatch)
    answers = []
    for ms in (0, 15):
        with LLM(path, dtype="float32", kv_groups=False, num_blocks=96, block_size=4, max_model_len=128, check_integrity=True) as llm:
            assert len(llm.engine.runner.kv_groups) == 1 and len(llm.engine.runner.model.model.native_forward.windows) == 2
            llm.engine.timer = lambda: 0.0
            llm.engine._run_budget = ms / 1000
            answers.append(_answers(llm.generate(prompts, params)))
    assert seen["native"] > 3 and max(seen["runs"]) == 8
    assert answers[1] == answers[0]


@pytest.mark.parametrize("quantization,dtype", [("int8", "auto"), ("int4", "auto"), ("int8", "bfloat16")])
def test_a_float_embedding_table_runs_natively(monkeypatch, tiny_llama_path, quantization, dtype):
    """A safetensors model on shoal's int8 or int4 kernels keeps its float embedding table: the plan looks up its rows
    too (forward_ids), so its runs go in one native call, with a token a step's tokens and logprobs, in the dtype a
    user gets by default (`auto`: float32 for shoal's low-bit codes) and with a bfloat16 table and activations."""
    prompts = [[(7 * i + j) % 300 + 3 for i in range(n)] for j, n in enumerate((4, 13, 7))]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=21), SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True)]
    seen = _spy(monkeypatch)
    answers = []
    for ms in (0, 15):
        with LLM(tiny_llama_path, dtype=dtype, quantization=quantization, speculative="off", num_blocks=96, block_size=4,
                 max_model_len=128, check_integrity=True) as llm:
            forward = llm.engine.runner.model.model.native_forward
            assert forward.ids and type(llm.engine.runner.model.model.embed_tokens) is torch.nn.Embedding
            llm.engine.timer = lambda: 0.0
            llm.engine._run_budget = ms / 1000
            answers.append(_answers(llm.generate(prompts, params)))
    assert seen["native"] > 3 and max(seen["runs"]) == 8
    assert answers[1] == answers[0]


def test_a_run_cut_short_sizes_the_next_by_the_forwards_it_ran():
    """The engine sizes runs by a forward's time: a step's time over the most tokens one sequence got (a run that an
    arrival or the sequences' ends cut short ran fewer forwards than planned)."""
    from shoal.engine.engine import Engine  # noqa: PLC0415
    from shoal.types import SampledToken  # noqa: PLC0415

    engine = Engine.__new__(Engine)  # (only what _size_runs reads)
    engine._run_budget = 0.025
    picks = [SampledToken(1, 5, -0.1), SampledToken(2, 6, -0.2), SampledToken(1, 7, -0.3)]
    engine._size_runs(0.010, picks)  # two forwards of 5 ms: runs of 5
    assert engine._run_steps == 5 and engine._decode_time is None
    engine._size_runs(0.010, picks[:1])  # one forward of 10 ms
    assert engine._run_steps == 2
    engine._size_runs(0.001, picks)  # forwards of 0.5 ms: the most, 8
    assert engine._run_steps == 8
    engine._size_runs(0.030, picks[:1])  # past the budget: none
    assert engine._run_steps == 1


@pytest.mark.parametrize("model", ["tiny_llama_path", "default_gguf_path"])
def test_an_arrival_ends_a_run_after_its_current_forward(model, request):
    """In the server, a request that arrives while a run is under way waits for the forward in progress, not for the
    run: the engine is held at the start of a run of 8 while a second request comes in, and the run then stops after
    one forward; the next step takes the arrival in. A run cut short gives its other blocks back. The tiny Llama's
    runs go a forward at a time (float weights: no native forward), the default model's in one native call, whose
    loop reads the flag the server's thread raised."""
    import threading  # noqa: PLC0415

    from server_utils import Gate, LiveServer, tiny_engine  # noqa: PLC0415
    from shoal.server import ServerSettings  # noqa: PLC0415

    engine = tiny_engine(request.getfixturevalue(model), decode_run_ms=25, check_integrity=True)
    engine.timer = lambda: 0.0  # runs of the most
    runner, steps = engine.runner, []
    forward, execute, native_run = runner.forward, runner.execute, runner._native_run

    def counted(*a, **k):
        steps[-1][1] += 1
        return forward(*a, **k)

    def native(seqs, *a):
        got = native_run(seqs, *a)
        steps[-1][1] += max((sum(t.seq_id == s.seq_id for t in got) for s in seqs), default=0)  # its forwards
        steps[-1][3] += 1
        return got

    def recorded(plan):
        steps.append([plan.run_steps, 0, len(plan.seqs), 0])
        return execute(plan)

    runner.forward, runner.execute, runner._native_run = counted, recorded, native
    with LiveServer(engine, ServerSettings(log_requests=False)) as srv:
        with Gate(engine, when=lambda: len(steps) >= 3 and steps[-1][0] == 8) as gate, srv.http() as h:
            a = {"prompt": "A", "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
            with h.stream("POST", "/v1/completions", json=a) as stream_a:
                lines = stream_a.iter_lines()
                next(ln for ln in lines if ln.startswith("data: "))
                assert gate.blocked.wait(30)  # held at the start of a run of 8
                held = len(steps)  # (the step the gate holds is recorded after it: see `recorded`)
                b = threading.Thread(target=lambda: srv.http().post("/v1/completions", json={"prompt": "B", "max_tokens": 2}))
                b.start()
                srv.wait_until(lambda: srv.state.engine.num_waiting >= 1, what="the arrival in the inbox")
                gate.open()
                b.join(30)
        srv.wait_until(lambda: engine.num_running == 0 and engine.pool.num_free == engine.pool.num_blocks, what="the blocks")
    assert steps[held][:2] == [8, 1]  # the held run stopped after its first forward
    assert steps[held][3] == (model == "default_gguf_path")  # in the native loop, for the default model
    assert steps[held + 1][2] == 2  # and the next step took the arrival in beside the stream
