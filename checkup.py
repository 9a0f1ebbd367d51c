"""The check-up: what a training step spends on moving data (notebooks 09 and 13).

``checkup(step, batches)`` times and profiles a training step, and says what makes it wait:
each cause it finds, the step time its fix would save (a replay of the profiled steps without
it) and what to change. ``analyze_checkup_trace`` does the same from a trace alone.

Times are in milliseconds throughout; the profiler's trace gives microseconds, converted where
it is read. The one exception is ``CheckupReport.step_window``, which hands the timeline plots
``Activity`` lanes in microseconds, as helpers.py keeps them. The profiler's lanes
(``helpers.parse_chrome_trace``, ``helpers.Activity``) and the rest of the measuring kit stay
in helpers.py, which does not import this module.
"""

from __future__ import annotations

import bisect
import collections
import enum
import functools
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from helpers import (
    COPY_KINDS,
    Activity,
    _activity_kind,
    _intersection,
    _length,
    _trace_events,
    _union,
    format_bytes,
    lane_names,
    parse_chrome_trace,
    require_cuda,
    time_cuda,
)

# The marks the check-up puts in the trace, and the CUDA calls it reads there

STEP_MARK, NEXT_MARK = "checkup: step", "checkup: next batch"
#: the release of a step's batch: a loader's shared memory, unmapped on this thread
RELEASE_MARK = "checkup: release batch"
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})
#: copies that return only when done; an async one blocks too when its host side is pageable
MEMCPY_CALLS = frozenset({"cudaMemcpy", "cudaMemcpyAsync", "cuMemcpy", "cuMemcpyAsync",
                          "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyHtoDAsync_v2",
                          "cuMemcpyDtoHAsync_v2"})
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                          "cuLaunchKernelEx"})
#: one call that launches a captured CUDA graph: every kernel of the replay carries its
#: correlation id (notebook 13)
GRAPH_LAUNCH_CALLS = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})


# The kinds of finding, and what each asks the reader to change

class Kind(enum.StrEnum):
    """What a finding says makes the step wait (notebook 09); each has its advice (``ADVICE``).
    A string too: ``finding.kind == "scalar_read"`` holds, and the reports print its value."""

    PAGEABLE_H2D = "pageable_h2d"
    CONSTANT_H2D = "constant_h2d"
    BLOCKING_H2D = "blocking_h2d"
    COPY_EXPOSED = "copy_exposed"
    SCALAR_READ = "scalar_read"
    BLOCKING_D2H = "blocking_d2h"
    EXPLICIT_SYNC = "explicit_sync"
    HIDDEN_SYNC = "hidden_sync"
    GRAD_SCALER = "grad_scaler"
    NONFINITE_CHECK = "nonfinite_check"
    DATA_WAIT = "data_wait"
    HOST_BOUND = "host_bound"
    HOST_WAITS = "host_waits"


#: per kind of finding: what to change, and the notebooks that measure why
ADVICE = {
    Kind.PAGEABLE_H2D: (
        "copy from pinned memory with non_blocking=True: DataLoader(pin_memory=True), or pin "
        "once what repeats", ("01", "03", "06")),
    Kind.CONSTANT_H2D: (
        "make the tensor once, before the loop, or on the GPU (torch.full, torch.arange): a "
        "tensor from a Python list is copied from pageable memory and waits for the GPU",
        ("01", "03")),
    Kind.BLOCKING_H2D: (
        "the source is pinned but the copy waits: add non_blocking=True", ("03",)),
    Kind.COPY_EXPOSED: (
        "copy batch k+1 on a side stream while step k computes (helpers.Prefetcher)",
        ("04", "07")),
    Kind.SCALAR_READ: (
        "keep metrics on the GPU and read them every N steps through a pinned buffer and an "
        "event, not .item() every step", ("05", "09")),
    Kind.BLOCKING_D2H: (
        "copy into pinned memory with non_blocking=True and wait on an event only when the "
        "values are needed", ("05",)),
    Kind.EXPLICIT_SYNC: (
        "drop the synchronisation from the step; time with CUDA events, and wait on an event "
        "recorded steps earlier", ("00", "05")),
    Kind.HIDDEN_SYNC: (
        "an operation whose output size depends on the data waits for the GPU: give it the "
        "size (e.g. bincount's minlength, repeat_interleave's output_size) or move it off the "
        "hot path", ("00",)),
    Kind.GRAD_SCALER: (
        "GradScaler.step reads found_inf on the host every step: train in bfloat16 without a "
        "scaler, or use a fused optimizer (fused=True), which checks on the GPU", ("00",)),
    Kind.NONFINITE_CHECK: (
        "error_if_nonfinite=True reads the norm on the host every step: check it every N "
        "steps, or keep the check on the GPU", ("00", "05")),
    Kind.DATA_WAIT: (
        "the loader does not keep up: more workers, compact (uint8) batches, work moved to the "
        "GPU", ("06", "07")),
    Kind.HOST_BOUND: (
        "the GPU waits for Python to launch kernels: fewer, larger operations, CUDA graphs or "
        "torch.compile", ("00", "13")),
    Kind.HOST_WAITS: (
        "remove every one of these waits: while one is left, the GPU runs dry at it and the "
        "others cost little", ("05", "09")),
}
#: per kind of finding: who waits, and for what, in words (CheckupReport.summary)
WAITS_ON = {
    Kind.PAGEABLE_H2D: "the host, for each copy from pageable memory to finish",
    Kind.CONSTANT_H2D: "the host, for a tensor made from Python values to be copied",
    Kind.BLOCKING_H2D: "the host, for a pinned copy made without non_blocking=True",
    Kind.COPY_EXPOSED: "the GPU, for the batch's copy: no kernel runs beside it",
    Kind.SCALAR_READ: "the host, for the GPU, at each .item()",
    Kind.BLOCKING_D2H: "the host, for a device-to-host copy",
    Kind.EXPLICIT_SYNC: "the host, for the GPU, at a synchronize() call",
    Kind.HIDDEN_SYNC: "the host, for an operation whose output size depends on the data",
    Kind.GRAD_SCALER: "the host, for GradScaler's check of the gradients",
    Kind.NONFINITE_CHECK: "the host, for the gradient norm's check",
    Kind.DATA_WAIT: "the GPU, while the host takes the next batch and frees the last",
    Kind.HOST_BOUND: "the GPU, for Python to launch its kernels",
    Kind.HOST_WAITS: "the host, for the GPU, at",
}
#: data_wait where the batch source alone keeps ahead of the step and its batches are copied
#: from pageable memory: the wait is next()'s own work on the step's thread (taking the batch
#: from the workers), not the loader's pace
KEEPS_UP_ADVICE = ("the loader keeps up, but next() takes each batch from the workers on this "
                   "thread, and its shared memory is freed here after the step: "
                   "DataLoader(pin_memory=True) does both on its pin thread", ("06", "09"))
#: data_wait where the source keeps ahead and no batch is copied from pageable memory (a pin
#: thread has them ready): what is left costs the GPU only while the host waits for it
HANDOVER_ADVICE = ("the loader keeps up: what is left is next()'s own hand-over on this thread, "
                   "which the GPU stops waiting for once the host runs ahead of it (no wait for "
                   "the GPU every step)", ("05", "09"))

# Thresholds and fallbacks of the analysis (times in ms)

PER_STEP = 0.5  # a cause seen in at least every other step is part of the step
#: a finding saves at least this share of the step, or this many milliseconds
MIN_SAVING_SHARE, MIN_SAVING_MS = 0.03, 0.05
PACED_COPY_BYTES, SLOW_COPY_SHARE = 8 << 20, 0.8  # a copy the profiler slowed (_pace_slow_copies)
STEADY_RATIO = 1.25  # timed and profiled steps (or the first profiled step and the rest) agree
BACK_TO_BACK_MS = 0.001  # a device op this close behind the one before it on its stream queued
#: a device op that starts this long after its launch and its stream allowed it waited for
#: another stream (an event, cudaStreamWaitEvent)
CROSS_STREAM_MS = 0.005
#: times this close are the same time: the trace's microseconds, read in milliseconds, round
#: (1 us + 4 us can come out a hair above 5 us), and a threshold must not flip on that
SAME_MS = 1e-9
LAUNCH_MS = 0.005  # a launch's host time when the trace has no launch to measure it by
LINK_GBPS = 20.0  # pinned host-to-device rate, for a trace read alone with no pinned copy in it
HOST_AHEAD = 0.5  # latent costs are priced with the host's time at this share of the GPU's
LATER_RATIO = 1.5  # a latent cause costs at least this much more once the host keeps ahead


# The report: findings, latent habits, and the table and summary a reader prints

def _notebooks(numbers: tuple[str, ...]) -> str:
    """The notebooks as the summary cites them: (notebook 09), (notebooks 05 and 09),
    (notebooks 00, 05 and 09)."""
    if len(numbers) == 1:
        return f"(notebook {numbers[0]})"
    return f"(notebooks {', '.join(numbers[:-1])} and {numbers[-1]})"


@dataclass(frozen=True)
class Finding:
    """A cause that costs the step time, with what to change and the notebooks that measure
    why (notebook 09)."""

    kind: Kind
    seen: str  # what was measured, per step
    cost_ms: float  # per step: the step time the replay saves without it (unprofiled pace)
    advice: str
    notebooks: tuple[str, ...]
    predicted_step_ms: float | None = None  # the step time the replay predicts without it

    def __str__(self) -> str:
        after = (f" -> about {self.predicted_step_ms:.3g} ms a step without it"
                 if self.predicted_step_ms is not None else "")
        return (f"{self.kind}, {self.cost_ms:.3g} ms a step{after}: {self.seen} -> "
                f"{self.advice} {_notebooks(self.notebooks)}")


@dataclass(frozen=True)
class Latent:
    """A habit that costs (almost) nothing now because the host is the bottleneck, and what the
    replay says it would cost once the host's time were down to ``HOST_AHEAD`` of the GPU's
    (notebook 09)."""

    kind: Kind
    seen: str  # what was measured, per step
    cost_ms: float  # now, per step
    later_ms: float  # once the host is not the bottleneck, per step
    advice: str
    notebooks: tuple[str, ...]

    def __str__(self) -> str:
        return (f"{self.kind}: {self.seen}: free while the host is the bottleneck; about "
                f"{self.later_ms:.3g} ms a step once it is not -> {self.advice} "
                f"{_notebooks(self.notebooks)}")


@dataclass
class CheckupReport:
    """What ``checkup`` saw; times per step in milliseconds, bytes per step (notebook 09).
    None: not measured (no unprofiled timing, no batch source, no kernel to count...)."""

    steps: int
    step_ms: float | None  # unprofiled: CUDA events from the end of the first timed step on
    profiled_step_ms: float  # under the profiler: one step's period on the GPU
    #: the device's time outside host<->device copies (kernels, memsets, device-to-device
    #: copies) in a profiled step / ``reference_ms``, at most 1
    gpu_busy: float
    h2d_pageable: tuple[float, float]  # (copies, bytes) per step
    h2d_pinned: tuple[float, float]
    d2h: tuple[float, float]
    syncs: dict[Kind, float]  # cause -> synchronisations per step, on every thread of the step
    host_wait_ms: float  # in them and in copies that block, per step
    data_wait_ms: float  # in next(batches) and releasing the batch after its step, per step
    #: cause -> the step time the replay saves without it, per step at the unprofiled pace
    #: (every cause seen, findings or not; host_bound: with no host time outside waits)
    savings_ms: dict[Kind, float]
    loader_ms: float | None = None  # the batch source alone, per batch, at its steady pace
    findings: list[Finding] = field(default_factory=list)
    latent: list[Latent] = field(default_factory=list)
    replay_fidelity: float | None = None  # the replay's step, nothing removed / the trace's
    #: the replay's step with the host's time scaled to match ``step_ms`` as well as it can
    #: (the profiler slows the host only): far from ``step_ms``, the two runs differ
    replay_step_ms: float | None = None
    host_busy_ms: float | None = None  # host time outside waits, per step (unprofiled pace)
    gpu_work_ms: float | None = None  # device time (kernels, copies) per step
    short_kernels: float | None = None  # share of kernels shorter than their launch call
    launch_queue: float | None = None  # kernels launched and not begun, on average
    host_allocs_timed: float | None = None  # pinned blocks the host allocator made while timed
    #: large pinned copies the profiler slowed, replayed at the link's rate measured apart
    paced_copies: int = 0
    #: what free launches save once the host's waits are gone too: host_bound is named only where
    #: the host cannot keep ahead even then (not a GPU-bound step whose host time, as profiled,
    #: comes near the GPU's and whose waits make the gaps)
    host_bound_past_waits_ms: float | None = None
    #: the pinned copy rate, measured apart and unprofiled, at which the copies counted in
    #: ``paced_copies`` were replayed
    link_gbps: float | None = None
    #: the share of the profiled host time that matches the unprofiled step (0: the replay's
    #: device floor alone already takes the timed step's time)
    host_scale: float | None = None
    #: the causes that block the host, seen in every other step or more, when there are two or
    #: more, and what the replay saves with all of them removed at once: one wait can hide the
    #: next (the GPU is already idle when the second comes), so each alone saves less
    waits_together: tuple[Kind, ...] = ()
    waits_together_ms: float = 0.0
    profiled_periods_ms: list[float] = field(default_factory=list, repr=False)
    activities: list[Activity] = field(default_factory=list, repr=False)
    #: the profiled steps on the host and on the GPU, in ms from the trace's first activity
    host_steps: list[tuple[float, float]] = field(default_factory=list, repr=False)
    gpu_steps: list[tuple[float, float]] = field(default_factory=list, repr=False)
    #: kinds -> the step time the replay saves without all of them (set by the analysis)
    what_if: Callable[[Iterable[str]], float] | None = field(default=None, repr=False,
                                                             compare=False)

    @property
    def kinds(self) -> set[Kind]:
        """The kinds of the findings (notebook 09)."""
        return {f.kind for f in self.findings}

    @property
    def named_kinds(self) -> set[Kind]:
        """Every cause the findings name: their kinds, and the kinds a ``host_waits`` finding
        prices together (notebook 09)."""
        together = set(self.waits_together) if Kind.HOST_WAITS in self.kinds else set()
        return (self.kinds - {Kind.HOST_WAITS}) | together

    def saving_ms(self, *kinds: str) -> float:
        """What removing every cause of ``kinds`` at once saves a step, as the replay predicts
        (0 where none was seen). Several kinds are replayed together, not added: a change
        that removes two waits can save more than the two alone, so a report without its
        replay refuses several (notebook 09)."""
        if len(kinds) == 1:
            return self.savings_ms.get(kinds[0], 0.0)
        if self.what_if is None:
            raise ValueError(f"this report has no replay to price {', '.join(kinds)} together: "
                             "ask for one kind at a time")
        return self.what_if(kinds)

    @property
    def reference_ms(self) -> float:
        """The step the savings are shares of: the timed one, else the profiled one (notebook
        09)."""
        return self.step_ms if self.step_ms is not None else self.profiled_step_ms

    @property
    def steady(self) -> bool:
        """Whether the timed steps and the profiled ones agree, and the profiled ones with each
        other: the findings describe the step that was timed (notebook 09)."""
        return not self.unsteady()

    def unsteady(self) -> list[str]:
        """Why the findings may not describe the timed step, one line each (notebook 09)."""
        notes = []
        explained = (self.replay_step_ms if self.replay_step_ms is not None
                     else self.profiled_step_ms)
        if self.step_ms is not None and explained and \
                not 1 / STEADY_RATIO <= self.step_ms / explained <= STEADY_RATIO:
            notes.append(f"the timed steps ({self.step_ms:.3g} ms) and the profiled ones "
                         f"({self.profiled_step_ms:.3g} ms; {explained:.3g} ms with the host "
                         f"at its unprofiled pace) disagree: the step is not steady, and the "
                         f"findings may not describe the timed step")
        periods = self.profiled_periods_ms
        if len(periods) > 2:
            rest = statistics.median(periods[1:])
            if rest > 0 and (periods[0] > STEADY_RATIO * rest or max(periods) > 2 * rest):
                notes.append(f"the profiled steps vary: {periods[0]:.3g} ms first, "
                             f"{rest:.3g} ms typical, {max(periods):.3g} ms the longest")
        if self.host_scale == 0:
            notes.append(f"the replay with no host time ({self.replay_step_ms:.3g} ms) already "
                         f"takes the timed step's {self.step_ms:.3g} ms: the profiler stretched "
                         f"the device's work, and what the host's causes save is priced low")
        if self.host_allocs_timed is not None and self.host_allocs_timed > 0:
            notes.append(f"the host allocator pinned {self.host_allocs_timed:.0f} new blocks "
                         f"while the steps were timed: they were still warming up")
        return notes

    def rows(self) -> list[tuple[str, str]]:
        """The report's table, as (what, value) rows (notebook 09)."""
        def copies(pair):
            return f"{pair[0]:.3g} ({format_bytes(pair[1])})"

        def per_cause(values, unit=""):
            ordered = sorted(values.items(), key=lambda kv: -kv[1])
            return ", ".join(f"{cause} {n:.3g}{unit}" for cause, n in ordered) or "0"

        def number(value, spec):
            return "-" if value is None else format(value, spec)

        rows = [("step time (unprofiled)",
                 "-" if self.step_ms is None else f"{self.step_ms:.3g} ms")]
        if self.loader_ms is not None:
            rows.append(("the batch source alone, per batch", f"{self.loader_ms:.3g} ms"))
        return rows + [
            ("GPU busy (device work / step time)", f"{self.gpu_busy:.2f}"),
            ("host busy / GPU work, per step", f"{number(self.host_busy_ms, '.3g')} ms / "
                                               f"{number(self.gpu_work_ms, '.3g')} ms"),
            ("kernels shorter than their launch", number(self.short_kernels, ".0%")),
            ("launch queue (kernels waiting)", number(self.launch_queue, ".3g")),
            ("replay / profiled step", number(self.replay_fidelity, ".3f")),
            ("predicted saving, by cause", per_cause(self.savings_ms, " ms")),
            ("... of the host's waits together",
             f"{self.waits_together_ms:.3g} ms ({', '.join(self.waits_together)})"
             if self.waits_together else "-"),
            ("H2D copies from pageable memory", copies(self.h2d_pageable)),
            ("H2D copies from pinned memory", copies(self.h2d_pinned)),
            ("D2H copies", copies(self.d2h)),
            ("synchronisations, by cause", per_cause(self.syncs)),
            ("host waiting in them", f"{self.host_wait_ms:.3g} ms"),
            ("host taking and freeing batches", f"{self.data_wait_ms:.3g} ms")]

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        lines = [f"per step, over {self.steps} profiled steps"]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        lines += [f"  ! {note}" for note in self.unsteady()]
        if self.paced_copies:  # the profiler's slowness, not the step's: no finding priced it
            lines += [f"  ! {self.paced_copies} pinned copies ran under {SLOW_COPY_SHARE:.0%} of "
                      f"the link's {self.link_gbps:.3g} GB/s while profiled: the replay ran "
                      f"them at that rate"]
        lines += ["findings, costliest first:"]
        lines += [f"  - {f}" for f in self.findings] or ["  none"]
        if self.latent:
            lines += ["latent (free now, not once the host keeps ahead):"]
            lines += [f"  - {f}" for f in self.latent]
        return "\n".join(lines)

    def summary(self) -> str:
        """A few lines for a newcomer: the step as timed, the costliest finding (what waits,
        the step time its fix would save, what to change), the others by name. The savings are
        the replay's estimates, and say so; ``str(report)`` is the full report (notebook 09)."""
        if self.step_ms is not None:
            lines = [f"step: {self.step_ms:.3g} ms, timed; GPU busy {self.gpu_busy:.0%} of it "
                     f"(device work, profiled)"]
        else:
            lines = [f"step: {self.profiled_step_ms:.3g} ms, profiled"]
        step_ms = self.reference_ms
        if not self.findings:
            floor = max(MIN_SAVING_SHARE * step_ms, MIN_SAVING_MS)
            lines.append(f"nothing to change: no wait the check-up saw would save {floor:.2g} ms "
                         f"a step or more (estimated)")
        else:
            top = self.findings[0]
            lines += [f"what waits: {self._waits_on(top)}",
                      f"what it costs: about {top.cost_ms:.3g} ms a step "
                      f"({top.cost_ms / step_ms:.0%} of the step), estimated by replaying the "
                      f"profiled steps without it",
                      f"what to change: {top.advice} {_notebooks(top.notebooks)}"]
            if len(self.findings) > 1:
                lines.append("also found: " + ", ".join(
                    f"{f.kind} (about {f.cost_ms:.2g} ms)" for f in self.findings[1:])
                    + ", estimated")
        if self.unsteady() or self.paced_copies:
            lines.append("the full report (print(report)) notes why these estimates may be off")
        return "\n".join(lines)

    def _waits_on(self, finding: Finding) -> str:
        """Who waits, and for what, for the summary's costliest finding."""
        if finding.kind == Kind.HOST_WAITS:
            waits = self.waits_together
            listed = ", ".join(waits[:-1]) + f" and {waits[-1]}" if len(waits) > 1 else waits[0]
            return f"{WAITS_ON[Kind.HOST_WAITS]} {listed} (priced together)"
        return f"{WAITS_ON[finding.kind]} ({finding.kind})"

    def step_window(self, first: int, count: int = 1) -> list[Activity]:
        """Profiled steps ``first`` to ``first + count - 1`` as the GPU ran them: the device
        work from the start of the first one's mark on the GPU to the start of the next, and
        on the host lane what the host ran meanwhile (often later steps: it runs ahead),
        clipped to that window; times from the window's start (in microseconds, as every
        ``Activity``), ready for ``helpers.plot_timeline`` (notebook 09)."""
        spans = self.gpu_steps or self.host_steps
        begin = spans[first][0]
        end = spans[first + count][0] if first + count < len(spans) else spans[-1][1]
        return [replace(a, start_us=(max(a.start_us / 1e3, begin) - begin) * 1e3,
                        end_us=(min(a.end_us / 1e3, end) - begin) * 1e3)
                for a in self.activities
                if (begin <= a.start_us / 1e3 < end if a.kind != "host"
                    else a.start_us / 1e3 < end and a.end_us / 1e3 > begin)]

    def side_copy_window(self, count: int = 2, default: int = 4) -> int:
        """The first profiled step from which ``count`` steps, as ``step_window`` cuts them, hold
        a copy off the compute stream; ``default`` where none does. A prefetcher's host runs
        ahead of the GPU and queues its copies as it goes, so they run under earlier steps than
        the ones they feed, and a window taken anywhere can hold none (notebook 09)."""
        spans = self.gpu_steps or self.host_steps
        for first in range(max(len(spans) - count + 1, 0)):
            window = self.step_window(first, count)
            names = lane_names(window)
            if any(a.kind in COPY_KINDS and names[a.stream] != "compute" for a in window):
                return first
        return default


# The analysis, in four stages (``analyze_checkup_trace`` runs them in order, one section
# each below): the trace -> the profiled steps and what made the host wait (_read_profile,
# _blocking_causes) -> the steps' dependency graph (_step_graph) -> a replay of the graph, as
# it ran and with each cause removed (_replay, _calibrate, _fixes, _priced) -> findings,
# costliest first (_findings, _waits_finding, _latent).
#
# The cost of a cause is the step time the replay saves without it, as Daydream does (Zhu et
# al., "Daydream: Accurately Estimating the Efficacy of Optimizations for DNN Training", USENIX
# ATC 2020): build a dependency graph of host and device work from a CUPTI trace, change the
# graph as the optimisation would, and simulate it. Unlike Daydream, the graph here has one
# host lane (the step's threads in time order), no mapping of work to layers and no
# framework-level transformations (fusing, reordering, distributed training): a fix only
# changes durations (a host call, a copy) and drops waits. Also unlike it, the host's time on
# batches (next(), and freeing each batch after its step) is scaled to its unprofiled time, and
# the rest of the host's time so that the replay runs at the unprofiled pace, since the profiler
# slows the host only. Like it, each kernel keeps its duration: a fix that keeps the GPU busy
# back to back can slow its kernels (tests/test_checkup.py's fp16 GradScaler ablation measures
# how much), and saves less than predicted.


# The profiled steps, as the trace gives them

@dataclass
class _Profile:
    """The profiled steps as the trace gives them; times in milliseconds (the trace's
    microseconds, converted by ``_read_profile``)."""

    steps: int
    host_steps: list[tuple[float, float]]
    gpu_steps: list[tuple[float, float]]  # empty if some step had no device work
    calls: list[dict]  # CUDA calls of the threads that launched the steps' work, by time
    launch_of: dict  # correlation -> the CUDA call that issued it (any thread, any time)
    device: list[dict]  # kernels, copies and memsets, by start
    direction: dict  # a copy's correlation -> ("h2d_pageable" | "h2d_pinned" | "d2h", pageable)
    data_waits: list[tuple[float, float]]  # in next(batches) or the release, step's thread
    context: list[dict]  # cpu ops and Python frames: the stacks of the calls
    host_busy: list[tuple[float, float]]  # when the step's threads ran an op or a Python frame

    @property
    def host_range(self) -> tuple[float, float]:
        """From the first step's start on the host to the last one's end."""
        return self.host_steps[0][0], self.host_steps[-1][1]


def _in_ms(event: dict) -> dict:
    """A trace's event with its time and duration in milliseconds (the trace's are in us)."""
    return dict(event, ts=event["ts"] / 1e3, dur=event["dur"] / 1e3)


def _read_profile(trace: dict | list, steps: int) -> _Profile:
    """The ``steps`` profiled steps of a trace, found by their ``STEP_MARK`` spans: the CUDA
    calls of the threads that launched their work, the device work, each copy's direction, the
    host's time in next(batches) and the release, and the stacks around the calls."""
    events = [_in_ms(e) for e in _trace_events(trace) if e.get("ph") == "X"]

    def marks(category):
        return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                      if e.get("cat") == category and e["name"] == STEP_MARK)

    host_steps, gpu_steps = marks("user_annotation"), marks("gpu_user_annotation")
    if len(host_steps) != steps:
        raise ValueError(f"expected {steps} '{STEP_MARK}' spans, found {len(host_steps)}")
    if len(gpu_steps) != steps:
        gpu_steps = []  # a step without device work has no mark on the GPU: use the host's
    main = next((e["pid"], e["tid"]) for e in events
                if e.get("cat") == "user_annotation" and e["name"] == STEP_MARK)
    begin, end = host_steps[0][0], host_steps[-1][1]
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    # the threads that launched the steps' work (autograd's too); not a pin-memory thread
    threads = {(c["pid"], c["tid"]) for c in calls
               if c["name"] in LAUNCH_CALLS | GRAPH_LAUNCH_CALLS and begin <= c["ts"] <= end}
    threads.add(main)
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    context = _same_thread_ids([e for e in events if e.get("cat") in ("cpu_op", "python_function")],
                               calls)
    direction = {}
    for e in device:
        kind = _activity_kind(e["cat"], e["name"])
        if kind in ("H2D", "D2H"):
            pageable = "Pageable" in e["name"]
            key = "d2h" if kind == "D2H" else ("h2d_pageable" if pageable else "h2d_pinned")
            direction[e.get("args", {}).get("correlation")] = (key, pageable)
    return _Profile(
        steps, host_steps, gpu_steps,
        calls=sorted((c for c in calls if (c["pid"], c["tid"]) in threads
                      and begin <= c["ts"] <= end), key=lambda c: c["ts"]),
        launch_of={c["args"]["correlation"]: c for c in calls
                   if c.get("args", {}).get("correlation") is not None},
        device=device, direction=direction,
        data_waits=[(e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "user_annotation"
                    and e["name"] in (NEXT_MARK, RELEASE_MARK) and (e["pid"], e["tid"]) == main],
        context=context,
        host_busy=_union((e["ts"], e["ts"] + e["dur"]) for e in context
                         if (e["pid"], e["tid"]) in threads))


def _same_thread_ids(context: list[dict], calls: list[dict]) -> list[dict]:
    """``context`` (ops, Python frames) with each thread named as its CUDA calls name it. On a
    thread other than the one that started the profiler (autograd's, say) Kineto can give the
    ops one id and the CUDA calls another: a thread with calls and no ops takes the id of the
    thread with ops and no calls whose ops hold the most of its calls."""
    def threads(events):
        return {(e["pid"], e["tid"]) for e in events}

    bare_calls = threads(calls) - threads(context)
    bare_ops = threads(context) - threads(calls)
    if not bare_calls or not bare_ops:
        return context
    spans = {t: _union((e["ts"], e["ts"] + e["dur"]) for e in context
                       if (e["pid"], e["tid"]) == t and e.get("cat") == "cpu_op")
             for t in bare_ops}
    starts = {t: [a for a, _ in spans[t]] for t in bare_ops}

    def holds(t, call):
        i = bisect.bisect_right(starts[t], call["ts"]) - 1
        return i >= 0 and spans[t][i][1] >= call["ts"] + call["dur"]

    alias = {}
    for thread in bare_calls:
        mine = [c for c in calls if (c["pid"], c["tid"]) == thread][:200]
        held = {t: sum(holds(t, c) for c in mine) for t in bare_ops - set(alias)}
        best = max(held, key=held.get, default=None)
        if best is not None and held[best] > 0:
            alias[best] = thread
    return [dict(e, pid=alias[(e["pid"], e["tid"])][0], tid=alias[(e["pid"], e["tid"])][1])
            if (e["pid"], e["tid"]) in alias else e for e in context]


# Which call of the reader's code made the host wait: from the stack of the blocking call

#: frames of a comprehension: the call is named after the function around it
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


#: files whose frames are the kit's, not the reader's: this module, helpers.py (named through a
#: function of it: tools/nbtool.py reads a quoted module name as a use of all of that module)
#: and torch's profiler
KIT_FILES = frozenset({Path(__file__).stem, Path(format_bytes.__code__.co_filename).stem,
                       "profiler"})


def _is_library_frame(name: str) -> bool:
    """Whether a Python frame of the trace is torch's, the kit's or the standard library's: the
    reader's code is the innermost frame that is not."""
    if name.startswith(("<built-in", "<frozen ")):
        return True
    path = name.split("(")[0]
    stem = Path(path).stem
    return (path.startswith("torch/") or "/torch/" in path or "site-packages" in path
            or "dist-packages" in path or stem in KIT_FILES or _is_stdlib_path(path))


#: the standard library's directories on this host
_STDLIB_DIRS = tuple(sorted({os.path.abspath(sysconfig.get_paths()[key])
                             for key in ("stdlib", "platstdlib")}))


@functools.lru_cache(maxsize=4096)
def _is_stdlib_path(path: str) -> bool:
    """Whether a frame's file is the standard library's. torch's tracer cuts every ``sys.path``
    prefix from a frame's file, so a reader's ``code.py`` beside the notebook and the standard
    ``code.py`` both read "code.py": a name counts as the standard library's where a standard
    directory holds it and no other ``sys.path`` entry does (a reader's file of that name
    shadows the standard module on import, so only it can run)."""
    if os.path.isabs(path):
        return path.startswith(tuple(d + os.sep for d in _STDLIB_DIRS))
    def holds(directory):
        return os.path.isfile(os.path.join(directory or os.curdir, path))
    others = [d for d in sys.path if os.path.abspath(d or os.curdir) not in _STDLIB_DIRS]
    return any(holds(d) for d in _STDLIB_DIRS) and not any(holds(d) for d in others)


def _callee_label(frame: str) -> str:
    """What the reader's code called, as the finding names it (".item()", "torch.nonzero()",
    "grad_scaler.step()"), from the frame just inside the reader's."""
    if frame.startswith("<built-in method "):
        method, _, owner = frame[len("<built-in method "):].partition(" of ")
        return f".{method}()" if owner.startswith("Tensor") else f"torch.{method}()"
    if frame.startswith("<built-in function "):
        return frame[len("<built-in function "):].rstrip(">") + "()"
    path, _, function = frame.partition(": ")
    return f"{Path(path.split('(')[0]).stem}.{function}()"


@dataclass(frozen=True)
class _Blocking:
    kind: Kind
    label: str  # what the reader's code called
    where: str  # where: the reader's function, or autograd's backward node


def _classify(stack: list[dict], copy_direction: str | None) -> _Blocking:
    """``stack``: the python frames and cpu ops enclosing a blocking call, outermost first;
    ``copy_direction``: the copy it issued ("h2d_pageable", "h2d_pinned", "d2h"), if any."""
    frames = [e["name"] for e in stack if e.get("cat") == "python_function"]
    ops = [e["name"] for e in stack if e.get("cat") == "cpu_op"]
    aten = [op for op in ops if op.startswith("aten::")]
    user = max((i for i, f in enumerate(frames) if not _is_library_frame(f)), default=None)
    below = [f for f in (frames[user + 1:] if user is not None else frames)
             if not f.startswith("<frozen ")]  # the import machinery calls nothing of ours
    callee = _callee_label(below[0]) if below else None
    if user is not None:
        named = [f.partition(": ")[2] for f in frames[:user + 1] if not _is_library_frame(f)]
        where = "in " + next((f for f in reversed(named) if f not in COMPREHENSIONS), named[-1])
    else:
        node = next((op for op in ops if not op.startswith(("aten::", "autograd::"))), None)
        where = f"in backward ({node}, autograd's thread)" if node else "in the step"
    library = " ".join(below)
    if "grad_scaler.py" in library:
        return _Blocking(Kind.GRAD_SCALER, "GradScaler.step()", where)
    if "clip_grad.py" in library:
        return _Blocking(Kind.NONFINITE_CHECK, "clip_grad_norm_(error_if_nonfinite=True)", where)
    outer = aten[0] if aten else None
    if outer is None:
        return _Blocking(Kind.EXPLICIT_SYNC, callee or "a synchronize()", where)
    if outer in ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"):
        label = callee if callee and frames else {"aten::is_nonzero": "bool(tensor)"}.get(
            outer, ".item()")
        return _Blocking(Kind.SCALAR_READ, label, where)
    if outer in ("aten::to", "aten::_to_copy", "aten::copy_", "aten::cpu", "aten::contiguous",
                 "aten::clone"):
        if callee in ("torch.tensor()", "torch.as_tensor()", "torch.asarray()"):
            return _Blocking(Kind.CONSTANT_H2D, callee, where)
        kind = {"h2d_pageable": Kind.PAGEABLE_H2D, "h2d_pinned": Kind.BLOCKING_H2D}.get(
            copy_direction, Kind.BLOCKING_D2H)
        return _Blocking(kind, callee or outer, where)
    name = outer[len("aten::"):].lstrip("_").rstrip("0123456789")
    return _Blocking(Kind.HIDDEN_SYNC, f"torch.{name}() ({outer})", where)


def _enclosing(context: list[dict], calls: list[dict]) -> dict[int, list[dict]]:
    """For each call (by index), the events of ``context`` on its thread that contain it,
    outermost first."""
    result: dict[int, list[dict]] = {}
    by_thread: dict[tuple, list] = collections.defaultdict(list)
    for event in context:
        by_thread[(event["pid"], event["tid"])].append((event["ts"], 0, -event["dur"], event))
    for index, call in enumerate(calls):
        by_thread[(call["pid"], call["tid"])].append((call["ts"], 1, -call["dur"], index))
    for items in by_thread.values():
        stack: list[dict] = []
        for ts, is_call, _, item in sorted(items, key=lambda x: x[:3]):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            if is_call:
                end = ts + calls[item]["dur"]
                result[item] = [e for e in stack if e["ts"] + e["dur"] >= end]
            else:
                stack.append(item)
    return result


def _blocks(call: dict, direction: dict) -> bool:
    """A synchronisation, or a copy that returns only when done (an async one from or to
    pageable memory is staged by the host, and blocks too)."""
    if call["name"] in SYNC_CALLS:
        return True
    if call["name"] not in MEMCPY_CALLS:
        return False
    _, pageable = direction.get(call.get("args", {}).get("correlation"), (None, False))
    return pageable or "Async" not in call["name"]


#: a blocking copy with no op around it (no stack to read): its kind from its direction
_COPY_KIND = {"h2d_pageable": Kind.PAGEABLE_H2D, "h2d_pinned": Kind.BLOCKING_H2D,
              "d2h": Kind.BLOCKING_D2H}


def _blocking_causes(profile: _Profile) -> tuple[dict[int, _Blocking], dict]:
    """Which call of the reader's code each blocking call stands for (by ``id`` of the call),
    and the cause each copy belongs to (by correlation): a synchronisation inside a ``.to()``
    waits for that op's copy, and fixing the one fixes the other."""
    blocking = [c for c in profile.calls if _blocks(c, profile.direction)]
    issued = [c for c in profile.calls if c["name"] in MEMCPY_CALLS
              and c.get("args", {}).get("correlation") in profile.direction]
    stacks = _enclosing(profile.context, blocking + issued)
    direction_of_op = {id(stacks[len(blocking) + i][-1]):
                       profile.direction[c["args"]["correlation"]][0]
                       for i, c in enumerate(issued) if stacks.get(len(blocking) + i)}
    cause_of_call: dict[int, _Blocking] = {}
    cause_of_op: dict[int, _Blocking] = {}
    for index, call in enumerate(blocking):
        stack = stacks.get(index, [])
        direction = profile.direction.get(call.get("args", {}).get("correlation"), (None,))[0]
        if direction is None and stack:
            direction = direction_of_op.get(id(stack[-1]))
        cause = _classify(stack, direction)
        if call["name"] in MEMCPY_CALLS and cause.kind == Kind.EXPLICIT_SYNC:
            cause = _Blocking(_COPY_KIND.get(direction, Kind.BLOCKING_D2H), "a copy", cause.where)
        cause_of_call[id(call)] = cause
        if stack:
            cause_of_op[id(stack[-1])] = cause
    cause_of_copy = {}
    for i, call in enumerate(issued):
        stack = stacks.get(len(blocking) + i)
        cause = cause_of_call.get(id(call)) or (cause_of_op.get(id(stack[-1])) if stack else None)
        if cause is not None:
            cause_of_copy[call["args"]["correlation"]] = cause
    return cause_of_call, cause_of_copy


# The step's dependency graph: one host lane of ops, each device op with what it waits for

@dataclass
class _HostOp:
    """A span of the host lane: time between CUDA calls ("work"; "data" inside next(batches);
    "idle" where the trace saw nothing run), a CUDA call ("call"; "launch" for one the trace
    lacks), or a step's start ("mark")."""

    start_ms: float  # as profiled
    own_ms: float  # its own time; for a call that waits, the time it would take if it did not
    kind: str
    name: str = ""
    blocks: bool = False
    waits_for: int = -1  # the device op whose end it waits for
    after_ms: float = 0.0  # from that end to its return (< 0: a pageable copy returns early)
    cause: _Blocking | None = None
    step: int = -1


@dataclass
class _DeviceOp:
    start_ms: float  # as profiled
    dur_ms: float
    stream: int
    kind: str  # an Activity kind: "kernel", "H2D", "D2H", "D2D", "memset"
    nbytes: int = 0
    pageable: bool = False
    step: int = -1  # the profiled step whose GPU mark holds it
    correlation: object = None
    launch: int = -1  # the host op that launched it (-1: none on the lane)
    launch_gap_ms: float = 0.0  # from that launch's return (a blocking copy: its call) to start
    blocking_launch: bool = False  # its launch waits for it (a copy that blocks)
    follows: list[tuple[int, float]] = field(default_factory=list)  # (device op, gap after it)
    not_before_ms: float = float("-inf")  # launched before the steps: starts no earlier
    position: int = -1  # host op after which the replay can place it (-1: at the start)
    cause: _Blocking | None = None


@dataclass
class _StepGraph:
    host: list[_HostOp]
    device: list[_DeviceOp]
    origin_ms: float  # the first step's start on the host
    steps: int
    marks: list[int]  # the host op of each step's start
    order: list[int]  # device ops in the order the replay places them

    def placed_after(self) -> dict[int, list[int]]:
        placed: dict[int, list[int]] = collections.defaultdict(list)
        for d in self.order:
            placed[self.device[d].position].append(d)
        return placed


def _device_work(profile: _Profile) -> tuple[list[_DeviceOp], list[int]]:
    """The device ops of the profiled steps (with those still running when the first began),
    by start, each with the op before it on its stream (-1: none); the profile's events lack
    stream order only where a hand-made trace has no launches (``launch_of``)."""
    begin, end = profile.host_range
    ops, before = [], []
    last_on: dict[int, int] = {}
    for e in profile.device:
        args = e.get("args", {})
        call = profile.launch_of.get(args.get("correlation"))
        stream = int(args.get("stream", e.get("tid", -1)))
        step = _step_of(profile, e["ts"], None if call is None else call["ts"])
        if step < 0 and call is None and stream in last_on:
            step = ops[last_on[stream]].step  # queued behind the op before it: its step's
        launched_in = call is not None and begin <= call["ts"] <= end
        if e["ts"] + e["dur"] <= begin or (step < 0 and not launched_in and e["ts"] > end):
            continue  # over before the steps, or after them and none of theirs
        if call is not None and call["ts"] > end and step < 0:
            continue
        kind = _activity_kind(e["cat"], e["name"])
        ops.append(_DeviceOp(e["ts"], e["dur"], stream, kind, args.get("bytes") or 0,
                             "Pageable" in e["name"], step, args.get("correlation")))
        before.append(last_on.get(stream, -1))
        last_on[stream] = len(ops) - 1
    return ops, before


def _step_of(profile: _Profile, start_ms: float, launched_ms: float | None) -> int:
    """The profiled step a device op belongs to: the GPU mark that holds its start, else the
    step whose host span holds its launch (a GPU mark holds only what the step's own thread
    launched under no inner annotation: autograd's thread and the optimizer's kernels fall
    outside it); -1 for neither."""
    for spans, at in ((profile.gpu_steps, start_ms), (profile.host_steps, launched_ms)):
        if at is not None:
            k = bisect.bisect_right([s for s, _ in spans], at) - 1
            if k >= 0 and at <= spans[k][1]:
                return k
    return -1


def _unlaunched(profile: _Profile, ops: list[_DeviceOp], before: list[int]) -> dict[int, float]:
    """Device ops with no launch in the trace that the host must have launched where they began
    (the GPU sat idle before them): op -> where the host lane places that launch. Those that
    began right behind the op before them on their stream were queued: their stream starts
    them. A launch that falls inside a CUDA call is put before the call."""
    begin, _ = profile.host_range
    starts = [c["ts"] for c in profile.calls]
    placed = {}
    for d, op in enumerate(ops):
        if op.correlation in profile.launch_of or op.start_ms < begin:
            continue
        p = before[d]
        if p >= 0 and op.start_ms - (ops[p].start_ms + ops[p].dur_ms) <= BACK_TO_BACK_MS + SAME_MS:
            continue
        at = op.start_ms
        j = bisect.bisect_right(starts, at) - 1
        if j >= 0 and profile.calls[j]["ts"] + profile.calls[j]["dur"] > at:
            at = profile.calls[j]["ts"]
        placed[d] = at
    return placed


def _subtract(intervals: list[tuple[float, float]], cut: list[tuple[float, float]]):
    """``intervals`` minus the union ``cut`` (both sorted, disjoint)."""
    out = []
    for a, b in intervals:
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def _add_work(lane: list[_HostOp], a: float, b: float, data: list[tuple[float, float]],
              busy: list[tuple[float, float]]) -> None:
    """The host's time from ``a`` to ``b``, between CUDA calls: a wait for data inside
    next(batches); else work where the trace saw the thread run an op or a Python frame;
    else idle (a hand-made trace's empty time, which no fix of the host's shortens)."""
    if b <= a:
        return
    waiting = _intersection([(a, b)], data)
    working = _intersection(_subtract([(a, b)], data), busy)
    for kind, ms in (("data", waiting), ("work", working), ("idle", b - a - waiting - working)):
        if ms > 1e-12:
            lane.append(_HostOp(a, ms, kind))
            a += ms


def _host_lane(profile: _Profile, cause_of_call: dict, launches: dict[int, float]):
    """The host's steps as one lane: each CUDA call of the step's threads, the work between
    them, a mark where each step begins, and a launch of no time for each op of ``launches``.
    PyTorch's threads of a step take turns (the main thread waits in backward() while autograd's
    launches), so one lane in time order holds them. Returns the lane, and the lane index of
    each call (by ``id``), of each step's mark (by step) and of each added launch (by op)."""
    begin, end = profile.host_range
    items = [(s, 0, "mark", k) for k, (s, _) in enumerate(profile.host_steps)]
    items += [(at, 1, "launch", d) for d, at in launches.items()]
    items += [(c["ts"], 2, "call", c) for c in profile.calls]
    items.sort(key=lambda item: item[:2])
    data = _union(profile.data_waits)
    starts = [s for s, _ in profile.host_steps]
    lane: list[_HostOp] = []
    index: dict = {}
    cursor = begin
    for at, _, kind, item in items:
        _add_work(lane, cursor, at, data, profile.host_busy)
        cursor = max(cursor, at)
        step = max(bisect.bisect_right(starts, cursor) - 1, 0)
        if kind == "call":  # a call that overlaps one before it (two threads) starts after it
            index[id(item)] = len(lane)
            lane.append(_HostOp(cursor, max(item["ts"] + item["dur"] - cursor, 0.0), "call",
                                item["name"], _blocks(item, profile.direction),
                                cause=cause_of_call.get(id(item)), step=step))
            cursor = max(cursor, item["ts"] + item["dur"])
        else:
            index[(kind, item)] = len(lane)
            lane.append(_HostOp(cursor, 0.0, kind, step=step))
    _add_work(lane, cursor, end, data, profile.host_busy)
    return lane, index


def _link_device_work(ops: list[_DeviceOp], before: list[int], lane: list[_HostOp],
                      launch_index: dict[int, int], queued: set[int]) -> None:
    """What each device op waits for: its launch, the op before it on its stream and, if it
    began well after both allowed it, the op of another stream that ended last before it (an
    event wait). The one that held it back longest keeps the gap seen after it, the others
    none, so that a replay of the graph as it is starts it when it started."""
    ends = sorted((op.start_ms + op.dur_ms, d) for d, op in enumerate(ops))
    for d, op in enumerate(ops):
        i = launch_index.get(d, -1)
        held: list[tuple[float, object]] = []  # (when it allowed the op to start, by what)
        if i >= 0:
            op.launch, op.position = i, i
            op.blocking_launch = lane[i].blocks and op.kind in ("H2D", "D2H")
            host = lane[i]
            held.append((host.start_ms + (0.0 if op.blocking_launch else host.own_ms), "launch"))
        elif d in queued:  # no launch in the trace, queued behind the op before it
            op.position = ops[before[d]].position
        else:  # launched before the steps, or by a thread off the lane
            op.not_before_ms = op.start_ms
            continue
        if before[d] >= 0:
            held.append((ops[before[d]].start_ms + ops[before[d]].dur_ms, before[d]))
        allowed = max(t for t, _ in held)
        if op.start_ms - allowed > CROSS_STREAM_MS + SAME_MS:
            j = bisect.bisect_right(ends, (op.start_ms, float("inf"))) - 1
            while j >= 0 and ends[j][0] > allowed:
                x = ops[ends[j][1]]
                if x.stream != op.stream and (x.position, x.start_ms) < (op.position, op.start_ms):
                    held.append(ends[j])
                    break
                j -= 1
        binding = max(held, key=lambda h: h[0])
        for t, by in held:
            gap = op.start_ms - t if (t, by) == binding else 0.0
            if by == "launch":
                op.launch_gap_ms = gap
            else:
                op.follows.append((by, gap))
    _floor_stream_gaps(ops, before)


def _floor_stream_gaps(ops: list[_DeviceOp], before: list[int]) -> None:
    """No stream starts an op the instant the one before it ends: an op its launch held back
    keeps, after the op before it, the gap the stream leaves between ops it runs back to back
    (their median; no more than the gap seen), so that a fix that removes its launch's delay
    does not pack it tighter than the GPU ever runs."""
    gaps: dict[int, list[float]] = collections.defaultdict(list)
    for d, op in enumerate(ops):
        gaps[op.stream] += [gap for p, gap in op.follows
                            if p == before[d] and SAME_MS < gap <= CROSS_STREAM_MS + SAME_MS]
    typical = {stream: statistics.median(g) for stream, g in gaps.items() if g}
    for d, op in enumerate(ops):
        p = before[d]
        if p < 0 or op.stream not in typical:
            continue
        seen = op.start_ms - (ops[p].start_ms + ops[p].dur_ms)
        op.follows = [(q, max(gap, min(typical[op.stream], seen)) if q == p else gap)
                      for q, gap in op.follows]


def _link_waits(lane: list[_HostOp], ops: list[_DeviceOp]) -> None:
    """What each blocking call waits for: a copy that blocks, for its copy; a synchronisation,
    for the device op launched before it that ended last while it waited (none if none did: it
    found the work done). Its own time becomes the time from that end to its return."""
    copy_of = {op.launch: d for d, op in enumerate(ops) if op.blocking_launch}
    ends = sorted((op.start_ms + op.dur_ms, d) for d, op in enumerate(ops))
    for i, host in enumerate(lane):
        if not host.blocks:
            continue
        returned = host.start_ms + host.own_ms
        waited = copy_of.get(i, -1)
        if waited < 0 and host.name in SYNC_CALLS:
            j = bisect.bisect_right(ends, (returned, float("inf"))) - 1
            while j >= 0 and ends[j][0] >= host.start_ms and waited < 0:
                if ops[ends[j][1]].position < i:
                    waited = ends[j][1]
                j -= 1
        if waited < 0:
            continue
        op = ops[waited]
        host.waits_for, host.after_ms = waited, returned - (op.start_ms + op.dur_ms)
        host.own_ms = min(host.own_ms, max(host.after_ms, 0.0))


def _step_graph(profile: _Profile, cause_of_call: dict, cause_of_copy: dict) -> _StepGraph:
    """The steps' dependency graph: the device work, the host lane that launched it (with a
    launch added where the trace has none), what each device op and each blocking call waits
    for, and the cause each copy belongs to."""
    ops, before = _device_work(profile)
    graph_origin = profile.host_range[0]
    launches = _unlaunched(profile, ops, before)
    lane, index = _host_lane(profile, cause_of_call, launches)
    launch_index = {}
    for d, op in enumerate(ops):
        call = profile.launch_of.get(op.correlation)
        at = index.get(id(call)) if call is not None else index.get(("launch", d))
        if at is not None:
            launch_index[d] = at
    queued = {d for d, op in enumerate(ops) if d not in launches and before[d] >= 0
              and op.correlation not in profile.launch_of and op.start_ms >= graph_origin}
    _link_device_work(ops, before, lane, launch_index, queued)
    for op in ops:
        if op.kind in ("H2D", "D2H"):
            launched = lane[op.launch].cause if op.launch >= 0 else None
            op.cause = cause_of_copy.get(op.correlation) or launched
    _link_waits(lane, ops)
    order = sorted(range(len(ops)), key=lambda d: (ops[d].position, ops[d].start_ms))
    marks = [index[("mark", k)] for k in range(profile.steps)]
    return _StepGraph(lane, ops, graph_origin, profile.steps, marks, order)


# The replay: a small discrete-event model of the graph

@dataclass
class _Change:
    """A fix, as the graph sees it."""

    host_ms: dict[int, float] = field(default_factory=dict)  # host op -> its own time
    device_ms: dict[int, float] = field(default_factory=dict)  # device op -> its duration
    no_wait: set[int] = field(default_factory=set)  # host ops that no longer wait
    host_scale: float = 1.0  # of every host op's own time but the waits for data

    def __or__(self, other: _Change) -> _Change:
        return _Change({**self.host_ms, **other.host_ms}, {**self.device_ms, **other.device_ms},
                       self.no_wait | other.no_wait, self.host_scale * other.host_scale)


def _replay(graph: _StepGraph, change: _Change | None = None):
    """Host and device start times with ``change`` made. The host lane runs its ops one after
    the other: each takes its own time, or, if it waits, lasts until the device op it waits for
    has ended (and its return after that). A device op starts once its launch has returned
    (plus the gap seen after it, never before the launch began) and the ops it follows have
    ended (plus theirs). Not modelled: contention (two streams' kernels, or copies in one
    direction, share the GPU as if they did not), the host's own threads beyond one lane, and
    any change in a kernel's duration. Returns (host starts, device starts, device ends)."""
    change = change or _Change()
    host, device = graph.host, graph.device
    own = [change.host_ms.get(i, op.own_ms)
           * (1.0 if op.kind in ("data", "idle") else change.host_scale)
           for i, op in enumerate(host)]
    duration = [change.device_ms.get(d, op.dur_ms) for d, op in enumerate(device)]
    host_start, dev_start, dev_end = [0.0] * len(host), [0.0] * len(device), [0.0] * len(device)

    def place(d):
        op = device[d]
        ready = op.not_before_ms
        if op.launch >= 0:
            began = host_start[op.launch]
            returned = began + (0.0 if op.blocking_launch else own[op.launch])
            ready = max(ready, began, returned + op.launch_gap_ms)
        for p, gap in op.follows:
            ready = max(ready, dev_end[p] + gap)
        dev_start[d], dev_end[d] = ready, ready + duration[d]

    placed = graph.placed_after()
    for d in placed.get(-1, ()):
        place(d)
    t = graph.origin_ms
    for i, op in enumerate(host):
        host_start[i] = t
        for d in placed.get(i, ()):
            place(d)
        end = t + own[i]
        if op.waits_for >= 0 and i not in change.no_wait:
            end = max(end, dev_end[op.waits_for] + op.after_ms)
        t = end
    return host_start, dev_start, dev_end


def _period_ms(graph: _StepGraph, host_start, dev_start, dev_end) -> float:
    """A step's period: from the end of the first step's device work to the end of the last
    one's, over the steps between (ends, not starts: a fix may move a step's first op, on a
    side stream, ahead of the rest); on the host's marks if some step has no device work; one
    step alone, from its first device op's start to its last one's end."""
    lasts = [float("-inf")] * graph.steps
    first = float("inf")
    for d, op in enumerate(graph.device):
        if op.step >= 0:
            lasts[op.step] = max(lasts[op.step], dev_end[d])
            first = min(first, dev_start[d]) if op.step == 0 else first
    if float("-inf") in lasts:
        marks = [host_start[m] for m in graph.marks] + [host_start[-1]]
        if graph.steps == 1:
            return marks[-1] - marks[0]
        return (marks[-2] - marks[0]) / (graph.steps - 1)
    if graph.steps > 1:
        return (lasts[-1] - lasts[0]) / (graph.steps - 1)
    return lasts[0] - first


def _profiled_period(graph: _StepGraph) -> float:
    """``_period_ms`` of the steps as they ran."""
    return _period_ms(graph, [op.start_ms for op in graph.host],
                      [op.start_ms for op in graph.device],
                      [op.start_ms + op.dur_ms for op in graph.device])


def _replay_period(graph: _StepGraph, change: _Change | None = None) -> float:
    """``_period_ms`` of the replay with ``change`` made."""
    return _period_ms(graph, *_replay(graph, change))


def _scale_data_waits(graph: _StepGraph, factor: float) -> None:
    """The host's time in next(batches) times ``factor``: the unprofiled over the profiled."""
    for op in graph.host:
        if op.kind == "data":
            op.own_ms *= factor


def _calibrate(graph: _StepGraph, step_ms: float | None) -> float:
    """The scale of host time at which the replay runs at ``step_ms`` a step (the unprofiled
    pace): the profiler slows the host (its bookkeeping, Python stacks) but not the GPU. 1 when
    the unprofiled step is no faster than the profiled one (the replay cannot explain more), or
    not measured."""
    if step_ms is None or _replay_period(graph) <= step_ms + SAME_MS:
        return 1.0
    if _replay_period(graph, _Change(host_scale=0.0)) >= step_ms - SAME_MS:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(24):  # the period grows with the host's time: halve the interval
        middle = (low + high) / 2
        if _replay_period(graph, _Change(host_scale=middle)) > step_ms:
            high = middle
        else:
            low = middle
    return (low + high) / 2


# Each cause's fix, and what the replay says it saves

def _cause_key(cause: _Blocking) -> tuple[Kind, str, str]:
    """A cause's key in the fixes and savings: one per call site, so that two .item() calls in
    two functions are priced apart."""
    return cause.kind, cause.label, cause.where


def _launch_ms(graph: _StepGraph) -> float:
    """What a launch costs the host in this trace: its median launch call."""
    times = [op.own_ms for op in graph.host if op.name in LAUNCH_CALLS]
    return statistics.median(times) if times else LAUNCH_MS


def _pace_slow_copies(graph: _StepGraph, link_gbps: float) -> int:
    """Pinned host-to-device copies of at least PACED_COPY_BYTES that ran under
    SLOW_COPY_SHARE of ``link_gbps`` (measured apart, unprofiled) with no other such copy beside
    them take the time the link's rate gives: the profiler can slow a copy, and the replay
    would price the slowness as the copy's. Returns how many were paced."""
    copies = sorted((op for op in graph.device if op.kind == "H2D" and not op.pageable),
                    key=lambda op: op.start_ms)
    paced = 0
    for i, op in enumerate(copies):
        alone = all(other.start_ms >= op.start_ms + op.dur_ms
                    or other.start_ms + other.dur_ms <= op.start_ms
                    for other in copies[max(i - 1, 0):i] + copies[i + 1:i + 2])
        link_ms = op.nbytes / (link_gbps * 1e6)  # GB/s: 1e6 bytes a ms
        if alone and op.nbytes >= PACED_COPY_BYTES and link_ms < SLOW_COPY_SHARE * op.dur_ms:
            op.dur_ms = link_ms
            paced += 1
    return paced


def _link_rate(graph: _StepGraph, link_gbps: float) -> float:
    """Bytes per millisecond of a pinned host-to-device copy: measured on those in the trace
    (none: ``link_gbps``)."""
    pinned = [op for op in graph.device
              if op.kind == "H2D" and not op.pageable and op.nbytes and op.dur_ms > 0]
    if pinned:
        return sum(op.nbytes for op in pinned) / sum(op.dur_ms for op in pinned)
    return link_gbps * 1e6


def _fixes(graph: _StepGraph, launch_ms: float, bytes_per_ms: float) -> dict[tuple, _Change]:
    """Each cause's fix as a change of the graph, by (kind, label, where):
    a synchronisation no longer waits and takes no time (the call is gone); a copy that blocks
    is launched instead (a launch's host time, no wait) and, from pageable memory, runs at the
    pinned rate; a constant copied in the step (torch.tensor) is made once: no copy at all;
    ``copy_exposed``: pinned copies that did not block take no device time in the step (a
    prefetch runs them on a side stream under the step before); ``data_wait``: the batch is
    there, no wait in next(batches); ``host_bound``: every host op's own time (the waits for
    data aside) scaled to 0. Scaling all of it, not just the launch calls, since the host's cost
    of a kernel is mostly Python and the dispatcher around its launch, which a CUDA graph or
    torch.compile removes with it: how fast the step would be if the GPU never waited for
    Python."""
    fixes: dict[tuple, _Change] = collections.defaultdict(_Change)
    for i, op in enumerate(graph.host):
        if op.cause is not None and op.blocks:
            fix = fixes[_cause_key(op.cause)]
            fix.no_wait.add(i)
            launched = op.name in MEMCPY_CALLS and op.cause.kind != Kind.CONSTANT_H2D
            fix.host_ms[i] = launch_ms if launched else 0.0
    for d, op in enumerate(graph.device):
        if op.cause is None or op.kind != "H2D":
            continue
        if op.cause.kind == Kind.CONSTANT_H2D:
            fixes[_cause_key(op.cause)].device_ms[d] = 0.0
        elif op.cause.kind == Kind.PAGEABLE_H2D and op.pageable and op.nbytes:
            fixes[_cause_key(op.cause)].device_ms[d] = op.nbytes / bytes_per_ms
    fixes[(Kind.COPY_EXPOSED, "", "")] = _Change(device_ms={
        d: 0.0 for d, op in enumerate(graph.device)
        if op.kind == "H2D" and not op.pageable and not op.blocking_launch})
    fixes[(Kind.DATA_WAIT, "", "")] = _Change(host_ms={
        i: 0.0 for i, op in enumerate(graph.host) if op.kind == "data"})
    fixes[(Kind.HOST_BOUND, "", "")] = _Change(host_scale=0.0)
    return dict(fixes)


def _saving_without(graph: _StepGraph, fixes: dict[tuple, _Change], scale: float,
                    kinds: Iterable[str]) -> float:
    """The step time (ms) the replay saves with every cause of ``kinds`` removed at once, host
    time at ``scale``."""
    kinds = set(kinds)
    paced = change = _Change(host_scale=scale)
    for key, fix in fixes.items():
        if key[0] in kinds:
            change = fix | change
    return max(_replay_period(graph, paced) - _replay_period(graph, change), 0.0)


def _savings(graph: _StepGraph, fixes: dict[tuple, _Change], scale: float) -> dict[tuple, float]:
    """Per cause, the step time (ms) the replay saves without it, host time at ``scale``."""
    paced = _Change(host_scale=scale)
    base = _replay_period(graph, paced)
    return {key: base - _replay_period(graph, fix | paced) for key, fix in fixes.items()}


def _launch_evidence(graph: _StepGraph) -> tuple[float | None, float, float, float]:
    """The signs Holistic Trace Analysis reads for a step bound by its launches ("CUDA kernel
    launch statistics", "queue length"): the share of kernels shorter than their launch call,
    the mean number of kernels launched and not yet begun; and, per step as profiled, the host's
    time outside waits and the device's time (kernels and copies, overlaps once). A graph's
    kernels share one launch call, so only kernels launched one by one count for the first two
    (none: the share is None)."""
    kernels = [op for op in graph.device if op.kind == "kernel" and op.launch >= 0
               and graph.host[op.launch].name in LAUNCH_CALLS]
    short = (sum(op.dur_ms < graph.host[op.launch].own_ms for op in kernels) / len(kernels)
             if kernels else None)
    queued = sum(max(op.start_ms - graph.host[op.launch].start_ms
                     - graph.host[op.launch].own_ms, 0.0) for op in kernels)
    ran = [(op.start_ms, op.start_ms + op.dur_ms) for op in graph.device
           if op.step >= 0 or op.not_before_ms == float("-inf")]
    span = max([e for _, e in ran] + [graph.host[-1].start_ms + graph.host[-1].own_ms])
    queue = queued / (span - graph.origin_ms) if span > graph.origin_ms else 0.0
    host_ms = sum(op.own_ms for op in graph.host if op.kind not in ("data", "idle")) / graph.steps
    return short, queue, host_ms, _length(_union(ran)) / graph.steps


def _calls_per_cause(graph: _StepGraph) -> dict[tuple, tuple[float, int]]:
    """Per cause, its blocking calls per step (its synchronisations if it has any) and the
    number of steps it was seen in."""
    syncs, copies = collections.Counter(), collections.Counter()
    steps: dict[tuple, set] = collections.defaultdict(set)
    for op in graph.host:
        if op.cause is not None and op.blocks:
            key = _cause_key(op.cause)
            (syncs if op.name in SYNC_CALLS else copies)[key] += 1
            steps[key].add(op.step)
    return {key: ((syncs[key] or copies[key]) / graph.steps, len(seen))
            for key, seen in steps.items()}


@dataclass(frozen=True)
class _Priced:
    """What the replay says of the graph at the unprofiled pace (host time at ``scale``): each
    cause's fix and saving (by (kind, label, where)), the blocking calls per cause, and the
    report's fields that the replay gives."""

    scale: float
    fixes: dict[tuple, _Change]
    savings: dict[tuple, float]  # ms a step
    per_cause: dict[tuple, tuple[float, int]]
    fields: dict


def _priced(graph: _StepGraph, scale: float, link_gbps: float | None) -> _Priced:
    """Each cause priced by the replay, with host time at ``scale``; with the host's waits of
    two or more kinds (seen in every other step) priced together too."""
    short, queue, host_ms, device_ms = _launch_evidence(graph)
    fixes = _fixes(graph, _launch_ms(graph),
                   _link_rate(graph, link_gbps if link_gbps is not None else LINK_GBPS))
    what_if = functools.partial(_saving_without, graph, fixes, scale)
    no_waits = {key[0] for key, fix in fixes.items() if fix.no_wait}
    by_kind = {kind: what_if({kind}) for kind in {key[0] for key in fixes}}
    per_cause = _calls_per_cause(graph)
    fields = dict(
        replay_step_ms=_replay_period(graph, _Change(host_scale=scale)),
        short_kernels=short, launch_queue=queue, host_busy_ms=host_ms * scale,
        gpu_work_ms=device_ms, what_if=what_if,
        savings_ms={kind: round(ms, 6) for kind, ms in by_kind.items() if ms >= 5e-4},
        host_bound_past_waits_ms=what_if(no_waits | {Kind.HOST_BOUND}) - what_if(no_waits))
    waits = sorted({key[0] for key, fix in fixes.items() if fix.no_wait
                    and per_cause.get(key, (0.0, 0))[1] >= PER_STEP * graph.steps})
    if len(waits) >= 2:
        fields.update(waits_together=tuple(waits), waits_together_ms=round(what_if(waits), 6))
    return _Priced(scale, fixes, _savings(graph, fixes, scale), per_cause, fields)


# Findings: what the trace measured, and what the replay says each cause costs

def _copies_and_busy(profile: _Profile) -> tuple[dict, list[tuple[float, float]]]:
    """Copies (count, bytes) by direction from the steps' start on, and when the device ran
    anything but a host<->device copy (kernels, memsets, device copies)."""
    begin = profile.host_range[0]
    totals = collections.defaultdict(lambda: [0, 0])
    busy = []
    for e in profile.device:
        kind = _activity_kind(e["cat"], e["name"])
        if kind not in ("H2D", "D2H"):
            busy.append((e["ts"], e["ts"] + e["dur"]))
        elif e["ts"] >= begin:
            key = profile.direction[e.get("args", {}).get("correlation")][0]
            totals[key][0] += 1
            totals[key][1] += e.get("args", {}).get("bytes", 0) or 0
    return totals, busy


def _trace_origin(trace: dict | list) -> float:
    """The time ``parse_chrome_trace`` counts from (us, the trace's unit)."""
    return min((float(e["ts"]) for e in _trace_events(trace) if e.get("ph") == "X"
                and _activity_kind(e.get("cat", ""), e.get("name", "")) is not None),
               default=0.0)


def _step_spans(trace: dict | list, category: str) -> list[tuple[float, float]]:
    """The steps' marks of ``category`` in ms from the time ``parse_chrome_trace`` counts from,
    where ``CheckupReport.step_window`` cuts its activities."""
    origin = _trace_origin(trace)
    return sorted(((e["ts"] - origin) / 1e3, (e["ts"] + e["dur"] - origin) / 1e3)
                  for e in _trace_events(trace) if e.get("ph") == "X"
                  and e.get("cat") == category and e["name"] == STEP_MARK)


def _measured(profile: _Profile, cause_of_call: dict, step_ms: float | None,
              trace: dict | list) -> dict:
    """The report's measured fields: copies, synchronisations and waits per step, the profiled
    period, and how busy the GPU kept it (all its work but host<->device copies)."""
    steps = profile.steps
    marks = profile.gpu_steps or profile.host_steps
    periods = max(steps - 1, 1)
    window = (marks[0][0], marks[-1][0] if steps > 1 else marks[0][1])
    totals, busy = _copies_and_busy(profile)
    blocking = [c for c in profile.calls if id(c) in cause_of_call]
    syncs = collections.Counter(cause_of_call[id(c)].kind for c in blocking
                                if c["name"] in SYNC_CALLS)
    period_ms = (window[1] - window[0]) / periods
    reference_ms = step_ms if step_ms is not None else period_ms
    busy_ms = _intersection(_union(busy), [window]) / periods
    return dict(
        steps=steps, step_ms=step_ms, profiled_step_ms=period_ms,
        gpu_busy=min(busy_ms / reference_ms, 1.0) if reference_ms else 0.0,
        h2d_pageable=tuple(v / steps for v in totals["h2d_pageable"]),
        h2d_pinned=tuple(v / steps for v in totals["h2d_pinned"]),
        d2h=tuple(v / steps for v in totals["d2h"]),
        syncs={kind: n / steps for kind, n in syncs.items()},
        host_wait_ms=sum(c["dur"] for c in blocking) / steps,
        data_wait_ms=_length(_union(profile.data_waits)) / steps,
        profiled_periods_ms=[marks[k + 1][0] - marks[k][0] for k in range(steps - 1)],
        activities=[a for a in parse_chrome_trace(trace)
                    if not a.name.startswith("ProfilerStep#")],
        host_steps=_step_spans(trace, "user_annotation"),
        gpu_steps=_step_spans(trace, "gpu_user_annotation") if profile.gpu_steps else [])


def _advice(kind: Kind, report: CheckupReport) -> tuple[str, tuple[str, ...]]:
    """What to change for ``kind``: for ``data_wait``, where the source alone takes less than
    the rest of the step (it keeps up), the wait is not the loader's pace but next()'s own work:
    with pageable batches (no pin thread), taking them from the workers and freeing them here;
    with pinned ones, the hand-over, which costs the GPU only while the host waits for it."""
    keeps_up = (report.loader_ms is not None
                and report.loader_ms < report.reference_ms - report.data_wait_ms)
    if kind == Kind.DATA_WAIT and keeps_up:
        return KEEPS_UP_ADVICE if report.h2d_pageable[0] > 0 else HANDOVER_ADVICE
    return ADVICE[kind]


def _seen(kind: Kind, label: str, where: str, per_step: float, report: CheckupReport) -> str:
    """What was measured of a cause, per step, for its finding: ``label`` called ``where``,
    ``per_step`` times a step, for the host's waits; the report's own figures for the others."""
    if kind == Kind.COPY_EXPOSED:
        n, nbytes = report.h2d_pinned
        return (f"{n:.3g} pinned H2D copies ({format_bytes(nbytes)}) a step with no kernel "
                f"beside them")
    if kind == Kind.DATA_WAIT:
        source = (f"; the batch source alone takes {report.loader_ms:.3g} ms a batch"
                  if report.loader_ms is not None else "")
        return (f"the host spends {report.data_wait_ms:.3g} ms a step taking the next batch and "
                f"freeing the last{source}")
    if kind == Kind.HOST_BOUND:
        kernels = "-" if report.short_kernels is None else f"{report.short_kernels:.0%}"
        return (f"the host is busy {report.host_busy_ms:.3g} ms a step outside waits, the GPU "
                f"{report.gpu_work_ms:.3g} ms; {kernels} of kernels are "
                f"shorter than their launch, {report.launch_queue:.2g} wait queued on average")
    return f"{label} {where}, {per_step:.3g} a step, blocks the host"


def _findings(report: CheckupReport, per_cause: dict,
              savings: dict) -> tuple[list[Finding], list[tuple]]:
    """A finding per cause seen in at least every other step whose fix saves at least
    MIN_SAVING_SHARE of the step and MIN_SAVING_MS (``savings``: ms a step, by cause);
    ``host_bound`` only where the host's time outside waits is at least the GPU's and, with its
    waits gone, free launches still save that much (the host cannot keep ahead). Costliest
    first: a slow loader can cost more than the host's own time, and both be findings. Returns
    the findings and the causes seen in every other step that save too little (candidates for
    ``latent``)."""
    reference_ms = report.reference_ms
    floor = max(MIN_SAVING_SHARE * reference_ms, MIN_SAVING_MS)
    findings, small = [], []
    for key, ms in savings.items():
        kind, label, where = key
        calls, seen = per_cause.get(key, (0.0, report.steps))
        if seen < PER_STEP * report.steps:
            continue
        past_waits = report.host_bound_past_waits_ms  # None: not priced, no objection
        if kind == Kind.HOST_BOUND and not (report.host_busy_ms >= report.gpu_work_ms and (
                past_waits is None or past_waits >= floor)):
            continue
        if ms < floor or ms <= 0:
            if key in per_cause:
                small.append(key)
            continue
        advice, notebooks = _advice(kind, report)
        findings.append(Finding(kind, _seen(kind, label, where, calls, report), ms,
                                advice, notebooks, reference_ms - ms))
    findings.sort(key=lambda f: -f.cost_ms)
    return findings, small


def _waits_finding(report: CheckupReport) -> Finding | None:
    """``host_waits``: the host's waits of several kinds, priced together, where that saves a
    finding's worth more than the best of them alone (a wait that the next one hides costs
    little by itself, and a fix of one kind alone leaves the GPU idle at the next)."""
    reference_ms = report.reference_ms
    floor = max(MIN_SAVING_SHARE * reference_ms, MIN_SAVING_MS)
    alone = {kind: report.saving_ms(kind) for kind in report.waits_together}
    if not alone or report.waits_together_ms < max(alone.values()) + floor:
        return None
    seen = (f"{', '.join(report.waits_together)} together (alone: "
            + ", ".join(f"{kind} {ms:.3g} ms" for kind, ms in alone.items()) + ")")
    advice, notebooks = ADVICE[Kind.HOST_WAITS]
    return Finding(Kind.HOST_WAITS, seen, report.waits_together_ms, advice, notebooks,
                   reference_ms - report.waits_together_ms)


def _latent(report: CheckupReport, graph: _StepGraph, priced: _Priced,
            keys: list) -> list[Latent]:
    """The causes of ``keys`` that cost too little now to be findings but would cost once the
    host keeps ahead: the replay with the host's time outside waits scaled to HOST_AHEAD of the
    GPU's, with each fix and without. (With no host time at all a synchronisation would cost
    only its return: the price is taken where the host has just stopped being the
    bottleneck.)"""
    host_ms, gpu_ms, scale = report.host_busy_ms, report.gpu_work_ms, priced.scale
    ahead = scale * min(1.0, HOST_AHEAD * gpu_ms / host_ms) if host_ms > 0 else scale
    floor = MIN_SAVING_MS  # the step it would be part of is shorter than this one
    later = _savings(graph, {key: priced.fixes[key] for key in keys}, ahead)
    found = []
    for key in keys:
        now = max(priced.savings[key], 0.0)
        if later[key] < floor:
            continue  # free now and later: a wait on an event recorded steps ago, say
        if later[key] < LATER_RATIO * now:
            continue  # small now and later alike: not hidden by the host (host_waits, maybe)
        kind, label, where = key
        advice, notebooks = _advice(kind, report)
        found.append(Latent(kind, _seen(kind, label, where, priced.per_cause[key][0], report),
                            now, later[key], advice, notebooks))
    return sorted(found, key=lambda f: -f.later_ms)


# The analysis of a trace: the stages above, in order

def analyze_checkup_trace(trace: dict | list, steps: int, step_ms: float | None = None,
                          loader_ms: float | None = None, *,
                          link_gbps: float | None = None,
                          next_ms: float | None = None) -> CheckupReport:
    """Read a Chrome trace of ``steps`` steps, each marked with ``record_function(STEP_MARK)``
    (the wait for its batch with ``NEXT_MARK``, the batch's release after it with
    ``RELEASE_MARK``), into a ``CheckupReport`` (notebook 09; ``checkup`` makes the trace).

    The trace becomes a dependency graph of the steps (host lane, device ops, launches, waits)
    that a replay runs as it ran (``replay_fidelity``: its step over the profiled one) and with
    each cause removed: a cause's cost is the step time that saves. With ``step_ms`` (the
    unprofiled step) the host's time is scaled so that the replay runs at that pace, since the
    profiler slows the host but not the kernels. With ``next_ms`` (the unprofiled time in
    next(batches) and the release per step) the waits for data are scaled to it first: the
    profiler slows the Python inside next() too (a prefetcher's, say), which no host scale
    reaches. ``link_gbps``, the pinned copy rate measured apart (unprofiled): the price of a
    pageable copy made pinned when the trace has no pinned copy to measure it by (not given:
    LINK_GBPS), and the pace of a large pinned copy that the profiler slowed."""
    if steps < 1:
        raise ValueError(f"checkup: a trace of {steps} steps: nothing to read")
    profile = _read_profile(trace, steps)
    cause_of_call, cause_of_copy = _blocking_causes(profile)
    graph = _step_graph(profile, cause_of_call, cause_of_copy)
    measured = _measured(profile, cause_of_call, step_ms, trace)
    profiled = _profiled_period(graph)
    fidelity = _replay_period(graph) / profiled if profiled > 0 else None
    if next_ms is not None and measured["data_wait_ms"] > 0:
        _scale_data_waits(graph, next_ms / measured["data_wait_ms"])
        measured["data_wait_ms"] = next_ms
    paced = _pace_slow_copies(graph, link_gbps) if link_gbps is not None else 0
    priced = _priced(graph, _calibrate(graph, step_ms), link_gbps)
    report = CheckupReport(**measured, **priced.fields, loader_ms=loader_ms, link_gbps=link_gbps,
                           paced_copies=paced, replay_fidelity=fidelity, host_scale=priced.scale)
    findings, small = _findings(report, priced.per_cause, priced.savings)
    together = _waits_finding(report)
    if together is not None:
        findings = sorted(findings + [together], key=lambda f: -f.cost_ms)
    return replace(report, findings=findings, latent=_latent(report, graph, priced, small))


# The check-up of a running step: warm up, time the batch source and the step, profile

def _buffered_batches(batches: Iterable | None) -> int:
    """How many batches a DataLoader's workers may hold ready: 0 for other sources; a wrapper
    that keeps its source as ``.batches`` (``Prefetcher``) is looked through."""
    loader = getattr(batches, "batches", batches)
    workers = getattr(loader, "num_workers", 0) or 0
    return workers * (getattr(loader, "prefetch_factor", None) or 2)


def checkup_batches(workers: int = 0, prefetch_factor: int = 2, *, steps: int = 10,
                    timed_steps: int = 20, warmup: int = 5, loader_batches: int = 10) -> int:
    """How many batches ``checkup`` takes from a loader with ``workers`` workers (0 for any
    other source) and these settings (the batches the workers hold ready count twice: taken
    before the source is timed alone, and stepped through again after it) (notebook 09)."""
    return _batches_needed(workers * prefetch_factor, steps=steps, timed_steps=timed_steps,
                           warmup=warmup, loader_batches=loader_batches)


def _batches_needed(ready: int, *, steps: int, timed_steps: int, warmup: int,
                    loader_batches: int) -> int:
    """The batches ``checkup`` takes, in its order: warm-up, the ``ready`` ones dropped, the
    source timed alone, the ``ready`` ones stepped through, the timed steps, the profiler's
    warm-up step and the profiled steps."""
    return warmup + 2 * ready + loader_batches + timed_steps + 1 + steps


@functools.cache
def _pinned_link_gbps(nbytes: int = 16 * 2**20) -> float:
    """The link's rate from page-locked memory to the device (GB/s), measured once a process:
    the median of 10 copies of ``nbytes``, what a pageable copy would run at once pinned (the
    replay's price for it where the trace has no pinned copy). The buffer is page-locked with
    cudaHostRegister, not taken from PyTorch's caching host allocator, so the pinned memory
    cached after a check-up is the step's own (notebook 09 reports it)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(error) != 0:  # else the "pinned" rate would be a pageable copy's
        raise RuntimeError(f"checkup: cudaHostRegister of {format_bytes(nbytes)} failed "
                           f"({error}): cannot measure the pinned link rate")
    try:
        target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        timing = time_cuda(lambda: target.copy_(host, non_blocking=True), warmup=2, repeat=10)
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.data_ptr())
    return timing.gbps(nbytes)


def _host_allocs() -> float | None:
    """Pinned blocks the caching host allocator has made so far (None where it cannot say)."""
    try:
        made = torch.cuda.host_memory_stats().get("num_host_alloc")
    except (AttributeError, RuntimeError):
        return None
    return None if made is None else float(made)


def _warm_up(one_step: Callable[[], None], steps: int, more: int) -> None:
    """``steps`` steps, then up to ``more`` while the caching host allocator still pins new
    blocks (a host running ahead of the GPU needs more pinned buffers in flight)."""
    for _ in range(steps):
        one_step()
    for _ in range(more):
        before = _host_allocs()
        one_step()
        after = _host_allocs()
        if before is None or after is None or not after > before:
            break


def _loader_ms(take: Callable[[], object], ready: int, batches: int) -> float:
    """The batch source's own pace, per batch. Its workers filled their queue (``ready``
    batches) while the first steps were slow (start-up, autotuning): those are taken first, so
    that the source is timed from an empty queue."""
    for _ in range(ready):
        take()
    began = time.perf_counter()
    for _ in range(batches):
        take()
    return (time.perf_counter() - began) * 1e3 / max(batches, 1)


def _timed_ms(one_step: Callable[[], None], timed_steps: int,
              next_s: list[float]) -> tuple[float | None, float, float | None]:
    """The unprofiled step, from CUDA events on the current stream: the time per step from the
    end of the first step, which the GPU starts only after the host, to the end of the last
    (None for one step); the host's time in next() and the batch's release per step
    (``next_s`` accumulates it, in seconds); and the pinned blocks the host allocator made
    meanwhile (a host that runs ahead may have new buffers pinned in the timed steps: not yet
    steady; None where the allocator cannot say)."""
    torch.cuda.synchronize()
    allocs, waited = _host_allocs(), next_s[0]
    one_step()
    first = _recorded_event()
    for _ in range(timed_steps - 1):
        one_step()
    last = _recorded_event()
    torch.cuda.synchronize()
    step_ms = first.elapsed_time(last) / (timed_steps - 1) if timed_steps > 1 else None
    next_ms = (next_s[0] - waited) * 1e3 / max(timed_steps, 1)
    after = _host_allocs()
    return step_ms, next_ms, None if allocs is None or after is None else after - allocs


def _recorded_event() -> torch.cuda.Event:
    """A timing event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _profiled_trace(one_step: Callable[[], None], steps: int) -> dict:
    """The Chrome trace of ``steps`` steps (CPU and CUDA activity, Python stacks), after one
    more under the profiler that absorbs its set-up cost."""
    from torch.profiler import ProfilerActivity, profile, schedule

    traces = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        path = Path(tmp) / "trace.json"

        def keep(prof):
            prof.export_chrome_trace(str(path))
            traces.append(json.loads(path.read_text()))

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     with_stack=True, schedule=schedule(wait=0, warmup=1, active=steps),
                     on_trace_ready=keep) as prof:
            for _ in range(1 + steps):
                one_step()
                prof.step()
    torch.cuda.synchronize()
    return traces[0]


_RAN_OUT = object()  # what next() gives once the batch source is exhausted (a batch may be None)


class _Stepper:
    """One step as ``checkup`` runs it: ``step(batch)`` with a batch taken from ``batches``
    (``step()`` if there are none), the batch released after it, the host's time in both added
    to ``next_s`` (seconds), and the check-up's marks recorded only while ``profiling`` (a
    record_function costs the host even unprofiled: the timed steps would charge it to the
    step and to next(batches))."""

    def __init__(self, step: Callable, batches: Iterable | None, needed: int):
        self.step, self.batches, self.needed = step, batches, needed
        self.source = iter(batches) if batches is not None else None
        self.taken = 0
        self.next_s = [0.0]  # a list: ``_timed_ms`` reads what the steps add while it runs
        self.profiling = False

    def take(self):
        """The next batch; once the source runs out, an error that says how many batches
        ``checkup`` needs (``checkup_batches``)."""
        batch = next(self.source, _RAN_OUT)
        if batch is _RAN_OUT:
            raise ValueError(f"the batch source ran out after {self.taken} batches; "
                             f"checkup needs {self.needed}")
        self.taken += 1
        return batch

    def _mark(self, name: str):
        if not self.profiling:
            return nullcontext()
        from torch.profiler import record_function

        return record_function(name)

    def __call__(self) -> None:
        with self._mark(STEP_MARK):
            if self.batches is None:
                self.step()
                return
            began = time.perf_counter()
            with self._mark(NEXT_MARK):
                batch = self.take()
            self.next_s[0] += time.perf_counter() - began
            self.step(batch)
            began = time.perf_counter()
            with self._mark(RELEASE_MARK):  # a worker's batch: its shared memory unmapped
                del batch
            self.next_s[0] += time.perf_counter() - began

    def close(self) -> None:
        close = getattr(self.source, "close", None)  # a generator: let its loader shut down now
        if close is not None:
            close()
        self.source = None  # a DataLoader iterator shuts its workers down when it is dropped


def checkup(step: Callable, batches: Iterable | None = None, *, steps: int = 10,
            timed_steps: int = 20, warmup: int = 5, loader_batches: int = 10) -> CheckupReport:
    """Time and profile a training step, and say what it spends on moving data (notebook 09;
    notebook 13 runs it on CUDA graphs).

    ``step(batch)`` is called with batches from ``batches`` (``step()`` if there are none):
    ``warmup`` steps (without batches, up to ``warmup`` more while the caching host allocator
    still pins new blocks); then, from a DataLoader, the batches its workers may hold ready are
    taken and dropped, and ``loader_batches`` are taken alone to time the source by itself; then
    as many untimed steps as the workers hold batches, so that the queue the source's timing
    emptied fills again where the loader keeps ahead of the step, as in the rest of an epoch;
    then ``timed_steps`` are timed (by CUDA events, from the end of the first), and one more and
    ``steps`` run under the profiler (with Python stacks), the only steps that carry its
    ``record_function`` marks. ``checkup_batches`` says how many batches that is. The wait
    for each batch counts as part of its step, and so does its release after the step (a
    worker's batch in shared memory is unmapped there, which pin_memory=True moves to the
    loader's pin thread). Returns a ``CheckupReport``: print it for a table, the findings
    (costliest first, each with what to change, the step time predicted without it and the
    notebook that measures why) and the latent ones.
    """
    if steps < 1 or timed_steps < 1:
        raise ValueError(f"checkup: steps ({steps}) and timed_steps ({timed_steps}) must be 1 or "
                         "more")
    require_cuda()
    ready = _buffered_batches(batches)
    needed = (_batches_needed(ready, steps=steps, timed_steps=timed_steps, warmup=warmup,
                              loader_batches=loader_batches) if batches is not None else 0)
    one_step = _Stepper(step, batches, needed)
    loader_ms = None
    try:
        _warm_up(one_step, warmup, warmup if batches is None else 0)
        if batches is not None:
            loader_ms = _loader_ms(one_step.take, ready, loader_batches)
            _warm_up(one_step, ready, 0)  # the queue fills again
        step_ms, next_ms, allocs = _timed_ms(one_step, timed_steps, one_step.next_s)
        one_step.profiling = True
        trace = _profiled_trace(one_step, steps)
    finally:
        one_step.close()
    report = analyze_checkup_trace(trace, steps, step_ms, loader_ms,
                                   link_gbps=_pinned_link_gbps(),
                                   next_ms=next_ms if batches is not None else None)
    return replace(report, host_allocs_timed=allocs)
