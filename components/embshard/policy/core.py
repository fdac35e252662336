"""The placement policy (DreamShard-style) and its REINFORCE training on the estimated MDP.

An episode places a task's tables one at a time, most expensive first. For each device the policy sees what
the cost model predicts: the device's cost now, its cost with the table added, the overall cost that choice
would give, and memory; a softmax over the devices that may take the table picks one. The reward at the end is
minus the predicted overall cost (relative to a per-task scale), so training needs no hardware.

Unlike the public DreamShard code: rollouts and the update use the same masked distribution (one forward
pass produces both), a device is allowed only if the remaining tables can still fit afterwards, a rollout that
still runs out of memory is flagged infeasible (never silently put on the last device), and the advantage uses
the mean reward of a group of rollouts of the same task as its baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..costmodel.scoring import TaskScorer

NUM_POLICY_FEATURES = 11
INFEASIBLE_PENALTY = 3.0  # reward of a rollout that ran out of memory, in units of the task scale


class PolicyNet(nn.Module):
    """Scores each device from its features; shared over devices, so any device count works."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.hidden = hidden
        self.mlp = nn.Sequential(nn.Linear(NUM_POLICY_FEATURES, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D, F) -> (B, D)
        return self.mlp(x).squeeze(-1)


@dataclass
class TaskContext:
    """Everything an episode needs about one task, computed once."""

    scorer: TaskScorer
    sizes: np.ndarray        # (N,) bytes of each piece
    memory: int              # bytes per device
    order: np.ndarray        # placement order (most expensive first)
    single: np.ndarray       # (N,) predicted cost of each piece alone
    scale: float             # per-task cost scale: max(sum of singles / D, largest single)

    @classmethod
    def build(cls, cost_model, features: np.ndarray, sizes: np.ndarray, num_devices: int, memory: int):
        scorer = TaskScorer(cost_model, features, num_devices)
        single = scorer.single_costs()
        order = np.lexsort((-np.asarray(sizes), -single))  # by cost, ties by size
        scale = max(single.sum() / num_devices, single.max(), 1e-6)
        # sizes copied: a TableSet's arrays are read-only, and torch warns about those in rollout()
        return cls(scorer, np.array(sizes, dtype=np.int64), int(memory), order, single, float(scale))


@dataclass
class Rollouts:
    assignment: np.ndarray   # (B, N) device of each piece
    log_prob: torch.Tensor   # (B,) sum of log-probabilities of the choices (with grad when training)
    entropy: torch.Tensor    # (B,) summed entropy
    feasible: np.ndarray     # (B,) bool
    overall: np.ndarray      # (B,) predicted overall cost (ms)
    device_costs: np.ndarray  # (B, D)


def rollout(policy: PolicyNet, ctx: TaskContext, batch: int, mode: str = "sample",
            generator: torch.Generator | None = None, greedy: int = 0, stats: bool = True) -> Rollouts:
    """Run `batch` episodes of one task. mode: 'sample' (training/exploration) or 'greedy'. With mode 'sample',
    the first `greedy` episodes take the most likely device instead (one batched pass serves a planner's greedy
    and sampled rollouts; the sampled ones draw exactly what they would alone). `stats=False` (a planner): the
    log-probabilities and entropies are not summed (left 0); the choices are the same."""
    sc = ctx.scorer
    D, N, H = sc.num_devices, len(ctx.sizes), sc.dim
    sums = torch.zeros(batch, D, H)
    counts = torch.zeros(batch, D, dtype=torch.long)
    cur = torch.zeros(batch, D)
    free = torch.full((batch, D), float(ctx.memory), dtype=torch.float64)
    sizes = torch.as_tensor(ctx.sizes, dtype=torch.float64)
    # Suffix totals/max of the sizes still to place after each step: the lookahead of the memory mask.
    ordered = sizes[torch.as_tensor(ctx.order)]
    rest_sum = torch.flip(torch.cumsum(torch.flip(ordered, [0]), 0), [0]) - ordered
    rest_max = torch.zeros(N, dtype=torch.float64)
    if N > 1:
        rest_max[:-1] = torch.flip(torch.cummax(torch.flip(ordered, [0]), 0).values, [0])[1:]
    assignment = np.empty((batch, N), dtype=np.int64)
    log_prob = torch.zeros(batch)
    entropy = torch.zeros(batch)
    feasible = torch.ones(batch, dtype=torch.bool)
    s = ctx.scale
    rows = torch.arange(batch)
    rest_sum_f, rest_max_f = rest_sum.tolist(), rest_max.tolist()
    flat_sums = sums.view(batch * D, H)
    ones = torch.ones(batch, 1, dtype=torch.long)
    forward = policy if stats else _plain_forward(policy)
    sizes_f = [float(x) for x in ctx.sizes]
    singles = [float(x) / s for x in ctx.single]
    for step, i in enumerate(ctx.order):
        size_i = sizes_f[i]
        feats = torch.empty(batch, D, NUM_POLICY_FEATURES)  # fresh each step: training keeps it for backward
        cand = sc.totals_nonempty(sums + sc.enc[i])  # (B, D) cost of each device with the table
        top = cur.max(dim=1, keepdim=True).values
        new_overall = torch.maximum(cand, top)
        # The 11 features, written in place (the same values as stacking them; the costs and the memory fills
        # each in one op, as a rollout step is mostly per-op overhead).
        torch.div(torch.stack([cur, cand, cand - cur, new_overall, top.expand(batch, D)], dim=2), s,
                  out=feats[..., :5])
        torch.div(counts, N, out=feats[..., 5])
        feats[..., 6:8] = 1 - torch.stack([free, free - size_i], dim=2) / ctx.memory
        feats[..., 8] = step / N
        feats[..., 9] = singles[i]
        torch.div(new_overall - new_overall.min(dim=1, keepdim=True).values, s, out=feats[..., 10])
        low = float(free.min()) - size_i
        if low >= rest_max_f[step] and (low >= rest_sum_f[step] or float(free.sum(1).min()) - D * size_i
                                        >= rest_sum_f[step] * (1 + 1e-9) + 1.0):
            # _memory_mask allows every device (each keeps room for the largest table left, and the rest fit;
            # the margin covers the rounding of its own sum): skip it.
            logits = forward(feats)
        else:
            mask = _memory_mask(free, size_i, rest_sum[step], rest_max[step])
            stuck = ~mask.any(dim=1)
            if stuck.any():  # lookahead too strict: any device with room; none: infeasible, flagged
                fits = free[stuck] >= size_i
                none = ~fits.any(dim=1)
                fits[none, :] = free[stuck][none] == free[stuck][none].max(dim=1, keepdim=True).values
                mask[stuck] = fits
                feasible[stuck.nonzero().squeeze(1)[none]] = False
            logits = forward(feats).masked_fill(~mask, float("-inf"))
        # Categorical(logits)'s own arithmetic (same probabilities, draws, log-probabilities and entropy),
        # without its per-step construction and argument checks.
        norm = logits - logits.logsumexp(dim=1, keepdim=True)
        probs = torch.softmax(norm, dim=1)
        if mode == "greedy":
            a = logits.argmax(dim=1)
        elif greedy:
            drawn = torch.multinomial(probs[greedy:], 1, generator=generator).squeeze(1)
            a = torch.cat([logits[:greedy].argmax(dim=1), drawn])
        elif generator is None:
            a = torch.multinomial(probs, 1, True).squeeze(1)
        else:
            a = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        if stats:
            log_prob = log_prob + norm.gather(1, a.unsqueeze(1)).squeeze(1)
            entropy = entropy - (norm.clamp(min=torch.finfo(norm.dtype).min) * probs).sum(dim=1)
        assignment[:, i] = a.numpy()
        # Each episode's chosen device takes the table (flat index ops: ~5x cheaper than [rows, a] indexing).
        a1 = a.unsqueeze(1)
        flat_sums.index_add_(0, rows * D + a, sc.enc[i].expand(batch, H))
        counts.scatter_add_(1, a1, ones)
        cur.scatter_(1, a1, cand.gather(1, a1))
        free.scatter_add_(1, a1, torch.full((batch, 1), -size_i, dtype=torch.float64))
    feasible &= (free >= 0).all(dim=1)
    return Rollouts(assignment, log_prob, entropy, feasible.numpy(), cur.max(dim=1).values.numpy().astype(np.float64),
                    cur.numpy().astype(np.float64))


def _plain_forward(policy: PolicyNet):
    """The policy's forward as plain functional calls (the same ops, without nn.Module's per-call overhead: a
    rollout calls it once per table), or the policy itself when its network is not the standard MLP."""
    layers = list(getattr(policy, "mlp", []))
    kinds = [type(m) for m in layers]
    if kinds != [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear] or type(policy).forward is not PolicyNet.forward:
        return policy
    (w1, b1), (w2, b2), (w3, b3) = [(m.weight, m.bias) for m in layers[::2]]
    linear = torch.nn.functional.linear

    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(torch.relu(linear(torch.relu(linear(x, w1, b1)), w2, b2)), w3, b3).squeeze(-1)

    return forward


def _memory_mask(free: torch.Tensor, size: torch.Tensor, rest_sum: torch.Tensor, rest_max: torch.Tensor):
    """Devices that can take the table and leave room for the rest (sum and largest remaining table)."""
    after = free - size
    fits = after >= 0
    total_ok = (after.sum(dim=1, keepdim=True) - 0) >= rest_sum  # same for every choice
    # Largest free block left if device d takes the table: max(after_d, max over the others of free).
    top2 = torch.topk(free, k=min(2, free.shape[1]), dim=1).values
    best_other = torch.where(free == top2[:, :1], top2[:, -1:], top2[:, :1])
    largest = torch.maximum(after, best_other)
    return fits & total_ok & (largest >= rest_max)


@dataclass
class TrainConfig:
    iterations: int = 300
    rollouts_per_task: int = 16
    lr: float = 3e-3
    entropy_coef: float = 0.01
    hidden: int = 64
    seed: int = 0


def reinforce_step(policy: PolicyNet, optimizer: torch.optim.Optimizer, ctx: TaskContext, cfg: TrainConfig,
                   generator: torch.Generator, costs=None) -> dict:
    """One REINFORCE update on one task: sample `cfg.rollouts_per_task` placements, reward each with minus its
    cost relative to the task's scale (the cost model's prediction, or `costs(rollouts)`: e.g. measured ms, NaN
    where infeasible), group baseline, normalised advantages, entropy bonus. The only policy-gradient update."""
    ro = rollout(policy, ctx, cfg.rollouts_per_task, "sample", generator)
    if costs is None:
        cost, scale = ro.overall, ctx.scale
    else:
        cost = np.asarray(costs(ro), dtype=np.float64)
        scale = np.nanmedian(cost) if np.isfinite(cost).any() else 1.0
    feasible = np.asarray(ro.feasible, dtype=bool) & np.isfinite(cost)
    reward = torch.as_tensor(np.where(feasible, -np.nan_to_num(cost) / scale, -INFEASIBLE_PENALTY),
                             dtype=torch.float32)
    adv = reward - reward.mean()
    adv = adv / (adv.std() + 1e-6)
    loss = -(adv * ro.log_prob).mean() - cfg.entropy_coef * ro.entropy.mean() / len(ctx.sizes)
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    stats = {"loss": float(loss.detach()), "reward_mean": float(reward.mean()), "reward_best": float(reward.max()),
             "feasible_frac": float(feasible.mean())}
    if costs is not None:
        stats["measured_best_ms"] = float(np.nanmin(cost)) if np.isfinite(cost).any() else float("nan")
    return stats
