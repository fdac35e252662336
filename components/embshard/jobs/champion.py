"""`embshard champion`: which registered planner training jobs load (`models:/embshard-policy@champion`), every
version with its gate verdict, and `--set VERSION` to roll the champion back (or forward) by hand.

The promotion gate (jobs/promote.py) moves the aliases after measuring; an incident needs a way to move them
without a run: `--set` moves `embshard-policy@champion` and `embshard-cost@champion` together (the cost model
the policy was trained against, as the gate does), drops `challenger` when it is that version, and records who
set it, when and why on the version (CHAMPION_SET_TAG), so the registry says why it is champion. A version the
gate measured slower, or that its run never finished, needs `--force`. Later gates judge their candidates against
whatever is champion then.
"""
from __future__ import annotations

import argparse
import getpass
import os
import socket

from .. import registry
from ..errors import EmbshardError, ModelNotFoundError

POLICY, COST = registry.POLICY_MODEL, registry.COST_MODEL
CHAMPION_SET_TAG = "champion_set_by"  # "<user>@<host> <UTC time>: <reason>" on a version made champion by hand
# Gate verdicts that a champion set by hand must override knowingly (--force).
NEEDS_FORCE = (registry.SLOWER, registry.INFEASIBLE, registry.FAILED_RUN)

OUTPUT = None  # writes nothing but registry aliases and tags


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="version", default=None, metavar="VERSION",
                   help="make this embshard-policy version the champion (and its cost model embshard-cost's); "
                        "without it: list the versions")
    p.add_argument("--reason", default=None, help="why, recorded on the version (required with --set)")
    p.add_argument("--force", action="store_true",
                   help=f"set a version whose gate verdict is {', '.join(NEEDS_FORCE)}")


def main(args: argparse.Namespace) -> int:
    if args.version is None and (args.reason is not None or args.force):  # it had listed, the flag ignored
        flag = "--reason" if args.reason is not None else "--force"
        raise EmbshardError(f"{flag} goes with --set (without --set the versions are only listed)", field="set",
                            fix="give --set VERSION to make that version the champion, or drop " + flag)
    store = registry.tracking_uri()
    missing = registry.no_store_error(registry.POLICY_CHAMPION_URI, store)  # nothing is created where it runs
    if missing is not None:
        raise missing
    registry.connect()
    registry.check_server(store)
    if args.version is None:
        print(versions_table())
        return 0
    if not (args.reason or "").strip():
        raise EmbshardError("a champion set by hand needs a reason", field="reason",
                            fix='give --reason "..." (recorded on the version, e.g. the incident it answers)')
    if _is_champion_already(args.version):
        # Nothing to move: setting it again would only replace the gate's reason with this one in the listing.
        print(f"embshard-policy@champion is version {str(args.version).strip()} already, with its cost model: "
              "nothing changed")
        print(versions_table())
        return 0
    before, cost = set_champion(args.version, args.reason, force=args.force)
    print(f"embshard-policy@champion: version {before or '(none)'} -> {args.version}; embshard-cost@champion -> "
          f"{cost or '(unchanged: the version names no cost model)'}")
    print(versions_table())
    return 0


def _is_champion_already(version) -> bool:
    """Whether policy `version` is the champion and the cost model it names holds the cost alias too."""
    current = registry.version_for_alias(POLICY, registry.CHAMPION)
    if current is None or str(current.version) != str(version).strip():
        return False
    cost = registry.followed_cost_model(current)
    if cost is None:
        return True  # a cost model the alias does not follow
    held = registry.version_for_alias(registry.COST_MODEL, registry.CHAMPION)
    return held is not None and str(held.version) == cost


def set_champion(version, reason: str, *, force: bool = False) -> tuple[str | None, str | None]:
    """Make policy `version` the champion by hand (module docstring); returns (the champion it replaced, the cost
    model version that followed), None where there is none. One-line errors: no such version, its files gone, or
    a verdict that needs `force`."""
    import mlflow
    from mlflow.exceptions import MlflowException

    version = str(version).strip()
    if not version.isdigit():
        raise EmbshardError(f"version {version!r} is not a version number", field="set",
                            fix="give a version listed by `embshard champion`")
    client = mlflow.MlflowClient()
    try:
        mv = client.get_model_version(POLICY, version)
    except MlflowException:
        raise ModelNotFoundError(f"{POLICY} has no version {version}", path=mlflow.get_registry_uri(), field="set",
                                 fix="give a version listed by `embshard champion`") from None
    verdict = mv.tags.get(registry.VERDICT_TAG, "")
    if verdict in NEEDS_FORCE and not force:
        raise EmbshardError(f"version {version}'s gate verdict is {verdict} "
                            f"({mv.tags.get(registry.VERDICT_REASON_TAG, 'no reason recorded')[:120]})",
                            field="set", fix="give --force to make it champion anyway, or choose another version")
    uri = f"models:/{POLICY}/{version}"
    files = registry.local_artifacts(uri)
    if files is not None:  # a local store: the files a training job will load must be there
        missing = [p for p in files.values() if not os.path.exists(p)]
        if missing:
            raise ModelNotFoundError(f"version {version} is registered but its files are missing ({missing[0]})",
                                     path=uri, field="set", fix="choose a version whose files are there")
    before = registry.version_for_alias(POLICY, registry.CHAMPION)
    from .. import signals

    with signals.deferred():  # the two aliases move together or not at all (a SIGTERM waits for both)
        registry.set_alias(POLICY, registry.CHAMPION, version)
        cost = registry.follow_cost_model(version, registry.CHAMPION)
    challenger = registry.version_for_alias(POLICY, registry.CHALLENGER)
    if challenger is not None and str(challenger.version) == version:
        registry.drop_challenger()
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    client.set_model_version_tag(POLICY, version, CHAMPION_SET_TAG,
                                 f"{who} {registry.utc_now()}: {reason.strip()}"[:500])
    if before is not None and str(before.version) != version:
        registry.mark_replaced(before.version, f"version {version} was set by hand by {who}: {reason.strip()}")
    return (None if before is None else str(before.version)), cost


def versions_table() -> str:
    """Every embshard-policy version, newest first: aliases, gate verdict (and reason), health, its cost model,
    the run that made it, and who set it champion by hand (when one did)."""
    import mlflow

    client = mlflow.MlflowClient()
    try:
        found: list = list(client.search_model_versions(f"name='{POLICY}'"))
    except Exception:  # no registered model yet reads as none
        found = []
    if not found:
        return f"no {POLICY} versions in {mlflow.get_registry_uri()} (a pipeline run registers the first)"
    aliases: dict[str, list[str]] = {}
    for alias in (registry.CHAMPION, registry.CHALLENGER):
        mv = registry.version_for_alias(POLICY, alias)
        if mv is not None:
            aliases.setdefault(str(mv.version), []).append(alias)
    lines = [f"{POLICY} in {mlflow.get_registry_uri()} (training jobs load models:/{POLICY}@champion):",
             f"{'version':>7}  {'aliases':<19} {'verdict':<18} {'health':<9} {'cost':>5}  {'made by':<44} note"]
    for mv in sorted(found, key=lambda m: -int(m.version)):
        t = mv.tags
        made = t.get("airflow.run_id") or "a command-line run"
        champion_now = registry.CHAMPION in aliases.get(str(mv.version), [])
        note = (f"set champion by hand: {t[CHAMPION_SET_TAG]}" if CHAMPION_SET_TAG in t and champion_now else
                t[registry.REPLACED_TAG] if registry.REPLACED_TAG in t and not champion_now else
                t.get(registry.VERDICT_REASON_TAG, ""))
        lines.append(f"{mv.version:>7}  {','.join(aliases.get(str(mv.version), [])) or '-':<19} "
                     f"{t.get(registry.VERDICT_TAG, '-'):<18} {t.get(registry.HEALTH_TAG, '-'):<9} "
                     f"{t.get('cost_model_version', '-'):>5}  {made[:44]:<44} {note[:110]}")
    return "\n".join(lines)
