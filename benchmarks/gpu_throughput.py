"""GPU throughput: shoal's engine against transformers generate() on one CUDA device, same run.

Not yet run on a GPU: the device tool lent none to the issue that wrote it. `--device cpu` tries it out here.

    # on a CPU machine that has the default model: write its config and tokenizer (no weights, ~3 MB)
    .venv/bin/python benchmarks/gpu_throughput.py prepare .gpu/smollm2-shape
    # on the GPU machine: fill in seeded random weights of that shape, then measure
    python benchmarks/gpu_throughput.py run .gpu/smollm2-shape --dtype bfloat16 --out results/gpu_throughput

The default model's 94 MB GGUF is too large to send to the lent GPU machine, so
the GPU run uses a model of exactly SmolLM2-135M's shapes (config and real
tokenizer from the GGUF) with seeded random weights: a step's cost depends on
the shapes, not on the values. Every request makes exactly --max-tokens tokens
(ignore_eos for shoal, min_new_tokens for transformers). Correctness on CUDA is
the test suite's job (it runs there with device "auto"), not this script's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from publish import machine, machine_line, publish, table  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402


def prepare(out: Path) -> None:
    from shoal.model.loader import load_checkpoint, resolve_model_path

    ckpt = load_checkpoint(resolve_model_path("smollm2"), progress=False)
    out.mkdir(parents=True, exist_ok=True)
    ckpt.hf_config.save_pretrained(out)
    ckpt.tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(ckpt.eos_token_ids)}))
    print(f"wrote {out}: config and tokenizer of {ckpt.path.name}, no weights")


def fill_random_weights(folder: Path, seed: int = 0) -> None:
    if any(folder.glob("*.safetensors")):
        return
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)


def prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, len(tok) - 1, (n, length), generator=g)  # ordinary tokens, no specials
    return ids.tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_shoal(llm: LLM, batch: list[list[int]], max_tokens: int, device: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(batch, params)
    sync(device)
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": tokens, "tok_per_s": tokens / dt}


def time_hf(model, batch: list[list[int]], max_tokens: int, device: str) -> dict:
    ids = torch.tensor(batch, device=device)  # equal lengths: no padding needed
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    sync(device)
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    sync(device)
    dt = time.perf_counter() - t
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"seconds": dt, "output_tokens": tokens, "tok_per_s": tokens / dt}


def run(folder: Path, device: str, dtype: str, batches: list[int], input_len: int, max_tokens: int, out: Path | None) -> None:
    import transformers

    fill_random_weights(folder)
    tdtype = getattr(torch, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=tdtype, attn_implementation="sdpa").to(device).eval()
    llm = LLM(str(folder), device=device, dtype=dtype, max_model_len=input_len + max_tokens + 16, max_num_seqs=max(batches))
    tok = llm.tokenizer
    rows = []
    for b in batches:
        batch = prompts(tok, b, input_len, seed=b)
        with torch.inference_mode():
            h = time_hf(hf, batch, max_tokens, device)
        s = time_shoal(llm, batch, max_tokens, device)
        rows.append({"batch": b, "shoal": s, "transformers": h, "ratio": s["tok_per_s"] / h["tok_per_s"]})
        print(f"batch {b}: shoal {s['tok_per_s']:.0f} tok/s, transformers generate {h['tok_per_s']:.0f} tok/s, "
              f"ratio {rows[-1]['ratio']:.2f}", flush=True)
    name = torch.cuda.get_device_properties(0).name if device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    doc = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__, "dtype": dtype,
           "input_len": input_len, "max_tokens": max_tokens, "machine": machine(), "rows": rows}
    md = [f"# GPU throughput ({time.strftime('%Y-%m-%d')}, {name})", "",
          f"SmolLM2-135M shapes (random weights), {dtype}, {input_len}-token prompts x {max_tokens} output tokens, "
          f"greedy, transformers {transformers.__version__}. Same run, same device. Host: {machine_line(doc['machine'])}.", "",
          *table(["requests at once", "shoal tok/s", "transformers generate tok/s", "shoal ÷ transformers"],
                 [[r["batch"], f"{r['shoal']['tok_per_s']:.0f}", f"{r['transformers']['tok_per_s']:.0f}", f"{r['ratio']:.2f}"]
                  for r in rows], align="rrrr")]
    if out:
        publish(out.name, doc, md, where=out.parent)
    else:
        print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("folder", type=Path)
    r = sub.add_parser("run")
    r.add_argument("folder", type=Path)
    r.add_argument("--device", default="cuda", help="cuda (the point of this script) or cpu (to try it out)")
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    r.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    r.add_argument("--input-len", type=int, default=128)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--out", type=Path, default=None, help="path without extension: writes .md and .json")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.folder)
    else:
        run(a.folder, a.device, a.dtype, a.batches, a.input_len, a.max_tokens, a.out)


if __name__ == "__main__":
    main()
