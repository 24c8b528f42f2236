"""Structured output: a grammar compiled once per constraint, one matcher per sequence. No torch.

Built on llguidance (docs/architecture/dependencies.md says why it and not xgrammar). The flow:

    StructuredOutput (plain data on SamplingParams)
      -> GrammarCompiler.compile: llguidance's grammar, validated against the tokenizer,
         and a template matcher that has computed its first mask. Cached by value (LRU)
         and thread-safe, so the server compiles in a worker thread before the request
         reaches the engine, and a second request with the same schema compiles nothing.
      -> CompiledGrammar.matcher(): a copy of the template per sequence (Sequence.grammar);
         `fork` copies a matcher with its state for a beam.
      -> each step, the plan carries the matcher's `mask` for every constrained row that
         samples (bit t of the little-endian bytes: token t is allowed); the sampler
         sends the rest of that row to -inf, as one more processor stage.
      -> the engine feeds each accepted token back (`accept`, which computes the next
         mask); when the grammar can take nothing more (`done`) the choice ends with
         finish reason "stop".

A matcher depends only on the tokens it has accepted, not on the KV cache, so
preemption and recompute leave it as it is.

Hostile grammars are bounded by llguidance's resource limits (`LIMITS`): a grammar
over them fails to compile (a 400 naming the problem), and the work of one mask
is capped, so a grammar that grows too complex mid-output fails its own request
(GrammarError) instead of stalling the step.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import llguidance

from shoal import json_schema
from shoal.json_schema import GrammarError
from shoal.types import StructuredOutput, ThinkingBudget

log = logging.getLogger("shoal.structured")

# The JSON layout when a request does not choose one (json_schema.py: compact or flexible). Measured on 26
# schemas (benchmarks/results/structured_finish.md): without a penalty the flexible layout finished more
# replies (81-83% against 69-76%), but with the server's default frequency penalty for JSON replies the
# compact one finishes the most (100%, 98%, 95% at temperatures 0, 0.7, 1 against 96%, 98%, 95%), in the
# fewest tokens.
DEFAULT_LAYOUT = "compact"

# llguidance's defaults, tightened: about 4 ms to build a grammar's lexer (initial fuel,
# ~50k/ms), about 7 ms of lexer work per mask (step fuel, ~14k/ms), and ~2 kB per lexer
# state. A schema or regex past them is refused ("too big"/"too many expressions").
LIMITS = dict(initial_lexer_fuel=200_000, step_lexer_fuel=100_000, max_lexer_states=50_000, verbose_errors=False)
CACHE_SIZE = 64


class GrammarMatcher:
    """One sequence's position in its grammar, with the mask of the tokens allowed next.

    The mask is computed when a token is accepted (and copied from the compiled
    grammar at the start), so a matcher that breaks fails in the engine's handling of
    its own token, never while the scheduler plans a step.
    """

    __slots__ = ("_m", "mask")

    def __init__(self, m: llguidance.LLMatcher, mask: bytes) -> None:
        self._m = m
        self.mask = mask  # bit t of the little-endian bytes: token t may come next

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token and compute the next mask; GrammarError if that fails."""
        m = self._m
        if not m.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not follow the grammar ({_message(m.get_error())})")
        self.mask = m.compute_bitmask()  # once complete: only the end tokens (a beam may still pick one)
        if m.is_error():
            raise GrammarError(_message(m.get_error()))

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._m.deep_copy(), self.mask)

    @property
    def done(self) -> bool:
        """The grammar is complete and can take no more tokens."""
        return self._m.is_stopped()


class BudgetMatcher:
    """A thinking budget as a token constraint with the interface of GrammarMatcher: no mask
    (any token) until the reasoning has run `max_tokens` tokens, then one-token masks that
    make the sequence write the end tag. It never ends the choice itself."""

    __slots__ = ("spec", "vocab_size", "inside", "count", "forcing", "finished", "recent", "mask")
    done = False

    def __init__(self, spec: ThinkingBudget, vocab_size: int) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.inside = not spec.start_ids  # reasoning from the first token
        self.count = 0
        self.forcing = -1  # index into end_ids while writing the end tag
        self.finished = False
        self.recent: list[int] = []
        self.mask: bytes | None = None
        if self.inside and spec.max_tokens == 0:
            self._force(0)

    def _force(self, i: int) -> None:
        self.forcing = i
        mask = bytearray((self.vocab_size + 31) // 32 * 4)
        token = self.spec.end_ids[i]
        mask[token // 8] |= 1 << (token % 8)
        self.mask = bytes(mask)

    def accept(self, token_id: int) -> None:
        spec = self.spec
        if self.forcing >= 0:
            if self.forcing + 1 < len(spec.end_ids):
                self._force(self.forcing + 1)
            else:
                self.forcing, self.finished, self.mask = -1, True, None
            return
        if self.finished:
            return
        self.recent = (self.recent + [token_id])[-max(len(spec.start_ids), len(spec.end_ids)) :]
        if not self.inside:
            if self.recent[-len(spec.start_ids) :] == list(spec.start_ids):
                self.inside = True
                if spec.max_tokens == 0:
                    self._force(0)
            return
        if self.recent[-len(spec.end_ids) :] == list(spec.end_ids):
            self.finished = True  # the model ended its reasoning within the budget
            return
        self.count += 1
        if self.count >= spec.max_tokens:
            self._force(0)

    def fork(self) -> BudgetMatcher:
        other = BudgetMatcher.__new__(BudgetMatcher)
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        other.recent = list(self.recent)
        return other


class CompiledGrammar:
    __slots__ = ("spec", "_template", "_first_mask")

    def __init__(self, spec: StructuredOutput, template: llguidance.LLMatcher, first_mask: bytes) -> None:
        self.spec = spec
        self._template = template  # never advanced: only copied
        self._first_mask = first_mask

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._first_mask)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; safe to call from any thread."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar | GrammarError] = OrderedDict()
        self._cache_size = cache_size
        self.compiles = 0
        self.cache_hits = 0

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's index of the vocabulary (~0.5 s for 49k tokens): built on first use."""
        with self._lock:
            if self._ll_tokenizer is None:
                start = time.perf_counter()
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos)
                log.info("structured output: indexed the vocabulary's %d tokens in %.2f s", self._vocab_size, time.perf_counter() - start)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled before.
        Raises GrammarError (also from the cache) when it cannot be compiled."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
        if hit is None:
            try:
                hit = self._compile(spec)
            except GrammarError as e:
                hit = e
            with self._lock:
                self.compiles += 1
                self._cache[spec] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        start = time.perf_counter()
        tok = self._tokenizer()
        grammar = _grammar(spec)
        limits = llguidance.LLParserLimits(**LIMITS)
        error = llguidance.LLMatcher.validate_grammar(grammar, tok, limits=limits)
        if error:
            raise GrammarError(_message(error))
        template = llguidance.LLMatcher(tok, grammar, limits=limits, log_level=0)
        # Build the lexer now, off the engine thread, and take one step on a copy: a grammar
        # whose lexer explodes (a regex like `(a{100}){100}`) fails here, not mid-output.
        mask = template.compute_bitmask()
        probe = template.deep_copy()
        first = _first_allowed(mask, set(self._eos))
        if first is not None:
            probe.consume_token(first)
            probe.compute_bitmask()
        for m in (template, probe):
            if m.is_error():
                raise GrammarError(_message(m.get_error()))
        log.info("structured output: compiled a %s constraint in %.1f ms", spec.kind, (time.perf_counter() - start) * 1e3)
        return CompiledGrammar(spec, template, mask)


def _grammar(spec: StructuredOutput) -> str:
    """llguidance's grammar text for a constraint."""
    try:
        if spec.json_schema is not None or spec.json_object:
            if spec.json_object:
                schema = json_schema.json_object_schema()
            else:
                schema = json_schema.prepare(json.loads(spec.json_schema), strict=spec.strict, extra_properties=spec.extra_properties)
            layout = json_schema.json_options(spec.layout or DEFAULT_LAYOUT, spec.whitespace_pattern)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout)
        if spec.regex is not None:
            return llguidance.grammar_from("regex", spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as e:
        raise GrammarError(_message(str(e))) from None


def _first_allowed(mask: bytes, skip: set[int]) -> int | None:
    for i, byte in enumerate(mask):
        while byte:
            bit = byte & -byte
            token = i * 8 + bit.bit_length() - 1
            if token not in skip:
                return token
            byte ^= bit
    return None


def _message(error: str) -> str:
    """llguidance's message without its debugging tail, in the words of a schema's author where it names llguidance's own options."""
    error = error.replace("<non-verbose/>", "").strip() or "the grammar could not be compiled"
    if "Unimplemented keys" in error:
        keys = error.split("Unimplemented keys:", 1)[1].split("\n")[0].strip()
        return f"the JSON schema uses keywords that structured output does not support: {keys}"
    if "oneOf constraints are not supported" in error:
        return "a oneOf whose branches may overlap is not supported (only disjoint ones are): use anyOf"
    return error
