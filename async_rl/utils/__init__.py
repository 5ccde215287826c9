"""Library modules every layer may use (layer ``library``, beside ``algorithms``, ``rewards`` and
``tools``): ``registry`` (the one spec resolver), ``lora`` (LoRA's naming contract),
``cpu_threads`` and ``cpu_affinity`` (thread budgets, OpenMP's wait policy, pinning roles to
cores), ``checkpoint_format`` (the checkpoint state format) and ``leftovers`` (the sweep of what
killed processes left). Nothing here imports torch at import time: ``cpu_threads`` must be
importable before it."""
