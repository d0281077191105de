"""Step time calibrated on this machine: the cost model's multipliers fitted to step times measured here.

Why: cost.py's rates describe a device class, and on a given machine its predicted step times are off
(on the 2-core CPU they develop on, 15-65% short for tiny models, whose steps go to elementwise kernels
and Python more than to matmuls). The ranking survives that; a run that prints "predicted step 0.12 s"
should still be right. So a run times its plan's first steps (`Trainer`, rank 0); when its prediction was
more than `TOLERANCE` off, that step joins this machine's samples, the multipliers are fitted again
(`cost.calibrate`) and kept in a small JSON cache keyed by the device, and the next plan on this machine
(`plan_for_run`, `plan_here`) starts calibrated.

Per model, not per machine alone: how many seconds a model spends per FLOP depends on the model (on the
2-core CPU a tiny gpt2 takes 2.5x the constants' seconds, a llama of the same size 1.4x, a wider one 1.0x:
scripts/bench_step_time.py), so multipliers fitted to other models' runs mislead more than they help.
Before the search a timed probe of the model being planned (step_time_probe.py, about a second, cached
per model) fits the multipliers to this model's forward and backward; the runs of this same model then
rescale them by the median ratio measured/predicted of their steps, so its second run predicts what its
first measured. Without a probe (a model too large to probe here, or a probe that failed) the
multipliers fitted to every run on this device are the fallback. What-if targets (`memtrain plan --gpu`)
neither probe nor read the cache: they are ranked with the device class's constants (`cost.SPEEDS`).

Compiled runs (`strategies.compile`) are samples apart (`Sample.compiled`): their eager terms and their
measured seconds give the device's compile speedup (`compile_speedup`: how much faster the compiled terms,
compute, recompute and micro-steps, ran than the multipliers fitted to eager steps predict), which the
cost model divides those terms by for a compiled plan. Without a compiled sample it is 1.0: compile is
never assumed faster (nor slower) until this machine measured it; the multipliers are fitted to eager
samples only, so a compiled run does not bend them.

The cache is `$MEMTRAIN_CACHE_DIR/step_time.json` (default `$XDG_CACHE_HOME/memtrain`, else
`~/.cache/memtrain`); `MEMTRAIN_CACHE_DIR=off` turns calibration off (no cache, no probe). One entry per
device key (CPU model and thread count, or GPU name, each with the torch version): the multipliers
fitted to all its runs, the last `MAX_SAMPLES` runs' samples (each naming its model), and the last
`MAX_PROBES` models' probe timings. It is written atomically (a temporary file, then a rename), so a
reader never sees half a file; of two runs finishing together the last one wins. A cache that cannot be
read, or an entry with a time or multiplier that is not a positive number, is ignored with a warning: it
only ever makes a prediction better.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from memtrain import json_out
from memtrain.errors import MemtrainError
from memtrain.jsonfile import read_json_object
from memtrain.planner import step_time_probe
from memtrain.planner.cost import COMPILED_TERMS, TERMS, CostModel, StepCost, calibrate
from memtrain.planner.model_probe import ModelProbe

TOLERANCE = 0.10  # a measured step time further than this from the prediction re-fits the multipliers
MAX_SAMPLES = 64  # samples kept per device (the newest)
MAX_PROBES = 32  # models whose probe timings are kept per device (the newest)
SPEEDUP_RANGE = 10.0  # a learned compile speedup stays within [1 / this, this]
CACHE_FILE = "step_time.json"
CACHE_ENV = "MEMTRAIN_CACHE_DIR"
VERSION = 1  # of the cache's layout: an entry of another version is ignored


@dataclass(frozen=True)
class Sample:
    """One measured step: the plan's predicted seconds by term at the device class's rates, and the
    median seconds it took."""

    plan: str
    terms: tuple[float, ...]
    seconds: float
    model: str = ""  # the probed model it ran ("" when there was no probe)
    compiled: bool = False  # a step of a compiled plan (`terms`: its eager terms)

    def to_dict(self) -> dict[str, Any]:
        compiled = {"compiled": True} if self.compiled else {}
        return {
            "plan": self.plan,
            "terms": list(self.terms),
            "seconds": self.seconds,
            "model": self.model,
            **compiled,
        }


@dataclass(frozen=True)
class DeviceCalibration:
    """The multipliers of one device, the samples they were fitted to, and probe timings per model."""

    device: str
    scale: tuple[float, ...]
    samples: tuple[Sample, ...]
    probes: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)

    def with_sample(self, sample: Sample, base: CostModel) -> DeviceCalibration:
        """This calibration with `sample` added (the oldest dropped past `MAX_SAMPLES`), fitted again."""
        samples = (*self.samples, sample)[-MAX_SAMPLES:]
        return replace(self, scale=fit(base, samples).scale, samples=samples)

    def with_probe(self, model: str, timings: tuple[Sample, ...]) -> DeviceCalibration:
        """This calibration with `model`'s probe timings (the oldest model dropped past `MAX_PROBES`)."""
        kept = [(k, v) for k, v in self.probes.items() if k != model][-(MAX_PROBES - 1) :]
        return replace(self, probes=dict([*kept, (model, timings)]))


def device_key(device: torch.device) -> str:
    """What the cache is keyed by: the GPU's name, or the CPU's model and torch's thread count, with the
    torch version (a new torch can change every kernel's speed)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_model()}, {torch.get_num_threads()} threads"
    return f"{device.type}: {name}; torch {torch.__version__}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; what `platform` knows elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cache_path() -> Path | None:
    """Where the cache lives; None when `MEMTRAIN_CACHE_DIR=off`."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured.lower() == "off":
        return None
    if configured:
        return Path(configured) / CACHE_FILE
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "memtrain" / CACHE_FILE


def load(device: str) -> DeviceCalibration | None:
    """The cached calibration of `device`, or None (no cache, no entry, or an entry that cannot be read)."""
    entry = _read_all().get(device)
    if not isinstance(entry, dict) or entry.get("version") != VERSION:
        return None
    try:
        scale = tuple(float(k) for k in entry["scale"])
        samples = tuple(_sample(s) for s in entry["samples"])
        probes = {str(k): tuple(_sample(s) for s in v) for k, v in entry.get("probes", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        _warn(f"ignoring the unreadable entry for {device!r}")
        return None
    every = [*samples, *(s for v in probes.values() for s in v)]
    if len(scale) != len(TERMS) or any(len(s.terms) != len(TERMS) for s in every):
        _warn(f"ignoring the entry for {device!r}: it does not match this version's cost terms")
        return None
    if not all(_positive(k) for k in scale) or not all(_measured(s) for s in every):
        _warn(f"ignoring the damaged entry for {device!r}: a time or multiplier is not a positive number")
        return None
    return DeviceCalibration(device, scale, samples, probes)


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _measured(sample: Sample) -> bool:
    """A sample memtrain could have written: a positive time, terms that are finite, not negative, and
    not all zero (the fit divides by both)."""
    terms = sample.terms
    return _positive(sample.seconds) and all(math.isfinite(t) and t >= 0 for t in terms) and sum(terms) > 0


def store(calibration: DeviceCalibration) -> Path | None:
    """Write `calibration` into the cache (other devices' entries kept); the path, or None when the cache
    is off or cannot be written (a warning says why)."""
    path = cache_path()
    if path is None:
        return None
    entries = _read_all()
    entries[calibration.device] = {
        "version": VERSION,
        "terms": list(TERMS),
        "scale": list(calibration.scale),
        "samples": [s.to_dict() for s in calibration.samples],
        "probes": {k: [s.to_dict() for s in v] for k, v in calibration.probes.items()},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=f".{CACHE_FILE}.", dir=path.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(json_out.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        _warn(f"cannot write {path} ({exc.strerror or exc}); set {CACHE_ENV} to a writable directory or off")
        return None
    return path


def local_cost_model(
    device: torch.device, probe: ModelProbe | None = None, usable_bytes: int = 0
) -> CostModel:
    """The cost model a plan for `device` (present in this process) is ranked with: fitted to a timed
    probe of `probe`'s model and rescaled by this machine's cached runs of that model (`for_model`), or,
    without a probe, fitted to every cached run here."""
    base = CostModel.for_device(device.type)
    if cache_path() is None:
        return base
    key = device_key(device)
    cached = load(key) or DeviceCalibration(key, base.scale, ())
    if probe is None:
        return _device_wide(base, cached)
    name = step_time_probe.fingerprint(probe)
    timings = cached.probes.get(name, ())
    if not timings:
        measured = step_time_probe.time_model(probe, device, usable_bytes)
        timings = tuple(Sample(what, cost.terms(), seconds, name) for what, cost, seconds in measured)
        if not timings:
            return _device_wide(base, cached)
        store(cached.with_probe(name, timings))
    return for_model(base, name, timings, cached.samples)


def _device_wide(base: CostModel, cached: DeviceCalibration) -> CostModel:
    """`base` at the multipliers fitted to every run on the device, with its compile speedup."""
    return replace(base, scale=cached.scale, compile_speedup=compile_speedup(cached.scale, cached.samples))


def fit(base: CostModel, samples: Sequence[Sample]) -> CostModel:
    """`base` with multipliers fitted to the eager `samples` (`base`'s without any) and the compile
    speedup of the compiled ones."""
    eager = [(StepCost.from_terms(s.terms), s.seconds) for s in samples if not s.compiled]
    fitted = calibrate(base, eager)
    return replace(fitted, compile_speedup=compile_speedup(fitted.scale, samples))


def compile_speedup(scale: Sequence[float], samples: Sequence[Sample]) -> float:
    """How much faster the compiled terms of the compiled `samples` ran than their eager prediction at
    `scale` (the median over the samples, within `SPEEDUP_RANGE`); 1.0 without a compiled sample."""
    ratios = []
    for s in samples:
        if not s.compiled:
            continue
        at = [t * k for t, k in zip(s.terms, scale, strict=True)]
        compiled = sum(t for t, term in zip(at, TERMS, strict=True) if term in COMPILED_TERMS)
        rest = sum(at) - compiled
        ratios.append(compiled / max(s.seconds - rest, compiled / SPEEDUP_RANGE))
    if not ratios:
        return 1.0
    return min(max(statistics.median(ratios), 1 / SPEEDUP_RANGE), SPEEDUP_RANGE)


def for_model(base: CostModel, model: str, probe: Sequence[Sample], samples: Sequence[Sample]) -> CostModel:
    """`base` fitted to `model`'s probe timings, every multiplier times the median ratio measured/predicted
    of this model's eager runs among `samples` (the device's), and the compile speedup of its compiled
    runs (of every model's on the device when it has none)."""
    fitted = replace(fit(base, probe), model=model)
    runs = [s for s in samples if s.model == model]
    eager = [s for s in runs if not s.compiled]
    if eager:
        ratio = statistics.median(s.seconds / _at(s.terms, fitted.scale) for s in eager)
        fitted = replace(fitted, scale=tuple(k * ratio for k in fitted.scale))
    compiled = [s for s in runs if s.compiled] or [s for s in samples if s.compiled]
    return replace(fitted, compile_speedup=compile_speedup(fitted.scale, compiled))


def check_step_time(
    predicted: StepCost, measured: list[float], device: torch.device, plan: str, compiled: bool = False
) -> dict[str, Any]:
    """Predicted against measured step time of a run's plan (the median of `measured`, seconds); when the
    prediction is more than `TOLERANCE` off, this step joins the device's samples, the multipliers are
    fitted again and cached. Returns the record for plan.json (`refit_predicted_s`: what the next plan of
    this model here predicts for this plan)."""
    seconds = statistics.median(measured)
    error = (predicted.total - seconds) / seconds
    record: dict[str, Any] = {
        "predicted_s": predicted.total,
        "measured_s": seconds,
        "measured_steps": len(measured),
        "relative_error": error,
        "calibrated": predicted.calibrated,
        "device": device_key(device),
        "model": predicted.model or None,
        "refit": abs(error) > TOLERANCE,
    }
    if record["refit"]:
        base = CostModel.for_device(device.type)
        raw = predicted.uncalibrated()
        previous = load(record["device"]) or DeviceCalibration(record["device"], base.scale, ())
        sample = Sample(plan, raw.terms(), seconds, predicted.model, compiled)
        refitted = previous.with_sample(sample, base)
        probe = refitted.probes.get(predicted.model, ())
        after = (
            for_model(base, predicted.model, probe, refitted.samples)
            if probe
            else _device_wide(base, refitted)
        )
        record["refit_predicted_s"] = _at(
            raw.terms(), after.scale, after.compile_speedup if compiled else 1.0
        )
        path = store(refitted)
        record["cache"] = str(path) if path is not None else None
    return record


def describe(record: dict[str, Any]) -> str:
    """The log line of a `check_step_time` record."""
    line = (
        f"[memtrain] step time: predicted {record['predicted_s']:.4g} s"
        f"{' (calibrated)' if record['calibrated'] else ''}, measured {record['measured_s']:.4g} s "
        f"(median of {record['measured_steps']}), {record['relative_error']:+.0%}"
    )
    if not record["refit"]:
        return line
    where = f"cached in {record['cache']}" if record.get("cache") else "not cached"
    return (
        f"{line}; re-fitted the step-time model ({record['refit_predicted_s']:.4g} s for this plan, {where})"
    )


def _at(terms: tuple[float, ...], scale: tuple[float, ...], speedup: float = 1.0) -> float:
    """Seconds of eager `terms` at `scale`, the compiled terms divided by `speedup`."""
    sped = [speedup if term in COMPILED_TERMS else 1.0 for term in TERMS]
    return sum(t * k / s for t, k, s in zip(terms, scale, sped, strict=True))


def _sample(raw: dict[str, Any]) -> Sample:
    terms = tuple(float(t) for t in raw["terms"])
    compiled = raw.get("compiled", False) is True
    return Sample(str(raw["plan"]), terms, float(raw["seconds"]), str(raw.get("model", "")), compiled)


def _read_all() -> dict[str, Any]:
    return read_cache(cache_path(), _warn, "the step-time cache")


def read_cache(path: Path | None, warn: Callable[[str], None], name: str) -> dict[str, Any]:
    """The entries of the JSON cache at `path`: {} when the cache is off or missing, and when it cannot be
    read (`warn` says why): a cache only ever makes a prediction better, never stops a run."""
    if path is None or not path.is_file():
        return {}
    try:
        return read_json_object(str(path), CACHE_ENV)
    except MemtrainError as exc:
        warn(f"ignoring {name}: {exc}")
        return {}


def _warn(message: str) -> None:
    print(f"[memtrain] step-time calibration: {message}", file=sys.stderr, flush=True)
