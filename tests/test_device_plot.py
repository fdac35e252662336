"""devices.png (placement_report.plot_device_costs): lines between hosts, and the devices holding pieces of cut tables
and the memory of replicas told apart, where a plan has them (checked on the figure's artists, not its pixels)."""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pytest

from embshard.ingest.synthetic import generate_tables
from embshard.placement import Placement
from embshard.placement_report import device_costs_figure, plot_device_costs
from embshard.tableset import TableSet
from embshard.types import DeviceTopology, Shard, row_blocks


@pytest.fixture(scope="module")
def tables() -> TableSet:
    ts = TableSet.from_frame(generate_tables(30, seed=3, bins_batch_size=512))
    return replace(ts, dims=np.full(len(ts), 16), size_bytes=ts.rows * 16 * ts.bytes_per_element)


def plan(ts: TableSet, devices: int, per_host: int | None, cuts: bool = True) -> Placement:
    """Table 0 in column slices on devices 2 and 3, table 1 row-wise over devices 9..12, table 2 replicated (with
    `cuts`), every other table whole."""
    shards = []
    if cuts:
        shards += [Shard(0, 2, col_offset=0, col_size=8), Shard(0, 3, col_offset=8, col_size=8)]
        shards += [Shard(1, 9 + k, row_offset=o, row_size=n) for k, (o, n) in enumerate(row_blocks(int(ts.rows[1]), 4))]
        shards += [Shard(2, d, kind="replicated") for d in range(devices)]
    shards += [Shard(t, t % devices) for t in range(3 if cuts else 0, len(ts))]
    mem = int(ts.size_bytes.sum())
    p = Placement(ts, devices, mem, shards, planner="test", topology=DeviceTopology.on_hosts(devices, mem, per_host))
    p.check()
    return p


def host_lines(ax) -> list[float]:
    return [float(line.get_xdata()[0]) for line in ax.lines if line.get_gid() == "host boundary"]


def hatched(ax) -> list[int]:
    return sorted(round(bar.get_x() + bar.get_width() / 2) for bars in ax.containers for bar in bars
                  if bar.get_hatch())


def test_the_device_plot_draws_hosts_and_hatches_exactly_the_devices_holding_pieces(tables, tmp_path):
    p = plan(tables, 24, per_host=8)
    pieces = sorted({s.device for s in p.shards if s.kind in ("column", "row")})
    assert pieces == [2, 3, 9, 10, 11, 12]
    fig = device_costs_figure(p, np.linspace(1, 2, 24), balanced_estimate=1.2)
    try:
        costs, memory = fig.axes[:2]
        for ax in (costs, memory):
            assert host_lines(ax) == [7.5, 15.5]  # between devices 7|8 and 15|16: hosts of 8
            assert hatched(ax) == pieces
            assert [t.get_text() for t in ax.child_axes[0].get_xticklabels()] == ["host 0", "host 1", "host 2"]
        # the replica's memory, the same share on every device, at the foot of each memory bar
        replica = 100 * tables.size_bytes[2] / p.memory_bytes_per_device
        assert [bar.get_height() for bar in memory.containers[0]] == pytest.approx([replica] * 24)
        assert fig.get_suptitle().endswith("\n2 cut into pieces, 1 replicated on every device")
        assert [t.get_text() for t in fig.legends[0].get_texts()] == [
            "balanced estimate", "holds pieces of cut tables", "memory of replicas (every device holds them)"]
    finally:
        plt.close(fig)
    fig = device_costs_figure(p, None)  # no costs: the empty chart gets no hosts (its x axis is not the devices')
    try:
        assert (host_lines(fig.axes[0]), host_lines(fig.axes[1])) == ([], [7.5, 15.5])
    finally:
        plt.close(fig)
    plot_device_costs(p, np.linspace(1, 2, 24), str(tmp_path / "devices.png"))
    assert (tmp_path / "devices.png").read_bytes()[:4] == b"\x89PNG"


def test_one_host_and_whole_tables_add_nothing_and_many_hosts_are_counted_not_named(tables):
    for p, lines, xlabel in [
            (plan(tables, 16, per_host=None, cuts=False), [], "device"),
            # too many hosts to name: lines between them, the x label counts them
            (plan(tables, 128, per_host=8), [8.0 * h - 0.5 for h in range(1, 16)],
             "device (16 hosts of 8; lines between hosts)"),
            # too many to draw lines between (past 512 devices the bars are lines, without hatches)
            (plan(tables, 1024, per_host=8), [], "device (128 hosts of 8)")]:
        fig = device_costs_figure(p, np.ones(p.num_devices))
        try:
            for ax in fig.axes[:2]:
                assert host_lines(ax) == lines and not ax.child_axes and ax.get_xlabel() == xlabel
                assert hatched(ax) == ([2, 3, 9, 10, 11, 12] if p.num_devices == 128 else [])
            assert ("\n" in fig.get_suptitle()) == (p.num_devices > 16)
            assert len(fig.legends) == (p.num_devices == 128)
        finally:
            plt.close(fig)
