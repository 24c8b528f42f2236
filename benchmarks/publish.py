"""What every benchmark does with its results: describe the machine, build tables, write NAME.json and NAME.md.

    from publish import machine, machine_line, publish, table

    doc = {..., "machine": machine()}
    lines = ["# Title", "", f"On {machine_line(doc['machine'])}.", "", *table(["a", "b"], rows)]
    publish("name", doc, lines)   # benchmarks/results/name.json and name.md

NAME.json holds everything measured, so a report can be written again later
(`load`); NAME.md is the page a reader looks at. A benchmark is imported by
its script's folder being on sys.path, and this module needs `shoal` importable
(the benchmarks put the repository root on sys.path, or run in the project's venv).
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.bench import machine_info

RESULTS = Path(__file__).resolve().parent / "results"

# The CPU flags a speed figure depends on, by the name the results use -> the name in /proc/cpuinfo.
# AVX2 / AVX-512 run the vector kernels, VNNI the low-bit kernels' int8 dot products, and
# avx512_bf16 or AMX decide whether dtype `auto` is bfloat16 or float32 (resolve_dtype).
SPEED_FLAGS = {"avx2": "avx2", "avx512f": "avx512f", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
               "amx": "amx_tile"}


def cpu_flags() -> dict[str, bool]:
    """SPEED_FLAGS' names -> present or not; empty where /proc/cpuinfo is not there to say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    present = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return {name: flag in present for name, flag in SPEED_FLAGS.items()}


def cpu_kind(flags: dict[str, bool] | None = None) -> str:
    """The kind of CPU a speed figure belongs to, for results kept per kind: "avx512-vnni-bf16", "avx512-vnni",
    "avx512", "avx2" or "baseline" (the widest vector code the kernels have, then what the low-bit matmuls and
    `--dtype auto` depend on)."""
    f = cpu_flags() if flags is None else flags
    if not f.get("avx512f"):
        return "avx2" if f.get("avx2") else "baseline"
    return "avx512" + ("-vnni" if f.get("avx512_vnni") else "") + ("-bf16" if f.get("avx512_bf16") or f.get("amx") else "")


def machine() -> dict:
    """What the results record of the machine: shoal.bench's description, the speed flags, torch and its threads."""
    import torch  # here rather than at import: the report-only modes describe no machine

    return {**machine_info(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


def machine_line(m: dict | None = None) -> str:
    """machine() as one sentence, e.g. "Intel(R) Xeon(R) Processor, 2 cores (avx2, avx512f, avx512_vnni;
    no avx512_bf16, no amx), torch 2.13.0+cpu with 2 threads".

    A description saved before this module leaves out what it lacks; its CPU may be under "cpu", the old key.
    """
    m = machine() if m is None else m
    text = m.get("cpu_model") or m.get("cpu") or "an unknown CPU"
    if m.get("cores"):
        text += f", {m['cores']} cores"
    flags = m.get("cpu_flags")
    if flags:
        have = ", ".join(name for name, on in flags.items() if on)
        lack = ", ".join(f"no {name}" for name, on in flags.items() if not on)
        text += f" ({'; '.join(part for part in (have, lack) if part)})"
    if m.get("torch"):
        text += f", torch {m['torch']}"
        if m.get("torch_threads"):
            text += f" with {m['torch_threads']} threads"
    return text


def table(header: list[str], rows: list[list], align: str = "") -> list[str]:
    """A markdown table's lines. align: a letter a column, "r" for right-aligned (numbers); others and missing ones
    get the default. Cells are written with str(); an empty one stays empty."""

    def line(cells) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    rule = "|" + "".join("---:|" if align[i:i + 1] == "r" else "---|" for i in range(len(header)))
    return [line(header), rule, *(line(row) for row in rows)]


def publish(name: str, doc: dict, lines: list[str], where: Path | None = None) -> None:
    """Write doc to NAME.json and lines to NAME.md in `where` (RESULTS unless told), print the page and say where."""
    where = RESULTS if where is None else where
    where.mkdir(parents=True, exist_ok=True)
    # default=str: a value JSON has no form for (a dtype, a path) is written as text, not lost with the whole run
    (where / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (where / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {where / name}.json and .md")


def load(name: str) -> dict:
    """RESULTS/NAME.json as publish wrote it, for a report written again without measuring."""
    return json.loads((RESULTS / f"{name}.json").read_text())
