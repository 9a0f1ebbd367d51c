"""Unit tests of helpers.py; parts that need a GPU are skipped, with the reason, without CUDA."""

import itertools
import math
import os
import threading
import time

import pytest
import torch

import helpers

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


def _untouched_pages(nbytes: int):
    """``nbytes`` of anonymous memory mapped for the caller alone, not one page of it touched.

    A tensor or array is no such memory: glibc's malloc may hand out pages an earlier test
    wrote and freed. Its mmap threshold is dynamic: once a block larger than it, up to 32 MiB,
    is freed, blocks of that size come from the heap, which keeps what is freed (a 16 MiB
    ``torch.ones`` then took no page fault at all). Transparent huge pages are refused, so
    that every 4 KiB page faults once and a first touch counts thousands of faults, far from
    any stray fault of another thread."""
    import mmap

    pages = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return pages


def _until(condition, timeout_s: float = 30.0) -> bool:
    """Wait until ``condition()`` holds, as long as a loaded host needs (up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# ---------------------------------------------------------------------------- environment


def test_pcie_link_rates_per_direction():
    assert helpers.pcie_link_gbps(5, 16) == pytest.approx(63.0, abs=0.05)
    assert helpers.pcie_link_gbps(4, 16) == pytest.approx(31.5, abs=0.05)
    assert helpers.pcie_link_gbps(3, 16) == pytest.approx(15.75, abs=0.05)
    assert helpers.pcie_link_gbps(1, 1) == pytest.approx(0.25)
    assert helpers.pcie_link_gbps(None, 16) is None
    assert helpers.pcie_link_gbps(5, None) is None
    assert helpers.pcie_link_gbps(9, 16) is None


def test_environment_report_prints_a_compact_table(capsys):
    env = helpers.environment_report()
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["torch", "GPU", "host", "host"]
    assert env["torch"] == torch.__version__
    assert env["host_ram_gib"] > 0
    assert env["cuda_available"] == torch.cuda.is_available()


def test_environment_report_names_the_cpus_this_process_may_use_where_fewer(monkeypatch):
    env = {**helpers.environment(), "cpu_count": 16, "usable_cpus": 2}
    assert "16 CPUs, 2 usable by this process, " in helpers.format_environment(env)
    env["usable_cpus"] = 16
    assert "16 CPUs, " + str(env["host_ram_gib"]) in helpers.format_environment(env)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert helpers.environment()["usable_cpus"] == 2  # as under taskset -c 0,1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a CPU-only machine")
def test_environment_without_cuda_degrades_gracefully():
    env = helpers.environment()
    assert env["gpu"] is None and env["link_gbps"] is None
    assert "none visible" in helpers.format_environment(env)


@needs_cuda
def test_environment_with_cuda_reads_the_gpu_and_its_link():
    env = helpers.environment()
    assert env["gpu"] == torch.cuda.get_device_name()
    assert env["gpu_memory_gib"] > 1
    assert env["link_gbps"] is None or env["link_gbps"] > 0.2
    assert env["copy_engines"] is None or env["copy_engines"] >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the guard only fires without CUDA")
def test_cuda_guard_stops_with_one_actionable_line(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    with pytest.raises(helpers.CUDARequired) as raised:
        helpers.require_cuda()
    rendered = raised.value._render_traceback_()
    assert len(rendered) == 1 and "NVIDIA GPU" in rendered[0]
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    with pytest.raises(helpers.CUDARequired, match="Runtime > Change runtime type"):
        helpers.require_cuda()


@needs_cuda
def test_cuda_guard_passes_with_cuda():
    assert helpers.require_cuda().type == "cuda"


def test_gpu_count_guard_names_what_the_notebook_needs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(helpers.CUDARequired) as raised:
        helpers.require_gpus(2)
    assert "needs 2 GPUs" in raised.value._render_traceback_()[0]
    assert helpers.require_gpus(1) == [torch.device("cuda", 0)]


# Two GPUs on one host: how they are connected.

#: nvidia-smi topo -m on the 2 x H200 host of notebook 10's committed run (as it printed it).
TOPOLOGY_H200 = (
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\t0-31\t0\t\tN/A\nGPU1\tNV18\t X \t0-31\t0\t\tN/A\n\nLegend:\n\n"
    "  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between "
    "NUMA nodes (e.g., QPI/UPI)\n  PIX  = Connection traversing at most a single PCIe bridge\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n\n")
#: A four-GPU host: one NVLink pair, a PCIe switch, two sockets, and a NIC column and row.
TOPOLOGY_FOUR = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV4\tPIX\tSYS\tPIX\t0-15\t0\t\tN/A\n"
    "GPU1\tNV4\t X \tPHB\tSYS\tPHB\t0-15\t0\t\tN/A\n"
    "GPU2\tPIX\tPHB\t X \tNODE\tPIX\t0-15\t0\t\tN/A\n"
    "GPU3\tSYS\tSYS\tNODE\t X \tSYS\t16-31\t1\t\tN/A\n"
    "NIC0\tPIX\tPHB\tPIX\tSYS\t X \n\nLegend:\n\n  X    = Self\n  PIX  = one bridge\n")


def test_the_topology_matrix_is_read_cell_by_cell():
    assert helpers.parse_topology_matrix(TOPOLOGY_H200) == {(0, 1): "NV18", (1, 0): "NV18"}
    cells = helpers.parse_topology_matrix(TOPOLOGY_FOUR)
    assert cells[(0, 1)] == cells[(1, 0)] == "NV4"
    assert cells[(0, 2)] == "PIX" and cells[(1, 2)] == "PHB" and cells[(2, 3)] == "NODE"
    assert cells[(3, 0)] == "SYS" and (0, 0) not in cells and len(cells) == 12
    assert all(0 <= a <= 3 and 0 <= b <= 3 for a, b in cells)  # no NIC column or row
    spaced = TOPOLOGY_FOUR.replace("\t", "    ")  # columns padded with spaces, not tabs
    assert helpers.parse_topology_matrix(spaced) == cells
    assert helpers.parse_topology_matrix("NVIDIA-SMI has failed") == {}
    assert helpers.parse_topology_matrix("") == {}


@pytest.mark.parametrize("cell, kind, nvlink, shares_switch, own_links", [
    ("NV4", "nvlink", True, False, False), ("PIX", "pcie_switch", False, True, False),
    ("PXB", "pcie_switch", False, True, False), ("PHB", "pcie_cpu", False, False, True),
    ("NODE", "pcie_cpu", False, False, True), ("SYS", "pcie_cpu", False, False, True),
    ("SOC", "pcie_cpu", False, False, True), ("???", "unknown", None, False, False)])
def test_a_gpu_link_is_classified_from_its_matrix_cell(cell, kind, nvlink, shares_switch,
                                                         own_links):
    link = helpers.link_from_matrix_cell(cell, peer_access=kind != "pcie_cpu")
    assert (link.kind, link.nvlink) == (kind, nvlink)
    assert link.shares_pcie_switch == shares_switch and link.separate_host_links == own_links
    assert ("NVLink (4 links)" in str(link)) == (kind == "nvlink")
    assert str(link).endswith(f"peer access: {'no' if kind == 'pcie_cpu' else 'yes'} "
                              "(from nvidia-smi topo -m)")


def test_a_gpu_link_names_the_pcie_path_and_says_what_it_does_not_know():
    switch = helpers.GpuLink(True, False, None, "PIX", "NVML")
    assert switch.kind == "pcie_switch" and "meet at one PCIe switch" in str(switch)
    both = helpers.GpuLink(True, True, 18, "PHB", "NVML")  # NVLink, and each its own host link
    assert both.kind == "nvlink" and both.separate_host_links and not both.shares_pcie_switch
    assert "NVLink (18 links)" in str(both) and "host bridge" in str(both)
    unknown = helpers.GpuLink(False, None, None, None, "nothing")
    assert unknown.kind == "unknown" and not unknown.shares_pcie_switch
    assert not unknown.separate_host_links  # unknown is not evidence of separate links
    assert "NVLink unknown" in str(unknown) and "an unreported place" in str(unknown)


class FakeNVML:
    """Stands in for the pynvml module: two GPUs found by PCI address, fixture answers."""

    NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK, NVML_NVLINK_MAX_LINKS = 2, 0, 36

    class NVMLError(Exception):
        pass

    def __init__(self, p2p_status=0, active_links=18, ancestor=30, fail=None):
        self.p2p_status, self.active_links, self.ancestor = p2p_status, active_links, ancestor
        self.fail, self.calls = fail or set(), []

    def _call(self, name):
        self.calls.append(name)
        if name in self.fail:
            raise self.NVMLError(name)

    def nvmlInit(self):
        self._call("init")

    def nvmlShutdown(self):
        self._call("shutdown")

    def nvmlDeviceGetHandleByPciBusId(self, address):
        self._call("handle")
        return {"0000:18:00.0": "gpu-a", "0000:2a:00.0": "gpu-b"}[address]

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        self._call("p2p")
        assert (a, b, index) == ("gpu-a", "gpu-b", self.NVML_P2P_CAPS_INDEX_NVLINK)
        return self.p2p_status

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= 18:  # an H200 has 18 links; NVML refuses to answer for more
            raise self.NVMLError("invalid argument")
        return int(link < self.active_links)

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        self._call("ancestor")
        return self.ancestor


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """CUDA devices 0 and 1 at two PCI addresses, with peer access, and no nvidia-smi."""
    addresses = {0: "0000:18:00.0", 1: "0000:2a:00.0"}
    monkeypatch.setattr(helpers, "pci_address", addresses.get)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(helpers, "tool_output", lambda *command, timeout=30: None)

    def install(nvml):
        monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
        return nvml

    return install


def test_nvml_tells_nvlink_its_active_links_and_the_pcie_path(two_fake_gpus):
    nvml = two_fake_gpus(FakeNVML())
    link = helpers.gpu_link(0, 1)
    assert link == helpers.GpuLink(True, True, 18, "PHB", "NVML")
    assert nvml.calls[0] == "init" and nvml.calls[-1] == "shutdown"
    switch = two_fake_gpus(FakeNVML(p2p_status=4, ancestor=10))  # no NVLink, one switch
    assert helpers.gpu_link(0, 1) == helpers.GpuLink(True, False, None, "PIX", "NVML")
    assert "p2p" in switch.calls
    unsure = two_fake_gpus(FakeNVML(fail={"p2p", "ancestor"}))  # NVML cannot say
    assert helpers.gpu_link(0, 1) == helpers.GpuLink(True, None, None, None, "NVML")
    assert unsure.calls[-1] == "shutdown"


def test_without_nvml_the_link_comes_from_nvidia_smi_in_its_own_numbering(two_fake_gpus,
                                                                            monkeypatch):
    two_fake_gpus(FakeNVML(fail={"init"}))  # a driver without NVML: the matrix instead
    answers = {"--query-gpu=index,pci.bus_id": "0, 00000000:2A:00.0\n1, 00000000:18:00.0\n",
               "topo": TOPOLOGY_FOUR}  # nvidia-smi's GPU0 is CUDA's device 1, and back

    def fake_tool(*command, timeout=30):
        return answers.get(command[1]) if command[0] == "nvidia-smi" else None

    monkeypatch.setattr(helpers, "tool_output", fake_tool)
    assert helpers.gpu_link(0, 1) == helpers.link_from_matrix_cell("NV4", True)
    monkeypatch.setattr(helpers, "pci_address", {0: "0000:18:00.0"}.get)  # 2: no address
    assert helpers.gpu_link(0, 2).pcie_path == "PHB"  # nvidia-smi's GPU1 and, unmatched, GPU2
    two_fake_gpus(FakeNVML(fail={"handle"}))  # NVML there, but it knows neither GPU
    monkeypatch.setattr(helpers, "tool_output", lambda *command, timeout=30: None)
    assert helpers.gpu_link(0, 1) == helpers.GpuLink(True, None, None, None, "nothing")


def test_tool_output_is_none_when_the_tool_is_missing_or_fails():
    assert helpers.tool_output("echo", "topology") == "topology\n"
    assert helpers.tool_output("no-such-tool-here") is None
    assert helpers.tool_output("false") is None


def test_numa_nodes_and_the_hypervisor_flag_are_read_from_the_system(tmp_path):
    for node, cpus in ((1, "16-31"), (0, "0-15"), (10, "64-79")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node
    assert helpers.numa_nodes(tmp_path) == {0: "0-15", 1: "16-31", 10: "64-79"}
    assert helpers.numa_nodes(tmp_path / "absent") == {}
    bare = "processor\t: 0\nflags\t\t: fpu vme sse sse2 avx2\nprocessor\t: 1\n"
    assert helpers.in_virtual_machine(bare) is False
    assert helpers.in_virtual_machine(bare.replace("avx2", "avx2 hypervisor")) is True
    assert helpers.in_virtual_machine("Features\t: fp asimd evtstrm\n") is False
    assert helpers.in_virtual_machine("model name\t: a hypervisor-free CPU\n") is False
    assert helpers.in_virtual_machine() in (True, False)  # this machine's own /proc/cpuinfo


@needs_cuda
def test_pci_address_is_written_the_way_linux_lists_devices():
    import re

    address = helpers.pci_address(0)
    assert address is None or re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.0", address)
    node = helpers.gpu_numa_node(0)
    assert node is None or node >= -1


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="requires 2 GPUs")
def test_gpu_link_reads_this_hosts_two_gpus():
    link = helpers.gpu_link(0, 1)
    both_ways = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    assert link.peer_access == both_ways
    assert link.kind in ("nvlink", "pcie_switch", "pcie_cpu", "unknown")
    assert link.source in ("NVML", "nvidia-smi topo -m", "nothing")
    address = helpers.pci_address(1)
    assert address is None or len(address.split(":")) == 3
    assert helpers.gpu_numa_node(1) is None or helpers.gpu_numa_node(1) >= -1


# ---------------------------------------------------------------------------- Colab set-up


def test_colab_install_pins_the_installed_torch_and_never_installs_torch():
    command = helpers.pip_install_command(["tensordict"], "/tmp/pins.txt")
    assert command[-1] == "tensordict"
    assert command[command.index("-c") + 1] == "/tmp/pins.txt"
    for spec in ("torch", "torch>=2.11", "torch==2.11.0"):
        with pytest.raises(ValueError):
            helpers.pip_install_command([spec], "/tmp/pins.txt")


def test_colab_setup_does_nothing_elsewhere(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert helpers.colab_setup(["a_package_that_does_not_exist"]) == []


def test_missing_packages():
    assert helpers.missing_packages(["json", "a_package_that_does_not_exist"]) == [
        "a_package_that_does_not_exist"]


# ---------------------------------------------------------------------------- timing


def test_timing_statistics():
    timing = helpers.Timing((4.0, 1.0, 3.0, 2.0, 5.0), "test")
    assert timing.median_ms == 3.0
    assert (timing.q1_ms, timing.q3_ms, timing.iqr_ms) == (2.0, 4.0, 2.0)
    assert timing.gbps(3_000_000) == pytest.approx(1.0)
    assert "3 ms median" in str(timing) and "n=5" in str(timing)
    assert "us" in str(helpers.Timing((0.05,), "test"))


def test_bandwidth_is_decimal_gigabytes_per_second():
    assert helpers.bandwidth_gbps(10**9, 1000.0) == 1.0
    assert helpers.bandwidth_gbps(2**30, 20.0) == pytest.approx(53.687, rel=1e-4)


def test_time_host_counts_calls_and_measures_the_call(monkeypatch):
    calls = []

    def sleep_2ms():
        calls.append(1)
        time.sleep(0.002)

    timing = helpers.time_host(sleep_2ms, sync=True, warmup=2, repeat=5)
    assert len(calls) == 7 and len(timing.samples_ms) == 5
    # a sleep never ends early; a loaded host can stretch it, not 250-fold (ms, not s or us)
    assert 2.0 <= timing.median_ms < 500
    assert timing.method == "host clock, synchronised"
    assert helpers.time_host(sleep_2ms, sync=False, repeat=3).method == "host clock, no sync"
    # what is timed, on a clock that only the calls move (a slow spell of the host cannot):
    # setup takes 10 s of it, the call 0.25 s
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def advance(name, seconds):
        def call():
            calls.append(name)
            now[0] += seconds
        return call

    calls.clear()
    timing = helpers.time_host(advance("fn", 0.25), sync=False, warmup=1, repeat=2,
                               setup=advance("setup", 10.0))
    assert calls == ["setup", "fn", "setup", "fn", "setup", "fn"]
    assert timing.samples_ms == (250.0, 250.0)  # the call, and nothing of setup


def test_benchmark_uses_torch_utils_benchmark():
    timing = helpers.benchmark(lambda: time.sleep(0.001), min_run_time=0.05)
    assert timing.method == "torch.utils.benchmark"
    # a sleep never ends early; a loaded host can stretch it, not 500-fold (ms, not s or us)
    assert 1.0 <= timing.median_ms < 500 and len(timing.samples_ms) >= 1


@needs_cuda
def test_cuda_events_see_queued_device_work():
    timing = helpers.time_cuda(lambda: helpers.gpu_busy(5.0), warmup=1, repeat=5)
    assert 3.0 < timing.median_ms < 8.0
    assert helpers.time_host(lambda: helpers.gpu_busy(5.0), sync=False).median_ms < 1.0


@needs_cuda
def test_sync_probe_tells_a_synchronising_call_from_an_asynchronous_one():
    x = torch.ones(1000, device="cuda")
    item = helpers.sync_probe(lambda: x.sum().item(), busy_ms=30)
    add = helpers.sync_probe(lambda: x + 1, busy_ms=30)  # its first call may wait: see docstring
    assert item.blocked and item.warned
    assert not add.blocked and not add.warned
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


# ---------------------------------------------------------------------------- profiling


def _event(cat, name, ts, dur, stream, nbytes=None):
    args = {"stream": stream, **({"bytes": nbytes} if nbytes else {})}
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": args}


SYNTHETIC_TRACE = {"traceEvents": [
    {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 1, "ts": 50, "dur": 9},
    _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000.0, 400.0, 13, 1 << 20),
    _event("kernel", "void some_kernel<float>()", 1100.0, 200.0, 7),
    _event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 1500.0, 100.0, 7, 4096),
    _event("gpu_memset", "Memset (Device)", 1600.0, 1.0, 7),
    _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1700.0, 10.0, 7),
    {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1000, "id": 1},
]}


def test_parse_chrome_trace_keeps_device_activity_per_stream():
    acts = helpers.parse_chrome_trace(SYNTHETIC_TRACE)
    assert [a.kind for a in acts] == ["H2D", "kernel", "D2H", "memset", "D2D"]
    h2d = acts[0]
    assert (h2d.stream, h2d.start_us, h2d.end_us, h2d.nbytes) == (13, 0.0, 400.0, 1 << 20)
    assert acts[1].stream == 7 and acts[1].duration_us == 200.0
    assert helpers.parse_chrome_trace([]) == []


HOST_AND_RUNTIME_TRACE = [
    {"ph": "X", "cat": "user_annotation", "name": "enqueue", "pid": 1, "tid": 1, "ts": 900,
     "dur": 50},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 1, "ts": 910,
     "dur": 5},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 1, "ts": 920,
     "dur": 5},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 1,
     "ts": 930, "dur": 500},
    {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "pid": 1, "tid": 1, "ts": 940,
     "dur": 3},
    {"ph": "i", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 950},
    _event("kernel", "void some_kernel<float>()", 1000.0, 200.0, 7),
]


def test_host_spans_from_record_function_get_their_own_lane():
    acts = helpers.parse_chrome_trace(HOST_AND_RUNTIME_TRACE)
    host = [a for a in acts if a.kind == "host"]
    assert [(a.stream, a.name, a.start_us, a.end_us) for a in host] == [
        (helpers.HOST_LANE, "enqueue", 0.0, 50.0)]
    kernel = next(a for a in acts if a.kind == "kernel")
    assert kernel.start_us == 100.0  # one clock for host and device
    assert helpers.overlap_fraction(acts + _spans(("H2D", 0, 100))) == 0.0  # host spans: no work


def test_runtime_calls_counts_cuda_api_calls_only():
    calls = helpers.runtime_calls({"traceEvents": HOST_AND_RUNTIME_TRACE})
    assert calls == {"cudaMemcpyAsync": 2, "cudaStreamSynchronize": 1, "cuLaunchKernel": 1}
    assert helpers.runtime_calls(SYNTHETIC_TRACE) == {}


def _spans(*spans):
    return [helpers.Activity(0, kind, kind, s, e) for kind, s, e in spans]


def test_overlap_fraction():
    assert helpers.overlap_fraction(_spans(("H2D", 0, 10), ("kernel", 0, 10))) == 1.0
    assert helpers.overlap_fraction(_spans(("H2D", 0, 10), ("kernel", 10, 20))) == 0.0
    assert helpers.overlap_fraction(_spans(("H2D", 0, 10), ("kernel", 5, 20))) == 0.5
    # copies are a union: two overlapping copies count once; two kernels likewise
    acts = _spans(("H2D", 0, 10), ("D2H", 5, 20), ("kernel", 0, 4), ("kernel", 2, 6))
    assert helpers.overlap_fraction(acts) == pytest.approx(6 / 20)
    assert helpers.overlap_fraction(acts, copy_kinds=("D2H",)) == pytest.approx(1 / 15)
    with pytest.raises(ValueError):
        helpers.overlap_fraction(_spans(("kernel", 0, 1)))


def test_overlap_between_two_kinds_is_a_share_of_the_shorter():
    together = _spans(("H2D", 0, 10), ("D2H", 1, 8))
    assert helpers.overlap_between(together) == 1.0  # the D2H ran entirely during the H2D
    assert helpers.overlap_between(_spans(("H2D", 0, 10), ("D2H", 10, 20))) == 0.0
    assert helpers.overlap_between(_spans(("H2D", 0, 10), ("D2H", 5, 25))) == 0.5
    # each kind is a union; kernels do not count
    acts = _spans(("H2D", 0, 4), ("H2D", 2, 6), ("D2H", 5, 9), ("kernel", 0, 9))
    assert helpers.overlap_between(acts) == pytest.approx(1 / 4)
    assert helpers.overlap_between(acts, "kernel", "D2H") == 1.0
    with pytest.raises(ValueError):
        helpers.overlap_between(_spans(("H2D", 0, 1), ("kernel", 0, 1)))


def test_copy_gbps_is_bytes_over_the_time_in_flight():
    acts = [helpers.Activity(0, "H2D", "c", 0.0, 10.0, 10**6),
            helpers.Activity(1, "H2D", "c", 5.0, 20.0, 10**6),  # in flight with the first
            helpers.Activity(0, "D2H", "c", 0.0, 1000.0, 1)]
    assert helpers.copy_gbps(acts, "H2D") == pytest.approx(2e6 / 20e-6 / 1e9)
    with pytest.raises(ValueError):
        helpers.copy_gbps(acts, "D2D")


@needs_cuda
def test_profile_activities_sees_a_side_stream_copy_overlap_a_kernel():
    src = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    side = torch.cuda.Stream()

    def work():
        helpers.gpu_busy(20)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    acts = helpers.profile_activities(work)
    assert {a.kind for a in acts} >= {"H2D", "kernel"}
    assert any(a.nbytes == src.numel() for a in acts if a.kind == "H2D")
    assert helpers.overlap_fraction(acts) > 0.9


@needs_cuda
def test_profile_trace_counts_the_sync_of_a_blocking_copy():
    src = torch.ones(1 << 20, dtype=torch.uint8).pin_memory()

    def copies(non_blocking):
        with torch.profiler.record_function("copies"):
            for _ in range(5):
                src.to("cuda", non_blocking=non_blocking)

    blocking = helpers.profile_trace(lambda: copies(False))
    non_blocking = helpers.profile_trace(lambda: copies(True))
    assert helpers.runtime_calls(blocking)["cudaMemcpyAsync"] == 5
    assert helpers.runtime_calls(blocking)["cudaStreamSynchronize"] == 5
    assert helpers.runtime_calls(non_blocking)["cudaStreamSynchronize"] == 0
    assert [a.name for a in helpers.parse_chrome_trace(blocking) if a.kind == "host"] == [
        "copies"]


def test_profile_all_threads_records_the_work_of_other_threads():

    side_ids = []

    def side():
        side_ids.append(threading.get_native_id())
        with torch.profiler.record_function("in side thread"):
            torch.ones(64).add_(1)

    def work():
        thread = threading.Thread(target=side)
        thread.start()
        thread.join()
        with torch.profiler.record_function("in main thread"):
            torch.ones(64).mul_(2)

    trace = helpers.profile_all_threads(work, warmup=0)
    found = {e["name"]: e["tid"] for e in trace["traceEvents"]
             if e.get("ph") == "X" and e.get("cat") == "user_annotation"}
    assert set(found) == {"in main thread", "in side thread"}
    # each thread's work under its own id, the OS's (the name the profiler gives a thread that
    # has ended is not reliable: it can be read after the thread is gone)
    assert found["in main thread"] == threading.get_native_id()
    assert found["in side thread"] == side_ids[0]


# ---------------------------------------------------------------------------- figures


def test_timeline_figure_is_saved_deterministically(tmp_path):
    acts = helpers.parse_chrome_trace(SYNTHETIC_TRACE)
    paths = []
    for name in ("a", "b"):
        fig = helpers.plot_timeline(acts, title="synthetic", stream_names={7: "default"})
        helpers.save_figure(fig, name, directory=tmp_path)
        paths.append(tmp_path / f"{name}.png")
        helpers.plt.close(fig)
    first, second = (p.read_bytes() for p in paths)
    assert paths[0].name == "a.png" and first[:8] == b"\x89PNG\r\n\x1a\n"
    assert first == second
    assert b"matplotlib" not in first.lower()  # no version string, no timestamp


def test_plot_timelines_shares_one_time_axis(tmp_path):
    acts = helpers.parse_chrome_trace(SYNTHETIC_TRACE)
    host = helpers.parse_chrome_trace(HOST_AND_RUNTIME_TRACE)
    fig = helpers.plot_timelines({"first": acts, "second": host, "third": acts}, columns=2,
                                 stream_names={7: "default"}, title="three")
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["first", "second", "third"]
    assert len({ax.get_xlim() for ax in visible}) == 1
    assert "host" in [t.get_text() for t in visible[1].get_yticklabels()]
    helpers.save_figure(fig, "three", directory=tmp_path)
    helpers.plt.close(fig)
    assert (tmp_path / "three.png").stat().st_size > 0


def _lane_labels(fig):
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_timeline_lanes_are_named_for_their_work_not_the_profilers_stream_id():
    acts = [helpers.Activity(7, "kernel", "conv", 0, 900),
            helpers.Activity(13, "H2D", "Memcpy HtoD", 0, 300),
            helpers.Activity(21, "H2D", "Memcpy HtoD", 100, 400),
            helpers.Activity(21, "kernel", "normalise", 400, 450),
            helpers.Activity(helpers.HOST_LANE, "host", "step", 0, 900)]
    fig = helpers.plot_timeline(acts)
    assert _lane_labels(fig) == ["host", "compute", "H2D copies", "H2D copies + kernels"]
    helpers.plt.close(fig)
    # a name the caller gives wins over the lane's work
    fig = helpers.plot_timeline(acts, stream_names={13: "prefetch copies"})
    assert _lane_labels(fig)[2] == "prefetch copies"
    helpers.plt.close(fig)


def test_back_to_back_copies_stay_separate_bars(tmp_path):
    # two copies with no gap between them: one bar each, in alternating shades, so that "copy
    # k+1 under step k" can be seen (a single shade drew them as one bar, issue 48)
    acts = [helpers.Activity(13, "H2D", "Memcpy HtoD", 0, 500),
            helpers.Activity(13, "H2D", "Memcpy HtoD", 500, 1000),
            helpers.Activity(7, "kernel", "k", 0, 1000)]
    fig = helpers.plot_timeline(acts, stream_names={13: "prefetch copies", 7: "compute"})
    copies = [c for c in fig.axes[0].collections
              if tuple(c.get_facecolor()[0][:3]) != helpers.matplotlib.colors.to_rgb(
                  helpers.KIND_COLORS["kernel"])]
    assert sum(len(c.get_paths()) for c in copies) == 2
    assert len({tuple(c.get_facecolor()[0]) for c in copies}) == 2
    helpers.save_figure(fig, "copies", directory=tmp_path)
    helpers.plt.close(fig)
    # a batch of images and labels: the labels' small copy keeps its images' shade, and the next
    # batch's images take the other one
    batches = [helpers.Activity(13, "H2D", "images", 0, 500),
               helpers.Activity(13, "H2D", "labels", 500, 505),
               helpers.Activity(13, "H2D", "images", 505, 1005)]
    assert helpers._copy_turns(batches) == [0, 0, 1]


def test_nested_host_spans_get_one_label_not_two_overprinted():
    acts = [helpers.Activity(helpers.HOST_LANE, "host", "checkup: step", 0, 10_000),
            helpers.Activity(helpers.HOST_LANE, "host", "checkup: next batch", 0, 9_000),
            helpers.Activity(7, "kernel", "k", 0, 20_000)]
    fig = helpers.plot_timeline(acts)
    assert [t.get_text() for t in fig.axes[0].texts] == ["checkup: step"]
    helpers.plt.close(fig)


def test_plot_timings_writes_each_bar_over_the_reference_on_a_linear_axis():
    fig = helpers.plot_timings({"no sync": 0.0134, "events": 2.66}, log=False, ratios=True,
                               reference=(2.66, " device time"))
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    labels = [t.get_text() for t in ax.texts]
    assert labels == [" 0.0134 ms (1/199 of device time)", " 2.66 ms (1.00x device time)"]
    helpers.plt.close(fig)


def test_the_four_clocks_figure_draws_its_199x_gap_on_a_linear_axis():
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "notebooks" / "00_timing_async_work.ipynb"
    nb = json.loads(path.read_text())
    [cell] = [c for c in nb["cells"] if "00_timing_four_clocks" in "".join(c["source"])]
    source = "".join(cell["source"])
    assert "log=False" in source and "ratios=True" in source


# ---------------------------------------------------------------------------- results and claims


@pytest.fixture
def fresh_measurements(monkeypatch):
    monkeypatch.setattr(helpers, "MEASUREMENTS", {})
    return helpers.MEASUREMENTS


def test_record_shows_and_keeps_a_value(fresh_measurements, capsys):
    helpers.record("copy_ms", 1.23456, "ms", "one copy", headline=True)
    assert capsys.readouterr().out == "one copy: 1.23 ms\n"
    assert fresh_measurements["copy_ms"] == {"key": "copy_ms", "value": 1.23456, "unit": "ms",
                                             "label": "one copy", "headline": True}
    helpers.record("speedup", 7.0, "x", "speed-up")
    assert capsys.readouterr().out == "speed-up: 7x\n"
    helpers.record("faults", 65536, "", "faults")
    assert capsys.readouterr().out == "faults: 65,536\n"


def test_answer_shows_the_result_beside_the_readers_guess_and_how_close(fresh_measurements,
                                                                       capsys):
    helpers.record("underreport", 143.2, "x", "the clock under-reports by")
    capsys.readouterr()
    helpers.answer("underreport", 10)
    assert capsys.readouterr().out == ("Answer: the clock under-reports by: 143x (your guess "
                                       "10x, off by 14.3x: the result is 14x your guess)\n")
    helpers.answer("underreport", 120)
    assert "(your guess 120x, close: the result is 1.2x your guess)" in capsys.readouterr().out
    helpers.answer("underreport", 250, name="my_guess_first")
    assert "within a factor of two: the result is 0.57x" in capsys.readouterr().out
    helpers.answer("underreport", name="my_guess_first")
    assert "(no guess typed in my_guess_first)" in capsys.readouterr().out
    helpers.record("wrong", 0, "", "reads wrong")
    capsys.readouterr()
    helpers.answer("wrong", 3)
    assert "(your guess 3, -3 from your guess)" in capsys.readouterr().out
    with pytest.raises(KeyError):
        helpers.answer("never_recorded", 1)


def test_an_empty_prediction_stops_run_all_in_one_line_unless_no_reader_types(monkeypatch):
    monkeypatch.delenv(helpers.GUESSES, raising=False)
    with pytest.raises(helpers.GuessNeeded) as stopped:
        helpers.expect_guess(None, "my_guess_launch")
    assert stopped.value._render_traceback_() == [
        "Predict first: type your guess into my_guess_launch above (replace None with a "
        "number), then run this cell again"]
    helpers.expect_guess(1.5, "my_guess")  # typed: nothing to say
    monkeypatch.setenv(helpers.GUESSES, "skip")  # nbval and committed runs
    helpers.expect_guess(None, "my_guess")


def test_a_claim_that_fails_on_a_readers_machine_says_so_in_one_line_and_goes_on(
        fresh_measurements, capsys, monkeypatch):
    monkeypatch.delenv(helpers.STRICT_CLAIMS, raising=False)
    helpers.record("fast_ms", 1.0, "ms", "fast")
    helpers.record("slow_ms", 10.0, "ms", "slow")
    capsys.readouterr()
    helpers.claim("fast is under a tenth of slow", "fast_ms", "<", "slow_ms", factor=0.05)
    shown = capsys.readouterr().out
    assert shown.count("\n") == 1 and shown.startswith("claim does not hold on this machine (")
    assert "fast is under a tenth of slow: fast_ms = 1, < 0.05 x 10 is false" in shown
    assert _nbval_sanitized(shown) != _nbval_sanitized(
        "claim holds: fast is under a tenth of slow\n")  # nbval, comparing, still fails
    monkeypatch.setenv(helpers.STRICT_CLAIMS, "1")  # committed runs, and pytest (conftest)
    with pytest.raises(helpers.ClaimFailed):
        helpers.claim("fast is under a tenth of slow", "fast_ms", "<", "slow_ms", factor=0.05)


def test_claim_holds_or_stops_with_one_line(fresh_measurements, capsys):
    helpers.record("fast_ms", 1.0, "ms", "fast")
    helpers.record("slow_ms", 10.0, "ms", "slow")
    capsys.readouterr()
    helpers.claim("fast is under a fifth of slow", "fast_ms", "<", "slow_ms", factor=0.2)
    assert capsys.readouterr().out == "claim holds: fast is under a fifth of slow\n"
    helpers.claim("fast is over half a millisecond", "fast_ms", ">", 0.5)
    with pytest.raises(helpers.ClaimFailed) as failed:
        helpers.claim("fast is under a tenth of slow", "fast_ms", "<", "slow_ms", factor=0.05)
    assert len(failed.value._render_traceback_()) == 1
    assert "fast is under a tenth of slow" in str(failed.value)
    with pytest.raises(ValueError):
        helpers.claim("nonsense", "fast_ms", "!=", "slow_ms")


def _nbval_sanitized(text: str) -> str:
    """``text`` as nbval compares it: the project's sanitize file, applied as nbval applies it."""
    import re

    from nbval.plugin import get_sanitize_patterns

    patterns = get_sanitize_patterns((helpers.ROOT / "tests" / "sanitize.cfg").read_text())
    assert len(patterns) >= 3, "tests/sanitize.cfg lost a regex/replace pair nbval can read"
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    return text


def test_a_host_dependent_claim_reads_the_same_to_nbval_where_it_applies_or_not(
        fresh_measurements, capsys):
    helpers.record("peer_over_host", 14.3, "x", "a peer copy beats the host by")
    capsys.readouterr()
    statement = "over NVLink, a peer copy is at least 3x faster than the trip through the host"
    helpers.claim_where(statement, "peer_over_host", ">=", 3, applies=True,
                        reason="no NVLink between these 2 GPUs")
    where_it_applies = capsys.readouterr().out
    helpers.claim_where(statement, "peer_over_host", ">=", 3, applies=False,
                        reason="no NVLink between these 2 GPUs")
    where_it_does_not = capsys.readouterr().out
    # the reader sees which ...
    assert where_it_applies == f"claim holds: {statement}\n"
    assert where_it_does_not == (f"claim not tested here (no NVLink between these 2 GPUs): "
                                 f"{statement}\n")
    # ... and nbval compares the same text, which still tells one claim from another
    assert _nbval_sanitized(where_it_applies) == _nbval_sanitized(where_it_does_not) \
        == "claim: over NVLink, a peer copy is at least Nx faster than the trip through the host\n"
    assert _nbval_sanitized(where_it_applies) != _nbval_sanitized("claim holds: other\n")
    plain = "claim holds: a claim of helpers.claim\n"  # every other claim reads as before
    assert _nbval_sanitized(plain) == "claim: a claim of helpers.claim\n"


def test_a_host_dependent_claim_that_applies_and_fails_still_fails(fresh_measurements):
    helpers.record("peer_over_host", 1.8, "x", "a peer copy beats the host by")
    with pytest.raises(helpers.ClaimFailed, match="at least 3x"):
        helpers.claim_where("over NVLink, a peer copy is at least 3x faster", "peer_over_host",
                            ">=", 3, applies=True, reason="no NVLink")
    # where it does not apply, nothing is evaluated: the measurement need not even exist
    helpers.claim_where("peer copies beat the host", "never_recorded", ">", 1, applies=False,
                        reason="no peer access")
    for reason in ("", "two\nlines", "odd): text"):  # a reason nbval's sanitizer can read
        with pytest.raises(ValueError, match="reason"):
            helpers.claim_where("x", "peer_over_host", ">", 1, applies=False, reason=reason)
    with pytest.raises(ValueError, match="op must be"):
        helpers.claim_where("x", "peer_over_host", "==", 1, applies=False, reason="r")


def test_evaluate_claim_reads_recorded_values():
    measured = {"a": {"value": 2.0}, "b": {"value": 3.0}}
    assert helpers.evaluate_claim({"lhs": "a", "op": "<", "rhs": "b", "factor": 1.0}, measured)
    assert not helpers.evaluate_claim({"lhs": "a", "op": ">=", "rhs": "b", "factor": 1.0},
                                      measured)
    assert helpers.evaluate_claim({"lhs": "b", "op": ">", "rhs": 2.5, "factor": 1.0}, measured)
    assert math.isclose(measured["a"]["value"], 2.0)


def test_plot_timings_draws_timings_and_plain_numbers(tmp_path):
    fig = helpers.plot_timings({"a": helpers.Timing((1.0, 2.0, 3.0), "t"), "b": 0.5},
                               title="t", reference=(2.0, "ref"))
    ax = fig.axes[0]
    assert [p.get_width() for p in ax.patches] == [2.0, 0.5]
    assert ax.get_xscale() == "log"
    helpers.plt.close(fig)


@needs_cuda
def test_stream_lane_id_names_the_profiler_lane():
    side = torch.cuda.Stream()
    src = torch.ones(1 << 20, device="cuda")

    def work():
        with torch.cuda.stream(side):
            src.mul_(2)
        torch.cuda.current_stream().wait_stream(side)

    acts = helpers.profile_activities(work)
    assert {a.stream for a in acts if a.kind == "kernel"} == {helpers.stream_lane_id(side)}


@needs_cuda
def test_per_step_ms_times_the_steady_state_step():
    alone = helpers.time_cuda(lambda: helpers.gpu_busy(1.0)).median_ms
    per_step = helpers.per_step_ms(lambda: range(12), lambda _: helpers.gpu_busy(1.0), runs=2)
    assert abs(per_step - alone) <= 0.1 * alone, (per_step, alone)
    with pytest.raises(ValueError, match="leaves none to time"):
        helpers.per_step_ms(lambda: range(4), lambda _: helpers.gpu_busy(0.1), skip=2, tail=1)


def test_interleaved_step_ms_takes_the_loops_in_turn(monkeypatch):
    log, times = [], iter(range(100))

    def fake_epoch(make_batches, step, *, skip, tail):
        log.append((make_batches(), skip, tail))
        return float(next(times))

    monkeypatch.setattr(helpers, "epoch_step_ms", fake_epoch)
    loops = {"a": (lambda: "a", None), "b": (lambda: "b", None)}
    per_round = helpers.interleaved_step_ms(loops, rounds=2, warmup=1, skip=3, tail=1,
                                            after=lambda name: log.append(name))
    assert log == [("a", 3, 1), "a", ("b", 3, 1), "b"] * 3
    assert per_round == {"a": [2.0, 4.0], "b": [3.0, 5.0]}  # warm-up round dropped


def test_interleaved_gated_pairs_the_cases_round_by_round(monkeypatch):
    order, times = [], iter([9.0, 9.0, 4.0, 2.0, 6.0, 3.0])

    def fake_time_gated(fn, streams, *, gate_ms):
        order.append((fn(), len(streams), gate_ms))
        return next(times)

    monkeypatch.setattr(helpers, "time_gated", fake_time_gated)
    timings = helpers.interleaved_gated({"serial": (lambda: "s", ["one"]),
                                         "parallel": (lambda: "p", ["one", "two"])},
                                        rounds=2, warmup=1, gate_ms=1.5)
    assert order == [("s", 1, 1.5), ("p", 2, 1.5)] * 3
    assert timings["serial"].samples_ms == (4.0, 6.0)
    assert timings["parallel"].samples_ms == (2.0, 3.0)
    assert "gated" in timings["serial"].method


@needs_cuda
def test_epoch_step_ms_times_one_epoch_of_steps():
    alone = helpers.time_cuda(lambda: helpers.gpu_busy(1.0)).median_ms
    per_step = helpers.epoch_step_ms(lambda: range(12), lambda _: helpers.gpu_busy(1.0))
    assert abs(per_step - alone) <= 0.1 * alone, (per_step, alone)
    with pytest.raises(ValueError, match="leaves none to time"):
        helpers.epoch_step_ms(lambda: range(4), lambda _: helpers.gpu_busy(0.1), skip=2, tail=1)


@needs_cuda
def test_time_gated_does_not_see_the_host_late_between_launches():
    first, second = torch.cuda.Stream(), torch.cuda.Stream()

    def two_streams():
        with torch.cuda.stream(first):
            helpers.gpu_busy(2.0)
        time.sleep(0.01)  # the host is 10 ms late with the second launch
        with torch.cuda.stream(second):
            helpers.gpu_busy(2.0)

    ms = helpers.time_gated(two_streams, [first, second], gate_ms=30.0)
    assert 1.5 < ms < 5.0, ms  # both ran at once, from the gate's end


def test_interleaved_timings_take_turns_in_blocks_and_time_only_the_blocks():
    log = []

    def make(name, seconds=0.0):
        def fn():
            log.append(name)
            time.sleep(seconds)
        return fn

    timings = helpers.interleaved_timings({"a": make("a", 0.002), "b": make("b")}, rounds=2,
                                          block=3, settle=1, warmup=1)
    assert log == ["a", "b"] + (["a"] * 4 + ["b"] * 4) * 2  # warm-up, then settle + block
    assert [len(t.samples_ms) for t in timings.values()] == [2, 2]
    assert min(timings["a"].samples_ms) >= 2.0  # per call: a sleep never ends early
    assert timings["a"].method == "host clock, synchronised, in turns"


def test_ratios_by_round_pair_the_rounds():
    slow = helpers.Timing((4.0, 6.0, 9.0), "test")
    fast = helpers.Timing((2.0, 3.0, 3.0), "test")
    assert helpers.ratios_by_round(slow, fast) == [2.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="numbers of rounds"):
        helpers.ratios_by_round(slow, helpers.Timing((1.0,), "test"))


def test_format_bytes():
    assert [helpers.format_bytes(n) for n in (512, 4096, 3 << 20, 1 << 30)] == [
        "512 B", "4 KiB", "3 MiB", "1 GiB"]


def test_bandwidth_sweep_times_each_copy_at_each_size(monkeypatch, capsys):
    made = []

    def fake_time_cuda(fn, *, warmup, repeat):
        fn()
        return helpers.Timing((1.0,) * repeat, "fake")

    monkeypatch.setattr(helpers, "time_cuda", fake_time_cuda)
    copies = {"a": lambda n: (made.append(("a", n)) or (lambda: None)),
              "b": lambda n: (made.append(("b", n)) or (lambda: None))}
    results = helpers.bandwidth_sweep([1000, 2000], copies, repeat=3)
    assert made == [("a", 1000), ("b", 1000), ("a", 2000), ("b", 2000)]
    assert [t.gbps(2000) for t in results["b"]] == [0.002, 0.002]
    assert len(capsys.readouterr().out.splitlines()) == 2
    fig = helpers.plot_sweep([1000, 2000], results, link_gbps=1.0, title="t")
    assert len(fig.axes[0].lines) == 3
    helpers.plt.close(fig)


def test_sustained_rate_takes_a_high_quantile_per_round_and_sizes_in_turn(monkeypatch):
    order = []
    times = itertools.cycle([4.0, 1.0, 2.0, 3.0])  # ms: each call times these four copies

    def fake_time_cuda(fn, *, warmup, repeat):
        fn()
        return helpers.Timing(tuple(next(times) for _ in range(repeat)), "fake")

    monkeypatch.setattr(helpers, "time_cuda", fake_time_cuda)

    def make(nbytes):
        return lambda: order.append(nbytes)

    rates = helpers.sustained_rate_gbps(make, [10**6, 2 * 10**6], rounds=2, repeat=4,
                                        quantile=1.0)
    assert order == [10**6, 2 * 10**6] * 2  # rounds interleave the sizes
    # quantile 1.0 of the rates is the fastest copy: 1 ms
    assert rates == {10**6: [1.0, 1.0], 2 * 10**6: [2.0, 2.0]}
    median = helpers.sustained_rate_gbps(make, [10**6], rounds=1, repeat=4, quantile=0.5)
    assert median[10**6] == [pytest.approx(10**6 / 2.5e-3 / 1e9)]


def test_fault_probe_counts_first_touch_page_faults():
    import numpy as np

    block = np.frombuffer(_untouched_pages(64 << 20), dtype=np.uint8)  # no page touched yet
    first = helpers.fault_probe(lambda: block.fill(1))
    second = helpers.fault_probe(lambda: block.fill(2))
    assert first.minor_faults >= (64 << 20) // (2 << 20)  # at least one per 2 MiB huge page
    assert second.minor_faults < first.minor_faults / 10
    assert "page faults" in str(first)
    assert helpers.fault_probe(lambda: 42).result == 42


def test_memlock_limit_is_readable():
    assert helpers.memlock_limit() == "unlimited" or helpers.memlock_limit().endswith("KiB")


@needs_cuda
def test_pinned_pool_rounds_up_and_caches_until_emptied():
    # torch.cuda.host_memory_stats() reads {} until CUDA is initialised, which pinning alone does
    # not do: run first in a process, this test read 0 bytes pinned (an H200 host, torch 2.11)
    torch.cuda.init()
    helpers.empty_pinned_cache()
    before = helpers.pinned_pool()["held_bytes"]
    block = torch.empty(5 << 20, dtype=torch.uint8, pin_memory=True)
    assert helpers.pinned_pool()["held_bytes"] - before == 8 << 20  # next power of two
    del block
    assert helpers.pinned_pool()["held_bytes"] - before == 8 << 20  # cached, not returned
    helpers.empty_pinned_cache()
    assert helpers.pinned_pool()["held_bytes"] == before


def test_time_host_memcpy_restores_the_thread_count():
    before = torch.get_num_threads()
    timing = helpers.time_host_memcpy(1 << 20, threads=1, pinned_destination=False, repeat=3)
    assert torch.get_num_threads() == before
    assert len(timing.samples_ms) == 3 and timing.gbps(1 << 20) > 0
    assert "1 thread" in timing.method


def test_worker_count_leaves_a_cpu_for_the_main_process(monkeypatch):
    monkeypatch.setattr(helpers, "usable_cpus", lambda: 16)
    assert helpers.worker_count(4) == 4
    monkeypatch.setattr(helpers, "usable_cpus", lambda: 2)
    assert helpers.worker_count(4) == 1
    monkeypatch.setattr(helpers, "usable_cpus", lambda: 1)
    assert helpers.worker_count(4) == 1


def test_child_processes_and_memory_watch_see_a_child_and_its_memory():
    import subprocess
    import sys

    watch = helpers.MemoryWatch(interval_s=0.02)
    baseline = watch.sample()
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; b = bytearray(300 << 20); "
                              "print('ready', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in helpers.child_processes()
        # the child's 300 MiB, written, count: the watch's own thread sees them (on a loaded
        # host it may wait a while to run, and a sample may take long)
        assert _until(lambda: watch.peak_mib - baseline > 250), watch.peak_mib - baseline
    finally:
        child.kill()
        child.wait()
    assert child.pid not in helpers.child_processes()
    peak = watch.stop()
    assert peak == watch.peak_mib and watch.kernel_peak_mib > 0


# ---------------------------------------------------------------------------- batches


Pair = __import__("collections").namedtuple("Pair", "image label")


def _nested_batch():
    return {"pair": Pair(torch.arange(4.0), torch.tensor([1])),
            "list": [torch.ones(2, 2), ("name", 7)], "plain": torch.zeros(3)}


def test_map_tensors_keeps_every_container_type():
    moved = helpers.map_tensors(lambda t: t * 2, _nested_batch())
    assert type(moved) is dict and isinstance(moved["pair"], Pair)
    assert type(moved["list"]) is list and moved["list"][1] == ("name", 7)
    assert torch.equal(moved["pair"].image, torch.arange(4.0) * 2)
    assert torch.equal(moved["list"][0], torch.full((2, 2), 2.0))

    class Batch(dict):
        pass

    assert type(helpers.map_tensors(lambda t: t, Batch(x=torch.ones(1)))) is Batch


def test_prefetcher_yields_every_batch_in_order_and_stops():
    batches = [(torch.full((3,), float(k)), {"k": torch.tensor(k)}) for k in range(5)]
    got = list(helpers.Prefetcher(batches, "cpu"))
    assert [int(b[1]["k"]) for b in got] == list(range(5))
    assert list(helpers.Prefetcher([], "cpu")) == []
    assert len(helpers.Prefetcher(batches, "cpu")) == 5
    with pytest.raises(ValueError):
        helpers.Prefetcher(batches, "cpu", guard="hope")


def test_prefetcher_applies_the_transform():
    images = [torch.full((2,), 255, dtype=torch.uint8)]
    got = list(helpers.Prefetcher(images, "cpu", transform=lambda t: t.float() / 255))
    assert got[0].dtype == torch.float32 and torch.equal(got[0], torch.ones(2))


@needs_cuda
@pytest.mark.parametrize("guard", helpers.Prefetcher.GUARDS)
def test_prefetcher_delivers_right_values_while_the_consumer_is_slow(guard):
    n = 1 << 20
    sources = [(torch.full((n,), float(k), pin_memory=True),
                {"k": torch.tensor([k], pin_memory=True)}) for k in range(8)]

    def late(batch):  # the copy stream is busy: a missing wait would read unfinished data
        helpers.gpu_busy(2)
        return batch

    prefetcher = helpers.Prefetcher(sources, transform=late, guard=guard)
    for _epoch in range(2):  # the same prefetcher, and its one stream, twice
        sums = []
        for values, extra in prefetcher:
            helpers.gpu_busy(2)  # the consumer is slow: a reused block would be overwritten
            sums.append((values.sum(), extra["k"]))
            assert values.device.type == "cuda" and values.is_cuda
        torch.cuda.synchronize()
        assert [(s.item(), k.item()) for s, k in sums] == [(float(k * n), k) for k in range(8)]
    assert prefetcher.stream is not None
    assert list(helpers.Prefetcher([])) == []


@needs_cuda
def test_prefetcher_copies_the_next_batch_while_the_consumer_computes():
    batches = [torch.ones(16 << 20, pin_memory=True) for _ in range(4)]
    matrix = torch.randn(2048, 2048, device="cuda")
    prefetcher = helpers.Prefetcher(batches)

    def loop():
        for batch in prefetcher:
            for _ in range(20):
                matrix @ matrix
            batch.sum()

    assert helpers.overlap_fraction(helpers.profile_activities(loop), ("H2D",)) > 0.5


@needs_cuda
def test_sanitizer_verdict_reports_a_missing_wait_and_nothing_once_it_is_there():
    def side_stream(wait):
        def snippet():
            side = torch.cuda.Stream()
            values = torch.ones(1 << 20, device="cuda")
            side.wait_stream(torch.cuda.current_stream())  # the ones are written first
            with torch.cuda.stream(side):
                values.mul_(2)
            if wait:
                torch.cuda.current_stream().wait_stream(side)
            return values.sum().item()
        return snippet

    verdict, _ = helpers.sanitizer_verdict(side_stream(False))
    assert "data race" in verdict
    verdict, total = helpers.sanitizer_verdict(side_stream(True))
    assert verdict == "no report" and total == 2 * (1 << 20)


@needs_cuda
def test_sanitizer_verdict_leaves_no_handler_behind():
    from torch._utils import CallbackRegistry
    from torch.cuda import _gpu_trace

    def handlers():
        return [len(r.callback_list) for r in vars(_gpu_trace).values()
                if isinstance(r, CallbackRegistry)]

    helpers.sanitizer_verdict(lambda: torch.ones(4, device="cuda").sum().item())
    before = handlers()
    helpers.sanitizer_verdict(lambda: torch.ones(4, device="cuda").sum().item())
    assert handlers() == before


def test_benchmark_runs_with_the_process_intra_op_threads():
    # torch.utils.benchmark's Timer alone would run fn on one thread
    # a set, not a list: the autorange calls fn as often as the time allows (millions on a
    # fast host), and a list that long, freed, moved glibc's mmap threshold for the tests after
    before, seen = torch.get_num_threads(), set()
    torch.set_num_threads(3)
    try:
        helpers.benchmark(lambda: seen.add(torch.get_num_threads()), min_run_time=0.01)
    finally:
        torch.set_num_threads(before)
    assert seen == {3}


def test_format_transfer_shows_time_rate_and_time_over_each_bound():
    row = helpers.format_transfer("path", helpers.Timing((10.0, 20.0, 30.0), "t"), 10**9,
                                  {"fast bound": 10.0, "slow bound": 40.0}, width=6)
    assert row.startswith("path   ")
    assert "20.00 ms" in row and "50.00 GB/s" in row
    assert row.index("2.00x fast bound") < row.index("0.50x slow bound")
    assert helpers.format_transfer("p", 5.0, 10**9).endswith("200.00 GB/s")


# ---------------------------------------------------------------------------- offload hooks


def test_pinned_pool_reuses_a_buffer_per_element_count_and_dtype():
    pool = helpers.PinnedPool(2**20, pin=False)
    buffer, fences = pool.take(1000, torch.float32)
    assert fences == [] and buffer.shape == (1000,) and pool.allocations == 1
    pool.give(buffer, ["copied"])
    again, fences = pool.take(1000, torch.float32)
    assert again is buffer and fences == ["copied"] and pool.allocations == 1
    other, _ = pool.take(1000, torch.float16)  # same count, another dtype: another buffer
    assert other is not buffer and pool.allocations == 2
    assert pool.held_bytes == 1000 * 4 + 1000 * 2 and pool.free_bytes == 0


def test_pinned_pool_stays_within_its_bound():
    pool = helpers.PinnedPool(3500, pin=False)
    first, _ = pool.take(600, torch.float32)  # 2400 bytes
    pool.give(first, [])
    second, _ = pool.take(400, torch.float32)  # does not fit beside the free one: it goes
    assert pool.held_bytes == 1600 and pool.free_bytes == 0 and second.numel() == 400
    with pytest.raises(MemoryError, match="pinned pool"):
        pool.take(700, torch.float32)  # 1600 in use + 2800 > 3500, nothing free to drop
    pool.give(second, [])
    pool.clear()
    assert pool.held_bytes == 0 and pool.free_bytes == 0


def test_pinned_pool_counts_pinned_buffers_as_the_host_allocator_rounds_them(monkeypatch):
    assert [helpers.pinned_block_bytes(n) for n in (0, 1, 4096, 4097, 96 * 2**20)] == [
        0, 1, 4096, 8192, 128 * 2**20]
    empty = torch.empty  # no pinning on this machine: the pool's bookkeeping is what is tested
    monkeypatch.setattr(torch, "empty", lambda n, dtype, pin_memory: empty(n, dtype=dtype))
    pool = helpers.PinnedPool(200 * 2**20)
    pool.take(96 * 2**20, torch.uint8)
    assert (pool.asked_bytes, pool.held_bytes) == (96 * 2**20, 128 * 2**20)
    with pytest.raises(MemoryError, match="pinned pool"):
        pool.take(96 * 2**20 + 1, torch.uint8)  # asked, 192 MiB would fit; pinned, 256 do not


class _FakeEvent:
    def __init__(self, stream):
        self.stream = stream


class _FakeStream:
    """Stands in for a CUDA stream: notes every wait and event in a shared log."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record_event(self):
        event = _FakeEvent(self)
        self.log.append((self.name, "record", event))
        return event

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event))

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))


@pytest.fixture
def fake_streams(monkeypatch):
    """torch.cuda's streams and events replaced by _FakeStream, so that OffloadHooks runs on
    CPU tensors (device="cpu"); returns the log and the compute stream."""
    import contextlib

    log = []
    compute = _FakeStream("compute", log)
    current = [compute]
    names = iter(f"side{i}" for i in itertools.count())

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(next(names), log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: log.append((stream.name, "record_stream", self)))
    return log, compute


def _small_mlp(width=16, depth=3):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width),
                                                     torch.nn.GELU()) for _ in range(depth)))


def _grads(model, inputs, hooks=None):
    import contextlib

    model.zero_grad(set_to_none=True)
    with hooks if hooks is not None else contextlib.nullcontext():
        loss = model(inputs).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _offload_hooks(**kwargs):
    kwargs.setdefault("pool", helpers.PinnedPool(2**24, pin=False))
    return helpers.OffloadHooks("cpu", min_bytes=0, **kwargs)


def test_offload_hooks_keep_parameters_their_views_and_small_tensors(fake_streams):
    hooks = helpers.OffloadHooks("cpu", min_bytes=64, pool=helpers.PinnedPool(2**20, pin=False))
    weight = torch.nn.Parameter(torch.ones(8, 8))
    assert hooks.keeps(weight) and hooks.keeps(weight.t())
    assert hooks.keeps(torch.ones(4))  # 16 bytes < min_bytes
    assert hooks.keeps(torch.ones(64, device="meta"))  # not on the hooks' device
    assert not hooks.keeps(torch.ones(64)) and not hooks.keeps(weight * 2)
    assert hooks.unpack(hooks.pack(weight)) is not weight  # detached, same memory
    assert hooks.unpack(hooks.pack(weight)).data_ptr() == weight.data_ptr()


def test_offload_hooks_give_the_same_gradients_and_reuse_their_buffers(fake_streams):
    model, inputs = _small_mlp(), torch.randn(32, 16)
    reference = _grads(model, inputs)
    hooks = _offload_hooks()
    for _ in range(3):
        grads = _grads(model, inputs, hooks)
        assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
    # x; per layer, its GELU's input and its output (the next layer's input, or what the loss
    # squares): 7 activations of 32x16
    assert hooks.offloaded_bytes == 7 * 32 * 16 * 4
    assert hooks.pool.allocations == 7  # allocated in the first step, reused after
    assert hooks.pool.free_bytes == hooks.pool.held_bytes == 7 * 32 * 16 * 4
    assert not hooks._held


def test_offload_hooks_wait_for_each_copy_and_prefetch_ahead(fake_streams):
    log, compute = fake_streams
    model, inputs = _small_mlp(), torch.randn(32, 16)
    hooks = _offload_hooks(in_flight=1, prefetch=2)
    slots, held, asked = [], [], []
    pack, unpack = hooks.pack, hooks.unpack

    def packing(tensor):
        saved = pack(tensor)
        if isinstance(saved, helpers._Saved):  # not a tensor kept as it is
            slots.append(saved.slot)
        held.append(len(hooks._held))
        return saved

    def unpacking(packed):
        if isinstance(packed, helpers._Saved):
            slot = packed.slot
            asked.append((slot, slot.back is not None, slot.gpu is not None))
        return unpack(packed)

    hooks.pack_hook, hooks.unpack_hook = packing, unpacking
    _grads(model, inputs, hooks)
    d2h, h2d = hooks.d2h.name, hooks.h2d.name
    assert len(slots) == 7 and max(held) == 1  # never more than in_flight held on the "GPU"
    for slot in slots:
        copy_at = log.index((d2h, "record", slot.copied))
        assert (d2h, "wait_stream", "compute") in log[:copy_at]
    # every activation the hooks let go of: the compute stream waited for its copy first
    let_go = [s for s in slots if s.arrived is not None]
    assert len(let_go) == 6  # the last one stayed on the "GPU" and came back as it was
    for slot in let_go:
        assert ("compute", "wait_event", slot.copied) in log
        fetched_at = log.index((h2d, "record", slot.arrived))
        assert (h2d, "wait_event", slot.copied) in log[:fetched_at]
        assert ("compute", "wait_event", slot.arrived) in log[fetched_at:]
    assert [s.index for s, _, _ in asked] == [6, 5, 4, 3, 2, 1, 0]  # backward asks in reverse
    assert asked[0][2]  # still held: it came back as it was, and was held for its copy out
    assert not any(what == "record_stream" for _, what, _ in log)  # it holds blocks back
    assert all(ready for _, ready, _ in asked[1:])  # each was on its way back before it was asked


def test_pinned_pool_counts_nothing_for_a_buffer_it_failed_to_allocate(monkeypatch):
    pool = helpers.PinnedPool(2**20, pin=False)

    def fails(*args, **kwargs):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(torch, "empty", fails)
    with pytest.raises(RuntimeError, match="cudaHostAlloc"):
        pool.take(1000, torch.float32)
    assert pool.held_bytes == 0 and pool.allocations == 0


def test_offload_hooks_give_the_buffer_back_when_packing_fails(fake_streams):
    import gc

    hooks = _offload_hooks()

    def fails(other):
        raise RuntimeError("no stream")

    hooks.d2h.wait_stream = fails
    with pytest.raises(RuntimeError, match="no stream"):
        hooks.pack(torch.ones(64))
    gc.collect()
    assert hooks.pool.held_bytes == hooks.pool.free_bytes == 64 * 4
    assert not hooks._held


def test_offload_hooks_stop_at_the_bound_of_their_pool(fake_streams):
    model, inputs = _small_mlp(), torch.randn(32, 16)
    hooks = _offload_hooks(pool=helpers.PinnedPool(3 * 32 * 16 * 4, pin=False))
    with pytest.raises(MemoryError, match="pinned pool"):
        _grads(model, inputs, hooks)


def test_offload_hooks_make_the_asking_stream_wait_before_freeing_what_it_never_asked_for(
        fake_streams):
    # A storage prefetched but never unpacked (autograd.grad on a middle tensor, an error mid-
    # backward) is freed with no wait on its copy back: the finalizer queues that wait on the
    # stream whose pool the memory returns to, and only for what was never asked for.
    import gc

    log, _ = fake_streams
    hooks = _offload_hooks(in_flight=0, prefetch=2)
    saved = [hooks.pack(torch.randn(8, 8)) for _ in range(3)]
    hooks.unpack(saved[2])  # brings back blocks 1 and 0 too, ahead of their unpacking
    arrived = [s.slot.arrived for s in saved]
    asked_waits = [e for stream, what, e in log if (stream, what) == ("compute", "wait_event")]
    assert [any(e is a for e in asked_waits) for a in arrived] == [False, False, True]
    mark = len(log)
    del saved
    gc.collect()
    freed_waits = [e for stream, what, e in log[mark:]
                   if (stream, what) == ("compute", "wait_event")]
    assert [any(e is a for e in freed_waits) for a in arrived] == [True, True, False]
    assert not any(what == "record_stream" for _, what, _ in log)


def test_offload_hooks_order_the_reuse_of_a_held_storage_after_its_copy_out(fake_streams):
    # A storage backward asks for while the hooks still hold it comes back as it is, its copy out
    # perhaps still reading it. Nothing is held back on the host: when it goes, the stream whose
    # pool it returns to waits for that copy, so that no later use of the memory overtakes it.
    import gc

    log, _ = fake_streams
    hooks = _offload_hooks(in_flight=1)
    saved = hooks.pack(torch.randn(8, 8))
    copied = saved.slot.copied
    back = hooks.unpack(saved)
    assert back.data_ptr() == saved.slot.back.data_ptr()
    waits = [e for stream, what, e in log if (stream, what) == ("compute", "wait_event")]
    assert not any(e is copied for e in waits)  # backward itself does not wait for it
    del saved, back
    gc.collect()
    waits = [e for stream, what, e in log if (stream, what) == ("compute", "wait_event")]
    assert any(e is copied for e in waits)


def test_offload_hooks_copy_a_storage_once_however_many_views_are_saved(fake_streams):
    hooks = _offload_hooks()
    wide, row = torch.randn(8, 16), torch.randn(16)
    views = (wide, wide.t(), wide[:, ::2], wide[2:5], row.expand(8, 16))
    with hooks:
        saved = [hooks.pack(view) for view in views]
    assert hooks.offloaded_bytes == wide.numel() * 4 + row.numel() * 4  # each storage once
    assert len({id(s.slot) for s in saved[:4]}) == 1 and saved[4].slot is not saved[0].slot
    for packed, view in zip(saved, views, strict=True):
        back = hooks.unpack(packed)
        assert torch.equal(back, view) and back.stride() == view.stride()
        assert back.storage_offset() == view.storage_offset()


def test_offload_hooks_copy_a_storage_again_once_it_was_written(fake_streams):
    hooks = _offload_hooks(in_flight=0)
    activation = torch.randn(64)
    with hooks:
        first = hooks.pack(activation)
        activation.add_(1)  # in place: the first copy no longer holds what a new save needs
        second = hooks.pack(activation)
    assert second.slot is not first.slot and torch.equal(hooks.unpack(second), activation)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        hooks.unpack(first)


class _Masked(torch.nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.register_buffer("mask", (torch.arange(width) % 2).float())

    def forward(self, x):
        return self.linear(x) * self.mask  # mul saves the mask, for the linear output's gradient


def test_offload_hooks_leave_the_buffers_of_their_module_where_they_are(fake_streams):
    model, batch = _Masked(), torch.randn(4, 64)
    for hooks, mask_travels in ((_offload_hooks(), True), (_offload_hooks(module=model), False)):
        with hooks.keep(batch):
            loss = model(batch).sum()
        loss.backward()
        assert hooks.offloaded_bytes == (64 * 4 if mask_travels else 0)


def test_offload_hooks_make_side_streams_for_each_device(fake_streams):
    hooks = _offload_hooks()
    assert hooks.side_streams(torch.device("cpu")) == (hooks.d2h, hooks.h2d)
    other = hooks.side_streams(torch.device("meta"))
    assert other != (hooks.d2h, hooks.h2d) and hooks.side_streams(torch.device("meta")) == other


def _frozen_after_trainable(width=16):
    torch.manual_seed(0)
    frozen = torch.nn.Linear(width, width).requires_grad_(False)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), frozen)


def test_offload_hooks_keep_frozen_parameters_and_the_tensors_the_caller_names(fake_streams):
    model, batch = _frozen_after_trainable(), torch.randn(32, 16)
    hooks = _offload_hooks()
    frozen = model[2].weight
    assert hooks.keeps(frozen) and hooks.keeps(frozen.t())  # a parameter, trained or not
    assert not hooks.keeps(batch)  # a leaf that needs no gradient, like a frozen layer's output
    with hooks.keep(batch):
        assert hooks.keeps(batch) and hooks.keeps(batch.t()) and hooks.keeps(batch.detach())
        assert not hooks.keeps(batch.clone())
    assert not hooks.keeps(batch)  # named for one step: forgotten when its block ends
    trained = [p for p in model.parameters() if p.requires_grad]
    reference = torch.autograd.grad(model(batch).square().sum(), trained)
    with hooks.keep(batch):
        loss = model(batch).square().sum()
    grads = torch.autograd.grad(loss, trained)
    assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
    # the batch (saved for the first weight's gradient) and the frozen layer's weight.t() stay;
    # the GELU's input and the frozen layer's output travel
    assert hooks.offloaded_bytes == 2 * 32 * 16 * 4


def test_offload_hooks_offload_what_frozen_layers_output(fake_streams):
    torch.manual_seed(0)
    backbone = _small_mlp(depth=2).requires_grad_(False)
    head, batch = torch.nn.Linear(16, 16), torch.randn(32, 16)
    hooks = _offload_hooks()
    with hooks.keep(batch):
        features = backbone(batch)  # no gradient flows back there: nothing saved, no grad_fn
        assert features.is_leaf and not features.requires_grad
        loss = head(features).square().sum()
    loss.backward()
    assert not hooks.keeps(features)
    assert hooks.offloaded_bytes == 2 * 32 * 16 * 4  # the head's input and its output


def test_offload_hooks_bring_back_the_strides_they_saved(fake_streams):
    hooks = _offload_hooks(in_flight=0)  # let go at once: what comes back is the host copy
    for saved in (torch.randn(6, 4).t(), torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1),
                  torch.randn(8, 6)[2:5]):
        back = hooks.unpack(hooks.pack(saved))
        assert torch.equal(back, saved) and back.stride() == saved.stride()
        assert back.storage_offset() == saved.storage_offset()


def _transposed_chain(x, weights):
    h = x
    for w in weights:
        h = torch.tanh(h.t() @ w)  # mm saves h.t(), a transposed view, for w's gradient
    return h.square().sum()


def test_offload_hooks_match_gradients_through_transposed_activations(fake_streams):
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    weights = [torch.nn.Parameter(torch.randn(*shape)) for shape in ((6, 5), (4, 3), (5, 7))]
    reference = torch.autograd.grad(_transposed_chain(x, weights), weights)
    for in_flight in (0, 3):
        with _offload_hooks(in_flight=in_flight) as hooks:
            loss = _transposed_chain(x, weights)
        assert hooks.offloaded_bytes > 0
        grads = torch.autograd.grad(loss, weights)
        assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))


def _scaled(x, w, hooks=None, *, write=None):
    import contextlib

    w.grad = None
    with hooks if hooks is not None else contextlib.nullcontext():
        y = x * w  # saves x for w's gradient, and w for x's
    if write is not None:
        with torch.no_grad():
            write.add_(100)  # in place, after the save
    y.sum().backward()
    return w.grad


@pytest.mark.parametrize("in_flight", [3, 1, 0])
@pytest.mark.parametrize("written", ["activation", "parameter"])
def test_offload_hooks_raise_on_an_in_place_write_to_a_saved_tensor(fake_streams, in_flight,
                                                                   written):
    def fresh():  # w is saved only for x's gradient
        x = torch.ones(64, requires_grad=written == "parameter")
        w = torch.nn.Parameter(torch.ones(64))
        return x, w, (x if written == "activation" else w)

    x, w, _ = fresh()
    assert torch.equal(_scaled(x, w, _offload_hooks(in_flight=in_flight)), _scaled(x, w))
    x, w, target = fresh()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _scaled(x, w, write=target)  # autograd's own check, without hooks
    x, w, target = fresh()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: "
                       r"\[torch\.float32 \[64\] on cpu\] is at version 1; expected version 0"):
        _scaled(x, w, _offload_hooks(in_flight=in_flight), write=target)



def test_offload_hooks_check_versions_without_holding_what_they_let_go(fake_streams):
    from torch.multiprocessing.reductions import StorageWeakRef

    hooks = _offload_hooks(in_flight=0)
    activation = torch.randn(64)
    memory = StorageWeakRef(activation.untyped_storage())
    slot = hooks.pack(activation)
    activation.mul_(2)  # seen through the slot's counter, which shares no memory with it
    del activation
    assert memory.expired()  # let go of at once: nothing the slot keeps holds that memory
    with pytest.raises(RuntimeError, match="is at version 1; expected version 0"):
        hooks.unpack(slot)

@needs_cuda
def test_offload_hooks_on_the_gpu_match_and_use_less_memory():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(256, 256),
                                                      torch.nn.GELU()) for _ in range(6))).cuda()
    inputs = torch.randn(4096, 256, device="cuda")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    hooks = helpers.OffloadHooks(min_bytes=0, in_flight=1, prefetch=1, max_pinned_bytes=2**28)
    try:
        peaks, grads = [], []
        for offload in (None, hooks, hooks):  # the second run of the hooks reuses their pool
            _grads(model, inputs, offload)
            torch.cuda.synchronize()
            model.zero_grad(set_to_none=True)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads.append(_grads(model, inputs, offload))
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for grad, reference in zip(grads[2], grads[0], strict=True):
        assert torch.allclose(grad, reference, rtol=1e-5, atol=1e-7)
    assert peaks[2] < 0.6 * peaks[0], peaks
    assert hooks.pool.allocations == 13  # x, and per layer its GELU's input and its output


@needs_cuda
def test_offload_hooks_on_the_gpu_free_no_memory_a_copy_back_still_writes():
    # autograd.grad on a middle tensor asks for the last activation only; the two before it are
    # prefetched into memory that goes back to the allocator with the graph, while their copies
    # wait behind a sleep on the H2D stream. Zeros allocated then on the compute stream, which
    # waits for nothing, are written long before those copies run: if they got that memory,
    # the copies overwrite them.
    numel = 2**22  # 16 MiB: from 10 MiB up each tensor is a segment of its own, an exact fit
    hooks = helpers.OffloadHooks(min_bytes=0, in_flight=1, prefetch=2, max_pinned_bytes=2**28)

    def grad_of_a_middle_activation():
        x = torch.randn(numel, device="cuda")
        w = torch.nn.Parameter(torch.randn(numel, device="cuda"))
        with hooks:
            h1 = x * w  # saves x (slot 0), for w's gradient
            h2 = h1.sin()  # saves h1 (slot 1)
            h3 = h2.sin()  # saves h2 (slot 2)
            loss = h3.sin().sum()  # saves h3 (slot 3), still held on the GPU: no wait for it
        with torch.cuda.stream(hooks.h2d):
            helpers.gpu_busy(50)  # every copy back runs 50 ms from now
        # slot 3 comes back as it is, slots 2 and 1 are prefetched, and backward stops at h3
        return torch.autograd.grad(loss, [h3])[0]  # the graph, and their memory, go here

    for trial in range(3):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the only free blocks are those this trial frees
        grad = grad_of_a_middle_activation()
        free_blocks = (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) // (4 * numel)
        zeros = [torch.zeros(numel, device="cuda") for _ in range(free_blocks + 2)]
        torch.cuda.synchronize()
        assert grad.abs().sum() > 0
        written = [i for i, z in enumerate(zeros) if z.count_nonzero().item()]
        assert not written, f"trial {trial}: {len(written)} of {len(zeros)} zeros overwritten"
        del grad, zeros


@needs_cuda
def test_offload_hooks_on_the_gpu_reserve_about_what_they_allocate():
    # The host runs four steps ahead of the GPU (a sleep queued first). Blocks marked with
    # record_stream for the H2D stream would wait, once freed, for every copy queued there by
    # then, later steps' included: the allocator reserves new ones (3.4x in the issue's repro).
    # Memory held on the host's side until a copy is done would pile up the same way.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                      torch.nn.GELU()) for _ in range(6))).cuda()
    inputs = torch.randn(8192, 1024, device="cuda")  # 32 MiB activations
    hooks = helpers.OffloadHooks(min_bytes=0, max_pinned_bytes=2**31)
    peaks = {}
    for name, offload in (("plain", None), ("hooks", hooks)):
        for _ in range(2):
            _grads(model, inputs, offload and offload.keep(inputs))
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        helpers.gpu_busy(200)
        for _ in range(4):
            _grads(model, inputs, offload and offload.keep(inputs))
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base,
                       torch.cuda.max_memory_reserved() - base)
    (plain, _), (allocated, reserved) = peaks["plain"], peaks["hooks"]
    assert reserved <= 1.3 * allocated, {k: [v / 2**20 for v in p] for k, p in peaks.items()}
    assert allocated <= 0.8 * plain, {k: [v / 2**20 for v in p] for k, p in peaks.items()}


@needs_cuda
def test_offload_hooks_on_the_gpu_bring_back_slices_of_one_projection():
    # q, k and v sliced from one fused projection: one storage, offloaded once, three views back
    torch.manual_seed(0)
    project = torch.nn.Linear(256, 3 * 256).cuda()
    x = torch.randn(2048, 256, device="cuda")

    def loss_of():
        q, k, v = project(x).chunk(3, dim=-1)  # views with gaps: not dense
        return ((q * k).sigmoid() * v).square().sum()

    reference = torch.autograd.grad(loss_of(), list(project.parameters()))
    hooks = helpers.OffloadHooks(min_bytes=0, in_flight=0)
    with hooks.keep(x):
        loss = loss_of()
    grads = torch.autograd.grad(loss, list(project.parameters()))
    assert all(torch.allclose(g, r, rtol=1e-5, atol=1e-6) for g, r in zip(grads, reference,
                                                                           strict=True))
    # q, k, v (one storage, saved three times), the sigmoid's output (saved twice), and the
    # product that square saves; before, the slices stayed on the GPU whole
    assert hooks.offloaded_bytes == 2048 * 256 * 4 * (3 + 1 + 1)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="requires 2 GPUs")
def test_offload_hooks_on_a_second_gpu_copy_on_its_own_side_streams():
    torch.manual_seed(0)
    second = torch.device("cuda", 1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 512)).to(second)
    inputs = torch.randn(4096, 512, device=second)
    reference = _grads(model, inputs)
    hooks = helpers.OffloadHooks("cuda:0", min_bytes=0, module=model)
    with torch.cuda.device(second):  # the driver reads a stream's id in its own device's context
        trace = helpers.profile_activities(lambda: _grads(model, inputs, hooks.keep(inputs)))
        grads = _grads(model, inputs, hooks.keep(inputs))
    assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
    d2h, h2d = hooks.side_streams(second)
    assert d2h.device == h2d.device == second
    # the copies ran beside the kernels, on a stream none of them ran on (before: on the second
    # GPU's compute stream, the hooks' events recorded on the first GPU's side streams)
    kernels = {a.stream for a in trace if a.kind == "kernel"}
    copies = {a.stream for a in trace if a.kind == "D2H" and a.nbytes and a.nbytes >= 2**20}
    assert kernels and copies and not copies & kernels, (copies, kernels)


# ---------------------------------------------------------------------------- checkpoints


def _disk_backed(path) -> bool:
    return helpers.file_system(path) not in helpers.MEMORY_FILE_SYSTEMS


def _write(path, nbytes, seed=0):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return data


def _read(path):
    with open(path, "rb") as f:
        while f.read(2**20):
            pass


def test_file_system_names_the_mount_that_holds_a_path(tmp_path):
    assert helpers.file_system("/proc") == "proc"
    assert helpers.file_system("/proc/self/status") == "proc"  # the longest mount point wins
    assert helpers.file_system(tmp_path) not in ("unknown", "proc")


def test_the_page_cache_drops_a_file_whole_or_in_part(tmp_path):
    path = tmp_path / "data.bin"
    _write(path, 8 * 2**20)
    if not _disk_backed(path):
        pytest.skip(f"{helpers.file_system(path)} keeps its files in memory: nothing to evict")
    _read(path)
    assert helpers.page_cache_share(path) > 0.99
    assert helpers.evict_from_page_cache(path) < 0.05
    _read(path)
    half = helpers.evict_from_page_cache(path, 4 * 2**20, 4 * 2**20)  # the second half only
    assert 0.45 < half < 0.55


def test_an_in_memory_file_system_keeps_its_pages_and_the_eviction_says_so():
    shm = "/dev/shm"
    if not os.path.isdir(shm) or helpers.file_system(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    import tempfile

    with tempfile.NamedTemporaryFile(dir=shm) as f:
        f.write(b"x" * 2**20)
        f.flush()
        assert helpers.evict_from_page_cache(f.name) > 0.95


def test_io_probe_counts_first_touch_faults_and_what_comes_from_the_disk(tmp_path):
    def fill(pages):
        return torch.frombuffer(pages, dtype=torch.uint8).fill_(1)

    fill(_untouched_pages(16 * 2**20))  # the code and threads of a fill, ready: no major fault
    pages = _untouched_pages(16 * 2**20)
    fresh = helpers.io_probe(lambda: fill(pages))
    assert fresh.minor_faults >= 8 and fresh.major_faults == 0  # a page per 2 MiB at least
    assert fresh.result.sum().item() == 16 * 2**20 and "page faults" in str(fresh)
    path = tmp_path / "data.bin"
    _write(path, 8 * 2**20)
    if helpers._disk_read_bytes() is None or not _disk_backed(path):
        pytest.skip("this kernel does not count disk reads, or the file is in memory")
    helpers.evict_from_page_cache(path)
    cold = helpers.io_probe(lambda: _read(path))
    warm = helpers.io_probe(lambda: _read(path))
    assert cold.disk_bytes >= 0.9 * 8 * 2**20
    assert warm.disk_bytes < 2**20


def test_interleaved_runs_take_the_functions_in_turn_and_check_every_result():
    log = []

    def make(name):
        def fn():
            log.append(name)
            return name
        return fn

    runs = helpers.interleaved_runs({"a": make("a"), "b": make("b")}, rounds=2, warmup=1,
                                    before=lambda: log.append("before"),
                                    check=lambda name, result: result == "a")
    assert log == ["before", "a", "before", "b"] * 3
    assert [len(r.probes) for r in runs.values()] == [2, 2]
    assert runs["a"].ok is True and runs["b"].ok is False
    assert all(p.result is None for r in runs.values() for p in r.probes)
    assert len(runs["a"].timing.samples_ms) == 2 and runs["a"].median("major_faults") == 0
    unchecked = helpers.interleaved_runs({"a": make("a")}, rounds=1, warmup=0)
    assert unchecked["a"].ok is None


def test_host_memory_peak_sees_a_block_that_came_and_went():
    with helpers.HostMemoryPeak() as quiet:
        pass
    with helpers.HostMemoryPeak() as peak:
        block = torch.ones(64 * 2**20, dtype=torch.uint8)
        # until the sampling thread has seen it (on a loaded host it may wait to run)
        assert _until(lambda: peak._peak_kib - peak._anonymous_start >= 56 * 2**10)
        del block
    assert peak.anonymous_mib >= 56 and quiet.anonymous_mib < 16
    if peak.resident_mib is not None:
        assert peak.resident_mib >= 56 and quiet.resident_mib < 16


def test_host_memory_peak_has_no_resident_peak_where_the_kernel_kept_the_old_one(monkeypatch):
    status = helpers._status_kib  # a kernel that takes the write to clear_refs and ignores it
    monkeypatch.setattr(helpers, "_status_kib",
                        lambda name: status(name) + 2**20 if name == "VmHWM" else status(name))
    with helpers.HostMemoryPeak() as peak:
        pass
    assert peak.resident_mib is None and peak.anonymous_mib < 16


def _checkpoint(path):
    """A nested checkpoint with what a loader can get wrong: a storage shared by two tensors,
    views at an offset and transposed, an empty tensor, several dtypes, things that are not
    tensors."""
    import collections

    torch.manual_seed(0)
    base = torch.arange(1000, dtype=torch.float32)
    saved = {"model": collections.OrderedDict(w=torch.randn(300, 7), tied=base,
                                              view=base[100:350], t=torch.randn(40, 30).t()),
             "small": [torch.arange(7, dtype=torch.int16), torch.ones(3, dtype=torch.bfloat16)],
             "empty": torch.empty(0, 5), "step": 12, "name": "net"}
    torch.save(saved, path)
    return torch.load(path, weights_only=True)


def _same(loaded, reference):
    if isinstance(reference, torch.Tensor):
        return (isinstance(loaded, torch.Tensor) and loaded.dtype == reference.dtype
                and loaded.shape == reference.shape and loaded.stride() == reference.stride()
                and torch.equal(loaded.cpu(), reference))
    if isinstance(reference, dict):
        return type(loaded) is type(reference) and loaded.keys() == reference.keys() and all(
            _same(loaded[k], reference[k]) for k in reference)
    if isinstance(reference, list):
        return len(loaded) == len(reference) and all(map(_same, loaded, reference))
    return loaded == reference


def test_checkpoint_index_points_at_each_storage_in_the_file(tmp_path):
    path = tmp_path / "c.pt"
    _checkpoint(path)
    loaded, stored = helpers.checkpoint_index(path)
    data = path.read_bytes()
    present = [s for s in stored if s.nbytes]
    assert len(present) == 5  # the shared storage counts once; the empty one has no bytes
    assert [s.offset for s in present] == sorted(s.offset for s in present)
    for s in present:
        mapped = torch.empty(0, dtype=torch.uint8).set_(s.mapped)
        assert data[s.offset:s.offset + s.nbytes] == mapped.numpy().tobytes()
    assert loaded["step"] == 12


@pytest.mark.parametrize("read", helpers.CheckpointLoader.READS)
@pytest.mark.parametrize("chunk_bytes, slots, threads", [(64, 2, 3), (1000, 1, 1), (2**20, 4, 2)])
def test_checkpoint_loader_gives_what_torch_load_gives(tmp_path, read, chunk_bytes, slots,
                                                       threads):
    path = tmp_path / "c.pt"
    reference = _checkpoint(path)
    loader = helpers.CheckpointLoader("cpu", read=read, chunk_bytes=chunk_bytes, slots=slots,
                                      threads=threads)
    try:
        for _ in range(2):  # the buffers are reused by the second load
            loaded = loader.load(path)
            assert _same(loaded, reference)
            model = loaded["model"]
            assert model["view"].untyped_storage().data_ptr() == \
                model["tied"].untyped_storage().data_ptr()  # still one storage
            assert model["view"].storage_offset() == 100
    finally:
        loader.close()


def test_checkpoint_loader_reads_the_data_once_in_pieces(tmp_path):
    path = tmp_path / "c.pt"
    _checkpoint(path)
    _, stored = helpers.checkpoint_index(path)
    present = [s for s in stored if s.nbytes]
    span = max(s.offset + s.nbytes for s in present) - present[0].offset
    loader = helpers.CheckpointLoader("cpu", chunk_bytes=512, threads=2)
    chunks = loader._pieces(stored)
    assert all(chunk.length <= 512 for chunk in chunks)
    assert sum(n for chunk in chunks for *_, n in chunk.parts) == sum(s.nbytes for s in present)
    assert loader.read(path) == span < os.path.getsize(path)
    loader.close()


def test_checkpoint_loader_reads_with_one_thread_per_cpu_up_to_its_cap(monkeypatch):
    for cpus, expected in ((2, 2), (8, 8), (16, helpers.CheckpointLoader.MAX_THREADS)):
        monkeypatch.setattr(helpers, "usable_cpus", lambda cpus=cpus: cpus)
        loader = helpers.CheckpointLoader("cpu", chunk_bytes=256)
        assert (loader.threads, loader.slots) == (
            expected, max(2 * expected, helpers.CheckpointLoader.MIN_SLOTS))
        loader.close()
    chosen = helpers.CheckpointLoader("cpu", chunk_bytes=256, threads=16)
    assert chosen.threads == 16
    chosen.close()
    one = helpers.CheckpointLoader("cpu", read="mmap", chunk_bytes=256)
    assert (one.threads, one.slots) == (1, 2)


@pytest.mark.parametrize("read", helpers.CheckpointLoader.READS)
def test_checkpoint_loader_read_calls_alongside_after_the_index_before_the_data(tmp_path,
                                                                               monkeypatch,
                                                                               read):
    path = tmp_path / "c.pt"
    _checkpoint(path)
    loader = helpers.CheckpointLoader("cpu", read=read, threads=2)
    order = []
    index = helpers.checkpoint_layout
    monkeypatch.setattr(helpers, "checkpoint_layout",
                        lambda p, **options: order.append("index") or index(p, **options))
    stream = loader._stream
    monkeypatch.setattr(loader, "_stream", lambda *a: order.append("data") or stream(*a))
    loader.read(path, alongside=lambda: order.append("alongside"))
    assert order == ["index", "alongside", "data"]
    loader.read(path)
    assert order[3:] == ["index", "data"]
    loader.close()


class _Fence:
    """Stands in for a CUDA event: notes when it is recorded and waited on."""

    def __init__(self, log, number):
        self.log, self.number = log, number
        log.append(("record", number))

    def synchronize(self):
        self.log.append(("wait", self.number))


@pytest.mark.parametrize("read", helpers.CheckpointLoader.READS)
def test_checkpoint_loader_refills_a_buffer_only_after_its_copies(tmp_path, monkeypatch, read):
    path = tmp_path / "c.pt"
    reference = _checkpoint(path)
    log = []
    # one reading thread: the fills are logged in the order of the chunks
    loader = helpers.CheckpointLoader("cpu", read=read, chunk_bytes=256, slots=3, threads=1)
    fences = itertools.count()
    monkeypatch.setattr(loader, "_record", lambda: _Fence(log, next(fences)))
    fill = loader._fill

    def filling(slot, fence, fd, chunk, stored):
        fill(slot, fence, fd, chunk, stored)
        log.append(("filled", chunk[0], slot, None if fence is None else fence.number))

    monkeypatch.setattr(loader, "_fill", filling)
    try:
        for _ in range(2):
            assert _same(loader.load(path), reference)
    finally:
        loader.close()
    chunks = [chunk.begin for chunk in loader._pieces(helpers.checkpoint_index(path)[1])]
    assert len(chunks) > 2 * loader.slots
    fills = [entry for entry in log if entry[0] == "filled"]
    assert [begin for _, begin, _, _ in fills] == chunks * 2
    last = dict.fromkeys(range(loader.slots))  # the fence of each buffer's last copies
    for number, (_, _, slot, fence) in enumerate(fills):  # chunk `number` records fence `number`
        assert slot == number % len(chunks) % loader.slots and fence == last[slot]
        if fence is not None:  # it waited for that buffer's copies, recorded before, then read
            assert log.index(("record", fence)) < log.index(("wait", fence)) \
                < log.index(("filled", chunks[number % len(chunks)], slot, fence))
        last[slot] = number
    if read == "mmap":  # read on the calling thread: a piece only once the copies before it run
        for number in range(1, len(chunks)):
            assert log.index(("record", number - 1)) < log.index(fills[number])


@needs_cuda
@pytest.mark.parametrize("read", helpers.CheckpointLoader.READS)
def test_checkpoint_loader_on_the_gpu_matches_and_reuses_pinned_buffers(tmp_path, read):
    path = tmp_path / "c.pt"
    torch.manual_seed(0)
    saved = {f"w{i}": torch.randn(2**18 + 7 * i) for i in range(24)}  # 1 MiB each, about
    torch.save(saved, path)
    loader = helpers.CheckpointLoader("cuda", read=read, chunk_bytes=2**20, threads=2)
    assert all(b.is_pinned() for b in loader.buffers)
    pointers = [b.data_ptr() for b in loader.buffers]
    try:
        first = loader.load(path)
        second = loader.load(path)  # no sync between: its reads wait for the first's copies
        torch.cuda.synchronize()
    finally:
        loader.close()
    for loaded in (first, second):
        assert all(loaded[k].is_cuda and torch.equal(loaded[k].cpu(), saved[k]) for k in saved)
    assert [b.data_ptr() for b in loader.buffers] == pointers


CHUNK = 64 * 2**10  # small chunks: several per file, several tensors' parts in one


def _tensors(seed=0, scale=1):
    """Tensors of a safetensors file: one spanning several 64 KiB chunks, an empty one, a
    scalar, several dtypes (bfloat16 and int64 among them)."""
    g = torch.Generator().manual_seed(seed)
    return {f"big{seed}": torch.randn(scale * 70_000, generator=g),  # 280 KiB: 5 chunks
            f"half{seed}": torch.randn(33, 17, generator=g).half(),
            f"bf16_{seed}": torch.randn(1000, generator=g).bfloat16(),
            f"ids{seed}": torch.randint(-2**40, 2**40, (5, 300), generator=g),
            f"mask{seed}": torch.rand(77, generator=g) > 0.5,
            f"empty{seed}": torch.empty(0, 4), f"scalar{seed}": torch.tensor(2.5)}


def _save_safetensors(path, tensors, metadata=None):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    return tensors


def _placed_view(layout, placed):
    """A layout's tensor, with its storage named by where its bytes lie, not by its number."""
    s = layout.stored[placed.stored]
    return ((s.offset, s.nbytes) if s.nbytes else None, placed.dtype, placed.shape,
            placed.stride, placed.storage_offset)


def test_safetensors_layout_matches_what_safetensors_reads(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "m.safetensors"
    _save_safetensors(path, _tensors(), metadata={"format": "pt", "step": "12"})
    data = path.read_bytes()
    start, header = helpers.safetensors_header(path)
    assert start == 8 + int.from_bytes(data[:8], "little")
    layout = helpers.safetensors_layout(path)
    assert [s.offset for s in layout.stored] == sorted(s.offset for s in layout.stored)
    assert all(s.mapped is None for s in layout.stored)  # nothing mapped, nothing read
    with safe_open(str(path), "pt") as f:
        assert header["__metadata__"] == f.metadata()
        assert sorted(layout.structure) == sorted(f.keys())
        for name, placed in layout.structure.items():
            expected = f.get_tensor(name)
            assert helpers.SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()] == placed.dtype
            assert list(placed.shape) == f.get_slice(name).get_shape()
            assert placed.stride == expected.stride()
            s = layout.stored[placed.stored]
            raw = expected.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert data[s.offset:s.offset + s.nbytes] == raw


@pytest.mark.parametrize("read", helpers.CheckpointLoader.READS)
def test_checkpoint_loader_loads_safetensors_as_load_file_does(tmp_path, read):
    from safetensors.torch import load_file

    path = tmp_path / "m.safetensors"
    _save_safetensors(path, _tensors())
    reference = load_file(str(path))
    loader = helpers.CheckpointLoader("cpu", read=read, chunk_bytes=CHUNK, threads=2)
    try:
        assert _same(loader.load(path), reference)
        assert _same(loader.load(str(path)), reference)  # the buffers again
        assert loader.read(path) == helpers.checkpoint_layout(path).nbytes  # packed: no gaps
    finally:
        loader.close()


def _sharded(directory):
    """Three safetensors shards of unequal sizes, and the index.json that names them."""
    import json

    shards = {f"model-0000{k}-of-00003.safetensors": _tensors(seed=k, scale=k)
              for k in (1, 2, 3)}
    weight_map = {}
    for name, tensors in shards.items():
        _save_safetensors(directory / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index, [directory / name for name in shards], {
        name: t for tensors in shards.values() for name, t in tensors.items()}


@pytest.mark.parametrize("read", helpers.CheckpointLoader.READS)
def test_checkpoint_loader_loads_a_sharded_checkpoint_into_one_dict(tmp_path, read):
    index, shards, union = _sharded(tmp_path)
    loader = helpers.CheckpointLoader("cpu", read=read, chunk_bytes=CHUNK, threads=3)
    try:
        assert _same(loader.load(index), union)
        assert _same(loader.load(shards), union)  # a list of the shards' paths
        layout = helpers.checkpoint_layout(index)
        assert layout.files == tuple(map(str, shards)) and loader.read(index) == layout.nbytes
    finally:
        loader.close()


@needs_cuda
def test_checkpoint_loader_on_the_gpu_loads_a_sharded_safetensors_checkpoint(tmp_path):
    index, _, union = _sharded(tmp_path)
    loader = helpers.CheckpointLoader("cuda", chunk_bytes=CHUNK, threads=3)
    try:
        first = loader.load(index)
        second = loader.load(index)  # no sync between: its reads wait for the first's copies
        torch.cuda.synchronize()
    finally:
        loader.close()
    for loaded in (first, second):
        assert all(t.is_cuda for t in loaded.values()) and _same(loaded, union)


def test_checkpoint_loader_reads_the_shards_at_once(tmp_path, monkeypatch):
    index, shards, union = _sharded(tmp_path)
    # one reading thread: the chunks are read in the order of the list
    loader = helpers.CheckpointLoader("cpu", chunk_bytes=CHUNK, threads=1, slots=4)
    chunks = loader._pieces(helpers.checkpoint_layout(index).stored)
    files = [chunk.file for chunk in chunks]
    assert sorted(set(files[:3])) == [0, 1, 2]  # the first three chunks: one from each shard
    for k in range(3):  # each shard read in order, its chunks spread over the whole read
        mine = [n for n, file in enumerate(files) if file == k]
        assert [chunks[n].begin for n in mine] == sorted(chunks[n].begin for n in mine)
        assert mine[0] < len(chunks) / 4 and mine[-1] >= 3 * len(chunks) / 4
    read_from, fill = [], loader._fill

    def filling(slot, fence, fd, chunk, stored):
        read_from.append((os.readlink(f"/proc/self/fd/{fd}"), chunk.file))
        fill(slot, fence, fd, chunk, stored)

    monkeypatch.setattr(loader, "_fill", filling)
    try:
        assert _same(loader.load(index), union)
    finally:
        loader.close()
    assert [file for _, file in read_from] == files  # each chunk from its own shard's file
    assert all(os.path.samefile(link, shards[file]) for link, file in read_from)


def test_checkpoint_meta_layout_of_a_torch_file_finds_what_the_mapping_finds(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    _checkpoint(path)
    meta = helpers.torch_file_layout(path)
    mapped = helpers.torch_file_layout(path, mapped=True)
    assert all(s.mapped is None for s in meta.stored)  # no mapping: nothing to fault in
    assert all(s.mapped is not None for s in mapped.stored)

    def present(layout):
        return [(s.offset, s.nbytes) for s in layout.stored if s.nbytes]

    assert len(present(meta)) == 5 and present(meta) == present(mapped)
    placed = [helpers._map_placed(lambda p, layout=layout: _placed_view(layout, p),
                                  layout.structure) for layout in (meta, mapped)]
    assert placed[0] == placed[1]
    model = meta.structure["model"]
    assert model["tied"].stored == model["view"].stored  # one storage, counted once
    assert meta.structure["step"] == 12
    # a torch that notes no offsets on meta storages: the mapping gives them
    monkeypatch.setattr(helpers, "_checkpoint_offset", lambda tensor: None)
    fallback = helpers.torch_file_layout(path)
    assert present(fallback) == present(meta)
    assert all(s.mapped is not None for s in fallback.stored)


@pytest.mark.parametrize("read", helpers.CheckpointLoader.READS)
def test_checkpoint_loader_read_file_reads_every_byte_of_the_files_and_no_index(tmp_path,
                                                                               monkeypatch,
                                                                               read):
    index, shards, _ = _sharded(tmp_path)
    torch_file = tmp_path / "c.pt"
    _checkpoint(torch_file)
    loader = helpers.CheckpointLoader("cpu", read=read, chunk_bytes=CHUNK, threads=2, slots=4)
    seen, fill = [], loader._fill

    def filling(slot, fence, fd, chunk, stored):
        fill(slot, fence, fd, chunk, stored)
        got = loader.buffers[slot][:chunk.length].numpy().tobytes()
        seen.append((chunk.file, chunk.begin, got))

    monkeypatch.setattr(loader, "_fill", filling)
    monkeypatch.setattr(helpers, "checkpoint_layout", None)  # no index is made
    try:
        for source, files in ((torch_file, [torch_file]), (index, shards)):
            seen.clear()
            assert loader.read_file(source) == sum(os.path.getsize(f) for f in files)
            for number, path in enumerate(files):
                pieces = sorted((begin, got) for file, begin, got in seen if file == number)
                assert b"".join(got for _, got in pieces) == path.read_bytes()
    finally:
        loader.close()


def test_a_truncated_checkpoint_raises_a_clear_error(tmp_path):
    path = tmp_path / "m.safetensors"
    _save_safetensors(path, _tensors())
    data = path.read_bytes()
    loader = helpers.CheckpointLoader("cpu", chunk_bytes=CHUNK, threads=2)
    try:
        path.write_bytes(data[:-100])  # the last tensor's end is gone
        with pytest.raises(ValueError, match="is truncated: tensor .* ends at byte"):
            loader.load(path)
        path.write_bytes(data[:20])  # the header is cut
        with pytest.raises(ValueError, match="is truncated: 20 bytes"):
            loader.read(path)
        torch_file = tmp_path / "c.pt"
        _checkpoint(torch_file)
        torch_file.write_bytes(torch_file.read_bytes()[:3000])
        with pytest.raises(ValueError, match="cannot index .*c.pt as a torch.save file"):
            loader.load(torch_file)
    finally:
        loader.close()


def test_checkpoint_loader_names_the_missing_shard_of_a_sharded_index(tmp_path):
    index, shards, _ = _sharded(tmp_path)
    shards[1].unlink()
    loader = helpers.CheckpointLoader("cpu", chunk_bytes=CHUNK, threads=2)
    try:
        for call in (loader.load, loader.read, loader.read_file):
            with pytest.raises(FileNotFoundError, match=r"index.json names files that are not "
                               r"there: \[.*model-00002-of-00003.safetensors"):
                call(index)
        (tmp_path / "no-map.index.json").write_text("{}")
        with pytest.raises(ValueError, match="has no weight_map"):
            loader.load(tmp_path / "no-map.index.json")
    finally:
        loader.close()


def test_checkpoint_loader_takes_torch_shards_and_tells_safetensors_by_its_start(tmp_path):
    torch.manual_seed(0)
    first, second = {"a": torch.randn(300, 70)}, {"b": torch.arange(9000)}
    torch.save(first, tmp_path / "one.bin")
    _save_safetensors(tmp_path / "two.bin", second)  # a safetensors file under another name
    loader = helpers.CheckpointLoader("cpu", chunk_bytes=CHUNK, threads=2)
    try:
        assert _same(loader.load([tmp_path / "one.bin", tmp_path / "two.bin"]),
                     {**first, **second})
    finally:
        loader.close()


def test_evictable_directory_skips_a_directory_that_keeps_its_pages(tmp_path):
    shm = "/dev/shm"
    if not _disk_backed(tmp_path):
        pytest.skip(f"{helpers.file_system(tmp_path)} keeps its files in memory")
    assert helpers.evictable_directory([tmp_path / "missing", tmp_path]) == str(tmp_path)
    if os.path.isdir(shm) and helpers.file_system(shm) == "tmpfs":
        assert helpers.evictable_directory([shm, tmp_path]) == str(tmp_path)
        assert helpers.evictable_directory([shm]) == shm  # none takes: the first
    assert not any(p.name.startswith("evict-probe-") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------- CUDA graphs


class _FakeGraphEvent:
    def __init__(self, log):
        self.log = log

    def record(self):
        self.log.append("record copied")

    def synchronize(self):
        self.log.append("wait copied")


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: the capture runs the body once to make
    the output (a GPU's capture runs nothing), and each replay runs it again into that output,
    as a replay writes the memory the capture saw."""

    def __init__(self, log):
        self.log, self.body, self.output = log, None, None

    def replay(self):
        self.log.append("replay")
        self.output.copy_(self.body())


@pytest.fixture
def fake_graphs(fake_streams, monkeypatch):
    """fake_streams, with torch.cuda's graphs and events faked too, so that GraphedStep runs on
    CPU tensors (device="cpu"); returns the log and a switch for torch without graph events."""
    log, _ = fake_streams
    older_torch = {"on": False}

    def event(external=False):
        if external and older_torch["on"]:
            raise TypeError("__new__() got an unexpected keyword argument 'external'")
        return _FakeGraphEvent(log)

    def capture(graph, stream, body):
        with torch.cuda.stream(stream):
            graph.body, graph.output = body, body()
        log.append("captured")
        return graph.output

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: _FakeGraph(log))
    monkeypatch.setattr(helpers, "_capture", capture)
    return log, older_torch


def _doubling_step(log):
    def step(x):  # what the graph holds: a note of the input it read, and its output
        log.append(("step", torch.cuda.current_stream().name, x[0].item()))
        return x * 2
    return step


def test_graphed_step_warms_up_on_a_side_stream_and_replays_in_place(fake_graphs):
    log, _ = fake_graphs
    graphed = helpers.GraphedStep(_doubling_step(log), [torch.ones(4)], warmup=3, device="cpu")
    steps = [entry for entry in log if entry[0] == "step"]
    assert steps == [("step", "side0", 1.0)] * 4  # three warm-ups and the capture, off the caller's
    assert log.index("captured") > log.index(steps[-1])
    # the side stream starts after the caller's work; the caller waits for the warm-up before
    # the capture (the recipe of torch's docs)
    waits = [entry for entry in log if entry[1:2] == ("wait_stream",)]
    assert waits == [("side0", "wait_stream", "compute"), ("compute", "wait_stream", "side0")]
    step_at = [index for index, entry in enumerate(log) if entry[0] == "step"]
    assert step_at[2] < log.index(waits[1]) < step_at[3]  # after the warm-up, before the capture
    address, output = graphed.inputs[0].data_ptr(), graphed.output
    log.clear()
    kept = graphed(torch.full((4,), 3.0))
    assert kept is output and graphed.inputs[0].data_ptr() == address
    assert log == ["replay", ("step", "compute", 3.0)] and kept[0].item() == 6
    graphed(torch.full((4,), 5.0))
    assert kept[0].item() == 10  # a kept output holds what the next replay wrote


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("batch, refused", [
    ([torch.ones(1, 2)], "input 0 has shape (1, 2), the captured step reads (4, 2): drop a last "
                         "partial batch (DataLoader(drop_last=True)), pad it to that shape with "
                         "a mask, or capture a second GraphedStep for it"),
    ([torch.ones(5, 2)], "input 0 has shape (5, 2), the captured step reads (4, 2)"),
    ([torch.ones(4, 2, dtype=torch.float64)], "input 0 is torch.float64, the captured step "
                                              "reads torch.float32: convert it first"),
    ([torch.ones(4, 2), torch.ones(4, 2)], "2 tensors, the captured step reads 1"),
])
def test_a_graphed_step_refuses_a_batch_unlike_the_captured_one(fake_graphs, staged, batch,
                                                                refused):
    # copy_ broadcasts: a last batch of one sample would train the graph on four copies of it
    log, _ = fake_graphs
    graphed = helpers.GraphedStep(lambda x: x * 2, [torch.zeros(4, 2)], staged=staged,
                                  warmup=1, device="cpu")
    before = [t.clone() for t in graphed.inputs + graphed.staging]
    with pytest.raises(ValueError) as raised:
        graphed(*batch)
    assert str(raised.value).startswith(f"GraphedStep: {refused}")
    assert len(str(raised.value).splitlines()) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, graphed.inputs + graphed.staging,
                                                 strict=True))  # nothing copied


def test_a_staged_graphed_step_refills_its_buffers_only_after_its_event(fake_graphs):
    log, _ = fake_graphs
    graphed = helpers.GraphedStep(_doubling_step(log), [torch.zeros(4)], staged=True, warmup=1,
                                  device="cpu")
    assert log[-2:] == [("step", "side0", 0.0), "captured"]
    assert log[-3] == "record copied"  # in the graph: the copies, the event, then the step
    assert log[0] == "record copied"  # made and recorded before the warm-up: nothing to wait for
    log.clear()
    graphed(torch.full((4,), 2.0))
    graphed(torch.full((4,), 3.0))
    assert log == ["replay", "record copied", ("step", "compute", 2.0),  # nothing to wait for
                   "wait copied", "replay", "record copied", ("step", "compute", 3.0)]
    log.clear()
    graphed.load(torch.full((4,), 9.0), wait=False)
    assert log == [] and graphed.staging[0][0].item() == 9  # refilled without waiting


def test_a_staged_graphed_step_records_its_event_after_the_replay_on_an_older_torch(fake_graphs):
    log, older_torch = fake_graphs
    older_torch["on"] = True
    graphed = helpers.GraphedStep(_doubling_step(log), [torch.zeros(4)], staged=True, warmup=1,
                                  device="cpu")
    assert log.count("record copied") == 1  # at construction, not in the graph
    log.clear()
    graphed(torch.full((4,), 2.0))
    graphed(torch.full((4,), 3.0))
    assert log == ["replay", ("step", "compute", 2.0), "record copied",
                   "wait copied", "replay", ("step", "compute", 3.0), "record copied"]


@pytest.mark.parametrize("older", [False, True])
def test_a_staged_graphed_step_waits_on_its_event_only_after_the_first_replay(fake_graphs,
                                                                             older):
    # Before any replay the event's last record is the one in the capture, which has not run:
    # the first loads must not wait on it; every load after a replay waits.
    log, older_torch = fake_graphs
    older_torch["on"] = older
    graphed = helpers.GraphedStep(_doubling_step(log), [torch.zeros(4)], staged=True, warmup=1,
                                  device="cpu")
    log.clear()
    graphed.load(torch.full((4,), 2.0))
    graphed.load(torch.full((4,), 3.0))  # loaded again, still before any replay
    assert "wait copied" not in log and graphed.staging[0][0].item() == 3
    graphed.replay()
    log.clear()
    graphed.load(torch.full((4,), 4.0))
    graphed.load(torch.full((4,), 5.0))
    assert log == ["wait copied", "wait copied"] and graphed.staging[0][0].item() == 5


def test_a_graphed_step_output_is_detached_and_shares_the_captured_memory(fake_graphs):
    # The captured loss's grad_fn would keep the step's autograd graph (and the parameters'
    # AccumulateGrad nodes) alive; the output kept is detached, a view of the same memory that
    # each replay rewrites.
    log, _ = fake_graphs
    weight = torch.ones(4, requires_grad=True)
    graphed = helpers.GraphedStep(lambda x: (x * weight).sum(), [torch.ones(4)], warmup=1,
                                  device="cpu")
    captured = graphed.graph.output  # what the capture returned
    assert captured.grad_fn is not None
    assert graphed.output.grad_fn is None and not graphed.output.requires_grad
    assert graphed.output.data_ptr() == captured.data_ptr()
    kept = graphed(torch.full((4,), 2.0))
    assert kept is graphed.output and kept.item() == 8  # the replay wrote the shared memory
    graphed(torch.full((4,), 3.0))
    assert kept.item() == 12


def _mlp_and_sgd_step(width=32):
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    return model, step


@needs_cuda
@pytest.mark.parametrize("staged", [False, True])
def test_graphed_step_trains_as_the_eager_step_does(staged):
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=generator),
                torch.randint(0, 10, (16,), generator=generator)) for _ in range(6)]
    if not staged:  # copied outside the graph with non_blocking=True: from pinned memory
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    eager_model, eager = _mlp_and_sgd_step()
    for _ in range(3):  # the graph's warm-up: three steps on the first batch
        eager(*(t.cuda() for t in batches[0]))
    expected = [eager(*(t.cuda() for t in batch)).item() for batch in batches[1:]]
    graph_model, step = _mlp_and_sgd_step()
    graphed = helpers.GraphedStep(step, batches[0], staged=staged)
    assert graphed.output.grad_fn is None  # detached: the capture's autograd graph is not kept
    assert [graphed(*batch).item() for batch in batches[1:]] == pytest.approx(expected,
                                                                             rel=1e-5)
    for ours, theirs in zip(graph_model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


@needs_cuda
@pytest.mark.parametrize("staged", [False, True])
def test_a_graphed_training_step_refuses_a_last_partial_batch(staged):
    # DataLoader's default drop_last=False ends an epoch on a smaller batch: one sample would
    # have trained the graph on 16 copies of it, 17 raised copy_'s bare RuntimeError
    model, step = _mlp_and_sgd_step()
    example = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    graphed = helpers.GraphedStep(step, [t.pin_memory() for t in example], staged=staged)
    weights = [p.detach().clone() for p in model.parameters()]
    for size in (1, 17):
        last = (torch.randn(size, 32).pin_memory(), torch.randint(0, 10, (size,)).pin_memory())
        with pytest.raises(ValueError, match=rf"input 0 has shape \({size}, 32\), the captured "
                                             r"step reads \(16, 32\): drop a last partial batch"):
            graphed(*last)
    torch.cuda.synchronize()
    for ours, before in zip(model.parameters(), weights, strict=True):
        torch.testing.assert_close(ours, before)  # no replay ran on it


@needs_cuda
def test_a_staged_graphed_step_reads_a_buffer_refilled_too_early_but_not_after_its_event():
    graphed = helpers.GraphedStep(lambda x: x * 2, [torch.zeros(1 << 20)], staged=True, warmup=1)
    seen = {}
    for wait in (False, True):
        graphed.load(torch.ones(1 << 20))
        helpers.gpu_busy(50)  # the replay's copy reads the staging buffer 50 ms from now
        graphed.replay()
        graphed.load(torch.full((1 << 20,), 2.0), wait=wait)  # the next batch
        torch.cuda.synchronize()
        seen[wait] = graphed.inputs[0].unique().tolist()
    assert seen == {False: [2.0], True: [1.0]}


def test_claim_takes_numbers_measured_in_place_and_keeps_them(monkeypatch):
    shown = []
    monkeypatch.setattr(helpers, "_emit", lambda text, metadata: shown.append((text, metadata)))
    monkeypatch.setattr(helpers, "MEASUREMENTS", {"b": {"value": 2.0, "unit": "ms"}})
    helpers.claim("a number beats a key", 5.0, ">", "b", factor=2)
    text, metadata = shown[-1]
    assert text == "claim holds: a number beats a key"
    assert metadata["claim"]["lhs"] is None and metadata["claim"]["lhs_value"] == 5.0
    assert helpers.evaluate_claim(metadata["claim"], helpers.MEASUREMENTS)
    helpers.claim("a count", 3, ">=", 3, exact=True)
    assert shown[-1][1]["claim"]["exact"] is True
    monkeypatch.setenv(helpers.STRICT_CLAIMS, "1")
    with pytest.raises(helpers.ClaimFailed, match="'too small' does not hold here: 1, > 1 x 2"):
        helpers.claim("too small", 1.0, ">", 2.0)


def test_claim_where_that_does_not_apply_takes_no_number(monkeypatch):
    shown = []
    monkeypatch.setattr(helpers, "_emit", lambda text, metadata: shown.append((text, metadata)))
    helpers.claim_where("needs NVLink", None, ">", 1, applies=False, reason="no NVLink here")
    assert shown[-1][0] == "claim not tested here (no NVLink here): needs NVLink"
    assert shown[-1][1]["claim"]["lhs_value"] is None
