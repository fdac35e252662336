"""Paths and URIs for run data: local folders, file:// and s3:// roots, atomic writes.

Stages exchange Parquet under one run-scoped root. Writes go to a temporary name beside the target and are
renamed into place, so a killed process never leaves a half-written file that a later stage would read.
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pyarrow.fs as pafs


def resolve(uri: str | os.PathLike, field: str | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a local path, file:// or s3:// URI (`field`: the option or param that named it, for
    the error of a store that does not answer)."""
    text = os.fspath(uri)
    if "://" not in text:
        return pafs.LocalFileSystem(), os.path.abspath(text)
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except OSError as exc:  # on AWS, resolving the bucket's region asks the store
        from .errors import EmbshardError, StoreUnreachableError, first_line

        fix = "check the bucket, the credentials (AWS_*), the region (AWS_REGION) and the endpoint, or use a local path"
        # a store that did not answer is worth another try (exit 75); a refusal (no such bucket, access denied) is not
        unreachable = any(w in str(exc) for w in ("NETWORK_CONNECTION", "curlCode", "imeout", "Connection"))
        error = StoreUnreachableError if unreachable else EmbshardError
        raise error(f"cannot {'reach' if unreachable else 'resolve'} it ({first_line(exc, 140)})", path=text,
                    field=field, fix=fix) from None
    return fs, path


def resolve_input(uri: str | os.PathLike, field: str | None = None) -> tuple[pafs.FileSystem, str]:
    """`resolve`, with a URI no file system takes (foo://, s3:/// without a bucket) refused in one line, exit 2: a
    mistake in the path, not a store that did not answer."""
    from .errors import EmbshardError, first_line

    try:
        return resolve(uri, field)
    except ValueError as exc:
        raise EmbshardError(f"not a path or URI embshard reads ({first_line(exc, 120)})", path=os.fspath(uri),
                            field=field, fix="give a local path, file:// or s3://bucket/key") from None


def join(root: str | os.PathLike, *parts: str) -> str:
    """Join path parts onto a root that may be a URI."""
    text = os.fspath(root)
    if "://" in text:
        return posixpath.join(text, *parts)
    return os.path.join(text, *parts)


def exists(uri: str | os.PathLike) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def makedirs(uri: str | os.PathLike) -> None:
    fs, path = resolve(uri)
    fs.create_dir(path, recursive=True)


def list_files(uri: str | os.PathLike, suffix: str = "") -> list[str]:
    """Files directly under a folder (sorted), as URIs/paths in the same form as `uri`."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.Directory:
        return []
    selector = pafs.FileSelector(path, recursive=False)
    names = sorted(i.base_name for i in fs.get_file_info(selector)
                   if i.type == pafs.FileType.File and i.base_name.endswith(suffix)
                   and not i.base_name.startswith("."))
    return [join(uri, n) for n in names]


@contextlib.contextmanager
def atomic_write(uri: str | os.PathLike, mode: str = "wb") -> Iterator:
    """Open a temporary file beside `uri`; on success rename it onto `uri`, on error delete it."""
    fs, path = resolve(uri)
    parent = posixpath.dirname(path) if "://" in os.fspath(uri) else os.path.dirname(path)
    fs.create_dir(parent, recursive=True)
    tmp = (posixpath if "://" in os.fspath(uri) else os.path).join(
        parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with fs.open_output_stream(tmp) as raw:
            if "b" in mode:
                yield raw
            else:
                import io
                text = io.TextIOWrapper(raw, encoding="utf-8")
                yield text
                text.flush()
                text.detach()
        fs.move(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.delete_file(tmp)
        raise


def existing_folder(path: str) -> str:
    """`path` if it is a local folder, else its nearest existing ancestor (room for temporary files that does
    not create the output folder before anything is written to it)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


STAGE_PREFIX = ".embshard-stage-"


def _target_key(out: str | os.PathLike) -> str:
    """A short key of the output a stage folder is for: its name says whose it is (`<prefix><key>-<pid>-...`)."""
    import hashlib

    text = os.fspath(out)
    text = os.path.abspath(text) if "://" not in text else text
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def remove_abandoned_stages(parent: str, out: str | os.PathLike) -> list[str]:
    """Delete the stage folders a killed earlier run for the same `out` left in `parent` (its process is gone);
    returns them. Stage folders of other outputs, or of a run still going, are left alone."""
    prefix = f"{STAGE_PREFIX}{_target_key(out)}-"
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if not name.startswith(prefix):
                continue
            pid = name[len(prefix):].split("-", 1)[0]
            # our own pid: a process before us (a restarted pod) had it, since ours made nothing yet
            if pid.isdigit() and (int(pid) == os.getpid() or not process_alive(int(pid))):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                removed.append(name)
    return removed


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[str]:
    """A local temporary folder for a command's outputs, published under `out` only if the block succeeds.

    A failed command leaves nothing: not a half-set of files, not an empty `out`. A killed one leaves its stage
    folder, named after `out` and its process id (`.embshard-stage-<key of out>-<pid>-...`), which the next run
    into the same `out` removes at its start. Each file is published with
    atomic_write (a reader never sees half a file); the window in which only some files are published is the
    copy of small files at the very end.
    """
    local = "://" not in os.fspath(out)
    parent = existing_folder(os.fspath(out)) if local else None
    prefix = f"{STAGE_PREFIX}{_target_key(out)}-{os.getpid()}-"
    if parent is not None:
        remove_abandoned_stages(parent, out)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in sorted(files):
                src = os.path.join(root, name)
                rel = os.path.relpath(src, tmp).split(os.sep)
                if local:
                    dest = os.path.join(os.fspath(out), *rel)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    os.replace(src, dest)  # same file system: an atomic rename
                else:
                    with open(src, "rb") as r, atomic_write(join(out, *rel)) as w:
                        shutil.copyfileobj(r, w)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def local_path(text: str) -> str | None:
    """The local path of a local path or file:// URI, else None."""
    if text.startswith("file://"):
        return text[len("file://"):]
    return None if "://" in text else text


def check_output(out: str | os.PathLike, *, kind: str = "folder", writes: tuple[str, ...] = (),
                 inputs: dict[str, object] | None = None, field: str = "out", suffixes: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, an output a command could not write or that would destroy one of its inputs.

    `kind` "folder" (the command writes `writes` under it) or "file"; `inputs` maps option names (e.g.
    "--tables") to the paths the command reads (None, a path, or a list of paths). Checks, each one line naming
    the path, the option and the fix: the output is none of the inputs (nor is any file it writes), an existing
    file is not given as a folder nor a folder as a file, a folder the command writes is not a file and a file
    is not a folder, a file has one of `suffixes` (when given),
    the nearest existing folder is writable, and a remote store (s3://) answers.
    """
    from .errors import EmbshardError, StoreUnreachableError, first_line

    text = os.fspath(out)
    flag = "--" + field.replace("_", "-")
    if not text.strip():
        raise EmbshardError("empty path", field=field, fix=f"give {flag} a path")
    local = local_path(text)
    if local is None:  # a remote store: reachable now, not after minutes of work
        fs, path = resolve_input(text, field)
        try:
            info = fs.get_file_info(path)
        except OSError as exc:
            raise StoreUnreachableError(f"cannot reach it ({first_line(exc, 140)})", path=text, field=field,
                                        fix="check the bucket, the credentials (AWS_*) and the endpoint, or write to "
                                            "a local folder") from None
        if kind == "folder" and info.type == pafs.FileType.File:
            raise EmbshardError("is a file, not a folder", path=text, field=field, fix=f"give {flag} a folder")
        return
    if os.path.islink(local) and not os.path.exists(local):  # it failed after the work, in a traceback
        raise EmbshardError(f"is a link to {os.readlink(local)}, which does not exist", path=text, field=field,
                            fix=f"give {flag} a folder, or create what the link points to")
    path = os.path.realpath(os.path.abspath(local))
    targets = [path] + [os.path.realpath(os.path.join(path, w)) for w in writes]
    for option, given in (inputs or {}).items():
        for inp in given if isinstance(given, (list, tuple)) else [given]:
            inp_local = None if inp is None else local_path(os.fspath(inp))  # type: ignore[arg-type]
            if not inp_local:
                continue
            real = os.path.realpath(os.path.abspath(inp_local))
            inside = [t for t in targets[1:] if real.startswith(t.rstrip(os.sep) + os.sep)]
            if real == path:
                why = f"is the {option} input"
            elif real in targets:
                why = f"would overwrite the {option} input {inp_local}"
            elif inside:
                why = f"would overwrite the {option} input {inp_local} (inside {inside[0]})"
            else:
                continue
            raise EmbshardError(why, path=text, field=field,
                                fix=f"write {flag} somewhere else; inputs are never overwritten")
    if kind == "file" and os.path.isdir(path):
        raise EmbshardError("is a folder, not a file", path=text, field=field,
                            fix=f"give {flag} a file name (e.g. {os.path.join(text, 'out.parquet')})")
    if kind == "file" and suffixes and not text.lower().endswith(suffixes):  # the suffix chooses the format
        raise EmbshardError("unknown output format", path=text, field=field,
                            fix=f"name the file {' or '.join(suffixes)}")
    if kind == "folder":
        if os.path.exists(path) and not os.path.isdir(path):
            raise EmbshardError("is a file, not a folder", path=text, field=field,
                                fix=f"give {flag} a folder (it is created), or remove the file")
        for w in writes:
            target = os.path.join(path, w)
            if os.path.isdir(target) and "." in os.path.basename(w):
                raise EmbshardError(f"{w} there is a folder, where a file is written", path=text, field=field,
                                    fix=f"remove or rename {target}, or write {flag} elsewhere")
    existing = path if kind == "folder" else os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise EmbshardError(f"{existing} is a file, so it cannot be created", path=text, field=field,
                            fix=f"give {flag} a path under a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise EmbshardError(f"folder {existing} is not writable", path=text, field=field,
                            fix=f"write {flag} to a folder you can write to, or change its permissions")
    _remove_stale_probes(existing)
    try:  # what os.access cannot tell (a read-only or virtual file system such as /proc, root's access)
        os.rmdir(tempfile.mkdtemp(prefix=".embshard-probe-", dir=existing))
    except OSError as exc:
        raise EmbshardError(f"nothing can be created in {existing} ({exc.strerror or exc})", path=text,
                            field=field, fix=f"write {flag} to a folder you can write to") from None


PROBE_STALE_S = 60.0  # an empty probe folder older than this was left by a command killed while it probed


def _remove_stale_probes(folder: str) -> None:
    """Empty `.embshard-probe-*` folders a killed command left in `folder` (nothing else removed them). Only old
    and empty ones: another command's probe lives for a moment, and rmdir leaves anything with content alone."""
    import glob
    import time

    for probe in glob.glob(os.path.join(glob.escape(folder), ".embshard-probe-*")):
        try:
            if time.time() - os.path.getmtime(probe) > PROBE_STALE_S:
                os.rmdir(probe)
        except OSError:
            pass


def remove(uri: str | os.PathLike) -> None:
    """Delete one file if it is there (local or object store)."""
    if exists(uri):
        fs, where = resolve(uri)
        fs.delete_file(where)


def remove_dir(uri: str | os.PathLike) -> None:
    """Delete a folder and everything in it if it is there (local or object store)."""
    if exists(uri):
        fs, where = resolve(uri)
        fs.delete_dir(where)


def write_text(uri: str | os.PathLike, text: str) -> None:
    with atomic_write(uri, "w") as f:
        f.write(text)


def read_text(uri: str | os.PathLike) -> str:
    return read_head(uri).decode("utf-8")


def read_head(uri: str | os.PathLike, size: int | None = None) -> bytes:
    """The first `size` bytes of a file or URI (all of it when None)."""
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read() if size is None else f.read(size)
