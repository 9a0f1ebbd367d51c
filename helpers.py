"""Shared measuring kit for the notebooks: environment, timing, profiling, figures, claims.

Every notebook imports this module (its setup cell puts the repository root on ``sys.path``,
or on Colab downloads this one file). Sections:

1. Colab set-up      install what Colab lacks without ever touching its torch
2. Environment       what machine the numbers come from; a guard for notebooks that need CUDA;
                     how two GPUs of one host reach each other (NVLink, PCIe, peer access)
3. Timing            host clock, CUDA events, torch.utils.benchmark; bandwidth; sync probes
4. Host memory       page faults, the pinned pool of PyTorch's caching host allocator,
                     host memcpy rate; loader workers and the memory of a process tree
5. Profiling         device activity as lanes, overlap fraction, timeline picture
6. Figures           one style, deterministic PNGs in ``figures/``
7. Results, claims   measurements recorded in output metadata; claims checked as they run,
                     or shown as not tested on a host they do not fit (claim_where)
8. Batches           nested batches moved to a device; a side-stream prefetcher; activations
                     offloaded to pinned host memory on side streams (OffloadHooks)
9. Check-up          time and profile a training step; name what it spends on moving data
10. Checkpoints      the page cache (residency, eviction), page faults and disk reads of a
                     call, peak host memory; where a checkpoint's tensors lie (torch.save,
                     safetensors, shards) and a loader through reused pinned buffers
11. CUDA graphs      a training step captured once and replayed, its batch copied in
                     outside the graph or from pinned staging buffers inside it
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules and not os.environ.get("MPLBACKEND"):
    matplotlib.use("Agg")  # scripts and tests draw off-screen; notebooks keep the inline backend
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent
# Test runs set COLLECTION_FIGURES_DIR (conftest.py) so that they never overwrite committed figures.
FIGURES_DIR = Path(os.environ.get("COLLECTION_FIGURES_DIR", ROOT / "figures"))
METADATA_KEY = "collection"  # namespace in notebook and output metadata

# --------------------------------------------------------------------------------------------
# 1. Colab set-up
# --------------------------------------------------------------------------------------------

#: Packages the notebooks use that a Colab runtime does not ship.
COLAB_EXTRAS = ("tensordict",)


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def missing_packages(names: Iterable[str]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def pip_install_command(packages: Sequence[str], constraints_file: str) -> list[str]:
    """pip command that installs ``packages`` while the constraints file pins torch.

    Pinning the installed torch makes pip pick the newest release of each package that
    declares itself compatible with it, and fail rather than replace torch.
    """
    if any(p.split("=")[0].split("<")[0].split(">")[0].strip() == "torch" for p in packages):
        raise ValueError("the set-up never installs torch: use the runtime's own")
    return [sys.executable, "-m", "pip", "install", "-q", "-c", constraints_file, *packages]


def colab_setup(packages: Sequence[str] = COLAB_EXTRAS) -> list[str]:
    """On Colab, install the missing ``packages`` against the runtime's torch; elsewhere nothing."""
    if not in_colab():
        return []
    missing = missing_packages(packages)
    if missing:
        torch_version = importlib.metadata.version("torch")
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
            pins.write(f"torch=={torch_version}\n")
        subprocess.run(pip_install_command(missing, pins.name), check=True)
        print(f"installed {', '.join(missing)} against torch {torch_version}")
    return missing


# --------------------------------------------------------------------------------------------
# 2. Environment
# --------------------------------------------------------------------------------------------

# Per-lane signalling rate (GT/s) and line-code efficiency for each PCIe generation.
_PCIE_LANE = {1: (2.5, 8 / 10), 2: (5.0, 8 / 10), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130),
              5: (32.0, 128 / 130), 6: (64.0, 242 / 256)}


def pcie_link_gbps(generation: int | None, width: int | None) -> float | None:
    """Theoretical PCIe payload rate per direction in GB/s (10^9 B/s), before protocol overhead."""
    if generation not in _PCIE_LANE or not width:
        return None
    rate, efficiency = _PCIE_LANE[generation]
    return rate * efficiency * width / 8


class CUDARequired(RuntimeError):
    """Raised by :func:`require_cuda`; Jupyter shows only its one-line message."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def require_cuda() -> torch.device:
    """Return the CUDA device, or stop the notebook with one line that says what to do."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if in_colab():
        hint = "on Colab choose Runtime > Change runtime type > T4 GPU, then Run all again."
    else:
        hint = (f"torch {torch.__version__} sees no CUDA device here; run it on a machine "
                "with an NVIDIA GPU, or open it in Colab with a GPU runtime.")
    raise CUDARequired(f"this notebook measures a GPU: {hint}")


def require_gpus(count: int) -> list[torch.device]:
    """Return ``count`` CUDA devices, or stop the notebook with one line saying what it needs."""
    require_cuda()
    visible = torch.cuda.device_count()
    if visible < count:
        raise CUDARequired(f"this notebook needs {count} GPUs on one host and torch sees "
                           f"{visible}; its outputs show a run on such a host.")
    return [torch.device("cuda", index) for index in range(count)]


def _pcie_link(index: int) -> tuple[int | None, int | None, int | None, int | None]:
    """(current gen, max gen, current width, max width) from NVML, else nvidia-smi, else Nones."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle),
                pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
                pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle),
                pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except Exception:  # no NVML binding or no NVML support: try the command-line tool
        pass
    if shutil.which("nvidia-smi"):
        query = ("pcie.link.gen.current,pcie.link.gen.max,"
                 "pcie.link.width.current,pcie.link.width.max")
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                              f"--id={index}"], capture_output=True, text=True, timeout=20)
        fields = [f.strip() for f in out.stdout.strip().split(",")]
        if out.returncode == 0 and len(fields) == 4:
            return tuple(int(f) if f.isdigit() else None for f in fields)  # type: ignore[return-value]
    return (None, None, None, None)


def _copy_engine_count(index: int) -> int | None:
    """CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT through the driver library, if it can be loaded."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device, value = ctypes.c_int(), ctypes.c_int()
        if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), index):
            return None
        if driver.cuDeviceGetAttribute(ctypes.byref(value), 40, device):
            return None
        return value.value
    except OSError:
        return None


def host_ram_gib() -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def environment(index: int = 0) -> dict:
    """Facts about this machine that the measurements depend on (None where unknown)."""
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "gpu": None, "gpu_memory_gib": None, "compute_capability": None,
           "pcie_gen": None, "pcie_gen_max": None, "pcie_width": None, "pcie_width_max": None,
           "link_gbps": None, "copy_engines": None, "cpu_count": os.cpu_count(),
           "usable_cpus": usable_cpus(),
           "host_ram_gib": round(host_ram_gib(), 1), "colab": in_colab()}
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(index)
        gen, gen_max, width, width_max = _pcie_link(index)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}",
                   pcie_gen=gen, pcie_gen_max=gen_max, pcie_width=width, pcie_width_max=width_max,
                   link_gbps=pcie_link_gbps(gen_max or gen, width_max or width),
                   copy_engines=_copy_engine_count(index))
    return env


def _usable(env: dict) -> str:
    """The CPUs this process may use, where fewer than the host's (``taskset``, a container)."""
    usable = env.get("usable_cpus")
    return "" if usable in (None, env["cpu_count"]) else f"{usable} usable by this process, "


def format_environment(env: dict) -> str:
    def show(value, fmt="{}"):
        return "unknown" if value is None else fmt.format(value)

    if env["cuda_available"]:
        link = (f"PCIe Gen{show(env['pcie_gen_max'])} x{show(env['pcie_width_max'])} "
                f"(now Gen{show(env['pcie_gen'])} x{show(env['pcie_width'])}), "
                f"{show(env['link_gbps'], '{:.1f}')} GB/s per direction in theory")
        gpu = (f"{env['gpu']}, {env['gpu_memory_gib']} GiB, compute capability "
               f"{env['compute_capability']}, {show(env['copy_engines'])} copy engines")
    else:
        link, gpu = "n/a", "none visible to torch"
    rows = [("torch", f"{env['torch']} (CUDA runtime {show(env['cuda_runtime'])}), "
                      f"Python {env['python']}"),
            ("GPU", gpu), ("host link", link),
            ("host", f"{env['cpu_count']} CPUs, {_usable(env)}{env['host_ram_gib']} GiB RAM"
                     + (", Google Colab" if env["colab"] else ""))]
    return "\n".join(f"{name:<10} {value}" for name, value in rows)


def environment_report(index: int = 0) -> dict:
    """Print the environment as a compact table and return it as a dict."""
    env = environment(index)
    print(format_environment(env))
    return env


# Two GPUs on one host: how they reach each other and the host (notebook 10).


def tool_output(*command: str, timeout: float = 30) -> str | None:
    """What a command-line tool prints, or None if it is missing or fails."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def pci_address(index: int) -> str | None:
    """A CUDA device's PCI address as Linux writes it ("0000:18:00.0"), or None if unknown."""
    props = torch.cuda.get_device_properties(index)
    if not hasattr(props, "pci_bus_id"):
        return None
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def gpu_numa_node(index: int) -> int | None:
    """The NUMA node a CUDA device hangs off (-1: the firmware does not say), or None."""
    try:
        return int(Path(f"/sys/bus/pci/devices/{pci_address(index)}/numa_node").read_text())
    except (OSError, ValueError):
        return None


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> dict[int, str]:
    """The CPUs of each NUMA node of this host (Linux), e.g. {0: "0-31"}; {} if unknown."""
    nodes = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    return {int(p.name[4:]): (p / "cpulist").read_text().strip() for p in nodes}


def in_virtual_machine(cpuinfo: str | None = None) -> bool:
    """Whether this runs under a hypervisor (the CPU's "hypervisor" flag, /proc/cpuinfo): a
    virtual machine shows its own PCIe tree, which can hide that two GPUs share a switch."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = (line.partition(":")[2].split() for line in cpuinfo.splitlines()
             if line.split(":")[0].strip() in ("flags", "Features"))
    return any("hypervisor" in line for line in flags)


#: The PCIe path between two GPUs in nvidia-smi's words (``nvidia-smi topo -m``), shortest first;
#: NVML's common-ancestor levels (``_NVML_ANCESTOR``) map onto the same names.
PCIE_PATHS = {"board": "one board", "PIX": "one PCIe switch",
              "PXB": "several PCIe switches, not the CPU", "PHB": "the CPU's PCIe host bridge",
              "NODE": "two host bridges of one NUMA node", "SYS": "the link between NUMA nodes"}
_NVML_ANCESTOR = {0: "board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_SWITCHED, _THROUGH_CPU = ("board", "PIX", "PXB"), ("PHB", "NODE", "SYS")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class GpuLink:
    """How two GPUs of one host reach each other, as the driver reports it."""

    peer_access: bool  # each can read and write the other's memory (torch asks the driver)
    nvlink: bool | None  # joined by NVLink (None: nobody could tell)
    nvlink_links: int | None  # active NVLink links, where known
    pcie_path: str | None  # a key of PCIE_PATHS (where their PCIe paths meet), None: unknown
    source: str  # where the facts come from: "NVML", "nvidia-smi topo -m" or "nothing"

    @property
    def kind(self) -> str:
        """"nvlink"; "pcie_switch" (PCIe, through a switch, not the CPU); "pcie_cpu" (PCIe,
        through the CPU's host bridge or further); or "unknown"."""
        if self.nvlink:
            return "nvlink"
        if self.pcie_path in _SWITCHED:
            return "pcie_switch"
        if self.pcie_path in _THROUGH_CPU:
            return "pcie_cpu"
        return "unknown"

    @property
    def shares_pcie_switch(self) -> bool:
        """Both GPUs sit behind one PCIe switch, so they share its one link to the host."""
        return self.pcie_path in _SWITCHED

    @property
    def separate_host_links(self) -> bool:
        """Their PCIe paths meet only at the CPU: each GPU has its own link to the host."""
        return self.pcie_path in _THROUGH_CPU

    def __str__(self) -> str:
        links = "" if self.nvlink_links is None else f" ({self.nvlink_links} links)"
        direct = {True: f"NVLink{links}", False: "no NVLink", None: "NVLink unknown"}
        return (f"GPU to GPU: {direct[self.nvlink]}; their PCIe paths meet at "
                f"{PCIE_PATHS.get(self.pcie_path, 'an unreported place')}; peer access: "
                f"{'yes' if self.peer_access else 'no'} (from {self.source})")


def parse_topology_matrix(text: str) -> dict[tuple[int, int], str]:
    """The GPU-to-GPU cells of ``nvidia-smi topo -m`` ("NV18", "PIX", "SYS", ...) by (row GPU,
    column GPU), in nvidia-smi's numbering; {} if ``text`` holds no matrix."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if re.match(r"\s+GPU0\b", line)), None)
    if start is None:  # the header row starts with the empty corner cell
        return {}
    columns = [int(name[3:]) for name in re.findall(r"\bGPU\d+\b", lines[start])]
    cells = {}
    for line in lines[start + 1:]:
        fields = line.split()
        if not fields or not re.fullmatch(r"GPU\d+", fields[0]):
            continue
        row = int(fields[0][3:])  # the GPU columns come first, before NICs and affinities
        for column, cell in zip(columns, fields[1:1 + len(columns)], strict=False):
            if cell != "X":
                cells[(row, column)] = cell
    return cells


def link_from_matrix_cell(cell: str, peer_access: bool) -> GpuLink:
    """A ``GpuLink`` from one cell of ``nvidia-smi topo -m``: "NV#" (NVLink, # links), where the
    matrix does not say the PCIe path, or a PCIe path."""
    if re.fullmatch(r"NV\d+", cell):
        return GpuLink(peer_access, True, int(cell[2:]), None, "nvidia-smi topo -m")
    path = {"SOC": "SYS"}.get(cell, cell)  # older drivers wrote SOC for SYS
    if path not in PCIE_PATHS:  # a word this code does not know: nothing can be told
        return GpuLink(peer_access, None, None, None, "nvidia-smi topo -m")
    return GpuLink(peer_access, False, None, path, "nvidia-smi topo -m")


def _nvml_link(a: int, b: int, peer_access: bool) -> GpuLink | None:
    """The link between CUDA devices ``a`` and ``b`` from NVML (package nvidia-ml-py), found by
    their PCI addresses (NVML may number GPUs differently); None if NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package, no driver library, or no NVML support
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByPciBusId(pci_address(i)) if pci_address(i)
                   else pynvml.nvmlDeviceGetHandleByIndex(i) for i in (a, b)]
        try:
            nvlink = pynvml.nvmlDeviceGetP2PStatus(
                *handles, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK
        except pynvml.NVMLError:
            nvlink = None
        links = None
        if nvlink:
            links = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    links += pynvml.nvmlDeviceGetNvLinkState(handles[0], link) == 1
                except pynvml.NVMLError:  # no such link
                    continue
        try:
            path = _NVML_ANCESTOR.get(pynvml.nvmlDeviceGetTopologyCommonAncestor(*handles))
        except pynvml.NVMLError:
            path = None
        return GpuLink(peer_access, nvlink, links or None, path, "NVML")
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def gpu_link(a: int = 0, b: int = 1) -> GpuLink:
    """How CUDA devices ``a`` and ``b`` are connected: from NVML if it can tell, else from
    ``nvidia-smi topo -m``; peer access from torch (the driver) either way."""
    peer = bool(torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a))
    link = _nvml_link(a, b, peer)
    if link is not None:
        return link
    smi_index = {}  # nvidia-smi numbers GPUs by PCI address; CUDA may number them otherwise
    listing = tool_output("nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader")
    for line in (listing or "").splitlines():
        index, _, bus = (field.strip() for field in line.partition(","))
        if index.isdigit():
            smi_index[bus.lower()[-12:]] = int(index)
    rows = [smi_index.get(pci_address(i) or "", i) for i in (a, b)]
    cell = parse_topology_matrix(tool_output("nvidia-smi", "topo", "-m") or "").get(tuple(rows))
    return link_from_matrix_cell(cell, peer) if cell else GpuLink(peer, None, None, None,
                                                                   "nothing")


# --------------------------------------------------------------------------------------------
# 3. Timing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one thing, in milliseconds."""

    samples_ms: tuple[float, ...]
    method: str

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def q1_ms(self) -> float:
        return _quantile(self.samples_ms, 0.25)

    @property
    def q3_ms(self) -> float:
        return _quantile(self.samples_ms, 0.75)

    @property
    def iqr_ms(self) -> float:
        return self.q3_ms - self.q1_ms

    def gbps(self, nbytes: int) -> float:
        return bandwidth_gbps(nbytes, self.median_ms)

    def __str__(self) -> str:
        return (f"{_ms(self.median_ms)} median (IQR {_ms(self.q1_ms)} to {_ms(self.q3_ms)}, "
                f"n={len(self.samples_ms)}, {self.method})")


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f} us" if value < 0.1 else f"{value:.3g} ms"


def bandwidth_gbps(nbytes: int, milliseconds: float) -> float:
    """Bytes per second in GB/s (10^9), the unit PCIe rates are quoted in."""
    return nbytes / (milliseconds * 1e-3) / 1e9


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_host(fn: Callable[[], object], *, sync: bool, warmup: int = 3, repeat: int = 20,
              setup: Callable[[], object] | None = None) -> Timing:
    """Host wall clock around each call. ``sync=False`` times only what the host waits for.

    ``setup`` runs, untimed, before every call, warm-up calls included (to empty a cache, say,
    so that each call is a first call, or to queue the work a call should wait for).
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    _sync()
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        if sync:
            _sync()
        start = time.perf_counter()
        fn()
        if sync:
            _sync()
        samples.append((time.perf_counter() - start) * 1e3)
    _sync()  # leave no queued work behind, whatever was timed
    method = "host clock, synchronised" if sync else "host clock, no sync"
    return Timing(tuple(samples), method)


def time_cuda(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 20) -> Timing:
    """CUDA events recorded on the current stream before and after each call."""
    for _ in range(warmup):
        fn()
    pairs = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()  # elapsed_time raises until both events have completed
    return Timing(tuple(s.elapsed_time(e) for s, e in pairs), "CUDA events")


def benchmark(fn: Callable[[], object], *, min_run_time: float = 1.0) -> Timing:
    """torch.utils.benchmark's blocked_autorange (it synchronises CUDA around each block).

    It sizes blocks so that the sync costs under 1e-4 of a block, so a call of a few ms makes
    blocks of about 0.3 s: ``min_run_time`` must cover several blocks to give a spread.
    """
    from torch.utils import benchmark as tub

    # Timer runs on one intra-op thread unless told otherwise; give it what the process has.
    measurement = tub.Timer(stmt="fn()", globals={"fn": fn},
                            num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time)
    return Timing(tuple(t * 1e3 for t in measurement.times), "torch.utils.benchmark")


def per_step_ms(make_batches: Callable[[], Iterable], step: Callable[[object], object], *,
                runs: int = 3, skip: int = 2, tail: int = 0) -> float:
    """Steady-state GPU time per step of a loop, in ms.

    Each epoch runs ``step(batch)`` over ``make_batches()`` with a CUDA event recorded on the
    current stream after every step; its time per step is the span from step ``skip`` to the
    ``tail``-th from last, over the steps between (the first steps fill the pipeline, the last
    may have nothing left to overlap). The result is the median over ``runs`` epochs, after one
    warm-up epoch.
    """
    per_epoch = [epoch_step_ms(make_batches, step, skip=skip, tail=tail)
                 for _ in range(runs + 1)]
    return statistics.median(per_epoch[1:])


# Taking turns: a loop's epochs (notebook 07), gated pairs of copies (notebook 04) and blocks of
# calls (notebooks 09, 11) timed alternately, so that a slow spell of a shared host falls on
# every case being compared, not on whichever ran then.


def epoch_step_ms(make_batches: Callable[[], Iterable], step: Callable[[object], object], *,
                  skip: int = 2, tail: int = 0) -> float:
    """GPU time per step of one epoch, in ms: ``step(batch)`` over ``make_batches()`` with a CUDA
    event recorded on the current stream after every step, timed from step ``skip`` to the
    ``tail``-th from last (one epoch of :func:`per_step_ms`)."""
    marks = []
    for batch in make_batches():
        step(batch)
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
    torch.cuda.synchronize()
    last = len(marks) - 1 - tail
    if last <= skip:
        raise ValueError(f"an epoch of {len(marks)} steps leaves none to time with "
                         f"skip={skip}, tail={tail}")
    return marks[skip].elapsed_time(marks[last]) / (last - skip)


def interleaved_step_ms(loops: dict[str, tuple[Callable[[], Iterable], Callable[[object], object]]],
                        *, rounds: int = 7, warmup: int = 1, skip: int = 2, tail: int = 0,
                        after: Callable[[str], object] | None = None) -> dict[str, list[float]]:
    """Time per step of several loops (name: (make_batches, step)), one epoch of each in turn
    (A B C A B C...) for ``warmup + rounds`` rounds, so that a slow spell of the host or the GPU
    falls on all of them rather than on whichever was being measured. Returns each loop's time
    per step in every timed round (:func:`epoch_step_ms`), in round order, so that a caller can
    compare loops round by round and see an outlier. ``after(name)`` runs, untimed, after each
    epoch, warm-up epochs included (to check a result, say)."""
    per_round: dict[str, list[float]] = {name: [] for name in loops}
    for index in range(warmup + rounds):
        for name, (make_batches, step) in loops.items():
            ms = epoch_step_ms(make_batches, step, skip=skip, tail=tail)
            if after is not None:
                after(name)
            if index >= warmup:
                per_round[name].append(ms)
    return per_round


def queue_gated(fn: Callable[[], object], streams: Sequence[torch.cuda.Stream], *,
                gate_ms: float = 5.0) -> tuple[torch.cuda.Event, list[torch.cuda.Event]]:
    """Queue ``fn``'s work behind a gate: ``gate_ms`` of GPU work on the current stream, which
    each of ``streams`` waits for before the work ``fn`` queues on it. ``fn`` must only queue
    work (on those streams), not wait for it. Everything is in place before any of it starts, so
    when each piece starts no longer depends on when the host got round to queueing it (a slow
    launch, a descheduled thread). Returns an event at the gate's end and one at the end of each
    stream's work."""
    opened = torch.cuda.Event(enable_timing=True)
    gpu_busy(gate_ms)
    opened.record()
    for stream in streams:
        stream.wait_event(opened)
    fn()
    ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
    for stream, end in zip(streams, ends, strict=True):
        end.record(stream)
    return opened, ends


def time_gated(fn: Callable[[], object], streams: Sequence[torch.cuda.Stream], *,
               gate_ms: float = 5.0) -> float:
    """Device time of the work ``fn`` queues on ``streams``, in ms: from the end of a gate that
    holds all of it back (:func:`queue_gated`) to the end of the last stream's work, by CUDA
    events (no host clock, no launch or synchronisation latency)."""
    torch.cuda.synchronize()
    opened, ends = queue_gated(fn, streams, gate_ms=gate_ms)
    torch.cuda.synchronize()
    return max(opened.elapsed_time(end) for end in ends)


def interleaved_gated(cases: dict[str, tuple[Callable[[], object],
                                             Sequence[torch.cuda.Stream]]], *,
                      rounds: int = 30, warmup: int = 2, gate_ms: float = 5.0,
                      ) -> dict[str, Timing]:
    """:func:`time_gated` for each case (name: (fn, streams)), the cases taken in turn (A B A
    B...) for ``warmup + rounds`` rounds, so that a slow spell falls on all of them. Sample i of
    every case comes from round i, so that cases can be compared round by round."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(warmup + rounds):
        for name, (fn, streams) in cases.items():
            ms = time_gated(fn, streams, gate_ms=gate_ms)
            if index >= warmup:
                samples[name].append(ms)
    return {name: Timing(tuple(values), "CUDA events, gated start, cases in turn")
            for name, values in samples.items()}


def interleaved_timings(fns: dict[str, Callable[[], object]], *, rounds: int = 5,
                        block: int = 1, settle: int = 0, warmup: int = 1) -> dict[str, Timing]:
    """Time per call of each function, the functions taking turns (A B A B ...), so that a
    slow spell of the host or of the GPU falls on all of them, and a ratio can pair calls made
    moments apart (``ratios_by_round``).

    Each function is called ``warmup`` times first, in turn. Then, every round, for each
    function: ``settle`` calls untimed (for loops that share one batch source, the pipeline
    gets to this loop's pace), then ``block`` calls timed together on the host clock,
    synchronised at both ends. A sample is a block's time over ``block``: one per round.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(settle):
                fn()
            _sync()
            start = time.perf_counter()
            for _ in range(block):
                fn()
            _sync()
            samples[name].append((time.perf_counter() - start) * 1e3 / block)
    return {name: Timing(tuple(s), "host clock, synchronised, in turns")
            for name, s in samples.items()}


def ratios_by_round(numerator: Timing, denominator: Timing) -> list[float]:
    """Round by round, one timing's sample over the other's: for timings taken in turns
    (``interleaved_timings``), each ratio pairs two calls made moments apart."""
    if len(numerator.samples_ms) != len(denominator.samples_ms):
        raise ValueError("the two timings have different numbers of rounds")
    return [a / b for a, b in zip(numerator.samples_ms, denominator.samples_ms, strict=True)]


def format_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def bandwidth_sweep(sizes: Sequence[int], copies: dict[str, Callable[[int], Callable[[], object]]],
                    *, warmup: int = 2, repeat: int = 10,
                    progress: bool = True) -> dict[str, list[Timing]]:
    """Time each kind of copy at each size with CUDA events, printing a line per size.

    ``copies[name](nbytes)`` allocates its buffers and returns a function that does one copy;
    they are dropped before the next size, so at most one size's buffers are alive at a time.
    """
    results: dict[str, list[Timing]] = {name: [] for name in copies}
    for nbytes in sizes:
        rates = []
        for name, make_copy in copies.items():
            one_copy = make_copy(nbytes)
            timing = time_cuda(one_copy, warmup=warmup, repeat=repeat)
            del one_copy
            results[name].append(timing)
            rates.append(f"{name} {timing.gbps(nbytes):6.2f}")
        if progress:
            print(f"{format_bytes(nbytes):>9}  " + " | ".join(rates) + "  GB/s", flush=True)
    return results


def sustained_rate_gbps(make_copy: Callable[[int], Callable[[], object]], sizes: Sequence[int],
                        *, rounds: int = 5, repeat: int = 20,
                        quantile: float = 0.9) -> dict[int, list[float]]:
    """A copy rate that a rerun reproduces: per size, one rate per round.

    Each round's rate is the ``quantile`` of ``repeat`` copies' rates (timed with CUDA events):
    a high quantile keeps what the link does and drops copies that another tenant of the host
    slowed. The rounds take the sizes in turn, so a slow spell falls on every size rather than
    on one. ``make_copy(nbytes)`` allocates buffers (kept for all rounds) and returns one copy.
    """
    copies = {nbytes: make_copy(nbytes) for nbytes in sizes}
    rates: dict[int, list[float]] = {nbytes: [] for nbytes in sizes}
    for _ in range(rounds):
        for nbytes, one_copy in copies.items():
            timing = time_cuda(one_copy, warmup=2, repeat=repeat)
            rates[nbytes].append(bandwidth_gbps(nbytes, _quantile(timing.samples_ms,
                                                                  1 - quantile)))
    return rates


@cache
def _sleep_cycles_per_ms() -> float:
    cycles = 1 << 20
    torch.cuda._sleep(cycles)  # warm-up: the first launch loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def gpu_busy(milliseconds: float) -> None:
    """Queue roughly ``milliseconds`` of device work on the current stream and return at once.

    Work queued ahead of an operation makes its ordering visible: whatever waits for the
    stream waits for this first.
    """
    torch.cuda._sleep(int(milliseconds * _sleep_cycles_per_ms()))


@dataclass(frozen=True)
class SyncProbe:
    host_ms: float  # how long the host spent in the call
    busy_ms: float  # device work queued ahead of it
    warned: bool  # torch.cuda.set_sync_debug_mode("warn") reported a synchronisation

    @property
    def blocked(self) -> bool:
        """The host waited for the queued work: the call synchronised."""
        return self.host_ms > 0.5 * self.busy_ms


def sync_probe(fn: Callable[[], object], *, busy_ms: float = 50.0) -> SyncProbe:
    """Does ``fn`` make the host wait for the GPU? Queue ``busy_ms`` of work, time the call.

    Also asks PyTorch's sync debug mode (process-wide, restored afterwards) for its opinion.
    ``fn`` runs once before the probe: a first call can wait for one-off set-up (loading a
    kernel's module, say) that says nothing about the operation itself.
    """
    fn()
    torch.cuda.synchronize()
    gpu_busy(busy_ms)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            start = time.perf_counter()
            fn()
            host_ms = (time.perf_counter() - start) * 1e3
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    warned = any("synchronizing CUDA operation" in str(w.message) for w in caught)
    return SyncProbe(host_ms, busy_ms, warned)


def sanitizer_verdict(fn: Callable[[], object]) -> tuple[str, object]:
    """Run ``fn`` under PyTorch's CUDA sanitizer (CSAN) and return its first data-race report
    line ("no report" if none) and what ``fn`` returned (None if the sanitizer raised).

    CSAN follows CUDA tensors across streams; it does not follow host memory.
    """
    import contextlib
    import io

    from torch._utils import CallbackRegistry
    from torch.cuda import _gpu_trace
    from torch.cuda._sanitizer import CUDASanitizerDispatchMode, CUDASanitizerErrors

    registries = [r for r in vars(_gpu_trace).values() if isinstance(r, CallbackRegistry)]
    registered = [len(r.callback_list) for r in registries]
    report = io.StringIO()
    try:
        with contextlib.redirect_stderr(report), CUDASanitizerDispatchMode():
            result = fn()
    except CUDASanitizerErrors:
        result = None
    finally:
        torch.cuda.synchronize()
        # The mode registers its handlers for every CUDA event and allocation for good: take
        # them off, or every later CUDA call in the process runs them.
        for registry, count in zip(registries, registered, strict=True):
            del registry.callback_list[count:]
    lines = report.getvalue().splitlines()
    return next((line for line in lines if "data race" in line), "no report"), result


# --------------------------------------------------------------------------------------------
# 4. Host memory: page faults and the pinned (page-locked) pool
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultProbe:
    ms: float  # host wall time of the call
    minor_faults: int  # pages the kernel had to map in during it
    result: object = field(default=None, repr=False, compare=False)  # what the call returned

    def __str__(self) -> str:
        return f"{_ms(self.ms)}, {self.minor_faults} page faults"


def fault_probe(fn: Callable[[], object]) -> FaultProbe:
    """Time one call of ``fn`` and count the minor page faults the process took during it."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    result = fn()
    ms = (time.perf_counter() - start) * 1e3
    return FaultProbe(ms, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, result)


def memlock_limit() -> str:
    """This process's RLIMIT_MEMLOCK (what ``ulimit -l`` shows), readable."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**10:.0f} KiB"


def pinned_pool() -> dict[str, int]:
    """What PyTorch's caching host allocator holds from CUDA: bytes and blocks, in use or
    cached, block sizes as requested from CUDA after rounding.

    There is no reliable "in use" figure: in torch 2.11 the ``active_*`` counters of
    ``torch.cuda.host_memory_stats()`` are not decremented on every free (``freed`` goes
    negative), so they only grow.
    """
    if torch.cuda.is_available():
        torch.cuda.init()  # host_memory_stats() reads {} until CUDA is initialised
    stats = torch.cuda.host_memory_stats()

    def stat(*names: str) -> int:
        return next((int(stats[n]) for n in names if n in stats), 0)

    return {"held_bytes": stat("allocated_bytes.current", "reserved_bytes.current"),
            "held_blocks": stat("allocations.current", "segment.current")}


def empty_pinned_cache() -> None:
    """Give the pinned blocks that PyTorch caches but nobody uses back to the driver."""
    torch._C._host_emptyCache()


def time_host_memcpy(nbytes: int, *, threads: int, pinned_destination: bool = True,
                     repeat: int = 10) -> Timing:
    """Host-only copy of ``nbytes`` from a pageable tensor into a pinned (or pageable) one, with
    ``threads`` intra-op threads: the rate at which pinning, or the driver's staging, can go.

    Both buffers are touched before timing, so no page faults are counted.
    """
    source = torch.ones(nbytes, dtype=torch.uint8)
    destination = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned_destination)
    destination.fill_(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timing = time_host(lambda: destination.copy_(source), sync=False, warmup=2,
                           repeat=repeat)
    finally:
        torch.set_num_threads(previous)
    return Timing(timing.samples_ms, f"host memcpy, {threads} thread(s)")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(cap: int = 4) -> int:
    """DataLoader workers for this host: one CPU left for the main process, at most ``cap``."""
    return max(1, min(cap, usable_cpus() - 1))


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # fields after the command name, which is in parentheses and may hold spaces
        state, parent = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":
            children[int(parent)].append(int(entry.name))
    return children


def child_processes(pid: int | None = None) -> list[int]:
    """Live descendants of ``pid`` (default: this process), e.g. DataLoader workers still
    running; zombies (exited, not yet reaped) are not counted. Linux only."""
    children = _children_by_parent()
    found, frontier = [], [os.getpid() if pid is None else pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return sorted(found)


def _memory_mib(pid: int) -> float:
    """A process's proportional set size (shared pages split among the processes sharing
    them, so forked workers are not counted twice), else its RSS; 0 if it has gone."""
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
        except OSError:
            continue
    return 0.0


class MemoryWatch:
    """Samples the memory of a process and all its descendants (loader workers included) in a
    daemon thread, from the moment it is made, and keeps the peak of their sum.

    The sum is of proportional set sizes, so pages that forked workers share with their parent
    count once. A peak shorter than ``interval_s`` can slip between samples;
    ``kernel_peak_mib`` is the process's own exact peak RSS, kept by the kernel.
    """

    def __init__(self, interval_s: float = 0.05, pid: int | None = None):
        import threading

        self.pid = os.getpid() if pid is None else pid
        self.interval_s = interval_s
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)
        self._thread.start()

    def sample(self) -> float:
        """The tree's memory now (MiB); also updates the peak."""
        total = sum(_memory_mib(p) for p in [self.pid, *child_processes(self.pid)])
        self.peak_mib = max(self.peak_mib, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    @property
    def kernel_peak_mib(self) -> float:
        match = next((line for line in Path(f"/proc/{self.pid}/status").read_text().splitlines()
                      if line.startswith("VmHWM:")), None)
        return int(match.split()[1]) / 1024 if match else 0.0

    def stop(self) -> float:
        """Stop sampling (after a last sample); returns the peak in MiB."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak_mib


# --------------------------------------------------------------------------------------------
# 5. Profiling: device activity as lanes
# --------------------------------------------------------------------------------------------

#: Lane of host-side spans marked with ``torch.profiler.record_function`` (kind "host").
HOST_LANE = -1


@dataclass(frozen=True)
class Activity:
    """One span of device work (a kernel, a copy, a memset, on one stream), or a host span
    that the code marked with ``torch.profiler.record_function``."""

    stream: int  # HOST_LANE for host spans
    kind: str  # "kernel", "H2D", "D2H", "D2D", "memset", "host"
    name: str
    start_us: float
    end_us: float
    nbytes: int | None = None

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def _activity_kind(category: str, name: str) -> str | None:
    if category == "user_annotation":
        return "host"
    if category == "kernel":
        return "kernel"
    if category == "gpu_memset":
        return "memset"
    if category == "gpu_memcpy":
        for marker, kind in (("HtoD", "H2D"), ("DtoH", "D2H"), ("DtoD", "D2D")):
            if marker in name:
                return kind
        return "D2D"  # peer-to-peer and other device-side copies
    return None


def _trace_events(trace: dict | list) -> list[dict]:
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def parse_chrome_trace(trace: dict | list) -> list[Activity]:
    """Device activities, and host spans marked with ``record_function``, from a torch.profiler
    Chrome trace; times in microseconds from the first of them (the profiler puts host and
    device events on one clock)."""
    found = []
    for event in _trace_events(trace):
        kind = _activity_kind(event.get("cat", ""), event.get("name", ""))
        if kind is None or event.get("ph") != "X":
            continue
        args = event.get("args", {})
        stream = HOST_LANE if kind == "host" else int(args.get("stream", event.get("tid", -1)))
        start = float(event["ts"])
        found.append((stream, kind, event["name"], start, start + float(event["dur"]),
                      args.get("bytes")))
    if not found:
        return []
    origin = min(f[3] for f in found)
    return sorted((Activity(s, k, n, b - origin, e - origin, nb) for s, k, n, b, e, nb in found),
                  key=lambda a: (a.start_us, a.stream))


def runtime_calls(trace: dict | list) -> collections.Counter:
    """How many times each CUDA runtime or driver function was called in a Chrome trace
    (``cudaMemcpyAsync``, ``cudaStreamSynchronize``, ...)."""
    return collections.Counter(e["name"] for e in _trace_events(trace)
                               if e.get("cat") in ("cuda_runtime", "cuda_driver")
                               and e.get("ph") == "X")


def profile_trace(fn: Callable[[], object], *, warmup: int = 1) -> dict:
    """Run ``fn`` under torch.profiler (host and CUDA activity), after ``warmup`` unprofiled
    calls, and return the Chrome trace as a dict. The device is synchronised after the call,
    so the trace holds all the work ``fn`` queued."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            # The profiler's first CUDA call costs it milliseconds of set-up; spend them here,
            # not inside the first operation of fn, which would look that slow on the host lane.
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def profile_all_threads(fn: Callable[[], object], *, warmup: int = 1) -> dict:
    """``profile_trace`` for every thread of the process: the Chrome trace of ``fn`` with the
    CPU work of each thread (a DataLoader's pin thread, say) under its own ``tid``, the thread's
    native id (``threading.get_native_id()``; on Linux also its entry in /proc/self/task, whose
    ``comm`` names a live thread reliably, unlike the trace's ``thread_name`` metadata, which may
    be read after a thread has ended). torch.profiler records only the calling thread unless told
    otherwise (torch >= 2.7 can; older versions raise RuntimeError here). Without CUDA only CPU
    activity is recorded.
    """
    from torch.profiler import ProfilerActivity, profile

    try:
        from torch._C._profiler import _ExperimentalConfig

        every_thread = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError) as error:
        raise RuntimeError("this torch's profiler records only the calling thread "
                           "(torch >= 2.7 can record every thread)") from error
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(warmup):
        fn()
    sync()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=activities, experimental_config=every_thread) as prof:
            sync()  # the profiler's CUDA set-up, spent before fn (as in profile_trace)
            fn()
            sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def profile_activities(fn: Callable[[], object], *, warmup: int = 1) -> list[Activity]:
    """Run ``fn`` under torch.profiler and return what the device did, per stream (and the
    host spans ``fn`` marked with ``record_function``)."""
    return parse_chrome_trace(profile_trace(fn, warmup=warmup))


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_fraction(activities: Sequence[Activity], copy_kinds: Sequence[str] = ("H2D", "D2H"),
                     ) -> float:
    """Share of copy time during which a kernel ran too: 0 = fully serial, 1 = fully hidden."""
    copies = _union((a.start_us, a.end_us) for a in activities if a.kind in copy_kinds)
    kernels = _union((a.start_us, a.end_us) for a in activities if a.kind == "kernel")
    copy_time = _length(copies)
    if copy_time == 0:
        raise ValueError(f"no copies of kinds {tuple(copy_kinds)} among the activities")
    return _intersection(copies, kernels) / copy_time


# Two kinds of copy in flight at once, and a kind's rate on the timeline (notebook 04)


def overlap_between(activities: Sequence[Activity], first: str = "H2D", second: str = "D2H",
                    ) -> float:
    """Share of the shorter of two kinds of activity (their union on the device) during which
    the other kind ran too: 1 = the shorter ran entirely alongside the other, 0 = one after the
    other. Two copies in opposite directions that overlap in time were in flight at once."""
    a = _union((x.start_us, x.end_us) for x in activities if x.kind == first)
    b = _union((x.start_us, x.end_us) for x in activities if x.kind == second)
    shorter = min(_length(a), _length(b))
    if shorter == 0:
        raise ValueError(f"the activities need both {first} and {second} work")
    return _intersection(a, b) / shorter


def copy_gbps(activities: Sequence[Activity], kind: str) -> float:
    """Bytes moved by the copies of ``kind`` ("H2D", "D2H", ...) over the time any of them was
    in flight (the union of their spans), in GB/s."""
    copies = [a for a in activities if a.kind == kind]
    busy_us = _length(_union((a.start_us, a.end_us) for a in copies))
    if busy_us == 0:
        raise ValueError(f"no {kind} copies among the activities")
    return sum(a.nbytes or 0 for a in copies) / (busy_us * 1e-6) / 1e9


KIND_COLORS = {"kernel": "#4C72B0", "H2D": "#DD8452", "D2H": "#55A868", "D2D": "#8172B3",
               "memset": "#937860", "host": "#A0A0A0"}


def stream_lane_id(stream: torch.cuda.Stream) -> int | None:
    """The id under which the profiler lists ``stream`` (the driver's cuStreamGetId), if known."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_ulonglong()
        if driver.cuStreamGetId(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(value)):
            return None
        return value.value
    except (OSError, AttributeError):
        return None


#: what a lane that nobody named holds, in words: one stream, named for its work (notebook 09)
LANE_WORDS = {"kernel": "kernels", "H2D": "H2D copies", "D2H": "D2H copies",
              "D2D": "D2D copies", "memset": "memsets"}
COPY_KINDS = ("H2D", "D2H", "D2D")


def lane_names(activities: Sequence[Activity], stream_names: dict | None = None) -> dict:
    """A label for each lane of ``activities``: the caller's name (``stream_names`` maps
    ``torch.cuda.Stream`` objects or profiler ids to labels), else what runs on it, since a
    profiler id ("stream 7") says nothing to a reader: "compute" for the stream with the most
    kernel time, and for another stream its two longest kinds of work, "H2D copies + kernels"
    say (notebooks 07, 09)."""
    names = {HOST_LANE: "host"}
    for key, label in (stream_names or {}).items():
        names[key if isinstance(key, int) else stream_lane_id(key)] = label
    time_of = collections.defaultdict(collections.Counter)
    for a in activities:
        if a.stream != HOST_LANE:
            time_of[a.stream][a.kind] += a.duration_us
    compute = max(time_of, key=lambda s: time_of[s]["kernel"], default=None)
    for stream, kinds in time_of.items():
        if stream in names:
            continue
        if stream == compute and kinds["kernel"] > 0:
            names[stream] = "compute"
        else:
            names[stream] = " + ".join(LANE_WORDS.get(k, k) for k, _ in kinds.most_common(2))
    return names


def _shade(color: str, lighter: float = 0.45) -> tuple:
    # lighter, not darker: a darker orange reads as the memsets' brown
    return tuple(c + (1 - c) * lighter for c in matplotlib.colors.to_rgb(color))


def _copy_turns(copies: Sequence[Activity]) -> list[int]:
    """0 or 1 for each copy of one lane, in time order: the shade it is drawn in. The shade
    changes at each large copy (a quarter of the longest or more), so that back-to-back batches
    alternate; a small copy (a batch's labels after its images) keeps the shade before it."""
    longest = max((a.duration_us for a in copies), default=0)
    turns, turn = [0] * len(copies), 1
    for i in sorted(range(len(copies)), key=lambda i: copies[i].start_us):
        if copies[i].duration_us >= 0.25 * longest:
            turn = 1 - turn
        turns[i] = turn
    return turns


def _label_host_spans(ax, activities: Sequence[Activity], row_of: dict, span_ms: float) -> None:
    """Name the host spans wide enough to hold their label, widest first, skipping any whose
    label would overlap one already written: the step's mark encloses next() and the release,
    and two labels centred on nested spans overprint."""
    written = collections.defaultdict(list)  # lane -> (start, end) of each label, in ms
    for a in sorted((a for a in activities if a.kind == "host"), key=lambda a: -a.duration_us):
        width = len(a.name) * 0.009 * span_ms  # a label's width at fontsize 8 in a 9-inch figure
        if a.duration_us / 1e3 < 1.2 * width:
            continue
        middle = (a.start_us + a.end_us) / 2e3
        extent = (middle - width / 2, middle + width / 2)
        if any(extent[0] < right and left < extent[1] for left, right in written[a.stream]):
            continue
        written[a.stream].append(extent)
        ax.text(middle, row_of[a.stream], a.name, ha="center", va="center", fontsize=8,
                clip_on=True)


def plot_timeline(activities: Sequence[Activity], *, title: str = "", ax=None,
                  stream_names: dict | None = None):
    """Draw one lane per stream, one coloured bar per activity. Returns the figure.

    Lanes are named by ``lane_names``. Bars are at least 0.2% of the time span wide, so that
    microsecond copies in a milliseconds-long timeline stay visible; copies alternate between
    two shades of their colour, so that back-to-back copies read as separate bars (one copy per
    batch, notebook 07), not one (notebooks 00, 07, 09).
    """
    if ax is None:
        lanes = len({a.stream for a in activities})
        _, ax = plt.subplots(figsize=(9, 0.7 + 0.55 * max(lanes, 1)))
    streams = sorted({a.stream for a in activities})
    names = lane_names(activities, stream_names)
    span_ms = max((a.end_us for a in activities), default=0) / 1e3
    for row, stream in enumerate(streams):
        for kind, color in KIND_COLORS.items():
            lane = [a for a in activities if a.stream == stream and a.kind == kind]
            turns = _copy_turns(lane) if kind in COPY_KINDS else [0] * len(lane)
            for turn, shade in enumerate((color, _shade(color))):
                spans = [(a.start_us / 1e3, max(a.duration_us / 1e3, 0.002 * span_ms))
                         for a, t in zip(lane, turns, strict=True) if t == turn]
                if spans:
                    ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=shade,
                                   edgecolor="none")
    _label_host_spans(ax, activities, {s: streams.index(s) for s in streams}, span_ms)
    ax.set_yticks(range(len(streams)), [names[s] for s in streams])
    ax.set_ylim(-0.6, len(streams) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time on the device (ms)")
    present = [k for k in KIND_COLORS if any(a.kind == k for a in activities)]
    ax.legend(handles=[matplotlib.patches.Patch(color=KIND_COLORS[k], label=k) for k in present],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    return ax.figure


def plot_timelines(panels: dict[str, Sequence[Activity]], *, stream_names: dict | None = None,
                   columns: int = 1, title: str = ""):
    """Several timelines on one time axis, one panel per entry (its key is the panel's title),
    so that their lengths compare at a glance. Returns the figure."""
    rows = -(-len(panels) // columns)
    lanes = max(len({a.stream for a in acts}) for acts in panels.values())
    fig, axes = plt.subplots(rows, columns, sharex=True, squeeze=False,
                             figsize=(9 if columns == 1 else 6 * columns,
                                      rows * (0.9 + 0.45 * lanes)))
    for index, (name, acts) in enumerate(panels.items()):
        ax = axes.flat[index]
        plot_timeline(acts, title=name, ax=ax, stream_names=stream_names)
        ax.title.set_fontweight("normal")
        if index < len(panels) - columns:  # the shared time axis is labelled once, at the bottom
            ax.set_xlabel("")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontweight="bold")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# 6. Figures
# --------------------------------------------------------------------------------------------

STYLE = {
    "figure.figsize": (7.5, 4.0), "figure.dpi": 100, "savefig.dpi": 110,
    "savefig.bbox": "tight", "font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold",
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
    "grid.alpha": 0.3, "legend.frameon": False,
    "axes.prop_cycle": matplotlib.cycler(color=["#4C72B0", "#DD8452", "#55A868", "#C44E52",
                                                "#8172B3", "#937860"]),
}
matplotlib.rcParams.update(STYLE)


def _ratio_to(value: float, reference: float, label: str) -> str:
    ratio = value / reference if reference else float("nan")
    if ratio == ratio and 0 < ratio < 0.5:  # "1/199 of", which a "0.005x" would hide
        return f"1/{1 / ratio:.0f} of {label}"
    return f"{ratio:.2f}x {label}"


def plot_timings(timings: dict[str, Timing | float], *, title: str = "", unit: str = "ms",
                 log: bool = True, reference: tuple[float, str] | None = None, ax=None,
                 ratios: bool = False):
    """Horizontal bars of medians with interquartile whiskers (plain floats: bars alone).

    ``reference`` draws a labelled vertical line, e.g. the device time everything is compared to;
    with ``ratios``, each bar's label also gives its median over the reference ("1/199 of device
    time"): on a log axis a 199x gap looks like a 20x one, so a figure whose point is the ratio
    takes ``log=False`` and the ratios written out (notebook 00).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 0.9 + 0.45 * len(timings)))
    names = list(timings)
    medians = [t.median_ms if isinstance(t, Timing) else float(t) for t in timings.values()]
    errors = [[t.median_ms - t.q1_ms if isinstance(t, Timing) else 0 for t in timings.values()],
              [t.q3_ms - t.median_ms if isinstance(t, Timing) else 0 for t in timings.values()]]
    ax.barh(names, medians, xerr=errors, color=[f"C{i % 6}" for i in range(len(names))],
            capsize=3)
    for row, (value, upper) in enumerate(zip(medians, errors[1], strict=True)):
        label = f" {value:.3g} {unit}"
        if ratios and reference is not None:
            label += f" ({_ratio_to(value, reference[0], reference[1].strip())})"
        ax.annotate(label, (value + upper, row), va="center", fontsize=9)
    if reference is not None:
        ax.axvline(reference[0], color="0.3", linestyle="--", linewidth=1, label=reference[1])
        ax.legend(loc="lower right")
    if log:
        ax.set_xscale("log")
    elif ratios:  # room on the right for the longest bar's label
        ax.set_xlim(0, 1.45 * max(m + u for m, u in zip(medians, errors[1], strict=True)))
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    ax.set_xlabel(f"time ({unit}{', log scale' if log else ''})")
    if title:
        ax.set_title(title)
    return ax.figure


def plot_sweep(sizes: Sequence[int], results: dict[str, list[Timing]], *, title: str = "",
               link_gbps: float | None = None, ax=None):
    """GB/s against transfer size (log-log), one line per kind of copy, shaded between the rates
    at the first and third quartile of the times; the link's theoretical rate dashed."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    for name, timings in results.items():
        pairs = list(zip(timings, sizes, strict=True))
        line, = ax.plot(sizes, [t.gbps(n) for t, n in pairs], marker="o", markersize=4,
                        label=name)
        ax.fill_between(sizes, [bandwidth_gbps(n, t.q3_ms) for t, n in pairs],
                        [bandwidth_gbps(n, t.q1_ms) for t, n in pairs],
                        color=line.get_color(), alpha=0.2, linewidth=0)
    if link_gbps:
        ax.axhline(link_gbps, color="0.3", linestyle="--", linewidth=1,
                   label=f"link limit, {link_gbps:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [n for n in sizes if sizes.index(n) % 2 == 0]
    ax.set_xticks(ticks, [format_bytes(n) for n in ticks])
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("GB/s (median; band: interquartile)")
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    return ax.figure


def format_transfer(name: str, timing: Timing | float, nbytes: int,
                    bounds_ms: dict[str, float] | None = None, *, width: int = 40) -> str:
    """One row of a table of transfers of ``nbytes``: the median time, the rate, and the time
    over each bound's time (``bounds_ms``: label to ms, a ceiling's say), where 1.00x is as
    fast as that bound allows and below 1 is faster than it."""
    median = timing.median_ms if isinstance(timing, Timing) else float(timing)
    row = f"{name:<{width}} {median:9.2f} ms {bandwidth_gbps(nbytes, median):7.2f} GB/s"
    return row + "".join(f"   {median / bound:5.2f}x {label}"
                         for label, bound in (bounds_ms or {}).items())


def save_figure(fig, name: str, directory: Path | None = None) -> None:
    """Save ``fig`` as ``figures/<name>.png``; no timestamp or version metadata, so it is
    byte-for-byte the same whenever the same data is drawn."""
    directory = FIGURES_DIR if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / f"{name}.png", format="png", metadata={"Software": None})


# --------------------------------------------------------------------------------------------
# 7. Results and claims
# --------------------------------------------------------------------------------------------

MEASUREMENTS: dict[str, dict] = {}


class ClaimFailed(AssertionError):
    """A claim the notebook makes did not hold on this machine; Jupyter shows one line."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def _emit(text: str, metadata: dict) -> None:
    """Show ``text``; in a notebook also store ``metadata`` with the output (nbval ignores it)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display({"text/plain": text}, raw=True, metadata={METADATA_KEY: metadata})
    else:
        print(text)


def record(key: str, value: float, unit: str, label: str, *, headline: bool = False) -> None:
    """Show a measured value and keep it, machine-readable, in the notebook's output metadata.

    ``headline`` values are the ones the README's table quotes for this notebook.
    """
    entry = {"key": key, "value": float(value), "unit": unit, "label": label,
             "headline": headline}
    MEASUREMENTS[key] = entry
    _emit(f"{label}: {format_value(value, unit)}", {"measurement": entry})


def format_value(value: float, unit: str) -> str:
    """3 significant digits (whole counts in full), the unit after a space ("x" without)."""
    number = f"{int(value):,}" if float(value).is_integer() and abs(value) >= 1000 \
        else f"{value:.3g}"
    return f"{number}{unit}" if unit in ("x", "") else f"{number} {unit}"


#: Set (to "skip") where notebooks run with no reader to type a guess: nbval under pytest and
#: ``nbtool.py run`` set it; a reader's Run all, without it, stops at the first empty guess.
GUESSES = "COLLECTION_GUESSES"


class GuessNeeded(Exception):
    """A prediction cell left empty: Jupyter shows this one line, and Run all stops here."""

    def _render_traceback_(self) -> list[str]:
        return [f"Predict first: {self}"]


def expect_guess(guess: float | None, name: str) -> None:
    """Stop here, in one line, until the reader has typed a guess into ``name`` (notebook 00
    first): Run all then stops at each prediction instead of answering it. Where no reader
    types (``COLLECTION_GUESSES=skip``), an empty guess passes."""
    if guess is None and os.environ.get(GUESSES) != "skip":
        raise GuessNeeded(f"type your guess into {name} above (replace None with a number), "
                          "then run this cell again")


def how_close(guess: float, value: float) -> str:
    """How far a guess was from the result, in words and numbers: the ratio where both are
    positive, else the difference."""
    if guess > 0 and value > 0:
        ratio = value / guess
        off = max(ratio, 1 / ratio)
        word = "close" if off <= 1.25 else "within a factor of two" if off <= 2 else \
            f"off by {off:.1f}x"
        return f"{word}: the result is {ratio:.2g}x your guess"
    return f"{value - guess:+.3g} from your guess"


def answer(key: str, guess: float | None = None, name: str = "my_guess") -> None:
    """One line for a result (notebook 00 first): the recorded value, beside it the reader's
    typed prediction (``name``) and how close it was."""
    measured = MEASUREMENTS[key]
    unit, value = measured["unit"], measured["value"]
    typed = (f"your guess {format_value(guess, unit)}, {how_close(guess, value)}"
             if guess is not None else f"no guess typed in {name}")
    print(f"Answer: {measured['label']}: {format_value(value, unit)} ({typed})")


OPERATORS = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__}


def claim_side(claim: dict, side: str, measurements: dict[str, dict]) -> float:
    """One side of a claim as a number: a recorded key's value, else the number the claim was
    given (kept as ``lhs_value``/``rhs_value`` where it was measured in place)."""
    given = claim[side]
    if isinstance(given, str):
        return float(measurements[given]["value"])
    return float(given if given is not None else claim[f"{side}_value"])


def evaluate_claim(claim: dict, measurements: dict[str, dict]) -> bool:
    """Whether ``lhs op factor * rhs`` holds (each side: a recorded key, or a number)."""
    lhs, rhs = (claim_side(claim, side, measurements) for side in ("lhs", "rhs"))
    return OPERATORS[claim["op"]](lhs, float(claim["factor"] * rhs))


#: Set (to "1") where a claim that fails must stop the notebook: ``nbtool.py run``, whose
#: outputs are committed. Elsewhere a failed claim is one line and the notebook goes on.
STRICT_CLAIMS = "COLLECTION_STRICT_CLAIMS"


def _this_machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU"
    return f"{gpu}, {usable_cpus()} usable CPUs"


def claim_entry(statement: str, lhs: str | float, op: str, rhs: str | float, factor: float,
                exact: bool) -> dict:
    """A claim as its output's metadata keeps it. A side given as a number, measured in place
    rather than recorded, is kept as ``lhs_value`` (the ``lhs`` itself is then None, so that
    runs group by the statement) or as the ``rhs`` number; ``exact`` marks a count, size or
    memory share, which no clock enters (tools/nbtool.py's margin bar is for timings)."""
    if op not in OPERATORS:
        raise ValueError(f"op must be one of {sorted(OPERATORS)}")
    entry = {"statement": statement, "lhs": lhs if isinstance(lhs, str) else None, "op": op,
             "rhs": rhs if isinstance(rhs, str) or rhs is None else float(rhs), "factor": factor}
    if not isinstance(lhs, str):  # None: a claim_where that does not apply measured nothing
        entry["lhs_value"] = None if lhs is None else float(lhs)
    if exact:
        entry["exact"] = True
    return entry


def claim(statement: str, lhs: str | float, op: str, rhs: str | float, *, factor: float = 1.0,
          exact: bool = False) -> None:
    """Check ``lhs op factor * rhs`` (notebook 00 first): each side a recorded key or a number
    measured in place, such as ``copies["pinned"].gbps(nbytes)``, so that a value no reader
    needs printed takes no ``record`` line.

    Claims are directions and ratios that should hold on any CUDA GPU. The line shown when one
    holds has no numbers in it, so nbval can compare it across machines. One that fails is
    shown in one line (what was expected, what was measured, on what machine) and the notebook
    goes on; nbval then sees other text, so CI still fails. With ``COLLECTION_STRICT_CLAIMS=1``
    (committed runs) it raises ``ClaimFailed`` and stops the notebook. ``exact``: a count, a
    size or a memory share rather than a time or a rate (see :func:`claim_entry`).
    """
    entry = claim_entry(statement, lhs, op, rhs, factor, exact)
    if evaluate_claim(entry, MEASUREMENTS):
        _emit(f"claim holds: {statement}", {"claim": entry})
        return
    lhs_value, rhs_value = (claim_side(entry, side, MEASUREMENTS) for side in ("lhs", "rhs"))
    named = f"{lhs} = {lhs_value:.4g}" if isinstance(lhs, str) else f"{lhs_value:.4g}"
    measured = f"{named}, {op} {factor:g} x {rhs_value:.4g} is false"
    if os.environ.get(STRICT_CLAIMS) == "1":
        raise ClaimFailed(f"'{statement}' does not hold here: {measured}")
    _emit(f"claim does not hold on this machine ({_this_machine()}): {statement}: {measured}; "
          "the committed run, on the GPU the README's table names, held it",
          {"claim": {**entry, "holds": False}})


#: How a claim that does not apply on this host starts its line. nbval's sanitizer
#: (tests/sanitize.cfg) maps it and "claim holds" to the same word, so that a checked cell prints
#: the same text on a host where the claim applies and on one where it does not.
NOT_TESTED = "claim not tested here"


def claim_where(statement: str, lhs: str | float, op: str, rhs: str | float, *, applies: bool,
                reason: str, factor: float = 1.0, exact: bool = False) -> None:
    """A claim that holds only on some hosts (NVLink, peer access, its own link to the host):
    checked like :func:`claim` where ``applies``, a failure stopping the notebook; elsewhere
    shown as not tested, with ``reason``, and not evaluated. The notebook needs no branch, and
    the reader sees which case this host is. ``reason`` (why it would not apply) is one line.
    """
    if not reason or "): " in reason or "\n" in reason:
        raise ValueError("a host-dependent claim needs a one-line reason without '): '")
    if applies:
        claim(statement, lhs, op, rhs, factor=factor, exact=exact)
        return
    entry = {**claim_entry(statement, lhs, op, rhs, factor, exact), "applies": False,
             "reason": reason}
    _emit(f"{NOT_TESTED} ({reason}): {statement}", {"claim": entry})


# --------------------------------------------------------------------------------------------
# 8. Batches: nested batches on a device, and a side-stream prefetcher
# --------------------------------------------------------------------------------------------


def map_tensors(fn: Callable[[torch.Tensor], object], batch):
    """Apply ``fn`` to every tensor in a nested batch (tuples, namedtuples, lists, dicts),
    keeping the containers' types; anything else is returned unchanged."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(fn, item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, item) for item in batch)
    if isinstance(batch, dict):
        mapped = {key: map_tensors(fn, value) for key, value in batch.items()}
        try:
            return type(batch)(mapped)
        except TypeError:  # a dict subclass whose constructor takes something else
            return mapped
    return batch


def to_device(batch, device: torch.device | str, non_blocking: bool = True):
    """Every tensor of a nested batch moved to ``device``."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


class Prefetcher:
    """Iterate over ``batches`` (any iterable of nested batches on the host) and get them on
    ``device``, each copied on a side stream while the caller works on the one before.

    For each batch: the copy (and ``transform``, if given, e.g. uint8 -> normalised float) is
    queued on ``self.stream``, one stream for the prefetcher's whole life (a stream per epoch
    strands memory in per-stream pools, notebook 04); an event recorded after it is waited on by
    the caller's current stream, so the caller's work never reads a batch before it lands.
    Batch k+1 is queued before batch k is handed over, so it copies while the caller's step k
    runs. Memory is protected one of two ways (``guard``):

    - ``"record_stream"``: each tensor is marked as used by the caller's stream, so the caching
      allocator does not reuse its block until the caller's work queued so far is done;
    - ``"wait_consumer"``: before each copy the side stream waits for the caller's queued
      work, so a block freed by the caller cannot be overwritten while still being read.

    Without CUDA (or for a CPU ``device``) batches are moved as they are asked for.
    """

    GUARDS = ("record_stream", "wait_consumer")

    def __init__(self, batches: Iterable, device: torch.device | str | None = None, *,
                 transform: Callable | None = None, guard: str = "record_stream"):
        if guard not in self.GUARDS:
            raise ValueError(f"guard must be one of {self.GUARDS}")
        self.batches = batches
        self.device = torch.device(device if device is not None else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self.transform = transform
        self.guard = guard
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def _load(self, batch):
        batch = to_device(batch, self.device, non_blocking=True)
        return self.transform(batch) if self.transform is not None else batch

    def __iter__(self):
        if self.stream is None:
            for batch in self.batches:
                yield self._load(batch)
            return
        consumer = torch.cuda.current_stream(self.device)
        source = iter(self.batches)

        def preload():
            batch = next(source, _END)
            if batch is _END:
                return None
            if self.guard == "wait_consumer":
                self.stream.wait_stream(consumer)
            with torch.cuda.stream(self.stream):
                batch = self._load(batch)
                ready = torch.cuda.Event()
                ready.record()
            return batch, ready

        pending = preload()
        while pending is not None:
            batch, ready = pending
            consumer.wait_event(ready)
            if self.guard == "record_stream":
                map_tensors(lambda t: t.record_stream(consumer), batch)
            pending = preload()  # batch k+1 starts copying before the caller queues step k
            yield batch


_END = object()


# Activations saved for backward, offloaded to pinned host memory on side streams (notebook 11)


def pinned_block_bytes(nbytes: int) -> int:
    """What PyTorch's caching host allocator pins for a request of ``nbytes`` (notebook 11): the
    next power of two, so that a freed block serves later requests of its size class (a 96 MiB
    buffer pins 128 MiB; pytorch/pytorch#150517 reports up to about twice the memory asked for)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


class PinnedPool:
    """Host buffers that activations travel through, reused from one step to the next.

    Buffers are flat and keyed by (element count, dtype), so any shape with that many elements
    fits one. ``take`` hands out a free buffer of the key, or allocates one (pinned, unless
    ``pin=False``), with its *fences*: the events recorded after the last copies that used it,
    which whoever writes it next must wait for. ``give`` takes a buffer back with its new fences.

    The pool holds at most ``max_bytes`` in all, counted as the host allocator pins them: a
    pinned buffer costs ``pinned_block_bytes`` of its size (a power of two), a pageable one its
    size. To allocate past that, it first drops free buffers of other keys, and if that is not
    enough it raises ``MemoryError``. ``asked_bytes`` is what its buffers hold; ``held_bytes``
    what they cost.
    """

    def __init__(self, max_bytes: int, *, pin: bool = True):
        import threading

        self.max_bytes, self.pin = max_bytes, pin
        self.held_bytes = 0  # the buffers in use and the free ones, as pinned
        self.asked_bytes = 0  # the same buffers, as asked for
        self.allocations = 0  # buffers allocated so far: a steady loop stops adding to it
        self._free: dict[tuple, list] = collections.defaultdict(list)
        self._lock = threading.Lock()  # buffers come back from autograd's backward thread

    def cost(self, numel: int, dtype: torch.dtype) -> int:
        """The host memory a buffer of ``numel`` elements of ``dtype`` takes."""
        nbytes = numel * dtype.itemsize
        return pinned_block_bytes(nbytes) if self.pin else nbytes

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self.cost(*key) * len(free) for key, free in self._free.items())

    def _drop_free(self, key: tuple) -> None:
        # A dropped pinned block is not handed out again before the copies recorded on it are
        # done: PyTorch's caching host allocator keeps their events.
        self._free[key].pop()
        self.held_bytes -= self.cost(*key)
        self.asked_bytes -= key[0] * key[1].itemsize

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, list]:
        key, nbytes, cost = (numel, dtype), numel * dtype.itemsize, self.cost(numel, dtype)
        with self._lock:
            if self._free[key]:
                return self._free[key].pop()
            while self.held_bytes + cost > self.max_bytes:
                other = next((k for k, free in self._free.items() if free), None)
                if other is None:
                    raise MemoryError(
                        f"the pinned pool holds {format_bytes(self.held_bytes)}, all in use, of "
                        f"at most {format_bytes(self.max_bytes)}: {format_bytes(cost)} more "
                        "do not fit; raise its max_bytes or offload fewer activations")
                self._drop_free(other)
            self.held_bytes += cost
            self.asked_bytes += nbytes
            self.allocations += 1
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=self.pin), []
        except BaseException:  # pinning failed: the pool does not hold what it counted
            with self._lock:
                self.held_bytes -= cost
                self.asked_bytes -= nbytes
                self.allocations -= 1
            raise

    def give(self, buffer: torch.Tensor, fences: list) -> None:
        with self._lock:
            self._free[(buffer.numel(), buffer.dtype)].append((buffer, list(fences)))

    def clear(self) -> None:
        """Drop the free buffers (call ``empty_pinned_cache`` after, to unpin them)."""
        with self._lock:
            for key in list(self._free):
                while self._free[key]:
                    self._drop_free(key)
            self._free.clear()


def _memory_of(tensor: torch.Tensor) -> tuple:
    """Where ``tensor``'s memory lives: the same for every tensor that shares it."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """Every byte of ``storage``, as a flat uint8 tensor that shares its memory."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _version_counter_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of no elements that shares ``tensor``'s version counter but not its memory: it
    reads the version of an offloaded activation without keeping that activation on the GPU."""
    counter = tensor.detach()  # shares the memory and the version counter
    counter.data = tensor.new_empty(0)  # set_data swaps the memory and keeps the counter
    return counter


def _check_not_written(saved) -> None:
    """Raise as autograd does when a tensor was written in place after it was saved: autograd
    skips that check for the tensors that saved_tensors_hooks pack."""
    now = saved.counter._version
    if now != saved.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{saved.dtype} {list(saved.shape)} on {saved.device}] is at "
            f"version {now}; expected version {saved.version} instead. (OffloadHooks checks "
            "this, since autograd does not for tensors that saved_tensors_hooks pack.)")


class _Kept:
    """What the pack hook saves for a tensor it leaves where it is."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()  # not the tensor itself: it may hold the graph that saves it
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.version, self.counter = tensor._version, self.tensor  # detach shares the counter


class _Offloaded:
    """One offloaded memory block (a tensor's whole storage), shared by every tensor saved as a
    view of it in one step: where its copy lives on the host, and how it comes back."""

    def __init__(self, index: int, step: int, storage: torch.UntypedStorage,
                 device: torch.device, host: torch.Tensor):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.index, self.step, self.device = index, step, device
        self.nbytes = storage.nbytes()
        self.memory = StorageWeakRef(storage)  # expired once the storage is freed
        self.host = host  # the pinned copy (uint8); valid once ``copied`` has completed
        self.copied = None  # event after the copy to the host, on the D2H stream
        self.fences: list = []  # events after which the host buffer may be written again
        self.gpu = None  # the storage's bytes, while the hooks still hold them
        self.stream = None  # the stream that produced it (the forward's)
        self.back = None  # the bytes brought back to the GPU
        self.arrived = None  # event after the copy back, on the H2D stream
        self.guard = None  # makes the asking stream wait for the copy back, if it never did


class _Saved:
    """What the pack hook saves for an offloaded tensor: its block, and the view of it."""

    def __init__(self, slot: _Offloaded, tensor: torch.Tensor):
        self.slot = slot
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.stride, self.offset = tensor.stride(), tensor.storage_offset()
        self.version, self.counter = tensor._version, _version_counter_of(tensor)

    def view_of(self, memory: torch.Tensor) -> torch.Tensor:
        """This tensor, laid out as it was saved, over ``memory`` (its block's bytes)."""
        return torch.empty(0, dtype=self.dtype, device=memory.device).set_(
            memory.untyped_storage(), self.offset, self.shape, self.stride)

    @property
    def host(self) -> torch.Tensor:
        """The tensor's pinned copy, as saved: valid once ``copied`` has completed."""
        return self.view_of(self.slot.host)

    @property
    def copied(self):
        """The event after the copy to the host."""
        return self.slot.copied


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Keep the activations autograd saves for backward in pinned host memory, copied there
    and back on side streams (notebook 11). A context manager around the forward (the backward
    may run inside the block or after it); one instance serves every step::

        hooks = helpers.OffloadHooks(module=model)
        with hooks.keep(x):  # or ``with hooks:``; x, named, stays where it is
            loss = model(x).square().mean()
        loss.backward()

    What travels is memory, not tensors: a saved tensor's whole storage (at least
    ``min_bytes``) is copied once a step, however many of its views are saved (``a`` and
    ``a.t()``; q, k and v sliced from one fused projection), and each view comes back as it was
    saved (its shape, strides and offset) over the storage brought back. A view keeps its whole
    storage alive without hooks too, so the storage is what offloading frees.

    Kept as they are (``keeps``): tensors on another kind of device; parameters
    (``torch.nn.Parameter``, trained or frozen) and views of them, and the parameters and
    registered buffers of ``module``, which stay on the GPU anyway; and the tensors the caller
    names with ``keep`` until the block ends, which it holds anyway, such as the input batch.
    A parameter cast to another dtype (autocast) is a new tensor, offloaded like an activation;
    a leaf that needs no gradient is not taken for the input, since a frozen layer's output is
    one too. A tensor on another GPU of the same kind travels on that GPU's own side streams.

    Forward: the storage is copied on the D2H stream into a buffer from ``pool`` (a
    ``PinnedPool`` of ``max_pinned_bytes``), after that stream has waited for the forward's
    stream (the op that wrote the tensor runs first) and for the buffer's fences. The hooks hold
    each offloaded storage until its copy is done, at most ``in_flight`` of them: past that, the
    forward's stream waits on the oldest copy's event and the hooks let go of it, so that its
    memory is reused only after the copy has read it.

    In-place writes: autograd does not check that a tensor saved through saved_tensors_hooks
    was left unchanged, so ``unpack`` does, and raises autograd's error for one written in place
    after it was saved (the copy queued to the host may have read the new values, or a mix).

    Backward: when autograd asks for a tensor, its storage and the ``prefetch`` offloaded before
    it (the next ones backward will ask for) are copied back on the H2D stream, into memory
    allocated on the asking stream, which the H2D stream waits for first (work queued there may
    still use that memory); the asking stream waits on the event after the copy, then frees the
    memory as its own. Where a storage brought back is never asked for (``autograd.grad`` on a
    middle tensor, an error mid-backward), a finalizer makes the asking stream wait for its copy
    before the memory goes back to that stream's pool. A storage the hooks still hold comes back
    as it is; when it goes, a finalizer makes the forward's stream wait for its pending copy
    out first. Neither holds memory on the host's side or uses ``record_stream``: a block marked
    so waits, once freed, for all the work queued on the side stream by then, and while the host
    runs ahead of the GPU that holds back many blocks (the reserved memory grows far past the
    allocated; notebook 11 measures both). A host buffer
    returns to the pool when autograd lets go of what the pack hook gave it, with the events of
    the copies that used it as its fences.

    ``retain_graph=True`` keeps what comes back on the GPU until the graph goes. The hooks
    cannot be captured in a CUDA graph (notebook 13): a replay would run none of their Python,
    neither the bookkeeping of what is held nor the waits they queue.
    """

    def __init__(self, device: torch.device | str = "cuda", *, max_pinned_bytes: int = 2**32,
                 in_flight: int = 3, prefetch: int = 3, min_bytes: int = 2**20,
                 pool: PinnedPool | None = None, module: torch.nn.Module | None = None):
        import weakref

        self.device = torch.device(device)
        self.in_flight, self.prefetch, self.min_bytes = in_flight, prefetch, min_bytes
        self.pool = pool if pool is not None else PinnedPool(max_pinned_bytes)
        self.module = module
        self._streams: dict = {}  # device: its (D2H, H2D) side streams
        self.d2h, self.h2d = self.side_streams(self.device)
        self.step = 0  # forwards begun; prefetching stays within one forward's activations
        self.offloaded_bytes = 0  # in this step
        self._held: collections.deque = collections.deque()  # offloaded, still held on the GPU
        self._by_index: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._by_memory: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._next_index = 0
        self._named: dict[tuple, torch.Tensor] = {}  # by memory: what keep named, this step
        self._module_memory: set = set()
        super().__init__(self.pack, self.unpack)

    def side_streams(self, device: torch.device) -> tuple:
        """The D2H and H2D side streams of ``device``, made on first use."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def __enter__(self):
        while self._held:  # left from a forward whose backward never asked for them
            self._let_go(self._held.popleft())
        self.step += 1
        self.offloaded_bytes = 0
        state = [] if self.module is None else [*self.module.parameters(), *self.module.buffers()]
        self._module_memory = {_memory_of(t) for t in state}  # buffers may be replaced
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._named.clear()  # the next step names its own batch
        super().__exit__(*exc)

    def keep(self, *tensors: torch.Tensor) -> OffloadHooks:
        """Name tensors that ``pack`` leaves where they are, with every tensor that shares their
        memory (a view, a detached alias), until the ``with`` block ends: what the caller holds
        anyway, such as the input batch. Returns the hooks, for ``with hooks.keep(batch):``."""
        for tensor in tensors:
            self._named[_memory_of(tensor)] = tensor  # held, so that no other takes its memory
        return self

    def keeps(self, tensor: torch.Tensor) -> bool:
        """Whether ``pack`` leaves ``tensor`` where it is rather than offload its storage."""
        base = tensor if tensor._base is None else tensor._base
        if (tensor.device.type != self.device.type or tensor.layout != torch.strided
                or isinstance(base, torch.nn.Parameter)):
            return True
        memory = _memory_of(tensor)
        return (tensor.untyped_storage().nbytes() < self.min_bytes
                or memory in self._module_memory or memory in self._named)

    def pack(self, tensor: torch.Tensor):
        if self.keeps(tensor):
            return _Kept(tensor)
        slot = self._by_memory.get(_memory_of(tensor))
        if (slot is None or slot.step != self.step or slot.memory.expired()
                or slot.nbytes != tensor.untyped_storage().nbytes()
                or slot.counter._version != slot.version or tensor._version != slot.version):
            slot = self._offload(tensor)  # not offloaded this step, or written since
        return _Saved(slot, tensor)

    def _offload(self, tensor: torch.Tensor) -> _Offloaded:
        """Queue the copy of ``tensor``'s storage to a pinned buffer; the block it fills."""
        import weakref

        storage, device = tensor.untyped_storage(), tensor.device
        stream, (d2h, _) = torch.cuda.current_stream(device), self.side_streams(device)
        buffer, fences = self.pool.take(storage.nbytes(), torch.uint8)
        slot = _Offloaded(self._next_index, self.step, storage, device, buffer)
        slot.version, slot.counter = tensor._version, _version_counter_of(tensor)
        # The buffer goes back to the pool when the slot goes, even if what follows raises; the
        # old fences stay with it until the new copy's event replaces them.
        slot.fences.extend(fences)
        weakref.finalize(slot, self.pool.give, buffer, slot.fences)
        self._next_index += 1
        d2h.wait_stream(stream)  # the op that wrote the tensor runs before the copy reads it
        for fence in fences:  # and the copies that last used the buffer end before it is written
            d2h.wait_event(fence)
        whole = _bytes_of(storage, device)
        with torch.cuda.stream(d2h):
            buffer.copy_(whole, non_blocking=True)
        slot.copied = d2h.record_event()
        slot.fences[:] = [slot.copied]  # it is queued after the old fences on the d2h stream
        slot.gpu, slot.stream = whole, stream
        self._held.append(slot)
        if len(self._held) > self.in_flight:
            self._let_go(self._held.popleft())
        self._by_index[slot.index] = self._by_memory[_memory_of(tensor)] = slot
        self.offloaded_bytes += slot.nbytes
        return slot

    def _let_go(self, slot: _Offloaded) -> None:
        # Work queued on the producing stream from now on, a reuse of the activation's memory
        # included, waits for its copy; then the hooks can drop it.
        slot.stream.wait_event(slot.copied)
        slot.gpu = None

    def _fetch(self, slot: _Offloaded, stream) -> None:
        _, h2d = self.side_streams(slot.device)
        slot.back = torch.empty(slot.nbytes, dtype=torch.uint8, device=slot.device)  # on stream
        h2d.wait_stream(stream)  # that memory may have been freed by work queued on stream
        h2d.wait_event(slot.copied)  # the host copy has landed
        with torch.cuda.stream(h2d):
            slot.back.copy_(slot.host, non_blocking=True)
        slot.arrived = h2d.record_event()
        slot.fences.append(slot.arrived)
        self._guard_until(slot, stream, slot.arrived)  # in case backward never asks for it

    @staticmethod
    def _guard_until(slot: _Offloaded, stream, event) -> None:
        """When ``slot`` goes, and with it (unless something else holds it) its memory, make
        ``stream``, whose pool that memory returns to, wait for ``event`` first: a later use of
        the memory from that pool is queued after the copy that ``event`` ends."""
        import weakref

        slot.guard = weakref.finalize(slot, stream.wait_event, event)

    def unpack(self, packed):
        _check_not_written(packed)
        if isinstance(packed, _Kept):
            return packed.tensor
        slot = packed.slot
        stream = torch.cuda.current_stream(slot.device)  # the stream backward runs this node on
        if slot.gpu is not None:  # never left the GPU; its copy out may still be reading it
            self._held.remove(slot)
            slot.back, slot.gpu = slot.gpu, None
            self._guard_until(slot, slot.stream, slot.copied)
        elif slot.back is None:
            self._fetch(slot, stream)
        for index in range(slot.index - 1, slot.index - 1 - self.prefetch, -1):
            earlier = self._by_index.get(index)
            if (earlier is not None and earlier.step == slot.step and earlier.gpu is None
                    and earlier.back is None):
                self._fetch(earlier, stream)
        if slot.arrived is not None:
            stream.wait_event(slot.arrived)  # the node reads it only once the copy has landed
            slot.guard.detach()  # the asking stream orders its own reuse of that memory now
        return packed.view_of(slot.back)


# --------------------------------------------------------------------------------------------
# 9. Check-up: what a training step spends on moving data
# --------------------------------------------------------------------------------------------

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
#: per kind of finding: what to change, and the notebooks that measure why
ADVICE = {
    "pageable_h2d": ("copy from pinned memory with non_blocking=True: DataLoader(pin_memory=True)"
                     ", or pin once what repeats", ("01", "03", "06")),
    "constant_h2d": ("make the tensor once, before the loop, or on the GPU (torch.full, "
                     "torch.arange): a tensor from a Python list is copied from pageable memory "
                     "and waits for the GPU", ("01", "03")),
    "blocking_h2d": ("the source is pinned but the copy waits: add non_blocking=True", ("03",)),
    "copy_exposed": ("copy batch k+1 on a side stream while step k computes "
                     "(helpers.Prefetcher)", ("04", "07")),
    "scalar_read": ("keep metrics on the GPU and read them every N steps through a pinned "
                    "buffer and an event, not .item() every step", ("05", "09")),
    "blocking_d2h": ("copy into pinned memory with non_blocking=True and wait on an event only "
                     "when the values are needed", ("05",)),
    "explicit_sync": ("drop the synchronisation from the step; time with CUDA events, and wait "
                      "on an event recorded steps earlier", ("00", "05")),
    "hidden_sync": ("an operation whose output size depends on the data waits for the GPU: "
                    "give it the size (e.g. bincount's minlength, repeat_interleave's "
                    "output_size) or move it off the hot path", ("00",)),
    "grad_scaler": ("GradScaler.step reads found_inf on the host every step: train in bfloat16 "
                    "without a scaler, or use a fused optimizer (fused=True), which checks on "
                    "the GPU", ("00",)),
    "nonfinite_check": ("error_if_nonfinite=True reads the norm on the host every step: check "
                        "it every N steps, or keep the check on the GPU", ("00", "05")),
    "data_wait": ("the loader does not keep up: more workers, compact (uint8) batches, "
                  "work moved to the GPU", ("06", "07")),
    "host_bound": ("the GPU waits for Python to launch kernels: fewer, larger operations, "
                   "CUDA graphs or torch.compile", ("00", "13")),
    "host_waits": ("remove every one of these waits: while one is left, the GPU runs dry at it "
                   "and the others cost little", ("05", "09")),
}
#: per kind of finding: who waits, and for what, in words (CheckupReport.summary)
WAITS_ON = {
    "pageable_h2d": "the host, for each copy from pageable memory to finish",
    "constant_h2d": "the host, for a tensor made from Python values to be copied",
    "blocking_h2d": "the host, for a pinned copy made without non_blocking=True",
    "copy_exposed": "the GPU, for the batch's copy: no kernel runs beside it",
    "scalar_read": "the host, for the GPU, at each .item()",
    "blocking_d2h": "the host, for a device-to-host copy",
    "explicit_sync": "the host, for the GPU, at a synchronize() call",
    "hidden_sync": "the host, for an operation whose output size depends on the data",
    "grad_scaler": "the host, for GradScaler's check of the gradients",
    "nonfinite_check": "the host, for the gradient norm's check",
    "data_wait": "the GPU, while the host takes the next batch and frees the last",
    "host_bound": "the GPU, for Python to launch its kernels",
    "host_waits": "the host, for the GPU, at each of",
}
#: data_wait where the batch source alone keeps ahead of the step: the wait is next()'s own
#: work on the step's thread (taking the batch from the workers), not the loader's pace
KEEPS_UP_ADVICE = ("the loader keeps up, but next() takes each batch from the workers on this "
                   "thread, and its shared memory is freed here after the step: "
                   "DataLoader(pin_memory=True) does both on its pin thread", ("06", "09"))
HANDOVER_ADVICE = ("the loader keeps up: what is left is next()'s own hand-over on this thread, "
                   "which the GPU stops waiting for once the host runs ahead of it (no wait for "
                   "the GPU every step)", ("05", "09"))
PER_STEP = 0.5  # a cause seen in at least every other step is part of the step
#: a finding saves at least this share of the step, or this many milliseconds
MIN_SAVING_SHARE, MIN_SAVING_MS = 0.03, 0.05
PACED_COPY_BYTES, SLOW_COPY_SHARE = 8 << 20, 0.8  # a copy the profiler slowed (_pace_slow_copies)
STEADY_RATIO = 1.25  # timed and profiled steps (or the first profiled step and the rest) agree
BACK_TO_BACK_US = 1.0  # a device op this close behind the one before it on its stream queued
CROSS_STREAM_US = 5.0  # a device op that starts this long after its launch and its stream
# allowed it waited for another stream (an event, cudaStreamWaitEvent)
LAUNCH_US = 5.0  # a launch's host time when the trace has no launch to measure it by
LINK_GBPS = 20.0  # pinned host-to-device rate, for a trace read alone with no pinned copy in it
HOST_AHEAD = 0.5  # latent costs are priced with the host's time at this share of the GPU's
LATER_RATIO = 1.5  # a latent cause costs at least this much more once the host keeps ahead


@dataclass(frozen=True)
class Finding:
    kind: str  # a key of ADVICE
    seen: str  # what was measured, per step
    cost_ms: float  # per step: the step time the replay saves without it (unprofiled pace)
    advice: str
    notebooks: tuple[str, ...]
    predicted_step_ms: float = float("nan")  # the step time the replay predicts without it

    def __str__(self) -> str:
        after = (f" -> about {self.predicted_step_ms:.3g} ms a step without it"
                 if self.predicted_step_ms == self.predicted_step_ms else "")
        return (f"{self.kind}, {self.cost_ms:.3g} ms a step{after}: {self.seen} -> "
                f"{self.advice} (notebook {', '.join(self.notebooks)})")


@dataclass(frozen=True)
class Latent:
    """A habit that costs (almost) nothing now because the host is the bottleneck, and what the
    replay says it would cost once the host's time were down to ``HOST_AHEAD`` of the GPU's."""

    kind: str  # a key of ADVICE
    seen: str
    cost_ms: float  # now, per step
    later_ms: float  # once the host is not the bottleneck, per step
    advice: str
    notebooks: tuple[str, ...]

    def __str__(self) -> str:
        return (f"{self.kind}: {self.seen}: free while the host is the bottleneck; about "
                f"{self.later_ms:.3g} ms a step once it is not -> {self.advice} "
                f"(notebook {', '.join(self.notebooks)})")


@dataclass
class CheckupReport:
    """What ``checkup`` saw; times per step in milliseconds, bytes per step."""

    steps: int
    step_ms: float  # unprofiled: CUDA events from the end of the first timed step to the last
    profiled_step_ms: float  # under the profiler: one step's period on the GPU
    gpu_busy: float  # kernel time of a step / the unprofiled step time
    h2d_pageable: tuple[float, float]  # (copies, bytes) per step
    h2d_pinned: tuple[float, float]
    d2h: tuple[float, float]
    syncs: dict[str, float]  # cause -> synchronisations per step, on every thread of the step
    host_wait_ms: float  # in them and in copies that block, per step
    data_wait_ms: float  # in next(batches) and releasing the batch after its step, per step
    #: cause -> the step time the replay saves without it, per step at the unprofiled pace
    #: (every cause seen, findings or not; "host_bound": with no host time outside waits)
    savings_ms: dict[str, float]
    loader_ms: float = float("nan")  # the batch source alone, per batch, at its steady pace
    findings: list[Finding] = field(default_factory=list)
    latent: list[Latent] = field(default_factory=list)
    replay_fidelity: float = float("nan")  # the replay's step, nothing removed / the trace's
    #: the replay's step with the host's time scaled to match ``step_ms`` as well as it can
    #: (the profiler slows the host only): far from ``step_ms``, the two runs differ
    replay_step_ms: float = float("nan")
    host_busy_ms: float = float("nan")  # host time outside waits, per step (unprofiled pace)
    gpu_work_ms: float = float("nan")  # device time (kernels, copies) per step
    short_kernels: float = float("nan")  # share of kernels shorter than their launch call
    launch_queue: float = float("nan")  # kernels launched and not begun, on average
    host_allocs_timed: float = float("nan")  # pinned blocks the host allocator made while timed
    #: large pinned copies the profiler slowed, replayed at the link's rate measured apart
    paced_copies: int = 0
    #: what free launches save once the host's waits are gone too: host_bound is named only where
    #: the host cannot keep ahead even then (not a GPU-bound step whose host time, as profiled,
    #: comes near the GPU's and whose waits make the gaps)
    host_bound_past_waits_ms: float = float("nan")
    #: the pinned copy rate, measured apart and unprofiled, at which the copies counted in
    #: ``paced_copies`` were replayed (nan: not measured)
    link_gbps: float = float("nan")
    #: the share of the profiled host time that matches the unprofiled step (0: the replay's
    #: device floor alone already takes the timed step's time)
    host_scale: float = float("nan")
    #: the causes that block the host, seen in every other step or more, when there are two or
    #: more, and what the replay saves with all of them removed at once: one wait can hide the
    #: next (the GPU is already idle when the second comes), so each alone saves less
    waits_together: tuple[str, ...] = ()
    waits_together_ms: float = 0.0
    profiled_periods_ms: list[float] = field(default_factory=list, repr=False)
    activities: list[Activity] = field(default_factory=list, repr=False)
    host_steps: list[tuple[float, float]] = field(default_factory=list, repr=False)
    gpu_steps: list[tuple[float, float]] = field(default_factory=list, repr=False)
    #: kinds -> the step time the replay saves without all of them (set by the analysis)
    what_if: Callable[[Iterable[str]], float] | None = field(default=None, repr=False,
                                                             compare=False)

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    @property
    def named_kinds(self) -> set[str]:
        """Every cause the findings name: their kinds, and the kinds a ``host_waits`` finding
        prices together (notebook 09)."""
        together = set(self.waits_together) if "host_waits" in self.kinds else set()
        return (self.kinds - {"host_waits"}) | together

    def saving_ms(self, *kinds: str) -> float:
        """What removing every cause of ``kinds`` at once saves a step, as the replay predicts
        (0 where none was seen). Several kinds are replayed together, not added: a change
        that removes two waits can save more than the two alone (notebook 09)."""
        if len(kinds) == 1 or self.what_if is None:
            return sum(self.savings_ms.get(kind, 0.0) for kind in kinds)
        return self.what_if(kinds)

    @property
    def steady(self) -> bool:
        """Whether the timed steps and the profiled ones agree, and the profiled ones with each
        other: the findings describe the step that was timed."""
        return not self.unsteady()

    def unsteady(self) -> list[str]:
        notes = []
        explained = (self.replay_step_ms if self.replay_step_ms == self.replay_step_ms
                     else self.profiled_step_ms)
        ratio = self.step_ms / explained if explained else float("nan")
        if ratio == ratio and not 1 / STEADY_RATIO <= ratio <= STEADY_RATIO:
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
        if self.host_allocs_timed == self.host_allocs_timed and self.host_allocs_timed > 0:
            notes.append(f"the host allocator pinned {self.host_allocs_timed:.0f} new blocks "
                         f"while the steps were timed: they were still warming up")
        return notes

    def rows(self) -> list[tuple[str, str]]:
        def copies(pair):
            return f"{pair[0]:.3g} ({format_bytes(pair[1])})"

        def per_cause(values, unit=""):
            ordered = sorted(values.items(), key=lambda kv: -kv[1])
            return ", ".join(f"{cause} {n:.3g}{unit}" for cause, n in ordered) or "0"

        rows = [("step time (unprofiled)", f"{self.step_ms:.3g} ms")]
        if self.loader_ms == self.loader_ms:
            rows.append(("the batch source alone, per batch", f"{self.loader_ms:.3g} ms"))
        return rows + [
            ("GPU busy (kernel time / step time)", f"{self.gpu_busy:.2f}"),
            ("host busy / GPU work, per step",
             f"{self.host_busy_ms:.3g} ms / {self.gpu_work_ms:.3g} ms"),
            ("kernels shorter than their launch",
             f"{self.short_kernels:.0%}" if self.short_kernels == self.short_kernels else "-"),
            ("launch queue (kernels waiting)", f"{self.launch_queue:.3g}"),
            ("replay / profiled step", f"{self.replay_fidelity:.3f}"),
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
        width = max(len(name) for name, _ in self.rows())
        lines = [f"per step, over {self.steps} profiled steps"]
        lines += [f"  {name:<{width}}  {value}" for name, value in self.rows()]
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
        if self.step_ms == self.step_ms:
            lines = [f"step: {self.step_ms:.3g} ms, timed; GPU busy {self.gpu_busy:.0%} of it "
                     f"(kernel time, profiled)"]
        else:
            lines = [f"step: {self.profiled_step_ms:.3g} ms, profiled"]
        step_ms = self.step_ms if self.step_ms == self.step_ms else self.profiled_step_ms
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
                      f"what to change: {top.advice} (notebook {', '.join(top.notebooks)})"]
            if len(self.findings) > 1:
                lines.append("also found: " + ", ".join(
                    f"{f.kind} (about {f.cost_ms:.2g} ms)" for f in self.findings[1:])
                    + ", estimated")
        if self.unsteady() or self.paced_copies:
            lines.append("the full report (print(report)) notes why these estimates may be off")
        return "\n".join(lines)

    def _waits_on(self, finding: Finding) -> str:
        if finding.kind == "host_waits":
            return (f"{WAITS_ON['host_waits']} {', '.join(self.waits_together)} (host_waits, "
                    f"priced together)")
        return f"{WAITS_ON[finding.kind]} ({finding.kind})"

    def step_window(self, first: int, count: int = 1) -> list[Activity]:
        """Profiled steps ``first`` to ``first + count - 1`` as the GPU ran them: the device
        work from the start of the first one's mark on the GPU to the start of the next, and
        on the host lane what the host ran meanwhile (often later steps: it runs ahead),
        clipped to that window; times from the window's start, ready for ``plot_timeline``."""
        spans = self.gpu_steps or self.host_steps
        begin = spans[first][0]
        end = spans[first + count][0] if first + count < len(spans) else spans[-1][1]
        return [replace(a, start_us=max(a.start_us, begin) - begin,
                        end_us=min(a.end_us, end) - begin)
                for a in self.activities
                if (begin <= a.start_us < end if a.kind != "host"
                    else a.start_us < end and a.end_us > begin)]

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


# Which call of the reader's code made the host wait: from the stack of the blocking call

#: frames of a comprehension: the call is named after the function around it
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def _is_library_frame(name: str) -> bool:
    if name.startswith(("<built-in", "<frozen ")):
        return True
    path = name.split("(")[0]
    stem = Path(path).stem
    return (path.startswith("torch/") or "/torch/" in path or "site-packages" in path
            or "dist-packages" in path or stem in ("helpers", "profiler")
            or stem in sys.stdlib_module_names)


def _callee_label(frame: str) -> str:
    if frame.startswith("<built-in method "):
        method, _, owner = frame[len("<built-in method "):].partition(" of ")
        return f".{method}()" if owner.startswith("Tensor") else f"torch.{method}()"
    if frame.startswith("<built-in function "):
        return frame[len("<built-in function "):].rstrip(">") + "()"
    path, _, function = frame.partition(": ")
    return f"{Path(path.split('(')[0]).stem}.{function}()"


@dataclass(frozen=True)
class _Blocking:
    kind: str  # a key of ADVICE
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
        return _Blocking("grad_scaler", "GradScaler.step()", where)
    if "clip_grad.py" in library:
        return _Blocking("nonfinite_check", "clip_grad_norm_(error_if_nonfinite=True)", where)
    outer = aten[0] if aten else None
    if outer is None:
        return _Blocking("explicit_sync", callee or "a synchronize()", where)
    if outer in ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"):
        label = callee if callee and frames else {"aten::is_nonzero": "bool(tensor)"}.get(
            outer, ".item()")
        return _Blocking("scalar_read", label, where)
    if outer in ("aten::to", "aten::_to_copy", "aten::copy_", "aten::cpu", "aten::contiguous",
                 "aten::clone"):
        if callee in ("torch.tensor()", "torch.as_tensor()", "torch.asarray()"):
            return _Blocking("constant_h2d", callee, where)
        kind = {"h2d_pageable": "pageable_h2d", "h2d_pinned": "blocking_h2d"}.get(
            copy_direction, "blocking_d2h")
        return _Blocking(kind, callee or outer, where)
    name = outer[len("aten::"):].lstrip("_").rstrip("0123456789")
    return _Blocking("hidden_sync", f"torch.{name}() ({outer})", where)


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


# The check-up in four stages: the trace -> the profiled steps (_read_profile, _blocking_causes)
# -> the step's dependency graph (_device_work, _host_lane, _link_device_work, _link_waits)
# -> a replay of the graph, as it ran and with each cause removed (_replay, _fixes)
# -> findings, costliest first (_savings, _findings, _latent).
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
# slows the host only. Like it, each kernel keeps its
# duration: a fix that keeps the GPU busy back to back can slow its kernels (fp16 GEMMs on an
# H100 took 8-12 % longer a step without a GradScaler's read), and saves less than predicted.


@dataclass
class _Profile:
    """The profiled steps as the trace gives them; times in microseconds."""

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
        return self.host_steps[0][0], self.host_steps[-1][1]


def _read_profile(trace: dict | list, steps: int) -> _Profile:
    events = [e for e in _trace_events(trace) if e.get("ph") == "X"]

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
_COPY_KIND = {"h2d_pageable": "pageable_h2d", "h2d_pinned": "blocking_h2d", "d2h": "blocking_d2h"}


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
        if call["name"] in MEMCPY_CALLS and cause.kind == "explicit_sync":
            cause = _Blocking(_COPY_KIND.get(direction, "blocking_d2h"), "a copy", cause.where)
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

    start_us: float  # as profiled
    own_us: float  # its own time; for a call that waits, the time it would take if it did not
    kind: str
    name: str = ""
    blocks: bool = False
    waits_for: int = -1  # the device op whose end it waits for
    after_us: float = 0.0  # from that end to its return (< 0: a pageable copy returns early)
    cause: _Blocking | None = None
    step: int = -1


@dataclass
class _DeviceOp:
    start_us: float  # as profiled
    dur_us: float
    stream: int
    kind: str  # an Activity kind: "kernel", "H2D", "D2H", "D2D", "memset"
    nbytes: int = 0
    pageable: bool = False
    step: int = -1  # the profiled step whose GPU mark holds it
    correlation: object = None
    launch: int = -1  # the host op that launched it (-1: none on the lane)
    launch_gap_us: float = 0.0  # from that launch's return (a blocking copy: its call) to start
    blocking_launch: bool = False  # its launch waits for it (a copy that blocks)
    follows: list[tuple[int, float]] = field(default_factory=list)  # (device op, gap after it)
    not_before_us: float = float("-inf")  # launched before the steps: starts no earlier
    position: int = -1  # host op after which the replay can place it (-1: at the start)
    cause: _Blocking | None = None


@dataclass
class _StepGraph:
    host: list[_HostOp]
    device: list[_DeviceOp]
    origin_us: float  # the first step's start on the host
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


def _step_of(profile: _Profile, start_us: float, launched_us: float | None) -> int:
    """The profiled step a device op belongs to: the GPU mark that holds its start, else the
    step whose host span holds its launch (a GPU mark holds only what the step's own thread
    launched under no inner annotation: autograd's thread and the optimizer's kernels fall
    outside it); -1 for neither."""
    for spans, at in ((profile.gpu_steps, start_us), (profile.host_steps, launched_us)):
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
        if op.correlation in profile.launch_of or op.start_us < begin:
            continue
        p = before[d]
        if p >= 0 and op.start_us - (ops[p].start_us + ops[p].dur_us) <= BACK_TO_BACK_US:
            continue
        at = op.start_us
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
    for kind, us in (("data", waiting), ("work", working), ("idle", b - a - waiting - working)):
        if us > 1e-9:
            lane.append(_HostOp(a, us, kind))
            a += us


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
    ends = sorted((op.start_us + op.dur_us, d) for d, op in enumerate(ops))
    for d, op in enumerate(ops):
        i = launch_index.get(d, -1)
        held: list[tuple[float, object]] = []  # (when it allowed the op to start, by what)
        if i >= 0:
            op.launch, op.position = i, i
            op.blocking_launch = lane[i].blocks and op.kind in ("H2D", "D2H")
            host = lane[i]
            held.append((host.start_us + (0.0 if op.blocking_launch else host.own_us), "launch"))
        elif d in queued:  # no launch in the trace, queued behind the op before it
            op.position = ops[before[d]].position
        else:  # launched before the steps, or by a thread off the lane
            op.not_before_us = op.start_us
            continue
        if before[d] >= 0:
            held.append((ops[before[d]].start_us + ops[before[d]].dur_us, before[d]))
        allowed = max(t for t, _ in held)
        if op.start_us - allowed > CROSS_STREAM_US:
            j = bisect.bisect_right(ends, (op.start_us, float("inf"))) - 1
            while j >= 0 and ends[j][0] > allowed:
                x = ops[ends[j][1]]
                if x.stream != op.stream and (x.position, x.start_us) < (op.position, op.start_us):
                    held.append(ends[j])
                    break
                j -= 1
        binding = max(held, key=lambda h: h[0])
        for t, by in held:
            gap = op.start_us - t if (t, by) == binding else 0.0
            if by == "launch":
                op.launch_gap_us = gap
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
                            if p == before[d] and 0 < gap <= CROSS_STREAM_US]
    typical = {stream: statistics.median(g) for stream, g in gaps.items() if g}
    for d, op in enumerate(ops):
        p = before[d]
        if p < 0 or op.stream not in typical:
            continue
        seen = op.start_us - (ops[p].start_us + ops[p].dur_us)
        op.follows = [(q, max(gap, min(typical[op.stream], seen)) if q == p else gap)
                      for q, gap in op.follows]


def _link_waits(lane: list[_HostOp], ops: list[_DeviceOp]) -> None:
    """What each blocking call waits for: a copy that blocks, for its copy; a synchronisation,
    for the device op launched before it that ended last while it waited (none if none did: it
    found the work done). Its own time becomes the time from that end to its return."""
    copy_of = {op.launch: d for d, op in enumerate(ops) if op.blocking_launch}
    ends = sorted((op.start_us + op.dur_us, d) for d, op in enumerate(ops))
    for i, host in enumerate(lane):
        if not host.blocks:
            continue
        returned = host.start_us + host.own_us
        waited = copy_of.get(i, -1)
        if waited < 0 and host.name in SYNC_CALLS:
            j = bisect.bisect_right(ends, (returned, float("inf"))) - 1
            while j >= 0 and ends[j][0] >= host.start_us and waited < 0:
                if ops[ends[j][1]].position < i:
                    waited = ends[j][1]
                j -= 1
        if waited < 0:
            continue
        op = ops[waited]
        host.waits_for, host.after_us = waited, returned - (op.start_us + op.dur_us)
        host.own_us = min(host.own_us, max(host.after_us, 0.0))


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
              and op.correlation not in profile.launch_of and op.start_us >= graph_origin}
    _link_device_work(ops, before, lane, launch_index, queued)
    for op in ops:
        if op.kind in ("H2D", "D2H"):
            launched = lane[op.launch].cause if op.launch >= 0 else None
            op.cause = cause_of_copy.get(op.correlation) or launched
    _link_waits(lane, ops)
    order = sorted(range(len(ops)), key=lambda d: (ops[d].position, ops[d].start_us))
    marks = [index[("mark", k)] for k in range(profile.steps)]
    return _StepGraph(lane, ops, graph_origin, profile.steps, marks, order)


# The replay: a small discrete-event model of the graph

@dataclass
class _Change:
    """A fix, as the graph sees it."""

    host_us: dict[int, float] = field(default_factory=dict)  # host op -> its own time
    device_us: dict[int, float] = field(default_factory=dict)  # device op -> its duration
    no_wait: set[int] = field(default_factory=set)  # host ops that no longer wait
    host_scale: float = 1.0  # of every host op's own time but the waits for data

    def __or__(self, other: _Change) -> _Change:
        return _Change({**self.host_us, **other.host_us}, {**self.device_us, **other.device_us},
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
    own = [change.host_us.get(i, op.own_us)
           * (1.0 if op.kind in ("data", "idle") else change.host_scale)
           for i, op in enumerate(host)]
    duration = [change.device_us.get(d, op.dur_us) for d, op in enumerate(device)]
    host_start, dev_start, dev_end = [0.0] * len(host), [0.0] * len(device), [0.0] * len(device)

    def place(d):
        op = device[d]
        ready = op.not_before_us
        if op.launch >= 0:
            began = host_start[op.launch]
            returned = began + (0.0 if op.blocking_launch else own[op.launch])
            ready = max(ready, began, returned + op.launch_gap_us)
        for p, gap in op.follows:
            ready = max(ready, dev_end[p] + gap)
        dev_start[d], dev_end[d] = ready, ready + duration[d]

    placed = graph.placed_after()
    for d in placed.get(-1, ()):
        place(d)
    t = graph.origin_us
    for i, op in enumerate(host):
        host_start[i] = t
        for d in placed.get(i, ()):
            place(d)
        end = t + own[i]
        if op.waits_for >= 0 and i not in change.no_wait:
            end = max(end, dev_end[op.waits_for] + op.after_us)
        t = end
    return host_start, dev_start, dev_end


def _period_us(graph: _StepGraph, host_start, dev_start, dev_end) -> float:
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
        return (marks[-2] - marks[0]) / (graph.steps - 1) if graph.steps > 1 else marks[-1]
    if graph.steps > 1:
        return (lasts[-1] - lasts[0]) / (graph.steps - 1)
    return lasts[0] - first


def _profiled_period(graph: _StepGraph) -> float:
    """``_period_us`` of the steps as they ran."""
    return _period_us(graph, [op.start_us for op in graph.host],
                      [op.start_us for op in graph.device],
                      [op.start_us + op.dur_us for op in graph.device])


def _replay_period(graph: _StepGraph, change: _Change | None = None) -> float:
    return _period_us(graph, *_replay(graph, change))


def _scale_data_waits(graph: _StepGraph, factor: float) -> None:
    """The host's time in next(batches) times ``factor``: the unprofiled over the profiled."""
    for op in graph.host:
        if op.kind == "data":
            op.own_us *= factor


def _calibrate(graph: _StepGraph, step_us: float) -> float:
    """The scale of host time at which the replay runs at ``step_us`` a step (the unprofiled
    pace): the profiler slows the host (its bookkeeping, Python stacks) but not the GPU. 1 when
    the unprofiled step is no faster than the profiled one (the replay cannot explain more)."""
    if step_us != step_us or _replay_period(graph) <= step_us:
        return 1.0
    if _replay_period(graph, _Change(host_scale=0.0)) >= step_us:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(24):  # the period grows with the host's time: halve the interval
        middle = (low + high) / 2
        if _replay_period(graph, _Change(host_scale=middle)) > step_us:
            high = middle
        else:
            low = middle
    return (low + high) / 2


# Each cause's fix, and what the replay says it saves

def _cause_key(cause: _Blocking) -> tuple[str, str, str]:
    return cause.kind, cause.label, cause.where


def _launch_us(graph: _StepGraph) -> float:
    """What a launch costs the host in this trace: its median launch call."""
    times = [op.own_us for op in graph.host if op.name in LAUNCH_CALLS]
    return statistics.median(times) if times else LAUNCH_US


def _pace_slow_copies(graph: _StepGraph, link_gbps: float) -> int:
    """Pinned host-to-device copies of at least PACED_COPY_BYTES that ran under
    SLOW_COPY_SHARE of ``link_gbps`` (measured apart, unprofiled) with no other such copy beside
    them take the time the link's rate gives: the profiler can slow a copy (once in 13 runs of
    the exposed-copy ablation on the H100: 31 GB/s against 54), and the replay would price the
    slowness as the copy's. Returns how many were paced."""
    copies = sorted((op for op in graph.device if op.kind == "H2D" and not op.pageable),
                    key=lambda op: op.start_us)
    paced = 0
    for i, op in enumerate(copies):
        alone = all(other.start_us >= op.start_us + op.dur_us
                    or other.start_us + other.dur_us <= op.start_us
                    for other in copies[max(i - 1, 0):i] + copies[i + 1:i + 2])
        link_us = op.nbytes / (link_gbps * 1e3)
        if alone and op.nbytes >= PACED_COPY_BYTES and link_us < SLOW_COPY_SHARE * op.dur_us:
            op.dur_us = link_us
            paced += 1
    return paced


def _link_rate(graph: _StepGraph, link_gbps: float) -> float:
    """Bytes per microsecond of a pinned host-to-device copy: measured on those in the trace."""
    pinned = [op for op in graph.device
              if op.kind == "H2D" and not op.pageable and op.nbytes and op.dur_us > 0]
    if pinned:
        return sum(op.nbytes for op in pinned) / sum(op.dur_us for op in pinned)
    return link_gbps * 1e3


def _fixes(graph: _StepGraph, launch_us: float, bytes_per_us: float) -> dict[tuple, _Change]:
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
            launched = op.name in MEMCPY_CALLS and op.cause.kind != "constant_h2d"
            fix.host_us[i] = launch_us if launched else 0.0
    for d, op in enumerate(graph.device):
        if op.cause is None or op.kind != "H2D":
            continue
        if op.cause.kind == "constant_h2d":
            fixes[_cause_key(op.cause)].device_us[d] = 0.0
        elif op.cause.kind == "pageable_h2d" and op.pageable and op.nbytes:
            fixes[_cause_key(op.cause)].device_us[d] = op.nbytes / bytes_per_us
    fixes[("copy_exposed", "", "")] = _Change(device_us={
        d: 0.0 for d, op in enumerate(graph.device)
        if op.kind == "H2D" and not op.pageable and not op.blocking_launch})
    fixes[("data_wait", "", "")] = _Change(host_us={
        i: 0.0 for i, op in enumerate(graph.host) if op.kind == "data"})
    fixes[("host_bound", "", "")] = _Change(host_scale=0.0)
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
    return max(_replay_period(graph, paced) - _replay_period(graph, change), 0.0) / 1e3


def _savings(graph: _StepGraph, fixes: dict[tuple, _Change], scale: float) -> dict[tuple, float]:
    """Per cause, the step time (us) the replay saves without it, host time at ``scale``."""
    paced = _Change(host_scale=scale)
    base = _replay_period(graph, paced)
    return {key: base - _replay_period(graph, fix | paced) for key, fix in fixes.items()}


def _launch_evidence(graph: _StepGraph) -> tuple[float, float, float, float]:
    """The signs Holistic Trace Analysis reads for a step bound by its launches ("CUDA kernel
    launch statistics", "queue length"): the share of kernels shorter than their launch call,
    the mean number of kernels launched and not yet begun; and, per step as profiled, the host's
    time outside waits and the device's time (kernels and copies, overlaps once). A graph's
    kernels share one launch call, so only kernels launched one by one count for the first two
    (none: not a number)."""
    kernels = [op for op in graph.device if op.kind == "kernel" and op.launch >= 0
               and graph.host[op.launch].name in LAUNCH_CALLS]
    short = (sum(op.dur_us < graph.host[op.launch].own_us for op in kernels) / len(kernels)
             if kernels else float("nan"))
    queued = sum(max(op.start_us - graph.host[op.launch].start_us
                     - graph.host[op.launch].own_us, 0.0) for op in kernels)
    ran = [(op.start_us, op.start_us + op.dur_us) for op in graph.device
           if op.step >= 0 or op.not_before_us == float("-inf")]
    span = max([e for _, e in ran] + [graph.host[-1].start_us + graph.host[-1].own_us])
    queue = queued / (span - graph.origin_us) if span > graph.origin_us else 0.0
    host_us = sum(op.own_us for op in graph.host if op.kind not in ("data", "idle")) / graph.steps
    return short, queue, host_us, _length(_union(ran)) / graph.steps


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


# Findings: what the trace measured, and what the replay says each cause costs

def _measured(profile: _Profile, cause_of_call: dict, step_ms: float, loader_ms: float,
              trace: dict | list) -> CheckupReport:
    """The report's measured part: copies, synchronisations and waits per step, the profiled
    period, and how busy the GPU's kernels kept it."""
    steps = profile.steps
    marks = profile.gpu_steps or profile.host_steps
    periods = max(steps - 1, 1)
    window = (marks[0][0], marks[-1][0] if steps > 1 else marks[0][1])
    begin = profile.host_range[0]
    totals = collections.defaultdict(lambda: [0, 0])
    busy = []
    for e in profile.device:
        kind = _activity_kind(e["cat"], e["name"])
        if kind not in ("H2D", "D2H"):
            busy.append((e["ts"], e["ts"] + e["dur"]))  # kernels, memsets, device copies
        elif e["ts"] >= begin:
            key = profile.direction[e.get("args", {}).get("correlation")][0]
            totals[key][0] += 1
            totals[key][1] += e.get("args", {}).get("bytes", 0) or 0
    blocking = [c for c in profile.calls if id(c) in cause_of_call]
    syncs = collections.Counter(cause_of_call[id(c)].kind for c in blocking
                                if c["name"] in SYNC_CALLS)
    period_us = (window[1] - window[0]) / periods
    reference_ms = step_ms if step_ms == step_ms else period_us / 1e3
    busy_ms = _intersection(_union(busy), [window]) / periods / 1e3
    report = CheckupReport(
        steps=steps, step_ms=step_ms, profiled_step_ms=period_us / 1e3,
        gpu_busy=min(busy_ms / reference_ms, 1.0) if reference_ms else 0.0,
        h2d_pageable=tuple(v / steps for v in totals["h2d_pageable"]),
        h2d_pinned=tuple(v / steps for v in totals["h2d_pinned"]),
        d2h=tuple(v / steps for v in totals["d2h"]),
        syncs={kind: n / steps for kind, n in syncs.items()},
        host_wait_ms=sum(c["dur"] for c in blocking) / steps / 1e3,
        data_wait_ms=_length(_union(profile.data_waits)) / steps / 1e3,
        savings_ms={}, loader_ms=loader_ms,
        profiled_periods_ms=[(marks[k + 1][0] - marks[k][0]) / 1e3 for k in range(steps - 1)],
        activities=[a for a in parse_chrome_trace(trace)
                    if not a.name.startswith("ProfilerStep#")])
    origin = _trace_origin(trace)
    report.host_steps = [(s - origin, e - origin) for s, e in profile.host_steps]
    report.gpu_steps = [(s - origin, e - origin) for s, e in profile.gpu_steps]
    return report


def _findings(report: CheckupReport, per_cause: dict, savings_us: dict, reference_ms: float):
    """A finding per cause seen in at least every other step whose fix saves at least
    MIN_SAVING_SHARE of the step and MIN_SAVING_MS; ``host_bound`` only where the host's time
    outside waits is at least the GPU's and, with its waits gone, free launches still save that
    much (the host cannot keep ahead). Costliest first: a slow
    loader can cost more than the host's own time, and both be findings. Returns the findings
    and the causes seen in every other step that save too little (candidates for ``latent``)."""
    floor = max(MIN_SAVING_SHARE * reference_ms, MIN_SAVING_MS)
    findings, small = [], []
    for key, us in savings_us.items():
        kind, label, where = key
        calls, seen = per_cause.get(key, (0.0, report.steps))
        if seen < PER_STEP * report.steps:
            continue
        if kind == "host_bound" and not (report.host_busy_ms >= report.gpu_work_ms
                                         and not report.host_bound_past_waits_ms < floor):
            continue
        if us / 1e3 < floor or us <= 0:
            if key in per_cause:
                small.append(key)
            continue
        advice, notebooks = _advice(kind, report, reference_ms)
        findings.append(Finding(kind, _seen(kind, label, where, calls, report), us / 1e3,
                                advice, notebooks, reference_ms - us / 1e3))
    findings.sort(key=lambda f: -f.cost_ms)
    return findings, small


def _waits_finding(report: CheckupReport, reference_ms: float) -> Finding | None:
    """``host_waits``: the host's waits of several kinds, priced together, where that saves a
    finding's worth more than the best of them alone (a wait that the next one hides costs
    little by itself, and a fix of one kind alone leaves the GPU idle at the next)."""
    floor = max(MIN_SAVING_SHARE * reference_ms, MIN_SAVING_MS)
    alone = {kind: report.saving_ms(kind) for kind in report.waits_together}
    if not alone or report.waits_together_ms < max(alone.values()) + floor:
        return None
    seen = (f"{', '.join(report.waits_together)} together (alone: "
            + ", ".join(f"{kind} {ms:.3g} ms" for kind, ms in alone.items()) + ")")
    advice, notebooks = ADVICE["host_waits"]
    return Finding("host_waits", seen, report.waits_together_ms, advice, notebooks,
                   reference_ms - report.waits_together_ms)


def _latent(report: CheckupReport, graph: _StepGraph, fixes: dict, keys: list, scale: float,
            per_cause: dict, savings_us: dict, reference_ms: float) -> list[Latent]:
    """The causes that cost too little now to be findings but would cost once the host keeps
    ahead: the replay with the host's time outside waits scaled to HOST_AHEAD of the GPU's,
    with each fix and without. (With no host time at all a synchronisation would cost only its
    return: the price is taken where the host has just stopped being the bottleneck.)"""
    host_us, gpu_us = report.host_busy_ms * 1e3, report.gpu_work_ms * 1e3
    ahead = scale * min(1.0, HOST_AHEAD * gpu_us / host_us) if host_us > 0 else scale
    floor = MIN_SAVING_MS  # the step it would be part of is shorter than this one
    later = _savings(graph, {key: fixes[key] for key in keys}, ahead)
    found = []
    for key in keys:
        if later[key] / 1e3 < floor:
            continue  # free now and later: a wait on an event recorded steps ago, say
        if later[key] < LATER_RATIO * max(savings_us[key], 0.0):
            continue  # small now and later alike: not hidden by the host (host_waits, maybe)
        kind, label, where = key
        advice, notebooks = _advice(kind, report, reference_ms)
        found.append(Latent(kind, _seen(kind, label, where, per_cause[key][0], report),
                            max(savings_us[key], 0.0) / 1e3, later[key] / 1e3, advice,
                            notebooks))
    return sorted(found, key=lambda f: -f.later_ms)


def _advice(kind: str, report: CheckupReport, reference_ms: float) -> tuple[str, tuple]:
    """What to change for ``kind``: for ``data_wait``, where the source alone takes less than
    the rest of the step (it keeps up), the wait is not the loader's pace but next()'s own work:
    with pageable batches (no pin thread), taking them from the workers and freeing them here;
    with pinned ones, the hand-over, which costs the GPU only while the host waits for it."""
    keeps_up = report.loader_ms < reference_ms - report.data_wait_ms
    if kind == "data_wait" and keeps_up:
        return KEEPS_UP_ADVICE if report.h2d_pageable[0] > 0 else HANDOVER_ADVICE
    return ADVICE[kind]


def _seen(kind, label, where, per_step, report) -> str:
    if kind == "copy_exposed":
        n, nbytes = report.h2d_pinned
        return (f"{n:.3g} pinned H2D copies ({format_bytes(nbytes)}) a step with no kernel "
                f"beside them")
    if kind == "data_wait":
        source = (f"; the batch source alone takes {report.loader_ms:.3g} ms a batch"
                  if report.loader_ms == report.loader_ms else "")
        return (f"the host spends {report.data_wait_ms:.3g} ms a step taking the next batch and "
                f"freeing the last{source}")
    if kind == "host_bound":
        return (f"the host is busy {report.host_busy_ms:.3g} ms a step outside waits, the GPU "
                f"{report.gpu_work_ms:.3g} ms; {report.short_kernels:.0%} of kernels are "
                f"shorter than their launch, {report.launch_queue:.2g} wait queued on average")
    return f"{label} {where}, {per_step:.3g} a step, blocks the host"


def analyze_checkup_trace(trace: dict | list, steps: int, step_ms: float = float("nan"),
                          loader_ms: float = float("nan"), *,
                          link_gbps: float = float("nan"),
                          next_ms: float = float("nan")) -> CheckupReport:
    """Read a Chrome trace of ``steps`` steps, each marked with ``record_function(STEP_MARK)``
    (the wait for its batch with ``NEXT_MARK``, the batch's release after it with
    ``RELEASE_MARK``), into a ``CheckupReport``.

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
    profile = _read_profile(trace, steps)
    cause_of_call, cause_of_copy = _blocking_causes(profile)
    graph = _step_graph(profile, cause_of_call, cause_of_copy)
    report = _measured(profile, cause_of_call, step_ms, loader_ms, trace)
    if _profiled_period(graph) > 0:
        report.replay_fidelity = _replay_period(graph) / _profiled_period(graph)
    if next_ms == next_ms and report.data_wait_ms > 0:
        _scale_data_waits(graph, next_ms / report.data_wait_ms)
        report.data_wait_ms = next_ms
    if link_gbps == link_gbps:
        report.link_gbps = link_gbps
        report.paced_copies = _pace_slow_copies(graph, link_gbps)
    scale = report.host_scale = _calibrate(graph, step_ms * 1e3)
    report.replay_step_ms = _replay_period(graph, _Change(host_scale=scale)) / 1e3
    short, queue, host_us, device_us = _launch_evidence(graph)
    report.short_kernels, report.launch_queue = short, queue
    report.host_busy_ms, report.gpu_work_ms = host_us * scale / 1e3, device_us / 1e3
    fixes = _fixes(graph, _launch_us(graph),
                   _link_rate(graph, link_gbps if link_gbps == link_gbps else LINK_GBPS))
    savings = _savings(graph, fixes, scale)
    report.what_if = functools.partial(_saving_without, graph, fixes, scale)
    no_waits = {key[0] for key, fix in fixes.items() if fix.no_wait}
    report.host_bound_past_waits_ms = (report.what_if(no_waits | {"host_bound"})
                                       - report.what_if(no_waits))
    by_kind = {kind: report.what_if({kind}) for kind in {key[0] for key in fixes}}
    report.savings_ms = {kind: round(ms, 6) for kind, ms in by_kind.items() if ms >= 5e-4}
    reference_ms = step_ms if step_ms == step_ms else report.profiled_step_ms
    per_cause = _calls_per_cause(graph)
    waits = sorted({key[0] for key, fix in fixes.items() if fix.no_wait
                    and per_cause.get(key, (0.0, 0))[1] >= PER_STEP * steps})
    if len(waits) >= 2:
        report.waits_together = tuple(waits)
        report.waits_together_ms = round(report.what_if(waits), 6)
    report.findings, small = _findings(report, per_cause, savings, reference_ms)
    together = _waits_finding(report, reference_ms)
    if together is not None:
        report.findings = sorted(report.findings + [together], key=lambda f: -f.cost_ms)
    report.latent = _latent(report, graph, fixes, small, scale, per_cause, savings,
                            reference_ms)
    return report


def _trace_origin(trace: dict | list) -> float:
    """The time ``parse_chrome_trace`` counts from."""
    return min((float(e["ts"]) for e in _trace_events(trace) if e.get("ph") == "X"
                and _activity_kind(e.get("cat", ""), e.get("name", "")) is not None),
               default=0.0)


def _buffered_batches(batches) -> int:
    """How many batches a DataLoader's workers may hold ready: 0 for other sources; a wrapper
    that keeps its source as ``.batches`` (``Prefetcher``) is looked through."""
    loader = getattr(batches, "batches", batches)
    workers = getattr(loader, "num_workers", 0) or 0
    return workers * (getattr(loader, "prefetch_factor", None) or 2)


def checkup_batches(workers: int = 0, prefetch_factor: int = 2, *, steps: int = 10,
                    timed_steps: int = 20, warmup: int = 5, loader_batches: int = 10) -> int:
    """How many batches ``checkup`` takes from a loader with ``workers`` workers (0 for any
    other source) and these settings (the batches the workers hold ready count twice: taken
    before the source is timed alone, and stepped through again after it)."""
    return (warmup + 2 * workers * prefetch_factor + loader_batches + timed_steps + 1 + steps)


@cache
def _pinned_link_gbps(nbytes: int = 16 * 2**20) -> float:
    """The link's rate from page-locked memory to the device (GB/s), measured once a process:
    the median of 10 copies of ``nbytes``, what a pageable copy would run at once pinned (the
    replay's price for it where the trace has no pinned copy). The buffer is page-locked with
    cudaHostRegister, not taken from PyTorch's caching host allocator, so the pinned memory
    cached after a check-up is the step's own (notebook 09 reports it)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    try:
        target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        timing = time_cuda(lambda: target.copy_(host, non_blocking=True), warmup=2, repeat=10)
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.data_ptr())
    return timing.gbps(nbytes)


def _host_allocs() -> float:
    """Pinned blocks the caching host allocator has made so far (nan where it cannot say)."""
    try:
        return float(torch.cuda.host_memory_stats().get("num_host_alloc", float("nan")))
    except (AttributeError, RuntimeError):
        return float("nan")


def _warm_up(one_step: Callable[[], None], steps: int, more: int) -> None:
    """``steps`` steps, then up to ``more`` while the caching host allocator still pins new
    blocks (a host running ahead of the GPU needs more pinned buffers in flight)."""
    for _ in range(steps):
        one_step()
    for _ in range(more):
        before = _host_allocs()
        one_step()
        if not _host_allocs() > before:
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
              next_s: list[float]) -> tuple[float, float, float]:
    """The unprofiled step, from CUDA events on the current stream: the time per step from the
    end of the first step, which the GPU starts only after the host, to the end of the last;
    the host's time in next() and the batch's release per step (``next_s`` accumulates it); and
    the pinned blocks the host allocator made meanwhile (a host that runs ahead may have new
    buffers pinned in the timed steps: not yet steady)."""
    torch.cuda.synchronize()
    allocs, waited = _host_allocs(), next_s[0]
    one_step()
    first = _recorded_event()
    for _ in range(timed_steps - 1):
        one_step()
    last = _recorded_event()
    torch.cuda.synchronize()
    step_ms = first.elapsed_time(last) / (timed_steps - 1) if timed_steps > 1 else float("nan")
    next_ms = (next_s[0] - waited) * 1e3 / max(timed_steps, 1)
    return step_ms, next_ms, _host_allocs() - allocs


def _recorded_event() -> torch.cuda.Event:
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


def checkup(step: Callable, batches: Iterable | None = None, *, steps: int = 10,
            timed_steps: int = 20, warmup: int = 5, loader_batches: int = 10) -> CheckupReport:
    """Time and profile a training step, and say what it spends on moving data.

    ``step(batch)`` is called with batches from ``batches`` (``step()`` if there are none):
    ``warmup`` steps (without batches, up to ``warmup`` more while the caching host allocator
    still pins new blocks); then, from a DataLoader, the batches its workers may hold ready are
    taken and dropped, and ``loader_batches`` are taken alone to time the source by itself; then
    as many untimed steps as the workers hold batches, so that the queue the source's timing
    emptied fills again where the loader keeps ahead of the step, as in the rest of an epoch
    (from an empty queue, a pin-memory loader's timed steps read 7 % slower than the profiled
    ones in notebook 09); then ``timed_steps`` are timed (by CUDA events, from the end of the
    first), and one more and
    ``steps`` run under the profiler (with Python stacks), the only steps that carry its
    ``record_function`` marks. ``checkup_batches`` says how many batches that is. The wait
    for each batch counts as part of its step, and so does its release after the step (a
    worker's batch in shared memory is unmapped there: 2.4 ms a step in notebook 09's usual
    loop, which pin_memory=True moves to the loader's pin thread). Returns a ``CheckupReport``:
    print it for a table, the findings (costliest first, each with what to change, the step
    time predicted without it and the notebook that measures why) and the latent ones.
    """
    from contextlib import nullcontext

    from torch.profiler import record_function

    require_cuda()
    source = iter(batches) if batches is not None else None
    needed = (warmup + 2 * _buffered_batches(batches) + loader_batches + timed_steps + 1
              + steps if batches is not None else 0)
    taken = 0

    def take():
        nonlocal taken
        batch = next(source, _END)
        if batch is _END:
            raise ValueError(f"the batch source ran out after {taken} batches; "
                             f"checkup needs {needed}")
        taken += 1
        return batch

    next_s = [0.0]  # the host's time in next(batches), unprofiled steps included
    # The marks only while profiled: unprofiled, a record_function still costs 0.02-0.05 ms on
    # the H100's host, which the timed steps would charge to the step and to next(batches)
    profiling = False

    def mark(name: str):
        return record_function(name) if profiling else nullcontext()

    def one_step() -> None:
        with mark(STEP_MARK):
            if batches is None:
                step()
                return
            began = time.perf_counter()
            with mark(NEXT_MARK):
                batch = take()
            next_s[0] += time.perf_counter() - began
            step(batch)
            began = time.perf_counter()
            with mark(RELEASE_MARK):  # a worker's batch: its shared memory unmapped
                del batch
            next_s[0] += time.perf_counter() - began

    loader_ms = float("nan")
    try:
        _warm_up(one_step, warmup, warmup if batches is None else 0)
        if batches is not None:
            loader_ms = _loader_ms(take, _buffered_batches(batches), loader_batches)
            _warm_up(one_step, _buffered_batches(batches), 0)  # the queue fills again
        step_ms, next_ms, allocs = _timed_ms(one_step, timed_steps, next_s)
        profiling = True
        trace = _profiled_trace(one_step, steps)
    finally:
        close = getattr(source, "close", None)  # a generator: let its loader shut down now
        if close is not None:
            close()
        source = None  # a DataLoader iterator shuts its workers down when it is dropped
    report = analyze_checkup_trace(trace, steps, step_ms, loader_ms,
                                   link_gbps=_pinned_link_gbps(),
                                   next_ms=next_ms if batches is not None else float("nan"))
    report.host_allocs_timed = allocs
    return report


# --------------------------------------------------------------------------------------------
# 10. Checkpoints: from the disk to the device
# --------------------------------------------------------------------------------------------

#: File systems whose pages live only in memory: nothing can evict them to a disk.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})


def file_system(path: str | os.PathLike) -> str:
    """The type of the file system that holds ``path`` ("ext4", "xfs", "tmpfs", "overlay"...),
    from /proc/mounts (the longest mount point that contains it); "unknown" where unreadable."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def page_cache_share(path: str | os.PathLike) -> float:
    """The share of a file's pages that sit in the page cache now (0 to 1), asked of the kernel
    with mincore(2) on a fresh mapping of the file; mapping a file reads none of it."""
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + page - 1) // page
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(address), size, vector):
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in bytes(vector)) / pages


def evict_from_page_cache(path: str | os.PathLike, offset: int = 0, length: int = 0) -> float:
    """Ask the kernel to drop a file's pages (``length`` bytes from ``offset``; 0: to the end)
    from the page cache, without root: write back what is dirty (fsync), then
    posix_fadvise(POSIX_FADV_DONTNEED). Returns the share of the whole file still cached.

    The kernel keeps pages it cannot drop: those of a memory file system (tmpfs), those still
    mapped by a process (a live ``torch.load(mmap=True)`` result), those under writeback.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return page_cache_share(path)


def evictable_directory(candidates: Sequence[str | os.PathLike] | None = None) -> str:
    """The first of ``candidates`` (default: the temporary directory, /var/tmp, the working
    directory) where the page cache drops a file it is asked to: a small probe file is written
    there, evicted, checked with ``page_cache_share`` and removed. The first candidate where
    none does (every file system in memory)."""
    if candidates is None:
        candidates = [tempfile.gettempdir(), "/var/tmp", os.getcwd()]
    for directory in candidates:
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix="evict-probe-") as probe:
                probe.write(os.urandom(2**20))
                probe.flush()
                if evict_from_page_cache(probe.name) < 0.05:
                    return os.fspath(directory)
        except OSError:  # not there, or not writable
            continue
    return os.fspath(candidates[0])


@dataclass(frozen=True)
class IOProbe:
    ms: float  # host wall time of the call
    minor_faults: int  # pages mapped in without waiting for the disk
    major_faults: int  # pages that had to be read from the disk first
    disk_bytes: int | None  # bytes the process had the storage layer read (None: not counted)
    result: object = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        disk = "disk reads not counted" if self.disk_bytes is None else \
            f"{format_bytes(self.disk_bytes)} read from the disk"
        return (f"{_ms(self.ms)}, {self.minor_faults} minor + {self.major_faults} major "
                f"page faults, {disk}")


def _disk_read_bytes() -> int | None:
    """read_bytes of /proc/self/io: what this process (all its threads) had the storage layer
    fetch; None where the kernel does not keep the count."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def io_probe(fn: Callable[[], object]) -> IOProbe:
    """Time one call of ``fn`` (and the device work it queued: CUDA is synchronised after it)
    and count the page faults, minor and major, and the disk reads of this process during it."""
    import resource

    def counts():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_minflt, usage.ru_majflt, _disk_read_bytes()

    _sync()
    minor, major, disk = counts()
    start = time.perf_counter()
    result = fn()
    _sync()
    ms = (time.perf_counter() - start) * 1e3
    minor_after, major_after, disk_after = counts()
    read = None if disk is None or disk_after is None else disk_after - disk
    return IOProbe(ms, minor_after - minor, major_after - major, read, result)


@dataclass
class Runs:
    """The calls of one function by ``interleaved_runs``: a probe per timed call, and whether
    ``check`` accepted every result (None without a check)."""

    probes: list[IOProbe]
    ok: bool | None = None

    @property
    def timing(self) -> Timing:
        return Timing(tuple(p.ms for p in self.probes), "host clock, synchronised")

    def median(self, attribute: str) -> float:
        return statistics.median(getattr(p, attribute) for p in self.probes)


def interleaved_runs(fns: dict[str, Callable[[], object]], *, rounds: int = 5, warmup: int = 1,
                     before: Callable[[], object] | None = None,
                     check: Callable[[str, object], bool] | None = None) -> dict[str, Runs]:
    """Call each function ``warmup`` times, then ``rounds`` times, taking them in turn (A B C A
    B C...), so that a slow spell of a shared host falls on all of them. Every call is an
    ``io_probe``; ``before()`` runs, untimed, before each call (an eviction, say), and
    ``check(name, result)``, untimed, after each, before the result is dropped."""
    runs = {name: Runs([], None if check is None else True) for name in fns}
    for index in range(warmup + rounds):
        for name, fn in fns.items():
            if before is not None:
                before()
            probe = io_probe(fn)
            if check is not None:
                runs[name].ok = bool(check(name, probe.result)) and runs[name].ok
            if index >= warmup:
                runs[name].probes.append(replace(probe, result=None))
            del probe
    return runs


def _status_kib(field_name: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return None


class HostMemoryPeak:
    """The peak host memory of this process inside a ``with`` block, above what it held at
    the start. Two measures:

    - ``anonymous_mib``: the peak of RssAnon (memory that belongs to the process alone, such as
      tensors and pageable copies; file pages it maps are not counted), sampled every
      ``interval_s`` by a thread, so a peak shorter than that can slip between samples;
    - ``resident_mib``: the kernel's exact peak of the resident set (VmHWM, reset on entry
      through /proc/self/clear_refs), which also counts the file pages the process maps, such
      as a checkpoint loaded with ``mmap=True``; None where the peak cannot be reset.

    On entry, glibc's ``malloc_trim(0)`` first gives the kernel back what earlier frees left in
    the allocator's heap: memory reused from there would not raise the resident set.
    """

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.anonymous_mib = 0.0
        self.resident_mib: float | None = None

    def __enter__(self):
        import threading

        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self._resident_start = _status_kib("VmRSS")
            peak = _status_kib("VmHWM")
            if self._resident_start is None or peak is None \
                    or peak - self._resident_start > 16 * 1024:
                self._resident_start = None  # the write was taken, the peak was not reset
        except OSError:
            self._resident_start = None
        self._anonymous_start = _status_kib("RssAnon") or 0
        self._peak_kib = self._anonymous_start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-memory-peak", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        self._peak_kib = max(self._peak_kib, _status_kib("RssAnon") or 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.anonymous_mib = (self._peak_kib - self._anonymous_start) / 1024
        if self._resident_start is not None:
            self.resident_mib = ((_status_kib("VmHWM") or 0) - self._resident_start) / 1024


def _mappings(of: str | None = None) -> list[tuple[int, int, int, str]]:
    """This process's mappings, from /proc/self/maps: (start, end, file offset, path), sorted;
    with ``of``, only the lines that name that path (a CUDA process has thousands)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if of is not None and of not in line:
            continue
        fields = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in fields[0].split("-"))
        found.append((low, high, int(fields[2], 16), fields[5] if len(fields) > 5 else ""))
    return sorted(found)


def _mapping_of(address: int, mappings: list[tuple[int, int, int, str]]):
    """The entry of ``mappings`` that holds ``address``."""
    index = bisect.bisect_right(mappings, (address, float("inf"))) - 1
    if index < 0 or not mappings[index][0] <= address < mappings[index][1]:
        raise ValueError(f"address {address:#x} is in no mapping of this process")
    return mappings[index]


@dataclass(frozen=True)
class _Stored:
    """One storage of a checkpoint (in a safetensors file: one tensor's bytes): where its bytes
    lie, in which of the checkpoint's files, and for the loader that reads through a mapping,
    the storage mapped onto them (by ``torch.load(mmap=True)``, or a mapping of the file)."""

    offset: int
    nbytes: int
    mapped: torch.UntypedStorage | None = None  # None: the index mapped nothing
    file: int = 0  # the number of its file among the checkpoint's (a shard's)


@dataclass(frozen=True)
class _Placed:
    """One tensor of a checkpoint, before its data is read: a view of storage number
    ``stored`` of its ``CheckpointLayout``, with the dtype, shape and stride it was saved with."""

    stored: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0


def _map_placed(fn: Callable[[_Placed], object], structure):
    """``map_tensors`` for the ``_Placed`` leaves of a layout's structure (containers rebuilt
    alike). Apart from ``map_tensors``, whose text the outputs of the notebooks that use it are
    stamped with: a change there would have them all re-run."""
    if isinstance(structure, _Placed):
        return fn(structure)
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):  # namedtuple
        return type(structure)(*(_map_placed(fn, item) for item in structure))
    if isinstance(structure, (tuple, list)):
        return type(structure)(_map_placed(fn, item) for item in structure)
    if isinstance(structure, dict):
        mapped = {key: _map_placed(fn, value) for key, value in structure.items()}
        try:
            return type(structure)(mapped)
        except TypeError:  # a dict subclass whose constructor takes something else
            return mapped
    return structure


@dataclass(frozen=True)
class CheckpointLayout:
    """What notebook 12's loader knows of a checkpoint before it reads the data: its files,
    every storage once with where its bytes lie (``stored``, in file then offset order), and
    ``structure``, the result to build: what ``torch.load`` returns (a {name: tensor} dict for
    safetensors), with a ``_Placed`` where each tensor goes."""

    files: tuple[str, ...]
    stored: list[_Stored]
    structure: object

    @property
    def nbytes(self) -> int:
        """The bytes of all its storages: what a load copies to the device."""
        return sum(s.nbytes for s in self.stored)


def _torch_load(path: str | os.PathLike, **options):
    """``torch.load(weights_only=True)``, its failure named with the file (a truncated file has
    lost the zip directory at its end: torch says so, and that the file may be corrupted)."""
    try:
        return torch.load(path, weights_only=True, **options)
    except RuntimeError as error:
        raise ValueError(f"cannot index {path} as a torch.save file: {error}") from error


def checkpoint_index(path: str | os.PathLike):
    """What ``torch.load(path, mmap=True)`` returns (every tensor a view of the file, nothing
    read yet), and its storages in file order, each with the offset of its bytes in the file,
    read off the mapping (/proc/self/maps). Storages shared by several tensors count once.
    Notebook 12's loader indexes this way where it reads through the mapping (``read="mmap"``);
    ``torch_file_layout`` finds the offsets without mapping anything."""
    loaded = _torch_load(path, mmap=True, map_location="cpu")
    storages: dict[int, torch.UntypedStorage] = {}
    map_tensors(lambda t: storages.setdefault(t.untyped_storage().data_ptr(),
                                              t.untyped_storage()), loaded)
    stored = []
    real = os.path.realpath(path)
    mappings = _mappings(real)
    for pointer, storage in storages.items():
        if storage.nbytes() == 0:
            stored.append(_Stored(0, 0, storage))
            continue
        start, _, file_offset, mapped_path = _mapping_of(pointer, mappings)
        if os.path.realpath(mapped_path) != real:
            raise ValueError(f"a tensor of {path} is not mapped from it ({mapped_path})")
        stored.append(_Stored(pointer - start + file_offset, storage.nbytes(), storage))
    return loaded, sorted(stored, key=lambda s: s.offset)


def _placed(number: int, tensor: torch.Tensor) -> _Placed:
    return _Placed(number, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                   tensor.storage_offset())


def _torch_layout(path, loaded, storages: dict, key: Callable) -> CheckpointLayout:
    """The layout of a torch file from what ``torch.load`` returned, given its storages, each
    under the ``key(tensor)`` of the tensors that view it (so a shared one counts once)."""
    order = sorted(storages, key=lambda k: storages[k].offset)
    number = {k: i for i, k in enumerate(order)}
    structure = map_tensors(lambda t: _placed(number[key(t)], t), loaded)
    return CheckpointLayout((os.fspath(path),), [storages[k] for k in order], structure)


def _checkpoint_offset(tensor: torch.Tensor) -> int | None:
    """Where the bytes of a tensor's storage lie in its file, noted by ``torch.load`` with
    ``map_location="meta"`` on the meta storage (torch 2.11 does); None where a torch does not."""
    return getattr(tensor.untyped_storage(), "_checkpoint_offset", None)


def _meta_layout(path, file: int) -> CheckpointLayout | None:
    """A torch file's layout from ``torch.load(map_location="meta")``: the pickle and the zip's
    directory are read, no data, nothing mapped. None where torch gave no offsets."""
    loaded = _torch_load(path, map_location="meta")
    tensors: list[torch.Tensor] = []
    map_tensors(tensors.append, loaded)
    storages: dict[int, _Stored] = {}
    for tensor in tensors:
        offset = _checkpoint_offset(tensor)
        if offset is None:
            return None
        if offset not in storages:  # the first tensor of a shared storage
            storages[offset] = _Stored(offset, tensor.untyped_storage().nbytes(), None, file)
    return _torch_layout(path, loaded, storages, _checkpoint_offset)


def torch_file_layout(path: str | os.PathLike, file: int = 0, *,
                      mapped: bool = False) -> CheckpointLayout:
    """A ``torch.save`` file's layout (notebook 12), with ``file`` its number in a sharded
    checkpoint. By default from ``torch.load(map_location="meta")``, which notes each storage's
    offset in the file and reads no data; with ``mapped`` (for a loader that copies from the
    mapping), or where this torch notes no offsets, from ``checkpoint_index``'s mapping."""
    if not mapped:
        layout = _meta_layout(path, file)
        if layout is not None:
            return layout
    loaded, stored = checkpoint_index(path)
    storages = {s.mapped.data_ptr(): replace(s, file=file) for s in stored}
    return _torch_layout(path, loaded, storages, lambda t: t.untyped_storage().data_ptr())


#: Every dtype name the safetensors format knows (0.8), with the name of the torch dtype it is
#: (None: torch has none, such as the 6-bit floats). Little-endian, as all of safetensors.
_SAFETENSORS_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2", "F6_E2M3": None, "F6_E3M2": None, "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
    "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64"}
#: safetensors' names of the dtypes it stores, and the torch dtypes they are, those this torch
#: has (looked up by name, so that an older torch, without the newest, still imports this)
SAFETENSORS_DTYPES = {code: getattr(torch, name) for code, name in
                      _SAFETENSORS_TORCH_NAMES.items() if getattr(torch, name or "", None)}
#: Dtypes that torch packs several to an element: F4 two 4-bit values a byte. safetensors'
#: shape counts the 4-bit values; torch's last dimension counts bytes, half as many.
SAFETENSORS_PACKED = {"F4": 2}
#: The most header bytes safetensors reads; a longer header it refuses, unread
SAFETENSORS_MAX_HEADER = 100_000_000


def _safetensors_header_length(path, f, size: int) -> int:
    """The header length a safetensors file opens with (8 bytes, little-endian), refused where
    the file cannot hold it: fewer than 8 bytes, a header longer than safetensors reads (a
    wrong length is caught before 100 MB are read), or longer than the rest of the file."""
    if size < 8:
        raise ValueError(f"{path} is truncated: {size} bytes, fewer than the 8 of a safetensors "
                         "file's header length")
    length = int.from_bytes(f.read(8), "little")
    if length > SAFETENSORS_MAX_HEADER:
        raise ValueError(f"{path}: its safetensors header is too large: it announces {length} "
                         f"bytes, safetensors reads at most {SAFETENSORS_MAX_HEADER}")
    if 8 + length > size:
        raise ValueError(f"{path} is truncated: {size} bytes, too few for the safetensors "
                         f"header it announces ({length} bytes after the first 8)")
    return length


def safetensors_header(path: str | os.PathLike) -> tuple[int, dict]:
    """A .safetensors file's header, and the offset where its data begin (notebook 12). The
    file opens with the header's length (8 bytes, little-endian), then the header, JSON:
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, optional "__metadata__"}, each
    tensor's offsets counted from the data's start. Reads the header alone, none of the data;
    refuses, in one line, a header that cannot be read (``_safetensors_header_length``), that
    is not a JSON object, or whose "__metadata__" is not {text: text}."""
    with open(path, "rb") as f:
        length = _safetensors_header_length(path, f, os.fstat(f.fileno()).st_size)
        text = f.read(length)
    try:
        header = json.loads(text)
    except ValueError as error:  # not UTF-8, or not JSON
        raise ValueError(f"{path}: its safetensors header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its safetensors header is not a JSON object")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(value, str) for value in metadata.values())):
        raise ValueError(f"{path}: its safetensors __metadata__ is not a {{text: text}} object")
    return 8 + length, header


def _safetensors_dtype(path, name: str, code) -> torch.dtype:
    """The torch dtype of a tensor's safetensors dtype name. Two refusals, each one line with
    the file and the tensor: a name the safetensors format does not have, and one it has that
    this torch has no dtype for (the 6-bit floats, which no torch has; the newest 8- and 4-bit
    ones on an older torch), since no tensor could be built of its bytes."""
    if isinstance(code, str) and code in SAFETENSORS_DTYPES:
        return SAFETENSORS_DTYPES[code]
    if isinstance(code, str) and code in _SAFETENSORS_TORCH_NAMES:
        raise ValueError(f"{path}: tensor {name!r} is {code}: torch has no dtype for {code} "
                         f"(torch {torch.__version__})")
    raise ValueError(f"{path}: tensor {name!r} has dtype {code!r}, which safetensors does not "
                     "know")


def _torch_shape(path, name: str, code: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape as torch holds it: the header's, except for a packed dtype (F4), whose
    last dimension torch counts in bytes, each holding ``SAFETENSORS_PACKED[code]`` values
    (safetensors.torch gives shape [2] for an F4 [4]). A last dimension that does not divide
    into bytes (or none: a scalar) is refused, as safetensors.torch refuses it."""
    per = SAFETENSORS_PACKED.get(code, 1)
    if per == 1:
        return shape
    if not shape or shape[-1] % per:
        raise ValueError(f"{path}: tensor {name!r} is {code} of shape {list(shape)}: torch packs "
                         f"{per} values a byte along the last dimension, which must be a "
                         f"multiple of {per}")
    return (*shape[:-1], shape[-1] // per)


def _is_count(n) -> bool:
    """Whether a JSON value is a count safetensors takes: a whole number, 0 or more."""
    return type(n) is int and n >= 0  # not a bool, not a float such as 16.0


def _safetensors_entry(path, name: str, entry) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """One tensor of a safetensors header, checked: its dtype (``_safetensors_dtype``), its
    shape as torch holds it (``_torch_shape``), and its bytes' begin and end counted from the
    data's start. The shape and offsets must be counts (a negative or fractional one is none),
    the end no less than the begin, and the bytes between exactly those that the shape and
    dtype need: safetensors refuses anything else, and a loader that took it would build a
    tensor of the wrong size, or of bytes that are not its own."""
    fields = entry if isinstance(entry, dict) else {}
    shape, offsets = fields.get("shape"), fields.get("data_offsets")
    if not (isinstance(shape, list) and all(map(_is_count, shape)) and isinstance(offsets, list)
            and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise ValueError(f"{path}: tensor {name!r} has a dtype, shape or data_offsets this "
                         f"parser does not know: {entry!r}")
    dtype = _safetensors_dtype(path, name, fields.get("dtype"))
    shape = _torch_shape(path, name, fields["dtype"], tuple(shape))
    begin, end = offsets
    if end < begin:
        raise ValueError(f"{path}: tensor {name!r} has data_offsets [{begin}, {end}]: it ends "
                         "before it begins")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise ValueError(f"{path}: tensor {name!r} spans bytes {begin} to {end}; its dtype and "
                         f"shape need {expected}")
    return dtype, shape, begin, end


def _offset_error(path, name: str, begin: int, expected: int) -> str:
    """The line that says why a tensor that begins at ``begin`` cannot follow the tensors
    before it, which end at ``expected`` (0: it is the first with bytes)."""
    if begin < expected:
        return (f"{path}: tensor {name!r} begins at data byte {begin}, inside the tensor before "
                f"it (which ends at {expected}): their data_offsets overlap")
    if expected == 0:
        return (f"{path}: tensor {name!r} begins at data byte {begin}, but the tensors' data "
                "must begin at 0")
    return (f"{path}: tensor {name!r} begins at data byte {begin}, leaving a gap of "
            f"{begin - expected} bytes after the tensor before it (which ends at {expected})")


def _safetensors_tensors(path, header: dict, data_start: int, size: int) -> list[tuple]:
    """The tensors of a safetensors header, each checked (``_safetensors_entry``): (name,
    dtype, shape, begin, end), in file order (by begin, then end, as safetensors sorts them).
    Checked together, against the file of ``size`` bytes: each tensor's bytes must begin
    where the previous one's end (the first's at 0), so that no byte is two tensors' and none
    is no tensor's, and the last must end where the file does. Safetensors refuses any other
    file; a shorter one is truncated (the first tensor whose bytes are not all there is
    named), a longer one holds bytes after its tensors that belong to none."""
    tensors = sorted(((name, *_safetensors_entry(path, name, entry))
                      for name, entry in header.items() if name != "__metadata__"),
                     key=lambda tensor: tensor[3:])
    end = 0
    for name, *_, begin, stop in tensors:
        if begin != end:
            raise ValueError(_offset_error(path, name, begin, end))
        end = stop
    if data_start + end > size:
        name, *_, stop = next(t for t in tensors if data_start + t[4] > size)
        raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte "
                         f"{data_start + stop}, the file holds {size}")
    if data_start + end < size:
        last = f" (the last, {tensors[-1][0]!r}, ends at byte {data_start + end})" if tensors \
            else ""
        raise ValueError(f"{path}: {size - data_start - end} bytes after its tensors' data"
                         f"{last}: safetensors refuses a file its tensors do not cover")
    return tensors


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a row-major tensor of ``shape``, as torch gives them (an empty dimension
    counts as one, so that ``torch.empty(0, 4)`` has strides (4, 1))."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _map_file(path: str | os.PathLike) -> torch.UntypedStorage:
    """A file's bytes as a storage mapped onto the file: nothing is read until touched, then
    page faults bring its pages in. A private mapping, so that torch can take it (it wants a
    writable buffer); nothing writes to it."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses an empty file
            return torch.UntypedStorage(0)
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()  # keeps it alive


def safetensors_layout(path: str | os.PathLike, file: int = 0, *,
                       mapped: bool = False) -> CheckpointLayout:
    """A .safetensors file's layout from its header alone (notebook 12): each tensor its own
    storage, in file order, the result a {name: tensor} dict in that order. With ``mapped``,
    each storage is also mapped from the file (for the loader that copies from the mapping).
    Refuses, with a one-line ValueError, the files that safetensors refuses
    (``safetensors_header``, ``_safetensors_tensors``) and those torch has no dtype for."""
    data_start, header = safetensors_header(path)
    tensors = _safetensors_tensors(path, header, data_start, os.path.getsize(path))
    whole = _map_file(path) if mapped else None
    stored, structure = [], {}
    for name, dtype, shape, begin, end in tensors:
        offset = data_start + begin
        view = None if whole is None else whole[offset:data_start + end]
        structure[name] = _Placed(len(stored), dtype, shape, _contiguous_stride(shape))
        stored.append(_Stored(offset, end - begin, view, file))
    return CheckpointLayout((os.fspath(path),), stored, structure)


def _weight_map(index: str | os.PathLike) -> dict[str, str]:
    """The "weight_map" of a sharded checkpoint's index: {tensor name: the file name of the
    shard that holds it, next to the index}. Refused in one line: an index that is not JSON,
    or has no weight_map of names to file names."""
    try:
        loaded = json.loads(Path(index).read_text())
    except ValueError as error:  # not UTF-8, or not JSON
        raise ValueError(f"{index} is not JSON, not a sharded checkpoint's index ({error})") \
            from error
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map: not a sharded checkpoint's index")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ValueError(f"{index}: its weight_map gives tensor {name!r} the shard "
                             f"{file!r}, not a file name")
    return weight_map


def _checkpoint_sources(source) -> tuple[list[str], dict[str, str] | None]:
    """``checkpoint_files(source)``, and the index's weight_map where ``source`` is one."""
    named = isinstance(source, (str, os.PathLike))
    weight_map = None
    if not named:
        files = [os.fspath(p) for p in source]
    elif os.fspath(source).endswith(".json"):
        weight_map = _weight_map(source)
        directory = os.path.dirname(os.fspath(source))
        files = [os.path.join(directory, name) for name in dict.fromkeys(weight_map.values())]
    else:
        files = [os.fspath(source)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        where = os.fspath(source) if named else "the list of files"
        raise FileNotFoundError(f"{where} names files that are not there: {missing}")
    return files, weight_map


def checkpoint_files(source) -> list[str]:
    """The files of a checkpoint (notebook 12): ``source`` itself; for a sharded checkpoint's
    ``*.index.json``, the shards its "weight_map" ({tensor name: file name}, the files next to
    it) names, in the order first named; for a list, its paths. FileNotFoundError names any
    that is missing, before anything is read."""
    return _checkpoint_sources(source)[0]


def _is_safetensors(path: str) -> bool:
    """Whether a file is a safetensors one: by its name, or by its start (8 bytes of header
    length, then the JSON's "{"; a torch.save file is a zip archive, which starts "PK")."""
    if path.endswith(".safetensors"):
        return True
    with open(path, "rb") as f:
        return f.read(9)[8:] == b"{"


def _merged(layouts: list[CheckpointLayout]) -> CheckpointLayout:
    """One layout of several files (shards), each a {name: tensor} dict: their storages in one
    list, numbered on, their tensors in one dict."""
    stored: list[_Stored] = []
    structure: dict = {}
    for layout in layouts:
        if not isinstance(layout.structure, dict):
            raise ValueError(f"{layout.files[0]} is no {{name: tensor}} dict: not a shard")
        base = len(stored)  # the number of this file's first storage
        for name, value in layout.structure.items():
            if name in structure:
                raise ValueError(f"{name!r} is in two shards (the second: {layout.files[0]})")
            structure[name] = _map_placed(
                lambda p, base=base: replace(p, stored=p.stored + base), value)
        stored += layout.stored
    return CheckpointLayout(tuple(f for layout in layouts for f in layout.files), stored,
                            structure)


def _shard_of_each_tensor(layouts: list[CheckpointLayout]) -> dict[str, str]:
    """{tensor name: the file of the shard that holds it}, for shards that are each a {name:
    tensor} dict (safetensors files, or ``torch.save`` state dicts)."""
    held: dict[str, str] = {}
    for layout in layouts:
        if not isinstance(layout.structure, dict):
            raise ValueError(f"{layout.files[0]} is no {{name: tensor}} dict: not a shard")
        for name in layout.structure:
            held.setdefault(name, layout.files[0])
    return held


def _check_index_against_shards(index, weight_map: dict[str, str],
                                layouts: list[CheckpointLayout]) -> None:
    """Check a sharded checkpoint's index against the tensors its shards hold (their headers,
    or their pickles, read), refusing in one line that names the index, the tensor and the
    shards:

    - a tensor the index names that no shard holds: the load would lack it, without a word;
    - a tensor the index puts in one shard that another holds: whoever opens the one shard the
      index names, to read that tensor alone, would not find it;
    - a tensor a shard holds that the index does not name. transformers takes one (it reads
      whole shards and uses the index for the files and for its report of missing keys), but
      this loader refuses it: it returns every tensor of the shards, and would return one that
      the checkpoint's table of contents says is not there, a sign that a shard and the index
      come from different saves. Pass the list of shard files to load them without an index.
    """
    directory = os.path.dirname(os.fspath(index))
    as_named = {os.path.join(directory, file): file for file in weight_map.values()}
    held = _shard_of_each_tensor(layouts)
    for name, file in weight_map.items():
        if name not in held:
            raise ValueError(f"{index} names tensor {name!r} in shard {file}, but no shard holds"
                             f" it (the shards: {', '.join(as_named.values())})")
        if held[name] != os.path.join(directory, file):
            raise ValueError(f"{index} names tensor {name!r} in shard {file}, but shard "
                             f"{as_named[held[name]]} holds it")
    for name, path in held.items():
        if name not in weight_map:
            raise ValueError(f"{index} does not name tensor {name!r}, which shard "
                             f"{as_named[path]} holds: an index must name every tensor")


def checkpoint_layout(source, *, mapped: bool = False) -> CheckpointLayout:
    """The index of a checkpoint, the cheapest way its format allows (notebook 12): for a
    .safetensors file, its header; for a ``torch.save`` file, ``torch.load(map_location=
    "meta")`` (``torch_file_layout``). ``source``: one file, a sharded checkpoint's
    ``*.index.json``, or a list of shard paths (their tensors in one dict). With ``mapped``,
    every storage is mapped from its file too, for a loader that copies from the mapping.
    An index is checked against what its shards hold (``_check_index_against_shards``)."""
    files, weight_map = _checkpoint_sources(source)
    layouts = []
    for number, path in enumerate(files):
        of_file = safetensors_layout if _is_safetensors(path) else torch_file_layout
        layouts.append(of_file(path, number, mapped=mapped))
    layout = layouts[0] if len(layouts) == 1 else _merged(layouts)
    if weight_map is not None:
        _check_index_against_shards(source, weight_map, layouts)
    return layout


class _Chunk(typing.NamedTuple):
    """A piece of one file that the loader reads into one buffer: ``length`` bytes from
    ``begin``, and ``parts``: (storage number, offset in the chunk, offset in the storage,
    bytes) for each storage it holds bytes of."""

    begin: int
    length: int
    parts: list[tuple[int, int, int, int]]
    file: int = 0


def _interleaved(runs: list[list[_Chunk]]) -> list[_Chunk]:
    """The chunks of several files in one order, each file's spread evenly over it (chunk k of
    n at (k + 1/2) / n of the way), so that readers work in every file at once, to the end."""
    placed = [((k + 0.5) / len(run), chunk.file, chunk)
              for run in runs for k, chunk in enumerate(run)]
    return [chunk for *_, chunk in sorted(placed, key=lambda entry: entry[:2])]


class CheckpointLoader:
    """Load a checkpoint onto ``device`` through a ring of reused (pinned) host buffers, each
    filled from the file while the ones before it cross the link (notebook 12). A checkpoint:
    a ``torch.save`` file, a .safetensors file, or a sharded one (its ``*.index.json``, or a
    list of its files).

    ``checkpoint_layout`` gives the index: every tensor's dtype, shape and storage, and where
    its bytes lie in the file, without reading them (a torch file's from
    ``torch.load(map_location="meta")``, a safetensors file's from its header). The file's data,
    from its first storage to the end of its last, is then read in ``chunk_bytes`` pieces,
    piece k into buffer k % ``slots``, and each storage's part of a piece is copied to its
    place on the device with ``non_blocking=True``. The pieces of several files (shards) are
    interleaved, so that the readers work in all of them at once. Before a buffer is filled
    again, its reader waits on the event recorded after the copies out of it; the next pieces
    are read while a piece's copies run. Two ways to read a piece (``read``):

    - ``"pread"``: ``os.preadv`` of the whole piece, by a pool of ``threads`` threads (each a
      system call that copies from the page cache, or waits for the disk, in the kernel; by
      default one per usable CPU, at most ``MAX_THREADS``);
    - ``"mmap"``: ``copy_`` from the mapped storages into the buffer, on the calling thread
      (page faults map the file's pages in; PyTorch's intra-op pool does the copy). A torch
      file is indexed by ``torch.load(mmap=True)`` then (``checkpoint_index``), which maps it.

    ``load`` returns what ``torch.load`` would (a {name: tensor} dict for safetensors), with
    tensors on ``device`` (storages shared in the file are shared there too; a ``Parameter``
    comes back as a plain tensor); the copies are queued on the current stream of ``device``,
    so work queued after on that stream sees them done. ``read`` does the reading alone, for
    the host's side of the ceiling; ``read_file`` reads the whole files, with no index. Buffers
    are pinned where ``device`` is CUDA (``pin``), and kept between calls.
    """

    READS = ("pread", "mmap")
    # More readers can still read faster alone, while the load gains less, if at all (notebook
    # 12's sweep of thread counts); a cap keeps the thread that queues the copies from competing
    # with many readers for CPUs and the GIL
    MAX_THREADS = 8
    MIN_SLOTS = 16

    def __init__(self, device: torch.device | str, *, read: str = "pread",
                 threads: int | None = None, chunk_bytes: int = 8 * 2**20,
                 slots: int | None = None, pin: bool | None = None):
        if read not in self.READS:
            raise ValueError(f"read must be one of {self.READS}")
        self.device = torch.device(device)
        self.read_mode = read
        self.threads = (threads or min(usable_cpus(), self.MAX_THREADS)) if read == "pread" else 1
        self.chunk_bytes = chunk_bytes
        # Readers run ahead by all buffers but one: at least 16 of them, so that on a host
        # whose CPUs all read, a late turn for the thread queuing the copies stalls no reader
        self.slots = slots or (max(2 * self.threads, self.MIN_SLOTS) if read == "pread" else 2)
        cuda = self.device.type == "cuda"
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8,
                                    pin_memory=cuda if pin is None else pin)
                        for _ in range(self.slots)]
        self._fences: list = [None] * self.slots  # event after the last copies out of each
        self._pool = None
        if read == "pread":
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="checkpoint-read")

    def _pieces(self, stored: list[_Stored]) -> list[_Chunk]:
        """The chunks to read: each file's data range in chunks, the files' interleaved."""
        present: dict[int, list[tuple[int, _Stored]]] = {}
        for index, s in enumerate(stored):
            if s.nbytes:
                present.setdefault(s.file, []).append((index, s))
        return _interleaved([self._file_pieces(file, present[file]) for file in sorted(present)])

    def _file_pieces(self, file: int, present: list[tuple[int, _Stored]]) -> list[_Chunk]:
        """One file's chunks, from its first storage to the end of its last (``present``: the
        storages with bytes, by number, in offset order)."""
        low = present[0][1].offset
        high = max(s.offset + s.nbytes for _, s in present)
        chunks, first = [], 0
        for begin in range(low, high, self.chunk_bytes):
            end = min(begin + self.chunk_bytes, high)
            parts = []
            while first < len(present) and present[first][1].offset + present[first][1].nbytes \
                    <= begin:
                first += 1
            for index, s in present[first:]:
                if s.offset >= end:
                    break
                a, b = max(begin, s.offset), min(end, s.offset + s.nbytes)
                if b > a:
                    parts.append((index, a - begin, a - s.offset, b - a))
            chunks.append(_Chunk(begin, end - begin, parts, file))
        return chunks

    def _fill(self, slot: int, fence, fd: int | None, chunk: _Chunk, stored) -> None:
        """Read one chunk into buffer ``slot``, once the copies that last read it are done."""
        if fence is not None:
            fence.synchronize()
        buffer = self.buffers[slot]
        if fd is None:  # through the mapping
            for index, at, offset, nbytes in chunk.parts:
                source = torch.empty(0, dtype=torch.uint8).set_(stored[index].mapped)
                buffer[at:at + nbytes].copy_(source[offset:offset + nbytes])
            return
        window = (ctypes.c_char * chunk.length).from_address(buffer.data_ptr())
        view, done = memoryview(window).cast("B"), 0
        while done < chunk.length:
            got = os.preadv(fd, [view[done:]], chunk.begin + done)
            if got == 0:
                raise EOFError(f"the file ended {chunk.length - done} bytes before its last "
                               "tensor")
            done += got

    def _record(self):
        """An event after the copies queued so far (None off CUDA, where they are done)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)  # a reader waiting on it sleeps, not spins
        event.record(torch.cuda.current_stream(self.device))  # the stream the copies went on
        return event

    def _open(self, files: Sequence[str]) -> list[int | None]:
        """A descriptor per file for the pread readers (None each, to read through mappings)."""
        if self.read_mode != "pread":
            return [None] * len(files)
        fds: list[int | None] = []
        try:
            for path in files:
                fds.append(os.open(path, os.O_RDONLY))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _stream(self, files: Sequence[str], stored: list[_Stored], destinations) -> int:
        """Read every chunk, copying each one's parts to ``destinations`` (None: read only).
        Returns the bytes read."""
        chunks = self._pieces(stored)
        fds = self._open(files)
        pending: dict[int, object] = {}

        def start(k):
            slot = k % self.slots
            fence, self._fences[slot] = self._fences[slot], None
            fd = fds[chunks[k].file]
            if self._pool is None:
                self._fill(slot, fence, fd, chunks[k], stored)
                return None
            return self._pool.submit(self._fill, slot, fence, fd, chunks[k], stored)

        # Chunks read ahead of the one being copied: with the pool, all buffers but the one just
        # handed to the link, so that a reader rarely waits for its buffer's copies; on the
        # calling thread, one, read after the copies of the one before are queued, so the two
        # overlap.
        ahead = max(1, self.slots - 1) if self._pool is not None else 1
        try:
            for k in range(min(ahead, len(chunks))):
                pending[k] = start(k)
            for k, chunk in enumerate(chunks):
                if pending[k] is not None:
                    pending[k].result()
                del pending[k]
                buffer = self.buffers[k % self.slots]
                if destinations is not None:
                    for index, at, offset, nbytes in chunk.parts:
                        destinations[index][offset:offset + nbytes].copy_(
                            buffer[at:at + nbytes], non_blocking=True)
                    self._fences[k % self.slots] = self._record()
                if k + ahead < len(chunks):
                    pending[k + ahead] = start(k + ahead)
        finally:
            for future in pending.values():  # after an error: let the readers finish first
                if future is not None:
                    future.exception()
            for fd in fds:
                if fd is not None:
                    os.close(fd)
        return sum(chunk.length for chunk in chunks)

    def _layout(self, source) -> CheckpointLayout:
        # copying from the mapping needs the storages mapped; pread needs offsets alone
        return checkpoint_layout(source, mapped=self.read_mode == "mmap")

    def read(self, source, alongside: Callable[[], object] | None = None) -> int:
        """Read the checkpoint's data through the buffers, copying nothing to the device: the
        host's side of a load, index included. Returns the bytes read.

        ``alongside`` is called once the index is read, before the data is: it can queue work
        that runs beside the read and competes with it (copies over the link, which read the
        host's memory too), to time both trips together.
        """
        layout = self._layout(source)
        if alongside is not None:
            alongside()
        return self._stream(layout.files, layout.stored, None)

    def read_file(self, source) -> int:
        """Read every byte of the checkpoint's file(s), whole, through the buffers, the way
        this loader reads (with its threads), with no index and no copies to the device: the
        host's side of the ceiling measured apart from the loader's own index (notebook 12
        takes the fastest of several thread counts). Returns the bytes read."""
        files = checkpoint_files(source)
        mapped = self.read_mode == "mmap"
        whole = [_Stored(0, os.path.getsize(path), _map_file(path) if mapped else None, number)
                 for number, path in enumerate(files)]
        return self._stream(files, whole, None)

    def load(self, source):
        """The checkpoint on ``device``: what ``torch.load`` returns for a torch file, a
        {name: tensor} dict for safetensors (a sharded one's tensors all in one dict)."""
        layout = self._layout(source)
        destinations = [torch.empty(s.nbytes, dtype=torch.uint8, device=self.device)
                        for s in layout.stored]
        self._stream(layout.files, layout.stored, destinations)

        def place(p: _Placed) -> torch.Tensor:
            return torch.empty(0, dtype=p.dtype, device=self.device).set_(
                destinations[p.stored].untyped_storage(), p.storage_offset, p.shape, p.stride)

        return _map_placed(place, layout.structure)

    def close(self) -> None:
        """Stop the reading threads (the buffers go when the loader does)."""
        if self._pool is not None:
            self._pool.shutdown()


# --------------------------------------------------------------------------------------------
# 11. CUDA graphs: a training step captured once, replayed for every batch
# --------------------------------------------------------------------------------------------


def _graph_event() -> tuple[torch.cuda.Event, bool]:
    """An event a capture can record as a node of its graph, for the host to wait on after a
    replay (``external=True``, torch >= 2.9), and True; on an older torch a plain event, which
    the caller records after each replay instead, and False."""
    try:
        return torch.cuda.Event(external=True), True
    except TypeError:
        return torch.cuda.Event(), False


def _capture(graph, stream, body: Callable[[], object]):
    """What ``body`` queues, recorded into ``graph`` on ``stream`` (nothing runs); its result."""
    with torch.cuda.graph(graph, stream=stream):
        return body()


class GraphedStep:
    """A step captured once as a CUDA graph and replayed for every batch (notebook 13).

    ``step(*inputs)`` queues a step's GPU work on device tensors (forward, backward and the
    optimizer's step, say) and returns its output (the loss); ``example`` is a batch on the host,
    a sequence of tensors that fixes the shapes and dtypes. A replay reads and writes the memory
    the capture saw: the batch goes into static tensors on ``device`` (``inputs``), made once,
    and ``output`` is overwritten in place by the next replay (``clone()`` it to keep it); it is
    detached from the captured step's autograd graph, which would otherwise stay alive and keep
    the parameters' gradient accumulators bound to the capture. Two ways in:

    - ``staged=False``: a call copies the batch into ``inputs`` with ``copy_(non_blocking=True)``,
      outside the graph (from pinned memory, so that the host does not wait), then replays;
    - ``staged=True``: the copies from pinned staging buffers (``staging``) into ``inputs`` are
      part of the graph, and so is an event right after them (``copied``). A call waits on that
      event (the last replay's copies have read the buffers; before the first replay there is
      nothing to wait for), copies the batch into the buffers on the host (from pageable memory
      too), then replays.

    Before the capture the step runs ``warmup`` times on the example batch, on a side stream, so
    that lazy set-up (cuBLAS workspaces, the allocator's blocks) happens outside the capture;
    those runs train like any other step, and the caller's stream waits for them. An optimizer
    that counts its steps on the host needs ``capturable=True`` (Adam, AdamW). What the step reads
    from Python at capture is fixed in the graph: SGD's learning rate, a float, stays the
    captured one whatever ``param_groups`` say later: capture again to change it.

    A replay reads one shape and dtype: ``load`` refuses, in one line, a batch of another (a
    last partial batch, say), where ``copy_`` would broadcast a smaller one silently.
    """

    def __init__(self, step: Callable, example: Sequence[torch.Tensor], *,
                 staged: bool = False, warmup: int = 3, device: torch.device | str = "cuda"):
        device = torch.device(device)
        self.staged = staged
        self.inputs = [t.to(device, copy=True) for t in example]  # its own, even on the CPU
        pin = device.type == "cuda"
        self.staging = ([torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t)
                         for t in example] if staged else [])
        self.copied, self._in_graph = _graph_event()
        self.copied.record()  # made now, outside the capture (which records it again)
        self._replayed = False  # until the first replay, load() has no copies to wait for
        self.stream = torch.cuda.Stream(device)
        caller = torch.cuda.current_stream(device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            for _ in range(warmup):
                step(*self.inputs)
        caller.wait_stream(self.stream)  # the warm-up is ordered before whatever comes next
        self.graph = torch.cuda.CUDAGraph()
        output = _capture(self.graph, self.stream, lambda: self._body(step))
        self.output = map_tensors(torch.Tensor.detach, output)  # the same memory, no grad_fn

    def _body(self, step: Callable):
        """What the graph holds: (staged) the copies out of the staging buffers and the event
        after them, then the step."""
        if self.staged:
            for static, buffer in zip(self.inputs, self.staging, strict=True):
                static.copy_(buffer, non_blocking=True)
            if self._in_graph:
                self.copied.record()
        return step(*self.inputs)

    def load(self, *batch: torch.Tensor, wait: bool = True) -> None:
        """Put a batch where the next replay reads it: queue its copy into ``inputs``, or (staged)
        copy it into ``staging`` on the host, first waiting (``wait``) until the last replay's
        copies have read them. Before the first replay it never waits: the last record of
        ``copied`` is then the capture's, which no replay has run."""
        self._refuse_unlike(batch)
        if not self.staged:
            for static, tensor in zip(self.inputs, batch, strict=True):
                static.copy_(tensor, non_blocking=True)
            return
        if wait and self._replayed:
            self.copied.synchronize()
        for buffer, tensor in zip(self.staging, batch, strict=True):
            buffer.copy_(tensor)

    def _refuse_unlike(self, batch: Sequence[torch.Tensor]) -> None:
        """Raise ValueError, in one line, where ``batch`` is not the captured batch's kind."""
        if len(batch) != len(self.inputs):
            raise ValueError(f"GraphedStep: {len(batch)} tensors, the captured step reads "
                             f"{len(self.inputs)}")
        for index, (static, tensor) in enumerate(zip(self.inputs, batch, strict=True)):
            if tensor.shape != static.shape:
                raise ValueError(
                    f"GraphedStep: input {index} has shape {tuple(tensor.shape)}, the captured "
                    f"step reads {tuple(static.shape)}: drop a last partial batch "
                    "(DataLoader(drop_last=True)), pad it to that shape with a mask, or capture "
                    "a second GraphedStep for it")
            if tensor.dtype != static.dtype:
                raise ValueError(f"GraphedStep: input {index} is {tensor.dtype}, the captured "
                                 f"step reads {static.dtype}: convert it first")

    def replay(self):
        """Queue the step on the current stream; returns ``output``."""
        self.graph.replay()
        self._replayed = True
        if self.staged and not self._in_graph:
            self.copied.record()  # after the whole step: later than needed, never too early
        return self.output

    def __call__(self, *batch: torch.Tensor):
        self.load(*batch)
        return self.replay()


# --------------------------------------------------------------------------------------------
# 12. Parking a training state in host memory (notebook 14)
# --------------------------------------------------------------------------------------------


def state_by_kind(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list]:
    """A training state's GPU tensors by kind (notebook 14): the weights, their gradients and
    each tensor the optimizer keeps per parameter (AdamW: ``exp_avg``, ``exp_avg_sq``), in the
    model's parameter order. Tensors on the host (a non-capturable optimizer's step counts) are
    left out: they stay where they are."""
    params = [p for p in model.parameters() if p.is_cuda]
    kinds: dict[str, list] = {"weights": params,
                              "gradients": [p.grad for p in params if p.grad is not None]}
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                kinds.setdefault(key, []).append(value)
    return {kind: tensors for kind, tensors in kinds.items() if tensors}


def _parkable(tensors: Sequence[torch.Tensor], device_type: str = "cuda") -> list[torch.Tensor]:
    """The tensors, checked: at least one, each on one device of ``device_type``, each the
    whole of a storage of its own (parking frees a storage: a view would lose its base's
    memory, or another view's)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("nothing to park: no tensors")
    seen: set = set()
    for index, t in enumerate(tensors):
        storage = t.untyped_storage()
        if t.device != tensors[0].device or t.device.type != device_type:
            raise ValueError(f"tensor {index} is on {t.device}: every parked tensor must be on "
                             f"the {device_type} device of the first ({tensors[0].device})")
        if (t.storage_offset() != 0 or not t.is_contiguous()
                or t.numel() * t.element_size() != storage.nbytes()):
            raise ValueError(f"tensor {index} ({list(t.shape)}, {t.dtype}) is a view of a "
                             "larger storage: park the tensor that owns the storage instead")
        if storage.data_ptr() in seen:
            raise ValueError(f"tensor {index} shares its storage with an earlier one: park "
                             "each storage once")
        seen.add(storage.data_ptr())
    return tensors


class HostBuffer:
    """``nbytes`` of page-locked host memory, exactly (notebook 14): pageable memory from
    ``torch.empty``, then registered with CUDA (``cudaHostRegister``), where PyTorch's caching
    host allocator would pin the next power of two (``pinned_block_bytes``). ``views`` lays
    tensors like given ones out in it, back to back, each at a 512-byte boundary. ``close``
    (or the end of a ``with`` block) unregisters it; the memory goes when the last view does.
    Refuses, in one line, a size of 0 and a registration CUDA refuses (such as a memlock limit)."""

    ALIGN = 512

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"HostBuffer: {nbytes} bytes: nothing to register")
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        error = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"HostBuffer: cudaHostRegister of {format_bytes(nbytes)} failed "
                               f"({error}); the memlock limit is {memlock_limit()}")
        self.registered = True

    @classmethod
    def layout(cls, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Each tensor's offset in a buffer that holds them all, then the buffer's size."""
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN
        return [*offsets, end]

    def views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped and typed like ``tensors``, laid out in this buffer."""
        *offsets, end = self.layout(tensors)
        if end > self.nbytes:
            raise ValueError(f"HostBuffer: the tensors need {format_bytes(end)}, the buffer "
                             f"holds {format_bytes(self.nbytes)}")
        return [self.tensor[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for o, t in zip(offsets, tensors, strict=True)]

    def close(self) -> None:
        if self.registered:
            error = torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
            if int(error) != 0:
                raise RuntimeError(f"HostBuffer: cudaHostUnregister failed ({error})")

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ParkedState:
    """A training state that can leave the GPU and come back, its tensors keeping their
    identity (notebook 14). ``park`` copies each tensor into its view of a ``HostBuffer`` on
    ``stream``, then frees its GPU storage (``resize_(0)``: the model and the optimizer keep
    the same tensor objects), once the current stream has waited for that tensor's copy (a
    later allocation there may reuse the memory). ``restore`` allocates each storage again on
    the current stream and copies it back on ``stream``, after ``stream`` has waited for the
    current one (the allocation may reuse memory that work queued there still uses). Each
    returns the event after its copies: make the current stream wait on it before a kernel
    reads the state, and ``synchronize`` it before the host reads the buffer. ``swap_states``
    parks one state while it restores another. A restored storage may sit at another
    address: capture a CUDA graph again after a restore (notebook 13). The tensors are
    checked by ``_parkable``; a second park, or a restore of a state not parked, is refused."""

    DEVICE_TYPE = "cuda"  # the tests park CPU tensors, with streams faked

    def __init__(self, tensors: Sequence[torch.Tensor], stream=None):
        self.tensors = _parkable(tensors, self.DEVICE_TYPE)
        self.nbytes = [t.untyped_storage().nbytes() for t in self.tensors]
        self.buffer = HostBuffer(HostBuffer.layout(self.tensors)[-1])
        self.host = self.buffer.views(self.tensors)
        self.stream = stream or torch.cuda.Stream(self.tensors[0].device)
        self.parked = False

    def _current(self):
        return torch.cuda.current_stream(self.tensors[0].device)

    def _park_one(self, index: int) -> torch.cuda.Event:
        tensor = self.tensors[index]
        self.stream.wait_stream(self._current())  # the tensor's last writes come first
        with torch.cuda.stream(self.stream):
            self.host[index].copy_(tensor.detach(), non_blocking=True)
        copied = self.stream.record_event()
        self._current().wait_event(copied)  # a reuse of the memory waits for the copy
        tensor.untyped_storage().resize_(0)
        return copied

    def _restore_one(self, index: int) -> torch.cuda.Event:
        tensor = self.tensors[index]
        tensor.untyped_storage().resize_(self.nbytes[index])  # on the current stream
        self.stream.wait_stream(self._current())
        with torch.cuda.stream(self.stream), torch.no_grad():
            tensor.detach().copy_(self.host[index], non_blocking=True)
        return self.stream.record_event()

    def park(self) -> torch.cuda.Event:
        if self.parked:
            raise RuntimeError("ParkedState: already parked; restore it first")
        events = [self._park_one(i) for i in range(len(self.tensors))]
        self.parked = True
        return events[-1]  # the copies run in order on one stream: the last is the latest

    def restore(self) -> torch.cuda.Event:
        if not self.parked:
            raise RuntimeError("ParkedState: not parked; nothing to restore")
        events = [self._restore_one(i) for i in range(len(self.tensors))]
        self.parked = False
        return events[-1]

    def close(self) -> None:
        self.buffer.close()


def swap_states(leaving: ParkedState, arriving: ParkedState) -> tuple:
    """Park ``leaving`` and restore ``arriving`` tensor by tensor, interleaved (notebook 14):
    the k-th restore may reuse the memory the k-th park freed, and waits for that park's copy
    only (and those before it), so that the copies out run on one copy engine while the copies
    in run on another. Returns the events after the last copy of each."""
    if leaving.parked or not arriving.parked:
        raise RuntimeError("swap_states: the leaving state must be on the GPU and the "
                           "arriving one parked")
    if leaving.tensors[0].device != arriving.tensors[0].device:
        raise ValueError(f"swap_states: the states are on {leaving.tensors[0].device} and "
                         f"{arriving.tensors[0].device}; swap states of one GPU")
    out_events, in_events = [], []
    for k in range(max(len(leaving.tensors), len(arriving.tensors))):
        if k < len(leaving.tensors):
            out_events.append(leaving._park_one(k))
        if k < len(arriving.tensors):
            in_events.append(arriving._restore_one(k))
    leaving.parked, arriving.parked = True, False
    return out_events[-1], in_events[-1]


# The tool readers use today, timed in a process of its own: torch_memory_saver replaces the
# caching allocator's CUDA calls (hook_mode "torch": a pluggable allocator), which only a process
# that has not yet used CUDA can do.
_MEMORY_SAVER_RUN = """
import json, os, sys, time
import torch
from torch_memory_saver import torch_memory_saver as saver
saver.hook_mode = "torch"
retain, tensors_wanted, width, cycles = sys.argv[1] == "1", *map(int, sys.argv[2:5])
with saver.region(enable_cpu_backup=True):
    state = [torch.randn(width, width, device="cuda") for _ in range(tensors_wanted)]
reference = [t.clone() for t in state]
saver.retain_cpu_backup = retain
spans = []
for _ in range(cycles + 1):
    torch.cuda.synchronize()
    began = time.perf_counter()
    saver.pause()
    torch.cuda.synchronize()
    paused = time.perf_counter()
    saver.resume()
    torch.cuda.synchronize()
    spans.append(((paused - began) * 1e3, (time.perf_counter() - paused) * 1e3))
print(json.dumps({"first": sum(spans[0]), "park": [p for p, _ in spans[1:]],
                  "restore": [r for _, r in spans[1:]],
                  "intact": all(torch.equal(t, r) for t, r in zip(state, reference))}),
      flush=True)
# Freeing the region's memory outside a region aborts torch_memory_saver (tms_torch_free checks
# that it is in one), and interpreter teardown would do that: leave without it.
os._exit(0)
"""


def memory_saver_cycles(tensors: int, width: int, *, retain: bool, cycles: int = 5,
                        timeout: float = 300) -> dict | str:
    """Park and restore ``tensors`` float32 tensors of ``width`` x ``width`` with
    torch_memory_saver (``pause``/``resume`` of a region with a CPU backup, keeping that
    backup between cycles with ``retain``), in a new Python process (notebook 14). Returns
    {"first", "park", "restore" (ms per cycle), "intact"}, or why it could not run: the
    package is missing, or the process failed (its last line of error)."""
    import subprocess

    try:
        done = subprocess.run(
            [sys.executable, "-c", _MEMORY_SAVER_RUN, "1" if retain else "0", str(tensors),
             str(width), str(cycles)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"torch_memory_saver did not finish in {timeout:.0f} s"
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        return ("torch_memory_saver is not installed (pip install torch_memory_saver)"
                if "No module named 'torch_memory_saver'" in done.stderr else last[:200])
    return json.loads(done.stdout.strip().splitlines()[-1])
