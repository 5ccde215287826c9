"""Hugging Face transformers generator: sampling with ``model.generate`` on CPU or GPU.

Behavior log-probs are read from the processed scores that ``generate`` sampled from
(``output_scores=True``): with temperature only they equal ``log_softmax(logits / T)``, exactly
what the learner recomputes; with top-p/top-k they are the log-probs of the truncated
distribution the token was actually drawn from.
"""

from __future__ import annotations

import itertools
from typing import Iterable

import torch

from generators.base import GeneratorConfig, Sample, SamplingParams, cut_at_stop


def load_named_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors into ``model``'s parameters by Hugging Face name, in place.

    Tied parameters may arrive under any of their names (for example ``lm_head.weight`` aliasing
    ``model.embed_tokens.weight``); each underlying parameter must be written at least once.

    Returns:
        The number of bytes copied.

    Raises:
        KeyError: a name that is not a parameter of ``model`` (named in the message).
        ValueError: a shape mismatch, or parameters that no tensor updated (listed).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    canonical = {id(p): name for name, p in model.named_parameters()}
    pending = set(canonical.values())
    nbytes = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the generator's model")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the engine's {tuple(param.shape)}")
            param.copy_(tensor.to(dtype=param.dtype, device=param.device))
            pending.discard(canonical[id(param)])
            nbytes += tensor.numel() * tensor.element_size()
    if pending:
        raise ValueError(f"weight update left {len(pending)} parameters unchanged: {sorted(pending)[:8]}")
    return nbytes


class HFGenerator:
    """A ``transformers`` causal LM used as a rollout engine.

    Args:
        model_path: Hugging Face model directory.
        cfg: generator settings (batch size, seed).
        pad_token_id: id used for left padding of prompts.
        device: torch device string.

    The model runs in eval mode under ``torch.inference_mode``; sampling draws from a forked RNG
    seeded per call (``cfg.seed`` and a call counter), so a generator never disturbs the
    learner's RNG in colocated mode and a run is reproducible.
    """

    def __init__(self, model_path: str, cfg: GeneratorConfig, pad_token_id: int, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device).eval()
        self.pad_token_id = pad_token_id
        self.policy_version = 0
        self._calls = itertools.count()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights by name (see ``load_named_weights``) and adopt ``version``."""
        load_named_weights(self.model, named_tensors)
        self.policy_version = version

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        """Sample ``n`` responses per prompt.

        Args:
            prompts: prompt token id lists.
            n: samples per prompt (>= 1).
            params: sampling settings; ``params.stop_token_ids`` must not be empty.

        Returns:
            ``len(prompts)`` lists of ``n`` ``Sample``s, in prompt order.

        Raises:
            ValueError: ``n < 1`` or no stop token ids.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not params.stop_token_ids:
            raise ValueError("SamplingParams.stop_token_ids is empty: generation could never stop")
        rows = [p for p in prompts for _ in range(n)]
        flat: list[Sample] = []
        seed = self.cfg.seed * 1_000_003 + next(self._calls)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(rows), self.cfg.max_batch_size):
                flat.extend(self._generate_batch(rows[start : start + self.cfg.max_batch_size], params))
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams) -> list[Sample]:
        from transformers import GenerationConfig

        P = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), P), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), P), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, P - len(r) :] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, P - len(r) :] = 1
        gen_cfg = GenerationConfig(
            do_sample=not params.greedy,
            temperature=None if params.greedy else params.temperature,
            top_p=None if params.greedy or params.top_p >= 1.0 else params.top_p,
            top_k=None if params.greedy else params.top_k,  # 0 = off; None would let transformers default to 50
            max_new_tokens=params.max_tokens,
            eos_token_id=list(params.stop_token_ids),
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            generation_config=gen_cfg,
        )
        generated = out.sequences[:, P:].cpu()
        # scores[t] is the processed [N, V] distribution step t sampled from.
        scores = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1).to(scores.device)).squeeze(-1).cpu()
        samples = []
        for i in range(len(rows)):
            ids = generated[i].tolist()
            keep, reason = cut_at_stop(ids, params.stop_token_ids)
            samples.append(Sample(
                response_ids=ids[:keep], logprobs=logprobs[i, :keep].tolist(), finish_reason=reason,
                policy_version=[self.policy_version] * keep,
            ))
        return samples
