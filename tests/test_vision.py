"""Vision-language models: Qwen2-VL and Qwen2.5-VL against transformers, and images through the engine's caches.

Tiny random-weight models of the real architectures (tests/tiny_models.py: a two-block ViT, the 2x2 merger,
a two-layer Qwen2 decoder with M-RoPE) go through shoal's loader, runner and engine:
- the logits equal transformers' `...ForConditionalGeneration` on the same weights and image, in float32, with
  prefill chunks that cut through an image and a text-only sequence in the same step;
- the prompt and pixels equal transformers' processor's (Qwen2VLProcessor), at each `detail`;
- the M-RoPE positions equal transformers' get_rope_index, chunk by chunk;
- in the default dtype the greedy tokens are the same alone, in a batch, in chunks and after a prefix-cache
  hit, and the vision tower runs once per distinct image (its counters prove it);
- a different image misses the prefix cache from its first token; the same pixels in another encoding hit.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from shoal import LLM, SamplingParams
from shoal.config import CacheConfig, EngineConfig
from shoal.multimodal import ImageSpan, expand_placeholders, mrope_positions
from shoal.runner.build import build_part
from shoal.runner.model_runner import forward_batch
from shoal.multimodal import pixel_digest
from shoal.types import ScheduledSeq, StepPlan
from tiny_models import VL_ARCHS, make_tiny_vl_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def picture(w: int, h: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB picture with structure (so resizing and patching matter)."""
    rng = np.random.default_rng(seed)
    base = np.add.outer(np.arange(h), np.arange(w))[..., None] * np.array([3, 5, 7]) % 256
    return Image.fromarray((base + rng.integers(0, 40, (h, w, 3))).clip(0, 255).astype("uint8"))


def reencoded(image: Image.Image, fmt: str) -> Image.Image:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return Image.open(io.BytesIO(buf.getvalue()))


@pytest.fixture(scope="module", params=sorted(VL_ARCHS))
def family(request, tmp_path_factory):
    path = make_tiny_vl_model(request.param, tmp_path_factory.mktemp(request.param))
    cls = getattr(transformers, VL_ARCHS[request.param][1])
    return request.param, path, cls.from_pretrained(path, dtype=torch.float32).eval()


def chat_ids(tokenizer, parts) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


USER = [{"type": "text", "text": "What is in "}, {"type": "image"}, {"type": "text", "text": " and in "}, {"type": "image"},
        {"type": "text", "text": "?"}]


def test_logits_match_transformers_with_images_split_across_chunks(family):
    name, path, hf = family
    part = build_part(EngineConfig(model=str(path), dtype="float32", max_model_len=256, cache=CacheConfig(num_blocks=64, block_size=4)))
    runner, ckpt = part.runner, part.checkpoint
    prep = ckpt.image_preparer
    images = [prep.prepare(im, pixel_digest(im)) for im in (picture(150, 100, 1), picture(60, 90, 2))]
    ids, spans = expand_placeholders(chat_ids(ckpt.tokenizer, USER), prep.spec.image_token_id, images)
    text = [5, 17, 99, 23, 8, 200, 150, 3, 44]
    n = len(ids)
    table = tuple(range(-(-n // 4) + 1))
    other = tuple(range(40, 43))
    got, other_logits = [], None
    with torch.inference_mode():
        for start in range(0, n, 7):  # chunks of 7 cut through both images
            seqs = [ScheduledSeq(1, tuple(ids[start : start + 7]), start, table, False, GREEDY, images=spans)]
            if start == 7:  # a text-only sequence in the same step
                seqs.append(ScheduledSeq(2, tuple(text), 0, other, False, GREEDY))
            batch, _ = forward_batch(StepPlan(tuple(seqs)))
            logits = runner.model.compute_logits(runner.forward(batch))
            got.append(logits[: len(seqs[0].token_ids)])
            if start == 7:
                other_logits = logits[len(seqs[0].token_ids) :]
        ref = hf(input_ids=torch.tensor([ids]), **hf_image_inputs(name, images, ids, prep.spec.image_token_id)).logits[0]
        ref_text = hf(input_ids=torch.tensor([text])).logits[0]
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(other_logits, ref_text, atol=1e-4, rtol=0)
    # Each image (each of an Idefics3 image's tiles) went through the tower once, whatever the chunks that held it.
    stats = runner.encoder.stats
    assert stats.images_encoded == len(spans) and stats.cache_hits >= 1
    assert len(spans) == (2 if name.startswith("qwen") else 10)  # Idefics3: 2 x 2 tiles and a global view an image


def hf_image_inputs(name: str, images, ids, token: int) -> dict:
    """What transformers' model takes for these images besides input_ids, as its processor would give it."""
    tiles = [t for im in images for t in (im.tiles if hasattr(im, "tiles") else im)]  # PreparedImages, or spans
    if name.startswith("qwen"):
        return {"pixel_values": torch.cat([t.pixels["pixel_values"] for t in tiles]),
                "image_grid_thw": torch.cat([t.pixels["image_grid_thw"] for t in tiles]),
                "mm_token_type_ids": torch.tensor([[int(t == token) for t in ids]])}
    return {"pixel_values": torch.cat([t.pixels["pixel_values"] for t in tiles], dim=1),
            "pixel_attention_mask": torch.cat([t.pixels["pixel_attention_mask"] for t in tiles], dim=1)}


def test_mrope_positions_equal_transformers_rope_index_in_any_chunking(family):
    name, path, hf = family
    if not name.startswith("qwen"):
        return  # Idefics3's positions are the tokens' indices, as text's
    tower_grids = [(1, 8, 10), (1, 6, 4)]  # before the 2x2 merge
    images = [ImageSpan(3, 20, b"a", (1, 4, 5)), ImageSpan(30, 6, b"b", (1, 3, 2))]
    ids = [7] * 40
    for s in images:
        ids[s.offset : s.end] = [hf.config.image_token_id] * s.length
    mm = torch.tensor([[int(t == hf.config.image_token_id) for t in ids]])
    ref, delta = hf.model.get_rope_index(torch.tensor([ids]), mm, image_grid_thw=torch.tensor(tower_grids))
    for chunk in (1, 5, 40):
        rows = [[], [], []]
        for start in range(0, 40, chunk):
            for row, part in zip(rows, mrope_positions(tuple(images), start, min(start + chunk, 40))):
                row.extend(part)
        assert torch.equal(torch.tensor(rows), ref[:, 0]), chunk
    # Past the prompt (outputs): the index plus the images' shift, transformers' rope delta.
    assert mrope_positions(tuple(images), 45, 46) == ([45 + int(delta)],) * 3


@pytest.mark.parametrize("detail", [None, "low"])
def test_prompt_and_pixels_equal_transformers_processor(family, detail, tmp_path):
    name, path, _ = family
    from shoal.model.loader import load_checkpoint

    ckpt = load_checkpoint(str(path), progress=False)
    prep = ckpt.image_preparer
    image = picture(700, 500, 3)  # over the tiny max_pixels: resized down
    if name in ("idefics3", "smolvlm"):
        return check_idefics3_processor(ckpt, prep, image, detail)
    if detail == "low":  # low detail caps the pixels lower than the model's own maximum
        prep = type(prep)(prep.processor, prep.spec)
        prep.max_pixels = 28 * 28 * 1024  # so that low (448 x 448) is below it
    ours = prep.prepare(image, pixel_digest(image), detail)
    size = prep._size(detail)
    # The model's image processor, loaded as transformers loads it, and its prompt expansion as
    # Qwen2VLProcessor does it (on the text: the pad token repeated grid.prod() // merge**2 times).
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    ref = processor(images=[image], return_tensors="pt", size=size)
    assert torch.equal(ours.tiles[0].pixels["pixel_values"], ref["pixel_values"])
    assert torch.equal(ours.tiles[0].pixels["image_grid_thw"], ref["image_grid_thw"])
    count = int(ref["image_grid_thw"].prod()) // processor.merge_size**2
    text = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": USER[:2]}], tokenize=False, add_generation_prompt=True)
    expected = ckpt.tokenizer.encode(text.replace("<|image_pad|>", "<|image_pad|>" * count), add_special_tokens=False)
    ids, spans = expand_placeholders(chat_ids(ckpt.tokenizer, USER[:2]), prep.spec.image_token_id, [ours])
    assert ids == expected
    assert spans[0].length == ours.length == count
    if detail == "low":
        assert ours.length < prep.prepare(image, pixel_digest(image), "high").length


def check_idefics3_processor(ckpt, prep, image, detail):
    """Idefics3Processor itself (the image processor and the tokenizer, as transformers loads them) against ours:
    the prompt's ids with each tile's markers and tokens, and every tile's pixels and mask."""
    processor = transformers.Idefics3Processor(image_processor=prep.processor, tokenizer=ckpt.tokenizer, image_seq_len=prep.image_seq_len)
    # (SmolVLMProcessor writes the same prompt, but wants a video processor, which needs torchvision)
    text = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": USER[:2]}], tokenize=False, add_generation_prompt=True)
    ref = processor(text=[text], images=[[image]], return_tensors="pt", do_image_splitting=detail != "low")
    ours = prep.prepare(image, pixel_digest(image), detail)
    ids, spans = expand_placeholders(chat_ids(ckpt.tokenizer, USER[:2]), prep.spec.image_token_id, [ours])
    assert ids == ref["input_ids"][0].tolist()
    assert torch.equal(torch.cat([t.pixels["pixel_values"] for t in ours.tiles], dim=1), ref["pixel_values"])
    assert torch.equal(torch.cat([t.pixels["pixel_attention_mask"] for t in ours.tiles], dim=1), ref["pixel_attention_mask"])
    assert len(spans) == (1 if detail == "low" else 5) and all(ids[s.offset : s.end] == [prep.spec.image_token_id] * 4 for s in spans)
    assert len({s.digest for s in spans}) == len(spans)  # each tile its own key


def vision_llm(path, **kw) -> LLM:
    """The default dtype (bfloat16 where the CPU has it), with the batch-invariant attention."""
    return LLM(str(path), attention="invariant", max_model_len=256, num_blocks=96, block_size=4, **kw)


ASK = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def conversation(image, question: str = "what is it?", system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


SYSTEM = "You look at pictures and say what is in them, in one short line."


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3"])
def vl_model(request, tmp_path_factory):
    """A tiny vision model of each kind of prompt layout: one run per image (Qwen2-VL, with M-RoPE), or a run per
    tile between marker tokens (Idefics3, whose template takes content as parts only)."""
    return make_tiny_vl_model(request.param, tmp_path_factory.mktemp(f"{request.param}_engine"))


def test_greedy_tokens_are_the_same_alone_batched_chunked_and_after_a_cache_hit(vl_model):
    chats = [conversation(picture(150, 100, i), f"question {i}") for i in range(3)]
    alone = [vision_llm(vl_model, enable_prefix_cache=False).chat(c, ASK)[0].outputs[0].token_ids for c in chats]
    batched = vision_llm(vl_model, max_num_batched_tokens=13).chat(chats, ASK)  # small chunks, all at once
    assert [o.outputs[0].token_ids for o in batched] == alone
    llm = vision_llm(vl_model)
    llm.chat(chats[0], ASK)
    again = llm.chat(chats[0], ASK)[0]
    _, spans = llm._chat_prompt(chats[0], {})
    assert again.num_cached_tokens >= spans[-1].end - 4  # the image's blocks came from the prefix cache
    assert again.outputs[0].token_ids == alone[0]
    assert llm.engine.runner.encoder.stats.images_encoded == len(spans)  # and the tower did not run again


def test_the_prefix_cache_keys_images_by_their_pixels(vl_model):
    llm = vision_llm(vl_model)
    first = picture(150, 100, 7)
    llm.chat(conversation(first, system=SYSTEM), ASK)
    prompt_ids, spans = llm._chat_prompt(conversation(first, system=SYSTEM), {})
    # Another picture of the same size: the same token ids, but a miss from its first placeholder on; the text
    # before it (the system prompt's whole blocks) is shared as usual.
    other = llm.chat(conversation(picture(150, 100, 8), system=SYSTEM), ASK)[0]
    assert llm._chat_prompt(conversation(picture(150, 100, 8), system=SYSTEM), {})[0] == prompt_ids
    assert spans[0].offset // 4 * 4 - 4 <= other.num_cached_tokens <= spans[0].offset
    assert other.num_cached_tokens >= 8
    # The same pixels sent as PNG and as lossless WebP: a hit, and the tower does not run for them.
    runs = llm.engine.runner.encoder.stats.images_encoded
    for fmt in ("PNG", "WEBP"):
        hit = llm.chat(conversation(reencoded(first, fmt), system=SYSTEM), ASK)[0]
        assert hit.num_cached_tokens >= spans[-1].end - 4  # every full block of the image came from the cache
    assert llm.engine.runner.encoder.stats.images_encoded == runs


def test_a_second_turn_reuses_the_image_kv_and_does_not_encode_again(vl_model):
    llm = vision_llm(vl_model)
    turn1 = conversation(picture(150, 100, 11))
    reply = llm.chat(turn1, ASK)[0].outputs[0].text
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    out = llm.chat(turn2, ASK)[0]
    _, spans = llm._chat_prompt(turn2, {})
    assert out.num_cached_tokens >= spans[-1].end  # the whole image, and the text after it
    assert llm.engine.runner.encoder.stats.images_encoded == len(spans)


def test_text_alone_on_a_vision_model_is_its_decoder_exactly(family):
    name, path, hf = family
    llm = LLM(str(path), dtype="float32", attention="invariant", max_model_len=256, num_blocks=96, block_size=4)
    prompt = [5, 17, 99, 23, 8, 200, 150, 3]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(6):  # transformers' forward over the whole text each time (its generate's cache is not tested here)
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
            logits[list(llm.engine.eos_token_ids)] = float("-inf")  # ignore_eos bans them, as min_new_tokens does
            ids.append(int(logits.argmax()))
    assert out == ids[len(prompt) :]


def test_placeholders_without_images_and_images_on_a_text_model_are_refused(vl_model, tmp_path):
    llm = vision_llm(vl_model)
    pad = llm.engine.vision.spec.image_token_id
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate([[5, pad, pad, 7]], ASK)
    from tiny_models import make_tiny_model

    text_only = LLM(str(make_tiny_model("qwen2", tmp_path / "q")), num_blocks=32)
    with pytest.raises(ValueError, match="does not accept images"):
        text_only.chat(conversation(picture(40, 40)), ASK)


def test_the_encoder_cache_encodes_a_digest_once_across_threads_and_evicts_least_recent_first():
    import threading
    import time as _time

    from shoal.runner.encoder_cache import EncoderCache

    calls = []

    def tower(pixels):
        calls.append(pixels["n"])
        _time.sleep(0.05)
        return torch.full((4, 8), float(pixels["n"]))  # 128 bytes

    cache = EncoderCache(tower, capacity_bytes=256)  # two images' rows
    span = lambda n: ImageSpan(0, 4, bytes([n]) * 32, (1, 2, 2), {"n": n})  # noqa: E731
    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.embeddings(span(1)))) for _ in range(3)]
    threads.append(threading.Thread(target=cache.warm, args=(span(1),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and len(got) == 3 and all(torch.equal(g, got[0]) for g in got)
    cache.embeddings(span(2))
    cache.embeddings(span(1))  # 1 is now the most recent
    cache.embeddings(span(3))  # over the budget: 2, the least recent, goes
    assert list(cache.entries) == [bytes([1]) * 32, bytes([3]) * 32] and calls == [1, 2, 3]
    assert cache.stats.images_encoded == 3 and cache.stats.cached_bytes == 256
    cache.embeddings(span(2))
    assert calls == [1, 2, 3, 2]  # evicted, so encoded again


def test_the_tower_counts_in_the_model_memory(vl_model):
    llm = vision_llm(vl_model)
    runner = llm.engine.runner
    decoder = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    tower = runner.encoder.tower.weight_bytes
    assert tower > 0 and llm.engine.facts.weight_bytes >= decoder + tower


def test_greedy_tokens_in_the_default_dtype_track_transformers(family):
    """In the dtype users run (bfloat16 where the CPU has it; float32 elsewhere), with the default attention: the
    greedy tokens of image chats are transformers' in the same dtype on the same weights and pixels, up to a first
    difference that must be a near tie: each side's token in the other's top 5 (vLLM's check_logprobs_close rule),
    and within 0.02 of transformers' best logit. A tiny random model's logits are flat (the largest is about 0.5
    and bfloat16 moves them by about 0.003 on either side), so near ties are common and exact runs are luck;
    a wrong image or position would move the logits by far more. transformers' choices are read teacher-forced
    along ours, in one forward."""
    name, path, hf = family
    llm = LLM(str(path), max_model_len=256, num_blocks=128, block_size=4)
    # loaded in the dtype, as transformers serves it (a cast model would round its rotary frequencies too)
    hf_dtype = type(hf).from_pretrained(path, dtype=llm.engine.runner.dtype).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    for seed in range(4):
        chat = conversation(picture(120 + 10 * seed, 90, 40 + seed), f"what is shown, {seed}?")
        ids, spans = llm._chat_prompt(chat, {})
        ours = llm.chat(chat, greedy)[0].outputs[0]
        with torch.inference_mode():
            inputs = hf_image_inputs(name, [spans], ids, llm.engine.vision.spec.image_token_id)
            if "mm_token_type_ids" in inputs:  # generated tokens are text, whatever their ids
                inputs["mm_token_type_ids"] = torch.cat((inputs["mm_token_type_ids"], torch.zeros(1, len(ours.token_ids), dtype=torch.long)), 1)
            logits = hf_dtype(input_ids=torch.tensor([ids + ours.token_ids]), **inputs).logits[0, len(ids) - 1 : -1].float()
            logits[:, list(llm.engine.eos_token_ids)] = float("-inf")  # ignore_eos bans them
        ref, ref_top5 = logits.argmax(-1).tolist(), logits.topk(5).indices.tolist()
        if ref == ours.token_ids:
            continue
        i = next(k for k, (a, b) in enumerate(zip(ours.token_ids, ref)) if a != b)
        assert ours.token_ids[i] in ref_top5[i] and ref[i] in [t.token_id for t in ours.logprobs[i].top], (name, seed, i)
        assert logits[i, ref[i]] - logits[i, ours.token_ids[i]] <= 0.02, (name, seed, i)
