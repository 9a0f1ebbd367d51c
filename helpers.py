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
9. Check-up          moved to checkup.py, beside this module (notebooks 09 and 13, whose
                     set-up cells fetch it too); it imports this module, never the reverse
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
# 9. Check-up: what a training step spends on moving data, in checkup.py (notebooks 09, 13)
# --------------------------------------------------------------------------------------------


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


def _shard_path(directory: str, file: str) -> str:
    """Where an index's shard name points: "a" and "./a" are one file, read once."""
    return os.path.normpath(os.path.join(directory, file))


def _checkpoint_sources(source) -> tuple[list[str], dict[str, str] | None]:
    """``checkpoint_files(source)``, and the index's weight_map where ``source`` is one."""
    named = isinstance(source, (str, os.PathLike))
    weight_map = None
    if not named:
        files = [os.fspath(p) for p in source]
    elif os.fspath(source).endswith(".json"):
        weight_map = _weight_map(source)
        directory = os.path.dirname(os.fspath(source))
        files = list(dict.fromkeys(_shard_path(directory, name) for name in weight_map.values()))
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
    shard_of: dict[str, str] = {}
    for layout in layouts:
        if not isinstance(layout.structure, dict):
            raise ValueError(f"{layout.files[0]} is no {{name: tensor}} dict: not a shard")
        base = len(stored)  # the number of this file's first storage
        for name, value in layout.structure.items():
            if name in structure:
                raise ValueError(f"{name!r} is in two shards: {shard_of[name]} and "
                                 f"{layout.files[0]}")
            shard_of[name] = layout.files[0]
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
    as_named: dict[str, str] = {}  # a shard's path: the name the index first gives it
    for file in weight_map.values():
        as_named.setdefault(_shard_path(directory, file), file)
    held = _shard_of_each_tensor(layouts)
    for name, file in weight_map.items():
        if name not in held:
            raise ValueError(f"{index} names tensor {name!r} in shard {file}, but no shard holds"
                             f" it (the shards: {', '.join(as_named.values())})")
        if held[name] != _shard_path(directory, file):
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
      (page faults map the file's pages in; PyTorch's intra-op pool does the copy, with at
      most ``MAX_THREADS`` of its threads while the loader reads). A torch
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
        threads = torch.get_num_threads()
        if self._pool is None:
            # Through the mapping, copy_ faults the file's pages in on every intra-op thread at
            # once, and many threads contend: notebook 12's mmap loader took 2,134 ms warm with
            # 64 of them on a 64-CPU host, 92.6 ms there with the cap of 8
            torch.set_num_threads(min(threads, self.MAX_THREADS))

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
            torch.set_num_threads(threads)
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
