"""`embshard <command>`: one entry point for people and pods.

Each command lives in its stage's `cli` module, which defines `configure(parser)` and `main(args) -> int`
and keeps heavy imports (torch, mlflow) inside `main` so that `embshard --help` stays fast.
Bad input raises EmbshardError: printed as one line on stderr, exit code 2 (75 for a store that did not answer:
errors.StoreUnreachableError).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys

from .errors import EmbshardError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ingest": ("embshard.jobs.ingest", "read tables (DLRM traces, spec files, synthetic) into tables.parquet"),
    "tasks": ("embshard.jobs.tasks", "sample train/test placement tasks into tasks.parquet"),
    "bench": ("embshard.jobs.bench", "measure fused device-shard costs into costs/part-*.parquet"),
    "train-cost": ("embshard.jobs.train_cost", "train the cost model and register embshard-cost"),
    "train-policy": ("embshard.outer_loop", "train the placement policy and register embshard-policy"),
    "predict": ("embshard.jobs.predict", "predict device-shard costs (with intervals) with the cost model"),
    "place": ("embshard.jobs.place", "place tables on devices with a planner"),
    "evaluate": ("embshard.jobs.evaluate", "measure several planners' placements side by side"),
    "export": ("embshard.jobs.export", "export placements (plan.json, Parquet, TorchRec plan)"),
    "champion": ("embshard.jobs.champion", "list the registered planners; --set VERSION rolls the champion back"),
    "prune": ("embshard.prune", "delete old runs' folders and logs and unaliased old registry versions"),
    "pipeline": ("embshard.pipeline", "run the whole Airflow DAG locally"),
    "ui": ("embshard.airflow_local", "start a real local Airflow (UI, scheduler) that runs the pipeline DAG"),
    "stage": ("embshard.stages", "run one pipeline stage on a run root (what the DAG's tasks and pods run)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line naming the option and the fix, exit code 2."""

    help_prog: str | None = None  # the command an error is of (the top parser reports a command's unknown options)

    def error(self, message: str):
        prog = self.help_prog or self.prog
        self.exit(2, f"{prog}: error: {message} (fix: see `{prog} --help`)\n")


def _command_of(argv: list[str]) -> str | None:
    """The subcommand in argv: the first word that is not an option (the top-level options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


ALL_COMMANDS = "*"


def build_parser(command: str | None = ALL_COMMANDS) -> _Parser:
    """The parser. Only `command`'s module is imported (each pulls in its own stack: pandas, torch, MLflow,
    Airflow), none for None, so `embshard --help` and one command's errors do not pay for all the others;
    ALL_COMMANDS (the default) imports every one (all options known: docs, tests)."""
    from .version import __version__

    # No abbreviated options: `--rows 1000` had been taken as `--rows-file 1000` ("file not found"), and a script's
    # abbreviation would change meaning when a later version adds an option that shares its prefix.
    parser = _Parser(prog="embshard", description="Learned embedding-table sharding.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"embshard {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if command != ALL_COMMANDS and name != command:
            if importlib.util.find_spec(module) is not None:  # listed in --help: no import
                sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("embshard"):
                continue  # a stage not built in this version
            raise
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        mod.configure(p)
        p.set_defaults(_main=mod.main, _output=getattr(mod, "OUTPUT", None))
    return parser


def quiet_third_party() -> None:
    """Keep a command's output to what it says itself: libraries' warnings and INFO chatter only with -v."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("mlflow", "alembic", "root", "torchrec", "fbgemm_gpu", "urllib3", "git"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("embshard").setLevel(logging.INFO)


def check_output(args: argparse.Namespace) -> None:
    """The one place every command's --out is checked before any work (storage.check_output): a module's
    OUTPUT = {"kind": "folder" | "file", "writes": names under the folder, "inputs": option names it reads,
    "suffixes": the file formats it writes, "option": the option naming it, default "out"} says what it writes
    and reads."""
    spec = getattr(args, "_output", None)
    option = (spec or {}).get("option", "out")  # the option that names the output ("root" for `embshard stage`)
    if not spec or getattr(args, option, None) is None:
        return
    from . import storage

    inputs = {"--" + name.replace("_", "-"): getattr(args, name, None) for name in spec.get("inputs", ())}
    storage.check_output(getattr(args, option), kind=spec.get("kind", "folder"), writes=tuple(spec.get("writes", ())),
                         inputs=inputs, suffixes=tuple(spec.get("suffixes", ())), field=option)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-v" not in argv and "--verbose" not in argv:
        # Before any library is imported: MLflow reads its log level once, at import.
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        quiet_third_party()
    command = _command_of(argv)
    parser = build_parser(command if command in COMMANDS else None)  # None: only the list of commands
    if command in COMMANDS:  # an option the command does not have is reported by the top parser
        parser.help_prog = f"embshard {command}"
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:
        quiet_third_party()
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    from . import signals

    signals.stop_on_sigterm(fresh=True)  # `kill` stops a command as Ctrl-C does (embshard.signals)
    from .run_context import bars_as_lines

    try:
        check_output(args)
        with bars_as_lines():
            return int(args._main(args) or 0)
    except EmbshardError as exc:
        print(f"embshard {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        code = signals.exit_code()
        print(f"embshard {args.command}: {'terminated' if code == 143 else 'interrupted'}", file=sys.stderr)
        return code
    except Exception as exc:  # an MLflow store that cannot be used at all: one line, not SQLAlchemy's traceback
        from .errors import disk_error
        from .registry import store_error

        err = disk_error(exc) or store_error(exc)  # a full or read-only disk: one line too (it had been a traceback)
        if err is None:
            raise
        print(f"embshard {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code


def console_main() -> int:
    """The `embshard` command: `main`, then a signal in the second the interpreter takes to exit (atexit handlers,
    threads) is ignored: the command has finished and published its output, and an exit 130 there said it was
    interrupted (a user's Ctrl-C just after "wrote ..."). In-process callers (tests) keep their handlers."""
    import signal

    rc = main()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return rc


if __name__ == "__main__":
    sys.exit(console_main())
