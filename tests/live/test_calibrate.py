"""`kvplane calibrate nixl` moves real bytes between two processes and reports sourced figures."""

from __future__ import annotations

from kvplane.live.calibrate import as_profile_yaml, measure


def test_calibration_measures_real_transfers_on_host_memory() -> None:
    figures = measure("cpu", 8 << 20, repeats=1)  # the target checks a checksum of what landed
    assert figures["write_bandwidth_GBps"] > 0 and figures["read_bandwidth_GBps"] > 0
    assert figures["scattered_descriptors"] == (8 << 20) // (2 * 4096)
    assert figures["per_descriptor_us"] >= 0
    text = as_profile_yaml(figures, "cpu")
    assert text.startswith("nixl_measured:")
    assert text.count("measured: kvplane calibrate nixl --device cpu") == len(figures)
