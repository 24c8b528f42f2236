"""The prefix cache's second tier on agent traffic that outgrows the KV pool, on the default model.

    .venv/bin/python benchmarks/kv_tier.py [--conversations 16] [--turns 3] [--pool-tokens 4200]
    .venv/bin/python benchmarks/kv_tier.py --threshold-only --model .peers/models/random-gemma3-1b-Q4_K_M.gguf

Agent loop: every conversation shares agentic_prefix.py's system prompt with tool definitions, reads its own
tool result (a ~900-token slice of shoal's source), and goes on for --turns turns, the conversations taking
turns one request at a time (clean time to first token). The KV pool holds --pool-tokens tokens of the
default dtype's cache, far fewer than the conversations together, so by the time a conversation comes back
its own blocks have been evicted. Four configurations, same run:

    no tier              the evicted blocks are gone: every later turn computes the conversation again
    tier                 --prefix-cache-dir: they are written to disk and restored (when measured cheaper)
    int8 KV              --kv-cache-dtype int8, no tier: the same bytes hold about twice the tokens
    int8 KV + tier       both

Then: time to first token right after a restart (the tier's server closed and started again on the same
directory) against a cold start, and the restore-or-recompute threshold on this host: one prompt's blocks
restored from the tier against computed, at several lengths, and the read rate below which computing wins.
--threshold-only measures only that last part, on --model (a Gemma 3 file: its local layers' KV group restores only
a window's blocks).

Writes benchmarks/results/kv_tier-<CPU kind>.{md,json} (kv_tier-threshold-<model>-<CPU kind> with --threshold-only).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentic_prefix import USER_TURNS, system_prompt, time_to_first_token  # noqa: E402
from publish import cpu_kind, machine, machine_line, publish, table  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402
from shoal.types import GenerationRequest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PARAMS = SamplingParams(temperature=0.0, max_tokens=16)
MAX_MODEL_LEN = 4096
CONFIGS = {  # name -> LLM arguments beside the pool's
    "no tier": {},
    "tier": {"tier": True},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "int8 KV + tier": {"kv_cache_dtype": "int8", "tier": True},
}


def tool_results(n: int) -> list[str]:
    """n distinct slices of shoal's own source, one per conversation (about 900 tokens each)."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "shoal").rglob("*.py")))
    return [text[i * 3500 : (i + 1) * 3500] for i in range(n)]


MODEL = "smollm2"  # --model


def open_llm(pool: int, tier_dir: str | None, **kw) -> LLM:
    """pool: the KV pool's bytes, or with --threshold-only its blocks of 16 tokens (the full-attention layers' blocks,
    with KV groups, whose windowed groups' blocks are sized from their windows)."""
    extra = {"prefix_cache_dir": tier_dir} if tier_dir else {}
    size = {"num_blocks": pool} if pool < 2**20 else {"kv_cache_memory": pool}
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, **size, **extra, **kw)


def ttft(llm: LLM, ids: list[int], rid: str):
    """One request alone: (seconds to its first token, its final output)."""
    return time_to_first_token(llm.engine, GenerationRequest(rid, tuple(ids), PARAMS))


class Conversations:
    def __init__(self, n: int) -> None:
        self.messages = [[{"role": "system", "content": system_prompt()},
                          {"role": "user", "content": f"[conversation {c}] Read this tool result, then answer.\n\n{r}"}]
                         for c, r in enumerate(tool_results(n))]

    def turn(self, llm: LLM, c: int, t: int, tag: str) -> dict:
        if t:
            self.messages[c].append({"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]})
        ids = llm.apply_chat_template(self.messages[c])
        seconds, out = ttft(llm, ids, f"{tag}-{c}-{t}")
        return {"conv": c, "turn": t, "ttft": seconds, "prompt": len(ids), "cached": out.num_cached_tokens, "reply": out.outputs[0].text}

    def reply(self, c: int, text: str) -> None:
        self.messages[c].append({"role": "assistant", "content": text})


def run_config(name: str, cfg: dict, args, tier_dir: str | None) -> dict:
    kw = {k: v for k, v in cfg.items() if k != "tier"}
    llm = open_llm(args.pool_bytes, tier_dir if cfg.get("tier") else None, **kw)
    convs = Conversations(args.conversations)
    records = []
    for t in range(args.turns):
        for c in range(args.conversations):
            r = convs.turn(llm, c, t, name)
            convs.reply(c, r["reply"])
            records.append(r)
            print(f"{name:15s} turn {t + 1} conv {c}: prompt {r['prompt']:5d}, cached {r['cached']:5d}, TTFT {r['ttft'] * 1e3:7.0f} ms", flush=True)
    snap = llm.engine.snapshot
    result = {"records": records, "pool_tokens": snap.kv_capacity_tokens, "kv_bytes_per_token": snap.kv_bytes_per_token,
              "tier": dict(snap.kv_tier) if snap.kv_tier else None, "messages": convs.messages}
    llm.close()
    del llm
    gc.collect()
    return result


def after_restart(args, tier_dir: str, messages: list) -> dict:
    """Each conversation's next turn on a server started again on the tier's directory, and on a cold one."""
    out = {}
    for name, d in (("restarted, tier", tier_dir), ("cold start, no tier", None)):
        llm = open_llm(args.pool_bytes, d)
        times = []
        for c, msgs in enumerate(messages):
            ids = llm.apply_chat_template(msgs + [{"role": "user", "content": "One more question after the restart."}])
            seconds, final = ttft(llm, ids, f"restart-{c}")
            times.append({"ttft": seconds, "prompt": len(ids), "cached": final.num_cached_tokens})
            print(f"{name:20s} conv {c}: prompt {len(ids):5d}, cached {final.num_cached_tokens:5d}, TTFT {seconds * 1e3:7.0f} ms", flush=True)
        out[name] = times
        llm.close()
        del llm
        gc.collect()
    return out


def threshold(args, tier_dir: str) -> dict:
    """One prompt restored from the tier against computed, at several lengths, on one engine."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    llm = open_llm(args.pool_bytes, tier_dir, prefix_cache_restore="always")
    ids = llm.tokenizer.encode(text)
    filler = ids[-(args.pool_tokens + 2000) :]  # more than the pool holds, none of it the prompts'
    rows = []
    for length in args.lengths:
        prompt = ids[: length]
        times = {}
        for mode in ("always", "never"):
            llm.engine.tier.policy.mode = mode
            ttft(llm, prompt, f"fill-{length}-{mode}")
            for k in range(0, len(filler) - 1000, 1000):  # other prompts take the pool: the blocks go to the tier
                ttft(llm, filler[k : k + 1000] + [length, len(rows)], f"evict-{length}-{mode}-{k}")
            llm.engine.tier.drain(30)
            seconds, final = ttft(llm, prompt + ids[length : length + 8], f"again-{length}-{mode}")
            times[mode] = {"ttft": seconds, "cached": final.num_cached_tokens}
        rows.append({"tokens": length, "restore": times["always"], "recompute": times["never"]})
        print(f"threshold {length:5d} tokens: restored {times['always']['ttft'] * 1e3:7.0f} ms (cached {times['always']['cached']}), "
              f"computed {times['never']['ttft'] * 1e3:7.0f} ms (cached {times['never']['cached']})", flush=True)
    p, t = llm.engine.tier.policy, llm.engine.tier.stats
    result = {"rows": rows, "read_rate": p.read_rate, "prefill_rate": p.prefill_rate, "threshold_read_rate": p.threshold_read_rate(),
              "block_bytes": p.block_bytes, "restored_blocks": t.restored_blocks, "restored_bytes": t.restored_bytes,
              "kv_groups": [[g.window, len(g.layers)] for g in llm.engine.runner.kv_groups]}
    llm.close()
    return result


def later_ttft(run: dict) -> float:
    return statistics.median(r["ttft"] for r in run["records"] if r["turn"] > 0)


def markdown(doc: dict, args) -> list[str]:
    runs = doc["runs"]
    base = later_ttft(runs["no tier"])
    rows = []
    for name, run in runs.items():
        later = [r for r in run["records"] if r["turn"] > 0]
        cached = sum(r["cached"] for r in later) / sum(r["prompt"] for r in later)
        t = run["tier"]
        rows.append([name, f"{run['pool_tokens']:,}", f"{later_ttft(run) * 1e3:.0f}", f"{base / later_ttft(run):.2f}x", f"{cached:.0%}",
                     f"{t['restored_blocks']:,} / {t['spilled_blocks']:,}" if t else "–"])
    restart = doc["restart"]
    r_tier = statistics.median(x["ttft"] for x in restart["restarted, tier"])
    r_cold = statistics.median(x["ttft"] for x in restart["cold start, no tier"])
    th = doc["threshold"]
    lines = [
        f"# The prefix cache's second tier on agent traffic ({time.strftime('%Y-%m-%d')}, {doc['cpu_kind']})",
        "",
        f"SmolLM2-135M-Instruct (the default configuration), {args.conversations} conversations x {args.turns} turns taking turns "
        f"one request at a time; each shares a {doc['system_tokens']}-token system prompt and has its own ~900-token tool result; "
        f"16 output tokens a turn; a KV pool of {args.pool_bytes / 2**20:.0f} MiB ({args.pool_tokens:,} tokens of the default cache), far less than the {doc['total_tokens']:,} tokens the conversations reach. "
        f"On {machine_line(doc['machine'])}.",
        "",
        "## Time to first token from turn 2",
        "",
        *table(["configuration", "pool tokens", "median TTFT (ms)", "vs no tier", "prompt tokens cached", "tier blocks restored / spilled"],
               rows, align="lrrrrr"),
        "",
        "## Right after a restart",
        "",
        f"Each conversation's next turn on a server started again on the tier's directory: median TTFT **{r_tier * 1e3:.0f} ms**, "
        f"against **{r_cold * 1e3:.0f} ms** on a cold server without a tier ({r_cold / r_tier:.1f}x).",
        "",
        *threshold_lines(th),
    ]
    return lines


def threshold_lines(th: dict) -> list[str]:
    return [
        "## Restore or recompute on this host",
        "",
        *table(["prompt tokens", "TTFT, restored (ms)", "TTFT, computed (ms)", "restored tokens"],
               [[r["tokens"], f"{r['restore']['ttft'] * 1e3:.0f}", f"{r['recompute']['ttft'] * 1e3:.0f}", r["restore"]["cached"]]
                for r in th["rows"]], align="rrrr"),
        "",
        f"- The tier read at {th['read_rate'] / 2**20:,.0f} MiB/s (measured on its restores, page cache included) and the engine "
        f"prefilled {th['prefill_rate']:,.0f} tokens/s (weighted to no context). A {th['block_bytes'] / 2**10:.0f} KiB block is "
        f"worth restoring as long as the store reads faster than **{th['threshold_read_rate'] / 2**20:.1f} MiB/s** "
        "(less the later in a prompt it sits, where computing costs more); `--prefix-cache-restore auto` decides this per "
        "request from the running rates and logs each change of mind.",
        f"- KV groups (window, layers): {th['kv_groups']}. The restores read {th['restored_bytes'] / 2**20:,.1f} MiB for "
        f"{th['restored_blocks']:,} blocks, {th['restored_bytes'] / max(1, th['restored_blocks'] * th['block_bytes']):.0%} of "
        "every layer's bytes for them (a windowed group reads only its last window).",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--pool-tokens", type=int, default=4200, help="the pool's size in tokens of the default dtype's cache")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 3072])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--model", default="smollm2", help="the model (the traffic's chat needs its template)")
    ap.add_argument("--threshold-only", action="store_true", help="only restore against compute, at --lengths")
    args = ap.parse_args()
    global MODEL
    MODEL = args.model
    probe = LLM(MODEL, max_model_len=MAX_MODEL_LEN)
    args.pool_bytes = args.pool_tokens * probe.engine.snapshot.kv_bytes_per_token
    system_tokens = 0 if args.threshold_only else len(probe.apply_chat_template([{"role": "system", "content": system_prompt()}]))
    probe.close()
    del probe
    gc.collect()
    doc = {"machine": machine(), "cpu_kind": cpu_kind(), "system_tokens": system_tokens, "args": vars(args), "runs": {}}
    if args.threshold_only:
        args.pool_bytes = args.pool_tokens // 16  # blocks (open_llm)
        with tempfile.TemporaryDirectory(prefix="shoal-tier-") as tmp:
            doc["threshold"] = threshold(args, f"{tmp}/threshold")
        name = Path(MODEL).stem
        publish(f"kv_tier-threshold-{name}-{doc['cpu_kind']}", doc, [
            f"# Restore or recompute, {name} ({time.strftime('%Y-%m-%d')}, {doc['cpu_kind']})", "",
            f"A KV pool of {args.pool_tokens:,} tokens (of the full-attention layers); on {machine_line(doc['machine'])}.", "",
            *threshold_lines(doc["threshold"])])
        return
    with tempfile.TemporaryDirectory(prefix="shoal-tier-") as tmp:
        for name in args.configs:
            doc["runs"][name] = run_config(name, CONFIGS[name], args, f"{tmp}/{name.replace(' ', '-')}")
        restart_dir = f"{tmp}/tier"
        doc["restart"] = after_restart(args, restart_dir, doc["runs"]["tier"].pop("messages"))
        doc["threshold"] = threshold(args, f"{tmp}/threshold")
    for run in doc["runs"].values():
        run.pop("messages", None)
    last = {}
    for r in next(iter(doc["runs"].values()))["records"]:
        last[r["conv"]] = r["prompt"]
    doc["total_tokens"] = sum(last.values())
    publish(f"kv_tier-{doc['cpu_kind']}", doc, markdown(doc, args))


if __name__ == "__main__":
    main()
