"""Meta's open DLRM trace format (`fbgemm_t856_bs65536.pt`, docs/contracts.md), read table by table.

A file holds `torch.save((indices, offsets, lengths))` (a dict with those keys is accepted too):
indices (all tables concatenated, table by table), lengths [T, B], and offsets in one of three layouts:
one flat array of T*B+1 running positions, or [T, B+1] per table (flat T*(B+1) also read) whose rows start
either at 0 or at the table's global position. A table's position in `indices` is the sum of the earlier
tables' lookups, which is the same in every layout, so no layout guessing is needed.

The real file holds ~887M indices (4.2 GB): zip-format `.pt` files are memory-mapped
(`torch.load(mmap=True)`), so only the table being read is resident, and the pages of a finished table are
handed back to the kernel. A `.pt.gz` is stream-decompressed to a temporary file first, then mapped.

Meta's dataset comes as several files of the same tables, one batch each (`fbgemm_t856_bs65536_0.pt` ... `_15.pt`):
an input may name several (`trace_files`: a glob pattern or a comma-separated list), read one after another, and a
table's features then describe all of them (`tables_from_trace`).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import gzip
import logging
import os
import re
import shutil
import tempfile
import zlib
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import checks, schemas, storage
from ..errors import EmbshardError, first_line
from ..features import bins_from_histogram

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"
_ZIP_MAGIC = b"PK\x03\x04"
DATA_TYPES = {"fp32": 4, "fp16": 2}
_FIX_FORMAT = "give a torch.save((indices, offsets, lengths)) file (.pt or .pt.gz), re-download or regenerate it"


class TraceFile:
    """A lazily read DLRM trace file: `table(t)` gives one table's (indices, lengths) as numpy int64."""

    # all None after close(); offsets or lengths also when the file does not hold them
    _indices: np.ndarray | None
    _offsets: np.ndarray | None
    _lengths: np.ndarray | None
    _keep: tuple | None

    def __init__(self, path: str | os.PathLike, tmp_dir: str | None = None, tmp_tag: str | None = None):
        self.path = os.fspath(path)
        self._tmp: str | None = None
        if os.path.isdir(self.path.removeprefix("file://")):
            raise EmbshardError("is a folder, not a file", path=self.path, fix="give the trace file itself")
        # not found, a FIFO (would hang), unreadable, a remote URI; file:// taken off
        self.path = checks.local_input_file(self.path, fix="check the --input path")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        load_path = self.path
        if magic[:2] == _GZIP_MAGIC:
            load_path = self._tmp = _gunzip_to_temp(self.path, tmp_dir, tmp_tag)
        elif self.path.lower().endswith(".gz"):
            raise EmbshardError("is named .gz but is not gzip-compressed", path=self.path,
                                fix="compress it with gzip, or rename it to .pt if it is a plain torch.save file")
        self.mapped = False  # set by _load: True when the tensors are backed by a file mapping
        try:
            indices, offsets, lengths = self._load(load_path, mmap=magic == _ZIP_MAGIC or self._tmp is not None)
            self._indices = _as_numpy(indices)
            self._offsets = None if offsets is None else _as_numpy(offsets)
            self._lengths = None if lengths is None else _as_numpy(lengths)
            self._keep = (indices, offsets, lengths)  # the tensors own the memory maps
            # a non-contiguous tensor was copied into ordinary memory: never madvise that
            self._release_ok = self.mapped and indices.is_contiguous()
            self._index()
        except BaseException:
            self.close()
            raise

    # -- loading -------------------------------------------------------------------------------------
    def _load(self, load_path: str, mmap: bool):
        import pickle

        import torch

        try:
            try:
                obj = torch.load(load_path, mmap=mmap, weights_only=True, map_location="cpu")
                self.mapped = mmap
            except RuntimeError as exc:
                if not mmap or "mmap" not in str(exc):
                    raise
                # Legacy (pre-zip) torch.save files cannot be mapped: read them whole.
                log.warning("%s is not in torch's zip format; loading it into memory", self.path)
                obj = torch.load(load_path, weights_only=True, map_location="cpu")
        except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, KeyError,
                AttributeError, IndexError, TypeError) as exc:
            reason = f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__
            if isinstance(exc, (KeyError, pickle.UnpicklingError)):  # a pickle opcode, meaningless to a user
                reason = "not in torch.save's format"
            raise EmbshardError(f"not a readable torch.save file, truncated or corrupt ({reason})",
                                path=self.path, fix=_FIX_FORMAT) from None
        if isinstance(obj, dict):
            missing = [k for k in ("indices", "offsets") if k not in obj]
            if missing and not ("indices" in obj and "lengths" in obj):
                raise EmbshardError(f"the saved dict has no {missing[0]!r} entry", path=self.path,
                                    field=missing[0], fix=_FIX_FORMAT)
            parts = (obj.get("indices"), obj.get("offsets"), obj.get("lengths"))
        elif isinstance(obj, (tuple, list)) and len(obj) in (2, 3) and any(isinstance(x, torch.Tensor) for x in obj):
            parts = (*obj, None) if len(obj) == 2 else tuple(obj)
        elif isinstance(obj, (tuple, list)) and len(obj) in (2, 3):
            # torch.save([1, 2, 3]) had been told "indices is not an integer tensor (int)"
            kinds = ", ".join(sorted({type(x).__name__ for x in obj}))
            raise EmbshardError(f"holds a {type(obj).__name__} of {len(obj)} {kinds} values, not the tensors "
                                "(indices, offsets, lengths)", path=self.path, fix=_FIX_FORMAT)
        else:
            raise EmbshardError(f"holds a {type(obj).__name__}, not (indices, offsets, lengths)",
                                path=self.path, fix=_FIX_FORMAT)
        for name, t in zip(("indices", "offsets", "lengths"), parts):
            # bool is not an index type either (True/False would read as rows 1/0)
            if t is not None and (not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex()
                                  or t.dtype == torch.bool):
                raise EmbshardError(f"is not an integer tensor ({getattr(t, 'dtype', type(t).__name__)})",
                                    path=self.path, field=name, fix=_FIX_FORMAT)
            # sparse, quantized or meta tensors hold no plain array of ids to read
            if t is not None and (t.layout != torch.strided or t.device.type == "meta" or t.is_quantized):
                kind = "meta" if t.device.type == "meta" else str(t.layout).removeprefix("torch.")
                raise EmbshardError(f"is a {kind} tensor, not a dense one", path=self.path, field=name,
                                    fix="save dense tensors (tensor.to_dense(), or the values on the CPU)")
        return parts

    def _index(self) -> None:
        """Find T, B and where every table starts in `indices` (reads only T+1 offsets, or the lengths)."""
        ind, off, lens = self._indices, self._offsets, self._lengths
        assert ind is not None  # set by __init__ just before
        where = self.path
        if ind.ndim != 1:
            raise EmbshardError(f"has shape {tuple(ind.shape)}, expected 1-D", path=where, field="indices",
                                fix=_FIX_FORMAT)
        if lens is not None and lens.ndim == 2:
            T, B = lens.shape
        elif off is not None and off.ndim == 2:
            T, B = off.shape[0], off.shape[1] - 1
        else:
            raise EmbshardError("cannot tell tables from samples: need lengths of shape [T, B] or offsets "
                                "of shape [T, B+1]", path=where, field="lengths", fix=_FIX_FORMAT)
        if T <= 0 or B <= 0:
            raise EmbshardError(f"no tables or no samples (T={T}, B={B})", path=where, field="lengths",
                                fix="give a trace with at least one table and one sample")
        if lens is not None and lens.size != T * B:
            raise EmbshardError(f"has {lens.size} entries, expected T*B = {T}*{B}", path=where, field="lengths",
                                fix=_FIX_FORMAT)
        self.num_tables, self.batch_size = int(T), int(B)
        self._layout = None
        if off is not None:
            if off.ndim == 1 and off.size == T * B + 1:
                self._layout = "flat"
                starts = off[::B].astype(np.int64)  # T+1 positions
                # Flat offsets index `indices` itself: a first offset of 5 whose last is len(indices) + 5 had been
                # read as the differences alone (the first ids lost, or another file's offsets).
                if starts[0] != 0:
                    raise EmbshardError(f"flat offsets start at {int(starts[0])}, not 0 (the first ids are missing, or "
                                        "the offsets belong to another file)", path=where, field="offsets",
                                        fix=_FIX_FORMAT)
                bounds = starts
            elif (off.ndim == 1 and off.size == T * (B + 1)) or (off.ndim == 2 and off.shape == (T, B + 1)):
                self._layout = "per_table"
                self._offsets = off = off.reshape(T, B + 1)
                firsts = off[:, 0].astype(np.int64)
                totals = off[:, -1].astype(np.int64) - firsts
                bounds = np.concatenate([[0], np.cumsum(totals)])
                # Each table's offsets start at 0 or at the table's position in `indices` (docs/contracts.md).
                odd = np.flatnonzero((firsts != 0) & (firsts != bounds[:-1]))
                if len(odd):
                    t = int(odd[0])
                    raise EmbshardError(f"table {t}'s offsets start at {int(firsts[t])}, neither 0 nor its position "
                                        f"{int(bounds[t])} in the indices", path=where, field="offsets",
                                        fix=_FIX_FORMAT)
            else:
                raise EmbshardError(f"has shape {tuple(off.shape)}; expected {T * B + 1} (flat) or "
                                    f"[{T}, {B + 1}] (per table)", path=where, field="offsets", fix=_FIX_FORMAT)
        else:
            assert lens is not None  # no offsets: the check above found lengths of shape [T, B]
            bounds = np.concatenate([[0], np.cumsum(lens.reshape(T, B).sum(axis=1, dtype=np.int64))])
        if lens is not None:
            self._lengths = lens.reshape(T, B)
        if np.any(np.diff(bounds) < 0) or bounds[0] < 0:
            raise EmbshardError("offsets decrease: the file is corrupt", path=where, field="offsets",
                                fix=_FIX_FORMAT)
        if bounds[-1] != ind.size:
            raise EmbshardError(f"offsets cover {bounds[-1]} indices but the file holds {ind.size}",
                                path=where, field="offsets", fix=_FIX_FORMAT)
        self.bounds = bounds.astype(np.int64)
        self.num_indices = int(ind.size)

    # -- reading ---------------------------------------------------------------------------------------
    def table(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(indices int64, lengths int64 [B]) of table t, checked for consistency."""
        if not 0 <= t < self.num_tables:
            raise EmbshardError(f"table index {t} out of range 0..{self.num_tables - 1}", path=self.path,
                                field="trace_table_index", fix="re-ingest the tables from this trace file")
        B = self.batch_size
        lo, hi = int(self.bounds[t]), int(self.bounds[t + 1])
        assert self._indices is not None, "the trace file is closed"
        if self._layout == "flat":
            assert self._offsets is not None  # _index chose this layout from the offsets
            o = self._offsets[t * B:(t + 1) * B + 1].astype(np.int64)
            lengths = np.diff(o)
        elif self._layout == "per_table":
            assert self._offsets is not None  # _index chose this layout from the offsets
            lengths = np.diff(self._offsets[t].astype(np.int64))
        else:
            assert self._lengths is not None  # no layout: _index found no offsets, so the lengths are there
            lengths = self._lengths[t].astype(np.int64)
        # Offsets that go backwards are named before any comparison with the lengths: they are what is wrong.
        if lengths.size and lengths.min() < 0:
            where = "offsets decrease" if self._layout is not None else "negative bag length"
            raise EmbshardError(f"{where} in table {t} (sample {int(np.argmax(lengths < 0))})", path=self.path,
                                field="offsets" if self._layout is not None else "lengths", fix=_FIX_FORMAT)
        if (self._lengths is not None and self._layout is not None
                and not np.array_equal(lengths, self._lengths[t])):
            raise EmbshardError(f"lengths of table {t} disagree with its offsets", path=self.path,
                                field="lengths", fix=_FIX_FORMAT)
        view = self._indices[lo:hi]
        indices = view.astype(np.int64, copy=True)
        if self._release_ok:
            _release(view)
        if indices.size and indices.min() < 0:
            raise EmbshardError(f"negative index in table {t}", path=self.path, field="indices", fix=_FIX_FORMAT)
        return indices, lengths

    def close(self) -> None:
        self._keep = self._indices = self._offsets = self._lengths = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(self._tmp)
            self._tmp = None

    def __enter__(self) -> TraceFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def trace_format_problem(path: str) -> str | None:
    """What makes a local file no DLRM trace, read from its first bytes and (for the zip format torch.save writes)
    its header, or None when it may be one: a CSV given as a trace, or a truncated .pt, had passed check_params and
    failed in ingest once the run had started. A gzip or legacy pickle file is left to ingest (read whole there)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return None  # ingest names it
    if magic[:2] == _GZIP_MAGIC or magic[:1] == b"\x80":
        return None
    if magic != _ZIP_MAGIC:
        return "is not a torch.save file (no zip or pickle header): " + ("an empty file" if not magic else
                                                                         "a text or other file")
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            if not any(n.endswith("data.pkl") for n in z.namelist()):
                return "is a zip file but not a torch.save file (no data.pkl)"
    except (zipfile.BadZipFile, OSError) as exc:
        return f"is a damaged torch.save file ({exc}): truncated, or still being written"
    return None


def trace_table_count(path: str) -> int | None:
    """The tables T of a local zip-format trace, from the shape of its lengths [T, B] or offsets [T, B+1] (the
    file memory-mapped: nothing is read but the pickled header), for a check before any work. None where that is
    not cheap (a .pt.gz or a legacy file is read whole), T cannot be told from shapes alone, or the file is
    unreadable: ingest then counts, or names the problem."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != _ZIP_MAGIC:
                return None
        import torch

        obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # any failure: ingest reads the file again and says what is wrong
        return None
    if isinstance(obj, dict):
        offsets, lengths = obj.get("offsets"), obj.get("lengths")
    elif isinstance(obj, (tuple, list)) and len(obj) in (2, 3):
        offsets, lengths = (*obj, None)[1:3]  # (indices, offsets[, lengths])
    else:
        return None
    for t, extra in ((lengths, 0), (offsets, 1)):  # the order TraceFile._index tells T, B by
        shape: tuple[int, ...] = tuple(getattr(t, "shape", ()))
        if len(shape) == 2 and shape[0] > 0 and shape[1] > extra:
            return int(shape[0])
    return None


def _as_numpy(t) -> np.ndarray:
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()


_libc = None
_MADV_DONTNEED = 4


def _release(view: np.ndarray) -> None:
    """Give the pages of a finished, memory-mapped slice back to the kernel (keeps resident memory flat).

    Only for file mappings that are never written (torch.load(mmap=True)): dropping their pages loses
    nothing, a later read faults them back in from the file. NEVER call it on ordinary (anonymous) memory,
    where MADV_DONTNEED would zero the data. Whole pages inside the slice only.
    """
    global _libc
    if view.size == 0 or view.base is None:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        start = view.ctypes.data
        end = start + view.nbytes
        a, b = -(-start // page) * page, (end // page) * page
        if b > a:
            _libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)
    except (OSError, AttributeError, ValueError):
        pass


TEMP_PREFIX = ".embshard-trace-"


def temp_tag(out: str) -> str:
    """A short tag naming the output a decompressed temp belongs to (the same output gives the same tag)."""
    import hashlib

    return hashlib.sha256(os.path.abspath(os.fspath(out)).encode()).hexdigest()[:12]


def remove_stale_temps(tmp_dir: str, tag: str) -> list[str]:
    """Remove what an earlier, killed ingest into the same output left in `tmp_dir`: decompressed traces named
    `.embshard-trace-<tag>-<pid>-*.pt` whose process is gone (a live one, e.g. a concurrent run, is left alone).
    Returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(tmp_dir)
    except OSError:
        return removed
    for name in names:
        parts = name[len(TEMP_PREFIX):].split("-")
        if not name.startswith(f"{TEMP_PREFIX}{tag}-") or not name.endswith(".pt") or len(parts) < 3:
            continue
        try:
            pid = int(parts[1])
        except ValueError:
            continue
        if pid != os.getpid() and storage.process_alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(tmp_dir, name))
            removed.append(os.path.join(tmp_dir, name))
            log.warning("removed %s: a decompressed trace left by an earlier, interrupted ingest",
                        os.path.join(tmp_dir, name))
    return removed


def _gunzip_to_temp(path: str, tmp_dir: str | None, tag: str | None = None) -> str:
    """Stream-decompress a .gz to a temporary file (never whole in memory); errors name the file.

    The temp is named `.embshard-trace-<tag>-<pid>-<random>.pt`: `tag` names the output it serves (temp_tag), so
    the next ingest into that output removes it if this process is killed before it can (remove_stale_temps)."""
    if tmp_dir:
        os.makedirs(tmp_dir, exist_ok=True)
    prefix = f"{TEMP_PREFIX}{tag}-{os.getpid()}-" if tag else TEMP_PREFIX
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".pt", dir=tmp_dir)
    try:
        with os.fdopen(fd, "wb") as dst, gzip.open(path, "rb") as src:
            shutil.copyfileobj(src, dst, 16 << 20)
    except (EOFError, OSError, zlib.error) as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, OSError) and getattr(exc, "errno", None) is not None:
            raise EmbshardError(f"cannot decompress ({exc.strerror})", path=path,
                                fix="free disk space for the decompressed copy or pass a .pt file") from None
        reason = first_line(exc, 100)
        raise EmbshardError(f"truncated or corrupt gzip file ({reason})", path=path, fix=_FIX_FORMAT) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return tmp


# -- lazy per-table access for other stages (the benchmark replays real indices) -----------------------------
_OPEN: dict[tuple, TraceFile] = {}
_MAX_OPEN = 2


def read_table_trace(path: str, table_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64, lengths int64 [B]) of one table of a DLRM-format trace file (.pt or .pt.gz).

    The file is opened once per process and memory-mapped (a .gz is decompressed once to a temp file that
    is removed at exit), so reading many tables one by one stays cheap.
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError:
        raise EmbshardError("trace file not found", path=path, field="trace_file",
                            fix="re-ingest the tables, or restore the trace file they point to") from None
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    trace = _OPEN.get(key)
    if trace is None:
        while len(_OPEN) >= _MAX_OPEN:
            _OPEN.pop(next(iter(_OPEN))).close()
        trace = _OPEN[key] = TraceFile(path)
    return trace.table(int(table_index))


@atexit.register
def _close_all() -> None:
    while _OPEN:
        _OPEN.popitem()[1].close()


# -- ingestion -------------------------------------------------------------------------------------------------
GLOB_CHARS = "*?["


def trace_files(spec: str | os.PathLike | list | tuple) -> list[str]:
    """The trace files an input names, in order: one path; a glob pattern (`/data/fbgemm_t856_bs65536_*.pt`),
    its matches in natural order (_2 before _10); a comma-separated list, in its order, whose entries may be
    patterns too; or a list of them (the shell's expansion of `--input a.pt b.pt`). A path that exists as a file is
    that file, and a pattern that matches files is that pattern, whatever characters they hold (a comma in a
    folder's name). Entries come back as given (a `file://` prefix kept: the reader takes it off); another URI is
    refused, in one line, where it is read. An empty entry (an unset shell variable), a pattern that matches
    nothing, or one file named twice (through a link too) is a one-line error naming the input."""
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise EmbshardError("names no file", path="", field="input", fix=_FIX_NO_FILE)
        return _distinct([f for x in spec for f in trace_files(os.fspath(x))])
    text = os.fspath(spec).strip()
    if not text:
        raise EmbshardError("is empty (an unset shell variable?)", path="''", field="input", fix=_FIX_NO_FILE)
    whole = _matches(text)
    if whole is not None or "," not in text:
        return _distinct(whole if whole is not None else _entry(text))
    parts = [x.strip() for x in text.split(",")]
    parts = parts[:-1] if parts[-1] == "" else parts  # a trailing comma
    if not any(parts):
        raise EmbshardError("names no file", path=text, field="input", fix=_FIX_NO_FILE)
    return _distinct([f for x in parts for f in _entry(x, text)])


_FIX_NO_FILE = "give a trace file, a comma-separated list of them or a glob pattern (quoted)"


def _matches(text: str) -> list[str] | None:
    """The files `text` names as it is: itself when it is a file, a pattern's matches (natural order) when it
    matches files; None otherwise."""
    local = text.removeprefix("file://")
    if "://" in local:
        return None
    if os.path.isfile(local):
        return [text]
    if any(c in local for c in GLOB_CHARS):
        found = sorted((f for f in glob.glob(local) if os.path.isfile(f)), key=_natural_key)
        return found or None
    return None


def _entry(text: str, given: str | None = None) -> list[str]:
    """One entry of an input (a path, or a pattern that must match a file); `given`: the whole input it is in."""
    text = text.strip()
    if not text:
        raise EmbshardError("an entry of the input is empty (an unset shell variable?)", path=given or "''",
                            field="input", fix=_FIX_NO_FILE)
    found = _matches(text)
    if found is not None:
        return found
    local = text.removeprefix("file://")
    if "://" not in local and any(c in local for c in GLOB_CHARS):
        raise EmbshardError("no trace file matches this pattern", path=text, field="input",
                            fix="check the folder and the pattern (quote it, so the shell leaves it to embshard)")
    return [text]  # read (or refused: missing, a folder, a URI) in one line where it is opened


def _distinct(parts: list[str]) -> list[str]:
    """`parts`, refused in one line when one file is named twice (by another path or through a link)."""
    seen: dict[str, str] = {}
    for x in parts:
        key = os.path.realpath(x.removeprefix("file://"))
        if key in seen:
            same = "" if os.path.abspath(x.removeprefix("file://")) == os.path.abspath(
                seen[key].removeprefix("file://")) else f" (as {seen[key]})"
            raise EmbshardError(f"names one file twice{same}", path=x, field="input",
                                fix="list each trace file once (its batches would count twice)")
        seen[key] = x
    return parts


def _no_copies(parts: list[str]) -> None:
    """Refuse two local files (plain paths) with the same bytes (a copy of one batch under another name counted its
    batches twice): only files of equal size are hashed, so distinct batches cost a stat each."""
    import hashlib

    by_size: dict[int, list[str]] = {}
    for x in parts:
        if "://" not in x and os.path.isfile(x):
            by_size.setdefault(os.path.getsize(x), []).append(x)
    for same_size in (group for group in by_size.values() if len(group) > 1):
        digests: dict[str, str] = {}
        for x in same_size:
            h = hashlib.sha256()
            with open(x, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            if h.hexdigest() in digests:
                raise EmbshardError(f"holds the same bytes as {digests[h.hexdigest()]} (a copy of one file)", path=x,
                                    field="input", fix="list each trace file once (its batches would count twice)")
            digests[h.hexdigest()] = x


def check_table_counts(files: list[str]) -> None:
    """Files of one trace hold the same number of tables: checked before any is read where their shapes tell
    (zip-format `.pt`, trace_table_count), so a file of another trace fails at once, not after the others were
    read (minutes each for Meta's files)."""
    counts = [(f, trace_table_count(f.removeprefix("file://"))) for f in files] if len(files) > 1 else []
    known = [(f, n) for f, n in counts if n is not None]
    for f, n in known[1:]:
        if n != known[0][1]:
            raise _not_one_trace(f, n, known[0][0], known[0][1])


def _not_one_trace(file: str, tables: int, first: str, first_tables: int) -> EmbshardError:
    return EmbshardError(f"holds {tables} tables, {os.path.basename(first)} holds {first_tables}: not batches of one "
                         "trace", path=file, field="input",
                         fix="give files of the same tables (e.g. fbgemm_t856_bs65536_*.pt)")


def _natural_key(path: str) -> list:
    """Sort key that orders the numbers in a name by value (`_2` before `_10`)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


@dataclass
class TraceOptions:
    dim: str | int = "mixed"            # an int for every table, or "mixed": a seeded draw from the synthetic mix
    data_type: str = "fp32"
    rows_file: str | None = None        # hash sizes, one per table; default: max index + 1
    seed: int = 0
    num_tables: int | None = None       # read only the first N tables
    tmp_dir: str | None = None          # where a .pt.gz is decompressed
    tmp_tag: str | None = None          # names the output the decompressed temp serves (temp_tag)


def read_rows_file(path: str, num_tables: int, trace_tables: int | None = None) -> np.ndarray:
    """Hash sizes from a text file: integers separated by commas, spaces or newlines, one per table: the
    `num_tables` read, or all `trace_tables` of the trace (the first `num_tables` are used)."""
    if os.path.isdir(path.removeprefix("file://")):
        raise EmbshardError("is a folder, not a file", path=path, field="rows", fix="give the rows file itself")
    path = checks.local_input_file(path, field="rows", fix="check the --rows-file path")
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
        text = raw.replace(",", " ").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise EmbshardError(f"cannot read this file ({getattr(exc, 'strerror', None) or type(exc).__name__})",
                            path=path, field="rows", fix="give a text file of integer hash sizes") from None
    try:
        values = [int(x) for x in text]
    except ValueError as exc:
        raise EmbshardError(f"not an integer ({str(exc).split(':')[-1].strip()})", path=path, field="rows",
                            fix="list one integer hash size per table") from None
    big = [k for k, v in enumerate(values) if v >= checks.MAX_TABLE_BYTES]
    if big:  # before int64 (it would overflow); the size bound itself is checked with the dims
        raise EmbshardError(f"hash size {values[big[0]]:,} of table {big[0]} is over 2^62", path=path, field="rows",
                            fix="give the hash-table sizes (rows), not byte counts")
    rows = np.array(values, dtype=np.int64)
    if rows.size not in (num_tables, trace_tables or num_tables):  # more is a file of another trace, not spare
        grouped = re.search(r"\d,\d{3}(?!\d)", raw) is not None  # 2,000,000: commas separate values here
        raise EmbshardError(f"has {rows.size} hash sizes for {num_tables} tables", path=path, field="rows",
                            fix="list one hash size per table of the trace" + (
                                " (a comma separates sizes: write 2000000, not 2,000,000)" if grouped else ""))
    if (rows[:num_tables] <= 0).any():
        bad = int(np.flatnonzero(rows <= 0)[0])
        raise EmbshardError(f"hash size {rows[bad]} of table {bad} is not > 0", path=path, field="rows",
                            fix="every hash size must be a positive integer")
    return rows[:num_tables]


def choose_dims(dim: str | int, num_tables: int, seed: int) -> np.ndarray:
    from .synthetic import DIM_PROBS, DIMS

    if isinstance(dim, str) and dim.strip().lower() == "mixed":
        return np.random.default_rng([seed, 3]).choice(DIMS, size=num_tables, p=DIM_PROBS).astype(np.int64)
    try:
        d = int(dim)
    except (TypeError, ValueError):
        d = 0
    if not 0 < d <= checks.MAX_DIM:
        raise EmbshardError(f"invalid value {str(dim)[:40]!r}", field="dim",
                            fix=f"give an integer from {checks.DIM_MULTIPLE} to {checks.MAX_DIM:,} or 'mixed'")
    if checks.bad_dim(d):
        raise EmbshardError(f"--dim {d} is not a multiple of {checks.DIM_MULTIPLE} (FBGEMM's kernels cannot "
                            f"measure it)", field="dim", fix=f"use a multiple of {checks.DIM_MULTIPLE}, e.g. "
                            f"{max(checks.DIM_MULTIPLE, d // checks.DIM_MULTIPLE * checks.DIM_MULTIPLE)}, or 'mixed'")
    return np.full(num_tables, d, dtype=np.int64)


def bytes_per_element(data_type: str) -> int:
    key = str(data_type).strip().lower()
    if key not in DATA_TYPES:
        raise EmbshardError(f"unsupported data type {data_type!r}", field="data_type", fix="use fp32 or fp16")
    return DATA_TYPES[key]


# A table sized by its largest id (no --rows-file) is suspect above this many rows when its ids are sparse: one
# stray id of 2^40 made a 65,536 GiB table. Hashed ids of a 40M-row table sampled by a 65,536 batch use 1 in 40-400.
RAW_ID_ROWS = 1 << 32
RAW_ID_RATIO = 10_000


def _warn_suspicious(path: str, ids: list[str], rows: np.ndarray, sparse_ids: np.ndarray,
                     no_lookups: np.ndarray) -> None:
    """Warnings (ingest goes on: the trace may be right) for tables that look like a mistake in the trace."""
    def named(mask: np.ndarray) -> str:
        picked = [f"{ids[t]} ({int(rows[t]):,} rows)" for t in np.flatnonzero(mask)[:3]]
        more = int(mask.sum()) - len(picked)
        return ", ".join(picked) + (f" and {more} more" if more > 0 else "")

    if sparse_ids.any():
        log.warning("%s: table(s) %s: rows come from the largest id, far beyond the ids the trace uses (raw ids, "
                    "or a stray one?) (fix: map ids to hash-table rows, or give --rows-file)", path, named(sparse_ids))
    if no_lookups.any():
        log.warning("%s: table(s) %s: no lookups in the trace, so measured as never read (fix: check the trace's "
                    "lengths, or drop the table)", path, named(no_lookups))


REPLAY_RATIO = 2.0  # a replayed file's mean bag length this far from all the files' is named


def _warn_replayed(first: str, ids: list[str], replayed: np.ndarray, pooling: np.ndarray) -> None:
    """Where the first file (the one the benchmark replays) reads a table much less or more than all the files do,
    its measurements will not match its features: a warning names the tables (ingest goes on)."""
    far = (pooling > 0) & ((replayed * REPLAY_RATIO < pooling) | (replayed > REPLAY_RATIO * pooling))
    if far.any():
        shown = [f"{ids[t]} ({replayed[t]:.3g} against {pooling[t]:.3g})" for t in np.flatnonzero(far)[:3]]
        more = int(far.sum()) - len(shown)
        log.warning("%s: table(s) %s%s: the benchmark replays this file, whose mean bag length is over %gx off the "
                    "files' together, so those tables are measured unlike their features (fix: put a file that "
                    "reads them as the others do first)", first, ", ".join(shown),
                    f" and {more} more" if more > 0 else "", REPLAY_RATIO)


def _warn_batch(path: str, batch: int) -> None:
    """The access bins are defined on a batch of BINS_BATCH_SIZE samples (docs/method.md); a trace's are counted on
    its own batch, and an id's count grows with the batch, so a smaller batch makes its tables read colder (a user
    measured 1.0-3.8x fewer lookups per unique id at 8,192 samples than at 65,536 of the same tables)."""
    from .synthetic import BINS_BATCH_SIZE

    if batch != BINS_BATCH_SIZE:
        log.warning("%s: the access bins are counted on the trace's batch of %s samples, but the features (and the "
                    "cost model trained on them) assume %s: ids repeat %s often in it, so its tables read %s than "
                    "they are (fix: give a trace of %s-sample batches)", path, f"{batch:,}", f"{BINS_BATCH_SIZE:,}",
                    "less" if batch < BINS_BATCH_SIZE else "more", "colder" if batch < BINS_BATCH_SIZE else "hotter",
                    f"{BINS_BATCH_SIZE:,}")


def tables_from_trace(path: str | list[str], options: TraceOptions | None = None, *,
                      rows: np.ndarray | None = None,
                      dims: np.ndarray | None = None, table_ids: list[str] | None = None,
                      source: str | None = None, progress: bool = True) -> pd.DataFrame:
    """A validated tables frame with one row per table of the trace, features computed from its indices.

    `path` may name several files of the same tables (`trace_files`: Meta's dataset holds one batch per file):
    they are read one after another (one decompressed at a time), and a table's features describe all of them:
    its rows from its largest id in any file, its pooling factor the lookups of all files over their samples, its
    access bins the unique ids per bin of each file's batch added up (each file is one batch, the batch the bins
    are defined on). The benchmark replays the first file (`trace_file`), whose own mean bag length is kept in
    `trace_pooling_factor` to check it against (bench.inputs.check_trace_matches).
    `rows`/`dims`/`table_ids` override what the options would choose (the synthetic source passes its own).
    Tables are streamed one at a time; every row points back at its trace (trace_file, trace_table_index).
    """
    from tqdm.auto import tqdm

    from .synthetic import table_bin_histogram

    opt = options or TraceOptions()
    files = [f.removeprefix("file://") for f in trace_files(path)]
    check_table_counts(files)
    # Here, where the files are read, not in trace_files: check_params and the CLI's checks resolve the input
    # several times, and hashing on each would read equal-size files again.
    _no_copies(files)
    first = files[0]  # the trace_file recorded for the benchmark is a plain path: the first file's
    bpe = bytes_per_element(opt.data_type)
    stats: _TraceStats | None = None
    batches: list[int] = []
    for k, file in enumerate(files):
        with TraceFile(file, tmp_dir=opt.tmp_dir, tmp_tag=opt.tmp_tag) as trace:
            if stats is None:
                T = trace.num_tables if opt.num_tables is None else min(int(opt.num_tables), trace.num_tables)
                if T <= 0:
                    raise EmbshardError("must be > 0", field="num_tables", fix="ask for at least one table")
                if opt.num_tables is not None and int(opt.num_tables) > trace.num_tables:
                    raise EmbshardError(f"asked for {int(opt.num_tables)} tables, the trace holds {trace.num_tables}",
                                        path=file, field="num_tables",
                                        fix=f"ask for at most {trace.num_tables}, or omit it")
                if rows is None and opt.rows_file:
                    rows = read_rows_file(opt.rows_file, T, trace.num_tables)
                if dims is None:
                    dims = choose_dims(opt.dim, T, opt.seed)
                if rows is not None:
                    over = [t for t in range(T) if int(rows[t]) * int(dims[t]) * bpe >= checks.MAX_TABLE_BYTES]
                    if over:
                        raise EmbshardError(f"table {over[0]}: {int(rows[over[0]]):,} rows x {int(dims[over[0]])} "
                                            "columns would need 2^62 bytes or more", path=opt.rows_file or file,
                                            field="rows", fix="give the hash-table sizes (rows), not byte counts")
                stats = _TraceStats(T, trace.num_tables, several=len(files) > 1)
            elif trace.num_tables != stats.file_tables:
                raise _not_one_trace(file, trace.num_tables, files[0], stats.file_tables)
            assert dims is not None
            desc = "ingest tables" + (f" (file {k + 1} of {len(files)})" if len(files) > 1 else "")
            for t in tqdm(range(stats.T), desc=desc, unit="table", disable=not progress or None, mininterval=1.0):
                idx, lengths = trace.table(t)
                stats.add(t, idx, lengths, trace.batch_size, None if rows is None else int(rows[t]),
                          int(dims[t]), bpe, file, first=k == 0, histogram=table_bin_histogram)
                del idx, lengths
            batches.append(trace.batch_size)
    assert stats is not None and dims is not None
    if stats.too_small:
        found = list(stats.too_small.values())
        more = f" (and {len(found) - 3} more tables)" if len(found) > 3 else ""
        raise EmbshardError("; ".join(found[:3]) + more, path=opt.rows_file or first, field="rows",
                            fix="give hash sizes larger than every index, or omit --rows-file")
    T = stats.T
    ids = table_ids or [f"t{i:04d}" for i in range(T)]
    out_rows = np.asarray(rows[:T], dtype=np.int64) if rows is not None else np.maximum(stats.top, 1)
    sparse_ids = ((stats.top > RAW_ID_ROWS) & (stats.top > RAW_ID_RATIO * stats.unique)) if rows is None \
        else np.zeros(T, dtype=bool)  # rows from the largest id, far beyond the ids seen: raw ids?
    label = first if len(files) == 1 else f"{first} and {len(files) - 1} more file(s)"
    if not (stats.lookups > 0).any():  # every bag empty: nothing to learn costs from (one empty table is warned of)
        raise EmbshardError(f"no lookups in any of its {T} tables (every bag is empty)", path=label, field="lengths",
                            fix="give a trace whose bags hold ids (check how its lengths or offsets were written)")
    _warn_suspicious(label, ids, out_rows, sparse_ids, stats.lookups == 0)
    if len(files) > 1:
        _warn_replayed(first, ids, stats.first_pooling, stats.lookups / float(sum(batches)))
    if source is None:  # a user's trace (the synthetic source chooses its traces' batch itself)
        for batch in dict.fromkeys(batches):
            _warn_batch(files[batches.index(batch)], batch)
    df = pd.DataFrame({"table_id": ids, "rows": out_rows, "dim": np.asarray(dims, dtype=np.int64),
                       "pooling_factor": stats.lookups / float(sum(batches)), "bytes_per_element": bpe})
    df["size_bytes"] = df["rows"] * df["dim"] * bpe
    bins = stats.bins()
    for k, c in enumerate(schemas.BIN_COLUMNS):
        df[c] = bins[:, k]
    if source is None:
        dim_desc = f"mixed(seed={opt.seed})" if str(opt.dim).lower() == "mixed" else str(int(opt.dim))
        rows_desc = f"file:{os.path.abspath(opt.rows_file)}" if opt.rows_file else "max-index+1"
        where = os.path.abspath(first) if len(files) == 1 else ",".join(os.path.abspath(f) for f in files)
        batch_desc = str(batches[0]) if len(set(batches)) == 1 else "+".join(map(str, batches))
        source = (f"dlrm:{where};{f'files={len(files)};' if len(files) > 1 else ''}batch={batch_desc};"
                  f"dim={dim_desc};dtype={str(opt.data_type).lower()};rows={rows_desc}")
    df["source"] = source
    df["trace_file"] = os.path.abspath(first)
    df["trace_table_index"] = np.arange(T, dtype=np.int64)
    if len(files) > 1:
        df["trace_pooling_factor"] = stats.first_pooling
    return schemas.validate(df, "tables", first)


_INT64_MAX = (1 << 63) - 1


class _TraceStats:
    """What tables_from_trace keeps of each table while it reads the files one after another."""

    def __init__(self, num_tables: int, file_tables: int, several: bool = False):
        T = self.T = num_tables
        self.several = several  # several files: an error names the file it is about
        self.file_tables = file_tables  # tables in each file (num_tables may read only the first ones)
        self.top = np.zeros(T, dtype=np.int64)       # largest id + 1 in any file (0: no lookups)
        self.lookups = np.zeros(T)                    # lookups of all files (float: a sum of up to 2^60)
        self.first_pooling = np.zeros(T)              # the first file's mean bag length (the one replayed)
        self.unique = np.zeros(T, dtype=np.int64)     # unique ids summed over the files (an upper bound of all's)
        self.hist = np.zeros((T, schemas.NUM_BINS), dtype=np.int64)
        self.too_small: dict[int, str] = {}           # table -> its id at or past its --rows-file hash size

    def add(self, t: int, idx: np.ndarray, lengths: np.ndarray, batch: int, rows: int | None, dim: int, bpe: int,
            file: str, first: bool, histogram) -> None:
        top = int(idx.max()) + 1 if idx.size else 0
        self.top[t] = max(int(self.top[t]), min(top, _INT64_MAX))  # an id of 2^63 - 1 is refused below
        self.lookups[t] += float(lengths.sum())
        if first:
            self.first_pooling[t] = float(lengths.sum()) / batch
        if rows is not None:
            if top > rows:  # every such table is named at the end, not one per run
                if t not in self.too_small:
                    where = f" in {os.path.basename(file)}" if self.several else ""
                    self.too_small[t] = f"table {t} uses index {top - 1:,}{where} but has {rows:,} rows"
                return  # no bins: counting up to a stray id of 2^40 would ask for terabytes
        elif top * dim * bpe >= checks.MAX_TABLE_BYTES:  # Python ints: never wraps around
            raise EmbshardError(f"table {t} uses index {top - 1}: {top:,} rows x {dim} columns would need 2^62 bytes "
                                "or more", path=file, field="indices",
                                fix="remap the ids to hash-table rows (the trace holds raw ids), or give --rows-file")
        hist = histogram(idx, rows if rows is not None else top)
        self.hist[t] += hist
        self.unique[t] += int(hist.sum())  # the histogram counts every unique id once: no second sort

    def bins(self) -> np.ndarray:
        """(T, 17) each table's access bins (fractions of its unique ids per bin; bin 0 where never read)."""
        return bins_from_histogram(self.hist)
