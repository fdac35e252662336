"""Search on top of the policy: local improvement and splits, scored by the batched cost model.

The search's budget counts work (scored candidates), never wall time, so a plan is reproducible (see Budget).
Local search repeatedly takes the slowest device and tries every move of one of its pieces to another device and
every swap with a piece elsewhere, all scored in one batched call; it applies the best one that lowers the
slowest device's cost (or, at equal maximum, the spread), within memory; row pieces are pinned (TorchRec's
row-wise layout fixes their devices) and never move. Splits cut the dominant piece of the slowest device into k
column slices (NeuroShard's column-wise split, k-way), row-wise over all devices, or table-row-wise within a host,
whichever lowers the predicted cost most after local search. Replicas: a small hot table of the slowest device
(or the best one anywhere) may instead be replicated on every device (data-parallel: each device looks up its
share of the batch, the gradient is all-reduced; `replica_candidate`) when its full bytes fit every device and
that lowers the predicted slowest device.

The search does not exploit the model's errors: with an ensemble cost model (costmodel.ensemble) a move that
claims to lower the slowest device is taken only when its predicted gain (the members' mean) exceeds
GUARD_Z x the members' disagreement about that gain; otherwise the search stops there (`Budget.guard_stops`).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..placement import Shard
from ..tableset import TableSet
from ..types import COLUMN, REPLICATED, WHOLE, DeviceTopology
from .scoring import TaskScorer, piece_features, replica_extra_ms, replica_extras
from .splitting import (
    DEFAULT_SPEED_SLICE_BYTES,
    column_pieces,
    is_pinned,
    max_speed_column_parts,
    replica_pieces,
    row_pieces,
)

_REL_TOL = 1e-6
MIN_SPLIT_DIM = 4  # FBGEMM wants dims that are multiples of 4
GUARD_Z = 1.0      # a move's mean predicted gain must exceed this many standard deviations of the members' gains


@dataclass
class SearchState:
    """An assignment of pieces (tables, column slices, row ranges) with its cached device sums and costs."""

    scorer: TaskScorer
    sizes: np.ndarray   # (N,) bytes per piece
    memory: int
    assignment: np.ndarray  # (N,) device per piece
    movable: np.ndarray | None = None  # (N,) bool: pieces the search may move (None: all; row pieces are pinned)

    def __post_init__(self):
        self.assignment = np.asarray(self.assignment, dtype=np.int64).copy()
        self.movable = (np.ones(len(self.assignment), dtype=bool) if self.movable is None
                        else np.asarray(self.movable, dtype=bool))
        self.sums, self.counts = self.scorer.device_sums(self.assignment)
        self.costs = self.scorer.totals(self.sums, self.counts).double()
        self.used = torch.as_tensor(np.bincount(self.assignment, weights=self.sizes,
                                                minlength=self.scorer.num_devices), dtype=torch.float64)
        # numpy views of the same memory: the search's row picks and additions on these small arrays are the same
        # IEEE arithmetic as torch's at a fraction of its per-call cost; only the scoring itself runs in torch.
        self.sums_np, self.counts_np = self.sums.numpy(), self.counts.numpy()
        self.costs_np, self.used_np = self.costs.numpy(), self.used.numpy()
        self.enc_np = self.scorer.enc.numpy()

    @property
    def overall(self) -> float:
        return float(self.costs_np.max())

    def copy(self) -> SearchState:
        """The same assignment in a state of its own (a search moves pieces in place)."""
        movable = None if self.movable is None else self.movable.copy()
        return SearchState(self.scorer, self.sizes, self.memory, self.assignment.copy(), movable=movable)

    def apply_move(self, piece: int, dst: int) -> None:
        src = int(self.assignment[piece])
        e = self.enc_np[piece]
        self.sums_np[src] -= e
        self.sums_np[dst] += e
        self.counts_np[src] -= 1
        self.counts_np[dst] += 1
        self.used_np[src] -= float(self.sizes[piece])
        self.used_np[dst] += float(self.sizes[piece])
        self.assignment[piece] = dst
        idx = [src, dst]
        self.costs_np[idx] = self.scorer.totals(torch.from_numpy(self.sums_np[idx]),
                                                torch.from_numpy(self.counts_np[idx])).double().numpy()


@dataclass
class Budget:
    """Work the search may do, counted in scored candidates (moves and swaps), so that the same inputs give the
    same plan on any machine and under any load. `deadline` (perf_counter time) is only a safety cap: hitting it
    makes the plan depend on the machine's speed, so it is recorded (`cap_hit`) and reported by the caller."""

    evaluations: int
    deadline: float = float("inf")
    used: int = 0
    cap_hit: bool = False
    skipped_proposers: list = field(default_factory=list)  # proposers not run: the cap had passed (compose)
    no_plan: list = field(default_factory=list)  # proposers that ran and placed nothing (compose)
    guard_stops: int = 0  # searches stopped because the best move's gain was inside the model's uncertainty
    side: int = 0  # work done on allowances of their own (Splits' branches, DominantCuts), not counted in `used`

    def spend(self, n: int) -> None:
        self.used += int(n)

    def exhausted(self) -> bool:
        if self.used >= self.evaluations:
            return True
        if time.perf_counter() > self.deadline:
            self.cap_hit = True
            return True
        return False

    def share(self, evaluations: int) -> Budget:
        """A sub-budget of at most `evaluations` (and what is left), charged back with `absorb`."""
        return Budget(min(int(evaluations), max(self.evaluations - self.used, 0)), self.deadline)

    def absorb(self, sub: Budget) -> None:
        self.used += sub.used
        self.cap_hit |= sub.cap_hit
        self.guard_stops += sub.guard_stops

    def absorb_side(self, allowance: Budget) -> None:
        """Record the work of an allowance of its own (a line beside the shared search) apart (`side`); its
        safety-cap hits and guard stops count with the planner's."""
        self.side += allowance.used
        self.cap_hit |= allowance.cap_hit
        self.guard_stops += allowance.guard_stops


@dataclass
class CutCache:
    """What the split search asks again and again about one task, kept for the task (the planner makes one per
    plan): the encodings of every cut piece it has scored (a piece's features depend on its table, width, rows
    and kind alone, so a cut asked again in a later round or another branch is not encoded again; a row-wise or
    replica cut's D pieces are a few distinct ones) and each table's comm heads as a replica
    (scoring.replica_extras)."""

    pieces: dict = field(default_factory=dict)  # piece_key -> (features (F,), model encoding (H,), projected or None)
    replica: dict = field(default_factory=dict)  # scoring.replica_extras' cache


def piece_key(s: Shard) -> tuple:
    """What a piece's features depend on (scoring.piece_features): its table, width, rows and kind."""
    return (s.table, s.col_size, s.row_size, s.kind)


def local_search(state: SearchState, budget: Budget, max_rounds: int = 10_000) -> SearchState:
    """Best-improvement moves and swaps off the slowest device until none helps or the budget is spent."""
    sc = state.scorer
    D = sc.num_devices
    sizes = np.asarray(state.sizes, dtype=np.float64)
    for _ in range(max_rounds):
        if D < 2 or budget.exhausted():
            break
        costs = state.costs_np
        b = int(np.argmax(costs))
        cur_max = float(costs[b])
        cur_sq = float((state.costs ** 2).sum())  # torch's sum: its summation order, as before
        on_b = np.flatnonzero((state.assignment == b) & state.movable)
        if len(on_b) == 0:
            break
        others = np.flatnonzero((state.assignment != b) & state.movable)
        budget.spend(len(on_b) * (D - 1 + len(others)))
        best = _best_candidate(state, b, on_b, others, sizes, cur_max, cur_sq)
        if best is None:
            break
        kind, p, q = best
        if not _trusted(state, kind, p, q):
            budget.guard_stops += 1
            break
        if kind == "move":
            state.apply_move(p, q)
        else:
            d = int(state.assignment[q])
            state.apply_move(p, d)
            state.apply_move(q, b)
    return state


def _trusted(state: SearchState, kind: str, p: int, q: int) -> bool:
    """Whether the ensemble's members agree that this move lowers the slowest device beyond their disagreement.
    Moves that only even out the other devices (no predicted gain in the maximum) are always allowed."""
    sc = state.scorer
    if not sc.has_members:
        return True
    sums, counts, enc = state.sums_np.copy(), state.counts_np.copy(), state.enc_np
    moves = [(p, q)] if kind == "move" else [(p, int(state.assignment[q])), (q, int(state.assignment[p]))]
    for piece, dst in moves:
        src = int(state.assignment[piece])
        sums[src] -= enc[piece]
        sums[dst] += enc[piece]
        counts[src] -= 1
        counts[dst] += 1
    both = sc.member_totals(torch.from_numpy(np.stack([state.sums_np, sums])),
                            torch.from_numpy(np.stack([state.counts_np, counts]))).amax(-1)  # (K, 2)
    before, after = both[:, 0], both[:, 1]
    gain = (before - after).double()
    mean = float(gain.mean())
    if mean <= _REL_TOL * max(float(before.mean()), 1e-9):
        return True  # a spread move: the maximum does not change
    return mean > GUARD_Z * float(gain.std(correction=0))


def _best_candidate(state, b, on_b, others, sizes, cur_max, cur_sq):
    # The float64 bookkeeping (memory, maxima, spreads) and the float32 row sums fed to the scorer are numpy (the
    # state's views): the same elementwise arithmetic as torch, at a fraction of its per-call cost on these small
    # arrays; only the cost model's scoring runs in torch.
    sc = state.scorer
    D = sc.num_devices
    costs, used, sums, counts, enc = state.costs_np, state.used_np, state.sums_np, state.counts_np, state.enc_np
    t = torch.from_numpy
    tol = _REL_TOL * max(cur_max, 1e-9)
    other_max = _max_of_others(costs, b)
    candidates = []  # (max, sumsq, kind, p, q)
    enc_b = t(enc[on_b])  # (P, H) the pieces that may leave b
    sums_b = t(sums[b] - enc[on_b])  # (P, H) b without each of them
    # Moves: piece p from b to device d.
    dsts = _other_devices(D, b)
    P = len(on_b)
    new_b = sc.totals(sums_b, t(np.full(P, counts[b] - 1))).double().numpy()  # (P,)
    fits = (used[dsts][None, :] + sizes[on_b][:, None]) <= state.memory
    # Only pairs whose b side ends at or below the current maximum can be better: the other side is scored
    # for those alone (the rest could never be chosen, so the choice is the same as scoring the whole grid).
    fits &= (new_b <= cur_max + tol)[:, None]
    new_d = _scored_where(fits, lambda pi, qi: sc.totals(t(sums[dsts[qi]] + enc[on_b[pi]]), t(counts[dsts[qi]] + 1)),
                          lambda: sc.pair_totals(enc_b, t(sums[dsts]), 1))  # (P, D-1)
    mx = np.maximum(np.maximum(new_b[:, None], new_d), other_max[dsts][None, :])
    sq = cur_sq - costs[b] ** 2 - costs[dsts][None, :] ** 2 + new_b[:, None] ** 2 + new_d ** 2
    _collect(candidates, mx, sq, fits, "move", on_b, dsts)
    # Swaps: p on b with q on d.
    if len(others):
        dev_q = state.assignment[others]
        nb = sc.pair_totals(sums_b, t(enc[others]), int(counts[b])).double().numpy()  # (P, Q)
        sums_d = sums[dev_q] - enc[others]  # (Q, H)
        counts_q = counts[dev_q]
        mem_b = used[b] - sizes[on_b][:, None] + sizes[others][None, :]
        mem_d = used[dev_q][None, :] - sizes[others][None, :] + sizes[on_b][:, None]
        fits = (mem_b <= state.memory) & (mem_d <= state.memory) & (nb <= cur_max + tol)
        nd = _scored_where(fits, lambda pi, qi: sc.totals(t(sums_d[qi] + enc[on_b[pi]]), t(counts_q[qi])),
                           lambda: sc.pair_totals(enc_b, t(sums_d), 1))
        mx = np.maximum(np.maximum(nb, nd), other_max[dev_q][None, :])
        sq = cur_sq - costs[b] ** 2 - costs[dev_q][None, :] ** 2 + nb ** 2 + nd ** 2
        _collect(candidates, mx, sq, fits, "swap", on_b, others)
    best = None
    for m, s, kind, p, q in candidates:
        better = m < cur_max - tol or (m <= cur_max + tol and s < cur_sq - tol * cur_max)
        if better and (best is None or (m, s) < (best[0], best[1])):
            best = (m, s, kind, p, q)
    return None if best is None else best[2:]


@functools.cache
def _other_devices(num_devices: int, b: int) -> np.ndarray:
    """The devices other than b, in order (cached, so read-only)."""
    out = np.delete(np.arange(num_devices), b)
    out.flags.writeable = False
    return out


def _max_of_others(costs: np.ndarray, b: int) -> np.ndarray:
    """(D,) for every device d, the largest cost of the devices other than b and d (0 when there is none)."""
    rest = costs.copy()
    rest[b] = -np.inf
    first = int(np.argmax(rest))
    out = np.full(len(costs), rest[first])
    rest[first] = -np.inf
    out[first] = rest.max()
    return np.maximum(out, 0.0)


DENSE_FROM = 0.25  # kept share of a grid from which scoring all of it (pair_totals) beats gathering the kept


def _scored_where(keep: np.ndarray, score, dense=None) -> np.ndarray:
    """(P, Q) float64 grid of `score(rows, cols)` (numpy index arrays in, a tensor out) at the True entries of
    `keep`, +inf elsewhere. `dense()`, when given, scores the whole grid at once (the same values): used when most
    of it is kept."""
    pi, qi = keep.nonzero()
    if dense is not None and len(pi) >= DENSE_FROM * keep.size:
        return np.where(keep, dense().double().numpy(), np.inf)
    out = np.full(keep.shape, np.inf)
    if len(pi):
        out[pi, qi] = score(pi, qi).double().numpy()
    return out


def _collect(out, mx, sq, fits, kind, rows, cols):
    """The best feasible candidate of a (P, Q) grid, appended to `out` as (max, sumsq, kind, p, q)."""
    mx = np.where(fits, mx, np.inf)
    m = float(mx.min())
    if not np.isfinite(m):
        return
    # Lexicographic (max, sumsq): among the minimal max (within a tolerance), the smallest spread.
    near = mx <= m + _REL_TOL * max(m, 1e-9)
    sq = np.where(near, sq, np.inf)
    i, j = divmod(int(np.argmin(sq)), mx.shape[1])
    out.append((float(mx[i, j]), float(sq[i, j]), kind, int(rows[i]), int(cols[j])))


def replica_candidate(tables: TableSet, shards: list[Shard], state: SearchState, cost_model,
                      pieces: np.ndarray, single: np.ndarray, cache: dict | None = None) -> int | None:
    """The whole piece among `pieces` (their costs alone: `single`) best worth replicating, or None: its bytes
    fit the free memory of every device but its own, and its predicted saving, (D-1)/D of its cost alone minus
    its all-reduce (less the all-to-all it no longer sends: scoring.replica_extra_ms), is the largest and
    positive."""
    D = state.scorer.num_devices
    if D < 2 or len(pieces) == 0:
        return None
    used = state.used.numpy()
    # The fullest device other than the piece's own: the fullest, or the second fullest where the piece is.
    top = np.argsort(-used, kind="stable")[:2]
    pieces = np.asarray(pieces)
    fullest_other = np.where(state.assignment[pieces] == top[0], used[top[1]], used[top[0]])
    whole = np.array([shards[p].kind == WHOLE for p in pieces], dtype=bool)
    # A table never looked up saves no lookups by being replicated (a trace's unread table was replicated on all
    # 8 devices: the model prices an empty table's fixed cost, which a replica only multiplies).
    read = np.array([tables.pooling_factor[shards[p].table] > 0 for p in pieces], dtype=bool)
    ok = np.flatnonzero(whole & read & (fullest_other + state.sizes[pieces] <= state.memory))
    if not len(ok):
        return None
    cands = pieces[ok]
    tabs = np.array([shards[p].table for p in cands.tolist()], dtype=np.int64)
    extra = replica_extras(cost_model, tables, tabs, tables.dims[tabs], D, cache=cache)  # as whole replicas
    gain = np.asarray(single)[ok] * (D - 1) / D - extra
    k = int(np.argmax(gain))
    return int(cands[k]) if gain[k] > 0 else None


def try_splits(tables: TableSet, shards: list[Shard], state: SearchState, cost_model, topology: DeviceTopology,
               budget: Budget, max_splits: int = 8, columns: bool = True, rows: bool = True,
               replicas: bool = False, variants: list[tuple[str, list[Shard], SearchState, bool]] | None = None,
               explore: bool = False, cache: CutCache | None = None,
               min_slice_bytes: int = DEFAULT_SPEED_SLICE_BYTES) -> tuple[list[Shard], SearchState]:
    """Cut the most expensive movable piece of the slowest device while that lowers the predicted overall cost.

    The cuts tried: k column slices (k = 2, 4, ..., at most the devices and slices of `min_slice_bytes` per row:
    the hardware's floor, splitting.speed_slice_bytes), starting on the slowest
    device and spread by local search; row-wise over all devices; table-row-wise over one host's devices (the host
    whose devices cost least; only when the topology names hosts); with `replicas`, a replica on every device of
    the slowest device's `replica_candidate` and of the best one anywhere (when there are; searched like a cut,
    but its search is charged to the budget only when it is kept, so tasks where no replica helps keep their
    plans and their work). Once a column cut's search took the piece off the slowest device, the piece's finer
    column cuts and its row cuts are skipped (it no longer sets the maximum; replicas are still tried). The best
    cut after local search is kept when it lowers the predicted overall cost.
    Returns (shards, state), unchanged when no cut helps.

    `variants`, when given, receives every first cut tried that fits memory, after its local search, as (label,
    pieces, state, variant_only), kept or not: the planner carries the best of each kind on (compose.Splits), and a
    measured refinement (embshard.refine) measures them, since the model may rank the kinds of cut wrongly on
    tables unlike those it was trained on. `variant_only`: searched only because of `explore`. `explore` (a
    measured refinement will measure them): the first round's skipped cuts are still searched, as variants only
    (never kept, not charged: the plan is the same), so that every kind of cut is measured (a skipped
    table-row-wise cut was the measured best on the MLPerf-like list on 4 hosts of 4). `cache`: the task's
    CutCache, shared by the planner's calls (the kept line and its branches)."""
    shards = list(shards)
    memory = state.memory
    cache = CutCache() if cache is None else cache
    replica_heads = cache.replica
    for it in range(max_splits):
        if budget.exhausted():
            break
        b = int(torch.argmax(state.costs))
        on_b = np.flatnonzero((state.assignment == b) & state.movable)
        if len(on_b) == 0:
            break
        single = state.scorer.single_costs()[on_b]
        p0 = int(on_b[np.argmax(single)])
        best_shards, best_state, best_work = None, state, None
        trials = [(p0, cut) for cut in _cuts(tables, shards[p0], state, topology, columns, rows, min_slice_bytes)]
        if replicas:
            # The slowest device's best candidate, and the best anywhere (a hot table the search has isolated on
            # a device of its own holds the others up without being on the slowest one).
            movable = np.flatnonzero(np.asarray(state.movable, dtype=bool))
            for r in dict.fromkeys(x for x in (
                    replica_candidate(tables, shards, state, cost_model, on_b, single, replica_heads),
                    replica_candidate(tables, shards, state, cost_model, movable,
                                      state.scorer.single_costs()[movable], replica_heads)) if x is not None):
                trials.append((r, replica_pieces(shards[r].table, topology.count)))
        encoded = _encode_cuts(tables, [cut for _, cut in trials], state.scorer, cost_model, topology.count, cache)
        # Half of the work left goes to this piece's cuts, shared equally, so that every cut gets its search.
        # (A replica's search is charged only when it is kept, so it takes no share.)
        searched = sum(1 for _, cut in trials if cut[0].kind != REPLICATED)
        per_cut = max((budget.evaluations - budget.used) // (2 * max(searched, 1)), 1)
        coarser_cleared = False  # a column cut took the piece off the slowest device (its other cuts skipped)
        for (p, cut), enc in zip(trials, encoded):
            if budget.exhausted():
                break
            # A cut skipped by the rule above is still searched as a variant when exploring (never kept: the plan
            # stays the one without `explore`, and its search is not charged).
            variant_only = coarser_cleared and cut[0].kind != REPLICATED
            if variant_only and not (explore and it == 0 and variants is not None):
                continue
            placed = [c.on(b) if not is_pinned(c) else c for c in cut]
            trial_shards = shards[:p] + placed + shards[p + 1:]
            trial_assign = np.concatenate([state.assignment[:p], [c.device for c in placed],
                                           state.assignment[p + 1:]])
            trial = _cut_state(tables, state, p, placed, trial_assign, cost_model, topology.count, enc,
                               replica_heads)
            if (trial.used > memory).any():  # row cuts and replicas add to every device; slices start on b
                continue
            replica = placed[0].kind == REPLICATED
            sub = budget.share(per_cut)
            trial = local_search(trial, sub)
            if not (replica or variant_only):
                budget.absorb(sub)
            if cut[0].kind == COLUMN and int(torch.argmax(trial.costs)) not in trial.assignment[p:p + len(placed)]:
                # After local search no slice is on the slowest device: the piece no longer sets the maximum, so a
                # finer or row cut of it would end on the same one (it did in most rounds seen at 10-200 tables).
                coarser_cleared = True
            if variants is not None and it == 0:  # the other first moves (later ones are tweaks of the plan)
                variants.append((cut_label(tables, cut, topology), trial_shards, trial, variant_only))
            if not variant_only and trial.overall < best_state.overall * (1 - 1e-4):
                best_shards, best_state, best_work = trial_shards, trial, (sub if replica else None)
        if best_shards is None:
            break
        if best_work is not None:  # a replica's search is charged only when it is kept (docstring)
            budget.absorb(best_work)
        shards, state = best_shards, best_state
    return [s.on(d) for s, d in zip(shards, state.assignment)], state


def cut_label(tables: TableSet, cut: list[Shard], topology: DeviceTopology | None = None) -> str:
    """What a cut is, in words: 'cat_20 in 4 column slices', 'cat_20 row-wise over 16 devices', 'cat_20
    table-row-wise over 4 devices' (rows on one host's devices, where `topology` names several hosts), 'cat_3
    replicated on 8 devices'."""
    name = str(tables.table_ids[cut[0].table])
    if cut[0].kind == COLUMN:
        return f"{name} in {len(cut)} column slices"
    if cut[0].kind == REPLICATED:
        return f"{name} replicated on {len(cut)} devices"
    devices = sorted({c.device for c in cut})
    task_hosts = () if topology is None or topology.hosts is None else topology.hosts
    one_host = len(set(task_hosts)) > 1 and len({task_hosts[d] for d in devices}) == 1
    return f"{name} {'table-' if one_host else ''}row-wise over {len(devices)} devices"


def cut_kind(label: str) -> str:
    """The kind of a `cut_label` (its first cut, when a branch carried it on): column, row, table-row or replica.
    Row-wise over all devices and over one host's are different kinds: their all-to-all differs (every device
    sends partial sums, or one host's), and the model may rank them wrongly."""
    first = label.split(", then ")[0]
    if "column slices" in first:
        return "column"
    if "replicated" in first:
        return "replica"
    return "table-row" if "table-row-wise" in first else "row"


def _cuts(tables: TableSet, piece: Shard, state: SearchState, topology: DeviceTopology, columns: bool,
          rows: bool, min_slice_bytes: int) -> list[list[Shard]]:
    """The cuts of one piece to try (module docstring); column cuts of a slice stay within its columns."""
    D = topology.count
    out: list[list[Shard]] = []
    width = piece.col_size if piece.col_size is not None else int(tables.dims[piece.table])
    if columns and piece.kind in (WHOLE, COLUMN):
        k = 2
        while k <= min(D, max_speed_column_parts(width, int(tables.bytes_per_element[piece.table]), min_slice_bytes)):
            out.append(column_pieces(piece.table, width, k, piece.col_offset))
            k *= 2
    n_rows = int(tables.rows[piece.table])
    if rows and piece.kind == WHOLE and n_rows >= 2:
        if D >= 2:
            out.append(row_pieces(piece.table, n_rows, list(range(D))))
        if topology.hosts is not None and len(set(topology.hosts)) > 1:
            costs = state.costs.numpy()
            hosts = sorted(set(topology.hosts))
            members = {h: [d for d in range(D) if topology.hosts[d] == h] for h in hosts}
            cheapest = min(hosts, key=lambda h: (float(costs[members[h]].sum()), h))
            if len(members[cheapest]) >= 2:
                out.append(row_pieces(piece.table, n_rows, members[cheapest]))
    return out


def _encode_cuts(tables, cuts: list[list[Shard]], scorer: TaskScorer, cost_model, num_devices: int,
                 cache: CutCache) -> list:
    """(features, model encodings, projected encodings) of each cut's pieces. The pieces not in `cache` are
    encoded in one cost-model call (one by one: each gets what it would get alone), then kept there."""
    if not cuts:
        return []
    known = cache.pieces
    new: dict[tuple, Shard] = {}
    for cut in cuts:
        for c in cut:
            k = piece_key(c)
            if k not in known:
                new.setdefault(k, c)
    if new:
        feats = piece_features(tables, list(new.values()), num_devices)
        with torch.no_grad():
            model_enc = cost_model.encode(feats).float()
            proj = None if scorer._fused is None else scorer._fused.project(model_enc)
        for i, k in enumerate(new):
            known[k] = (feats[i], model_enc[i], None if proj is None else proj[i])
    out = []
    for cut in cuts:
        rows = [known[piece_key(c)] for c in cut]
        out.append((np.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                    None if rows[0][2] is None else torch.stack([r[2] for r in rows])))
    return out


def _cut_state(tables, state: SearchState, p: int, placed: list[Shard], assignment, cost_model, num_devices,
               encoded, replica_heads: dict | None = None) -> SearchState:
    """The state with piece p replaced by its cut `placed` (encoded by `_encode_cuts`): only the new pieces are
    encoded and projected, the others keep theirs."""
    feats, new, new_proj = encoded
    old = state.scorer.model_enc
    new_extra = replica_extra_ms(cost_model, tables, placed, num_devices, feats, cache=replica_heads)
    extra = None
    if new_extra is not None or state.scorer.extra is not None:
        was_extra = state.scorer.extra if state.scorer.extra is not None else np.zeros(len(state.sizes))
        extra = np.concatenate([was_extra[:p], new_extra if new_extra is not None else np.zeros(len(placed)),
                                was_extra[p + 1:]])
    model_enc = torch.cat([old[:p], new, old[p + 1:]])
    projected = None
    if new_proj is not None:
        old_proj = state.scorer.projected  # without the extra channel, which is rebuilt from `extra`
        projected = torch.cat([old_proj[:p], new_proj, old_proj[p + 1:]])
    scorer = TaskScorer(cost_model, None, num_devices, enc=model_enc, projected=projected, extra=extra)
    sizes = np.concatenate([state.sizes[:p], feats[:, 3].astype(np.int64), state.sizes[p + 1:]])
    was = np.ones(len(state.sizes), dtype=bool) if state.movable is None else state.movable
    movable = np.concatenate([was[:p], [not is_pinned(c) for c in placed], was[p + 1:]])
    return SearchState(scorer, sizes, state.memory, assignment, movable=movable)
