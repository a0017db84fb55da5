"""Phase timers, profiler traces, memory-snapshot gating, MoE load figures and heatmaps,
each against a value computed by hand (a scripted clock and memory, counts from the router's
own choices)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from temper.config import Config, ConfigError, Job, Metrics, Model, Profiling, Training
from temper.models.layers.moe import MoE, RoutingStats, load_balancing_loss, load_imbalance
from temper.trainer import Trainer, phases
from temper.trainer.moe_load import MoELoad, load_heatmap, write_load
from temper.trainer.phases import PhaseTimer
from temper.trainer.profiling import StepProfiler
from temper.utils import compat
from temper.utils.device import Runtime

CPU = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)


class Script:
    """A clock and a memory gauge the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.memory = 0.0
        self.peak = 0.0

    def use(self, gib: float) -> None:
        self.memory = gib
        self.peak = max(self.peak, gib)

    def reset(self, device: torch.device) -> None:
        self.peak = self.memory


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Script:
    s = Script()
    monkeypatch.setattr(phases.time, "perf_counter", lambda: s.now)
    monkeypatch.setattr(phases, "peak_memory_gib", lambda device: s.peak)
    monkeypatch.setattr(phases, "reset_peak", s.reset)
    return s


def test_phase_times_are_exclusive_and_peaks_inclusive(script: Script) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):  # two steps: times are means per step, peaks the highest
        with timer("data"):
            script.now += 1.0
            script.use(5.0)  # the parent's peak before the child resets the counter
            script.use(2.0)
            with timer("rollout"):
                script.now += 3.0
                script.use(4.0)
                script.use(1.0)
            script.now += 0.5
        with timer("forward"):
            script.use(3.0)
            script.now += 2.0
        timer.step_done()
    summary = timer.summary()
    assert summary == {
        "time_data_ms": 1500.0,
        "time_rollout_ms": 3000.0,
        "time_forward_ms": 2000.0,
        "mem_data_gib": 5.0,
        "mem_rollout_gib": 4.0,
        "mem_forward_gib": 3.0,
    }
    assert timer.run_peak_gib == 5.0
    assert timer.summary() == {}  # a new window


def test_disabled_timer_keeps_only_the_ranges(script: Script) -> None:
    timer = PhaseTimer(torch.device("cpu"), enabled=False)
    with timer("forward"):
        script.now += 1.0
    timer.step_done()
    assert timer.summary() == {}


def test_real_cpu_peak_sees_a_phases_allocation() -> None:
    """A trainer process started from a large one (a launcher, or this test process late in
    a suite) measures its own peaks: a phase that touches 64 MiB peaks 64 MiB above one that
    allocates nothing. The parent holds 512 MiB: ``ru_maxrss``, which a fork-and-exec child
    inherits, read the parent's size for both phases (0 apart); ``VmHWM`` does not."""
    ballast = torch.ones(512 * 2**20 // 4)  # resident in this process when the child starts
    code = (
        "import torch\n"
        "from temper.trainer.phases import PhaseTimer\n"
        "timer = PhaseTimer(torch.device('cpu'))\n"
        "with timer('forward'):\n"
        "    big = torch.ones(64 * 2**20 // 4)\n"
        "    del big\n"
        "timer.step_done()\n"
        "with timer('backward'):\n"
        "    pass\n"
        "s = timer.summary()\n"
        "print(s['mem_forward_gib'] - s['mem_backward_gib'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ballast[-1].item() == 1.0
    assert 0.055 < float(out.stdout.split()[-1]) < 0.08  # 64 MiB = 0.0625 GiB


def test_trace_written_for_the_chosen_step_only(tmp_path) -> None:
    profiler = StepProfiler(Profiling(trace_steps=[2]), tmp_path, 3, torch.device("cpu"))
    timer = PhaseTimer(torch.device("cpu"))
    for step in (1, 2, 3):
        with profiler.step(step), timer("forward"):
            torch.ones(8, 8) @ torch.ones(8, 8)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step-2"]
    (trace,) = (tmp_path / "profile" / "step-2").glob("rank3.*.pt.trace.json")
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"temper.forward", "aten::mm"} <= names


def test_memory_snapshot_records_only_its_steps(tmp_path, monkeypatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(compat, "record_memory_history", lambda on: calls.append(on))
    monkeypatch.setattr(compat, "dump_memory_snapshot", lambda path: calls.append(path))
    settings = Profiling(memory_snapshot_steps=[2, 3])
    profiler = StepProfiler(settings, tmp_path, 1, torch.device("cuda"))
    for step in (1, 2, 3, 4):
        with profiler.step(step):
            calls.append(f"step {step}")
    snap = tmp_path / "memory_snapshot"
    assert calls == [
        "step 1",
        True,
        "step 2",
        str(snap / "step-2" / "rank1.pickle"),
        False,
        True,
        "step 3",
        str(snap / "step-3" / "rank1.pickle"),
        False,
        "step 4",
    ]


def test_memory_snapshot_on_cpu_is_skipped_with_a_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(compat, "record_memory_history", lambda on: pytest.fail("recorded"))
    profiler = StepProfiler(Profiling(memory_snapshot_steps=[1]), tmp_path, 0, torch.device("cpu"))
    with profiler.step(1):
        pass
    assert "memory_snapshot_steps needs CUDA" in capsys.readouterr().out
    assert not (tmp_path / "memory_snapshot").exists()


def test_profiling_rules_name_the_field() -> None:
    config = Config(metrics=Metrics(log_freq=2), profiling=Profiling(moe_heatmap_freq=3))
    with pytest.raises(ConfigError, match="profiling.moe_heatmap_freq .3. must be 0 or a mult"):
        config.validate(1)
    config.profiling = Profiling(trace_steps=[0])
    with pytest.raises(ConfigError, match="profiling.trace_steps"):
        config.validate(1)
    config.profiling = Profiling(moe_heatmap_freq=4)
    config.validate(1)


class TwoMoELayers(nn.Module):
    """A ``RoutedModel``: it collects its layers' statistics per forward, as MoEDecoder does."""

    args = SimpleNamespace(router_aux_loss_coef=0.0)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [MoE(16, 8, n_experts=4, top_k=2, norm_topk_prob=True) for _ in range(2)]
        )
        for moe in self.layers:
            moe.init_weights(0.5, 0.5)
        self.last_routing: list[RoutingStats] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_routing = []
        for moe in self.layers:
            x, stats = moe(x)
            self.last_routing.append(stats)
        return x

    def routing(self) -> list[RoutingStats]:
        return self.last_routing

    def aux_loss(self) -> torch.Tensor:
        return load_balancing_loss(self.last_routing)

    def load_imbalance(self) -> torch.Tensor:
        return load_imbalance(self.last_routing)


def by_hand(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the router's top-2 choices and its summed entropy for input ``x``."""
    probs = (x.reshape(-1, 16) @ moe.router.gate.weight.T).softmax(-1)
    choices = probs.topk(2, dim=-1).indices
    counts = torch.bincount(choices.flatten(), minlength=4)
    return counts, -(probs * probs.log()).sum()


def test_moe_load_sums_micro_batches_against_the_routers_choices() -> None:
    torch.manual_seed(0)
    model = TwoMoELayers()
    load = MoELoad(model)
    assert load.layer_ids() == ["0", "1"]
    counts = torch.zeros(2, 4, dtype=torch.int64)
    entropy, tokens = torch.zeros(2), 0
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 5, 16)
            inputs = [x, model.layers[0](x)[0]]
            model(x)
            load.add()
            for i, moe in enumerate(model.layers):
                c, e = by_hand(moe, inputs[i])
                counts[i] += c
                entropy[i] += e
            tokens += 10
    metrics, seen = load.summary()
    np.testing.assert_array_equal(seen, counts.numpy())
    imbalance = counts.max(dim=1).values / counts.float().mean(dim=1)
    for i in range(2):
        assert metrics[f"moe_imbalance/{i}"] == pytest.approx(imbalance[i].item())
        expected = entropy[i].item() / tokens / math.log(4)
        assert metrics[f"moe_entropy/{i}"] == pytest.approx(expected, rel=1e-5)
    assert metrics["moe_imbalance_mean"] == pytest.approx(imbalance.mean().item())
    assert load.summary() == ({}, None)  # a new window


def test_heatmap_colours() -> None:
    counts = np.array([[10, 10, 10, 10], [40, 0, 0, 0], [20, 20, 5, 35]])
    image = load_heatmap(counts, cell=2)
    assert image.shape == (6, 8, 3) and image.dtype == np.uint8
    cell = image[::2, ::2]
    assert (cell[0] == 255).all()  # balanced: white
    assert tuple(cell[1, 0]) == (200, 0, 0)  # 4x the mean: full red
    assert (cell[1, 1:] == 0).all()  # unused: black
    assert tuple(cell[2, 2]) == (0, 60, 200)  # a quarter of the mean: full blue
    red, green, blue = (int(c) for c in cell[2, 3])  # 1.75x: a light red
    assert red == round(255 - 55 * math.log(1.75) / math.log(4)) and green == blue < 255


def test_write_load_png_and_counts(tmp_path) -> None:
    counts = np.array([[3, 1], [2, 2]])
    image = write_load(tmp_path, 7, ["1", "3"], counts)
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "step-7.png")), image)
    row = json.loads((tmp_path / "load.jsonl").read_text())
    assert row == {"step": 7, "layers": ["1", "3"], "tokens_per_expert": [[3, 1], [2, 2]]}


@pytest.mark.slow
def test_a_moe_run_logs_phases_and_draws_its_load(tmp_path) -> None:
    config = Config(
        job=Job(dump_folder=str(tmp_path)),
        model=Model(name="qwen3_moe", flavor="debug"),
        training=Training(steps=2, seq_len=16, local_batch_size=2, global_batch_size=4),
        metrics=Metrics(tensorboard=True, log_freq=2),
        profiling=Profiling(moe_heatmap_freq=2),
    )
    trainer = Trainer(config, runtime=CPU)
    assert trainer.train()
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for phase in ("data", "forward", "backward", "optimizer"):
        assert record[f"time_{phase}_ms"] > 0 and record[f"mem_{phase}_gib"] > 0
    assert record["memory_gib"] >= max(record[f"mem_{p}_gib"] for p in ("forward", "backward"))
    layers = trainer.moe_load.layer_ids()
    (row,) = map(json.loads, (tmp_path / "moe" / "load.jsonl").read_text().splitlines())
    assert row["layers"] == layers
    n_experts = trainer.engine.model.args.n_experts
    top_k = trainer.engine.model.args.top_k
    # Every token of both micro-batches of both steps, top_k times, in every routed layer.
    assert [sum(r) for r in row["tokens_per_expert"]] == [2 * 4 * 16 * top_k] * len(layers)
    assert all(len(r) == n_experts for r in row["tokens_per_expert"])
    assert (tmp_path / "moe" / "step-2.png").is_file()
