"""The device sample behind the `device` topic: its memory breakdown against independent
counts (the HF model's parameters, the KV arithmetic, psutil and /proc), and NVML's optional
fields (a fake pynvml: no GPU here)."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import psutil
import pytest
import torch

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.server.device_monitor import DeviceMonitor, cuda_breakdown, unique_bytes
from kvscope.engine.server.nvml import NvmlDevice, open_nvml_device
from kvscope.testing.tiny_models import save_tiny_model

MiB = 2**20
# Pids above Linux's largest pid_max (2**22) belong to no process here.
P1, P7, P42, P99 = (2**22 + i for i in (1, 7, 42, 99))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


def make_engine(model, **overrides) -> LLMEngine:
    cfg = {"model": str(model), "device": "cpu", "block_size": 4, "num_kv_blocks": 64,
           "max_model_len": 256, **overrides}
    return LLMEngine(EngineConfig(**cfg))


def test_weights_are_the_models_parameters_plus_rope_tables(model):
    from transformers import AutoModelForCausalLM

    engine = make_engine(model)
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    params = sum(p.numel() * p.element_size() for p in hf.parameters())
    rope = 2 * 256 * engine.model.shape.head_dim * 4  # cos and sin, float32, max_model_len
    frame = DeviceMonitor(engine).sample()
    assert frame.weights_bytes == params + rope


def test_unique_bytes_counts_shared_storage_once():
    a = torch.zeros(100)
    assert unique_bytes([a, a, a[10:], None]) == 400
    assert unique_bytes([a, torch.zeros(10)]) == 440


@pytest.mark.parametrize("kv_dtype,per_head", [("auto", 16 * 4), ("int8", 16 + 4)])
def test_kv_parts_follow_the_block_manager(model, kv_dtype, per_head):
    """Per-block bytes from the formula (K and V, layers, kv heads, head_dim x bytes plus a
    float scale when quantized), used/cached from the block counts."""
    engine = make_engine(model, kv_dtype=kv_dtype, enable_prefix_caching=True)
    shape = engine.model.shape
    assert shape.head_dim == 16
    per_block = 4 * 2 * shape.num_layers * shape.num_kv_heads * per_head
    monitor = DeviceMonitor(engine)
    frame = monitor.sample()
    assert frame.kv_pool_bytes == 64 * per_block == engine.pool.nbytes
    assert (frame.kv_used_bytes, frame.kv_cached_bytes) == (0, 0)
    engine.add_request(list(range(1, 23)), SamplingParams(max_tokens=3))
    engine.step()
    frame = monitor.sample()
    assert frame.kv_used_bytes == 6 * per_block  # 22 prompt tokens in blocks of 4
    while engine.has_unfinished():
        engine.step()
    frame = monitor.sample()
    assert frame.kv_used_bytes == 0
    assert frame.kv_cached_bytes == engine.block_manager.num_cached_free_blocks * per_block > 0


def _proc_kib(path: str, key: str) -> int:
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_cpu_memory_matches_ps_and_proc(model):
    engine = make_engine(model)
    frame = DeviceMonitor(engine).sample()
    rss_psutil = psutil.Process().memory_info().rss
    rss_proc = _proc_kib("/proc/self/status", "VmRSS")
    assert frame.process_source == "rss" and frame.pid == os.getpid()
    assert frame.process_bytes == pytest.approx(rss_psutil, rel=0.03)
    assert frame.process_bytes == pytest.approx(rss_proc, rel=0.03)
    assert frame.memory_total == _proc_kib("/proc/meminfo", "MemTotal")
    assert frame.memory_free == pytest.approx(_proc_kib("/proc/meminfo", "MemAvailable"),
                                              rel=0.05)
    assert frame.memory_used == frame.memory_total - frame.memory_free
    parts = frame.weights_bytes + frame.kv_pool_bytes + frame.other_bytes
    assert parts == frame.process_bytes  # the breakdown adds up to what ps shows
    assert frame.device == "cpu" and frame.num_cpus == psutil.cpu_count()
    # No NVML on a CPU engine: those fields are missing, not zero.
    assert frame.gpu_utilization is None and frame.power_w is None
    assert frame.temperature_c is None and frame.activations_bytes is None


def test_cpu_percent_sees_the_engine_working(model):
    engine = make_engine(model)
    monitor = DeviceMonitor(engine)
    monitor.sample()
    engine.add_request(list(range(1, 50)), SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    frame = monitor.sample()
    assert frame.cpu_percent is not None and frame.cpu_percent > 5
    assert 0 <= frame.system_cpu_percent <= 100


def test_cuda_breakdown_parts_add_up():
    GiB = 2**30
    parts = cuda_breakdown(free=60 * GiB, total=80 * GiB, allocated=14 * GiB,
                           reserved=16 * GiB, weights=4 * GiB, kv_pool=8 * GiB,
                           nvml_process=int(16.5 * GiB))
    assert parts["memory_used"] == 20 * GiB
    assert parts["activations_bytes"] == 2 * GiB
    assert parts["allocator_free_bytes"] == 2 * GiB
    assert parts["other_bytes"] == GiB // 2  # the CUDA context, beyond the allocator
    assert parts["process_source"] == "nvml"
    total = 4 * GiB + 8 * GiB + sum(parts[k] for k in ("activations_bytes",
                                                        "allocator_free_bytes", "other_bytes"))
    assert total == parts["process_bytes"]
    no_nvml = cuda_breakdown(60 * GiB, 80 * GiB, 14 * GiB, 16 * GiB, 4 * GiB, 8 * GiB, None)
    assert (no_nvml["process_bytes"], no_nvml["process_source"]) == (16 * GiB, "torch")
    assert no_nvml["other_bytes"] == 0


class FakeNvml:
    """pynvml's surface as NvmlDevice uses it."""
    NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.fail = fail

    def __getattribute__(self, name):
        if name.startswith("nvml") and name in object.__getattribute__(self, "fail"):
            def failing(*_):
                raise FakeNvml.NVMLError(name)
            return failing
        return object.__getattribute__(self, name)

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetPowerUsage(self, h):
        return 412_345  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, which):
        assert which == self.NVML_CLOCK_MEM
        return 2619

    def nvmlDeviceGetMaxClockInfo(self, h, which):
        return 3201

    def nvmlDeviceGetTemperature(self, h, which):
        return 54

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=P1, usedGpuMemory=5),
                SimpleNamespace(pid=P42, usedGpuMemory=7 * MiB)]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        # A desktop on the same card; the driver may not say how much it holds.
        return [SimpleNamespace(pid=P7, usedGpuMemory=None),
                SimpleNamespace(pid=P42, usedGpuMemory=None)]


def test_nvml_fields_are_converted_to_plain_units():
    dev = NvmlDevice(FakeNvml(), handle=object())
    assert dev.name() == "NVIDIA H200"
    assert dev.busy() == {"gpu_utilization": 87.0, "memory_utilization": 41.0,
                          "memory_clock_mhz": 2619.0, "memory_clock_max_mhz": 3201.0,
                          "temperature_c": 54.0, "power_w": 412.345, "power_limit_w": 700.0}
    assert dev.process_bytes(P42) == 7 * MiB
    assert dev.process_bytes(P99) is None  # e.g. a container hides the host pid
    assert dev.processes() == {P1: 5, P42: 7 * MiB, P7: None}


def test_a_failing_nvml_query_leaves_that_field_missing():
    methods = {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetName",
               "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"}
    dev = NvmlDevice(FakeNvml(fail=methods), handle=object())
    busy = dev.busy()
    assert busy["gpu_utilization"] is None and busy["power_w"] is None
    assert busy["memory_utilization"] is None
    assert busy["temperature_c"] == 54.0 and busy["power_limit_w"] == 700.0
    assert dev.name() is None and dev.process_bytes(P42) is None


def test_without_nvidia_ml_py_there_is_no_nvml_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert open_nvml_device(0) is None


def test_nvml_without_a_driver_is_no_nvml_device():
    """make setup installs nvidia-ml-py; on a machine without the NVIDIA driver its init
    fails, which must mean "no NVML fields", not an error."""
    pytest.importorskip("pynvml")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: NVML is expected to work here")
    assert open_nvml_device(0) is None


def test_a_device_frame_round_trips_the_wire(model):
    from kvscope.ipc import codec

    frame = DeviceMonitor(make_engine(model)).sample(seq=7)
    assert codec.decode_state("device", codec.encode(frame)) == frame


def test_the_cuda_branch_with_a_fake_card(model, monkeypatch):
    """No GPU here: the CUDA path runs against torch.cuda's memory calls and NVML, faked, so
    its wiring (which number lands in which field) is still checked."""
    GiB = 2**30
    engine = make_engine(model)
    engine.device = "cuda:0"  # only the monitor reads it from here on
    calls = {"mem_get_info": lambda i=0: (60 * GiB, 80 * GiB),
             "memory_allocated": lambda i=0: 3 * GiB, "memory_reserved": lambda i=0: 4 * GiB,
             "get_device_name": lambda i=0: "fallback name"}
    for name, fn in calls.items():
        monkeypatch.setattr(torch.cuda, name, fn)

    class Card(FakeNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, h):
            return [SimpleNamespace(pid=P1, usedGpuMemory=GiB),  # not in our pid namespace
                    SimpleNamespace(pid=os.getpid(), usedGpuMemory=int(4.5 * GiB))]

    frame = DeviceMonitor(engine, nvml=NvmlDevice(Card(), handle=object())).sample()
    assert (frame.device, frame.name) == ("cuda:0", "NVIDIA H200")
    assert (frame.memory_total, frame.memory_used, frame.memory_free) == \
        (80 * GiB, 20 * GiB, 60 * GiB)
    assert (frame.process_bytes, frame.process_source) == (int(4.5 * GiB), "nvml")
    weights, kv = frame.weights_bytes, frame.kv_pool_bytes
    assert frame.activations_bytes == 3 * GiB - weights - kv
    assert frame.allocator_free_bytes == GiB
    assert frame.other_bytes == GiB // 2
    assert (frame.gpu_utilization, frame.power_w, frame.temperature_c) == (87.0, 412.345, 54.0)
    assert frame.cpu_percent is not None  # the engine's host thread still counts
    me = psutil.Process().name()
    assert [(p.pid, p.name, p.bytes) for p in frame.processes] == [
        (os.getpid(), me, int(4.5 * GiB)), (P1, "", GiB), (P7, "", None), (P42, "", None)]
