"""Peak FLOP/s lookup and cache, throughput arithmetic and the metrics files."""

from __future__ import annotations

import json

import pytest
import torch

from temper.data.batch import REAL_TOKENS, real_share
from temper.models.qwen3.args import Qwen3Args
from temper.models.qwen3.model import Qwen3Transformer
from temper.trainer import metrics as metrics_module
from temper.trainer.metrics import MetricsLogger, Throughput, format_line
from temper.utils import peak_flops as peak_module
from temper.utils.peak_flops import cpu_peak_flops, gpu_peak_flops


def test_gpu_table_prefers_the_specific_name() -> None:
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA H200", torch.float32) == 67e12
    assert gpu_peak_flops("NVIDIA GB200", torch.bfloat16) == 2.5e15
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_cpu_probe_runs_once_then_reads_the_cache(tmp_path, monkeypatch) -> None:
    calls = []

    def fake_probe(dtype: torch.dtype) -> float:
        calls.append(dtype)
        return 123e9

    monkeypatch.setattr(peak_module, "_measure_matmul_flops", fake_probe)
    cache = tmp_path / "peak.json"
    assert cpu_peak_flops(torch.float32, cache) == 123e9
    assert cpu_peak_flops(torch.float32, cache) == 123e9
    assert calls == [torch.float32]
    assert list(json.loads(cache.read_text()).values()) == [123e9]


def test_real_probe_counts_two_n_cubed_over_the_fastest_repeat(monkeypatch) -> None:
    """An n x n matmul is n^3 multiply-adds: 2 n^3 flops, over the fastest timed repeat (the
    warm-up untimed), checked with a clock that hands out known durations."""
    shapes = []
    mm = torch.mm

    def counted_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        shapes.append((tuple(a.shape), tuple(b.shape), a.dtype))
        return mm(a, b)

    ticks = iter([10.0, 10.5, 20.0, 20.25, 30.0, 30.4])  # repeats of 0.5 s, 0.25 s, 0.4 s
    monkeypatch.setattr(peak_module.torch, "mm", counted_mm)
    monkeypatch.setattr(peak_module.time, "perf_counter", lambda: next(ticks))
    rate = peak_module._measure_matmul_flops(torch.bfloat16, n=96, repeats=3)
    assert rate == 2 * 96**3 / 0.25
    assert shapes == [((96, 96), (96, 96), torch.bfloat16)] * 4  # a warm-up, then 3 timed


def test_throughput_arithmetic(monkeypatch) -> None:
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    throughput = Throughput(flops_per_token=lambda width: 1e9, peak_flops=4e12, total_steps=10)
    throughput.add_rows(4, 1000)
    rates = throughput.measure(step=2)
    assert rates["tokens_per_second"] == pytest.approx(2000.0)
    assert rates["tflops"] == pytest.approx(2.0)  # 1e9 flops/token x 2000 tokens/s
    assert rates["mfu"] == pytest.approx(50.0)
    assert rates["eta_seconds"] == pytest.approx(8.0)  # 1 s/step x 8 steps left


def test_flops_count_padded_rows_at_their_width(monkeypatch) -> None:
    """Two micro-batches: 2 rows of 8 positions and 3 of 4 (right-padded, the padding is
    computed): 28 positions, each at the FLOPs per token of its row's width."""
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    args = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64,
                     ffn_hidden_dim=48)  # fmt: skip
    model = Qwen3Transformer(args)
    throughput = Throughput(model.flops_per_token, peak_flops=1e6, total_steps=1)
    throughput.add_rows(2, 8)
    throughput.add_rows(3, 4)
    rates = throughput.measure(step=1)
    weights = sum(p.numel() for p in model.parameters()) - 64 * 32  # the lookup table is free
    by_hand = 16 * (6 * weights + 12 * 2 * 4 * 8 * 8) + 12 * (6 * weights + 12 * 2 * 4 * 8 * 4)
    assert rates["tokens_per_second"] == 28
    assert rates["tflops"] * 1e12 == pytest.approx(by_hand, rel=1e-12)
    assert rates["mfu"] == pytest.approx(100 * by_hand / 1e6, rel=1e-12)


def test_eta_uses_the_recent_steps(monkeypatch) -> None:
    """10 slow steps (1 s) then 30 fast ones (0.1 s): after them the ETA counts 0.1 s per
    step, where the average since the start (0.325 s) would overstate it threefold."""
    times = [100.0] + [100.0 + s for s in range(1, 11)] + [110.0 + 0.1 * s for s in range(1, 31)]
    clock = iter(times)
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    throughput = Throughput(flops_per_token=lambda width: 1.0, peak_flops=None, total_steps=100)
    for step in range(1, 41):
        rates = throughput.measure(step)
    assert rates["eta_seconds"] == pytest.approx(0.1 * 60)


TRAINER_ROW = {
    "loss": 2.5,
    "grad_norm": 0.5,
    "lr": 1e-3,
    "tokens_per_second": 1000.0,
    "computed_tokens_per_second": 1250.0,
    "packing_efficiency": 80.0,
    "tflops": 0.1,
    "mfu": 5.0,
    "memory_gib": 1.0,
    "eta_seconds": 61.0,
}
"""What the trainer logs every step, whatever the objective."""


def test_logger_writes_jsonl_and_console(tmp_path, capsys) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=True, enabled=True)
    row = dict(TRAINER_ROW)
    logger.log(3, row)
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, **row}
    assert any((tmp_path / "tb").iterdir())
    line = capsys.readouterr().out
    assert "step      3  loss 2.5000  grad_norm 0.500" in line and "eta 00:01:01" in line
    assert "tok/s 1,000 of 1,250 (packing 80.0%)" in line


def test_throughput_counts_real_tokens_beside_the_computed_positions(monkeypatch) -> None:
    """Padded rows, by hand: an SFT micro-batch of 2 rows of 8 positions holding 6 and 4 real
    tokens, and a DPO pair (1 row a side, 8 wide) of 5 and 3: 18 real tokens of 32 computed
    in 2 s. Tokens/s and the FLOPs count the 18 only; the 32 and their ratio stand beside."""
    clock = iter([0.0, 2.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    sft = {"input_ids": torch.zeros(2, 8, dtype=torch.long), REAL_TOKENS: torch.tensor([6, 4])}
    pair = {
        "chosen_input_ids": torch.zeros(1, 8, dtype=torch.long),
        f"chosen_{REAL_TOKENS}": torch.tensor([5]),
        "rejected_input_ids": torch.zeros(1, 8, dtype=torch.long),
        f"rejected_{REAL_TOKENS}": torch.tensor([3]),
    }
    text = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}  # packed text: all real
    assert real_share(sft) == 10 / 16
    assert real_share(pair, "chosen_") == 5 / 8 and real_share(pair, "rejected_") == 3 / 8
    assert real_share(text) == 1.0
    throughput = Throughput(flops_per_token=lambda width: 100.0, peak_flops=3600.0, total_steps=1)
    throughput.add_rows(2, 8, real_share(sft))
    throughput.add_rows(1, 8, real_share(pair, "chosen_"))
    throughput.add_rows(1, 8, real_share(pair, "rejected_"))
    rates = throughput.measure(step=1)
    assert rates["tokens_per_second"] == pytest.approx(18 / 2)
    assert rates["computed_tokens_per_second"] == pytest.approx(32 / 2)
    assert rates["packing_efficiency"] == pytest.approx(100 * 18 / 32)
    assert rates["tflops"] * 1e12 == pytest.approx(18 * 100 / 2)
    assert rates["mfu"] == pytest.approx(100 * 900 / 3600)  # 25%, where counting padding: 44%


def test_console_line_shows_an_objectives_headline_metrics() -> None:
    row = TRAINER_ROW | {"step": 7, "loss": 0.0, "accuracy": 0.5, "reward_mean": 1.25}
    line = format_line(row | {"entropy": 0.4})  # entropy goes to metrics.jsonl only
    assert "loss 0.0000  reward_mean 1.250  accuracy 0.500  grad_norm 0.500" in line
    assert "entropy" not in line


def test_disabled_logger_writes_nothing(tmp_path) -> None:
    logger = MetricsLogger(tmp_path / "run", tensorboard=True, enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_console_line_shows_the_step_of_the_total(tmp_path, capsys) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False, enabled=True, total_steps=60)
    logger.log(12, dict(TRAINER_ROW))
    logger.close()
    assert capsys.readouterr().out.startswith("step  12/60  loss 2.5000")
