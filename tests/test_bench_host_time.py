"""``bench.host_time``: the host's part of the attention module's training step, inductor's CUDA code launched on
the CPU without running its kernels. Checked to run and report, never timed."""

import pytest

from bench import host_time


@pytest.mark.compiled
def test_host_time_reports_each_peer_against_flexattentions_window(tmp_path):
    """Two rounds of the default path and FlexAttention's window: each peer's time a step and of its two passes, its
    Triton launches a step, and its ratio to the window's, written to the JSON file asked for. The default path launches the kernels of its one
    compiled graph, forward and backward (FlexAttention's among them); the window's peer only its kernel's."""
    out = tmp_path / "host.json"
    peers = ["long-short", "flex-window"]
    results = host_time.main(["--peers", *peers, "--n", "256", "--repeats", "2", "--out", str(out)])
    rows = results["rows"]
    assert list(rows) == peers and out.exists()
    assert all(row["time_s"] > 0 and row["ratio_to_baseline"] > 0 for row in rows.values())
    assert all(0 < row["forward_s"] + row["backward_s"] <= row["time_s"] * 1.5 for row in rows.values())
    assert rows["flex-window"]["ratio_to_baseline"] == 1.0
    assert 0 < rows["flex-window"]["triton_launches"] < rows["long-short"]["triton_launches"]
