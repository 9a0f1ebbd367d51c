"""Tests of helpers.py's section 12, parking a training state in host memory (notebook 14).
CPU tests fake CUDA's streams and host registration; the GPU tests run where CUDA is."""

import gc

import pytest
import torch

import helpers
from tests.test_helpers import fake_streams  # noqa: F401  (a fixture)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


class _FakeCudart:
    """Stands in for torch.cuda.cudart(): registration succeeds (or fails), and is noted."""

    def __init__(self, error=0):
        self.error, self.registered = error, []

    def cudaHostRegister(self, ptr, size, flags):
        if not self.error:
            self.registered.append((ptr, size))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.registered = [(p, s) for p, s in self.registered if p != ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def _adamw_state(width=8, layers=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def test_state_by_kind_finds_weights_gradients_and_the_moments(monkeypatch):
    model, optimizer = _adamw_state()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as if on a GPU
    state = helpers.state_by_kind(model, optimizer)
    params = list(model.parameters())
    assert list(state) == ["weights", "gradients", "step", "exp_avg", "exp_avg_sq"]
    assert state["weights"] == params and all(g is p.grad for g, p in zip(
        state["gradients"], params, strict=True))
    assert [t is optimizer.state[p]["exp_avg"] for t, p in zip(
        state["exp_avg"], params, strict=True)] == [True] * len(params)


def test_state_by_kind_leaves_out_what_stays_on_the_host():
    model, optimizer = _adamw_state()
    assert helpers.state_by_kind(model, optimizer) == {}  # a CPU model: nothing on a GPU


def test_parkable_refuses_views_shared_storages_and_mixed_devices():
    whole = torch.zeros(4, 4)
    assert helpers._parkable([whole, torch.ones(3)], "cpu")[0] is whole
    for tensors, words in (([], "nothing to park"),
                           ([whole[1:]], "view of a larger storage"),
                           ([whole.t()], "view of a larger storage"),
                           ([whole, whole.view(16)], "shares its storage"),
                           ([whole, torch.ones(2, device="meta")], "every parked tensor")):
        with pytest.raises(ValueError, match=words) as refused:
            helpers._parkable(tensors, "cpu")
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="cuda device"):
        helpers._parkable([whole])


def test_host_buffer_lays_tensors_out_aligned_and_registers_exactly(cudart):
    tensors = [torch.zeros(3, dtype=torch.float32), torch.zeros(1000, dtype=torch.float16)]
    assert helpers.HostBuffer.layout(tensors) == [0, 512, 2560]
    with helpers.HostBuffer(2560) as buffer:
        assert cudart.registered == [(buffer.tensor.data_ptr(), 2560)]  # not 4096
        views = buffer.views(tensors)
        assert [(v.shape, v.dtype) for v in views] == [(t.shape, t.dtype) for t in tensors]
        assert views[1].data_ptr() - views[0].data_ptr() == 512
        with pytest.raises(ValueError, match="the buffer holds"):
            buffer.views([*tensors, torch.zeros(1)])
    assert cudart.registered == []


def test_host_buffer_refuses_nothing_and_a_failed_registration(monkeypatch):
    with pytest.raises(ValueError, match="nothing to register"):
        helpers.HostBuffer(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(error=2))
    with pytest.raises(RuntimeError, match="cudaHostRegister .* failed .* memlock limit"):
        helpers.HostBuffer(4096)


def _parked_cpu_state(monkeypatch, n=3):
    monkeypatch.setattr(helpers.ParkedState, "DEVICE_TYPE", "cpu")
    tensors = [torch.randn(8, 8) * (k + 1) for k in range(n)]
    return tensors, [t.clone() for t in tensors]


def test_parked_state_frees_each_storage_and_gives_it_back_intact(
        fake_streams, cudart, monkeypatch):  # noqa: F811
    log, compute = fake_streams
    tensors, reference = _parked_cpu_state(monkeypatch)
    parked = helpers.ParkedState(tensors)
    done = parked.park()
    assert [t.untyped_storage().nbytes() for t in tensors] == [0, 0, 0]
    copied = [e for stream, what, e in log if what == "record" and stream == parked.stream.name]
    assert done is copied[-1]
    # each storage was freed only after the current stream had waited for its copy
    assert [e for s, what, e in log if (s, what) == ("compute", "wait_event")] == copied
    with pytest.raises(RuntimeError, match="already parked"):
        parked.park()
    parked.restore()
    assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))
    assert (parked.stream.name, "wait_stream", "compute") in log  # after the allocations
    with pytest.raises(RuntimeError, match="not parked"):
        parked.restore()
    parked.close()
    assert cudart.registered == []


def test_swap_states_interleaves_and_each_restore_waits_for_the_park_before_it(
        fake_streams, cudart, monkeypatch):  # noqa: F811
    log, _ = fake_streams
    a, a_ref = _parked_cpu_state(monkeypatch)
    b, b_ref = _parked_cpu_state(monkeypatch)
    job_a, job_b = helpers.ParkedState(a), helpers.ParkedState(b)
    job_b.park()
    mark = len(log)
    helpers.swap_states(job_a, job_b)
    assert job_a.parked and not job_b.parked
    assert all(torch.equal(t, r) for t, r in zip(b, b_ref, strict=True))
    order = [s for s, what, _ in log[mark:] if what == "record"]
    assert order == [job_a.stream.name, job_b.stream.name] * 3  # out k, then in k
    with pytest.raises(RuntimeError, match="must be on the GPU"):
        helpers.swap_states(job_a, job_b)
    helpers.swap_states(job_b, job_a)
    assert all(torch.equal(t, r) for t, r in zip(a, a_ref, strict=True))
    job_a.close()
    job_b.close()


@needs_cuda
def test_parked_state_on_the_gpu_frees_the_memory_and_restores_it_bit_for_bit():
    torch.manual_seed(0)
    tensors = [torch.randn(2**22, device="cuda") for _ in range(4)]  # 16 MiB each
    reference = [t.clone() for t in tensors]
    parked = helpers.ParkedState(tensors)
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        parked.park().synchronize()
        assert before - torch.cuda.memory_allocated() == 4 * 2**24
        assert torch.equal(parked.host[0], reference[0].cpu())
        torch.cuda.current_stream().wait_event(parked.restore())
        assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))
    finally:
        parked.close()


@needs_cuda
def test_swap_states_on_the_gpu_moves_both_states_bit_for_bit():
    torch.manual_seed(0)
    a = [torch.randn(2**22, device="cuda") for _ in range(4)]
    b = [torch.randn(2**22, device="cuda") for _ in range(4)]
    a_ref, b_ref = [t.clone() for t in a], [t.clone() for t in b]
    job_a, job_b = helpers.ParkedState(a), helpers.ParkedState(b)
    try:
        job_b.park().synchronize()
        for _ in range(3):
            for leaving, arriving in ((job_a, job_b), (job_b, job_a)):
                for event in helpers.swap_states(leaving, arriving):
                    torch.cuda.current_stream().wait_event(event)
        torch.cuda.synchronize()
        assert all(torch.equal(t, r) for t, r in zip(a, a_ref, strict=True))
        assert job_b.parked and all(torch.equal(h, r.cpu()) for h, r in zip(
            job_b.host, b_ref, strict=True))
    finally:
        job_a.close()
        job_b.close()
        gc.collect()


def test_memory_saver_cycles_says_why_it_cannot_run():
    import importlib.util

    if importlib.util.find_spec("torch_memory_saver") is not None:
        pytest.skip("torch_memory_saver is installed here: nothing to refuse")
    reason = helpers.memory_saver_cycles(1, 8, retain=False, timeout=120)
    assert isinstance(reason, str) and "not installed" in reason and "\n" not in reason


def test_memory_saver_cycles_reads_the_last_line_its_process_prints(monkeypatch):
    import json
    import subprocess

    printed = {"first": 9.0, "park": [1.0, 2.0], "restore": [3.0, 4.0], "intact": True}
    seen = {}

    def run(args, **kwargs):
        seen["args"] = args
        return subprocess.CompletedProcess(args, 0, "a warning\n" + json.dumps(printed), "")

    monkeypatch.setattr(subprocess, "run", run)
    assert helpers.memory_saver_cycles(32, 4096, retain=True, cycles=2) == printed
    assert seen["args"][-4:] == ["1", "32", "4096", "2"]

    def fails(args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "Traceback\nRuntimeError: no GPU\n")

    monkeypatch.setattr(subprocess, "run", fails)
    assert helpers.memory_saver_cycles(1, 8, retain=False) == "RuntimeError: no GPU"
