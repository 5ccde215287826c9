"""Qwen2-VL on vLLM without torchvision: image prompts through vLLM's own multimodal path.

vLLM 0.32 serves Qwen2-VL (``vllm/model_executor/models/qwen2_vl.py``) with two dependencies on
torchvision, through transformers 5.19:

* the model module imports ``smart_resize`` from
  ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, which imports torchvision at its
  top, so vLLM cannot even import the model class (and its model-info probe fails);
* ``Qwen2VLProcessingInfo.get_hf_processor`` builds ``Qwen2VLProcessor.from_pretrained``, which
  loads a video processor through ``AutoVideoProcessor``: a torchvision-only dummy.

``serve_qwen2_vl_without_torchvision`` (a no-op where torchvision imports) fixes both in the
process that calls it:

* a stand-in for that transformers module holding only ``smart_resize``, taken from the Pillow
  image processor's module (``image_processing_pil_qwen2_vl``), whose function is the same code;
* vLLM's out-of-tree model registration (``ModelRegistry.register_model``), under Qwen2-VL's own
  architecture name, of a subclass of vLLM's model whose multimodal processor
  (``MULTIMODAL_REGISTRY.register_processor``) is vLLM's own, with processing info that builds an
  image-only HF processor (``ImageOnlyQwen2VLProcessor``: the image processor and tokenizer from
  the model directory, no video processor) and declares images as the only modality (so
  profiling builds no dummy video). Videos are refused in one line.

It must run in every process that builds the model or processes prompts: the engine's own
process, before the ``AsyncLLM`` is made (``async_rl.generators.vllm.engine``), and vLLM's
engine-core and worker processes, which it reaches through the engine's config
(``RegisterInEveryProcess``).
"""

from __future__ import annotations

import functools
import sys
import types

QWEN2_VL_ARCH = "Qwen2VLForConditionalGeneration"
_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def is_qwen2_vl(model_path: str) -> bool:
    """Whether the model directory's ``config.json`` names Qwen2-VL's architecture (``False``
    when there is no such file)."""
    import json
    import os

    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return QWEN2_VL_ARCH in (json.load(f).get("architectures") or [])


def torchvision_missing() -> bool:
    """Whether transformers finds no torchvision (then the stand-ins here are needed)."""
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available()


def serve_qwen2_vl_without_torchvision() -> bool:
    """Make vLLM's Qwen2-VL importable and servable (images only) in this process; returns
    whether anything was registered (``False`` where torchvision imports). Idempotent.

    Raises:
        ImportError: vLLM's Qwen2-VL module still fails to import (another missing dependency).
    """
    if not torchvision_missing():
        return False
    from vllm import ModelRegistry

    ModelRegistry.register_model(QWEN2_VL_ARCH, _image_only_model())
    return True


class RegisterInEveryProcess:
    """An engine's ``hf_overrides`` (``EngineArgs.hf_overrides``, a callable over the HF config)
    that leaves the config unchanged and registers Qwen2-VL without torchvision in every process
    that unpickles the engine's config.

    On the CPU build, vLLM's engine core runs in a process of its own (spawned, not forked: our
    registrations in the caller's process do not reach it), which builds the multimodal processor
    for its encoder budget before any worker imports our extension; it receives the engine's
    config pickled, ``hf_overrides`` included. Unpickling this object calls
    ``serve_qwen2_vl_without_torchvision`` there (``__reduce__``). vLLM leaves ``hf_overrides``
    out of its config hash.
    """

    def __call__(self, config):
        return config

    def __reduce__(self):
        return (_registered_in_this_process, ())


def _registered_in_this_process() -> RegisterInEveryProcess:
    serve_qwen2_vl_without_torchvision()
    return RegisterInEveryProcess()


def _install_smart_resize_stand_in() -> None:
    # Only where the real module cannot be imported: with torchvision present it is left alone.
    if _TORCHVISION_MODULE in sys.modules:
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    stand_in = types.ModuleType(_TORCHVISION_MODULE, "Stand-in without torchvision (async-rl): smart_resize only.")
    stand_in.smart_resize = pil.smart_resize
    sys.modules[_TORCHVISION_MODULE] = stand_in


@functools.cache
def _image_only_model() -> type:
    """vLLM's Qwen2-VL model class with an image-only multimodal processor (module docstring)."""
    _install_smart_resize_stand_in()
    from vllm.model_executor.models import qwen2_vl as vq
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor_cls = image_only_processor_class()

    class ImageOnlyQwen2VLProcessingInfo(vq.Qwen2VLProcessingInfo):
        """Qwen2-VL's processing info with the image-only HF processor; images are the only modality."""

        def get_hf_processor(self, **kwargs: object):
            return self.ctx.get_hf_processor(processor_cls, **kwargs)

        def get_supported_mm_limits(self):
            return {"image": None}

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
            return {"image": self.get_max_image_tokens()}

    class ImageOnlyQwen2VLDummyInputsBuilder(vq.Qwen2VLDummyInputsBuilder):
        """Profiling inputs: the largest image only (vLLM's builder also makes a video)."""

        def get_dummy_mm_data(self, seq_len, mm_counts, mm_options):
            width, height = self.info.get_image_size_with_most_features()
            return {"image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0),
                                                    overrides=mm_options.get("image"))}

    @MULTIMODAL_REGISTRY.register_processor(vq.Qwen2VLMultiModalProcessor, info=ImageOnlyQwen2VLProcessingInfo,
                                            dummy_inputs=ImageOnlyQwen2VLDummyInputsBuilder)
    class ImageOnlyQwen2VLForConditionalGeneration(vq.Qwen2VLForConditionalGeneration):
        """vLLM's Qwen2-VL, unchanged but for its multimodal processor (images only)."""

    # Named as the architecture it stands for: vLLM records the class name as the architecture.
    ImageOnlyQwen2VLForConditionalGeneration.__name__ = QWEN2_VL_ARCH
    ImageOnlyQwen2VLForConditionalGeneration.__qualname__ = QWEN2_VL_ARCH
    return ImageOnlyQwen2VLForConditionalGeneration


@functools.cache
def image_only_processor_class() -> type:
    """``ImageOnlyQwen2VLProcessor``: transformers' ``Qwen2VLProcessor`` without a video
    processor, so ``from_pretrained`` loads only the image processor (the Pillow one) and the
    tokenizer; calling it with videos raises ``ValueError``. A subclass, so vLLM's type check
    (``get_hf_processor(Qwen2VLProcessor)``) accepts it."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessorKwargs
    from transformers.processing_utils import ProcessorMixin, Unpack

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        # ``ProcessorMixin.get_attributes`` reads the sub-processors off this signature: no video one.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

        # The annotation is how vLLM finds the processor's keyword arguments (min_pixels, ...).
        def __call__(self, images=None, text=None, videos=None, **kwargs: Unpack[Qwen2VLProcessorKwargs]):
            if videos is not None:
                raise ValueError("this Qwen2-VL processor serves images only (no torchvision: no video processor)")
            return super().__call__(images=images, text=text, **kwargs)

    ImageOnlyQwen2VLProcessor.__qualname__ = ImageOnlyQwen2VLProcessor.__name__
    return ImageOnlyQwen2VLProcessor
