"""Batch-invariant paged attention: one definition of a query's attention, whatever the step.

A query at position p attends over keys 0..p (or its sliding window). Here it
always does so the same way, whether it is a decode, a row of a prefill chunk
of any length or start, alone or next to 63 other sequences:

- The keys are cut into tiles of TILE_KEYS positions (whole cache blocks)
  counted from position 0, and a sequence's keys are padded with the null
  block to whole tiles, so a given key always sits in the same tile at the
  same offset.
- The scores q.k are one matmul per (KV head, sequence): each score is a
  D-long dot product, and the CPU's GEMMs give a row and a column the same
  bits whatever the number of rows and columns (`matmul` for the one case
  that needs a nudge).
- Hidden keys (past p, padding, outside the window) score -inf, and the row's
  float32 softmax runs over whole tiles: torch's kernel reduces a row in one
  vector pass from its start, and the keys past the query's own tiles add
  exact zeros to it.
- p.v is one matmul of a fixed shape [M, TILE] x [TILE, D] per tile, and the
  tiles' results are added in tile order in float32; a tile the query cannot
  see adds +0.0.

Nothing here looks at the step's shape to pick a kernel. torch's fused SDPA
kernels were tried and rejected: their GEMMs block the query rows (32, 64,
256 by the chunk's length) and a row's bits then depend on where it falls in
its block (tests/test_invariance.py).

On the CPU, where shoal's native kernels built (`shoal/kernels/`), one C++ op
per layer does all of it instead: it writes the step's keys and values, and
runs each row as a flash-style online softmax over tiles of 64 keys, in one
fixed order of operations per row, without building score matrices. That is
the same guarantee by construction rather than by the GEMMs' behaviour, and it
keeps long prompts fast: the matrices above cost memory traffic proportional
to the chunk times the context. Its answers differ in the last bits from this
file's torch path (both are invariant; a process uses one). It stores keys
transposed within their block, so the cache is read by this backend alone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from shoal import kernels
from shoal.model.attention.common import MODEL_WINDOW, PerWindow, SeqSpan, gather_blocks, slot_mapping, visible_keys, write_kv
from shoal.model.invariance import wide_dtype, wide_matmul

# Keys per tile: the length of every p.v reduction. 128 keys x 64 dims is 16 KiB of
# bf16 per head; shorter tiles mean more matmuls per step.
TILE_KEYS = 128


@dataclass
class _Group:
    """One batched attention call: B sequences with the same number of query rows each (decodes: 1)."""

    row_start: int  # first row of the group in the flat batch
    num_seqs: int  # B
    queries: int  # query tokens per sequence
    num_tiles: int  # n: tiles every sequence of the group reads (padded with the null block)
    block_ids: torch.Tensor  # [B * n * blocks_per_tile] long
    mask_from: int  # first key column with any hidden key
    hidden: torch.Tensor | None  # [1, B or 1, M or 1, n * TILE - mask_from] bool, True: hidden


@dataclass
class InvariantMetadata(PerWindow):
    backend: InvariantAttention
    slot_mapping: torch.Tensor  # [T] long
    groups: list[_Group] = field(default_factory=list)
    window: int | None = None  # the sliding window the groups' masks hide keys outside of
    spans: tuple = ()  # (decodes, chunks): what prepare was given, for another window's metadata
    other_windows: dict = field(default_factory=dict)  # window -> the step's metadata for it, built on first use

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, scale: float,
                window=MODEL_WINDOW, softcap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step; kv [2, Hkv, blocks, block_size, D]: the layer's cache.
        window: the layer's sliding window (None: none; MODEL_WINDOW: the backend's); softcap: its logit softcap."""
        write_kv(kv, k, v, self.slot_mapping)
        return self.backend.attend(q, kv, self.for_window(window), scale, softcap)


@dataclass
class NativeMetadata:
    """The native op's view of the step: every row's sequence and position, and the sequences' block tables."""

    backend: InvariantAttention
    slot_mapping: torch.Tensor  # [T] long
    tables: torch.Tensor  # [S, max blocks] int32, padded with the null block
    row_seq: torch.Tensor  # [T] int32: the row's sequence (its table)
    row_pos: torch.Tensor  # [T] int32: the row's position

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, scale: float,
                window=MODEL_WINDOW, softcap: float | None = None) -> torch.Tensor:
        """window, softcap: as InvariantMetadata.forward's, arguments of the op."""
        b = self.backend
        window = b.window if window is MODEL_WINDOW else window
        return kernels.invariant_attention(q, k, v, kv, self.slot_mapping, self.tables, self.row_seq, self.row_pos,
                                           scale, window or 0, b.group_size, softcap or 0.0)


class TableRows:
    """The block tables of the sequences a step attends over, kept as rows of one int32 tensor from step to step, so a
    step writes only what changed (issue 53: nothing O(context) rebuilt in Python per sequence per step).

    A sequence's row holds the table it had in the last step that named it, padded with the null block. A span says
    from which entry its table may differ from that one (SeqSpan.changed_from, from the plan's diffs: runner/kept.py),
    so a step writes a sequence's new blocks only, or from the earliest entry that changed (copy-on-write's swap of a
    block, a window's freed blocks, a rejected draft's), or the whole row for a sequence it has not seen. Rows of
    sequences no step has named for longest are reused once every row is taken; the tensor doubles where a step
    needs more rows or a table more columns. `tables(spans)` is then one gather of the step's rows, wider than the
    widest table only by null columns, which the attention op never reads past a row's position.
    """

    def __init__(self, null: int, device: torch.device, rows: int = 16, columns: int = 16) -> None:
        self.null, self.device = null, device
        self.tensor = torch.full((rows, columns), null, dtype=torch.int32, device=device)
        self.columns = columns
        self.view: tuple[int, int, torch.Tensor] | None = None  # (first row, rows, the tensor's view of them) last returned
        self.row_of: OrderedDict[int, int] = OrderedDict()  # seq_id -> its row, least recently named first
        self.held: dict[int, int] = {}  # seq_id -> the length of the table its row holds
        self.free = list(range(rows - 1, -1, -1))

    def tables(self, spans: list[SeqSpan], step: set[int]) -> torch.Tensor:
        """[len(spans), columns] int32: each span's block table from column 0, null after it. step: the spans'
        sequence ids, each span's own."""
        widest = max(len(s.block_table) for s in spans)
        if widest > self.columns:
            self._grow(self.tensor.shape[0], max(widest, 2 * self.columns))
        rows = []
        for s in spans:
            sid, table = s.seq_id, s.block_table
            row = self.row_of.get(sid)
            if row is None:
                row = self._take_row(step)
                self.row_of[sid] = row
                start = 0
            else:
                self.row_of.move_to_end(sid)
                held = self.held[sid]
                start = min(s.changed_from, held)
                if len(table) < held:  # a shorter table: its old entries past the end go back to null
                    self.tensor[row, len(table) : held] = self.null
            if start == 0:
                self.tensor[row].fill_(self.null)
            if len(table) > start:
                self.tensor[row, start : len(table)] = torch.tensor(table[start:], dtype=torch.int32)
            self.held[sid] = len(table)
            rows.append(row)
        first, n = rows[0], len(rows)
        if rows[-1] - first == n - 1 and rows == list(range(first, first + n)):  # in order (one stream, a steady batch):
            if self.view is None or self.view[:2] != (first, n):  # a view, the last step's where the rows are its rows
                self.view = (first, n, self.tensor[first : first + n])
            return self.view[2]
        return self.tensor.index_select(0, torch.tensor(rows, device=self.device))

    def _take_row(self, step: set[int]) -> int:
        if not self.free:
            stale = next((sid for sid in self.row_of if sid not in step), None)
            if stale is None:  # every row is this step's: twice the rows
                rows = self.tensor.shape[0]
                self._grow(2 * rows, self.columns)
                self.free = list(range(2 * rows - 1, rows - 1, -1))
            else:
                self.free.append(self.row_of.pop(stale))
                del self.held[stale]
        return self.free.pop()

    def _grow(self, rows: int, columns: int) -> None:
        bigger = torch.full((rows, columns), self.null, dtype=torch.int32, device=self.device)
        bigger[: self.tensor.shape[0], : self.columns] = self.tensor
        self.tensor, self.columns, self.view = bigger, columns, None


class InvariantAttention:
    name = "invariant"
    keep_tables = True  # the native op's tables kept across steps (TableRows); False: built afresh every step

    def __init__(self, *, block_size: int, num_kv_heads: int, group_size: int, sliding_window: int | None,
                 null_block: int, device: torch.device, dtype: torch.dtype, native: bool | None = None) -> None:
        """native: the C++ op (None: on the CPU where it built; False: the torch path, as tests ask)."""
        self.block_size = block_size
        self.blocks_per_tile = max(1, TILE_KEYS // block_size)
        self.tile = self.blocks_per_tile * block_size
        self.num_kv_heads = num_kv_heads
        self.group_size = group_size
        self.window = sliding_window
        self.null_block = null_block
        self.device = device
        # the native op (CPU, where it built): row-invariant by construction, needs neither setting below
        self.native = device.type == "cpu" and (native is not False) and kernels.available()
        self.table_rows: dict[tuple, TableRows] = {}  # the native op's block tables, kept across steps, per KV group
        torch_cpu = device.type == "cpu" and not self.native
        # where the host's GEMMs in this dtype are not row-invariant (MKL's float32 on AMD EPYC, emulated
        # bfloat16): products in a wider dtype, rounded once (invariance.wide_dtype, a probe run once per dtype)
        self.wide = wide_dtype(dtype) if torch_cpu else None
        # MKL's float32 and oneDNN's half-precision batched GEMMs take another path for a single
        # row than for several (tests/test_invariance.py, invariance.pads_single_row): such a matmul runs on the row twice.
        self.pad_single_row = torch_cpu and (self.wide or dtype) in (torch.float32, torch.float16, torch.bfloat16)

    # ------------------------------------------------------------ plan -> metadata
    def prepare(self, decodes: list[SeqSpan], chunks: list[SeqSpan], window=MODEL_WINDOW,
                null_block: int | None = None) -> InvariantMetadata | NativeMetadata:
        """window: the one the torch path's masks are for (MODEL_WINDOW: the backend's); the native op takes it per call.
        null_block: what pads the tables (None: the backend's; a KV group's cache has its own, types.KVGroup)."""
        null = self.null_block if null_block is None else null_block
        if self.native:
            return self._native(decodes + chunks, null, window)
        window = self.window if window is MODEL_WINDOW else window
        meta = InvariantMetadata(self, slot_mapping(decodes + chunks, self.block_size, self.device), window=window, spans=(decodes, chunks))
        if decodes:
            meta.groups.append(self._group(0, decodes, 1, window, null))
        row = len(decodes)
        for s in chunks:
            meta.groups.append(self._group(row, [s], s.length, window, null))
            row += s.length
        return meta

    def write_kv(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Keys and values [T, Hkv, D] into a layer's cache at `slots`, in this backend's layout (a step's own
        are written by its forward; this is for caches filled from outside, as tests do)."""
        write_kv(kv, k, v, slots, transposed_keys=self.native)  # the native op keeps keys transposed within their block

    def _native(self, spans: list[SeqSpan], null: int, window) -> NativeMetadata:
        tables_t = self.native_tables(spans, null, window)
        # each row's cache slot, sequence and position, in one op from the spans and their tables
        starts_lengths = torch.tensor([s.start_pos for s in spans] + [s.length for s in spans], dtype=torch.long)
        slots, seq_t, pos_t = kernels.step_rows(starts_lengths, tables_t, self.block_size, null)
        return NativeMetadata(self, slots, tables_t, seq_t, pos_t)

    def native_tables(self, spans: list[SeqSpan], null: int | None = None, window=MODEL_WINDOW) -> torch.Tensor:
        """The spans' block tables [S, W] int32 as the native op reads them (a KV group's: its null block and window):
        the runner's sequences, each once, from rows kept across steps (TableRows); others built afresh."""
        null = self.null_block if null is None else null
        ids = {s.seq_id for s in spans}
        if self.keep_tables and spans and min(ids) >= 0 and len(ids) == len(spans):
            rows = self.table_rows.get((null, window))
            if rows is None:
                rows = self.table_rows[(null, window)] = TableRows(null, self.device)
            return rows.tables(spans, ids)
        return self.tables(spans, null)

    def tables(self, spans: list[SeqSpan], null: int) -> torch.Tensor:
        """The spans' block tables [S, widest] int32, padded with `null`, built from scratch (what TableRows keeps)."""
        width = max((len(s.block_table) for s in spans), default=1)
        tables = [list(s.block_table) + [null] * (width - len(s.block_table)) for s in spans] or [[null]]
        return torch.tensor(tables, dtype=torch.int32, device=self.device)

    def _group(self, row_start: int, spans: list[SeqSpan], queries: int, window: int | None, null: int) -> _Group:
        T, bpt = self.tile, self.blocks_per_tile
        n = -(-max(s.context_len for s in spans) // T)
        ids: list[int] = []
        for s in spans:
            table = list(s.block_table[: n * bpt])
            ids.extend(table + [null] * (n * bpt - len(table)))
        if queries == 1:  # the decode group: one row per sequence, the same for every head
            pos = torch.tensor([s.start_pos for s in spans], device=self.device)
        else:  # one chunk: its positions
            pos = torch.arange(spans[0].start_pos, spans[0].context_len, device=self.device)
        hidden = ~visible_keys(torch.arange(n * T, device=self.device), pos, window)  # [rows, n * TILE]
        cols = hidden.any(dim=0).nonzero()
        mask_from = int(cols[0]) if len(cols) else n * T
        mask = None
        if mask_from < n * T:
            tail = hidden[:, mask_from:]
            # decodes: a row per sequence for every head; a chunk: rows g * L + i of the folded heads
            mask = tail[None, :, None, :] if queries == 1 else tail.repeat(self.group_size, 1)[None, None]
        return _Group(row_start, len(spans), queries, n, torch.tensor(ids, dtype=torch.long, device=self.device), mask_from, mask)

    # ------------------------------------------------------------ forward
    def attend(self, q: torch.Tensor, kv: torch.Tensor, meta: InvariantMetadata, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D]; kv [2, Hkv, blocks, block_size, D] -> [T, Hq, D]. softcap: the layer's logit softcap
        (scores -> softcap * tanh(scores / softcap), elementwise, so as invariant as the scores)."""
        if isinstance(meta, NativeMetadata):
            none = q.new_empty(0, self.num_kv_heads, q.shape[-1])
            return meta.forward(q, none, none, kv, scale, softcap=softcap)
        _, Hq, D = q.shape
        Hkv, G = self.num_kv_heads, self.group_size
        q = q * scale  # HF scales the scores; the same factor on the queries (exact for head_dim 64, 256)
        out = None if len(meta.groups) == 1 else torch.empty_like(q)
        for g in meta.groups:
            B, L = g.num_seqs, g.queries
            # [2, Hkv, B * n * TILE, D] -> K and V as [Hkv, B, n * TILE, D], no copy
            k, v = gather_blocks(kv, g.block_ids, q.dtype).view(2, Hkv, B, -1, D)
            rows = q[g.row_start : g.row_start + B * L]
            if L == 1:  # decodes: [Hkv, B, G, D], head h = kv_head * G + g as in HF's repeat_kv
                qg = rows.view(B, Hkv, G, D).transpose(0, 1)
            else:  # a chunk's rows, query heads folded into the rows: [Hkv, 1, G * L, D]
                qg = rows.view(L, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, 1, G * L, D)
            o = self._tiles(qg, k, v, g, softcap)  # [Hkv, B, M, D]
            o = o.transpose(0, 1).reshape(B, Hq, D) if L == 1 else o.view(Hkv, G, L, D).permute(2, 0, 1, 3).reshape(L, Hq, D)
            if out is None:
                return o
            out[g.row_start : g.row_start + B * L] = o
        return out

    def _tiles(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: _Group, softcap: float | None = None) -> torch.Tensor:
        """q [Hkv, B, M, D] (scaled); k, v [Hkv, B, n * TILE, D] -> [Hkv, B, M, D]."""
        Hkv, B, M, D = q.shape
        n, T = g.num_tiles, self.tile
        s = self.matmul(q, k.transpose(-1, -2))  # [Hkv, B, M, n * TILE]
        if softcap is not None:
            s = torch.tanh(s.float() / softcap).mul_(softcap)
        if g.hidden is not None:
            s[..., g.mask_from :].masked_fill_(g.hidden, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
        if n == 1:
            return self.matmul(p.to(v.dtype), v)
        # p.v tile by tile ([M, TILE] x [TILE, D] each), added in tile order in float32
        tiles = torch.empty(Hkv, B, n, M, T, dtype=v.dtype, device=v.device)
        tiles.copy_(p.view(Hkv, B, M, n, T).transpose(2, 3))
        o = self.matmul(tiles, v.view(Hkv, B, n, T, D))  # [Hkv, B, n, M, D]
        return o.sum(dim=2, dtype=torch.float32).to(v.dtype)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        single = self.pad_single_row and a.shape[-2] == 1
        if single:
            a = torch.cat((a, a), dim=-2)
        y = torch.matmul(a, b) if self.wide is None else wide_matmul(a, b, self.wide)
        return y[..., :1, :] if single else y
