"""What a run stands on (layer ``components``, beside ``learners``, ``generators``, ``buffers``,
``weight_sync`` and ``data``): ``checkpoint`` (checkpoints and the run directory), ``metrics``,
``inputs`` (the check that a run's data files and model exist before anything loads),
``cluster`` (joining a Ray cluster, bind addresses, placement groups) and ``placement`` (what
each role asks the cluster for)."""
