"""The ``vllm`` rollout engine: completions from a vLLM server, weights pushed after each
update.

A managed server (no ``--rollout.url``) is started by rank 0 from an HF folder in
``rollout.weights_dir`` (``/dev/shm``): config.json and the run's starting weights, streamed
from the trainer. Each ``update_weights`` streams the current weights into the same folder
(``temper.generation.engines.weights``: one bucket in memory at a time; every rank iterates,
rank 0 writes) and has the server reload them between a pause and a resume; a barrier then
keeps every rank from sampling before the reload ended. So a restarted server starts from
the newest weights. A managed server that dies is restarted once, on the same port, with a
message; a second death ends the run.

Sampling: temperature, top-k and top-p as vLLM's; ``--logprobs-mode processed_logprobs``
returns each token's log-probability after the temperature (raw log-softmax when greedy),
what Temper's sampler returns, except that with top-k or top-p vLLM's are renormalized
over the kept tokens. Seeds come from the caller's generator, one per row.

On CUDA, vLLM's weight-transfer engine (NCCL broadcast from the trainer into the server's
GPUs) would skip the files; it is not used (docs/post-training.md says what it needs).
"""

from __future__ import annotations

import shlex
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from temper.generation.decoding import Generation
from temper.generation.engines.base import SamplingParams
from temper.generation.engines.vllm_client import Completion, ServerGone, VLLMClient
from temper.generation.engines.vllm_server import (
    ManagedServer,
    ServerSettings,
    check_environment,
    find_python,
    free_port,
)
from temper.generation.engines.weights import write_weights
from temper.models.hf import adapter_of, write_hf_config

Weights = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class VLLMSettings:
    """What the ``vllm`` engine needs from ``--rollout.*`` and the run."""

    url: str | None
    """An external server; None starts one."""
    python: str | None
    weights_dir: Path
    bucket_bytes: int
    max_model_len: int
    kv_cache_bytes: int
    startup_timeout_s: float
    log: Path
    extra_args: str = ""


class VLLMEngine:
    """A vLLM server as a ``RolloutEngine`` (see the module docstring)."""

    def __init__(
        self,
        client: VLLMClient,
        server: ManagedServer | None,
        weights_dir: Path,
        bucket_bytes: int,
        writer: bool,
        tied: bool,
    ) -> None:
        self.client = client
        self.tied = tied
        self.server = server
        self.weights_dir = weights_dir
        self.bucket_bytes = bucket_bytes
        self.writer = writer
        """This rank writes the files and asks for the reload (rank 0)."""
        self.restarts_left = 1
        self.push_seconds = 0.0
        """Time spent in ``update_weights`` (writing and reloading), summed."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Generation:
        base = 0
        if generator is not None:
            base = int(torch.randint(2**31 - len(prompts), (1,), generator=generator))
        seeds = [base + i for i in range(len(prompts))]
        sampling = {
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": sorted(params.stop_tokens),
            "ignore_eos": True,  # only the caller's stop tokens end a row
        }
        prompts = [list(map(int, p)) for p in prompts]
        try:
            answers = self.client.complete(prompts, seeds, sampling)
        except ServerGone:
            self._recover()
            answers = self.client.complete(prompts, seeds, sampling)
        return as_generation(answers, params.max_new_tokens)

    def update_weights(self, weights: Weights) -> None:
        started = time.perf_counter()
        if self.writer:
            write_weights(self.weights_dir, served_weights(weights, self.tied)(), self.bucket_bytes)
            try:
                self.client.reload_weights(str(self.weights_dir))
            except ServerGone:
                self._recover()  # a restarted server starts from the folder's weights
        else:
            for _ in weights():  # each tensor is a collective under FSDP
                pass
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        self.push_seconds += time.perf_counter() - started

    def _recover(self) -> None:
        """Restart a managed server that died, once; an external one is waited for."""
        if self.server is None or not self.writer:
            deadline = time.monotonic() + 600
            while not self.client.healthy():
                if time.monotonic() > deadline:
                    raise ServerGone(f"vLLM at {self.client.url} is gone and did not come back")
                time.sleep(2)
            return
        if self.restarts_left == 0:
            raise RuntimeError(
                f"the vLLM server died again after a restart; its log: {self.server.settings.log}"
            )
        self.restarts_left -= 1
        code = self.server.process.poll() if self.server.process is not None else None
        print(
            f"temper: the vLLM server stopped answering (exit code {code}); restarting it once "
            f"(log {self.server.settings.log})",
            flush=True,
        )
        self.server.stop()
        self.server.start()

    def close(self) -> None:
        """Stop a managed server and free the weights folder (memory, in /dev/shm)."""
        if self.server is not None:
            self.server.stop()
        if self.writer:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


def served_weights(weights: Weights, tied: bool) -> Weights:
    """``weights`` as vLLM reloads them: a model with tied embeddings also gets
    ``lm_head.weight``. vLLM's in-place reload copies each layer's new values into its own
    tensors, and its CPU build keeps the head's apart from the embedding's: without its own
    entry the head would keep the starting weights (measured: greedy tokens then differ)."""
    if not tied:
        return weights

    def with_head() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights():
            yield name, tensor
            if name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor

    return with_head


def as_generation(answers: list[Completion], max_new_tokens: int) -> Generation:
    """Completions as ``generate`` returns them: tokens padded with 0 after each row's end,
    lengths, log-probabilities (0 after the end), finish reasons."""
    rows = len(answers)
    tokens = torch.zeros(rows, max_new_tokens, dtype=torch.long)
    log_probs = torch.zeros(rows, max_new_tokens)
    lengths = torch.zeros(rows, dtype=torch.long)
    for i, answer in enumerate(answers):
        n = len(answer.tokens)
        tokens[i, :n] = torch.tensor(answer.tokens, dtype=torch.long)
        log_probs[i, :n] = torch.tensor(answer.log_probs, dtype=torch.float32)
        lengths[i] = n
    return Generation(tokens, lengths, log_probs, [a.finish_reason for a in answers])


def start_vllm(settings: VLLMSettings, model: nn.Module, weights: Weights) -> VLLMEngine:
    """The ``vllm`` engine of this rank: with a managed server, rank 0 checks the environment,
    writes the starting folder and starts the server; the others learn its URL. Every rank
    calls this (the starting weights are a collective under FSDP)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = rank == 0
    tied = model.args.tie_embeddings
    folder = settings.weights_dir
    if settings.url is not None:
        client = VLLMClient(settings.url)
        engine = VLLMEngine(client, None, folder, settings.bucket_bytes, writer, tied)
        engine.update_weights(weights)  # the server may hold other weights than the run's
        return engine
    server = None
    url = [""]
    if writer:
        python = find_python(settings.python)
        architectures = adapter_of(model).args_to_hf(model.args)["architectures"]
        check_environment(python, architectures)
        folder.mkdir(parents=True, exist_ok=True)
        first = next(model.parameters())
        dtype = first.dtype
        write_hf_config(folder, model, dtype)
        write_weights(folder, served_weights(weights, tied)(), settings.bucket_bytes)
        server = ManagedServer(
            ServerSettings(
                python=python,
                model=str(folder),
                dtype=str(dtype).removeprefix("torch."),
                max_model_len=settings.max_model_len,
                kv_cache_bytes=settings.kv_cache_bytes,
                log=settings.log,
                startup_timeout_s=settings.startup_timeout_s,
                port=free_port(),
                extra_args=tuple(shlex.split(settings.extra_args)),
                cpu=first.device.type == "cpu",
            )
        )
        url = [server.start().url]
    else:
        for _ in weights():
            pass
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(url, src=0)
    return VLLMEngine(VLLMClient(url[0]), server, folder, settings.bucket_bytes, writer, tied)
