"""The registered form of the learned planner: policy weights + the cost model it was trained against.

One MLflow pyfunc model holds both, so `models:/embshard-policy@champion` needs nothing else to plan. As a
pyfunc it also predicts: a tables DataFrame in (tables contract), params num_devices and
memory_bytes_per_device, a placements DataFrame out. (Moved here from policy.model: the policy does not import
the planners. Policy versions registered before the move pickled `embshard.policy.model.PolicyPythonModel`.)
"""
from __future__ import annotations

import functools
import logging
import numbers
from typing import Any

import pandas as pd  # module level: MLflow resolves the predict signature's type hints in this module

from ..errors import EmbshardError
from ..registry import POLICY_CHAMPION_URI
from .learned import LearnedPlanner

log = logging.getLogger(__name__)


def __getattr__(name: str):
    # The pyfunc class subclasses MLflow's PythonModel, and importing mlflow.pyfunc takes seconds: it is built on
    # first use (registering, unpickling by MLflow), never by `embshard place`, which reads the artifacts itself.
    if name == "PolicyPythonModel":
        return _policy_python_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _policy_python_model() -> Any:
    from mlflow.pyfunc import PythonModel  # mypy does not see mlflow.pyfunc.PythonModel (mlflow.pyfunc is lazy)

    from ..policy import model as _policy_model

    class PolicyPythonModel(PythonModel):
        """pyfunc wrapper: load_context restores the policy and its cost model from the logged artifacts."""

        def load_context(self, context):
            self.policy, self.cost_model, self.config = bundle_from_artifacts(context.artifacts)

        def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:  # noqa: ARG002 (MLflow's signature)
            from .. import checks
            from ..costmodel.scoring import placement_costs
            from ..errors import EmbshardError
            from ..tableset import TableSet
            from ..types import DeviceTopology

            params = params or {}
            for key in ("num_devices", "memory_bytes_per_device", "devices_per_host"):  # int() would cut 0.5 to 0
                value = params.get(key)
                if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) \
                        and not float(value).is_integer():  # numpy floats too
                    raise EmbshardError(f"{key} is a whole number ({'bytes' if 'bytes' in key else 'devices'}), "
                                        f"got {value}", field=key,
                                        fix="give memory in bytes, e.g. 80 * 2**30 for 80 GiB" if "bytes" in key
                                        else "give a whole number of devices")
            devices, memory = int(params.get("num_devices") or 0), int(params.get("memory_bytes_per_device") or 0)
            bad = [(k, v) for k, v in (("num_devices", devices), ("memory_bytes_per_device", memory)) if v <= 0]
            if bad:  # MLflow passes a param the call leaves out as its signature's default, 0
                raise EmbshardError("; ".join(f"{k} is {v}" + (" (0: not given, or given as 0)" if v == 0 else "")
                                              for k, v in bad),
                                    field=bad[0][0] if len(bad) == 1 else "params",
                                    fix="call predict(tables, params={'num_devices': D, "
                                        "'memory_bytes_per_device': BYTES}) (the task's own; memory in bytes, e.g. "
                                        "80 * 2**30 for 80 GiB)")
            if memory > checks.MAX_MEMORY_GB * checks.GiB:  # as `embshard place --memory-gb` refuses it
                raise EmbshardError(f"{memory:,} bytes per device is more than {checks.MAX_MEMORY_GB:,.0f} GiB "
                                    "(1 PiB)", field="memory_bytes_per_device",
                                    fix="give memory in bytes, e.g. 80 * 2**30 for 80 GiB")
            # Versions registered before devices_per_host was a param drop it (MLflow warns): one host.
            per_host = int(params.get("devices_per_host") or 0) or None
            tables = TableSet.from_frame(model_input, "<model input>")
            planner = LearnedPlanner(self.policy, self.cost_model)
            placement = planner.plan(tables, DeviceTopology.on_hosts(devices, memory, per_host),
                                     task_id=str(params.get("task_id") or "task"))
            return placement.to_frame(placement_costs(self.cost_model, placement))

    # Pickled by reference as embshard.planners.registered.PolicyPythonModel (this module's __getattr__ finds it).
    PolicyPythonModel.__qualname__ = "PolicyPythonModel"
    PolicyPythonModel.__module__ = __name__
    # Versions registered before this class moved here (from policy.model) were pickled by reference as
    # embshard.policy.model.PolicyPythonModel: that name points here, so an upgraded pipeline still loads the
    # champion it must measure. (The policy package cannot import the planners; the planners put the old name back.)
    _policy_model.PolicyPythonModel = PolicyPythonModel  # type: ignore[attr-defined]
    return PolicyPythonModel


def bundle_from_artifacts(a: dict[str, str]):
    """(policy, cost_model, config) from the bundle's artifact files (policy.model.policy_artifacts). Loaded as
    float32 on the CPU whatever the caller set, leaving torch's global random state as it was (the networks are
    built, drawing from it, before their weights are read: a user's seeded model init after load_planner had
    changed)."""
    import torch

    from ..costmodel.ensemble import CostEnsemble
    from ..costmodel.scoring import torch_defaults
    from ..policy.model import load_policy_files

    with torch_defaults(), torch.random.fork_rng(devices=[]):
        policy, config = load_policy_files(a["policy_weights"], a["policy_config"])
        cost_model = CostEnsemble.from_files({k[len("cost_"):]: v for k, v in a.items() if k.startswith("cost_")})
    return policy, cost_model, config


def _not_a_policy(uri: str, what: str):
    from .. import registry
    from ..errors import EmbshardError

    return EmbshardError(f"this model is {what}, not a placement policy", path=uri, field="model",
                         fix=f"give a version of '{registry.POLICY_MODEL}', e.g. {registry.POLICY_CHAMPION_URI} "
                             "(a cost model goes to --cost-model)")


def load_policy_bundle(uri: str):
    """(policy, cost_model, config) of a registered learned planner. From a local sqlite store the artifacts are
    read directly (registry.local_artifacts: the alias resolved now, no MLflow import); else through MLflow."""
    from .. import registry

    arts = registry.local_artifacts(uri)
    if arts is not None:
        if "policy_weights" not in arts:
            raise _not_a_policy(uri, "a cost model (embshard-cost)" if "ensemble" in arts
                                else "a model without policy weights")
        return bundle_from_artifacts(arts)
    cls = _policy_python_model()
    model = registry.load_python_model(uri)
    if not isinstance(model, cls):
        raise _not_a_policy(uri, "a cost model (embshard-cost)" if hasattr(model, "model") and
                            not hasattr(model, "policy") else f"a {type(model).__name__}")
    return model.policy, model.cost_model, model.config


def load_planner(model_uri: str = POLICY_CHAMPION_URI, **kw) -> LearnedPlanner:
    """The learned planner registered in MLflow (policy + the cost model it was trained against).

    An alias (`@champion`) is resolved to the version it names now, which plans record as their `model_uri`
    (the alias may move on; the version a plan came from does not).
    Plans are reproducible: the same tables, devices, memory, model version and `seed` give the same placement
    on every machine and under any load (every rank of a training job may call `plan(...)` and get the same
    plan). The search stops on a work budget (`search_evaluations`, scored moves and swaps), not on a clock;
    `time_budget_s` is only a safety cap, and a plan that hit it says so in `placement.meta["time_cap_hit"]`.
    """
    import inspect

    from .. import registry

    # before any load: a misspelt setting ('sead=3') had raised a bare TypeError after the model was loaded
    takes = [n for n in inspect.signature(LearnedPlanner.__init__).parameters
             if n not in ("self", "policy", "cost_model", "model_uri")]
    unknown = sorted(set(kw) - set(takes))
    if unknown:
        raise EmbshardError(f"unknown planner setting {unknown[0]!r}", field=unknown[0],
                            fix=f"use the settings {', '.join(takes)}")
    model_uri = registry.pinned(model_uri)  # the version the alias names now: loaded, and recorded in the plans
    policy, cost_model, _ = load_policy_bundle(model_uri)
    if registry.version_tag(model_uri, registry.HEALTH_TAG) == registry.HEALTH_REGRESSED:
        log.warning(
            "%s measured slower than the best baseline at its last promotion gate (%s); its plans may be slower "
            "than a heuristic's (fix: compare with --planners or run the pipeline to train a replacement)",
            model_uri, registry.version_tag(model_uri, registry.HEALTH_REASON_TAG) or "no reason recorded")
    return LearnedPlanner(policy, cost_model, model_uri=model_uri, **kw)
