"""Inputs that used to end in a raw traceback or a silent nonsense figure now get an aioready
error saying what was expected: a trace or hint file that is not UTF-8 (and a spreadsheet's BOM
is accepted), lognormal jitter too wide to mean anything, a NaN learning rate, a metrics port
out of range or in use, an unwritable checkpoint directory (found before step 0); the metrics
server closes idle connections."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from aioready import HintOrder, simulate
from aioready.cli.trainer import TrainConfig
from aioready.errors import ConfigError, HintError, TraceError
from aioready.sim.traces import read_trace
from aioready.sim.variability import parse_jitter

pytestmark = pytest.mark.timeout(60)


def test_trace_encodings(tmp_path: Path) -> None:
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfstep,stage,chunk,microbatch,kind,ms\n0,0,0,0,F,1\n"
                    b"0,0,0,0,B,2\n")
    assert simulate(stages=1, microbatches=1, trace=bom).step_time == 3
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"step,stage\xff\n")
    with pytest.raises(TraceError, match="not UTF-8.*0xff at offset 10"):
        read_trace(bad)


def test_hint_file_not_utf8(tmp_path: Path) -> None:
    bad = tmp_path / "hint.txt"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(HintError, match="not UTF-8"):
        HintOrder.load(bad)


@pytest.mark.parametrize("spec", ["lognormal:40", "lognormal:1e3"])
def test_lognormal_too_wide(spec: str) -> None:
    with pytest.raises(TraceError, match="SIGMA <= 4"):
        parse_jitter(spec)
    parse_jitter("lognormal:4")


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_learning_rate(lr: float) -> None:
    with pytest.raises(ConfigError, match="lr must be a positive finite number"):
        TrainConfig(lr=lr)


def test_metrics_port(capsys: pytest.CaptureFixture[str]) -> None:
    from aioready.cli import main
    with pytest.raises(ConfigError, match="metrics_port out of range"):
        TrainConfig(metrics_port=99999)
    from aioready.telemetry.prometheus import serve_metrics
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve_metrics(port, None)
    assert main(["train", "--metrics-port", "99999", "--steps", "1"]) != 0
    assert "metrics_port out of range" in capsys.readouterr().err


def test_unwritable_checkpoint_dir_found_before_step_0(tmp_path: Path) -> None:
    import asyncio

    from aioready.cli.trainer import train
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = TrainConfig(stages=2, microbatches=2, steps=1, task_ms=0, batch=1, seq=4, dim=8,
                      heads=1, vocab=16, checkpoint_dir=str(blocker / "ckpt"))
    with pytest.raises(ConfigError, match="cannot write checkpoints to"):
        asyncio.run(train(cfg))


def test_trace_row_far_out_is_refused_without_a_huge_table(tmp_path: Path) -> None:
    path = tmp_path / "far.csv"
    path.write_text("step,stage,chunk,microbatch,kind,ms\n0,0,0,0,F,1\n0,0,0,0,B,2\n"
                    "0,0,0,100000000,F,1\n")
    with pytest.raises(TraceError, match="rows span 1 steps x 1 stages x 100000001 micro"):
        read_trace(path)


def test_stage_count_is_bounded_and_placement_is_linear_time() -> None:
    from aioready.placement import MAX_STAGES, Placement
    with pytest.raises(ConfigError, match="too many stages"):
        Placement(10**23, 10**23)
    big = Placement(MAX_STAGES, MAX_STAGES)  # S^2 = 4e9 steps before: never ended in a test
    assert big.stages_of(MAX_STAGES - 1) == (MAX_STAGES - 1,)
    inter = Placement(8, 2, "interleaved")
    assert inter.stages_of(1) == (1, 3, 5, 7) and inter.chunk_of(5) == 2


def test_metrics_server_closes_idle_connections() -> None:
    from prometheus_client import CollectorRegistry

    from aioready.telemetry.prometheus import serve_metrics
    server = serve_metrics(0, CollectorRegistry(), idle_timeout=0.2)
    try:
        with socket.create_connection(("127.0.0.1", server.server_port)) as idle:
            idle.settimeout(30)  # a hang fails here, not the whole run
            assert idle.recv(1) == b""  # closed by the server, not kept forever
        with socket.create_connection(("127.0.0.1", server.server_port)) as client:
            client.settimeout(30)
            client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert client.recv(12).startswith(b"HTTP/1.0 200")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("value", ["fast", "-1"])
def test_cpu_inline_threshold_from_env_is_checked(monkeypatch, value: str) -> None:
    from aioready.devices.cpu import CPUDevice
    from aioready.errors import ConfigError

    monkeypatch.setenv("AIOREADY_CPU_INLINE_US", value)
    with pytest.raises(ConfigError, match="AIOREADY_CPU_INLINE_US"):
        CPUDevice()
    monkeypatch.setenv("AIOREADY_CPU_INLINE_US", "50")
    device = CPUDevice()
    try:
        assert device.inline_below_s == pytest.approx(50e-6)
    finally:
        device.close()
