"""shoal's native CPU kernels: C++ built on this machine with its g++ against torch's headers.

`cpu.cpp` holds:
- the batch-invariant paged attention (`model/attention/invariant.py`): one op per layer
  that writes the step's keys and values into the cache and attends for every query
  row, each row by one fixed sequence of operations, without building score matrices;
- a decoder layer's row-wise ops, each one call where torch makes several: the residual
  add fused with the RMSNorm after it, rotary embedding in place, SiLU-and-multiply
  (`model/layers.py` takes them on the CPU). Each row is computed on its own, so they
  are row-invariant too.
`lowbit.cpp` holds the int4/int8 matmuls of `model/quant.py`: a GGUF's Q4/Q8 blocks
times int8-rounded activations, summed exactly in integers (AVX-512 VNNI, AVX2 or
SSE2, the same bits on each), as llama.cpp computes them.
It picks AVX-512, AVX2 or baseline code per process: the best this CPU has, or the path that
SHOAL_CPU_ISA=avx512|avx2|baseline forces (for benchmarks and tests: an AVX-512 host then measures
the AVX2 path honestly; a path the CPU lacks is a startup error). The log says which path each op
takes and why. Every op is written once for 16 float lanes (vec.h) and compiled per path, so the
AVX2 and AVX-512 paths give the same bits; the baseline has no FMA, so its bits differ.

`make setup` builds the library once (`python -m shoal.kernels`, 20-30 s on two cores); a process
that finds it missing builds it on first use. It lives beside the virtual environment, or
under ~/.cache when that is not writable, named by a hash of the source, the compiler
and torch's version, so a change to any of them builds afresh. Where it cannot build (no
compiler, not x86-64) or SHOAL_NO_KERNELS=1 is set, `available()` is False and the
callers keep their pure-torch paths, with the same guarantees and less speed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("shoal.kernels")
SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu.cpp", "lowbit.cpp", "kquants.cpp", "decoder.cpp", "moe.cpp"))  # compiled
HEADERS = tuple(Path(__file__).with_name(n) for n in ("vec.h", "lowbit.h", "ops.h"))  # included: part of the library's hash
ISA_NAMES = {1: "x86-64 baseline", 2: "AVX2", 3: "AVX-512"}
ISA_LEVELS = {"baseline": 1, "avx2": 2, "avx512": 3}  # SHOAL_CPU_ISA's values
_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path() -> Path:
    """Where the built library is (or would be)."""
    cxx = _compiler() or ""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1] if cxx else []
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + repr((version, torch.__version__)).encode()).hexdigest()[:16]
    base = Path(sys.prefix) / "shoal-kernels"
    if not os.access(sys.prefix, os.W_OK):
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shoal" / "kernels"
    return base / f"shoal_kernels-{key}.so"


def available() -> bool:
    """Whether the kernels are loaded (building them the first time)."""
    ok = _state.get("ok")
    if ok is not None:  # the answer, once known, without the lock: layers ask on every call
        return bool(ok)
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return bool(_state["ok"])


def _build(target: Path, cxx: str) -> None:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = [cxx, "-O3", "-std=gnu++17", "-ffp-contract=fast", "-fPIC", "-shared", "-Wno-psabi",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
           *map(str, SOURCES), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}", "-fopenmp"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.strip().splitlines()[-1:]
            raise RuntimeError(errors[0] if errors else "the compiler failed")
        os.replace(out, target)  # atomic: another process building the same file at once is harmless


def requested_isa() -> str:
    """SHOAL_CPU_ISA as given, trimmed ("" where unset)."""
    return os.environ.get("SHOAL_CPU_ISA", "").strip()


def forced_level(value: str, best: int | None) -> int:
    """SHOAL_CPU_ISA's level (0 where it is unset: the best the CPU has), checked against `best`, the CPU's
    best level (None: not an x86-64 CPU). A path the CPU lacks, or a name that is none, is a ValueError."""
    if not value:
        return 0
    level = ISA_LEVELS.get(value.lower())
    if level is None:
        raise ValueError(f"SHOAL_CPU_ISA={value} is not a code path: use one of {', '.join(ISA_LEVELS)}")
    if best is None:
        raise ValueError(f"SHOAL_CPU_ISA={value} asks for an x86-64 path, and this CPU is {platform.machine()}")
    if level > best:
        raise ValueError(f"SHOAL_CPU_ISA={value}: this CPU has no {ISA_NAMES[level]} (the best it has is {ISA_NAMES[best]})")
    return level


def forced_below_avx512() -> bool:
    """Whether SHOAL_CPU_ISA forces a path below AVX-512: the process then runs as on a CPU without it, so
    `--dtype auto` does not count on native bfloat16 (runner.resolve_dtype)."""
    return ISA_LEVELS.get(requested_isa().lower(), 3) < 3


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _load() -> bool:
    forced = requested_isa()
    if forced and not _is_x86():
        forced_level(forced, None)  # raises: the CPU has none of the x86-64 paths
    if os.environ.get("SHOAL_NO_KERNELS") == "1":
        log.info("SHOAL_NO_KERNELS=1: shoal's native kernels are off; attention, the row-wise ops and the low-bit matmuls take torch's paths")
        return False
    if not _is_x86():
        log.info("shoal's native kernels are x86-64 only, not %s: attention, the row-wise ops and the low-bit matmuls take torch's paths", platform.machine())
        return False
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler (g++) here: shoal's native kernels are off, and attention, the row-wise ops and the low-bit matmuls take torch's slower paths")
        return False
    target = library_path()
    try:
        if not target.exists():
            log.info("building shoal's native CPU kernels with %s (once, about 30 s) into %s", cxx, target.parent)
            _build(target, cxx)
        torch.ops.load_library(str(target))
    except Exception as exc:  # a failed build or load: the pure-torch paths remain
        log.warning("shoal's native kernels are off (%s): attention, the row-wise ops and the low-bit matmuls take torch's slower paths", exc)
        return False
    best = int(torch.ops.shoal_kernels.use_isa(0))
    level = forced_level(forced, best)  # a path this CPU lacks: a ValueError, the caller's startup error
    if level:
        torch.ops.shoal_kernels.use_isa(level)
    for line in describe_paths(best, level):
        log.info("%s", line)
    return True


def describe_paths(best: int, forced: int) -> list[str]:
    """The startup log's account of which code path each native op takes, and why."""
    level = forced or best
    why = (f"forced by SHOAL_CPU_ISA; this CPU has {ISA_NAMES[best]}" if forced and forced != best
           else "SHOAL_CPU_ISA asks for it, and it is this CPU's best" if forced else "the best this CPU has")
    matmul = int(torch.ops.shoal_kernels.matmul_isa())
    matmul_path = {3: "AVX-512 VNNI (vpdpbusd)", 2: "AVX2 (vpmaddubsw + vpmaddwd)", 1: "SSE2 (pmaddwd)"}[matmul]
    no_vnni = "; this CPU has AVX-512 but no VNNI" if level == 3 and matmul != 3 else ""
    few = ("; one or two rows a panel at a time, 32-weight blocks on AVX2's kernels (an AMD CPU streams them faster)"
           if matmul == 3 and int(torch.ops.shoal_kernels.one_row_isa()) != 3 else "")
    return [f"native kernels: attention, RMSNorm, rotary and SiLU on the {ISA_NAMES[level]} path ({why})",
            f"native kernels: low-bit matmuls on {matmul_path}{no_vnni}{few}; activations rounded to int8 by the "
            "baseline's code on every path, so every path sees the same codes",
            f"native kernels: packed weights {weight_pages()}"]


def weight_pages(setting: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")) -> str:
    """How weight_empty's memory is paged here, for the startup log: the host's transparent huge page setting (the
    bracketed word of `setting`) and SHOAL_HUGE_PAGES."""
    if os.environ.get("SHOAL_HUGE_PAGES") == "0":  # as weight_empty reads it
        return "on 4 KiB pages (SHOAL_HUGE_PAGES=0)"
    try:
        mode = setting.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "advised for 2 MiB pages, which this kernel may not have (no transparent huge page setting to read)"
    if mode == "never":
        return "on 4 KiB pages: this host's transparent huge pages are off (`never`; `madvise` lets shoal's weights have them)"
    return f"on 2 MiB pages where the kernel has them free (transparent huge pages: {mode})"


def isa() -> str:
    """The instruction set the kernels use on this CPU."""
    return ISA_NAMES[int(torch.ops.shoal_kernels.isa())]


def use_isa(level: int) -> str:
    """Run the kernels' code for instruction-set level 1 (baseline), 2 (AVX2) or 3 (AVX-512), capped at what
    this CPU has; 0 returns to the best. For tests: a process normally keeps one level for its life."""
    return ISA_NAMES[int(torch.ops.shoal_kernels.use_isa(level))]


def use_rows_rule(rule: int) -> int:
    """How one or two rows of a low-bit matmul read their weights on AVX-512 VNNI: 1 a panel at a time (32-weight
    blocks on AVX2's kernels), as an AMD CPU streams them faster; 2 two panels a pass, as an Intel one does; 0 this
    CPU's rule. Every rule gives the same bits. For tests: a process normally keeps its CPU's. Returns the rule in force."""
    return int(torch.ops.shoal_kernels.use_rows_rule(rule))


def native_for(x: torch.Tensor) -> bool:
    """Whether a tensor's row-wise ops (RMSNorm, rotary, SiLU-and-multiply) take the native ops."""
    return x.device.type == "cpu" and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> HF's RMSNorm of each row with `weight`."""
    return torch.ops.shoal_kernels.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, N] -> (x + delta rounded as torch rounds it, the RMSNorm of that): a residual add and the norm after it."""
    return torch.ops.shoal_kernels.add_rms_norm(x, delta, weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in place by its row's float32 cos and signed sin [T, D] (layers.Rotary)."""
    return torch.ops.shoal_kernels.rope_(x, cos, signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    return torch.ops.shoal_kernels.silu_mul(gate_up)


def row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] float32 -> (x.argmax(-1), x.amax(-1)): the first index of each row's maximum (a row's first NaN, where
    it has one) and that maximum, in one op."""
    return torch.ops.shoal_kernels.row_argmax(x)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] float32 -> each row's log-sum-exp [B], one thread and one order of operations a row (NaN where the
    row's maximum is not finite)."""
    return torch.ops.shoal_kernels.row_logsumexp(x)


def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 @ w [N, K].T -> [T, N] float32, each output in one fixed order of operations: the same bits
    whatever the batch (a sparse MLP's router: moe.cpp)."""
    return torch.ops.shoal_kernels.row_linear(x, w)


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sparse layer's routing from its router logits [T, E] float32 (moe.cpp): (rows [T k]: each pair's token, grouped
    by expert; counts [E]; scales [T k]: each grouped pair's weight; back [T k]: token t's j-th expert, ascending, ->
    its pair's grouped position)."""
    return torch.ops.shoal_kernels.moe_route(logits, top_k, normalize)


def moe_combine(y: torch.Tensor, scales: torch.Tensor, back: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts' outputs y [T k, H] float32, grouped as moe_route grouped them -> [T, H]: each token's outputs
    times their weights, added in ascending expert order (one rounding per multiply and per add, as torch's)."""
    return torch.ops.shoal_kernels.moe_combine(y, scales, back, top_k)


def greedy_rows(raw: torch.Tensor, processed: torch.Tensor, bans: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy batch's tokens (the argmax of `processed`, or a negative error code: -1 raw not finite, -2 all
    banned) and their logprobs (each raw logit less its row's row_logsumexp), in one op (runner/sampler.py's codes). bans: flat indices
    into raw (which is then `processed` too) banned for the argmax, without a processed copy; raw is left as it was."""
    return torch.ops.shoal_kernels.greedy_rows(raw, processed, bans)


def greedy_head(hidden: torch.Tensor, weight: torch.Tensor, rows: int, kind: int,
                bans: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """The logits head (gguf_linear of packed `weight`, GGUF type `kind`, `rows` outputs) and greedy_rows over its
    float32 logits (with `bans`, as greedy_rows takes them) in one op: each row's token or negative code, and its
    logprob, as lists (what `.tolist()` of greedy_rows' outputs gives)."""
    return torch.ops.shoal_kernels.greedy_head(hidden, weight, rows, kind, bans)


def weight_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialized uint8 tensor for weights a step streams whole (packed panels): on transparent huge pages
    where the kernels built and the host allows them (cpu.cpp weight_empty), else torch.empty."""
    if available():
        return torch.ops.shoal_kernels.weight_empty(list(shape))
    return torch.empty(shape, dtype=torch.uint8)


def weight_arena_end() -> None:
    """The next weight_empty starts a new arena (a model's load begins): models loaded one after another share none,
    so each one's memory goes back whole when it is unloaded."""
    if available():
        torch.ops.shoal_kernels.weight_arena_end()


def step_rows(spans: torch.Tensor, tables: torch.Tensor, block_size: int, null: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's row indices for invariant_attention: spans [2S] int64 (each sequence's first position, then each one's
    row count), tables [S, W] int32 -> (slots [T] int64, row_seq [T] int32, row_pos [T] int32)."""
    return torch.ops.shoal_kernels.step_rows(spans, tables, block_size, null)


def invariant_attention(q, k, v, kv, slots, tables, row_seq, row_pos, scale: float, window: int, group: int,
                        softcap: float = 0.0) -> torch.Tensor:
    """See cpu.cpp: writes k/v into kv at `slots`, returns attention [T, Hq, D] in q's dtype."""
    return torch.ops.shoal_kernels.invariant_attention(q, k, v, kv, slots, tables, row_seq, row_pos, scale, window, group, softcap)
