"""Test helpers for the weight sync layer (importable from tests: pytest puts this folder on sys.path)."""

from __future__ import annotations

from typing import Iterator

import torch

from async_rl.weight_sync import ModuleWeights


class WithExtraWeight(ModuleWeights):
    """``ModuleWeights`` plus one more named tensor: an update an engine must refuse (tests)."""

    def __init__(self, model: torch.nn.Module, name: str, tensor: torch.Tensor, offset: float = 0.0) -> None:
        super().__init__(model)
        self.extra, self.offset = (name, tensor), offset

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's tensors (plus ``offset``, so a partial load would show) and the extra one."""
        yield from ((n, t + self.offset) for n, t in super().named_weights())
        yield self.extra

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The module's metadata and the extra tensor's."""
        return super().weight_metadata() + [(self.extra[0], self.extra[1].dtype, tuple(self.extra[1].shape))]


# ------------------------------------------------------------------ processes of test_weight_sync_failfast
# A weight update with the sender and each receiving engine in processes of their own, so that the
# sender can fail the way a learner does: raise mid-update (its process lives on) or be SIGKILLed.

TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def engine_process(model_path: str, pad_token_id: int, conn) -> None:
    """A receiving HF engine in its own process, driven over ``conn`` (a ``multiprocessing`` pipe).

    Commands ``(op, *args)``, each answered by one message:
    ``("connect", init_info, rank)`` -> ``("ok",)`` or ``("raised", type, message, time.time())``;
    ``("receive", plan_dict, version)`` -> the same (``time.time()`` when the call ended);
    ``("state", names)`` -> ``(policy_version, {name: tensor}, "" or generate's error)``;
    ``("exit",)`` ends the process.
    """
    import time

    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.generators.hf import HFGenerator

    engine = HFGenerator(model_path, GeneratorConfig(), pad_token_id)
    conn.send(("ok",))
    while True:
        op, *args = conn.recv()
        if op == "exit":
            return
        if op == "state":
            params = dict(engine.model.named_parameters())
            try:
                engine.generate([[5, 6, 7, 8]], 1, SamplingParams(greedy=True, max_tokens=2, stop_token_ids=(1,)))
                refused = ""
            except RuntimeError as e:
                refused = str(e)
            conn.send((engine.policy_version, {n: params[n].detach().clone() for n in args[0]}, refused))
            continue
        try:
            if op == "connect":
                engine.connect_weight_sync(*args)
            else:
                engine.receive_weights(*args)
            conn.send(("ok",))
        except Exception as e:  # noqa: BLE001 - reported to the test
            conn.send(("raised", type(e).__name__, str(e), time.time()))


def sender_process(model_path: str, transports: list[str], timeout_s: float, bucket_mb: float, version: int,
                   fail: str, stamp_path: str, queue, done, connected) -> None:
    """A learner's ``WeightSender`` in its own process, sending the model's weights + ``version``
    as ``version``.

    Puts ``init_info`` then the plan's dict on ``queue`` (the test hands both to the engines), then
    streams the update. The slot files are unlinked once the test sets ``connected`` (every
    engine mapped them), as ``WeightPublisher`` does: earlier, an engine's mapping would create a
    file of the same name (its own memory) that no one removes. ``fail``: ``"none"`` (a complete update), ``"raise"`` (the learner's
    weight iterator raises ``RuntimeError`` once the first bucket went out; the process stays up
    until ``done`` is set, as a trainer's would) or ``"kill"`` (the process SIGKILLs itself at
    that point). The moment of the failure (``time.time()``) is written to ``stamp_path`` first.
    Puts ``("sent",)`` or ``("raised", message)`` on ``queue`` when ``send`` ends.
    """
    import os
    import signal
    import time

    from transformers import AutoModelForCausalLM

    from async_rl.weight_sync import WeightSender, WeightSyncConfig

    model = AutoModelForCausalLM.from_pretrained(model_path)
    named = [(n, p.detach() + version) for n, p in model.named_parameters() if n not in TIED]
    cfg = WeightSyncConfig(bucket_size_mb=bucket_mb, timeout_s=timeout_s)
    sender = WeightSender(cfg, len(transports), receiver_transports=transports)
    queue.put(sender.init_info())
    sender.connect()
    if not connected.wait(timeout_s):
        raise TimeoutError("the engines did not connect")
    sender.unlink_slots()
    plan = sender.plan(named, version, aliases=dict(TIED))
    queue.put(plan.to_dict())
    first = {m.name for m in plan.buckets[0]}
    by_name = dict(named)

    def weights():
        for name in (m.name for b in plan.buckets for m in b if m.alias_of is None):
            if fail != "none" and name not in first:
                # Bucket 0 is complete (the sender packs a bucket only once all its tensors came):
                # the sender fails before the second bucket, with the first one in the engines.
                with open(stamp_path, "w") as f:
                    f.write(repr(time.time()))
                if fail == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("learner failed mid-update (test)")
            yield name, by_name[name]

    try:
        sender.send(plan, weights())
        queue.put(("sent",))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put(("raised", f"{type(e).__name__}: {e}"))
    done.wait(600)
