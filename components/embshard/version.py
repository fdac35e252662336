"""The package version (a module of its own: importing it pulls in nothing heavy)."""
from __future__ import annotations

import functools
import os
import subprocess

__version__ = "0.1.0"


def code_version(fresh: bool = False) -> str:
    """The version of the code that runs (_code_version), read once per process; `fresh`: read again now (a stage
    of a long-running process, `embshard pipeline`, checking that the checkout did not change under the run: its
    later stages import modules of the new code)."""
    if fresh:
        _code_version.cache_clear()
    return _code_version()


@functools.cache
def _code_version() -> str:
    """The version of the code that runs, for lineage (model-version tags, plan.json): EMBSHARD_CODE_VERSION when
    set (an image built without .git bakes it in), else __version__ with the git commit of a checkout the
    package runs from ("0.1.0+g1a2b3c4d5e6f", ".dirty" appended when tracked files differ from it), else __version__.
    The package version alone could not tell apart runs of different code (every plan said 0.1.0)."""
    given = os.environ.get("EMBSHARD_CODE_VERSION", "").strip()
    if given:
        return given
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", here],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+g{sha}{'.dirty' if dirty else ''}" if sha else __version__
