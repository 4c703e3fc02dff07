"""One device resolver for every command, NVML matched to torch's device by PCI bus id, and NVML failures
that degrade to the counters' availability flags: tested with a fake CUDA runtime and a fake NVML."""
from __future__ import annotations

import json
import types

import pytest

import specpilot.decoding.hardware as hw
from specpilot.decoding.errors import SpecPilotError
from conftest import CPU_KEY

# physical GPUs as NVML numbers them: (name, PCI bus, utilisation %)
PHYSICAL = [("NVIDIA A100-SXM4-80GB", 0x07, 11), ("NVIDIA A100-SXM4-80GB", 0x0F, 22),
            ("NVIDIA H100 80GB HBM3", 0x3B, 33), ("NVIDIA H100 80GB HBM3", 0x5E, 44)]


class FakeCuda:
    """torch.cuda under CUDA_VISIBLE_DEVICES=`visible` (physical indices)."""

    def __init__(self, visible: list[int]):
        self.visible = visible

    def device_count(self):
        return len(self.visible)

    def get_device_name(self, i):
        return PHYSICAL[self.visible[i]][0]

    def get_device_properties(self, i):
        name, bus, _ = PHYSICAL[self.visible[i]]
        return types.SimpleNamespace(name=name, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0,
                                     uuid=f"uuid-{self.visible[i]}")


class NVMLError(Exception):
    pass


def fake_nvml(broken: set[str] = frozenset()):
    """A pynvml stand-in; the functions named in `broken` raise NVMLError."""
    handles = [types.SimpleNamespace(index=i) for i in range(len(PHYSICAL))]

    def may_fail(name, fn):
        def call(*args):
            if name in broken:
                raise NVMLError(name)
            return fn(*args)
        return call

    def by_bus(bus_id: bytes):
        bus = int(bus_id.decode().split(":")[1], 16)
        return next(h for h, (_, b, _) in zip(handles, PHYSICAL) if b == bus)

    return types.SimpleNamespace(
        NVML_CLOCK_SM=0, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetCount=lambda: len(PHYSICAL),
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetHandleByPciBusId=may_fail("bus", by_bus),
        nvmlDeviceGetHandleByUUID=may_fail("uuid", lambda u: handles[int(u.decode().rsplit("-", 1)[1])]),
        nvmlDeviceGetMaxClockInfo=may_fail("maxclock", lambda h, c: 2000),
        nvmlDeviceGetClockInfo=may_fail("clock", lambda h, c: 1000),
        nvmlDeviceGetEnforcedPowerLimit=may_fail("power", lambda h: 700_000),
        nvmlDeviceGetPowerUsage=may_fail("power", lambda h: 350_000),
        nvmlDeviceGetTemperature=may_fail("temp", lambda h, t: 50),
        nvmlDeviceGetUtilizationRates=may_fail("util", lambda h: types.SimpleNamespace(gpu=PHYSICAL[h.index][2],
                                                                                       memory=5)),
        nvmlGpmQueryDeviceSupport=lambda h: types.SimpleNamespace(isSupportedDevice=False),
    )


@pytest.fixture
def gpus(monkeypatch):
    """Install a fake machine: visible GPUs (physical indices) and an NVML (or none)."""
    def install(visible, nvml=None):
        monkeypatch.setattr(hw, "_cuda", lambda: FakeCuda(visible) if visible else None)
        monkeypatch.setattr(hw, "_nvml", lambda: nvml)
        hw._WARNED.clear()
    return install


def test_one_resolver_for_auto_cuda_n_and_device_keys(gpus):
    gpus([2, 0])  # CUDA_VISIBLE_DEVICES=2,0: an H100 then an A100
    assert hw.resolve("auto") == hw.Device("h100", "cuda:0", "NVIDIA H100 80GB HBM3")
    assert hw.resolve("cuda") == hw.resolve("cuda:0") == hw.resolve("h100") == hw.resolve("auto")
    assert hw.resolve("cuda:1") == hw.resolve("A100") == hw.Device("a100", "cuda:1", "NVIDIA A100-SXM4-80GB")
    assert hw.resolve("cpu").torch == "cpu"
    with pytest.raises(SpecPilotError, match=r"--device l4 is not present.*cuda:0 NVIDIA H100 80GB HBM3 \(h100\)"):
        hw.resolve("l4")
    with pytest.raises(SpecPilotError, match=r"2 CUDA device\(s\) visible"):
        hw.resolve("cuda:2")
    gpus([])
    assert hw.resolve("auto").torch == "cpu"
    with pytest.raises(SpecPilotError, match="CUDA is not available"):
        hw.resolve("cuda:0")


def test_nvml_reads_the_gpu_torch_uses_under_cuda_visible_devices(gpus):
    """torch's cuda:0 is physical GPU 3 here: the monitor must read GPU 3's counters, not GPU 0's."""
    gpus([3, 1], fake_nvml())
    values = dict(zip(hw.HW_FEATURES, hw.HardwareMonitor("cuda:0").read()))
    assert values["hw_is_gpu"] == 1.0 and values["hw_gpu_util"] == pytest.approx(0.44)
    assert values["hw_sm_clock_ratio"] == pytest.approx(0.5) and values["hw_power_ratio"] == pytest.approx(0.5)
    assert dict(zip(hw.HW_FEATURES, hw.HardwareMonitor("cuda:1").read()))["hw_gpu_util"] == pytest.approx(0.22)
    gpus([3, 1], fake_nvml({"bus"}))  # no PCI lookup: the UUID finds the same GPU
    assert dict(zip(hw.HW_FEATURES, hw.HardwareMonitor("cuda:0").read()))["hw_gpu_util"] == pytest.approx(0.44)


@pytest.mark.parametrize("broken", [None, {"bus", "uuid"}, {"maxclock", "clock", "power", "temp", "util"}])
def test_nvml_failures_degrade_to_the_availability_flags(gpus, capsys, broken):
    gpus([2], None if broken is None else fake_nvml(broken))
    monitor = hw.HardwareMonitor("cuda:0")
    values = dict(zip(hw.HW_FEATURES, monitor.read()))
    err = capsys.readouterr().err
    if broken is None or "bus" in broken:  # no NVML at all, or no matching device: one warning, flags 0
        assert values["hw_is_gpu"] == 0.0 and err.count("warning: no GPU counters for cuda:0") == 1
        hw.HardwareMonitor("cuda:0")
        assert capsys.readouterr().err == ""  # said once
    else:  # every counter call fails: the GPU is there, each counter keeps its neutral value
        assert values["hw_is_gpu"] == 1.0 and values["hw_sm_clock_ratio"] == 1.0 and err == ""
    assert monitor.hardware_name == "NVIDIA H100 80GB HBM3"


class Loaded(Exception):
    """Raised instead of loading a model: carries the torch device the command asked for."""


@pytest.mark.parametrize("device", ["cuda:1", "a100", "auto"])
def test_every_command_resolves_the_device_the_same_way(gpus, monkeypatch, tmp_path, device):
    """--device cuda:N / a key / auto give the same torch device in all four commands (models never load)."""
    import specpilot.decoding.models
    from specpilot.agents.train_cli import train_main
    from specpilot.bench.benchmark_cli import benchmark_main
    from specpilot.bench.profile_cli import profile_main
    from specpilot.decoding.generate_cli import generate_main

    gpus([2, 0] if device != "auto" else [0], fake_nvml())
    expected = "cuda:1" if device != "auto" else "cuda:0"

    def load_model(spec, dtype, torch_device):
        raise Loaded(torch_device)

    monkeypatch.setattr(specpilot.decoding.models, "load_model", load_model)
    monkeypatch.chdir(tmp_path)
    commands = {
        "generate": lambda: generate_main(["--device", device, "--prompt", "x"]),
        "benchmark": lambda: benchmark_main(["--device", device]),
        "profile": lambda: profile_main(["--device", device, "--out", str(tmp_path)]),
        "train": lambda: train_main(["--device", device, "--no-track", "--out", str(tmp_path)]),
    }
    for name, run in commands.items():
        with pytest.raises(Loaded) as loaded:
            run()
        assert str(loaded.value) == expected, name


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh --dry-run: the GPU check's steps (tests, profile, a real-loop training with its
    export and evaluation, LearnedK deciding in generate) on the CPU with tiny shapes, all under $OUT."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for step in ("tests", "profile", "train", "generate"):
        assert f"{step}: exit 0" in proc.stdout
    profile = json.loads((tmp_path / "profile" / f"{CPU_KEY}.json").read_text())
    assert profile["batch_sizes"] == [1, 2] and len(profile["verify_s"][0]) == 5
    assert json.loads((tmp_path / "generate.json").read_text())["policy"] == "learned"
    assert list((tmp_path / "policies").glob(f"{CPU_KEY}/ngram-3/policy.json"))


def test_gpu_check_without_a_gpu_stops_at_once(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh")], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable},
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no CUDA GPU visible")
    assert proc.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_background_load_never_outlives_its_run(tmp_path):
    """The load stops with its block, and with the process that started it when that one is SIGKILLed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from specpilot.env.load import background_load

    with background_load("both") as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    script = ("import time\nfrom env.load import start_load\nprocs = start_load('compute')\n"
              "print(procs[0].pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        try:  # reap it if it became ours (it was re-parented to init otherwise)
            os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the load {child} outlived its killed parent")


def test_benchmark_killed_under_load_leaves_no_load(tmp_path):
    """scripts/benchmark.py --background-load: SIGKILL the benchmark while a load runs; the load dies with it."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    cmd = [sys.executable, "scripts/benchmark.py", "--target", "random:configs/tiny-target", "--draft", "ngram",
           "--policies", "none,static:2", "--split", "test", "--per-category", "1", "--max-new-tokens", "64",
           "--repeats", "50", "--background-load", "compute", "--out", str(tmp_path), "--no-progress"]
    bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def is_load(p) -> bool:
            try:
                return "a = a @ a" in " ".join(p.cmdline())
            except psutil.NoSuchProcess:  # a short-lived child gone between listing and reading it
                return False

        loads = []
        for _ in range(600):  # the model loads first (a few seconds), then the first load starts
            loads = [p for p in psutil.Process(bench.pid).children(recursive=True) if is_load(p)]
            if loads or bench.poll() is not None:
                break
            time.sleep(0.1)
        assert loads, "the benchmark never started its background load"
        bench.send_signal(signal.SIGKILL)
        bench.wait()
        gone, alive = psutil.wait_procs(loads, timeout=10)
        assert not alive, f"the load {alive} outlived the killed benchmark"
    finally:
        if bench.poll() is None:
            bench.kill()


def test_benchmark_under_loads_pairs_each_load_with_plain_under_it(tiny_model_dirs, tmp_path):
    """--background-load none,memory: every policy runs under each load in every repeat (the order rotating),
    each load's speedups are over plain decoding under that load, and every row matches plain decoding."""
    from specpilot.bench.benchmark_cli import benchmark_main

    out = tmp_path / "runs"
    assert benchmark_main(["--target", tiny_model_dirs["target"], "--draft", "ngram", "--policies", "none,static:3,static:1",
                           "--split", "test", "--per-category", "1", "--max-new-tokens", "8", "--repeats", "2",
                           "--background-load", "none,memory", "--versus", "static:1", "--out", str(out),
                           "--no-progress"]) == 0
    doc = json.loads((out / "load_results.json").read_text())
    runs, summary = doc["runs"], doc["summary"]
    assert summary["loads"] == ["none", "memory"]
    order = [(r["repeat"], r["load"]) for r in runs]
    assert list(dict.fromkeys(order)) == [(0, "none"), (0, "memory"), (1, "memory"), (1, "none")]
    for load in ("none", "memory"):
        cell = summary["by_load"][load]["table"]["1"]
        assert cell["none"]["speedup"] == 1.0 and cell["static:3"]["mismatch_rate"] == 0.0
        expected = []
        for repeat in (0, 1):  # by hand: the policy's tokens/s over plain's, both from this load's pass of this repeat
            mine = [r for r in runs if r["load"] == load and r["repeat"] == repeat]
            rate = {p: sum(r["new_tokens"] for r in mine if r["policy"] == p) / sum(r["seconds"] for r in mine if r["policy"] == p)
                    for p in ("none", "static:3")}
            expected.append(rate["static:3"] / rate["none"])
        assert cell["static:3"]["speedup_per_repeat"] == pytest.approx(expected, rel=1e-9)
        versus = []  # --versus static:1: static:3 over static:1 within each repeat, under this load
        for repeat in (0, 1):
            mine = [r for r in runs if r["load"] == load and r["repeat"] == repeat]
            rate = {p: sum(r["new_tokens"] for r in mine if r["policy"] == p) / sum(r["seconds"] for r in mine if r["policy"] == p)
                    for p in ("static:1", "static:3")}
            versus.append(rate["static:3"] / rate["static:1"])
        assert summary["versus"]["cells"]["static:3"][f"{load} B=1"]["per_repeat"] == pytest.approx(versus, rel=1e-9)


def test_a_cpu_machine_key_names_its_model_and_cores(gpus):
    """The key a CPU's artifacts live under: model (trademarks, 'CPU', clock and 'Processor' dropped) and cores;
    --device cpu and auto resolve to this machine's, another CPU's key is a one-line error naming this one."""
    gpus([])
    assert hw.cpu_key("AMD EPYC", 2) == "cpu-amd-epyc-2c"
    assert hw.cpu_key("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", 8) == "cpu-intel-xeon-platinum-8375c-8c"
    assert hw.cpu_key("AMD EPYC 7B13 64-Core Processor", 16) == "cpu-amd-epyc-7b13-64-core-16c"
    here = hw.cpu_key()
    assert hw.resolve("cpu").key == hw.resolve("auto").key == hw.resolve(here).key == here
    assert hw.artifact_key("cpu") == here and hw.artifact_key("a100") == "a100"
    with pytest.raises(SpecPilotError, match=f"is not this machine: its CPU is {here}"):
        hw.resolve("cpu-other-model-1024c")
