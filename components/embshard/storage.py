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
from typing import Iterator

import pyarrow.fs as pafs


def resolve(uri: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a local path, file:// or s3:// URI."""
    text = os.fspath(uri)
    if "://" not in text:
        return pafs.LocalFileSystem(), os.path.abspath(text)
    fs, path = pafs.FileSystem.from_uri(text)
    return fs, path


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


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[str]:
    """A local temporary folder for a command's outputs, published under `out` only if the block succeeds.

    A failed command leaves nothing: not a half-set of files, not an empty `out`. Each file is published with
    atomic_write (a reader never sees half a file); the window in which only some files are published is the
    copy of small files at the very end.
    """
    local = "://" not in os.fspath(out)
    tmp = tempfile.mkdtemp(prefix=".embshard-stage-",
                           dir=existing_folder(os.fspath(out)) if local else None)
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


def write_text(uri: str | os.PathLike, text: str) -> None:
    with atomic_write(uri, "w") as f:
        f.write(text)


def read_text(uri: str | os.PathLike) -> str:
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read().decode("utf-8")
