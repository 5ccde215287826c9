"""The parts of one training step (layer ``step``, below the loops): ``rollout`` (prompts ->
sampled, scored trajectories, in both modes), ``agent`` (multi-turn tool-use conversations on an
engine), ``batch`` (trajectories -> a ``TrainBatch`` with advantages) and ``evaluation`` (held-out
evaluation and the supervised warm start)."""
