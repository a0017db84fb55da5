"""The typed config tree that a recipe returns and the CLI overrides.

Every field has a type and a default; the docstring under a field is its `--help`
text. `Config.validate()` checks the rules that span fields, before any model or
process group exists, and names the offending field in its error.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

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
    flavor are then ignored), its safetensors the weights, its tokenizer.json the tokenizer.
    A repository id (Qwen/Qwen3-8B) names its snapshot in the local Hugging Face cache."""
    allow_download: bool = False
    """hf_path as a repository id that is not in the local cache: download it (network) instead
    of refusing."""
    attn: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """Attention backend (block-causal over packed documents): sdpa with an explicit mask
    (reference, CPU training), flex (FlexAttention; CUDA, forward only on CPU), varlen (flash,
    CUDA sm80+, bf16). auto = sdpa, or on CUDA for packed documents varlen else flex, and for
    attention sinks (gpt-oss) flex."""
    mtp_depth: int | None = None
    """Multi-token-prediction depths (deepseek_v3, deepseek_v4), trained jointly with a
    weighted draft loss; None = the flavor's or hf_path config's (0 / num_nextn_predict_layers,
    as far as the folder holds them)."""
    mtp_loss_weight: float | None = None
    """Weight of the MTP loss, shared by the depths; None = the model's (0.3)."""
    indexer_training: Literal["off", "sparse", "dense_warmup"] | None = None
    """How DeepSeek sparse attention's indexer trains (deepseek_v32, glm_moe_dsa): off (it
    does not; fine-tuning a released model), sparse (attention over each query's top-k, the
    indexer learning the main attention over them by a KL term), dense_warmup (dense
    attention, only the indexers train); None = the model's (off)."""
    indexer_loss_weight: float | None = None
    """Weight of the indexer's KL term per token; None = the model's (1.0)."""
    freeze: list[Literal["vision", "merger", "language"]] = field(default_factory=list)
    """Parts that keep their weights (vision-language models): vision (the tower's patch and
    position embeddings and blocks), merger (its patch merger), language (the language
    model). Recorded in temper.json; a resume must freeze the same."""

    def arg_overrides(self) -> dict[str, int | float | str]:
        """The fields above that replace the model's own arguments, where set."""
        fields = {
            "mtp_depth": self.mtp_depth,
            "mtp_loss_weight": self.mtp_loss_weight,
            "indexer_training": self.indexer_training,
            "indexer_loss_weight": self.indexer_loss_weight,
        }
        return {name: value for name, value in fields.items() if value is not None}


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
    skip_nonfinite: int = 0
    """Skip up to N steps whose loss or gradient norm is not finite (no update; their data
    is not trained on again), each logged; the next one stops the run. 0 stops at the first."""


@dataclass
class Optimizer:
    name: Literal["adamw", "muon", "adamw8bit", "adamw4bit", "adamw_fp8"] = "adamw"
    """adamw: AdamW on every parameter. adamw8bit / adamw4bit / adamw_fp8: the same AdamW with
    its moments stored in 8 bits, 4 bits or fp8 (torchao.optim; docs/precision.md). muon: Muon
    on the blocks' weight matrices (each stacked expert's on its own), AdamW (lr, betas,
    weight_decay) on embeddings, LM head, norms, biases and routers. See docs/optimizers.md."""
    lr: float = 3e-4
    """Peak learning rate (with muon: of the AdamW parameters)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms or biases)."""
    muon_lr: float | None = None
    """muon: peak lr of the Muon matrices; None = lr (right with muon_update_scale
    match_rms_adamw, which makes AdamW's lr carry over)."""
    muon_weight_decay: float | None = None
    """muon: decoupled weight decay of the Muon matrices; None = weight_decay."""
    muon_momentum: float = 0.95
    """muon: momentum (an EMA of the gradient, as torch.optim.Muon keeps it)."""
    muon_nesterov: bool = True
    """muon: orthogonalize the Nesterov look-ahead of the momentum instead of the momentum."""
    muon_ns_steps: int = 5
    """muon: quintic Newton-Schulz iterations."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """muon: dtype of the Newton-Schulz iteration: auto = bfloat16 (as torch.optim.Muon) on CUDA
    and on CPUs with AVX512-BF16 or AMX, float32 on other CPUs, which emulate bfloat16 products
    (many times slower); float32 also repeats across layouts to fp32 precision."""
    muon_update_scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """muon: lr multiplier per matrix: match_rms_adamw (Moonlight) gives the update AdamW's
    RMS, muon_update_rms (lr and weight decay tuned for AdamW carry over); original (Keller
    Jordan) is sqrt(max(1, rows / cols)), for an lr tuned for Muon (~0.02)."""
    muon_update_rms: float = 0.2
    """muon, match_rms_adamw: the update RMS to match."""
    muon_distribute: Literal["size", "round_robin"] = "size"
    """muon under FSDP/HSDP: how matrices are assigned to the rank that orthogonalizes them:
    by Newton-Schulz cost (balanced) or round-robin."""
    muon_qk_clip: float = 0.0
    """muon: QK-clip threshold (MuonClip; Kimi K2 used 100): after each step, a head whose
    largest attention logit exceeded it has its query weights scaled by threshold / max.
    0 = off. Grouped-query attention without q/k norms; not with sp > 1 or compile."""
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
class DataSource:
    """One source of ``data.sources``: a path of any kind ``data.path`` takes, its weight and
    its own field names."""

    path: str = ""
    """A file (.txt, .jsonl, .jsonl.gz, .parquet, .tokens), an Arrow folder or a folder of
    files."""
    weight: float = 1.0
    """Share of the documents drawn from this source: weight / sum of weights."""
    fields: dict[str, str] = field(default_factory=dict)
    """The format's field -> this source's column, where they differ (e.g. messages ->
    conversations); text defaults to data.text_field."""
    name: str = ""
    """Label of its logged counts (data_<name>_documents, data_<name>_tokens); "" = the
    file or folder name."""


@dataclass
class Data:
    path: str | None = None
    """A file (.txt, .jsonl, .jsonl.gz, .parquet, .tokens pretokenized), an Arrow dataset
    folder (save_to_disk) or a folder of files; None = the built-in tasks (see data.sources
    to mix several)."""
    sources: list[DataSource] = field(default_factory=list)
    """Several sources mixed by weight (recipes set this list; flags override its items as
    --data.sources.0.weight); when set, data.path must be None."""
    isolate_documents: bool = False
    """text: packed documents do not attend to or predict each other (per-document
    position_ids with block-causal attention); else the stream runs across documents."""
    text_field: str = "text"
    """JSONL field holding a document's text."""
    tokenizer_path: str | None = None
    """tokenizer.json or a folder holding one; None = model.hf_path's, else the built-in."""
    format: str = "text"
    """text: pretraining documents; sft: JSONL with "messages" (chat, image parts included);
    preference: JSONL with "prompt", "chosen", "rejected" (DPO); prompt: JSONL with "prompt"
    and "answer" (GRPO); or a format a user module registers (temper.data.formats). path
    None = the built-in tasks of that format."""
    chat_template: str | None = None
    """sft/preference: a Jinja chat template file; None = the tokenizer folder's, else the
    built-in template of the built-in tokenizer."""
    template_timeout_s: float = 5.0
    """Seconds one render of the chat template may run (it comes with a model folder and is
    code: one that loops is stopped, in the main thread)."""
    max_template_chars: int = 32 * 2**20
    """Characters one render of the chat template may write, and any one repetition or
    concatenation inside it may make (checked before the string is built)."""
    max_record_bytes: int = 16 * 2**20
    """The longest JSONL record (one line) read, in bytes; a longer one is refused, naming its
    file and line, before it is parsed."""
    train_on_prompt: bool = False
    """sft: also train on system/user tokens, not only the assistant's."""
    pack: bool = True
    """sft: pack whole samples into rows (isolated by position_ids); else one padded sample a
    row."""
    pack_buffer: int = 64
    """sft with pack: samples each lane reads ahead and packs best-fit decreasing (whole
    samples, the longest that fits first); 1 packs in reading order. Saved with the data
    state (its tokens), so a resumed run continues exactly."""
    max_length_policy: Literal["truncate", "drop"] = "truncate"
    """sft/preference: a sample longer than training.seq_len + 1 tokens is cut or skipped;
    counts are logged as data_truncated / data_dropped."""
    builtin_examples: int = 4096
    """sft/preference/prompt without a path: training examples drawn from the built-in
    tasks."""
    builtin_images: bool = False
    """sft without a path: the built-in image task (a coloured shape, "shape?" or "colour?")
    instead of copy/sort; for vision-language models (qwen3_5_vl)."""


@dataclass
class Validation:
    """A held-out loss during training: the objective's mean loss over a fixed set of
    batches, laid out as training is, logged as val_loss."""

    interval: int = 0
    """Validate every N optimizer steps (and after the last); 0 = never."""
    path: str | None = None
    """Validation records (any kind data.path takes, in data.format); None = held out from
    the training sources by validation.fraction, or the built-in tasks' eval split."""
    fraction: float = 0.0
    """With no validation.path: the last fraction of each training source's records is held
    out of training and validated on."""
    steps: int = 2
    """Global batches (training.global_batch_size rows each) per validation."""
    generate: int = 0
    """sft/prompt data: also answer this many held-out prompts greedily and log the exact
    match of the answers to the records' as val_exact_match (prompt data: only this)."""
    max_new_tokens: int = 32
    """Longest greedy answer of the generation check, in tokens."""


@dataclass
class ObjectiveConfig:
    """The ``objective`` section. Each objective subclasses it beside its loss with its own
    typed fields, ``data_formats``, ``validate`` and ``build``, and registers the subclass
    with ``temper.objectives.register_objective``; ``--objective.name`` picks one and the CLI
    then parses (and ``--help`` shows) that subclass's fields."""

    name: str = "causal_lm"
    """Training objective, as registered with `temper.objectives.register_objective`:
    causal_lm (pretraining, SFT), dpo or grpo."""

    data_formats: ClassVar[tuple[str, ...]] = ()
    """The ``data.format`` values this objective reads."""

    def validate(self, config: Config) -> None:
        """Rules of this objective that span sections; raise ConfigError naming the field."""

    def completion_tokens(self) -> int:
        """Tokens of each row this objective fills itself (sampled completions of prompt
        data), which the prompt must leave free."""
        return 0

    def build(self, config: Config, build_reference: Callable[[], Any]) -> Any:
        """The objective (``temper.objectives.Objective``) this section configures;
        ``build_reference`` makes a frozen copy of the policy for objectives that need one."""
        raise NotImplementedError(f"objective {self.name!r} does not define build()")


_OBJECTIVES: dict[str, type[ObjectiveConfig]] = {}
_RULES: list[Callable[[Config, int], None]] = []


def register_objective_config(section: type[ObjectiveConfig]) -> type[ObjectiveConfig]:
    """Make ``section`` (a dataclass subclass of ObjectiveConfig whose ``name`` default is its
    registered name) a choice of ``--objective.name``."""
    name = section.name
    if not (isinstance(section, type) and issubclass(section, ObjectiveConfig)):
        raise TypeError(f"objective {name!r}: {section!r} is not a subclass of ObjectiveConfig")
    if name in _OBJECTIVES:
        raise ValueError(f"objective {name!r} is already registered")
    _OBJECTIVES[name] = section
    return section


def objective_config_type(name: str) -> type[ObjectiveConfig]:
    if name not in _OBJECTIVES:
        raise ConfigError(
            f"objective.name {name!r} is not registered; choose one of "
            f"{', '.join(objective_config_names())}"
        )
    return _OBJECTIVES[name]


def objective_config_names() -> list[str]:
    return sorted(_OBJECTIVES)


def default_objective() -> ObjectiveConfig:
    """causal_lm's section once ``temper.objectives`` registered it, else the bare base."""
    section = _OBJECTIVES.get(ObjectiveConfig.name)
    return section() if section is not None else ObjectiveConfig()


def register_rule(rule: Callable[[Config, int], None]) -> Callable[[Config, int], None]:
    """Add a cross-field rule that ``Config.validate`` runs: ``rule(config, world_size)``
    raises ConfigError. The component that owns a rule registers it where it is defined
    (parallel degrees in ``temper.parallel.dims``, model fit in ``temper.models``, ...), so
    this package needs nothing above it; ``import temper.engine`` loads every built-in rule."""
    _RULES.append(rule)
    return rule


def registered_rules() -> list[Callable[[Config, int], None]]:
    """The rules ``register_rule`` added, in order (a dry run reports each one's error)."""
    return list(_RULES)


DEFAULT_LORA_TARGETS = ("layers.*.attention.w*", "layers.*.feed_forward.w*")
"""Every attention and dense-MLP projection. A family may lack one kind (every MLP an MoE,
whose experts are stacked weights, not linear layers): these two may then match nothing,
where a pattern a user gives must match."""


@dataclass
class Rollout:
    """``--rollout.*``: what samples an RL objective's rollouts, and when (see
    docs/post-training.md)."""

    engine: Literal["native", "vllm"] = "native"
    """native: the training model decodes its own rollouts (exact, small scale); vllm: a vLLM
    server (started by the run from scripts/setup_vllm.sh's virtualenv, or at rollout.url)
    samples them and takes the weights after every update."""
    url: str | None = None
    """A vLLM server someone else runs (http://host:port); None starts one on 127.0.0.1."""
    vllm_python: str | None = None
    """The interpreter of vLLM's virtualenv; None = ~/.cache/temper/venv-vllm/bin/python."""
    vllm_args: str = ""
    """More arguments for the managed server (--gpu-memory-utilization 0.5, say)."""
    startup_timeout_s: float = 600.0
    """The longest wait for the managed server to answer its health check."""
    kv_cache_gib: float = 1.0
    """KV-cache memory of the managed server."""
    weights_dir: str = "/dev/shm"
    """Where the weights sent to the server are written (a folder per run under it)."""
    bucket_mib: int = 512
    """The weights are written in files of about this size, one in memory at a time."""
    mode: Literal["sync", "async"] = "sync"
    """sync: each step's rollout is sampled with the current weights; async: the next step's
    rollout is sampled while this step trains (rollout.staleness)."""
    staleness: int = 1
    """async: updates between the sampling weights and the trained ones (0 or 1; 0 is sync)."""


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
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Linear layers to adapt: fnmatch patterns on Temper's module names, Hugging Face module
    names as PEFT reads them (q_proj, v_proj, gate_proj, ...), or all-linear."""
    quantize_base: Literal["none", "nf4"] = "none"
    """nf4: QLoRA, the frozen base weights of the adapted layers stored in 4-bit NormalFloat
    (torchao), dequantized blockwise in each forward; the adapters stay full precision."""
    initial_adapter: str | None = None
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) whose adapters
    start the run instead of the fresh init; its r, lora_alpha, use_rslora and target layers
    must be this section's."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Log every N steps (console, TensorBoard, metrics.jsonl)."""
    tensorboard: bool = True
    """Write TensorBoard events to <dump_folder>/tb."""
    wandb: bool = False
    """Also log every metrics row to Weights & Biases (the wandb package, its login and
    WANDB_* settings), a run named after job.dump_folder."""
    mlflow: bool = False
    """Also log every metrics row to MLflow (the mlflow package; MLFLOW_TRACKING_URI, else
    ./mlruns), a run named after job.dump_folder with the config as its params."""
    project: str = "temper"
    """The W&B project and the MLflow experiment the run is logged under."""


@dataclass
class Profiling:
    """What a run shows of its own steps (``--profiling.*``); see docs/observability.md."""

    phase_times: bool = True
    """Log each phase's wall-clock time per step (time_<phase>_ms: data, rollout, forward,
    backward, optimizer, checkpoint) and its peak memory (mem_<phase>_gib) every log step."""
    trace_steps: list[int] = field(default_factory=list)
    """Steps to trace with torch.profiler: one Chrome trace per rank under
    <dump_folder>/profile/step-<N>/ (the layout of TensorBoard's profiler plugin)."""
    record_shapes: bool = False
    """Traces record each op's input shapes."""
    profile_memory: bool = False
    """Traces record tensor allocations and frees."""
    with_stack: bool = False
    """Traces record Python stacks (large files)."""
    memory_snapshot_steps: list[int] = field(default_factory=list)
    """CUDA: record the allocator's history over these steps and write
    <dump_folder>/memory_snapshot/step-<N>/rank<R>.pickle (for pytorch.org/memory_viz)."""
    moe_heatmap_freq: int = 0
    """MoE models: every N steps (a multiple of metrics.log_freq) a layer x expert load map
    to TensorBoard (moe/load) and <dump_folder>/moe/step-<N>.png; 0 = off."""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """HSDP replica groups (data parallel, weights replicated)."""
    dp_shard: int = -1
    """FSDP shard degree; -1 = the rest of the world size."""
    sp: int = 1
    """Ulysses sequence-parallel degree."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks in a load-balanced
    layout, attention as ring attention (docs/parallelism.md)."""
    ep: int = 1
    """Expert-parallel degree."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free a block's gathered weights after its forward (and gather again for backward)?
    default: every block but the last; always; never (more memory, less communication)."""
    fsdp_cpu_offload: bool = False
    """FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state live in
    host memory (the optimizer steps on the CPU); each unit's weights are copied to the device
    for its forward and backward. For models whose state does not fit the GPUs; slower."""


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
    save_on_stop: bool = True
    """On Ctrl-C or SIGTERM, save the step reached before exiting (unless it was just saved),
    so a stop loses nothing; a second Ctrl-C during that save exits at once without it."""
    async_mode: bool = False
    """DCP asynchronous save: training waits only for the in-memory staging copy."""
    resume: str = "auto"
    """auto (the latest complete checkpoint, if any), never, or a step number."""
    initial_load: str | None = None
    """A checkpoint folder whose model weights start a new run (when there is nothing to
    resume)."""
    hf_export: Literal["none", "final", "every"] = "none"
    """Also write a Hugging Face folder (as ``dcp-to-hf`` does) to job.dump_folder/hf/step-<N>
    for the final checkpoint or for every one (rank 0, on the CPU)."""
    initial_recipe: str | None = None
    """``module:function`` of a recipe, then any of its overrides (``--training.steps 90``),
    to train first when initial_load is None; its final checkpoint (under
    job.dump_folder/initial, reused once there) becomes initial_load."""


@dataclass
class Float8:
    """FP8 training of the decoder blocks' linear layers (torchao.float8; docs/precision.md)."""

    enable: bool = False
    """Matmuls of every block's linear layer in float8 (e4m3 forward, e5m2 gradients); never
    the LM head, embeddings, routers, gates or norms. Needs CUDA sm89+ (H100, L40, RTX 4090)
    unless emulate."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """Scaling: one scale per tensor (fastest), one per row of each operand (more accurate
    where a few rows hold outliers), or rowwise with the weight gradient's matmul kept in
    high precision (torchao's recipes of these names)."""
    emulate: bool = False
    """Compute the float8 casts and scaled matmuls in plain PyTorch (any device, slow): for
    tests and debugging."""
    fsdp_all_gather: bool = False
    """tensorwise under FSDP2: all-gather the weights as float8 (half the bytes of bf16)."""
    moe_experts: bool = False
    """The routed experts' grouped GEMMs in FP8 too (torchao's rowwise FP8 grouped GEMM),
    with or without enable. CUDA sm90+ (H100, H200) only: torchao has no emulation of it."""


@dataclass
class Quantize:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class QAT:
    """Quantization-aware fine-tuning (torchao QAT; docs/precision.md)."""

    enable: bool = False
    """Train the blocks' linear layers through fake quantization (weights rounded to
    weight_bits integers per group, activations to int8 per token, gradients straight
    through), so the model survives the real quantization its export gets."""
    weight_bits: Literal[4, 8] = 4
    """Integer bits of each weight (symmetric)."""
    group_size: int = 32
    """Weights per scale, along each row; a layer whose input width it does not divide keeps
    full precision."""
    activations: bool = True
    """Also fake-quantize each linear layer's input to int8 (dynamic, one scale per token):
    the int8-activation int4-weight scheme; False = weight-only."""


Impl = Literal["auto", "reference", "compile", "triton"]
Op = Literal[
    "cross_entropy",
    "rmsnorm",
    "swiglu",
    "rope",
    "moe_permute",
    "gated_delta",
    "sparse_attention",
    "compressed_attention",
]


@dataclass
class Kernels:
    """Fused-kernel choices of a run (``--kernels.*``)."""

    fused_cross_entropy: bool = True
    """LM head and loss in chunks of tokens, the gradient computed chunk by chunk with the
    loss, so the full [tokens, vocab] logits and their gradient never exist; False computes
    full logits."""
    fused_ring_attention: bool = True
    """Context parallelism's ring attention runs each K/V block through torch's fused
    attention kernel that returns the log-sum-exp (flash on CPU; flash for fp16/bf16 on
    CUDA) where causal order alone decides the block; False runs the plain-PyTorch tiles
    (the reference) for every block."""
    cross_entropy_chunk: int = 0
    """Tokens per chunk of the fused cross-entropy (memory grows with chunk x vocab); 0 picks
    by device: 512 on CPU, where larger chunks measured no faster and a chunk's logits add to
    the peak, 2048 on CUDA, where fewer chunks mean fewer fp32 weight-gradient updates."""
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
    sparse_attention: Impl = "auto"
    """DeepSeek sparse attention's core (each query over its selected keys): the reference
    masks dense scores (sdpa); triton reads only the selected keys."""
    compressed_attention: Impl = "reference"
    """DeepSeek V4's attention over its window keys and compressed entries, on the
    ``sparse_attention`` op's forms (triton: with its sinks and shared head). The reference
    unless asked: the Triton form is checked under Triton's interpreter only, not yet on a
    GPU, where one key head taking every head's gradient atomically may cost more than it
    saves."""

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
        return 512 if device.type == "cpu" else 2048


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    objective: ObjectiveConfig = field(default_factory=default_objective)
    lora: LoRA = field(default_factory=LoRA)
    rollout: Rollout = field(default_factory=Rollout)
    metrics: Metrics = field(default_factory=Metrics)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    kernels: Kernels = field(default_factory=Kernels)
    profiling: Profiling = field(default_factory=Profiling)
    quantize: Quantize = field(default_factory=Quantize)
    qat: QAT = field(default_factory=QAT)

    def validate(self, world_size: int | None = None) -> None:
        """Raise ConfigError naming the first field that breaks a rule: every number finite,
        this section's own rules, then the objective's, then those the owning components
        registered."""
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        check_finite(self)
        check_positive(self, "training.steps", "training.seq_len", "training.local_batch_size")
        check_positive(self, "optimizer.lr", "optimizer.eps", "metrics.log_freq")
        check_positive(self, "checkpoint.interval")
        check_range(self, "optimizer.beta1", 0.0, 1.0, right_open=True)
        check_range(self, "optimizer.beta2", 0.0, 1.0, right_open=True)
        check_range(self, "lr_scheduler.min_lr_ratio", 0.0, 1.0)
        check_range(self, "lr_scheduler.decay_ratio", 0.0, 1.0)
        for name in (
            "optimizer.weight_decay",
            "training.max_norm",
            "training.skip_nonfinite",
            "lr_scheduler.warmup_steps",
        ):
            if get_field(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {get_field(self, name)}")
        _check_checkpoint(self.checkpoint)
        _check_profiling(self)
        check_positive(self, "lora.rank", "lora.alpha", "data.builtin_examples")
        check_range(self, "lora.dropout", 0.0, 1.0, right_open=True)
        _check_objective(self)
        _check_rollout(self)
        self.objective.validate(self)
        for rule in _RULES:
            rule(self, world_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def get_field(config: Config, dotted: str) -> Any:
    """The value of ``section.field`` (``"training.seq_len"``)."""
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def check_finite(value: Any, name: str = "") -> None:
    """Every float in ``value`` (the config, a section, a list, a number) is finite. NaN fails
    no comparison that a range rule makes (``nan <= 0`` is False) and inf passes most, so each
    field is checked here, by name, before the rules: ``--optimizer.eps inf`` would otherwise
    train with no update. No field takes an infinity to mean "off"; 0 or None does."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: {value} is not a finite number")
    if dataclasses.is_dataclass(value):
        items: Any = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return
    for key, item in items:
        check_finite(item, f"{name}.{key}" if name else str(key))


def check_positive(config: Config, *names: str) -> None:
    """Each named ``section.field`` is > 0."""
    for name in names:
        if get_field(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {get_field(config, name)}")


def check_range(
    config: Config, name: str, low: float, high: float, right_open: bool = False
) -> None:
    value = get_field(config, name)
    if not low <= value <= high or (right_open and value == high):
        bracket = ")" if right_open else "]"
        raise ConfigError(f"{name} must be in [{low}, {high}{bracket}, got {value}")


def _check_checkpoint(checkpoint: Checkpoint) -> None:
    if checkpoint.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0, got {checkpoint.keep_latest_k}")
    if checkpoint.resume not in ("auto", "never") and not checkpoint.resume.isdigit():
        raise ConfigError(
            f"checkpoint.resume must be auto, never or a step number, got {checkpoint.resume!r}"
        )
    if checkpoint.hf_export != "none" and not checkpoint.enable:
        raise ConfigError(
            f"checkpoint.hf_export {checkpoint.hf_export} exports checkpoints: add "
            "--checkpoint.enable"
        )
    idle = [
        f"checkpoint.{name} {getattr(checkpoint, name)}"
        for name in ("interval", "keep_latest_k", "async_mode", "resume")
        if getattr(checkpoint, name) != getattr(Checkpoint, name) and not checkpoint.enable
    ]
    if idle:
        raise ConfigError(
            f"{', '.join(idle)} does nothing without --checkpoint.enable (no checkpoint is "
            "saved or resumed): add it, or drop the flag"
        )
    if checkpoint.initial_load is not None and not os.path.isfile(
        os.path.join(checkpoint.initial_load, "temper.json")
    ):
        raise ConfigError(
            f"checkpoint.initial_load {checkpoint.initial_load!r} is not a temper checkpoint "
            "folder (no temper.json)"
        )


def _check_profiling(config: Config) -> None:
    profiling = config.profiling
    for name in ("trace_steps", "memory_snapshot_steps"):
        if any(step < 1 for step in getattr(profiling, name)):
            raise ConfigError(
                f"profiling.{name} holds step numbers >= 1, got {getattr(profiling, name)}"
            )
    freq, log_freq = profiling.moe_heatmap_freq, config.metrics.log_freq
    if freq < 0 or freq % log_freq:
        raise ConfigError(
            f"profiling.moe_heatmap_freq ({freq}) must be 0 or a multiple of metrics.log_freq "
            f"({log_freq}): a map shows the steps logged since the last one"
        )


def _check_rollout(config: Config) -> None:
    """Rollout settings only where there are rollouts, and async only where it can overlap."""
    rollout = config.rollout
    if rollout != Rollout() and config.objective.completion_tokens() == 0:
        raise ConfigError(
            f"rollout.* configures RL rollouts; objective.name {config.objective.name!r} samples "
            "none (use grpo)"
        )
    if rollout.staleness not in (0, 1):
        raise ConfigError(f"rollout.staleness must be 0 or 1, got {rollout.staleness}")
    if rollout.mode == "async" and rollout.engine == "native":
        raise ConfigError(
            "rollout.mode async overlaps sampling with training, which needs a sampler apart "
            "from the trained model: add --rollout.engine vllm"
        )
    if rollout.engine == "native" and (rollout.url or rollout.vllm_python):
        raise ConfigError("rollout.url and rollout.vllm_python need --rollout.engine vllm")
    check_positive(config, "rollout.startup_timeout_s", "rollout.kv_cache_gib")
    check_positive(config, "rollout.bucket_mib")


def _check_objective(config: Config) -> None:
    """The objective is registered, its section is its own type, and it reads the data."""
    section = config.objective
    expected = objective_config_type(section.name)
    if type(section) is not expected and not issubclass(type(section), expected):
        raise ConfigError(
            f"objective.name {section.name!r} takes a {expected.__name__} section, got "
            f"{type(section).__name__}: set objective = {expected.__name__}(...) in the recipe "
            "or pass --objective.name before its fields"
        )
    if config.data.format not in section.data_formats:
        raise ConfigError(
            f"objective.name {section.name!r} does not read data.format {config.data.format!r}: "
            f"{section.name} takes {' or '.join(section.data_formats)} data"
        )
