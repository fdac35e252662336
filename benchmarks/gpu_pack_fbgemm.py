"""Pack a reduced fbgemm-gpu CUDA wheel small enough to travel to a borrowed GPU machine (64 MiB per call).

    python -m benchmarks.gpu_pack_fbgemm OUT_DIR [--wheel PATH] [--version 1.6.0] [--arch 90]

writes OUT_DIR/fbgemm-red.tar.xz (the unpacked package, to extract into a folder on PYTHONPATH) and
OUT_DIR/fbgemm.sha256 (the archive's digest alone, as benchmarks/gpu_device_run.sh checks it).

FBGEMM pairs with torch: fbgemm-gpu 1.N <-> torch 2.(N+5); the device image has torch 2.11.0+cu130, so 1.6.0.
PyPI's fbgemm-gpu 1.6.0 manylinux wheel is the CUDA 13 build (its libraries NEED libcudart.so.13, checked
below); it is 465 MB zipped, 2.5 GB unpacked. Two reductions, neither touching a kernel that runs:

1. Libraries EXACT_SGD table-batched-embedding training does not use are dropped (inference, the dense,
   global-weight-decay and variable-batch backwards) and taken out of `fbgemm_gpu_libraries` in
   `fbgemm_gpu/__init__.py`; the script checks that no kept library NEEDs a dropped one.
2. In every kept library's `.nv_fatbin` section, the device-code payloads of the other architectures (sm_80,
   sm_100 in 1.6.0) are zeroed in each fat binary that also holds an sm_`arch` cubin. The entry headers stay, so
   the CUDA driver still finds and loads the sm_`arch` cubin, whose bytes are unchanged (checked by digest).
   Zeros compress to nothing in xz.

The dist-info RECORD is rewritten to match (dropped files removed, changed files re-hashed).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile

DROP = ["fbgemm_gpu_tbe_inference", "fbgemm_gpu_tbe_training_backward_dense",
        "fbgemm_gpu_tbe_training_backward_gwd", "fbgemm_gpu_tbe_training_backward_vbe"]
FATBIN_MAGIC = 0xBA55ED50
ELF_KIND = 2  # fat-binary entry kinds: 1 PTX, 2 cubin (ELF)


def elf_sections(b: bytes) -> dict[str, tuple[int, int]]:
    """name -> (file offset, size) of an ELF64 little-endian file's sections."""
    if b[:4] != b"\x7fELF" or b[4] != 2 or b[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    raw = [struct.unpack_from("<IIQQQQ", b, shoff + i * shentsize) for i in range(shnum)]
    stroff = raw[shstrndx][4]
    out = {}
    for name, _typ, _flags, _addr, off, size in raw:
        end = b.index(b"\0", stroff + name)
        out[b[stroff + name:end].decode()] = (off, size)
    return out


def elf_needed(b: bytes) -> list[str]:
    """The DT_NEEDED entries of an ELF64 shared library."""
    s = elf_sections(b)
    dyn_off, dyn_size = s[".dynamic"]
    str_off = s[".dynstr"][0]
    out = []
    for i in range(0, dyn_size, 16):
        tag, val = struct.unpack_from("<qQ", b, dyn_off + i)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            out.append(b[str_off + val:b.index(b"\0", str_off + val)].decode())
    return out


def fatbin_entries(b, start: int, size: int):
    """Yield (fatbin_start, [(kind, sm, payload_offset, padded_size), ...]) for each fat binary in a section."""
    p, end = start, start + size
    while p + 16 <= end:
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", b, p)
        if magic != FATBIN_MAGIC:
            p += 8  # fat binaries in the section are 8-byte aligned
            continue
        entries, q = [], p + hsize
        while q < p + hsize + fsize:
            kind, _ev, ehsize, padded = struct.unpack_from("<HHII", b, q)
            sm = struct.unpack_from("<I", b, q + 28)[0]
            entries.append((kind, sm, q + ehsize, padded))
            q += ehsize + padded
        if q != p + hsize + fsize:
            raise ValueError(f"fat binary at {p:#x}: entries do not add up to its size")
        yield p, entries
        p += hsize + fsize


def zero_other_archs(path: str, arch: int) -> dict:
    """Zero, in place, the cubin/PTX payloads of architectures other than `arch` in every fat binary of `path`
    that holds an sm_`arch` cubin. Returns counts and the digest of the kept sm_`arch` payloads before/after."""
    with open(path, "rb") as f:
        b = bytearray(f.read())
    secs = elf_sections(b)
    st = {"fatbins": 0, "without_arch": 0, "zeroed_bytes": 0, "kept_bytes": 0}
    if ".nv_fatbin" not in secs:
        return st
    off, size = secs[".nv_fatbin"]
    kept_before, kept_after = hashlib.sha256(), hashlib.sha256()
    plan = []
    for _p, entries in fatbin_entries(b, off, size):
        st["fatbins"] += 1
        if not any(k == ELF_KIND and sm == arch for k, sm, _, _ in entries):
            st["without_arch"] += 1  # left whole: the device would need another entry of it
            continue
        for kind, sm, po, n in entries:
            if kind == ELF_KIND and sm == arch:
                kept_before.update(b[po:po + n])
                st["kept_bytes"] += n
            else:
                plan.append((po, n))
    for po, n in plan:
        b[po:po + n] = bytes(n)
        st["zeroed_bytes"] += n
    for _p, entries in fatbin_entries(b, off, size):  # headers still parse; the kept cubins are unchanged
        if any(k == ELF_KIND and sm == arch for k, sm, _, _ in entries):
            for kind, sm, po, n in entries:
                if kind == ELF_KIND and sm == arch:
                    kept_after.update(b[po:po + n])
    if kept_before.digest() != kept_after.digest():
        raise AssertionError(f"{path}: the sm_{arch} cubins changed")
    with open(path, "wb") as f:
        f.write(b)
    return st


def download(version: str, dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", dest, f"fbgemm-gpu=={version}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    whl = [f for f in os.listdir(dest) if f.startswith(f"fbgemm_gpu-{version}-") and f.endswith(".whl")]
    if len(whl) != 1:
        raise SystemExit(f"expected one fbgemm_gpu-{version} wheel in {dest}, found {whl}")
    return os.path.join(dest, whl[0])


def record_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def rewrite_record(stage: str, dist_info: str, changed: set[str], dropped: set[str]) -> None:
    rec = os.path.join(stage, dist_info, "RECORD")
    lines = []
    with open(rec) as f:
        for line in f.read().splitlines():
            name = line.split(",", 1)[0]
            if name in dropped:
                continue
            if name in changed:
                line = f"{name},{record_hash(os.path.join(stage, name))},{os.path.getsize(os.path.join(stage, name))}"
            lines.append(line)
    with open(rec, "w") as f:
        f.write("\n".join(lines) + "\n")


def reduce_package(stage: str, arch: int, drop: list[str]) -> dict:
    pkg = os.path.join(stage, "fbgemm_gpu")
    init = os.path.join(pkg, "__init__.py")
    with open(init) as f:
        src = f.read()
    changed, dropped = {"fbgemm_gpu/__init__.py"}, set()
    for lib in drop:
        src, n = re.subn(rf'\n\s*"{re.escape(lib)}",', "", src)
        if n != 1:
            raise SystemExit(f"{lib!r} is not in fbgemm_gpu_libraries of this wheel")
        os.remove(os.path.join(pkg, lib + ".so"))
        dropped.add(f"fbgemm_gpu/{lib}.so")
    with open(init, "w") as f:
        f.write(src)
    sos = sorted(f for f in os.listdir(pkg) if f.endswith(".so"))
    cudart = set()
    for so in sos:
        with open(os.path.join(pkg, so), "rb") as f:
            needed = elf_needed(f.read())
        bad = [n for n in needed if n.removesuffix(".so") in drop]
        if bad:
            raise SystemExit(f"{so} NEEDs dropped {bad}")
        cudart.update(n for n in needed if n.startswith("libcudart"))
    stats = {}
    for so in sos:
        st = zero_other_archs(os.path.join(pkg, so), arch)
        if st["zeroed_bytes"]:
            changed.add(f"fbgemm_gpu/{so}")
        stats[so] = st
        print(f"  {so:<52} fatbins {st['fatbins']:>3} (without sm_{arch}: {st['without_arch']}) "
              f"zeroed {st['zeroed_bytes'] / 1e6:8.1f} MB, kept sm_{arch} {st['kept_bytes'] / 1e6:7.1f} MB", flush=True)
    dist_info = [d for d in os.listdir(stage) if d.endswith(".dist-info")][0]
    rewrite_record(stage, dist_info, changed, dropped)
    return {"cudart": sorted(cudart), "libraries": sos, "stats": stats}


def write_archive(stage: str, out: str) -> None:
    """A reproducible tar.xz of the staged folder (sorted names, fixed owner and mtime), written with the xz
    binary's threads where it exists (the archive is still one plain .xz stream that Python's lzma reads)."""
    def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        ti.mtime = 0
        return ti

    tmp = out + ".tar"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(stage):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                tar.add(full, arcname=os.path.relpath(full, stage), filter=norm, recursive=False)
    if shutil.which("xz"):
        with open(out, "wb") as f:
            subprocess.run(["xz", "-9e", "-T0", "-c", tmp], stdout=f, check=True)
    else:
        with open(tmp, "rb") as src, lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--wheel", help="an already downloaded fbgemm_gpu wheel (else pip downloads it)")
    ap.add_argument("--version", default="1.6.0")
    ap.add_argument("--arch", type=int, default=90, help="the SM architecture whose cubins stay (90: H100/H200)")
    ap.add_argument("--work", help="scratch folder (default: a temporary one, removed after)")
    a = ap.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    work = a.work or tempfile.mkdtemp(prefix="fbgemm-pack-")
    try:
        wheel = a.wheel or download(a.version, os.path.join(work, "dl"))
        print("wheel:", os.path.basename(wheel), f"{os.path.getsize(wheel) / 1e6:.1f} MB", flush=True)
        stage = os.path.join(work, "stage")
        shutil.rmtree(stage, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
            version = re.search(r"^Version: (\S+)", z.read(meta[0]).decode(), re.M).group(1)
            if version != a.version:
                raise SystemExit(f"the wheel is fbgemm_gpu {version}, not {a.version}")
            z.extractall(stage)
        info = reduce_package(stage, a.arch, DROP)
        print("CUDA runtime the libraries NEED:", ", ".join(info["cudart"]))
        if not any(c.startswith("libcudart.so.13") for c in info["cudart"]):
            raise SystemExit("this wheel is not the CUDA 13 build (the device's torch is cu130, driver 580)")
        out = os.path.join(a.out_dir, "fbgemm-red.tar.xz")
        write_archive(stage, out)
        with open(out, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        with open(os.path.join(a.out_dir, "fbgemm.sha256"), "w") as f:
            f.write(digest + "\n")
        print(f"{out}: {os.path.getsize(out) / 2**20:.1f} MiB, sha256 {digest}")
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
