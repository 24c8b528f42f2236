"""How expert reading scales with the batch: the distinct experts a mixture-of-experts decode step touches.

    .venv/bin/python benchmarks/gguf_formats.py --sizes moe --build-only   # the file (Qwen3-30B-A3B's layer shape)
    .venv/bin/python benchmarks/moe_routing.py

A decode step of n sequences reads, in each sparse layer, the experts its n tokens chose: with k of E experts a
token, and choices spread evenly, E (1 - (1 - k/E)^n) distinct ones. Grouping the step's tokens by expert reads
each of them once (layers.MoE), so the bytes a step streams grow with the distinct experts, not with n * k. Per
batch size this reports the mean distinct experts per layer and step, measured (every layer's call of
layers.Experts during greedy decoding, speculation off, so every step has n rows), beside the even-spread
figure, and the expert bytes a step reads against one token's. Random weights spread the choices about evenly;
a trained model's router has favourites, so it touches fewer.
Results: benchmarks/results/moe_routing-KIND.{md,json}.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

BATCHES = (1, 2, 4, 8, 16, 32)


def main() -> int:
    from gguf_formats import model_path
    from publish import machine, publish, table
    from tqdm.auto import tqdm

    from shoal import LLM, SamplingParams
    from shoal.model.layers import Experts

    path = model_path("moe", "Q4_K_M")
    if not path.exists():
        raise SystemExit(f"{path} is missing: run benchmarks/gguf_formats.py --sizes moe --build-only first")
    calls: list[tuple[int, int]] = []  # (rows, distinct experts) of every layer's experts call
    forward = Experts.forward

    def counted(self, x, counts):
        calls.append((x.shape[0], sum(1 for c in counts if c)))
        return forward(self, x, counts)

    Experts.forward = Experts.__call__ = counted  # a Layer is called through __call__, set to forward at its creation
    llm = LLM(str(path), speculative="off", max_model_len=4096)
    moe = next(layer.mlp for layer in llm.engine.runner.model.model.layers if hasattr(layer.mlp, "top_k"))
    k, experts = moe.top_k, len(moe.experts.mlps)
    rows = []
    for n in tqdm(BATCHES, desc="batch sizes", unit="batch"):
        prompts = [[(97 * j + 13 * i) % 40000 + 100 for i in range(16)] for j in range(n)]
        calls.clear()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        steps = [d for r, d in calls if r == n * k]  # decode steps with every sequence in them
        measured = sum(steps) / len(steps)
        even = experts * (1 - (1 - k / experts) ** n)
        rows.append({"streams": n, "layer_steps": len(steps), "distinct_experts": measured, "even_spread": even,
                     "expert_bytes_vs_one_token": measured / k})
    doc = {"machine": machine(), "file": path.name, "experts": experts, "top_k": k, "batches": rows}
    lines = ["# Distinct experts a decode step reads", "",
             f"{path.name}: {experts} experts, {k} a token; greedy decoding, speculation off; per sparse layer and step.", "",
             *table(["streams", "distinct experts (measured)", "even spread", "expert bytes, × one token's", "tokens × k"],
                    [[r["streams"], f"{r['distinct_experts']:.1f}", f"{r['even_spread']:.1f}",
                      f"{r['expert_bytes_vs_one_token']:.2f}×", r["streams"] * k] for r in rows])]
    publish("moe_routing", doc, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
