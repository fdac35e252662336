"""The policy's files: its weights and config, and the artifacts of the registered bundle (policy + the cost
model it was trained against). The registered pyfunc that plans with them is planners.registered (the policy
does not import the planners).
"""
from __future__ import annotations

import json
import os

import torch

from ..registry import POLICY_MODEL
from .core import PolicyNet

REGISTERED_NAME = POLICY_MODEL


def save_policy(policy: PolicyNet, folder: str, extra: dict | None = None) -> dict[str, str]:
    os.makedirs(folder, exist_ok=True)
    weights, config = os.path.join(folder, "policy.pt"), os.path.join(folder, "policy.json")
    torch.save(policy.state_dict(), weights)
    with open(config, "w", encoding="utf-8") as f:
        json.dump({"hidden": policy.hidden, **(extra or {})}, f, indent=1)
    return {"policy_weights": weights, "policy_config": config}


def load_policy_files(weights: str, config: str) -> tuple[PolicyNet, dict]:
    with open(config, encoding="utf-8") as f:
        cfg = json.load(f)
    policy = PolicyNet(hidden=int(cfg.get("hidden", 64)))
    policy.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return policy.eval(), cfg


def policy_artifacts(policy: PolicyNet, cost_model, folder: str, extra: dict | None = None) -> dict[str, str]:
    """Artifacts of the bundle: the policy's files and the cost model's weights/config."""
    arts = save_policy(policy, os.path.join(folder, "policy"), extra)
    cost = cost_model.save(os.path.join(folder, "cost_model"))
    arts.update({f"cost_{k}": v for k, v in cost.items()})
    return arts
