"""Export placements: plan.json (schema embshard.plan/v3), placements.parquet and TorchRec sharding plans.

Light imports only here; the TorchRec parts (export.torchrec_plan) import torchrec lazily.
"""
from __future__ import annotations

from .placements import device_costs_from_frame, placement_from_frame
from .plan_json import SCHEMA_VERSION, placement_from_plan, read_plan_json, validate_plan, write_plan_json


def to_torchrec_plan(plan_or_placement, **kw):
    """See embshard.export.torchrec_plan.to_torchrec_plan."""
    from .torchrec_plan import to_torchrec_plan as _to

    return _to(plan_or_placement, **kw)


def torchrec_constraints(plan_or_placement):
    """See embshard.export.torchrec_plan.torchrec_constraints."""
    from .torchrec_plan import torchrec_constraints as _c

    return _c(plan_or_placement)


__all__ = ["SCHEMA_VERSION", "write_plan_json", "read_plan_json", "validate_plan", "placement_from_plan",
           "placement_from_frame", "device_costs_from_frame", "to_torchrec_plan", "torchrec_constraints"]
