"""Beam search over one request (HF's classic BeamSearchScorer rules). No torch.

A group of live beams, each a sequence. A step samples every live beam; the
sampler's top 2 * num_beams logprobs are its candidates, and the sampled token
itself is only provisional. Once every live beam has sampled, the group ranks
all (beam, candidate) pairs by cumulative logprob and continues the best
num_beams of them as new sequences:

    beam:   | prompt | output so far | provisional sample |   (held: `paused`, never scheduled again)
    child:  | prompt | output so far | chosen candidate   |   shares the beam's KV (scheduler.add_fork)

A beam that ends (EOS or a stop token) among the top num_beams becomes a
finished hypothesis instead. Beams are not streamed: the request's output comes
once, with the best n hypotheses.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.request import Choice, RequestState
from shoal.engine.sequence import Sequence
from shoal.types import CompletionOutput, FinishReason, SampledToken


@dataclass
class Hypothesis:
    score: float  # cumulative logprob / generated_len ** length_penalty
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason


class BeamSearch(RequestState):
    def __init__(self, request, metrics, ctx) -> None:
        super().__init__(request, metrics, ctx)
        self.live: list[Sequence] = []
        self.scores: dict[int, float] = {}  # seq_id -> cumulative logprob
        self.candidates: dict[int, list[tuple[int, float]]] = {}  # seq_id -> (token, logprob), once it has sampled
        self.hyps: list[Hypothesis] = []
        self._done = False

    def start(self, grammar) -> None:
        request, p = self.request, self.request.params
        seq = Sequence(request.request_id, list(request.prompt_token_ids), p, priority=request.priority, seed=p.seed,
                       images=request.images)
        seq.grammar = self.ctx.constraint(p, grammar)
        self.live, self.scores = [seq], {seq.seq_id: 0.0}
        self.ctx.scheduler.add(seq)

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.choices] or self.live

    @property
    def done(self) -> bool:
        return self._done

    def end(self, reason: FinishReason) -> None:
        if not self._done:
            for seq in self.live:
                self.ctx.scheduler.finish(seq, reason)
            self._done = True

    def on_sampled(self, seq: Sequence, s: SampledToken) -> None:
        # -inf: a token the grammar or a ban rules out, listed only because fewer were allowed
        self.candidates[seq.seq_id] = [(t.token_id, t.logprob) for t in s.top_logprobs if t.logprob > float("-inf")]
        seq.paused = True

    def settle(self) -> bool:
        """When every live beam has sampled, pick the next beams; an output is due once the search is done."""
        if len(self.candidates) < len(self.live):
            return False  # some beams of the group have not sampled yet
        self._step()
        return self._done

    def _add(self, hyp: Hypothesis) -> None:
        self.hyps.append(hyp)
        self.hyps.sort(key=lambda h: -h.score)
        del self.hyps[self.request.params.num_beams :]

    def _step(self) -> None:
        """Pick the next beams among the top 2*num_beams continuations of each beam."""
        p, ctx = self.request.params, self.ctx
        K = p.num_beams
        cands = sorted(
            ((self.scores[b.seq_id] + lp, b, tok) for b in self.live for tok, lp in self.candidates[b.seq_id]),
            key=lambda c: -c[0],
        )
        gen_len = self.live[0].num_output_tokens  # after this step: the provisional sample counts
        nxt = []
        for rank, (score, beam, tok) in enumerate(cands):
            is_eos = tok in ctx.eos_token_ids and not p.ignore_eos and gen_len > p.min_tokens
            if is_eos or tok in p.stop_token_ids and gen_len > p.min_tokens:
                if rank < K:  # an ending only counts if it would have been a top beam
                    hyp_len = gen_len - 1 if is_eos else gen_len  # HF scores the hypothesis without its EOS
                    self._add(Hypothesis(score / max(hyp_len, 1) ** p.length_penalty, _chosen(beam, tok), score, FinishReason.STOP))
                continue
            nxt.append((score, beam, tok))
            if len(nxt) == K:
                break
        at_limit = (p.max_tokens is not None and gen_len >= p.max_tokens) or self.live[0].num_tokens >= ctx.max_model_len
        best = nxt[0][0] if nxt else float("-inf")
        enough = len(self.hyps) >= K and (p.early_stopping or self.hyps[-1].score >= best / gen_len**p.length_penalty)
        if at_limit or enough or not nxt:
            if not enough:
                for score, beam, tok in nxt:
                    self._add(Hypothesis(score / gen_len**p.length_penalty, _chosen(beam, tok), score, FinishReason.LENGTH))
            for b in self.live:
                ctx.scheduler.finish(b, FinishReason.STOP)
            self._done = True
            self._outputs()
            return
        new_live: list[Sequence] = []
        try:
            for _, beam, tok in nxt:
                new_live.append(self._continue(beam, tok))
        except Exception:
            for b in new_live:  # the request fails: no half-made group may stay scheduled
                ctx.scheduler.finish(b, FinishReason.ERROR)
            raise
        self.scores = {b.seq_id: score for b, (score, _, _) in zip(new_live, nxt)}
        for b in self.live:
            ctx.scheduler.finish(b, FinishReason.STOP)
        self.live, self.candidates = new_live, {}
        ctx.stats.generated_tokens += len(new_live)

    def _continue(self, beam: Sequence, token_id: int) -> Sequence:
        """A new beam: `beam`'s tokens with `token_id` in place of its provisional sample, sharing its KV."""
        child = Sequence(
            request_id=beam.request_id,
            prompt_token_ids=beam.prompt_token_ids,
            params=beam.params,
            priority=beam.priority,
            arrival=beam.arrival,
            token_ids=beam.token_ids[:-1] + [token_id],
            seed=beam.seed,
            num_prompt_logprobs=beam.num_prompt_logprobs,
            images=beam.images,
        )
        if beam.grammar is not None:
            child.grammar = beam.grammar.fork()
            child.grammar.accept(token_id)
        self.ctx.scheduler.add_fork(child, beam)
        return child

    def _outputs(self) -> None:
        p = self.request.params
        for i, h in enumerate(self.hyps[: p.n]):
            text = self.ctx.tokenizer.decode(h.token_ids, skip_special_tokens=p.skip_special_tokens)
            out = CompletionOutput(index=i, text=text, token_ids=h.token_ids, finish_reason=h.finish_reason, cumulative_logprob=h.cumulative_logprob)
            self.choices.append(Choice(self.live[0], None, out, delta_token_ids=list(h.token_ids)))


def _chosen(beam: Sequence, token_id: int) -> list[int]:
    """The beam's output with `token_id` in place of its provisional sample."""
    return beam.output_token_ids[:-1] + [token_id]
