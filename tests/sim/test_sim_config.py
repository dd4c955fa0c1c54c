"""Scenario configuration: loading, sweep expansion, and errors that name file, field, expectation."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvplane.sim.config import (
    FixedLease,
    LengthSpec,
    PublishedFigure,
    RenewableLease,
    Scenario,
    ScenarioError,
    bundled_scenario_names,
    load_scenario,
    scenario_from_data,
)

MINIMAL = """\
name: t
requests: 10
profiles:
  model: tiny-test
  hardware: cpu-test
engine:
  max_num_seqs: 4
  max_num_batched_tokens: 512
  max_model_len: 4096
workload:
  kind: poisson
  qps: 2
  input_len: 256
  output_len: 16
"""


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path: Path) -> ScenarioError:
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return info.value


# --- loading --------------------------------------------------------------------------------------


def test_bundled_scenarios_load_by_name_and_path() -> None:
    names = bundled_scenario_names()
    assert {"seed_push_vs_pull", "seed_bidirectional"} <= set(names)
    by_name = load_scenario("seed_push_vs_pull")
    here = Path(__file__).resolve().parents[2] / "scenarios" / "seed_push_vs_pull.yaml"
    assert load_scenario(here) == by_name
    assert by_name.model.name == "qwen3-32b" and by_name.hardware.name == "p5en-h200-tp8"
    assert by_name.decode_tp == 8 and by_name.link == "network"


def test_defaults_follow_the_published_connector(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, MINIMAL))
    c = s.connector
    assert c.decoder_kv_blocks_ttl == 480.0 and c.kv_recompute_threshold == 64
    assert isinstance(c.lease, FixedLease)
    assert c.prefix_caching.prefill and not c.prefix_caching.decode


def test_inline_profiles_and_paths(tmp_path: Path) -> None:
    profile = Path(__file__).resolve().parents[2] / "scenarios" / "profiles" / "tiny-test.yaml"
    (tmp_path / "m.yaml").write_text(profile.read_text(), encoding="utf-8")
    text = MINIMAL.replace("model: tiny-test", "model: m.yaml")
    s = load_scenario(write(tmp_path, text))
    assert s.model.name == "tiny-test"


def test_scenario_is_frozen(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, MINIMAL))
    with pytest.raises(ValidationError):
        s.requests = 3  # type: ignore[misc]


def test_dump_round_trips_through_validation(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, MINIMAL))
    assert Scenario.model_validate(s.model_dump()) == s


# --- sweep --------------------------------------------------------------------------------------


def test_points_expand_every_axis_with_mode_outermost() -> None:
    s = load_scenario("seed_push_vs_pull")
    points = s.points()
    assert len(points) == 2 * 4 * 5
    assert [p.mode for p in points[:20]] == ["push"] * 20
    first = points[0]
    assert first.label == "push_qps1_in1024_out128_iter0"
    assert first.scenario.workload.qps == 1  # type: ignore[union-attr]
    assert first.scenario.workload.input_len.mean == 1024  # type: ignore[union-attr]
    assert first.scenario.sweep.modes is None
    assert points[-1].scenario.connector.mode == "pull"


def test_push_and_pull_share_seeds_but_iterations_do_not(tmp_path: Path) -> None:
    text = MINIMAL + "sweep:\n  modes: [push, pull]\n  qps: [1, 2]\n  iterations: 2\n"
    points = load_scenario(write(tmp_path, text)).points()
    by_key: dict[tuple[float | None, int], set[int]] = {}
    for p in points:
        by_key.setdefault((p.qps, p.iteration), set()).add(p.seed)
    assert all(len(seeds) == 1 for seeds in by_key.values())
    assert len({next(iter(v)) for v in by_key.values()}) == 4


def test_multi_turn_axes_map_to_conversation_fields() -> None:
    s = load_scenario("seed_bidirectional")
    points = s.points()
    assert [p.bidirectional for p in points] == [False, True]
    rate = s.workload.conversation_rate  # type: ignore[union-attr]
    assert points[1].label == f"pull_bidi_qps{rate:g}_iter0"


# --- errors name the file, the field and what was expected ----------------------------------------


def test_wrong_literal_names_file_field_line_and_choices(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "connector:\n  mode: teleport\n")
    err = error_of(path)
    text = str(err)
    assert str(path) in text
    assert "connector.mode" in text and "'push' or 'pull'" in text and "teleport" in text
    assert f"{path}:16:" in text
    assert err.field == "connector.mode"


def test_wrong_type_deep_in_a_list(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL + "sweep:\n  qps: [1, fast, 4]\n"))
    assert err.field == "sweep.qps[1]"
    assert "number" in str(err)


def test_unknown_field_lists_the_allowed_ones(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL + "connector:\n  ttl: 5\n"))
    assert err.field == "connector.ttl"
    assert "no such field" in str(err) and "decoder_kv_blocks_ttl" in str(err)


def test_missing_field(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL.replace("requests: 10\n", "")))
    assert err.field == "requests" and "required" in str(err)


def test_unknown_workload_kind(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL.replace("kind: poisson", "kind: bursty")))
    assert err.field == "workload.kind"
    assert "'poisson'" in str(err) and "'multi_turn'" in str(err) and "'bursty'" in str(err)


def test_field_of_the_chosen_workload_kind(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL.replace("qps: 2", "qps: -1")))
    assert err.field == "workload.qps" and "greater than 0" in str(err)


def test_yaml_syntax_error_has_a_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL + "sweep:\n  qps: [1, 2\n"))
    assert "valid YAML" in str(err)
    assert err.problems[0][3] is not None and err.problems[0][3] >= 16


def test_unknown_profile_name_lists_bundled_ones(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL.replace("model: tiny-test", "model: gpt-9")))
    assert err.field == "profiles.model"
    assert "qwen3-32b" in str(err) and "gpt-9" in str(err)


def test_profile_of_the_other_kind(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL.replace("model: tiny-test", "model: cpu-test")))
    assert "model profile" in str(err)


def test_inline_profile_errors_carry_the_scenario_path(tmp_path: Path) -> None:
    text = MINIMAL.replace(
        "  model: tiny-test\n",
        "  model:\n    name: inline\n    num_layers: 2\n",
    )
    err = error_of(write(tmp_path, text))
    fields = [p[0] for p in err.problems]
    assert "profiles.model.num_layers" in fields
    assert any("source" in p[1] for p in err.problems)


def test_incoherent_settings_are_errors(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL + "cluster:\n  decode_tp: 4\n"))
    assert "decode_tp" in str(err) and "devices per node" in str(err)
    err = error_of(write(tmp_path, MINIMAL.replace("input_len: 256", "input_len: 5000")))
    assert "max_model_len" in str(err)
    text = MINIMAL.replace(
        "workload:\n  kind: poisson\n  qps: 2\n  input_len: 256\n  output_len: 16\n",
        "workload:\n  kind: trace\n  path: t.jsonl\nsweep:\n  qps: [1]\n",
    )
    err = error_of(write(tmp_path, text))
    assert "sweep.qps" in str(err) and "trace" in str(err)


def test_no_chunked_prefill_needs_a_large_token_budget(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, MINIMAL.replace("max_model_len: 4096",
                                                   "max_model_len: 4096\n  chunked_prefill: false")))
    assert "max_num_batched_tokens" in str(err)


def test_bundled_name_that_does_not_exist() -> None:
    with pytest.raises(ScenarioError) as info:
        load_scenario("no_such_scenario")
    assert "seed_push_vs_pull" in str(info.value)


def test_trace_path_is_relative_to_the_scenario(tmp_path: Path) -> None:
    text = MINIMAL.replace(
        "workload:\n  kind: poisson\n  qps: 2\n  input_len: 256\n  output_len: 16\n",
        "workload:\n  kind: trace\n  path: t.jsonl\n",
    )
    s = load_scenario(write(tmp_path, text))
    assert s.workload.path == str(tmp_path / "t.jsonl")  # type: ignore[union-attr]


def test_scenario_from_data_without_a_file() -> None:
    data = {
        "name": "x", "requests": 1, "profiles": {"model": "tiny-test", "hardware": "cpu-test"},
        "engine": {"max_num_batched_tokens": 512, "max_model_len": 2048},
        "workload": {"kind": "poisson", "input_len": 100},
    }
    assert scenario_from_data(data).workload.input_len.mean == 100  # type: ignore[union-attr]
    with pytest.raises(ScenarioError) as info:
        scenario_from_data({**data, "requests": 0})
    assert "<scenario>: requests" in str(info.value)


# --- small models ---------------------------------------------------------------------------------


def test_length_spec_accepts_a_bare_integer() -> None:
    assert LengthSpec.model_validate(512) == LengthSpec(mean=512)
    with pytest.raises(ValidationError):
        LengthSpec(mean=10, min=5, max=2)


def test_renewable_lease_must_outlast_its_heartbeat() -> None:
    assert RenewableLease(kind="renewable").extension_s == 20.0
    with pytest.raises(ValidationError):
        RenewableLease(kind="renewable", heartbeat_interval_s=30.0, extension_s=20.0)


def test_published_figure_is_a_value_or_a_range() -> None:
    PublishedFigure(id="a", metric="tpot_ms", low=5.6, high=5.8, source="s")
    with pytest.raises(ValidationError):
        PublishedFigure(id="a", metric="tpot_ms", source="s")
    with pytest.raises(ValidationError):
        PublishedFigure(id="a", metric="tpot_ms", value=1.0, where={"colour": "red"}, source="s")
    with pytest.raises(ValidationError):
        PublishedFigure(id="a", metric="tpot_ms", value=1.0, low=1.0, high=2.0, source="s")
