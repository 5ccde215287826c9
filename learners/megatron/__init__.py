"""The Megatron learner backend (``learner.backend=megatron``): megatron-core's ``GPTModel`` with
tensor and pipeline parallelism, behind the learner protocol.

- ``async_rl.learners.megatron.learner``: ``MegatronLearner``, the policy learner;
- ``async_rl.learners.megatron.model``: Hugging Face Qwen2 / Llama / Qwen3 / Qwen3-MoE models as
  ``GPTModel``s and their weights both ways (MoE experts and routers included);
- ``async_rl.learners.megatron.routing``: routing replay (R3) and routing records for MoE layers;
- ``async_rl.learners.megatron.critic``: the PPO critic on the same layout;
- ``async_rl.learners.megatron.ops``: the tensor-parallel step pieces both share;
- ``async_rl.learners.megatron.pipeline``: pipeline stages joined by sends inside autograd;
- ``async_rl.learners.megatron.checkpoint``: megatron-core distributed checkpoints;
- ``async_rl.learners.megatron.cpu``: the adjustments megatron-core needs on CPU (gloo).

megatron-core itself is imported inside the functions that use it (it is an optional dependency).
"""

# The names of ``async_rl.learners.megatron.learner``, imported on first use: importing ``cpu``, ``model`` or
# ``checkpoint`` alone loads nothing of the learner, as before they were a package.
__all__ = ["MegatronLearner"]


def __getattr__(name: str):
    if name in __all__:
        from async_rl.learners.megatron import learner

        return getattr(learner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
