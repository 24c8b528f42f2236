"""The offline API: `LLM(model="smollm2").generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from shoal import multimodal
from shoal.chat_template import ChatRenderer
from shoal.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, auto_bytes, auto_int
from shoal.engine.builder import build_engine
from shoal.multimodal import pixel_digest
from shoal.types import GenerationRequest, RequestOutput, SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """Runs an Engine in the caller's thread until every prompt is done.

    Keyword arguments not naming an EngineConfig field go to its scheduler or
    cache config (`max_num_seqs=8`, `block_size=16`, `num_blocks=64`, ...).
    """

    def __init__(self, model: str = "smollm2", **kwargs: Any) -> None:
        self.engine = build_engine(_engine_config(model, kwargs))
        self.tokenizer = self.engine.tokenizer
        self._renderer = ChatRenderer(self.tokenizer)  # the server's rendering: the model's template, or the fallback
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other ranks, if it has any (tensor parallelism), and with a --prefix-cache-dir keep the
        cached prefixes there for the next start."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._encode(p) for p in prompts]
        return self._run(token_lists, params, priority, use_tqdm, texts=[p if isinstance(p, str) else None for p in prompts])

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them. A vision model's messages may
        hold images as content parts: {"type": "image", "image": a PIL image, "detail": optional}."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_prompt(c, chat_template_kwargs or {}) for c in conversations]
        stop = self._renderer.default_stop  # the plain fallback's: a base model must not write the user's turn
        if stop:
            plist = self._params(params, len(prompts))
            params = [replace(p, stop=p.stop + tuple(s for s in stop if s not in p.stop)) for p in plist]
        return self._run([ids for ids, _ in prompts], params, None, use_tqdm, texts=[None] * len(prompts),
                         images=[spans for _, spans in prompts])

    def _chat_prompt(self, messages: Sequence[Message], kwargs: dict) -> tuple[list[int], tuple]:
        """A conversation's token ids, with each image's tokens in place, and the images' spans."""
        images, rendered = [], []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list) and any(p.get("type") == "image" for p in content):
                if self.engine.vision is None:
                    raise ValueError("this model does not accept images")
                for p in content:
                    if p.get("type") == "image":
                        image = p["image"].convert("RGB")
                        images.append(self.engine.vision.prepare(image, pixel_digest(image), p.get("detail")))
                m = {**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in content]}
            rendered.append(m)
        ids = self.apply_chat_template(rendered, **kwargs)
        if self.engine.vision is None:
            return ids, ()
        return multimodal.expand_placeholders(ids, self.engine.vision.spec.image_token_id, images)

    def apply_chat_template(self, messages: Sequence[Message], **kwargs: Any) -> list[int]:
        return self._renderer.encode(self._renderer.render(list(messages), template_kwargs=kwargs))

    # ------------------------------------------------------------ internals
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    @staticmethod
    def _params(params, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * n
        if len(plist) != n:
            raise ValueError(f"{n} prompts but {len(plist)} SamplingParams")
        return plist

    def _run(self, token_lists, params, priority, use_tqdm, texts, images=None) -> list[RequestOutput]:
        n = len(token_lists)
        plist = self._params(params, n)
        order = []
        for i, ids in enumerate(token_lists):
            rid = f"offline-{next(self._ids)}"
            req = GenerationRequest(rid, tuple(ids), plist[i], priority=priority[i] if priority else 0, prompt=texts[i],
                                    images=images[i] if images else ())
            self.engine.add_request(req)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        bar = _progress(n) if use_tqdm else None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in order]


def apply_chat_template(tokenizer, messages: Sequence[Message], **kwargs: Any) -> list[int]:
    """Render `messages` as the server does (the model's template, or the plain fallback for a
    model without one), ready for the assistant's turn, as token ids."""
    renderer = ChatRenderer(tokenizer)
    return renderer.encode(renderer.render(list(messages), template_kwargs=kwargs))


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")


def _engine_config(model: str, kwargs: dict[str, Any]) -> EngineConfig:
    top = {k: kwargs.pop(k) for k in list(kwargs) if k in EngineConfig.__dataclass_fields__}
    if isinstance(top.get("speculative"), str):  # LLM(..., speculative="ngram")
        top["speculative"] = SpeculativeConfig(method=top["speculative"])
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.__dataclass_fields__}
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in CacheConfig.__dataclass_fields__}
    if "kv_cache_memory" in cache:  # LLM(..., kv_cache_memory="2GiB" or "auto" or bytes)
        cache["kv_cache_memory"] = auto_bytes(cache["kv_cache_memory"])
    if isinstance(top.get("max_model_len"), str):  # LLM(..., max_model_len="auto")
        top["max_model_len"] = auto_int(top["max_model_len"])
    parallel = {k: kwargs.pop(k) for k in list(kwargs) if k in ParallelConfig.__dataclass_fields__}
    if kwargs:
        raise TypeError(f"unknown LLM arguments: {', '.join(sorted(kwargs))}")
    return EngineConfig(model=model, **top, scheduler=SchedulerConfig(**sched), cache=CacheConfig(**cache),
                        parallel=ParallelConfig(**parallel))
