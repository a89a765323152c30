"""The CPU runtime redirects exactly what it lists, and only where no GPU is present."""

import pytest
import torch

from megatron_ext import registry, runtime


@pytest.fixture
def cpu_runtime():
    runtime.use_cpu()
    yield
    runtime.stop_cpu()


def test_cuda_placements_land_on_cpu(cpu_runtime):
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.empty(2, device="cuda:0").device.type == "cpu"
    x = torch.arange(3.0)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.type(torch.float64).dtype == torch.float64
    # megatron's get_pos_emb_on_this_cp_rank pins a small index; there is no driver to pin with.
    assert torch.tensor([0, 3], device="cpu", pin_memory=True).tolist() == [0, 3]


def test_streams_events_and_synchronize_are_inert(cpu_runtime):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        event = torch.cuda.Event()
        event.record()
    torch.cuda.synchronize()
    assert torch.cuda.device_count() == 1
    assert not torch.cuda.is_available(), "megatron must keep taking its CPU branches"


def test_cuda_rng_state_is_the_cpu_generator(cpu_runtime):
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    first = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), first)


def test_stop_cpu_restores_everything():
    before = {p.target: registry.original(p.target) for p in registry.patches("cpu")}
    runtime.use_cpu()
    runtime.use_cpu()  # idempotent
    runtime.stop_cpu()
    assert not runtime.cpu_active()
    assert torch.zeros(1, device="cpu").type() == "torch.FloatTensor"
    for patch in registry.patches("cpu"):
        assert registry.original(patch.target) is before[patch.target]
        assert not registry.is_applied(patch.target)


def test_refuses_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(runtime.GpuPresentError, match="CUDA_VISIBLE_DEVICES"):
        runtime.use_cpu()
    assert not runtime.cpu_active()


def test_describe_lists_each_redirection():
    lines = runtime.describe()
    for patch in registry.patches("cpu"):
        assert any(line.startswith(patch.target) for line in lines)
    assert any("CudaToCpuMode" in line for line in lines)
