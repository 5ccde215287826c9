"""What a training loop is: its config section (``trainer``), the parts a run shares, and the
``Loop`` protocol both modes implement.

Policy versions: the learner's version counts optimizer *training steps*, not optimizer updates:
each ``Loop.step`` trains once (however many mini-batches and epochs that takes) and ends with
policy version v -> v + 1, which is then published to every generator. A sample's staleness is
the learner's version minus the version of the weights that generated it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from async_rl.runtime.checkpoint import CheckpointConfig
from async_rl.data.images import PromptImages

if TYPE_CHECKING:
    # Annotations only: ``Config`` is a layer above (it imports this module's ``TrainerConfig``), and
    # the components stay unimported until the trainer builds them.
    from transformers import PreTrainedTokenizerBase

    from async_rl.step.episodes import EpisodeLoop
    from async_rl.step.evaluation import EvalAtK
    from async_rl.runtime.cluster import Cluster
    from async_rl.config import Config
    from async_rl.data.dataset import PromptDataset
    from async_rl.generators.base import Generator, SamplingParams
    from async_rl.learners.base import Learner
    from async_rl.runtime.metrics import MetricsLogger
    from async_rl.rewards.scorer import RewardScorer
    from async_rl.weight_sync.publisher import WeightPublisher

TRAINER_MODES = ("sync", "async")
POLICY_VERSION_UNITS = ("step", "mini_batch")
"""Values of ``trainer.policy_version_per``."""


DEFAULT_RESPONSE_FIELDS = ("extra_info.answer", "reward_model.ground_truth")
"""Where the warm start looks for a row's reference response when ``response_field`` is unset,
in order: a worked answer in ``extra_info.answer`` where the row has one (it may differ from the
ground truth, e.g. a solution ending in the number the reward checks), else the verl layout's
``reward_model.ground_truth`` (right for tasks whose answer is the ground truth itself)."""


@dataclass
class WarmStartConfig:
    """Supervised warm start on the rows' reference responses, before RL.

    It teaches a model that cannot yet answer (the built-in tiny one, a randomly initialised
    model) the answer format, so RL starts with some reward signal; a pretrained or instruction
    tuned model usually needs none (``steps=0``). The reference responses are read from the train
    rows when they are loaded: a row without one stops the run before anything trains.
    """

    steps: int = 0
    """Optimizer steps of supervised training (>= 0); 0 skips the warm start."""
    batch_size: int = 64
    """Prompts per warm-start step (>= 1)."""
    lr: float = 1e-3
    """Constant learning rate of the warm start (> 0)."""
    response_field: str | None = None
    """Dotted path of the row field holding the reference response: ``reward_model.ground_truth``,
    ``extra_info.answer``, a top-level key such as ``answer``; its text is trained followed by EOS
    (with ``agent.tools``: a list of messages, a demonstration). Unset (``null``): ``extra_info.answer``
    where the row has it, else ``reward_model.ground_truth`` (``DEFAULT_RESPONSE_FIELDS``, per row)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError("trainer.warm_start needs steps >= 0, batch_size >= 1 and lr > 0, got "
                             f"steps={self.steps}, batch_size={self.batch_size}, lr={self.lr}")
        if self.response_field is not None and (
                not self.response_field or any(not part.strip() for part in self.response_field.split("."))):
            raise ValueError("trainer.warm_start.response_field must be a dotted path of the row field holding the "
                             f"reference response (e.g. reward_model.ground_truth), got {self.response_field!r}")

    def reference_fields(self) -> tuple[str, ...]:
        """The dotted paths to read a row's reference response from, in order; ``()`` without a
        warm start (``steps=0``), so no row needs one."""
        if not self.steps:
            return ()
        return (self.response_field,) if self.response_field is not None else DEFAULT_RESPONSE_FIELDS


@dataclass
class TrainerConfig:
    """The training loop: mode, length, batch shape, evaluation, outputs."""

    mode: str = "sync"
    """``sync``: generate, train and update the colocated engine in turn (hybrid engine).
    ``async``: a pool of generator actors streams trajectories while the learner trains
    (``async_rl.loops.async_loop``); data is at most ``max_staleness`` policy versions old."""
    total_steps: int = 100
    """Training steps (>= 1); each consumes ``prompts_per_step`` prompts."""
    prompts_per_step: int = 16
    """Prompts (groups) per training step (>= 1)."""
    samples_per_prompt: int = 8
    """Responses sampled per prompt, the group size n (>= 1)."""
    max_staleness: int | None = None
    """Most policy versions (training steps; mini-batches with ``policy_version_per=mini_batch``)
    a sample may lag the learner at train time (>= 0); ``None`` = 0 in sync mode, 1 in async
    mode. Async with 0 (and versions per step) reproduces sync mode."""
    max_reuse: int = 1
    """Async: times one group may be trained on (>= 1); 1 = never reused."""
    serve_order: str = "dispatch"
    """Async: which complete groups a step trains on. ``dispatch``: the oldest dispatched, none
    passed over while an older one is still being sampled, so a step trains on the groups
    admitted for it, as sync mode would, and a group is never overtaken (and then evicted as too
    stale) because its answers are long. ``completion``: the first to complete, whatever their
    age; on a long-tailed task the long groups then finish last, are reached past
    ``max_staleness`` and dropped, biasing training towards short answers
    (``buffers.replay.ReplayBuffer``)."""
    policy_version_per: str | None = None
    """Async: what one policy version is. ``step``: the learner trains on the step's
    ``prompts_per_step`` groups (``learner.num_mini_batches`` optimizer steps), then publishes its
    weights. ``mini_batch``: each mini-batch is a version of its own: ``num_mini_batches`` times a
    step the learner takes ``prompts_per_step / num_mini_batches`` complete groups from the replay
    buffer, takes one optimizer step on them and publishes (the in-flight weight updates of
    PipelineRL, Piche et al. 2025, arXiv 2509.19128; verl's fully-async local step of one
    mini-batch), so a sample trails the weights it trains by ``max_staleness`` optimizer steps at
    most instead of that many batches of them. Admission, the buffer bound and staleness count
    these versions. Needs whole groups per mini-batch and ``learner.num_epochs=1``; sync mode
    takes ``step`` only (its generation is a barrier between steps). ``None`` resolves to
    ``mini_batch`` in async mode where it applies (whole groups per mini-batch, one epoch,
    ``max_staleness`` >= 1), else to ``step`` (``async_rl.config``)."""
    group_spread: int | None = None
    """Async with ``policy_version_per=mini_batch``: policy versions (optimizer steps) over which
    each group's samples are dealt (>= 1); ``None`` resolves to ``DEFAULT_GROUP_SPREAD`` where it
    applies (async, a version per mini-batch, no critic, KL term or teacher, ``max_reuse`` 1), else
    to 1 (``async_rl.config``). With 1 a version trains on the whole groups it takes
    (``prompts_per_step / num_mini_batches`` prompts per optimizer step); with m, each group taken
    at version v is dealt at random into m shares (``n / m`` of its samples each, within one),
    trained at versions v .. v+m-1, so an
    optimizer step sees m times as many prompts (as sync mode's mini-batches of single samples
    do) and a share may be up to ``max_staleness + m - 1`` versions old. Advantages are computed
    over the whole group when it is taken. The run's last version trains every share still
    pending; a checkpoint saves them (a run stopped early counts them,
    ``pipeline/spread_partly_trained_at_exit``). Not with a
    critic, a KL term or a teacher (their passes would have to run on whole groups)."""
    zmq_address: str | None = None
    """Async: ZeroMQ address the trajectory receiver binds; ``None`` = a free TCP port on
    ``bind_host``."""
    ray_address: str | None = None
    """Ray cluster to join (``auto``, or the head's ``host:port``), as ``RAY_ADDRESS`` does
    (which is read when this is unset); the trainer process becomes the driver and learner rank 0
    on the node it runs on. ``None`` and no ``RAY_ADDRESS``: async and multi-rank runs start a
    single-node Ray of their own, bound to loopback (``async_rl.runtime.cluster``)."""
    placement_timeout_s: float = 300.0
    """How long generator actors and learner ranks may wait for the cluster's resources (seconds,
    > 0); then the run stops, naming what it asked for and what each node has. Raise it for a
    cluster that autoscales."""
    bind_host: str | None = None
    """The address every socket of the run binds and announces (trajectory receiver, weight
    store, learner rendezvous, broadcast groups): an address of the trainer's node that the other
    nodes reach. ``None`` = the trainer node's IP as Ray knows it on a cluster of several nodes,
    else ``127.0.0.1`` (one node, nothing reachable from outside)."""
    zmq_hwm: int = 1024
    """Async: ZeroMQ high-water mark in messages (back-pressure on generators); >= 1."""
    seed: int = 0
    """Seed of the data order, sampler and learner."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    run_name: str | None = None
    """Run directory name under ``output_dir``; ``None`` = a timestamp (made unique with a
    ``-1``, ``-2``, ... suffix). A fresh run refuses a name whose directory already holds files,
    unless ``resume`` continues it or ``overwrite`` replaces it."""
    eval_every_steps: int = 10
    """Evaluate on the held-out split every K steps (>= 0); 0 = only before step 1 and at the end."""
    eval_greedy: bool = True
    """Evaluate with greedy decoding; ``False`` = one sample per prompt at the training temperature."""
    eval_samples: int = 0
    """Evaluation at k (>= 0): besides the pass above, sample this many responses per held-out
    prompt at ``eval_temperature`` and report pass@k (k = 1, 2, 4, ..., eval_samples; the unbiased
    estimator of Chen et al. 2021, eq. 1), mean@k and maj@k, each with a bootstrap standard error
    over prompts (``eval/pass@1_se`` ...), per data source too (``async_rl.step.eval_metrics``);
    0 = off."""
    eval_temperature: float | None = None
    """Temperature of evaluation at k (> 0); ``None`` = ``generator.temperature``."""
    eval_on_pool: bool = True
    """Async mode: the evaluations between steps are sampled by the generator pool in its idle
    time while the learner keeps training (``async_rl.loops.evaluation``; their metrics arrive
    with a later step, tagged ``eval/policy_version`` and ``eval/started_step``); ``False`` = on
    the trainer's colocated engine, the learner waiting. The evaluations before the first step and
    after the last are always on the colocated engine. Sync mode: unused."""
    export_model: bool = True
    """Write the final policy as a Hugging Face directory to ``<run_dir>/final_model``."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When to save checkpoints (``async_rl.runtime.checkpoint``)."""
    resume: str | None = None
    """``auto``: continue from ``<output_dir>/<run_name>``'s latest checkpoint if there is one;
    a checkpoint or run directory: continue from it; ``None``: start fresh."""
    overwrite: bool = False
    """Delete an existing ``<output_dir>/<run_name>`` (once the run's inputs have loaded) and start
    afresh in it; ``False`` = a fresh run refuses a run directory that already holds files."""

    def __post_init__(self) -> None:
        if self.mode not in TRAINER_MODES:
            raise ValueError(f"trainer.mode must be one of {TRAINER_MODES}, got {self.mode!r}")
        for key in ("total_steps", "prompts_per_step", "samples_per_prompt"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {getattr(self, key)}")
        # max_staleness=None is resolved by mode in config._cross_validate, not here: omegaconf
        # instantiates this class for its schema, and a value filled in then would outlive mode=async.
        if (self.max_staleness is not None and self.max_staleness < 0) or self.eval_every_steps < 0:
            raise ValueError("trainer.max_staleness and trainer.eval_every_steps must be >= 0")
        from async_rl.buffers.replay import SERVE_ORDERS

        if self.serve_order not in SERVE_ORDERS:
            raise ValueError(f"trainer.serve_order must be dispatch or completion, got {self.serve_order!r}")
        if self.eval_samples < 0:
            raise ValueError(f"trainer.eval_samples must be >= 0, got {self.eval_samples}")
        if self.eval_temperature is not None and not self.eval_temperature > 0:
            raise ValueError(f"trainer.eval_temperature must be > 0 (or null: generator.temperature), "
                             f"got {self.eval_temperature}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"trainer.placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        if self.group_spread is not None and self.group_spread < 1:
            raise ValueError(f"trainer.group_spread must be >= 1, got {self.group_spread}")
        if self.max_reuse < 1 or self.zmq_hwm < 1:
            raise ValueError(f"trainer.max_reuse and trainer.zmq_hwm must be >= 1, got {self.max_reuse} and {self.zmq_hwm}")
        if self.policy_version_per is not None and self.policy_version_per not in POLICY_VERSION_UNITS:
            raise ValueError(f"trainer.policy_version_per must be one of {POLICY_VERSION_UNITS}, "
                             f"got {self.policy_version_per!r}")
        if self.mode == "sync" and self.policy_version_per not in (None, "step"):
            raise ValueError(f"trainer.policy_version_per={self.policy_version_per}: sync mode publishes once per "
                             "step (its generation waits for the step's weights); use trainer.mode=async or step")
        if self.mode == "sync" and self.max_staleness not in (None, 0):
            raise ValueError(f"trainer.mode=sync trains on-policy: trainer.max_staleness must be 0, got {self.max_staleness}")
        if self.run_name is not None and (not self.run_name.strip() or self.run_name.startswith(("/", "~")) or
                                          any(part in ("", ".", "..") for part in self.run_name.rstrip("/").split("/"))):
            # trainer.overwrite deletes <output_dir>/<run_name>: it must lie strictly inside output_dir.
            raise ValueError(f"trainer.run_name={self.run_name!r} must name a directory inside trainer.output_dir "
                             "(no leading '/' or '~', no empty, '.' or '..' part)")
        if self.overwrite and self.resume is not None:
            raise ValueError(f"trainer.overwrite=true deletes the run directory that trainer.resume={self.resume} "
                             "continues: set only one of them")


def versions_per_step(trainer: TrainerConfig, learner: Any) -> int:
    """Policy versions one training step publishes (``trainer.policy_version_per``): 1, or the
    learner's ``num_mini_batches`` with ``mini_batch``. ``learner`` is the ``learner`` section."""
    return learner.num_mini_batches if trainer.policy_version_per == "mini_batch" else 1


@dataclass
class RunContext:
    """Everything one run's loops share (built by ``async_rl.trainer``).

    The types are named for annotations only (``if TYPE_CHECKING``): ``Config`` lives a layer
    above, and a field that holds one of several implementations is typed with their protocol
    (``Learner``, ``Generator``).

    Attributes:
        cfg: the resolved ``Config``.
        tokenizer: the policy's tokenizer (a ``PreTrainedTokenizerBase``, pad token set).
        model_path: Hugging Face directory of the starting weights.
        train_ds, val_ds: the train ``PromptDataset`` and the held-out one (or ``None``).
        scorer: the training ``RewardScorer``; eval_scorer: its own counters for evaluation.
        params, eval_params: ``SamplingParams`` of rollouts and of evaluation.
        eval_at_k: evaluation at k (``EvalAtK``: ``trainer.eval_samples`` > 0), else ``None``.
        learner: the ``Learner`` (``FSDPLearner`` or ``MegatronLearner``; on N ranks, rank 0's).
        generator: the colocated engine (a ``Generator``: ``HFGenerator``, ``VLLMGenerator`` or
            ``SGLangGenerator``): sync-mode rollouts, and evaluation in both modes (async mode with
            ``backend: vllm`` evaluates on a colocated HF engine, leaving the pool's engines to
            rollouts).
        publisher: the ``WeightPublisher`` into ``generator`` (every push to it goes through it).
        run_dir: the run directory.
        log: the ``MetricsLogger``.
        agent: the ``EpisodeLoop`` of an environment (``env.name``, or the tools of
            ``agent.tools``), else ``None``.
        cluster: the run's Ray ``async_rl.runtime.cluster.Cluster`` (async mode, Ray-placed learner
            ranks), else ``None``.
        service_cores: async mode with ``learner.cpu_affinity``: the CPU ids of the trainer's
            threads that do not train (``cluster.split_learner_threads``); threads the loop
            starts (receiver, dispatcher, ZeroMQ's, Ray's) are started on them. Else empty.
        prompt_images: the images of the datasets' prompts by uid (``data.images.PromptImages``;
            empty for a text policy), for the learner's batches.
    """

    cfg: Config
    tokenizer: PreTrainedTokenizerBase
    model_path: str
    train_ds: PromptDataset
    val_ds: PromptDataset | None
    scorer: RewardScorer
    eval_scorer: RewardScorer
    params: SamplingParams
    eval_params: SamplingParams
    learner: Learner
    generator: Generator
    publisher: WeightPublisher
    run_dir: Path
    log: MetricsLogger
    agent: EpisodeLoop | None = None
    eval_at_k: EvalAtK | None = None
    cluster: Cluster | None = None
    service_cores: list[int] = field(default_factory=list)
    prompt_images: PromptImages = field(default_factory=PromptImages)


class Loop(Protocol):
    """One mode's training loop, as ``async_rl.trainer.train`` drives it.

    Implementations take ``(ctx: RunContext, resume_state: dict | None)``: ``resume_state`` is a
    checkpoint's ``state_dict()`` output, restored before the first step.
    """

    def step(self, step: int) -> dict[str, float]:
        """One training step (policy version v -> v + 1, published); returns its metrics.

        Raises:
            RuntimeError: nothing to train on (every sample rejected), a sample staler than
                ``trainer.max_staleness``, or (async) a dead generator actor or stalled pipeline.
            ValueError: dynamic sampling could not fill the step, or the reward function failed
                on every call of the loop's first step.
        """

    def start_evaluation(self, step: int) -> bool:
        """Start an evaluation after ``step`` that runs while training goes on (its metrics come
        with a later step's); ``False``: this loop has none (the caller evaluates now)."""

    def sync_eval_engine(self) -> None:
        """Make the colocated engine hold the learner's current weights before an evaluation."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this loop (taken between two steps)."""

    def close(self) -> dict[str, Any]:
        """Stop what the loop started; returns summary entries (idempotent)."""

    def evaluation_after_last_step(self) -> dict[str, float] | None:
        """After ``close``: the metrics of an evaluation started between steps that ended only
        as the loop closed (tagged ``eval/started_step``), for the trainer to log; ``None``
        when there was none (one still unfinished then is abandoned and counted)."""


class GeneratorsGone(RuntimeError):
    """Every generator actor of the async pool (``async_rl.loops.pool``) died or was retired
    (``generator.max_restarts``); the message is one line naming each actor's end and its root
    cause. Defined here, not beside the pool, so that catching it (the CLI does) imports no Ray."""
