"""Rollout engines: the generator protocol (``base``), HF transformers (``hf``), vLLM (the
``vllm`` subpackage: the engine in ``vllm.engine``, its weight-transfer backend in ``vllm.worker``,
its processes' sockets and environment in ``vllm.process`` and its log filter in
``vllm.logging_filter``) and SGLang (the ``sglang`` subpackage: the engine in ``sglang.engine``, its
processes in ``sglang.process`` and its LoRA adapters in ``sglang.lora``); what each can do in
``capabilities``; the model checks an engine makes at start in ``model_support``. The async
pool's actors that host them live in ``async_rl.loops.actors``.
Nothing here imports the learner side (LoRA settings and adapter names come from
``async_rl.utils.lora``)."""


def make_generator(cfg, model_path: str, pad_token_id: int, num_threads: int = 0, device: str | None = None,
                   lora=None):
    """The engine ``cfg.backend`` names (a name of ``capabilities.ENGINES``: ``hf``, ``vllm`` or
    ``sglang``), loaded from ``model_path``.

    Args:
        cfg: ``GeneratorConfig``.
        model_path: Hugging Face model directory of the starting weights.
        pad_token_id: left-padding id (HF engine).
        num_threads: CPU threads of an engine that decodes in processes of its own (vLLM, SGLang:
            ``EngineCapabilities.separate_processes``; 0 = the engine's default).
        device: ``cpu`` or ``cuda``; ``None`` (the trainer's and the pool's call):
            ``EngineCapabilities.default_device``: the HF engine's ``generator.hf.device``;
            ``cuda`` where torch sees a GPU for an engine that is told its device (SGLang,
            ``EngineCapabilities.picks_device``); else ``cpu`` (vLLM's own build picks its platform).
        lora: the run's ``async_rl.utils.lora.LoRAConfig`` (``cfg.learner.lora``): with ``rank > 0`` the engine
            serves the base model plus the same adapters and its weight updates carry only them.
            ``None`` (the default) = no LoRA: full-weight updates.

    Raises:
        ValueError: an unknown backend.
        ImportError: the engine's library is not installed (the message says what to install).
    """
    from async_rl.generators.capabilities import engine_class

    cls = engine_class(cfg.backend)
    caps = cls.capabilities
    if device is None:
        device = caps.default_device(cfg)
    extra = {"num_threads": num_threads} if caps.separate_processes else {}
    try:
        return cls(model_path, cfg, pad_token_id, device=device, lora=lora, **extra)
    except ModuleNotFoundError as e:
        if caps.library and (e.name or "").split(".")[0] == caps.library:
            raise ImportError(f"generator.backend={cfg.backend} needs {caps.name}: {caps.install} ({e})") from e
        raise


def check_model(cfg, model_spec: str) -> None:
    """Refuse at start a model the engine ``cfg.backend`` names cannot serve on this platform: a
    vision-language model on an engine whose capabilities lack ``serves_images``, then the engine
    class's ``check_model(hf_config, model_path)`` where it has one (vLLM's; the HF engine serves
    whatever transformers loads), given the model's ``config.json``. ``model_spec``: a model
    directory or ``builtin:NAME`` (resolved, i.e. built when not cached). Starts nothing and
    imports no engine library.

    Raises:
        ValueError: an unknown backend (``engine_class``).
        UnservableModelError: (a ``ValueError``) one line naming the engine, the value and what would work.
    """
    from async_rl.data.builtin import resolve
    from async_rl.generators.capabilities import engine_class, engines_that
    from async_rl.generators.model_support import UnservableModelError, read_hf_config

    cls = engine_class(cfg.backend)
    path = resolve(model_spec)
    hf_config = read_hf_config(path)
    if hf_config.get("vision_config") and not cls.capabilities.serves_images:
        raise UnservableModelError(f"generator.backend={cfg.backend}: the {cls.capabilities.name} engine does not "
                                   f"sample from prompts with images, and {model_spec} is a vision-language model; "
                                   f"use generator.backend={engines_that(lambda c: c.serves_images)}")
    check = getattr(cls, "check_model", None)
    if check is not None:
        check(hf_config, path)
