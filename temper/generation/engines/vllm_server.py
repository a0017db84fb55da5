"""A vLLM server the run starts, watches and stops: ``--rollout.engine vllm`` without
``--rollout.url``.

The server runs from its own virtualenv (``scripts/setup_vllm.sh`` makes it under
``~/.cache/temper/venv-vllm``; ``--rollout.vllm_python`` names another interpreter), on
127.0.0.1 at a free port, under a watchdog (``vllm_watchdog.py``) in a process group of its
own. ``stop`` ends the group; an atexit handler stops it on any exit of Python, and the
watchdog stops it when the trainer process is gone without one (SIGKILL, a failed rank that
torchrun killed). Before the start, ``check_environment`` names what cannot work: no
interpreter, a vLLM release Temper does not know, an architecture vLLM does not list.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from temper.generation.engines.vllm_client import VLLMClient

SUPPORTED = ("0.32.",)
"""vLLM releases whose server API (token-id prompts, /pause, /resume, /collective_rpc with
reload_weights) this module was checked against."""

DEFAULT_VENV = Path.home() / ".cache" / "temper" / "venv-vllm"
SETUP = "scripts/setup_vllm.sh"
WATCHDOG = Path(__file__).with_name("vllm_watchdog.py")


class VLLMStartupError(RuntimeError):
    """The managed server cannot start; the message says why and what to do."""


def find_python(override: str | None) -> str:
    """The interpreter to run vLLM with: ``override``, else the setup script's virtualenv."""
    python = override or str(DEFAULT_VENV / "bin" / "python")
    if not os.access(python, os.X_OK):
        flag = "rollout.vllm_python" if override else f"no {python}"
        raise VLLMStartupError(
            f"rollout.engine vllm: {flag} ({python}) is not an executable interpreter; run "
            f"{SETUP} once (it builds {DEFAULT_VENV}), or pass --rollout.vllm_python"
        )
    return python


def check_environment(python: str, architectures: list[str]) -> str:
    """vLLM's version in ``python``'s environment, after checking that Temper knows it and
    that vLLM lists the model's ``architectures``; VLLMStartupError naming the problem."""
    probe = (
        "import json, vllm\n"
        "from vllm import ModelRegistry\n"
        "print(json.dumps([vllm.__version__, sorted(ModelRegistry.get_supported_archs())]))"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise VLLMStartupError(
            f"rollout.engine vllm: {python} cannot import vllm (run {SETUP}):\n{tail}"
        )
    version, known = json.loads(done.stdout.strip().splitlines()[-1])
    if not version.startswith(SUPPORTED):
        raise VLLMStartupError(
            f"rollout.engine vllm: {python} has vLLM {version}; Temper supports "
            f"{', '.join(v + 'x' for v in SUPPORTED)} (run {SETUP})"
        )
    missing = [a for a in architectures if a not in known]
    if missing:
        raise VLLMStartupError(
            f"rollout.engine vllm: vLLM {version} cannot load {', '.join(missing)} (the model's "
            "config.json architectures); use --rollout.engine native"
        )
    return version


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerSettings:
    """How the managed server is started."""

    python: str
    model: str
    """An HF folder (config.json, the run's starting weights)."""
    dtype: str
    max_model_len: int
    kv_cache_bytes: int
    log: Path
    startup_timeout_s: float
    port: int
    """Kept across a restart, so every rank's client still finds the server."""
    extra_args: tuple[str, ...] = ()
    cpu: bool = False
    """vLLM's CPU build: its model runner is started inside the engine process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless the environment sets it), which saves one
    Python process and its import of vLLM per start (ready in 24 s against 34 s here)."""


class ManagedServer:
    """One vLLM OpenAI-compatible server process group (see the module docstring)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.process: subprocess.Popen[bytes] | None = None
        self.client: VLLMClient | None = None
        atexit.register(self.stop)

    def command(self, port: int) -> list[str]:
        s = self.settings
        return [
            s.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            s.model,
            "--served-model-name",
            "temper",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            s.dtype,
            "--max-model-len",
            str(s.max_model_len),
            "--kv-cache-memory-bytes",
            str(s.kv_cache_bytes),
            "--enforce-eager",
            "--skip-tokenizer-init",
            "--logprobs-mode",
            "processed_logprobs",
            "--seed",
            "0",
            "--generation-config",
            "vllm",
            *s.extra_args,
        ]

    def environment(self, inherited: Mapping[str, str]) -> dict[str, str]:
        """The server's environment: ``inherited`` with the development endpoints on
        (``/collective_rpc``, ``/pause``) and, on CPU, the in-process model runner by default."""
        defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.settings.cpu else {}
        return (
            defaults
            | dict(inherited)
            | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CONFIGURE_LOGGING": "1"}
        )

    def start(self) -> VLLMClient:
        """Start the server and wait for its health check, printing the wait; the client."""
        s = self.settings
        port = s.port
        s.log.parent.mkdir(parents=True, exist_ok=True)
        env = self.environment(os.environ)
        with open(s.log, "ab") as log:
            self.process = subprocess.Popen(
                [s.python, str(WATCHDOG), str(os.getpid()), *self.command(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.client = VLLMClient(f"http://127.0.0.1:{port}")
        print(
            f"temper: starting vLLM on 127.0.0.1:{port} (log {s.log}; up to "
            f"{s.startup_timeout_s:.0f} s)",
            flush=True,
        )
        started = last_said = time.monotonic()
        while not self.client.healthy():
            if self.process.poll() is not None:
                raise VLLMStartupError(
                    f"rollout.engine vllm: the vLLM server exited ({self.process.returncode}) "
                    f"while starting:\n{log_tail(s.log)}"
                )
            now = time.monotonic()
            if now - started > s.startup_timeout_s:
                self.stop()
                raise VLLMStartupError(
                    f"rollout.engine vllm: no healthy server after {s.startup_timeout_s:.0f} s "
                    f"(--rollout.startup_timeout_s); its log {s.log} ends:\n{log_tail(s.log)}"
                )
            if now - last_said > 30:
                print(f"temper: waiting for vLLM ({now - started:.0f} s)", flush=True)
                last_said = now
            time.sleep(1)
        print(f"temper: vLLM ready in {time.monotonic() - started:.0f} s", flush=True)
        return self.client

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 30 s); idempotent."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass


def log_tail(log: Path, lines: int = 15) -> str:
    """The last lines of the server's log, where vLLM states why it stopped."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
