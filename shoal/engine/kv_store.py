"""Where the prefix cache's second tier keeps blocks: a directory (survives restarts) or host RAM. No torch.

A directory holds one subdirectory per configuration, named by the fingerprint's digest, and one file per block:

    DIR/lock                      flock'd by the server using DIR (a second server is refused)
    DIR/model-hashes.json         the model files' SHA-256, by path, size and mtime (hashed once)
    DIR/<fingerprint>/ab/abcd….kv one block: a header, then the block's bytes as the KV tensor holds them

A model with several KV groups (types.KVGroup: Gemma's local and global layers) has one subdirectory per group,
DIR/<fingerprint>-group<g>, each entry a block of that group's layers.

An entry's header (ENTRY_HEADER) holds a magic, the layout version, the fingerprint's digest, the block's
chain digest and its parent's, its token count, the payload's length and its CRC-32 (the chain digest already names
the content; the checksum only has to catch a torn or flipped file, and CRC-32 reads at 7 GB/s where BLAKE2b reads at 1.5). The
fingerprint covers everything that changes a block's bytes: the model file's hash, the dtype, the KV dtype,
the weight format, the attention backend, the model's shape, the block size, the layout version and shoal's
version. An entry whose header does not match, whose file is shorter than it says, or whose checksum fails
is ignored with one log line and deleted; it is never loaded.

Writes go through a writer thread (write to a temporary name, then rename: a reader never sees half a
file) and reads through a reader thread; the engine's thread only queues them. A write that fails (the
disk is full, the directory went away) sets `failure`: the tier turns itself off and serving goes on.
Blocks queued but not yet written are served from memory.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("shoal.engine")

LAYOUT_VERSION = 1  # the entry format and the KV tensor's block layout (attention/common.py)
MAGIC = b"SHOALKV\x00"
# magic, layout version, fingerprint digest, block digest, parent digest, tokens, payload bytes, payload checksum
ENTRY_HEADER = struct.Struct("<8sI32s32s32sIQI")
MAX_PENDING_BYTES = 512 * 2**20  # spilled bytes waiting for the writer; beyond it, spills are dropped
PROBE_BYTES = 8 * 2**20  # read at start-up for a first read rate


def checksum(payload) -> int:
    return zlib.crc32(payload)


def fingerprint_digest(fingerprint: dict) -> bytes:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).digest()


@dataclass
class Fetch:
    """A read of consecutive blocks of one prompt, from `first_block` on. `payloads[i]` is None where the block
    could not be read; `errors` says why for the ones that failed their checks."""

    first_block: int
    digests: list[bytes]
    payloads: list = field(default_factory=list)
    errors: list[tuple[bytes, str]] = field(default_factory=list)
    nbytes: int = 0  # bytes read from the store (not from the write queue)
    seconds: float = 0.0
    event: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return self.event.is_set()

    def usable(self) -> list:
        """The payloads up to the first one missing."""
        out = []
        for p in self.payloads:
            if p is None:
                break
            out.append(p)
        return out


class HostStore:
    """The tier in host RAM (meant for a KV cache on a GPU; on a CPU the pool itself could take the memory)."""

    kind = "host"
    persistent = False  # gone with the process: nothing to keep for a restart
    read_rate = None  # a memory copy: the policy restores until it has measured one
    failure = None
    rejected = 0

    def __init__(self, capacity_bytes: int, payload_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = self.entry_bytes = payload_bytes
        self._blocks: dict[bytes, bytearray] = {}

    def existing(self) -> list[bytes]:
        return []

    def put(self, digest: bytes, parent: bytes, num_tokens: int, payload) -> bool:
        self._blocks[digest] = bytearray(payload)
        return True

    def delete(self, digest: bytes) -> None:
        self._blocks.pop(digest, None)

    def fetch(self, first_block: int, digests: list[bytes]) -> Fetch:
        f = Fetch(first_block, digests)
        t0 = time.perf_counter()
        for d in digests:
            p = self._blocks.get(d)
            f.payloads.append(None if p is None else bytearray(p))
            f.nbytes += len(p) if p is not None else 0
        f.seconds = time.perf_counter() - t0
        f.event.set()
        return f

    def drain(self, timeout: float) -> bool:
        return True  # nothing is written in the background

    def close(self) -> None:
        self._blocks.clear()


class DirectoryStore:
    """The tier in a local directory: it survives restarts. One server per directory (a lock)."""

    kind = "disk"
    persistent = True  # survives restarts: the engine keeps the pool's blocks here as it closes

    def __init__(self, root: str | Path, capacity_bytes: int, payload_bytes: int, fingerprint: dict,
                 group: int | None = None) -> None:
        """group: which KV group's blocks (types.KVGroup) this store holds, for a model with several: each group
        has a store, in DIR/<fingerprint>-group<g>; the first one's holds DIR's lock, so open it first."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock(self.root) if not group else None
        self.configuration = fingerprint_digest(fingerprint).hex()[:16]
        if group is not None:
            fingerprint = {**fingerprint, "kv_group": group}
        self.fingerprint = fingerprint_digest(fingerprint)
        self.dir = self.root / (self.configuration if group is None else f"{self.configuration}-group{group}")
        self.dir.mkdir(exist_ok=True)
        (self.dir / "fingerprint.json").write_text(json.dumps(fingerprint, sort_keys=True, indent=1) + "\n")
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = payload_bytes
        self.entry_bytes = ENTRY_HEADER.size + payload_bytes
        self.failure: str | None = None
        self.rejected = 0
        self._pending: dict[bytes, object] = {}  # digest -> payload queued for the writer
        self._pending_bytes = 0
        self._mutex = threading.Lock()
        self._found = self._scan()
        self.read_rate = self._probe() if not group else None  # the first group's measures the directory
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._writer, name="shoal-tier-writer", daemon=True),
                         threading.Thread(target=self._reader, name="shoal-tier-reader", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ start-up
    def path(self, digest: bytes) -> Path:
        h = digest.hex()
        return self.dir / h[:2] / f"{h}.kv"

    def _scan(self) -> list[bytes]:
        """The entries left by earlier runs, oldest first; the bad ones are deleted, with one line saying so."""
        found, bad = [], {}
        for p in self.dir.glob("*/*"):
            if p.suffix == ".tmp":  # a write cut short by an exit
                p.unlink(missing_ok=True)
                continue
            try:
                with open(p, "rb") as f:
                    header = f.read(ENTRY_HEADER.size)
                digest, reason = self._check_header(p, header, p.stat().st_size)
            except (OSError, ValueError) as e:
                digest, reason = None, f"unreadable ({e.__class__.__name__})"
            if reason is not None:
                bad[reason] = bad.get(reason, 0) + 1
                p.unlink(missing_ok=True)
                continue
            found.append((p.stat().st_mtime_ns, digest))
        self.rejected = sum(bad.values())
        if bad:
            log.warning("prefix-cache tier: ignored and deleted %d entries in %s (%s)", self.rejected, self.dir,
                        ", ".join(f"{n} {why}" for why, n in sorted(bad.items())))
        others = [d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(self.configuration)]
        if others and self._lock_file is not None:  # said once, by the first group's store
            size = sum(f.stat().st_size for d in others for f in d.glob("*/*.kv"))
            log.info("prefix-cache tier: %s also holds %d other configurations' entries (%.1f MiB), not counted in "
                     "this server's budget; delete those folders to reclaim them", self.root, len(others), size / 2**20)
        found.sort()
        return [d for _, d in found]

    def _check_header(self, path: Path, header: bytes, size: int) -> tuple[bytes | None, str | None]:
        """The entry's digest, or None and why it is not one of this configuration's."""
        if len(header) < ENTRY_HEADER.size:
            return None, "truncated"
        magic, layout, fp, digest, _parent, _tokens, length, _sum = ENTRY_HEADER.unpack(header)
        if magic != MAGIC:
            return None, "not an entry"
        if layout != LAYOUT_VERSION or fp != self.fingerprint:
            return None, "written by another configuration"
        if digest.hex() != path.stem or length != self.payload_bytes:
            return None, "mismatched"
        if size < ENTRY_HEADER.size + length:
            return None, "truncated"
        return digest, None

    def _probe(self) -> float | None:
        """A first read rate: write PROBE_BYTES and read them back. None if that fails."""
        probe = self.root / f"probe-{os.getpid()}.tmp"
        try:
            data = os.urandom(PROBE_BYTES)
            probe.write_bytes(data)
            t0 = time.perf_counter()
            with open(probe, "rb") as f:
                f.readinto(bytearray(PROBE_BYTES))
            return PROBE_BYTES / max(time.perf_counter() - t0, 1e-6)
        except OSError:
            return None
        finally:
            probe.unlink(missing_ok=True)

    def existing(self) -> list[bytes]:
        return self._found

    # ------------------------------------------------------------ writes
    def put(self, digest: bytes, parent: bytes, num_tokens: int, payload) -> bool:
        """Queue a block for writing; False (nothing queued) when the tier is off or the writer is too far behind."""
        if self.failure is not None:
            return False
        with self._mutex:
            if self._pending_bytes + self.payload_bytes > MAX_PENDING_BYTES:
                return False
            self._pending[digest] = payload
            self._pending_bytes += self.payload_bytes
        self._writes.put(("write", digest, parent, num_tokens))
        return True

    def delete(self, digest: bytes) -> None:
        self._writes.put(("delete", digest, None, 0))

    def _writer(self) -> None:
        while True:
            op, digest, parent, num_tokens = self._writes.get()
            if op == "stop":
                return
            if op == "delete":
                with self._mutex:
                    self._unqueue(digest)
                self.path(digest).unlink(missing_ok=True)
                continue
            with self._mutex:
                payload = self._pending.get(digest)
            if payload is None or self.failure is not None:
                continue  # deleted before it was written, or the tier is off
            try:
                self._write(digest, parent, num_tokens, payload)
            except Exception as e:  # noqa: BLE001 (whatever it is, the tier turns off and serving goes on)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    reason = "the disk is full"
                elif isinstance(e, OSError):
                    reason = f"writing failed ({e.strerror or e})"
                else:
                    reason = f"writing failed ({e.__class__.__name__})"
                self.failure = f"{reason} in {self.dir}"
                with self._mutex:
                    self._pending.clear()
                    self._pending_bytes = 0
                continue
            with self._mutex:
                self._unqueue(digest)

    def _unqueue(self, digest: bytes) -> None:
        if self._pending.pop(digest, None) is not None:
            self._pending_bytes -= self.payload_bytes

    def _write(self, digest: bytes, parent: bytes, num_tokens: int, payload) -> None:
        path = self.path(digest)
        path.parent.mkdir(exist_ok=True)
        header = ENTRY_HEADER.pack(MAGIC, LAYOUT_VERSION, self.fingerprint, digest, parent.rjust(32, b"\0"),
                                   num_tokens, len(payload), checksum(payload))
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    # ------------------------------------------------------------ reads
    def fetch(self, first_block: int, digests: list[bytes]) -> Fetch:
        f = Fetch(first_block, digests)
        self._reads.put(f)
        return f

    def _reader(self) -> None:
        while True:
            f = self._reads.get()
            if f is None:
                return
            t0 = time.perf_counter()
            try:
                self._read_all(f)
            except Exception as e:  # a bug, or no memory: this read gives what it has, and the reader goes on
                log.warning("prefix-cache tier: a read failed (%s); its prompt is computed instead", e.__class__.__name__)
                f.payloads.append(None)
            finally:
                f.seconds = time.perf_counter() - t0
                f.event.set()  # always: a request waits on it

    def _read_all(self, f: Fetch) -> None:
        for d in f.digests:
            with self._mutex:
                queued = self._pending.get(d)
            if queued is not None:
                f.payloads.append(bytearray(queued))
                continue
            payload, reason = self._read(d)
            if reason is not None:
                f.errors.append((d, reason))
            f.payloads.append(payload)
            f.nbytes += len(payload) if payload is not None else 0
            if payload is None:
                break  # the blocks after it are of no use without it

    def _read(self, digest: bytes) -> tuple[bytearray | None, str | None]:
        path = self.path(digest)
        try:
            with open(path, "rb") as fh:
                header = fh.read(ENTRY_HEADER.size)
                size = os.fstat(fh.fileno()).st_size
                got, reason = self._check_header(path, header, size)
                if reason is not None:
                    return None, reason
                payload = bytearray(self.payload_bytes)
                n = fh.readinto(payload)
        except FileNotFoundError:
            return None, None  # deleted meanwhile: a plain miss
        except OSError as e:
            return None, f"unreadable ({e.strerror or e})"
        if n != self.payload_bytes:
            return None, "truncated"
        if checksum(payload) != ENTRY_HEADER.unpack(header)[7]:
            return None, "checksum mismatch (corrupted)"
        os.utime(path)  # recency survives a restart
        return payload, None

    # ------------------------------------------------------------ end
    def drain(self, timeout: float) -> bool:
        """Wait until the queued writes are done (at most `timeout` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._mutex:
                if not self._pending and self._writes.empty():
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 30.0) -> None:
        if not self.drain(timeout):
            log.warning("prefix-cache tier: gave up waiting for writes after %.0f s; the unwritten blocks are lost", timeout)
        self._writes.put(("stop", None, None, 0))
        self._reads.put(None)
        for t in self._threads:
            t.join(timeout=5)
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock


def _lock(root: Path):
    """Hold DIR/lock for this process's life; another server holding it is a clear error."""
    f = open(root / "lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ValueError(
            f"--prefix-cache-dir {root} is in use by another shoal server (pid {holder}); give each server its own "
            f"directory"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def model_digest(path: str | Path, root: Path) -> str:
    """SHA-256 of the model's weights: one file, or every file of a folder (hashed once per path, size and
    modification time; the results are kept in DIR/model-hashes.json)."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    known_path = root / "model-hashes.json"
    try:
        known = json.loads(known_path.read_text())
    except (OSError, ValueError):
        known = {}
    total = hashlib.sha256()
    changed = False
    for p in files:
        st = p.stat()
        key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
        if key not in known:
            t0 = time.perf_counter()
            with open(p, "rb") as f:
                known[key] = hashlib.file_digest(f, "sha256").hexdigest()
            if st.st_size > 2**26:
                log.info("prefix-cache tier: hashed %s (%.0f MiB) in %.1f s for the tier's fingerprint (once per file)",
                         p.name, st.st_size / 2**20, time.perf_counter() - t0)
            changed = True
        total.update(f"{p.relative_to(path) if path.is_dir() else p.name}:{known[key]}\n".encode())
    if changed:
        known_path.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    return total.hexdigest()
