"""Limits on what users type: ids, device counts, memory sizes, table shapes. One place, so every stage agrees.

Id rules (table_id, task_id): `^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$` and not "." or "..". TorchRec names
tables and uses them as keys of module paths and state dicts (letters, digits, `_` are always safe; `.` and `-`
appear in real feature names and are accepted by EmbeddingBagConfig); exports turn task ids into folder names, so
no path separator, no leading dot (hidden files, "." and "..") and at most 128 characters (far below any file
system's 255-byte name limit, with room for suffixes).

The id rule matches the whole string (re.fullmatch: `$` alone would accept a trailing newline, and 't0000\n' would
become a plan entry or a folder name).

Dims are multiples of 4: FBGEMM's fused kernels (and TorchRec's column-wise splits) require it; a table of dim 3
or 6 is refused where it enters (spec, trace ingest, any tables file) rather than failing inside the benchmark.
Seeds are integers from 0 to 2^63 - 1 (numpy's seed sequences take no negative entries).

Shape limits catch unit mistakes (bytes typed as dims, a size typed in bytes as GiB) before they become
overflows or hours of measuring: dims up to 65,536 (production models use 4..2,048; FBGEMM's fused kernels are
tuned for dims of a few thousand at most), pooling up to 4,096 lookups per sample (larger is a sequence feature,
not a pooled one, and the access-bin sample of 65,536 samples would need over 2 GiB of indices), table sizes
below 2^62 bytes (int64 arithmetic stays exact), memory per device up to 1 PiB, up to 65,536 devices and up to
10,000 sampled tasks per split.
"""
from __future__ import annotations

import math
import re

from .errors import EmbshardError

ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
MAX_LOCAL_DEVICES = 128  # torch's device index is 8 bits: a host's GPUs are cuda:0 .. cuda:127
ID_RULE = "letters, digits, '_', '.', '-' (not first), at most 128 characters"
_ID = re.compile(ID_PATTERN)

MAX_DIM = 65_536
DIM_MULTIPLE = 4  # FBGEMM's TBE kernels need dims that are multiples of 4
DIM_RULE = f"a multiple of {DIM_MULTIPLE} from {DIM_MULTIPLE} to {MAX_DIM:,}"
MAX_SEED = 2**63 - 1  # int64: fits every seeded library (numpy, torch) and the files that record it
MAX_TASKS = 10_000  # tasks per split (the DAG's num_tasks maximum): a typo of 10^8 would run for minutes
MAX_POOLING_FACTOR = 4096.0
MAX_TABLE_BYTES = 2**62
MAX_MEMORY_GB = 2.0**20  # 1 PiB per device
MAX_DEVICES = 65_536
MAX_ROUNDS = 100  # measuring rounds of the ruler (evaluate, refine, the pipeline's eval_rounds)
GiB = 2**30


def size_text(n_bytes: float, round_up: bool = False) -> str:
    """Bytes in the unit that shows them: '19.073 GiB', '2.4 MiB', '591,536 bytes' (a GiB figure of a small
    overrun read '0.000 GiB over'). `round_up`: never below the bytes (a memory to give: 2.0124 GiB is '2.013')."""
    n = float(n_bytes)
    if abs(n) >= GiB:
        return f"{math.ceil(n / GiB * 1000) / 1000 if round_up else n / GiB:.3f} GiB"
    if abs(n) >= 2**20:
        return f"{math.ceil(n / 2**20 * 10) / 10 if round_up else n / 2**20:.1f} MiB"
    return f"{math.ceil(n) if round_up else int(n):,} bytes"


def bad_id(value) -> bool:
    """True when `value` is not a valid table/task id (see the module doc)."""
    return not isinstance(value, str) or _ID.fullmatch(value) is None


def bad_dim(value) -> bool:
    """True when `value` is not a dim FBGEMM can measure (an integer multiple of 4 in 4..MAX_DIM)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return True
    return not (v.is_integer() and 0 < v <= MAX_DIM and int(v) % DIM_MULTIPLE == 0)


def seed(value, *, field: str = "seed", path: str | None = None) -> int:
    """A seed: an integer from 0 to MAX_SEED."""
    try:
        ok = float(value).is_integer() and 0 <= int(value) <= MAX_SEED
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise EmbshardError(f"invalid seed {number(value)}", path=path, field=field,
                            fix=f"give an integer from 0 to {MAX_SEED:,}")
    return int(value)


def input_file(path: str, *, field: str | None = None, fix: str = "check the path") -> str:
    """`path` if it is a local regular file that can be read; else one line saying why (not found, a folder, a
    FIFO or device: reading those could block forever, permission denied). URIs (s3://) pass through."""
    import os
    import stat

    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return text
    local = text.removeprefix("file://")
    try:
        st = os.stat(local)
    except FileNotFoundError:
        raise EmbshardError("file not found", path=text, field=field, fix=fix) from None
    except OSError as exc:
        raise EmbshardError(f"cannot access this file ({exc.strerror})", path=text, field=field, fix=fix) from None
    if stat.S_ISDIR(st.st_mode):
        raise EmbshardError("is a folder, not a file", path=text, field=field, fix="give the file itself")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise EmbshardError(f"is {kind}, not a regular file", path=text, field=field,
                            fix="give a regular file (copy the data to a file first)")
    if not os.access(local, os.R_OK):
        raise EmbshardError("permission denied: this file cannot be read", path=text, field=field,
                            fix="make it readable (chmod u+r) or run as a user who may read it")
    return text


def _yaml_mapping(text: str) -> bool:
    """Whether `text`, which is not JSON, reads as a YAML mapping (PyYAML: light, there with Airflow and MLflow)."""
    try:
        import yaml

        return isinstance(yaml.safe_load(text), dict)
    except Exception:  # noqa: BLE001 - not YAML either, or no PyYAML: the JSON error stands
        return False


def read_json_file(path, *, field: str | None = None, fix: str = "check the path"):
    """The JSON value in a file (a plan a user hands in): `input_file`'s checks first (a FIFO would block the read
    forever), then one line for a file that is no JSON, no UTF-8, or nested too deeply for the parser (a
    RecursionError), with `field` and `fix`. URIs are read through storage."""
    import json

    from . import storage

    text = input_file(path, field=field, fix=fix)
    try:
        content = storage.read_text(text)
        return json.loads(content)
    except json.JSONDecodeError as exc:
        if _yaml_mapping(content):  # a plan written in YAML (tables specs may be YAML): said as such
            raise EmbshardError("a YAML mapping, not JSON: plans are JSON", path=text, field=field,
                                fix="write it as JSON, e.g. python -c \"import json, sys, yaml; json.dump(yaml.safe_"
                                    "load(open(sys.argv[1])), sys.stdout, indent=1)\" FILE.yaml > plan.json") from None
        raise EmbshardError(f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})", path=text,
                            field=field, fix=fix) from None
    except UnicodeDecodeError:
        raise EmbshardError("not valid JSON (not UTF-8 text)", path=text, field=field, fix=fix) from None
    except RecursionError:
        raise EmbshardError("not a plan: its JSON is nested too deeply to read", path=text, field=field,
                            fix=fix) from None
    except FileNotFoundError:
        raise EmbshardError("file not found", path=text, field=field, fix=fix) from None
    except OSError as exc:
        if "://" in text and not text.startswith("file://"):  # a store that did not answer: try again (exit 75)
            from .errors import StoreUnreachableError

            raise StoreUnreachableError(f"cannot reach it ({exc.strerror or exc})", path=text, field=field,
                                        fix="check the bucket, the credentials (AWS_*) and the endpoint") from None
        raise EmbshardError(f"cannot be read ({exc.strerror or exc})", path=text, field=field, fix=fix) from None


def local_input_file(path, *, field: str | None = None, fix: str = "check the path") -> str:
    """The local path of a file that is read with plain file reads (a DLRM trace, a rows file, a spec): `file://`
    taken off, any other URI refused in one line (an s3:// trace had ended in a FileNotFoundError traceback), then
    checked as `input_file` checks it."""
    import os

    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise EmbshardError(f"is a {text.split('://', 1)[0]}:// URI, but this file is read from a local path only",
                            path=text, field=field, fix="copy it to a local or mounted path and give that path")
    local = text.removeprefix("file://")
    input_file(local, field=field, fix=fix)
    return local


def number(value) -> str:
    """A number for messages: plain Python formatting, never a numpy repr like np.float64(1.5)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return repr(value)
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:g}"


def devices(value, *, field: str = "devices", path: str | None = None) -> int:
    """A device count: an integer in 1..MAX_DEVICES."""
    try:
        ok = float(value).is_integer()
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or not 1 <= int(float(value)) <= MAX_DEVICES:
        raise EmbshardError(f"invalid device count {number(value)}", path=path, field=field,
                            fix=f"give an integer from 1 to {MAX_DEVICES}")
    return int(float(value))


def memory_gb(value, *, field: str = "memory_gb", path: str | None = None) -> float:
    """Memory per device in GiB: a finite number > 0 and at most MAX_MEMORY_GB."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or v <= 0 or v > MAX_MEMORY_GB:
        raise EmbshardError(f"invalid memory {number(value)} GiB", path=path, field=field,
                            fix=f"give a number of GiB > 0 and <= {MAX_MEMORY_GB:,.0f} (1 PiB)")
    return v


def gib_text(text: str) -> float:
    """A command line's GiB: a number, or one written with its unit ('16GiB', '16 GiB'); 'GB' is refused, since
    GB (10^9 bytes) and GiB (2^30) differ by 7%."""
    import argparse

    t = str(text).strip()
    unit = re.search(r"(?<=[0-9.])\s*([a-zA-Z]+)$", t)  # letters after a number ('nan' is a number's text)
    if unit is not None:
        if unit.group(1).lower() != "gib":
            raise argparse.ArgumentTypeError(f"{text!r}: the unit is GiB (2^30 bytes), not {unit.group(1)}; give "
                                             "a number of GiB, e.g. 16 or 16GiB")
        t = t[:unit.start()]
    if "_" in t:  # float() reads "1_6" as 16: a typo for 1.6 would give ten times the memory
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB (no '_' in it; e.g. 16 or 1.6)")
    try:
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB (e.g. 16 or 16GiB)") from None


def memory_bytes(gb, *, field: str = "memory_gb", path: str | None = None) -> int:
    return int(memory_gb(gb, field=field, path=path) * GiB)


def positive_finite(value, *, field: str, path: str | None = None, upper: float | None = None) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or v <= 0 or (upper is not None and v > upper):
        limit = f" and <= {number(upper)}" if upper is not None else ""
        raise EmbshardError(f"invalid value {number(value)}", path=path, field=field,
                            fix=f"give a finite number > 0{limit}")
    return v


# The policy's curriculum of task shapes (policy.curriculum): growing stages of table counts, or off.
DEFAULT_CURRICULUM = "10-50,50-200,200-1000"
CURRICULUM_OFF = "off"
MAX_CURRICULUM_TABLES = 10_000


def curriculum_stages(spec) -> list[tuple[int, int]]:
    """'10-50,50-200' -> [(10, 50), (50, 200)]; 'off' (or empty/None) -> []. Ranges must be 2 <= LO <= HI <=
    10,000 and must not shrink from one stage to the next."""
    if spec is None or str(spec).strip().lower() in ("", CURRICULUM_OFF, "none", "false"):
        return []
    fix = f"give 'off' or comma-separated LO-HI table ranges that grow, e.g. {DEFAULT_CURRICULUM}"
    stages: list[tuple[int, int]] = []
    for part in str(spec).split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise EmbshardError(f"invalid stage {part.strip()!r}", field="policy_curriculum", fix=fix) from None
        if not 2 <= a <= b <= MAX_CURRICULUM_TABLES:
            raise EmbshardError(f"invalid stage {a}-{b}", field="policy_curriculum", fix=fix)
        if stages and (a < stages[-1][0] or b < stages[-1][1]):
            raise EmbshardError(f"stage {a}-{b} is smaller than the one before", field="policy_curriculum", fix=fix)
        stages.append((a, b))
    return stages
