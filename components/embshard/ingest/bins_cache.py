"""An on-disk cache of the access bins sampled for a spec's tables, so that `embshard place --tables spec.csv`
does not sample them again on every call (about 10-26 ms a table: 9-26 s at 856-1,000 tables, against ~1 s to
plan them with a heuristic).

An entry is one table's 17 bins, found by a key that holds everything the sample depends on: the seed, the batch
size, the table's name (its random stream), rows, pooling factor and zipf alpha, numpy's version (the Generator's
streams may change between releases) and the source code of the functions that sample and bin (a changed
sampler makes new keys, never stale hits). So a hit is the very array the sampling would give: plans, content
hashes and `export`'s "tables changed" check read the same with the cache or without it.

Where: $EMBSHARD_CACHE_DIR, else $XDG_CACHE_HOME/embshard, else ~/.cache/embshard (`off` turns it off). A cache
that cannot be written (a read-only home in a pod) is skipped with one debug line; an entry that does not read
back as 17 finite, non-negative bins summing to 1 is sampled again and replaced. Deleting the folder is safe.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import os
import tempfile
from functools import lru_cache

import numpy as np

from .. import schemas

log = logging.getLogger(__name__)

ENV = "EMBSHARD_CACHE_DIR"
OFF = ("off", "none", "0", "false")
FOLDER = "spec-bins"
# Raised by hand when what a sample depends on changes outside the functions fingerprinted below (their constants,
# e.g. the bin edges' module constants): old entries then miss.
FORMAT = 1


def cache_dir() -> str | None:
    """The folder of bin entries, or None when the cache is off (or the sampler's source cannot be read)."""
    if _sampler_fingerprint() is None:
        return None
    given = os.environ.get(ENV)
    if given is not None:
        if given.strip().lower() in OFF or not given.strip():
            return None
        return os.path.join(os.path.expanduser(given), FOLDER)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "embshard", FOLDER)


@lru_cache(maxsize=1)
def _sampler_fingerprint() -> str | None:
    """numpy's version and the source of every function that turns a spec row into bins (see the module doc);
    None where the source is not installed (bytecode only): no key could tell a changed sampler, so no cache."""
    from .. import features
    from . import synthetic

    parts = [np.__version__, str(FORMAT)]
    try:
        for fn in (synthetic.table_rng, synthetic._name_seed, synthetic.sample_table_batch, synthetic.bag_lengths,
                   synthetic.zipf_indices, synthetic.table_bins, synthetic.table_bin_histogram,
                   features.bin_histogram, features.bin_of_count, features.bins_from_histogram):
            parts.append(inspect.getsource(fn))
    except (OSError, TypeError):
        log.debug("the sampler's source is not installed: spec bins are not cached")
        return None
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


def table_key(seed: int, batch: int, name: str, rows: int, pooling_factor: float, alpha: float) -> str:
    """The entry name of one table's sampled bins (repr keeps every bit of the floats)."""
    text = "|".join([str(_sampler_fingerprint()), str(int(seed)), str(int(batch)), name, str(int(rows)),
                     repr(float(pooling_factor)), repr(float(alpha))])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _entry(folder: str, key: str) -> str:
    return os.path.join(folder, key[:2], key + ".bin")


def load(folder: str | None, key: str) -> np.ndarray | None:
    """The cached bins of `key`, or None (off, missing, or not a valid entry: then it is sampled again)."""
    if folder is None:
        return None
    try:
        with open(_entry(folder, key), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if len(raw) != 8 * schemas.NUM_BINS:
        return None
    bins = np.frombuffer(raw, dtype="<f8").astype(np.float64)
    if not (np.isfinite(bins).all() and (bins >= 0).all() and abs(bins.sum() - 1.0) < 1e-9):
        return None
    return bins


class Writer:
    """Stores entries until the first failure, then stops trying (one debug line, never an error)."""

    def __init__(self, folder: str | None):
        self.folder = folder

    def store(self, key: str, bins: np.ndarray) -> None:
        if self.folder is None:
            return
        path = _entry(self.folder, key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # written beside, then renamed: a reader never sees half an entry
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            try:
                os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache's entries from its other users
                with os.fdopen(fd, "wb") as f:
                    f.write(np.asarray(bins, dtype="<f8").tobytes())
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.debug("spec bins cache %s not written (%s): later reads sample again", self.folder, exc)
            self.folder = None
