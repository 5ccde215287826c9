"""The bucket protocols a ``WeightSender`` speaks, by what they change on the wire.

An engine class names its protocol (``EngineCapabilities.protocol``); the sender and the
transport choice read the protocol's properties here instead of branching on its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from async_rl.generators.capabilities import WIRE_PROTOCOLS


@dataclass(frozen=True)
class WireProtocol:
    """How one protocol's receivers join the broadcast group and read a bucket.

    Attributes:
        name: the protocol's name (a key of ``PROTOCOLS``).
        receivers: how messages name its receivers (``SGLang engines``).
        engine_group: the receivers join the broadcast group the engine's own way (SGLang's
            ``init_weights_update_group``: ``init_custom_process_group`` over the sender's store,
            group name = the sender's prefix, registered with torch's group registry, so the
            sender destroys it through ``dist.destroy_process_group``); false = our
            ``WeightReceiver``'s group.
        align: byte alignment of tensors inside a bucket (``plan_update(align=...)``); 1 packs
            them back to back (SGLang's ``flattened_bucket`` layout); ``None`` = the planner's
            default.
        mixed_transports: receivers of one update may mix ``shm`` and ``broadcast`` (false for
            SGLang, whose schedulers join the group themselves and all read it).
    """

    name: str
    receivers: str
    engine_group: bool
    align: int | None
    mixed_transports: bool


PROTOCOLS: dict[str, WireProtocol] = {
    "async_rl": WireProtocol("async_rl", "async_rl weight receivers", engine_group=False, align=None, mixed_transports=True),
    "sglang": WireProtocol("sglang", "SGLang engines", engine_group=True, align=1, mixed_transports=False),
}
"""Protocol name -> properties; the names are ``capabilities.WIRE_PROTOCOLS``."""
assert tuple(PROTOCOLS) == WIRE_PROTOCOLS, "capabilities.WIRE_PROTOCOLS and PROTOCOLS must list the same protocols"
