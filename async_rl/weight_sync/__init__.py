"""The weight sync layer: the learner's named tensors, packed into flat buckets, into every engine.

Transports (``weight_sync.transport``):

* ``colocated``: the engine lives in the learner's process (HF engine in sync mode); the learner
  hands it its full tensors by name, nothing is copied in between. (On GPU the same role is played
  by CUDA IPC handles; see the repository's ``bench/gpu_weight_sync.py``.)
* ``shm``: same host. The learner owns ``num_slots`` reusable shared-memory slots of
  ``bucket_size_mb`` (files under ``/dev/shm``, mapped once by every receiver); it copies bucket
  i into slot ``i % num_slots`` and announces it; receivers load straight from the slot and
  acknowledge. Measured 3-4x faster than any socket on these machines (``bench/bench_weight_sync.py``
  puts it beside the gloo broadcast).
* ``broadcast``: a ``torch.distributed`` process group of its own (gloo on CPU, NCCL on GPU) with
  the learner's sender as rank 0 and the broadcast generators as ranks 1.. in order (generator k
  is rank k + 1 when all are broadcast); each bucket is one broadcast. It never touches the
  default group, which the learner's FSDP ranks and vLLM's workers own.
* **Both in one update** (multi-node): each generator gets its own transport
  (``transports_for_targets``: with ``auto`` in async mode, ``shm`` for the engines on the
  learner's host and ``broadcast`` for the others; a forced ``weight_sync.transport`` applies to
  all). The sender packs each bucket once into a shm slot and broadcasts that slot's bytes to
  the group, which holds only the broadcast generators. HF and vLLM engines mix; SGLang engines
  do not (their schedulers join the group themselves): with a remote one, all of them take broadcast.

Protocol (one ``WeightSender`` on the learner, one ``WeightReceiver`` in each engine process):

1. **Rendezvous** (once). The sender starts a ``TCPStore`` and, if any receiver is ``shm``, allocates
   its slots; ``init_info()`` is a plain dict (JSON-able: it travels through Ray or vLLM's
   ``init_weight_transfer_engine``) from which each receiver connects with its rank (and learns its
   own transport). For ``broadcast`` the process group forms when the sender and every broadcast
   receiver have connected (the caller runs both sides concurrently).
2. **Per-version update**. ``plan_update(named_shapes, version)`` lays the tensors out in buckets
   (names, dtypes, shapes, byte offsets; tied aliases carry no bytes; a decoder layer is never
   split across buckets, because a loader may keep a partial layer's tensors until it is whole). The
   plan goes to every generator through the control plane (a Ray call, or vLLM's ``update_weights``
   request) with the version. Each receiver first checks the whole plan against its engine
   (``check_update``, see *All or nothing* below) and posts ``ready`` or ``error`` to the store;
   the sender waits for all ``ready`` before moving a byte, so a bad update fails the sync before
   any engine is touched. A failure after that (the sender's, a receiver's, or one engine's load)
   is posted as ``error`` too, and every waiting party reads that key between short waits
   (receivers every ``wire.POLL_S``, 0.1 s, also between slices of a pending broadcast), so all of
   them stop within about a second, not at ``timeout_s``. A sender whose process died is seen as
   its store (which lives in the sender's process) no longer answering, and for ``broadcast`` as
   the group's connection closing. A failed update drops the broadcast group on both sides
   (``WeightSender.broken``, ``WeightReceiver.broken``: a receiver may have left the sequence of
   collectives mid-bucket); ``WeightPublisher`` rebuilds the transport, every engine connecting
   again, before its next push. Then bucket by bucket: the sender packs (casting to the wire dtype),
   publishes (slot + store key, or broadcast), and receivers unpack views and hand them to their
   engine's loader, then acknowledge (``shm``: a slot is reused only after every receiver
   acknowledged it).
3. **Finalize**. A receiver's engine finishes its load (HF: swaps the staged tensors in; vLLM:
   layerwise reload finalization), then its control call returns. The caller bumps the published
   policy version only when every generator's call has returned: a sync is atomic from the
   learner's view, and a failed one publishes nothing.
4. **In-flight requests**: decided by the engine, per ``generator.partial_rollout``: ``keep``
   pauses the engine with requests frozen (their KV cache kept) and resumes them on the new
   weights; ``abort`` aborts them and re-issues their partial responses as prompt extensions.
   Prefix-cache entries of older versions are never reused (vLLM: requests are salted with the
   version; ``abort`` also clears the cache).

A sync that does not complete in ``weight_sync.timeout_s`` raises ``TimeoutError`` naming the
receivers that did not acknowledge and the bucket each reached.

**All or nothing.** Every engine, on every transport (``colocated`` included), with full weights
and with LoRA adapters, validates the whole update before the first byte of it is written
(``check_update``): every name maps to a parameter (fused q/k/v and gate/up shards, tied heads
as aliases), every parameter is covered exactly once, each tensor has its target's full
(unsharded) shape, and each dtype converts to the target's under one rule (``converts_to``):
a floating-point tensor loads into a floating-point parameter of any precision, rounded to the
parameter's dtype (exact when widening, e.g. a ``bfloat16`` wire into a ``float32`` engine;
narrowing is the engine's own precision setting, e.g. ``generator.vllm.dtype=bfloat16``); any
other pair must match exactly, so an integer, bool or complex tensor for a floating parameter is
refused, and so is a dtype the wire does not carry. Two different tensors for one tied parameter
are refused too (send one, the other as its alias). A refused update raises one line naming
every offending weight (expected against got) and leaves every engine bit-identical.

A failure after the first byte (the sender dies or raises mid-stream, a bucket fails to load, a
receiver times out) never leaves an engine sampling from a half-written model:

* **HF engine: staging.** Buckets are received into a copy of the targeted parameters (the
  whole model, or only the adapters with LoRA) while generation goes on, and swapped in between
  two decoding steps once the last bucket arrived; a failure before the swap drops the copy and
  the engine keeps its old weights and version. Peak memory is the model plus one copy of its
  parameters on the engine's device, cheap for the models the HF engine serves (the large-model
  engine is vLLM); the colocated path converts first and writes last, with no copy unless a dtype
  or device changes. Should the swap itself fail (a device fault), the engine is marked
  unusable, as below.
* **vLLM engine: unusable until repaired.** Its layerwise reload writes processed layers into
  the live weights in place as they complete (on the CPU build into oneDNN-packed kernels) and
  a second copy of a large model does not fit beside its KV cache, so it cannot stage. After a
  failure the reload is unwound (unprocessed layers get their old tensors back, the reload state
  is cleared) and, if any bucket had reached the model, the engine is marked unusable: requests
  frozen by the update are aborted, ``generate`` raises, and the next complete update makes it
  usable again. If no byte had reached the model it keeps serving its old weights. LoRA updates
  on vLLM are staged (every bucket is received before the adapter is swapped in), so only a
  failure inside the swap marks the engine unusable.

An engine's ``policy_version`` moves only with a complete update, and ``WeightPublisher`` publishes
a version only when every engine loaded all of it.

Modules (every name is importable from ``async_rl.weight_sync``): ``config`` (settings,
``resolve_transport``, ``transports_for_targets``), ``plan`` (bucket layout, dtype rule), ``check`` (``check_update``: the
whole update against an engine), ``sources`` (what a push reads), ``wire``
(``WeightSender``/``WeightReceiver``), ``protocols`` (what each bucket protocol changes on the
wire; an engine class names its protocol in its capabilities), ``targets`` (the engine side of a
push: ``LocalTarget``, ``RayTarget``), ``publisher`` (the transport objects and
``WeightPublisher``: the one path every push takes; ``colocated`` is a transport object like
``shm`` and ``broadcast``, not a branch).
"""

from async_rl.weight_sync.check import UnknownWeightError, WeightUpdateError, check_update, map_to_engine
from async_rl.weight_sync.config import (TRANSPORTS, WIRE_DTYPES, WeightSyncConfig, engine_protocol,
                                         replace_transport, resolve_transport, transports_for_targets)
from async_rl.weight_sync.plan import (DTYPES, TensorMeta, UpdatePlan, converts_to, dtype_name, layer_key,
                                       pack_bucket, plan_update, unpack_bucket)
from async_rl.weight_sync.publisher import (BucketTransport, ColocatedTransport, LocalTarget, RayTarget, Transport,
                                            WeightPublisher, WeightTarget, make_transport)
from async_rl.weight_sync.sources import ModuleWeights, NamedTensors, WeightSource, tied_aliases
from async_rl.weight_sync.wire import WeightReceiver, WeightSender

__all__ = ["BucketTransport", "ColocatedTransport", "DTYPES", "LocalTarget", "ModuleWeights", "NamedTensors",
           "RayTarget", "TRANSPORTS", "TensorMeta", "Transport", "UnknownWeightError", "UpdatePlan", "WIRE_DTYPES",
           "WeightPublisher", "WeightReceiver", "WeightSender", "WeightSource", "WeightSyncConfig", "WeightTarget",
           "WeightUpdateError", "check_update", "converts_to", "dtype_name", "engine_protocol", "layer_key",
           "make_transport",
           "map_to_engine", "pack_bucket", "plan_update", "replace_transport", "resolve_transport", "tied_aliases",
           "transports_for_targets", "unpack_bucket"]
