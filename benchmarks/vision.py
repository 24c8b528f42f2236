"""Images: the vision tower's time per image, a second turn about the same image, mixed traffic, and transformers.

    .venv/bin/python benchmarks/vision.py [--model FOLDER] [--rounds 3]

No vision checkpoint can be downloaded here, so by default the model is a random-weight Qwen2-VL built in a temp
folder at a small but real shape: a 4-block ViT (embed 256, 4 heads) with the 2x2 merger, before a 4-layer Qwen2
decoder (hidden 512, 8 heads over 2 KV heads) with M-RoPE; images up to 448 x 448 pixels (256 tokens). `--model`
takes a real Qwen2-VL or SmolVLM folder where one is present. Weights are random, so the replies are noise: what is
measured is the work.

    encoder          the tower on one image (224, 336 and 448 pixels a side): shoal's call (transformers' module
                     through shoal's runner) against transformers' `model.visual` on the same pixels
    second-turn      TTFT of a first turn about an image, of a second turn about the same image (its KV and its
                     embeddings from the caches), and of a first turn about a new image with a text-only history
    mixed            output tok/s of 16 requests (32 tokens each, all at once): text only, and half of them with
                     an image each (distinct images)
    transformers     one image request, 32 greedy tokens: shoal's time against transformers' generate, the same
                     tokens (float32)

shoal runs in-process (LLM), in its default dtype for the rows that do not compare with transformers. Each figure
is the median of --rounds. Writes benchmarks/results/vision-KIND.{md,json} (KIND: publish.cpu_kind, or avx2 when run
with SHOAL_CPU_ISA=avx2, the path an AVX2-only CPU takes: float32 by default there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from publish import cpu_kind, machine, machine_line, publish, table  # noqa: E402
from tiny_models import make_tiny_vl_model  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.multimodal import pixel_digest  # noqa: E402

TEXT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})
VISION = dict(depth=4, embed_dim=256, num_heads=4, mlp_ratio=4, hidden_size=512)
SIDES = (224, 336, 448)


def picture(side: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.add.outer(np.arange(side), np.arange(side))[..., None] * np.array([3, 5, 7]) % 256
    return Image.fromarray((base + rng.integers(0, 60, (side, side, 3))).clip(0, 255).astype("uint8"))


def chat(image: Image.Image | None, question: str) -> list[dict]:
    parts = [{"type": "image", "image": image}] if image is not None else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def median_time(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def encoder_rows(llm: LLM, hf, rounds: int) -> list[dict]:
    rows = []
    tower = llm.engine.runner.encoder.tower
    for side in SIDES:
        image = picture(side, side)
        prepared = llm.engine.vision.prepare(image, pixel_digest(image))
        prepare = median_time(lambda: llm.engine.vision.prepare(image, pixel_digest(image)), rounds)
        pixels = prepared.tiles[0].pixels
        tower(pixels)  # warm-up: the first call of a shape pays for allocations
        ours = median_time(lambda: tower(pixels), rounds)
        with torch.inference_mode():
            hf.model.visual(pixels["pixel_values"].to(hf.dtype), grid_thw=pixels["image_grid_thw"])
            theirs = median_time(lambda: hf.model.visual(pixels["pixel_values"].to(hf.dtype), grid_thw=pixels["image_grid_thw"]), rounds)
        rows.append({"side": side, "tokens": prepared.length, "prepare_ms": prepare * 1e3, "shoal_ms": ours * 1e3, "transformers_ms": theirs * 1e3})
    return rows


def ttft(out) -> float:
    return out.metrics.time_to_first_token


def second_turn_rows(path: Path, rounds: int) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    firsts, seconds, fresh = [], [], []
    for r in range(rounds):
        llm = LLM(str(path), max_model_len=2048)
        image = picture(448, 100 + r)
        turn1 = chat(image, "Describe the picture in detail.")
        first = llm.chat(turn1, greedy)[0]
        turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "And the colours?"}]
        second = llm.chat(turn2, greedy)[0]
        other = chat(picture(448, 200 + r), "Describe the picture in detail.")
        new = llm.chat(other, greedy)[0]
        firsts.append(ttft(first))
        seconds.append(ttft(second))
        fresh.append(ttft(new))
        cached = second.num_cached_tokens, len(second.prompt_token_ids)
    return {"first_turn_s": statistics.median(firsts), "second_turn_s": statistics.median(seconds),
            "new_image_s": statistics.median(fresh), "second_turn_cached": cached[0], "second_turn_prompt": cached[1]}


def mixed_rows(path: Path, rounds: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = {}
    for kind in ("text", "mixed"):
        rates = []
        for r in range(rounds):
            llm = LLM(str(path), max_model_len=2048)
            chats = [chat(picture(336, 1000 * r + i) if kind == "mixed" and i % 2 == 0 else None, f"Question {i}: what is shown?")
                     for i in range(16)]
            t = time.perf_counter()
            outs = llm.chat(chats, params)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        out[kind] = statistics.median(rates)
    return out


def transformers_row(path: Path, hf, rounds: int) -> dict:
    image = picture(448, 7)
    llm = LLM(str(path), dtype="float32", max_model_len=2048, enable_prefix_cache=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours_tokens = llm.chat(chat(image, "Describe it."), greedy)[0].outputs[0].token_ids
    ours = median_time(lambda: llm.chat(chat(picture(448, int(time.time_ns() % 10**6)), "Describe it."), greedy), rounds)
    tok = llm.tokenizer
    prepared = llm.engine.vision.prepare(image, pixel_digest(image))
    ids, _ = llm._chat_prompt(chat(image, "Describe it."), {})
    pixels = prepared.tiles[0].pixels
    mm = torch.tensor([[int(t == llm.engine.vision.spec.image_token_id) for t in ids]])
    kwargs = dict(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                  mm_token_type_ids=mm, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    with torch.inference_mode():
        theirs_tokens = hf.generate(**kwargs)[0, len(ids) :].tolist()
        theirs = median_time(lambda: hf.generate(**kwargs), rounds)
    return {"shoal_s": ours, "transformers_s": theirs, "same_tokens": ours_tokens == theirs_tokens, "prompt_tokens": len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a vision model folder (default: a random-weight Qwen2-VL built here)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.model) if a.model else make_tiny_vl_model("qwen2_vl", Path(tmp) / "qwen2-vl-bench", max_pixels=448 * 448,
                                                                text=TEXT, vision=VISION)
        hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        print("encoder ...", flush=True)
        enc = encoder_rows(LLM(str(path), dtype="float32", max_model_len=2048), hf, a.rounds)
        print("second turn ...", flush=True)
        turns = second_turn_rows(path, a.rounds)
        print("mixed traffic ...", flush=True)
        mixed = mixed_rows(path, a.rounds)
        print("against transformers ...", flush=True)
        ref = transformers_row(path, hf, a.rounds)
    forced = os.environ.get("SHOAL_CPU_ISA")
    kind = forced if forced in ("avx2", "baseline") else cpu_kind()
    m = machine()
    lines = [f"# Images ({kind})", "", f"{machine_line(m)}{f', forced onto its {forced} path (SHOAL_CPU_ISA)' if forced else ''}. Model: {'random-weight Qwen2-VL (benchmarks/vision.py)' if not a.model else Path(a.model).name}; "
             f"median of {a.rounds} rounds. `benchmarks/vision.py`.", "",
             "## The vision tower, one image (float32)", "",
             "Preparing is the server's work before the engine sees the request (the pixel digest and the model's processor: "
             "resize, normalize, patch), on every request, a cache hit too. The tower runs only where the caches miss.", "",
             *table(["side (px)", "tokens", "prepare (ms)", "tower: shoal (ms)", "tower: transformers (ms)", "ratio"],
                    [[r["side"], r["tokens"], f"{r['prepare_ms']:.1f}", f"{r['shoal_ms']:.1f}", f"{r['transformers_ms']:.1f}",
                      f"{r['transformers_ms'] / r['shoal_ms']:.2f}x"] for r in enc], "rrrrrr"),
             "", "shoal calls transformers' own tower module, so the ratio is its call's overhead and this host's noise.",
             "", "## A second turn about the same image (default dtype)", "",
             *table(["request", "TTFT (ms)"], [
                 ["first turn, a new 448 px image", f"{turns['first_turn_s'] * 1e3:.1f}"],
                 [f"second turn, the same image ({turns['second_turn_cached']} of {turns['second_turn_prompt']} prompt tokens cached)", f"{turns['second_turn_s'] * 1e3:.1f}"],
                 ["first turn, another new image", f"{turns['new_image_s'] * 1e3:.1f}"]], "lr"),
             "", f"The second turn takes {turns['second_turn_s'] / turns['first_turn_s']:.2f}x the first's time to first token "
             "(from the engine's arrival: the preparing above comes before it).", "",
             "## Mixed traffic (default dtype): 16 requests at once, 32 tokens each", "",
             *table(["traffic", "output tok/s"], [["text only", f"{mixed['text']:.1f}"], ["half with a 336 px image each", f"{mixed['mixed']:.1f}"]], "lr"),
             "", f"Mixed traffic keeps {mixed['mixed'] / mixed['text']:.2f}x the text-only rate. It is more work, not the same work "
             "slower: each image adds 144 prompt tokens and a tower run, inside the steps every request shares.", "",
             "## Against transformers: one image request, 32 greedy tokens (float32)", "",
             *table(["", "seconds", "speed-up"], [["transformers generate", f"{ref['transformers_s']:.3f}", "1.00x"],
                                                ["shoal", f"{ref['shoal_s']:.3f}", f"{ref['transformers_s'] / ref['shoal_s']:.2f}x"]], "lrr"),
             "", f"Same tokens: {'yes' if ref['same_tokens'] else 'NO'} ({ref['prompt_tokens']} prompt tokens)."]
    publish(f"vision-{kind}", {"machine": m, "encoder": enc, "second_turn": turns, "mixed": mixed, "transformers": ref}, lines)


if __name__ == "__main__":
    main()
