"""Profiles: every constant cites its source; the bundled numbers are the published ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from kvplane.sim.costs import KVGeometry, TransferCost
from kvplane.sim.profiles import (
    SOURCE_KINDS,
    HardwareProfile,
    ModelProfile,
    ScenarioError,
    Sourced,
    SourcedInt,
    bundled_profile_names,
    load_profile,
)

PROFILES = Path(__file__).resolve().parents[2] / "scenarios" / "profiles"


def sourced_values(model: BaseModel, path: str = "") -> list[tuple[str, Sourced | SourcedInt]]:
    out: list[tuple[str, Sourced | SourcedInt]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        here = f"{path}.{name}" if path else name
        if isinstance(value, (Sourced, SourcedInt)):
            out.append((here, value))
        elif isinstance(value, BaseModel):
            out.extend(sourced_values(value, here))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, BaseModel):
                    out.extend(sourced_values(item, f"{here}.{key}"))
    return out


def test_bundled_profiles() -> None:
    assert set(bundled_profile_names("model")) == {
        "qwen3-32b", "llama-3.3-70b", "llama-3.1-405b", "deepseek-v3", "deepseek-v3.2-exp",
        "tiny-test"}
    assert set(bundled_profile_names("hardware")) == {"p5en-h200-tp8", "p5-h100-tp8", "cpu-test"}
    assert "calib-dense-p5en-h200-tp8" in bundled_profile_names("calibration")


REAL = ("qwen3-32b", "llama-3.3-70b", "llama-3.1-405b", "deepseek-v3", "deepseek-v3.2-exp",
        "p5en-h200-tp8", "p5-h100-tp8")


@pytest.mark.parametrize("name", [*REAL, "tiny-test", "cpu-test"])
def test_every_constant_has_a_typed_source(name: str) -> None:
    profile = load_profile(name)
    values = sourced_values(profile)
    assert len(values) >= 8
    for field, value in values:
        kind = value.source.split(":", 1)[0]
        assert kind in SOURCE_KINDS, field
        if name in REAL:
            assert kind != "synthetic", f"{field} of a real profile cites a synthetic source"


def test_every_numeric_leaf_in_the_files_sits_in_a_sourced_mapping() -> None:
    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            if "value" in node:
                assert "source" in node, path
                return
            for key, item in node.items():
                walk(item, f"{path}.{key}")
        else:
            assert isinstance(node, (str, bool, list)) or node is None, f"bare number at {path}"

    for file in PROFILES.glob("*.yaml"):
        walk(yaml.safe_load(file.read_text()), file.name)


def edited(tmp_path: Path, name: str, old: str, new: str) -> Path:
    text = (PROFILES / f"{name}.yaml").read_text()
    assert old in text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


def test_a_bare_number_is_an_error(tmp_path: Path) -> None:
    path = edited(tmp_path, "qwen3-32b",
                  'num_layers: {value: 64, unit: layers, source: "config: Qwen/Qwen3-32B '
                  'config.json num_hidden_layers"}', "num_layers: 64")
    with pytest.raises(ScenarioError) as info:
        load_profile(path)
    assert info.value.field == "num_layers"
    assert str(path) in str(info.value) and "source" in str(info.value)
    assert info.value.problems[0][3] is not None  # the line of num_layers


def test_a_missing_source_is_an_error(tmp_path: Path) -> None:
    path = edited(tmp_path, "p5en-h200-tp8",
                  '  hbm_bandwidth: {value: 4.8e+12, unit: B/s, source: "datasheet: NVIDIA H200 '
                  'Tensor Core GPU, GPU memory bandwidth 4.8 TB/s"}',
                  "  hbm_bandwidth: {value: 4.8e+12, unit: B/s}")
    with pytest.raises(ScenarioError) as info:
        load_profile(path)
    assert info.value.field == "device.hbm_bandwidth"
    assert "source" in str(info.value)


def test_a_source_must_say_what_kind_of_evidence_it_is(tmp_path: Path) -> None:
    path = edited(tmp_path, "qwen3-32b", 'source: "config: Qwen/Qwen3-32B config.json head_dim"',
                  'source: "trust me"')
    with pytest.raises(ScenarioError) as info:
        load_profile(path)
    assert info.value.field == "head_dim" and "datasheet" in str(info.value)


def test_a_wrong_unit_is_an_error(tmp_path: Path) -> None:
    path = edited(tmp_path, "p5en-h200-tp8", "{value: 4.8e+12, unit: B/s,",
                  "{value: 4.8e+12, unit: Gb/s,")
    with pytest.raises(ScenarioError) as info:
        load_profile(path)
    assert "hbm_bandwidth" in str(info.value) and "'B/s'" in str(info.value)


def test_unknown_fields_and_wrong_kind(tmp_path: Path) -> None:
    path = edited(tmp_path, "tiny-test", "kv_dtype: bf16", "kv_dtype: bf16\ncolour: blue")
    with pytest.raises(ScenarioError) as info:
        load_profile(path)
    assert info.value.field == "colour" and "no such field" in str(info.value)
    with pytest.raises(ScenarioError) as info:
        load_profile("qwen3-32b", "hardware")
    assert "hardware profile" in str(info.value)


def test_qwen3_32b_is_the_published_shape() -> None:
    m = load_profile("qwen3-32b")
    assert isinstance(m, ModelProfile)
    assert (m.num_layers.value, m.num_attention_heads.value, m.num_kv_heads.value,
            m.head_dim.value, m.hidden_size.value) == (64, 64, 8, 128, 5120)
    assert 32.7e9 < m.total_params.value < 32.9e9
    assert 31.1e9 < m.total_params.value - m.embedding_params.value < 31.3e9  # model card 31.2B
    assert m.weight_dtype == m.kv_dtype == "bf16"


def test_llama_kv_bytes() -> None:
    m = load_profile("llama-3.3-70b")
    assert isinstance(m, ModelProfile)
    assert KVGeometry.of(m, tp=1).bytes_per_token_per_rank == 2 * 80 * 8 * 128 * 2  # 320 KiB
    assert 70.5e9 < m.total_params.value < 70.6e9


def test_p5en_is_the_published_machine() -> None:
    hw = load_profile("p5en-h200-tp8")
    assert isinstance(hw, HardwareProfile)
    assert hw.device.peak_flops_bf16.value == pytest.approx(989.5e12)
    assert hw.device.hbm_bandwidth.value == 4.8e12 and hw.device.hbm_capacity.value == 141e9
    assert hw.node.devices_per_node.value == 8 and hw.node.tp_size.value == 8
    efa = hw.links["network"]
    # 16 x 200 Gb/s per node over 8 GPUs: 2 rails of 25 GB/s per GPU
    assert efa.rails_per_device.value * hw.node.devices_per_node.value == 16
    assert efa.bandwidth_per_rail.value * 8 == pytest.approx(200e9)


def test_nvlink_link_reproduces_spec_section_5() -> None:
    hw = load_profile("p5en-h200-tp8")
    assert isinstance(hw, HardwareProfile)
    nv = TransferCost(hw, "nvlink")
    mib512 = 512 * 2**20
    assert nv.wire_time(mib512, 128) * 1e3 == pytest.approx(2.2, rel=0.05)  # contiguous
    assert nv.wire_time(mib512, 131072) * 1e3 == pytest.approx(795, rel=0.02)  # scattered
    assert nv.prepare_time(131072) * 1e3 == pytest.approx(0.1 + 3.8, rel=0.02)
    assert nv.prepare_time(131072, prepped=False) * 1e3 == pytest.approx(0.1 + 34, rel=0.02)
