"""The learner protocol and its configuration.

A learner owns the trainable policy. Per training step it recomputes proximal log-probs with the
weights of the current policy version (before any update), takes one or more optimizer steps on
the step's batch, and exposes the new weights by Hugging Face name for the weight-sync layer.
The policy version counts training steps (one per batch, whatever its number of optimizer
steps); staleness is measured in these versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from async_rl.buffers.trajectory import TrainBatch
from async_rl.runtime.cluster import check_cpu_affinity, check_placement
from async_rl.learners.capabilities import (LEARNERS, learner_capabilities, learners_that, model_parallel_size,
                                            model_parallel_sizes)
from async_rl.utils.lora import LoRAConfig

LR_SCHEDULES = ("constant", "linear", "cosine")
MINI_BATCH_SPLITS = ("samples", "groups")
MIXED_PRECISION = ("auto", "fp32", "bf16")
BACKENDS = tuple(LEARNERS)
"""The ``learner.backend`` names, in registration order (``capabilities.LEARNERS``)."""


@dataclass
class MegatronConfig:
    """Model parallelism of the Megatron learner (``learner.backend=megatron``): megatron-core's
    ``GPTModel`` split ``tensor_parallel_size`` ways inside each layer (Megatron-LM, Shoeybi et
    al. 2019, arXiv 1909.08053) and ``pipeline_parallel_size`` ways across layers (Narayanan et
    al. 2021, arXiv 2104.04473); the rest of ``learner.world_size`` is data parallel."""

    tensor_parallel_size: int = 1
    """Ranks one layer's weights are split over (>= 1); must divide the attention heads, the KV
    heads and the MLP width (checked when the model is built)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (>= 1): consecutive groups of decoder layers on successive ranks; must
    divide the number of layers."""
    sequence_parallel: bool = True
    """With ``tensor_parallel_size > 1`` on CUDA, also split the layer norms' and dropouts'
    activations along the sequence (Korthikanti et al. 2022, arXiv 2205.05198). Ignored on CPU,
    where megatron-core's sequence-parallel kernels do not run."""

    expert_parallel_size: int = 1
    """Ranks a mixture-of-experts layer's experts are split over (>= 1), carved out of the
    data-parallel ranks (``learner.world_size`` must be a multiple of expert x tensor x pipeline
    parallel sizes) and dividing the number of experts; 1 for a dense model."""
    moe_token_dispatcher: str = "alltoall"
    """megatron-core's token dispatcher of a mixture-of-experts layer: ``alltoall`` (tokens go to
    their experts' ranks) or ``allgather`` (every rank gathers every token); both run on gloo."""

    def __post_init__(self) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"learner.megatron.{key} must be >= 1, got {getattr(self, key)}")
        if self.moe_token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"learner.megatron.moe_token_dispatcher must be alltoall or allgather, got "
                             f"{self.moe_token_dispatcher!r}")


@dataclass
class CriticConfig:
    """The value model of PPO: the policy's architecture with a scalar head, trained on GAE returns.

    Built only when the advantage estimator needs values (``algorithm.name=ppo`` or
    ``algorithm.advantage_estimator=gae``). It shares the policy's mini-batch split and
    micro-batch size, and takes one optimizer step per policy optimizer step.
    """

    model_path: str | None = None
    """Initial backbone weights (a Hugging Face causal-LM directory or ``builtin:`` URI);
    ``None`` = the policy's starting weights (after the warm start, if any)."""
    lr: float = 1e-5
    """Peak AdamW learning rate of the critic (> 0); same warm-up and schedule as the policy."""
    clip_range_value: float | None = 0.5
    """Value clipping epsilon in reward units (> 0); ``None`` = plain squared error."""
    loss_coef: float = 1.0
    """Scale of the value loss (> 0); the critic has its own optimizer, so this acts like its LR."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or not self.loss_coef > 0:
            raise ValueError(f"learner.critic.lr and loss_coef must be > 0, got {self.lr} and {self.loss_coef}")
        if self.clip_range_value is not None and not self.clip_range_value > 0:
            raise ValueError(f"learner.critic.clip_range_value must be > 0 or null, got {self.clip_range_value}")


@dataclass
class LearnerConfig:
    """Trainer-side settings: backend, sharding, optimizer, schedule and batching of the learner,
    over a gloo (CPU) or NCCL (GPU) process group."""

    backend: str = "fsdp2"
    """``fsdp2``: the Hugging Face model sharded with torch FSDP2 (``fully_shard``), every rank
    data parallel. ``megatron``: megatron-core's ``GPTModel`` with tensor and pipeline
    parallelism (``learner.megatron``; Qwen2 and Llama architectures), the same losses, weight
    sync, checkpoints and metrics."""
    world_size: int = 1
    """Learner ranks (>= 1) on one process group (gloo on CPU). Rank 0 is the trainer process;
    ranks 1.. are Ray actors it places (``async_rl.learners.launch``), or the other ranks of a
    ``torchrun --nproc-per-node N -m async_rl.cli train ...`` launch. At most the sequences of
    the smallest mini-batch, ``floor(prompts_per_step * samples_per_prompt / num_mini_batches)``,
    and at most ``trainer.warm_start.batch_size`` with a warm start, so no rank is left without a
    sequence (checked at load)."""
    device: str = "auto"
    """``cpu``, ``cuda`` (one GPU per rank, NCCL for the collectives), or ``auto`` = ``cuda`` when
    torch sees a GPU."""
    mixed_precision: str = "auto"
    """FSDP2 ``MixedPrecisionPolicy``: ``bf16`` (bf16 parameters and activations in forward and
    backward, float32 master weights, gradient reduction and optimizer), ``fp32`` (none), or
    ``auto`` = ``bf16`` on CUDA, ``fp32`` on CPU (where bf16 matmuls are emulated on most cores
    and only change the numerics)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them (less
    memory, about one more forward pass of compute)."""
    cpu_offload: bool = False
    """FSDP2 ``CPUOffloadPolicy``: keep sharded parameters, gradients and optimizer state in host
    memory between uses (CUDA learners only; a CPU learner holds them there already)."""
    lr: float = 1e-6
    """Peak AdamW learning rate (> 0)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, two values in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon (> 0)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (>= 0)."""
    warmup_steps: int = 0
    """Optimizer steps of linear LR warm-up from 0 (>= 0). The schedule advances once per
    optimizer step taken; a skipped mini-batch (see ``num_mini_batches``) does not advance it."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant``, ``linear`` (decay to ``min_lr_ratio``) or ``cosine``."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of ``lr`` for ``linear``/``cosine`` (in [0, 1])."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this (> 0); 0 disables clipping."""
    micro_batch_size: int = 64
    """Sequences per forward/backward pass (>= 1); gradients accumulate across micro-batches."""
    max_tokens_per_micro_batch: int = 0
    """> 0: micro-batches are cut by tokens instead, each at most this many (padded) tokens, and
    padding beyond a micro-batch's longest sequence is removed (``async_rl.learners.batching``). Must be
    at least the longest possible sequence, ``data.max_prompt_tokens +
    generator.max_response_tokens`` (with tools ``+ agent.max_response_tokens`` instead; checked
    at load); a sequence of exactly this many tokens gets a micro-batch of its own."""
    packing: bool = False
    """Run each micro-batch as one row of its sequences' real tokens, without padding (position
    ids restart per sequence; verl's ``use_remove_padding``). With ``attn_implementation:
    flash_attention_2`` the attention is flash-attention's varlen kernel; with ``sdpa``/``eager``
    a block-diagonal causal mask over the row. ``max_tokens_per_micro_batch`` then counts the
    packed tokens (the sum of lengths) instead of the padded size. The critic packs too."""
    shared_prefix: bool = False
    """Run each group's common prompt once per micro-batch (the shared-prefix forward of Prefix
    Grouper, Liu et al. 2025, arXiv:2506.05433): the policy's passes (proximal, reference,
    training) pack a micro-batch into one row in which the rows of a group (GRPO's samples of one
    prompt) that begin with the same tokens share one copy of them, and a custom attention mask
    lets each row's own tokens see that copy and themselves only. Exact (log-probs as unshared
    up to rounding; the copy's gradient is the sum of the rows'), and it saves ``samples_per_prompt
    - 1`` copies of every prompt's compute where a micro-batch holds whole groups
    (``mini_batch_split: groups``, or async mode's version per mini-batch), fewer where groups
    are dealt apart. Costs a dense ``[N, N]`` mask per micro-batch (``N`` its tokens after
    sharing): worth it when prompts are a large share of the tokens, and a micro-batch is run
    shared only when that fills at most 0.75 of its padded slots. A preference, honoured where it
    can be: the FSDP2 learner with the Hugging Face model's ``sdpa`` or ``eager`` attention and a
    dense text policy (probed at start, as packing is); elsewhere (the Megatron learner,
    flash-attention, a vision-language or mixture-of-experts policy) it is off, with one warning
    line saying why. The critic does not share. ``max_tokens_per_micro_batch`` still counts the
    unshared packed tokens."""
    freeze_vision: bool = False
    """Vision-language policies (a config with ``vision_config``, e.g. Qwen2-VL): ``true`` freezes
    the vision tower (its ViT blocks and patch merger): its parameters get no gradient and no
    optimizer state, and only the language model and its head train. Its weights are still sent
    in every weight update, unchanged (one update format whatever is frozen). ``false`` (the
    default): the vision tower trains with the rest. No effect on text-only models; with
    ``lora.rank > 0`` the whole base model, vision tower included, is frozen anyway."""
    attn_implementation: str = "auto"
    """The Hugging Face attention backend of the policy and reference models: ``sdpa``,
    ``eager``, ``flash_attention_2`` (CUDA, needs ``flash-attn``), or ``auto`` = the model's
    default (``sdpa`` for the built-in models)."""
    num_mini_batches: int = 1
    """Optimizer steps per training step: the step's batch is split into this many (>= 1, and at
    most the ``prompts_per_step * samples_per_prompt`` sequences of a step; checked at load). A
    mini-batch left without a valid token at run time (a batch shrunk below this by reward
    rejections, or every token masked by the overlong filter) is skipped, with no optimizer or
    LR-scheduler step, and counted in ``actor/skipped_mini_batches``."""
    num_epochs: int = 1
    """Passes over the step's batch (>= 1)."""
    mini_batch_split: str = "samples"
    """How a step's batch is dealt into its ``num_mini_batches`` mini-batches, in a seeded random
    order per policy version and epoch: ``samples`` (the default) deals single samples, so a
    group's samples spread over the mini-batches and each optimizer step sees more prompts (as
    TRL's ``GRPOTrainer``); ``groups`` deals whole groups (``group_ids``), so every mini-batch
    holds complete groups and fewer prompts (as verl's in-order split of its grouped rows, and
    as async mode's policy version per mini-batch must)."""
    seed: int | None = None
    """Seed of the learner's randomness: model initialisation, and the order in which a step's
    samples are dealt into mini-batches (``num_mini_batches > 1``). ``None`` (the default): the
    run's ``trainer.seed``, so runs of different seeds differ there too."""
    num_threads: int = 0
    """Torch CPU threads of the learner process (>= 0); 0 = ``OMP_NUM_THREADS`` where the user
    set it, else torch's default in sync mode and the cores (CPU affinity) the generator actors
    leave in async mode."""
    cpu_affinity: list[int] = field(default_factory=list)
    """CPU ids every learner rank may run on (``os.sched_setaffinity`` on all its threads,
    Linux; ids >= 0, each once); empty = no pinning (default). The trainer process (rank 0) is
    pinned once the run's Ray is up, ranks 1..N-1 as they start; ``num_threads: 0`` then means
    as many torch threads as cores listed. In async mode only rank 0's training thread (and the
    torch and gloo threads it starts) runs here: its receiver, dispatcher, ZeroMQ and Ray threads
    and the Ray processes the run starts take the other cores (``cluster.split_learner_threads``).
    With ``generator.cpu_affinity`` it sets each role's cores apart (see there for sync mode)."""
    num_cpus_per_rank: float = 1.0
    """CPUs Ray reserves for each learner rank it places (ranks 1..N-1; >= 0, placement only:
    threads are ``num_threads``)."""
    num_gpus_per_rank: float | None = None
    """GPUs per Ray-placed learner rank (>= 0); ``None`` = 1 on CUDA, 0 on CPU."""
    node_labels: dict[str, str] = field(default_factory=dict)
    """Ray node labels the nodes of learner ranks 1..N-1 must carry (``ray start --labels
    role=train``); empty = any node. Rank 0 is the trainer process, on the node it was started on."""
    placement_strategy: str = "PACK"
    """Ray placement group strategy of learner ranks 1..N-1 (``PACK``: as few nodes as the
    resources allow, ``STRICT_PACK``: one node, ``SPREAD``, ``STRICT_SPREAD``)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model, used only by estimators that need values (``gae``)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (``rank > 0``): only they train and only they sync to the generators
    (``fsdp2`` only)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Tensor and pipeline parallel sizes of ``backend=megatron``."""

    @property
    def data_parallel_size(self) -> int:
        """Ranks that take separate shares of a batch: ``world_size`` for ``fsdp2``, ``world_size
        / (tensor_parallel_size * pipeline_parallel_size)`` for ``megatron`` (the backend's
        ``LearnerCapabilities.model_parallel``)."""
        return self.world_size // model_parallel_size(self)

    @property
    def rng_seed(self) -> int:
        """``seed`` as resolved by the run's config (``trainer.seed`` when unset), or 0 for a
        ``LearnerConfig`` built directly with none."""
        return 0 if self.seed is None else self.seed

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"learner.world_size must be >= 1, got {self.world_size}")
        if self.backend not in LEARNERS:  # the registry, not the tuple: a backend registered later counts
            raise ValueError(f"learner.backend must be one of {tuple(LEARNERS)}, got {self.backend!r}")
        self._check_backend()
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"learner.device must be auto, cpu or cuda, got {self.device!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"learner.mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        if not self.lr > 0:
            raise ValueError(f"learner.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"learner.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"learner.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"learner.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"learner.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"learner.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"learner.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"learner.grad_clip must be >= 0, got {self.grad_clip}")
        check_placement("learner", "rank", self.num_cpus_per_rank, self.num_gpus_per_rank, self.placement_strategy)
        if self.num_threads < 0:
            raise ValueError(f"learner.num_threads must be >= 0, got {self.num_threads}")
        check_cpu_affinity("learner.cpu_affinity", self.cpu_affinity)
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"learner.max_tokens_per_micro_batch must be >= 0, got {self.max_tokens_per_micro_batch}")
        if self.mini_batch_split not in MINI_BATCH_SPLITS:
            raise ValueError(f"learner.mini_batch_split must be one of {MINI_BATCH_SPLITS}, got {self.mini_batch_split!r}")
        for key in ("micro_batch_size", "num_mini_batches", "num_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"learner.{key} must be >= 1, got {getattr(self, key)}")

    def _check_backend(self) -> None:
        """What the backend cannot do (its ``LearnerCapabilities``), refused at load with one line
        each, naming the backend that would work."""
        caps = learner_capabilities(self.backend)
        sizes = model_parallel_sizes(self)
        if self.world_size % math.prod(sizes.values()):
            keys = " * ".join(f"learner.{caps.parallel_settings}.{k}" for k in sizes)
            raise ValueError(f"learner.world_size={self.world_size} is not a multiple of {keys} = "
                             f"{' * '.join(map(str, sizes.values()))}")
        if self.lora.rank > 0 and not caps.lora:
            raise ValueError(f"learner.lora.rank > 0 needs learner.backend={learners_that(lambda c: c.lora)}: the "
                             f"{caps.name} learner trains full weights only")
        if self.cpu_offload and not caps.cpu_offload:
            owners = [learner_capabilities(n).name for n in LEARNERS if learner_capabilities(n).cpu_offload]
            fit = " / ".join(f"learner.{caps.parallel_settings}.{k}" for k in caps.model_parallel) or "a smaller model"
            raise ValueError(f"learner.cpu_offload=true is an {' or '.join(owners) or 'unsupported'} option; with "
                             f"learner.backend={self.backend} use {fit} to fit the model")
        if self.attn_implementation not in ("auto", "sdpa") and not caps.hf_attention:
            raise ValueError(f"learner.attn_implementation={self.attn_implementation} is a Hugging Face backend; "
                             f"the {caps.name} learner runs its own attention (leave it at auto)")


def learner_device(cfg: LearnerConfig) -> torch.device:
    """The learner's device type: ``learner.device``, with ``auto`` = CUDA when available."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("learner.device=cuda but torch sees no CUDA device")
    return torch.device(cfg.device)


def process_group_backend(device: torch.device) -> str:
    """gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for the CPU ones (normalisers,
    micro-batch counts, the rank-0 command channel)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_single_process_group(backend: str = "gloo") -> None:
    """Create a world-size-1 default group in-process (no rendezvous) if none exists."""
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def clip_and_step(params, optimizer, scheduler, grad_clip: float) -> torch.Tensor:
    """Clip the global gradient norm (``grad_clip > 0``), step optimizer and scheduler, zero grads.

    Args:
        params: the parameters being optimized (plain or DTensor).
        optimizer, scheduler: torch optimizer and LR scheduler (``scheduler`` may be ``None``).
        grad_clip: max global L2 norm; 0 = no clipping.

    Returns:
        The pre-clip global gradient norm, a 0-dim float tensor (gathered if sharded).
    """
    params = [p for p in params if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):  # sharded parameters give a sharded norm
        norm = norm.full_tensor()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


def copy_matching_parameters(src: Iterable[tuple[str, torch.Tensor]], dst: nn.Module, prefix: str = "") -> int:
    """Copy parameters into ``dst`` by name, in place; returns how many were copied.

    Args:
        src: ``(name, tensor)`` pairs; a name is matched to ``dst``'s parameter ``name`` after
            stripping ``prefix`` (for example a causal LM's ``"model."`` onto its bare backbone).
            Both sides may be DTensors with the same sharding (FSDP2 on the same mesh).
        dst: the module to overwrite.

    Raises:
        ValueError: a parameter of ``dst`` got no value, or shapes differ (names both).
    """
    from torch.distributed.fsdp import FSDPModule

    # Write the sharded parameters, the ones FSDP2 all-gathers from: the root may still hold
    # unsharded ones after a forward without backward (a reference model), and a write into
    # those would not be guaranteed to survive the next all-gather.
    for module in dst.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    # Activation checkpointing inserts a wrapper level into names, on either side or on both (a
    # LoRA policy's merged weights come without it): match without it.
    unwrap = lambda n: n.replace("_checkpoint_wrapped_module.", "")  # noqa: E731
    targets = {unwrap(n): p for n, p in dst.named_parameters()}
    done: set[str] = set()
    with torch.no_grad():
        for name, tensor in src:
            key = unwrap(name[len(prefix):] if prefix and name.startswith(prefix) else name)
            if key not in targets:
                continue
            if targets[key].shape != tensor.shape:
                raise ValueError(f"parameter {key}: shape {tuple(tensor.shape)} does not fit {tuple(targets[key].shape)}")
            _copy_into(targets[key], tensor.detach())
            done.add(key)
    missing = sorted(set(targets) - done)
    if missing:
        raise ValueError(f"no source weights for {len(missing)} parameters, e.g. {missing[:3]}")
    return len(done)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` across DTensor/plain tensor: FSDP2 keeps the root's parameters
    unsharded (plain) between forward and backward, so either side may be either kind."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(src, DTensor):
        src = src.full_tensor()
    if isinstance(dst, DTensor):
        src = distribute_tensor(src, dst.device_mesh, dst.placements)
    dst.copy_(src)


def save_hf_model(model: nn.Module, out_dir: str, tokenizer=None, state_dict: dict | None = None) -> None:
    """Write ``model`` (a ``transformers`` ``PreTrainedModel``) as a Hugging Face directory
    ``out_dir``: safetensors of ``state_dict`` (default: the model's own), its config, and
    ``tokenizer`` beside them if given.

    The written config says ``use_cache: true`` whatever the training copy's says: the learner
    turns the KV cache off (a training forward never reuses keys and values), but the exported
    model is for inference, where ``generate`` without a cache recomputes the whole prefix for
    every new token. ``model.config`` itself is left as it was.
    """
    previous = model.config.use_cache
    model.config.use_cache = True
    try:
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    finally:
        model.config.use_cache = previous
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


class Learner(Protocol):
    """What the rest of the system calls on a learner (``FSDPLearner``; on N ranks, rank 0's,
    which forwards each call to the others): the training loops (``prepare`` through
    ``async_rl.step.batch.make_batch``, ``train_step``, ``version``), the warm start (``sft_step``,
    then ``begin_rl``), the weight publisher (``named_weights``, ``weight_metadata``,
    ``weight_aliases``: an ``async_rl.weight_sync.WeightSource``), checkpoints
    (``save_checkpoint``, ``load_checkpoint``) and the final export (``export_hf``). Every call
    but ``version``, ``weight_metadata`` and ``weight_aliases`` is collective: on N ranks each rank
    makes it.
    """

    version: int
    """Policy version: training steps taken (one per ``train_step``, whatever its number of
    optimizer steps); 0 before the first, and what a checkpoint restores."""

    def begin_rl(self) -> None:
        """Freeze the RL starting point, once, after any warm start and before step 1: reset the
        optimizer, snapshot the reference policy (KL term) and start the critic from the policy."""
        ...

    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, torch.Tensor]:
        """One supervised step (warm start) at learning rate ``lr`` on the loss-masked tokens of
        ``batch``; returns ``{"sft/loss", "sft/grad_norm"}`` (0-dim tensors). ``version`` stays."""
        ...

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs ``[B, L-1]`` float32 of ``batch``'s labels under the current weights (no grad)."""
        ...

    def prepare(self, batch: TrainBatch) -> dict[str, float]:
        """No-grad passes the advantages and the loss need, stored in ``batch.extras``
        (``proximal_logprobs``, ``ref_logprobs``, ``values``: ``[B, L-1]`` float32); returns
        their timings in seconds.

        Raises:
            RuntimeError: a KL term is on and ``begin_rl`` was never called.
        """
        ...

    def train_step(self, batch: TrainBatch, num_mini_batches: int | None = None) -> dict[str, float]:
        """One training step (``num_mini_batches`` optimizer steps, ``None``: the configured
        number) on ``batch`` after ``prepare``; ``version += 1``; returns metrics reduced over
        ranks and micro-batches."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) parameters by Hugging Face name, each tied parameter once, in
        ``weight_metadata`` order (with LoRA the adapter matrices only). Gathers one tensor at a
        time: every rank must iterate it to the end."""
        ...

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of what ``named_weights`` yields, in order, without
        gathering (local, not collective)."""
        ...

    def weight_aliases(self) -> dict[str, str]:
        """``{tied name: name sent}`` for parameters ``named_weights`` yields once under another
        name (``{"lm_head.weight": "model.embed_tokens.weight"}``; ``{}`` with LoRA)."""
        ...

    def save_checkpoint(self, path: str) -> None:
        """Write the whole training state (policy, optimizer, critic, reference, schedules,
        ``version``) under directory ``path`` (``torch.distributed.checkpoint`` shards)."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote, instead of ``begin_rl`` (any number of ranks).

        Raises:
            FileNotFoundError, ValueError: no checkpoint there, or one of another model or setup.
        """
        ...

    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write the policy as a Hugging Face safetensors directory ``out_dir`` (with LoRA: merged
        weights plus the adapter under ``out_dir/adapter``), and ``tokenizer`` beside it if given."""
        ...
