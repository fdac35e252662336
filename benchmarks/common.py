"""Small shared pieces of the harness: progress lines, the hardware line, Markdown tables, plots' backend."""
from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field

_START = time.perf_counter()


def progress(msg: str) -> None:
    """One progress line, prefixed with the harness's elapsed time."""
    el = time.perf_counter() - _START
    print(f"[bench {int(el // 60):02d}:{int(el % 60):02d}] {msg}", flush=True)


@dataclass
class Hardware:
    cpu: str
    cores: int
    threads: int
    versions: dict = field(default_factory=dict)

    def line(self) -> str:
        v = ", ".join(f"{k} {val}" for k, val in self.versions.items())
        return (f"{self.cpu} ({self.cores} logical cores, measurements with {self.threads} thread(s)); "
                f"Python {platform.python_version()}; {v}")


def hardware() -> Hardware:
    from importlib import metadata

    from embshard.bench.backends import hardware as hw_name
    from embshard.bench.backends import num_threads

    versions = {}
    for pkg in ("torch", "fbgemm-gpu-cpu", "torchrec", "mlflow", "apache-airflow"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return Hardware(cpu=hw_name("cpu").removeprefix("cpu:"), cores=os.cpu_count() or 1, threads=num_threads(),
                    versions=versions)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, (bool,)):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        if x != 0 and (abs(x) >= 10**5 or abs(x) < 10**-digits):
            return f"{x:.2e}"
        return f"{x:.{digits}f}"
    return str(x)


def md_table(df, digits: int | dict = 3, index: bool = False) -> str:
    """A GitHub Markdown table of a DataFrame (NaN as an en dash); `digits` per column or for all."""
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    if index:
        df = df.reset_index()
    cols = list(df.columns)
    lines = ["| " + " | ".join(str(c) for c in cols) + " |",
             "| " + " | ".join("---:" if is_numeric_dtype(df[c]) and not is_bool_dtype(df[c]) else "---"
                               for c in cols) + " |"]
    for row in df.itertuples(index=False):
        cells = []
        for c, v in zip(cols, row):
            d = digits.get(c, 3) if isinstance(digits, dict) else digits
            cells.append(fmt(v.item() if hasattr(v, "item") else v, d))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_text(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
