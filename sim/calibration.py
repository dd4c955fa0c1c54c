"""Calibration: the few constants no datasheet gives, fitted per (model kind, hardware).

Rules kept here:
- A `CalibrationProfile` (scenarios/profiles/calib-*.yaml) holds the free constants of one
  (model kind, hardware) pair: compute and memory efficiency, the engine's step overhead, the
  per-request delay on the prefill path, the network's achieved share of line rate and the set-up
  of a D->P reuse read. Each names the figures it was fitted to, so `kvplane validate` can tell
  a fitted figure from a predicted one.
- `fit` solves the free constants from a named set of figures (ids of scenarios/published.yaml)
  by least squares on relative error, pricing each figure on the light-load critical path with
  the real cost objects (one request alone, an idle engine: the setting of those figures). A
  constant the chosen figures do not determine keeps its prior value and is marked so.
- Nothing here runs the simulator: fitting is closed-form pricing; predicting is `validate`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .profiles import (
    CalibrationProfile,
    Fitted,
    HardwareProfile,
    ModelProfile,
    bundled_profile_names,
    load_profile,
)

if TYPE_CHECKING:
    from .config import Scenario

__all__ = [
    "FREE",
    "FitResult",
    "apply_calibration",
    "bundled_calibration",
    "calibration_for",
    "fit",
    "fittable_figures",
    "model_kind",
]

FREE = ("compute_utilization", "memory_bandwidth_utilization", "step_overhead",
        "prefill_request_overhead", "network_utilization", "reuse_read_setup")
_BOUNDS = {"compute_utilization": (0.05, 1.0), "memory_bandwidth_utilization": (0.05, 1.0),
           "step_overhead": (0.0, 0.1), "prefill_request_overhead": (0.0, 1.0),
           "network_utilization": (0.05, 1.0), "reuse_read_setup": (0.0, 1.0)}


def model_kind(model: ModelProfile) -> str:
    """The kind of model a calibration applies to."""
    return "moe" if model.moe is not None else "dense"


@functools.cache
def _bundled() -> tuple[CalibrationProfile, ...]:
    out = []
    for name in bundled_profile_names("calibration"):
        prof = load_profile(name, "calibration")
        assert isinstance(prof, CalibrationProfile)
        out.append(prof)
    return tuple(out)


def bundled_calibration(model: ModelProfile, hardware: HardwareProfile) -> CalibrationProfile:
    """The bundled calibration made for this model kind on this hardware."""
    kind = model_kind(model)
    for prof in _bundled():
        if prof.model_kind == kind and prof.hardware == hardware.name:
            return prof
    raise ValueError(
        f"no calibration for {kind} models on {hardware.name}: fit one with `kvplane calibrate "
        f"fit` and name it in the scenario's profiles.calibration")


def calibration_for(scenario: Scenario) -> CalibrationProfile:
    cal = scenario.profiles.calibration
    return cal if cal is not None else bundled_calibration(scenario.model, scenario.hardware)


def apply_calibration(scenario: Scenario, calibration: CalibrationProfile) -> Scenario:
    profiles = scenario.profiles.model_copy(update={"calibration": calibration})
    return scenario.model_copy(update={"profiles": profiles})


# --- pricing a figure on the light-load critical path ------------------------------------------

@dataclass(frozen=True)
class _Setting:
    """What a figure's pricing needs besides the constants: the seed scenarios' settings and
    the block runs their pools produce (measured by simulating, not chosen)."""

    model: ModelProfile
    hardware: HardwareProfile
    chunk: int
    p2d_run_blocks: dict[int, float]  # prompt length -> mean blocks per run of P->D transfers
    read_run_blocks: dict[int, float]  # prompt length -> mean blocks per run of D->P reads
    read_share: dict[int, float]  # prompt length -> share of the prompt a reuse read covers


def _costs(s: _Setting, cal: CalibrationProfile) -> tuple[object, object]:
    from .costs import ComputeCost, TransferCost

    return ComputeCost(s.model, s.hardware, None, 16, cal), TransferCost(s.hardware, "network",
                                                                         cal)


def _pricers(s: _Setting) -> dict[str, list[tuple[float, Callable[[CalibrationProfile], float]]]]:
    """Figure id -> [(observed seconds, price(cal) in seconds)]; a range gives two points."""
    from .costs import ComputeCost, TransferCost

    def cc(cal: CalibrationProfile) -> tuple[ComputeCost, TransferCost]:
        c, t = _costs(s, cal)
        assert isinstance(c, ComputeCost) and isinstance(t, TransferCost)
        return c, t

    def tpot(ctx: int, batch: int = 1) -> Callable[[CalibrationProfile], float]:
        return lambda cal: cc(cal)[0].decode_step_time(batch, batch * ctx)

    def prefill_off(n: int, cal: CalibrationProfile) -> float:
        # the harness's window (sim/validate.py `prefill_window`): the request's leg into
        # prefill, the compute, and the answer's way back to the router
        c, t = cc(cal)
        return (c.prefill_request_overhead + cal.request_leg.value
                + c.chunked_prefill_time(n, 0, s.chunk)
                + t.notification_time() + cal.response_leg.value)

    def ttft_off(n: int) -> Callable[[CalibrationProfile], float]:
        def price(cal: CalibrationProfile) -> float:
            c, t = cc(cal)
            blocks = c.geometry.blocks_for(n)
            runs = max(1, round(blocks / s.p2d_run_blocks[n]))
            p2d = t.kv_timing(c.geometry, blocks, runs, placement="engine_loop", notify=False)
            # then the leg into decode, the P->D transfer, one step, the token's way out
            return (prefill_off(n, cal) + cal.request_leg.value + cal.transfer_setup.value
                    + p2d.total_s + c.decode_step_time(1, n) + cal.response_leg.value)
        return price

    def read(n: int) -> Callable[[CalibrationProfile], float]:
        def price(cal: CalibrationProfile) -> float:
            c, t = cc(cal)
            blocks = c.geometry.full_blocks(int(n * s.read_share[n]))
            runs = max(1, math.ceil(blocks / s.read_run_blocks[n]))
            return t.kv_timing(c.geometry, blocks, runs, placement="thread", notify=False,
                               setup_s=t.reuse_read_setup).total_s
        return price

    from .config import load_published

    pub = {f.id: f for st in load_published().values() for f in st.figures}
    out: dict[str, list[tuple[float, Callable[[CalibrationProfile], float]]]] = {}

    def val(fid: str) -> float:
        v = pub[fid].value
        assert v is not None
        return v / 1e3

    light = pub["pp-tpot-light"]
    assert light.low is not None and light.high is not None
    out["pp-tpot-light"] = [(light.low / 1e3, tpot(1024)), (light.high / 1e3, tpot(16384))]
    for q in (4, 8):  # eight 16k requests running, halfway through a 128-token output
        out[f"pp-tpot-push-{q}qps-16k"] = [(val(f"pp-tpot-push-{q}qps-16k"),
                                            tpot(16384 + 64, 8))]
    for k, n in (("2k", 2048), ("24k", 24576)):
        out[f"bd-prefill-off-{k}"] = [(val(f"bd-prefill-off-{k}"),
                                       lambda cal, n=n: prefill_off(n, cal))]
        out[f"bd-ttft-off-{k}"] = [(val(f"bd-ttft-off-{k}"), ttft_off(n))]
        out[f"bd-read-{k}"] = [(val(f"bd-read-{k}"), read(n))]
    return out


def fittable_figures() -> list[str]:
    """Ids of the figures `fit` can price (light-load critical paths)."""
    from .config import load_scenario

    bd = load_scenario("seed_bidirectional")  # the names do not depend on the runs: no simulation
    return sorted(_pricers(_Setting(bd.model, bd.hardware, 1, {}, {}, {})))


@functools.cache
def _default_setting() -> _Setting:
    """The bidirectional seed, simulated once to measure the block runs its pools produce at
    the published prompt lengths (transfers' contiguity is state, not a constant)."""
    from .config import load_scenario
    from .runner import simulate

    bd = load_scenario("seed_bidirectional")
    p2d: dict[int, float] = {}
    read: dict[int, float] = {}
    share: dict[int, float] = {}
    done = {p.bidirectional: simulate(p, drain=False)[0].done for p in bd.points()}
    bs = bd.engine.block_size
    for n in (2048, 24576):
        near = [r for r in done[False] if abs(r.prompt - n) <= 0.25 * n and r.runs]
        p2d[n] = (sum(-(-r.prompt // bs) for r in near) / sum(r.runs for r in near)
                  if near else 1.0)
        reads = [r for r in done[True] if abs(r.prompt - n) <= 0.25 * n and r.read_runs]
        read[n] = (sum(r.read_blocks for r in reads) / sum(r.read_runs for r in reads)
                   if reads else 1.0)
        share[n] = (sum(r.read_blocks * bs / r.prompt for r in reads) / len(reads)
                    if reads else 0.0)
    return _Setting(bd.model, bd.hardware, bd.engine.max_num_batched_tokens, p2d, read, share)


@dataclass
class FitResult:
    calibration: CalibrationProfile
    residuals: dict[str, float]  # figure id (#k for a range's k-th end) -> relative error
    fitted: dict[str, list[str]]  # constant -> figure ids that determined it
    kept: list[str]  # constants the chosen figures do not determine (prior value kept)


def fit(use: Sequence[str], prior: CalibrationProfile | None = None, name: str | None = None,
        setting: _Setting | None = None, hold: dict[str, float] | None = None) -> FitResult:
    """Least-squares fit of the free constants to the figures `use` (relative errors).

    `hold` fixes constants at given values (not fitted: e.g. a mechanism removed, at 0)."""
    s = setting or _default_setting()
    if prior is None:
        from .config import load_scenario

        prior = calibration_for(load_scenario("seed_bidirectional"))
    hold = hold or {}
    bad = [h for h in hold if h not in FREE]
    if bad:
        raise ValueError(f"cannot hold {bad}; the free constants are {list(FREE)}")
    if hold:
        prior = prior.model_copy(update={
            h: getattr(prior, h).model_copy(update={
                "value": float(v), "fitted_to": [],
                "source": f"derived: held at {v:g} by kvplane calibrate fit --hold"})
            for h, v in hold.items()})
    pricers = _pricers(s)
    unknown = [u for u in use if u not in pricers]
    if unknown:
        raise ValueError(f"cannot price {unknown}; figures fit can use: {sorted(pricers)}")
    obs = [(fid, k, o, p) for fid in use for k, (o, p) in enumerate(pricers[fid])]

    def with_values(x: np.ndarray) -> CalibrationProfile:
        upd = {n: getattr(prior, n).model_copy(update={"value": float(v)})
               for n, v in zip(FREE, x, strict=True)}
        return prior.model_copy(update=upd)

    def residuals(x: np.ndarray) -> np.ndarray:
        cal = with_values(x)
        return np.array([(p(cal) - o) / o for _, _, o, p in obs])

    x = np.array([getattr(prior, n).value for n in FREE], dtype=float)
    lo = np.array([_BOUNDS[n][0] for n in FREE])
    hi = np.array([_BOUNDS[n][1] for n in FREE])
    scale = np.maximum(np.abs(x), 1e-3)

    def jac(x: np.ndarray) -> np.ndarray:
        r0 = residuals(x)
        cols = []
        for i in range(len(x)):
            h = 1e-4 * scale[i]
            xp = x.copy()
            xp[i] += h
            cols.append((residuals(xp) - r0) / h)
        return np.array(cols).T

    determined = (np.abs(jac(x)).sum(axis=0) > 1e-9) & np.array([n not in hold for n in FREE])
    lam = 1e-3
    for _ in range(60):  # Levenberg-Marquardt on the determined constants
        r, j = residuals(x), jac(x)[:, determined]
        a = j.T @ j
        step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -j.T @ r)
        trial = x.copy()
        trial[determined] = np.clip(x[determined] + step, lo[determined], hi[determined])
        if float(np.sum(residuals(trial) ** 2)) < float(np.sum(r ** 2)):
            x, lam = trial, lam / 3
            if np.max(np.abs(step) / scale[determined]) < 1e-7:
                break
        else:
            lam *= 4
    j = jac(x)
    fitted: dict[str, list[str]] = {}
    for i, n in enumerate(FREE):
        if determined[i]:
            fitted[n] = sorted({fid for (fid, _, _, _), d in zip(obs, j[:, i], strict=True)
                                if abs(d) > 1e-9})
    kept = [n for i, n in enumerate(FREE) if not determined[i]]
    upd = {}
    for i, n in enumerate(FREE):
        old = getattr(prior, n)
        if determined[i]:
            upd[n] = Fitted(value=float(x[i]), unit=old.unit, fitted_to=fitted[n],
                            source=f"calibrated: kvplane calibrate fit, least squares on "
                                   f"{', '.join(fitted[n])}")
        else:
            upd[n] = old.model_copy(update={"fitted_to": []} if old.source.startswith(
                "synthetic") else {})
    cal = prior.model_copy(update={**upd, "name": name or f"{prior.name}-fit",
                                   "description": f"fitted by kvplane calibrate fit to "
                                                  f"{', '.join(use)}"})
    res = {f"{fid}#{k}" if len(pricers[fid]) > 1 else fid: float(v)
           for (fid, k, _, _), v in zip(obs, residuals(x), strict=True)}
    return FitResult(cal, res, fitted, kept)
