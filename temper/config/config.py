"""The typed config tree that a recipe returns and the CLI overrides.

Every field has a type and a default; the docstring under a field is its `--help`
text. `Config.validate()` checks the rules that span fields, before any model or
process group exists, and names the offending field in its error.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Run folder: config.json, metrics.jsonl, TensorBoard logs and checkpoints go here."""
    description: str = ""
    """Free text, printed at start and saved with the config."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family, as registered with `temper.models.register_model`."""
    flavor: str = "debug"
    """Named size of the family (e.g. debug, 1b, 8b)."""
    hf_path: str | None = None
    """Local Hugging Face folder: its config.json sets the family and sizes (name and
    flavor are then ignored), its safetensors the weights, its tokenizer.json the tokenizer."""
    attn: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """Attention backend (block-causal over packed documents): sdpa with an explicit mask
    (reference, CPU training), flex (FlexAttention; CUDA, forward only on CPU), varlen (flash,
    CUDA sm80+, bf16). auto = sdpa, or for packed documents on CUDA varlen else flex."""


@dataclass
class Training:
    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """Seed for model init, data order and dropout."""
    seq_len: int = 256
    """Tokens per sequence."""
    local_batch_size: int = 8
    """Sequences per micro-batch on one rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1 means local x dp
    (no accumulation). Gradient accumulation = global / (local x dp)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype; auto = float32 on CPU, bfloat16 on CUDA."""
    max_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping."""
    deterministic: bool = False
    """Use deterministic algorithms (bitwise repeatable runs, slower on GPU)."""


@dataclass
class Optimizer:
    name: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = 3e-4
    """Peak learning rate."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms or biases)."""
    offload_during_rollout: bool = False
    """grpo: move the optimizer state to CPU while rollouts are sampled, freeing device
    memory for the KV cache; it comes back before the next step."""


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to the peak lr."""
    decay: Literal["linear", "cosine", "wsd"] = "cosine"
    """Shape after warmup; wsd holds the peak then decays linearly over decay_ratio."""
    decay_ratio: float = 0.2
    """wsd only: fraction of all steps spent in the final decay."""
    min_lr_ratio: float = 0.0
    """The lr at the last step, as a fraction of the peak."""


@dataclass
class Data:
    path: str | None = None
    """A .txt or .jsonl file, or a folder of them; None = the built-in synthetic tasks."""
    text_field: str = "text"
    """JSONL field holding a document's text."""
    tokenizer_path: str | None = None
    """tokenizer.json or a folder holding one; None = model.hf_path's, else the built-in."""
    format: Literal["text", "sft", "preference", "prompt"] = "text"
    """text: pretraining documents; sft: JSONL with "messages" (chat); preference: JSONL with
    "prompt", "chosen", "rejected" (DPO); prompt: JSONL with "prompt" and "answer" (GRPO).
    path None = the built-in tasks of that format."""
    chat_template: str | None = None
    """sft/preference: a Jinja chat template file; None = the tokenizer folder's, else the
    built-in template of the built-in tokenizer."""
    train_on_prompt: bool = False
    """sft: also train on system/user tokens, not only the assistant's."""
    pack: bool = True
    """sft: pack whole samples into rows (isolated by position_ids); else one padded sample a
    row."""
    max_length_policy: Literal["truncate", "drop"] = "truncate"
    """sft/preference: a sample longer than training.seq_len + 1 tokens is cut or skipped;
    counts are logged as data_truncated / data_dropped."""
    builtin_examples: int = 4096
    """sft/preference/prompt without a path: training examples drawn from the built-in
    tasks."""


@dataclass
class Objective:
    name: str = "causal_lm"
    """Training objective, as registered with `temper.objectives.register_objective`:
    causal_lm (pretraining, SFT), dpo or grpo."""
    beta: float = 0.1
    """dpo: strength of the pull toward the reference (the KL coefficient)."""
    label_smoothing: float = 0.0
    """dpo sigmoid loss: assumed probability that a preference label is flipped."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """dpo: sigmoid (DPO) or ipo."""
    group_size: int = 8
    """grpo: completions sampled per prompt; advantages are normalized within the group."""
    max_new_tokens: int = 32
    """grpo: the longest completion; prompts get training.seq_len minus this."""
    temperature: float = 1.0
    """grpo: sampling temperature of the rollouts (0 is greedy)."""
    top_k: int | None = None
    """grpo: sample among the k most likely tokens; None = all."""
    top_p: float = 1.0
    """grpo: nucleus sampling mass; 1.0 = off."""
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """grpo: reward functions registered with `temper.objectives.register_reward`, summed."""
    reward_weights: list[float] = field(default_factory=list)
    """grpo: one weight per reward; empty = all 1."""
    clip_eps: float = 0.2
    """grpo: the importance ratio is clipped to [1 - eps, 1 + eps] (PPO)."""
    kl_coef: float = 0.0
    """grpo: weight of the k3 KL estimate to the reference model; 0 builds no reference."""
    updates_per_rollout: int = 1
    """grpo: optimizer steps taken on each rollout batch (the first one is on-policy)."""


@dataclass
class LoRA:
    enable: bool = False
    """Train low-rank adapters on target_modules; every other weight is frozen."""
    rank: int = 8
    alpha: float = 16.0
    """Adapter scale numerator: scale = alpha / rank (alpha / sqrt(rank) with rslora)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    rslora: bool = False
    """Rank-stabilized scale alpha / sqrt(rank)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["layers.*.attention.w*", "layers.*.feed_forward.w*"]
    )
    """fnmatch patterns on module names of the linear layers to adapt."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Log every N steps (console, TensorBoard, metrics.jsonl)."""
    tensorboard: bool = True
    """Write TensorBoard events to <dump_folder>/tb."""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """HSDP replica groups (data parallel, weights replicated)."""
    dp_shard: int = -1
    """FSDP shard degree; -1 = the rest of the world size."""
    sp: int = 1
    """Ulysses sequence-parallel degree."""
    ep: int = 1
    """Expert-parallel degree."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free a block's gathered weights after its forward (and gather again for backward)?
    default: every block but the last; always; never (more memory, less communication)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Per block: none stores every activation; full keeps only block inputs and recomputes
    the rest in backward; selective also keeps matmul and attention outputs."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each decoder block (regional compilation), on CPU and GPU."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints during training, and resume from them."""
    folder: str = "checkpoints"
    """Subfolder of job.dump_folder that holds step-<N>/ checkpoints."""
    interval: int = 500
    """Save every N steps; the last step is always saved."""
    keep_latest_k: int = 0
    """Keep only the newest K complete checkpoints; 0 keeps all."""
    async_mode: bool = False
    """DCP asynchronous save: training waits only for the in-memory staging copy."""
    resume: str = "auto"
    """auto (the latest complete checkpoint, if any), never, or a step number."""
    initial_load: str | None = None
    """A checkpoint folder whose model weights start a new run (when there is nothing to
    resume)."""
    initial_recipe: str | None = None
    """``module:function`` of a recipe, then any of its overrides (``--training.steps 90``),
    to train first when initial_load is None; its final checkpoint (under
    job.dump_folder/initial, reused once there) becomes initial_load."""


Impl = Literal["auto", "reference", "compile", "triton"]
Op = Literal["cross_entropy", "rmsnorm", "swiglu", "rope", "moe_permute", "gated_delta"]


@dataclass
class Kernels:
    """Fused-kernel choices of a run (``--kernels.*``)."""

    fused_cross_entropy: bool = True
    """LM head and loss in chunks of tokens, the gradient computed chunk by chunk with the
    loss, so the full [tokens, vocab] logits and their gradient never exist; False computes
    full logits."""
    cross_entropy_chunk: int = 0
    """Tokens per chunk of the fused cross-entropy (memory grows with chunk x vocab); 0 picks
    by device: 256 on CPU, where a chunk's logits add to the peak and smaller chunks measured
    no slower, 2048 on CUDA, where fewer chunks mean fewer fp32 weight-gradient updates."""
    cross_entropy: Impl = "auto"
    """Softmax and gradient of each logits chunk: auto, reference, compile or triton (CUDA)."""
    rmsnorm: Impl = "auto"
    """RMSNorm (block norms, final norm, q/k norms)."""
    swiglu: Impl = "auto"
    """silu(gate) * up in the MLPs and experts."""
    rope: Impl = "auto"
    """Rotary embedding of q and k."""
    moe_permute: Impl = "auto"
    """Gathering tokens by expert and the weighted sum back (MoE)."""
    gated_delta: Impl = "auto"
    """Gated DeltaNet's chunked delta rule; triton runs flash-linear-attention's kernel when
    the ``fla`` package is installed (CUDA)."""

    def __post_init__(self) -> None:
        if self.cross_entropy_chunk < 0:
            raise ValueError(f"cross_entropy_chunk must be >= 0, got {self.cross_entropy_chunk}")
        for op in get_args(Op):
            if getattr(self, op) not in get_args(Impl):
                raise ValueError(f"kernels.{op} must be one of {get_args(Impl)}")

    def chunk_tokens(self, device: torch.device) -> int:
        """The fused cross-entropy's chunk on ``device``."""
        if self.cross_entropy_chunk:
            return self.cross_entropy_chunk
        return 256 if device.type == "cpu" else 2048


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    objective: Objective = field(default_factory=Objective)
    lora: LoRA = field(default_factory=LoRA)
    metrics: Metrics = field(default_factory=Metrics)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    kernels: Kernels = field(default_factory=Kernels)

    def validate(self, world_size: int | None = None) -> None:
        """Raise ConfigError naming the first field that breaks a rule."""
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        _check_positive(self, "training.steps", "training.seq_len", "training.local_batch_size")
        _check_positive(self, "optimizer.lr", "optimizer.eps", "metrics.log_freq")
        _check_positive(self, "checkpoint.interval")
        _check_range(self, "optimizer.beta1", 0.0, 1.0, right_open=True)
        _check_range(self, "optimizer.beta2", 0.0, 1.0, right_open=True)
        _check_range(self, "lr_scheduler.min_lr_ratio", 0.0, 1.0)
        _check_range(self, "lr_scheduler.decay_ratio", 0.0, 1.0)
        for name in ("optimizer.weight_decay", "training.max_norm", "lr_scheduler.warmup_steps"):
            if _get(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {_get(self, name)}")
        dp = self.data_parallel_size(world_size)
        local, global_ = self.training.local_batch_size, self.training.global_batch_size
        if global_ != -1 and (global_ <= 0 or global_ % (local * dp)):
            raise ConfigError(
                f"training.global_batch_size ({global_}) must be -1 or a positive multiple of "
                f"training.local_batch_size x data-parallel size ({local} x {dp} = {local * dp})"
            )
        _check_model(self.model)
        _check_expert_parallel(self)
        _check_sequence_parallel(self)
        _check_attention(self)
        _check_checkpoint(self.checkpoint)
        _check_posttrain(self)

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that see different data: the world divided by the non-data degrees."""
        from temper.parallel.dims import ParallelDims

        return ParallelDims.from_config(self.parallelism, world_size).dp

    def grad_accum_steps(self, world_size: int) -> int:
        dp = self.data_parallel_size(world_size)
        local = self.training.local_batch_size
        global_ = self.training.global_batch_size
        return 1 if global_ == -1 else global_ // (local * dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _get(config: Config, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def _check_positive(config: Config, *names: str) -> None:
    for name in names:
        if _get(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {_get(config, name)}")


def _check_range(
    config: Config, name: str, low: float, high: float, right_open: bool = False
) -> None:
    value = _get(config, name)
    if not low <= value <= high or (right_open and value == high):
        bracket = ")" if right_open else "]"
        raise ConfigError(f"{name} must be in [{low}, {high}{bracket}, got {value}")


def _check_model(model: Model) -> None:
    from temper.models import get_model_spec, model_names
    from temper.models.hf import read_hf_args

    if model.hf_path is not None:
        try:
            read_hf_args(model.hf_path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.hf_path: {err}") from err
        return

    if model.name not in model_names():
        raise ConfigError(
            f"model.name {model.name!r} is not a registered model; choose one of "
            f"{', '.join(model_names())}"
        )
    flavors = get_model_spec(model.name).flavors
    if model.flavor not in flavors:
        raise ConfigError(
            f"model.flavor {model.flavor!r} is not a flavor of {model.name}; choose one of "
            f"{', '.join(flavors)}"
        )


def _check_attention(config: Config) -> None:
    """A backend that this machine's training device lacks fails here, before any work."""
    import torch

    from temper.kernels.attention import backend_unavailable
    from temper.utils.device import resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(config.training.dtype, device)
    reason = backend_unavailable(config.model.attn, device, dtype, backward=True)
    if reason is not None:
        raise ConfigError(f"model.attn {config.model.attn!r}: {reason}")


def _check_checkpoint(checkpoint: Checkpoint) -> None:
    if checkpoint.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0, got {checkpoint.keep_latest_k}")
    if checkpoint.resume not in ("auto", "never") and not checkpoint.resume.isdigit():
        raise ConfigError(
            f"checkpoint.resume must be auto, never or a step number, got {checkpoint.resume!r}"
        )
    if checkpoint.initial_load is not None and not os.path.isfile(
        os.path.join(checkpoint.initial_load, "temper.json")
    ):
        raise ConfigError(
            f"checkpoint.initial_load {checkpoint.initial_load!r} is not a temper checkpoint "
            "folder (no temper.json)"
        )


def _check_expert_parallel(config: Config) -> None:
    """``ep > 1`` needs routed experts that split evenly; how ep fits the world (it divides
    ``dp_shard x sp``) is checked with the other degrees by `ParallelDims.from_config`."""
    ep = config.parallelism.ep
    if ep == 1:
        return
    if config.compile.enable:
        raise ConfigError(
            f"compile.enable with parallelism.ep = {ep}: the all-to-all dispatch reads its split "
            "sizes on the host, which a full-graph compiled block cannot; turn one off"
        )
    args, source = _model_args(config.model)
    n_experts = getattr(args, "n_experts", 0)
    if not n_experts:
        raise ConfigError(
            f"parallelism.ep = {ep} needs a mixture-of-experts model; {source} has no experts"
        )
    if n_experts % ep:
        raise ConfigError(
            f"parallelism.ep ({ep}) must divide the number of experts ({n_experts} in {source})"
        )


def _check_sequence_parallel(config: Config) -> None:
    """``sp > 1`` (Ulysses) splits attention heads over SP ranks and gives each at least one
    token; sequence lengths that SP does not divide are right-padded."""
    sp = config.parallelism.sp
    if sp == 1:
        return
    from temper.models.layers.hybrid import HybridArgs
    from temper.parallel.ulysses import check_heads, check_linear_attention_heads

    if config.training.seq_len < sp:
        raise ConfigError(
            f"training.seq_len ({config.training.seq_len}) must be at least parallelism.sp "
            f"({sp}): every SP rank holds a slice of each sequence"
        )
    args, source = _model_args(config.model)
    try:
        check_heads(args.n_heads, getattr(args, "n_kv_heads", args.n_heads), sp)
        if isinstance(args, HybridArgs):
            check_linear_attention_heads(args.linear_n_k_heads, args.linear_n_v_heads, sp)
    except ConfigError as error:
        raise ConfigError(f"{error} ({source})") from None


def _model_args(model: Model) -> tuple[Any, str]:
    """The architecture's args (from ``model.hf_path``'s config.json, else the flavor) and
    where they came from, for checks that depend on the model's sizes."""
    from temper.models import get_model_spec
    from temper.models.hf import read_hf_args

    if model.hf_path is not None:
        _, args = read_hf_args(model.hf_path)
    else:
        args = get_model_spec(model.name).flavors[model.flavor]
    return args, model.hf_path or f"{model.name}/{model.flavor}"


def _check_posttrain(config: Config) -> None:
    """The objective exists and gets the data format it reads; LoRA sizes are sane."""
    from temper.objectives.registry import objective_names

    name = config.objective.name
    if name not in objective_names():
        raise ConfigError(
            f"objective.name {name!r} is not registered; choose one of "
            f"{', '.join(objective_names())}"
        )
    for objective, data_format in (("dpo", "preference"), ("grpo", "prompt")):
        if (name == objective) != (config.data.format == data_format):
            raise ConfigError(
                f"objective.name {name!r} does not read data.format {config.data.format!r}: "
                f"{objective} takes {data_format} data, and {data_format} data needs {objective}"
            )
    if name == "dpo" and config.parallelism.sp != 1:
        raise ConfigError("parallelism.sp must be 1 with objective.name 'dpo' (not supported yet)")
    if name == "grpo":
        _check_grpo(config)
    _check_positive(config, "objective.beta", "lora.rank", "lora.alpha", "data.builtin_examples")
    _check_range(config, "objective.label_smoothing", 0.0, 0.5)
    _check_range(config, "lora.dropout", 0.0, 1.0, right_open=True)


def _check_grpo(config: Config) -> None:
    """Rollouts fit the rows, groups can differ, every reward exists; SP and EP are refused:
    decoding runs each rank on its own prompts, with no collective between tokens."""
    from temper.generation.sampling import check_sampling
    from temper.objectives.rewards import reward_names

    section = config.objective
    for degree in ("sp", "ep"):
        if getattr(config.parallelism, degree) != 1:
            raise ConfigError(
                f"parallelism.{degree} must be 1 with objective.name 'grpo': rollouts decode "
                "each rank's prompts alone, without the per-token collectives it needs"
            )
    if section.group_size < 2:
        raise ConfigError(
            f"objective.group_size must be >= 2 (advantages compare a prompt's completions), "
            f"got {section.group_size}"
        )
    _check_positive(config, "objective.max_new_tokens", "objective.updates_per_rollout")
    if section.max_new_tokens >= config.training.seq_len:
        raise ConfigError(
            f"objective.max_new_tokens ({section.max_new_tokens}) must be below "
            f"training.seq_len ({config.training.seq_len}): the prompt needs room"
        )
    try:  # the sampler's own rules; its messages start with the argument's name
        check_sampling(section.temperature, section.top_k, section.top_p)
    except ValueError as error:
        raise ConfigError(f"objective.{error}") from None
    _check_range(config, "objective.clip_eps", 0.0, 1.0, right_open=True)
    if section.kl_coef < 0:
        raise ConfigError(f"objective.kl_coef must be >= 0, got {section.kl_coef}")
    if not section.rewards:
        raise ConfigError("objective.rewards must name at least one reward")
    unknown = [r for r in section.rewards if r not in reward_names()]
    if unknown:
        raise ConfigError(
            f"objective.rewards: {', '.join(map(repr, unknown))} not registered; choose from "
            f"{', '.join(reward_names())} or register one with @register_reward"
        )
    if section.reward_weights and len(section.reward_weights) != len(section.rewards):
        raise ConfigError(
            f"objective.reward_weights has {len(section.reward_weights)} values for "
            f"{len(section.rewards)} objective.rewards"
        )
