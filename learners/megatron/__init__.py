"""The Megatron learner backend (``learner.backend=megatron``): megatron-core's ``GPTModel`` with
tensor and pipeline parallelism, behind the learner protocol.

- ``async_rl.learners.megatron.learner``: ``MegatronLearner``, the policy learner;
- ``async_rl.learners.megatron.model``: Hugging Face Qwen2 / Llama models as ``GPTModel``s and
  their weights both ways;
- ``async_rl.learners.megatron.critic``: the PPO critic on the same layout;
- ``async_rl.learners.megatron.ops``: the tensor-parallel step pieces both share;
- ``async_rl.learners.megatron.pipeline``: pipeline stages joined by sends inside autograd;
- ``async_rl.learners.megatron.checkpoint``: megatron-core distributed checkpoints;
- ``async_rl.learners.megatron.cpu``: the adjustments megatron-core needs on CPU (gloo).

megatron-core itself is imported inside the functions that use it (it is an optional dependency).
"""

from async_rl.learners.megatron.learner import MegatronLearner

__all__ = ["MegatronLearner"]
