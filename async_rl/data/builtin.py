"""Built-in artefacts for the embedded default run: a tiny Qwen2 model, its tokenizer, and a task.

Nothing here downloads anything. The artefacts are ordinary Hugging Face files, so the same
loading code that reads a user's model directory or verl parquet reads them too:

- ``builtin:tiny-qwen2``: a randomly initialised Qwen2-architecture causal LM (about 0.9M
  parameters, tied embeddings) saved with ``save_pretrained`` (config.json, model.safetensors,
  generation_config.json) next to a byte-level BPE tokenizer (tokenizer.json,
  tokenizer_config.json with a ChatML chat template). transformers and vLLM both load it.
- ``builtin:arithmetic/train`` and ``builtin:arithmetic/test``: parquet files in the verl row
  layout (``prompt`` as chat messages, ``data_source``, ``reward_model.ground_truth``,
  ``extra_info``) holding short addition problems such as ``"37+45="`` with answer ``"82"``.
  The held-out split holds operand pairs that never occur in the train split.
- ``builtin:chainsum/train`` and ``builtin:chainsum/test``: the same layout, sums of 2 to 24
  single-digit terms such as ``"3+8+5+1="`` whose worked answer is the chain of running sums
  ``"11 16 17"``; the number of terms is long-tailed (``CHAINSUM_SPEC``), so are the answers'
  lengths. The held-out split holds prompts that never occur in the train split.
- ``builtin:skipcount/train`` and ``builtin:skipcount/test``: the same layout, counting down from
  a start by a step to a floor, such as ``"53-5>30"`` whose worked answer is ``"48 43 38 33"``;
  the count of numbers is long-tailed (``SKIPCOUNT_SPEC``), so are the answers' lengths, and each
  number follows from the one before and the prompt's step, a rule the tiny model learns where
  chain sums (a term to find at every step) defeat it.
- ``builtin:tiny-llama``, ``tiny-qwen3``, ``tiny-mistral``, ``tiny-gemma2``, ``tiny-phi3``,
  ``tiny-olmo2``: tiny models of other architectures with the same tokenizer
  (``async_rl.data.architectures``).
- ``builtin:small-qwen2``: a Qwen2 of the same kind about 5x larger (4.8M parameters, 512
  positions, the same tokenizer), for tasks whose prompts are sentences (``SMALL_QWEN2_SPEC``).
- ``builtin:tiny-qwen2-vl``: a tiny Qwen2-VL vision-language model with its image processor and
  the tokenizer with Qwen2-VL's image markup (``async_rl.data.vision``).
- ``builtin:shapes/train`` and ``builtin:shapes/test``: an image task for the tiny Qwen2-VL,
  the verl layout with an ``images`` column (PNG bytes) and ``<image>`` before a question such as
  ``"How many shapes?"`` about 1 to 4 flat shapes (``async_rl.data.shapes``); one-word answers.
- ``builtin:tiny-qwen2-reward``: the same tiny Qwen2 with a scalar head
  (``Qwen2ForSequenceClassification``, one label), a reward model for ``reward.model``.

Artefacts are built once into ``<cache_dir>/<name>-<spec hash>`` (written to a temporary
directory and renamed, so a crashed build never leaves a half-written artefact) and reused by
every later run whose spec is the same. The cache directory is ``$ASYNC_RL_CACHE`` if set, else
``~/.cache/async-rl``.

Run ``python -m async_rl.data.builtin`` to build them and print their paths.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from async_rl.data.architectures import ARCH_SPECS, build_arch
from async_rl.data.shapes import SHAPES_DATA_SOURCE, SHAPES_SPEC, build_shapes  # noqa: F401  (re-exported, as ARITHMETIC_DATA_SOURCE)
from async_rl.data.vision import TINY_QWEN2_VL_SPEC, build_tiny_qwen2_vl

BUILTIN_PREFIX = "builtin:"

# Bumped when the build code changes in a way the spec dicts below do not capture.
_BUILD_REVISION = 2

TINY_QWEN2_SPEC: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "seed": 0,
}

SMALL_QWEN2_SPEC: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "seed": 0,
}
"""``builtin:small-qwen2``: the tiny Qwen2's tokenizer in a model about 5x its size (4.8M
parameters): enough to learn tasks whose prompts are whole sentences (reasoning-gym's) from a
warm start, where the tiny one learns only the compact prompts it was built for."""

ARITHMETIC_SPEC: dict[str, Any] = {
    "max_operand": 19,
    "num_train": 320,
    "num_test": 80,
    "seed": 0,
}

ARITHMETIC_DATA_SOURCE = "async_rl/arithmetic"

# The long-tailed worked-answer task: k single-digit terms, k drawn from a truncated Zipf law
# P(k) ~ (k - min_terms + 1) ** -term_exponent on min_terms..max_terms. With exponent 1.2 about
# half the problems have 2-3 terms, and the train split's worked answers (running sums, one
# character per token, plus EOS) measure median 8 and p99 70 tokens (p99/median 9, mean 15): most
# responses are short, a few run long, as reasoning traces do, so a synchronous step waits on its
# longest samples. A heavier tail than a geometric law's (ratio 0.75: p99 48) on purpose: long
# answers are what make decoding, not training, the larger share of a step. 24 terms bound the
# longest answer at 82 tokens with EOS (sums up to 216) and the longest prompt at 56 tokens with
# the chat template: both fit the tiny model's 256 positions.
CHAINSUM_SPEC: dict[str, Any] = {
    "min_terms": 2,
    "max_terms": 24,
    "term_exponent": 1.2,
    # Share of the problem space (by a seeded hash of the prompt text) held out for the test
    # split: large enough that the test split has several distinct 2-term problems (about 10 of
    # the 81), small enough that train keeps most of the short problems to learn from. Each
    # split repeats problems as the law draws them (the test split: 165 distinct prompts in 256
    # rows), so its accuracy weighs the problems as training sees them.
    "test_fraction": 0.125,
    # A few thousand train rows: the warm start and RL draw from them with replacement, and the
    # short problems recur (only 81 two-term problems exist), as easy problems do in real data.
    # 256 test rows: an eval with a +-3 point standard error that the CPU job can afford.
    "num_train": 4000,
    "num_test": 256,
    "seed": 0,
}

CHAINSUM_DATA_SOURCE = "async_rl/chainsum"

# The long-tailed job's task: skip counting down to a floor. A problem is a start n, a step k in
# 1..9 and a floor f; the worked answer is n - k, n - 2k, ... down to the last number >= f,
# ``count`` numbers. ``count`` follows the truncated Zipf law P(c) ~ c ** -count_exponent on
# 1..max_count, k is uniform, f uniform on 0..max_floor, and n = f + count * k + r with r uniform
# on 0..k-1. Each number follows from the one before and the prompt's step (a subtraction with a
# borrow), and the answer stops where the next number would fall below the floor (a comparison
# with the prompt's floor): a local rule the tiny model learns from a few thousand warm-start
# steps, where a chain sum's next term must be found at a moving place in the prompt. The floor
# makes the problem space large (24 counts x 45 (k, r) pairs x 100 floors = 108,000 problems), so
# the held-out split's unseen problems measure the rule, not a memorised chain: without it (a
# floor of 0, 1,080 problems) the warm-started model reproduced train chains (sampled reward 0.6)
# and solved 9% of held-out ones. With exponent 1.2 and 24 numbers at most, the train split's
# answers are long-tailed (SKIPCOUNT_LENGTHS).
SKIPCOUNT_SPEC: dict[str, Any] = {
    "max_count": 24,
    "count_exponent": 1.2,
    "max_step": 9,
    "max_floor": 99,
    # As CHAINSUM_SPEC: a seeded hash of the prompt routes 1/8 of the problems to the test split.
    "test_fraction": 0.125,
    # 20,000 train rows, 13,775 of them distinct (the short problems recur, as easy problems do in
    # real data): a warm start of 1,500 steps of 64 sees a problem about 7 times, too few to
    # memorise the set. 256 test rows (240 distinct), as chain sums.
    "num_train": 20000,
    "num_test": 256,
    "seed": 0,
}

SKIPCOUNT_DATA_SOURCE = "async_rl/skipcount"

SKIPCOUNT_LENGTHS = (9, 83, 96)
"""The train split's answer lengths in tokens (one per character, plus EOS): median, p99 (nearest
rank) and longest. p99 is 9x the median: a synchronous step's generation waits on the few long
answers."""

# The tool-use variant: the same architecture, a longer context, and a Qwen2.5-style (Hermes)
# chat template that renders tool schemas, assistant tool calls and tool responses.
TINY_QWEN2_TOOLS_SPEC: dict[str, Any] = {**TINY_QWEN2_SPEC, "max_position_embeddings": 512, "variant": "tools"}

CALC_SPEC: dict[str, Any] = {
    "min_operand": 11,
    "max_operand": 49,
    "max_addend": 99,
    "ops": "+",
    "num_train": 2000,
    "num_test": 100,
    "seed": 0,
}

CALC_DATA_SOURCE = "async_rl/calc"

# Qwen2.5's tool layout, compact enough for a 512-token model: the system block lists each tool
# as name(parameters); an assistant tool call is a <tool_call> block holding
# {"name": ..., "arguments": {...}}; consecutive tool responses share one user turn, each in a
# <tool_response> block. Prefix-stable: rendering more messages never changes earlier tokens.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n# Tools\n' }}"
    "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- f.name + '(' + (f.parameters.properties.keys() | list | join(', ')) + ')\n' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' "
    "+ (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Single tokens for the tool-call markup, as a trained BPE would merge them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "tool", "calculator",
               "expression", '"name": "', '", "arguments": {"', '": "']
# The template and tokens are part of the artefact's identity: a change rebuilds it.
TINY_QWEN2_TOOLS_SPEC["template_sha"] = hashlib.sha256(
    json.dumps([TOOLS_CHAT_TEMPLATE, TOOL_TOKENS]).encode()).hexdigest()[:12]

# ChatML, the layout of Qwen2 chat templates: generation stops at <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen2-VL's image markup, special tokens of the vision-language tokenizer (``vision=True``): an
image is ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch + ``<|vision_end|>``."""
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML with multimodal content: a message's ``content`` is a string or a list of parts
``{"type": "text", "text": ...}`` / ``{"type": "image"}`` (the OpenAI and transformers layout);
an image part renders as one ``<|image_pad|>``, which the processor expands to the image's
merged-patch count (Qwen2-VL's template does the same)."""
# Role names as single tokens keep the tiny model's prompts short (14 tokens for "37+45=").
ROLE_TOKENS = ["system", "user", "assistant"]


def cache_dir() -> Path:
    """Root of the artefact cache: ``$ASYNC_RL_CACHE`` or ``~/.cache/async-rl``."""
    return Path(os.environ.get("ASYNC_RL_CACHE", Path.home() / ".cache" / "async-rl"))


def _spec_hash(spec: dict[str, Any]) -> str:
    blob = json.dumps({"rev": _BUILD_REVISION, **spec}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _build_cached(name: str, spec: dict[str, Any], build) -> Path:
    """Return ``cache_dir()/<name>-<hash>``, calling ``build(tmp_dir)`` first if it is absent."""
    target = cache_dir() / f"{name}-{_spec_hash(spec)}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text(json.dumps(spec, sort_keys=True))
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first; its copy is identical.
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tokenizer(out_dir: Path, tools: bool = False, model_max_length: int | None = None,
                    vision: bool = False):
    """Write a byte-level BPE tokenizer with ChatML special tokens to ``out_dir``.

    Vocabulary: the 256 byte symbols, three special tokens (``<|endoftext|>`` = pad,
    ``<|im_start|>``, ``<|im_end|>`` = EOS) and the role names as single tokens; no merges, so
    any UTF-8 text round-trips exactly. With ``tools``: also the tool-call markup as single
    (non-special) tokens and the tool-aware chat template ``TOOLS_CHAT_TEMPLATE``. With ``vision``:
    also ``VISION_TOKENS`` (special, after the others, so every other id is unchanged) and
    ``VISION_CHAT_TEMPLATE``.
    ``model_max_length``: the model's positions (default: the tiny model's, 256, or 512 with
    ``tools``).

    Returns:
        The ``transformers.PreTrainedTokenizerFast`` that was saved.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(byte_symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(ROLE_TOKENS + (TOOL_TOKENS if tools else []))
    tok.add_special_tokens(SPECIAL_TOKENS + (VISION_TOKENS if vision else []))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=model_max_length or (TINY_QWEN2_TOOLS_SPEC if tools else
                                              TINY_QWEN2_SPEC)["max_position_embeddings"],
        padding_side="left",
        chat_template=VISION_CHAT_TEMPLATE if vision else TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)
    return fast


def build_qwen2(out_dir: Path, spec: dict[str, Any] = TINY_QWEN2_SPEC) -> None:
    """Write a randomly initialised ``Qwen2ForCausalLM`` of ``spec``'s shape, its generation
    config and the project's tokenizer (``build_tokenizer``) to ``out_dir``.

    ``spec`` holds ``Qwen2Config`` fields plus ``seed`` (of the initialisation), optionally
    ``variant: "tools"`` (the tool-use tokenizer) and ``vocab_size``: absent, the tokenizer's
    length (262); larger, an embedding padded past the tokenizer as real checkpoints are (Qwen2.5
    has 151,936 rows for 151,665 tokens; ids the tokenizer lacks decode to ``""``), which gives a
    test model a real model's embedding and head sizes (``bench/gpu_check.py``).
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = dict(spec)
    seed = spec.pop("seed")
    spec.pop("template_sha", None)
    tokenizer = build_tokenizer(out_dir, tools=spec.pop("variant", None) == "tools",
                                model_max_length=spec["max_position_embeddings"])
    vocab_size = spec.pop("vocab_size", len(tokenizer))
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **spec,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    model.save_pretrained(out_dir, safe_serialization=True)


TINY_QWEN2_REWARD_SPEC: dict[str, Any] = {**TINY_QWEN2_SPEC, "seed": 1, "variant": "reward",
                                                   "head_scale": 10.0}
"""``builtin:tiny-qwen2-reward``: the tiny Qwen2 with a scalar head (``Qwen2ForSequenceClassification``,
``num_labels=1``) and the same tokenizer, randomly initialised with its own seed: a reward model
(``reward.model``) the project owns, for tests and demos; its scores mean nothing."""


def _build_tiny_qwen2_reward(out_dir: Path, spec: dict[str, Any] = TINY_QWEN2_REWARD_SPEC) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    spec = {k: v for k, v in spec.items() if k not in ("template_sha", "variant")}
    seed, head_scale = spec.pop("seed"), spec.pop("head_scale")
    tokenizer = build_tokenizer(out_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, torch_dtype="float32", num_labels=1, **spec)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    # A random head's scores are ~0.1 apart; a larger head spreads them to about unit scale.
    with torch.no_grad():
        model.score.weight.mul_(head_scale)
    model.save_pretrained(out_dir, safe_serialization=True)


def make_arithmetic_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row for the problem ``a+b``.

    Example: ``make_arithmetic_row(37, 45, "train", 0)`` gives ``prompt`` =
    ``[{"role": "user", "content": "37+45="}]``, ``reward_model.ground_truth`` = ``"82"`` and
    ``extra_info.answer`` = ``"82"`` (the target text used by the supervised warm start).
    """
    answer = str(a + b)
    return {
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "data_source": ARITHMETIC_DATA_SOURCE,
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer},
    }


def _build_arithmetic(out_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = ARITHMETIC_SPEC
    pairs = [(a, b) for a in range(spec["max_operand"] + 1) for b in range(spec["max_operand"] + 1)]
    random.Random(spec["seed"]).shuffle(pairs)
    need = spec["num_train"] + spec["num_test"]
    if need > len(pairs):
        raise ValueError(f"arithmetic spec asks for {need} distinct problems, only {len(pairs)} exist")
    splits = {
        "test": pairs[: spec["num_test"]],
        "train": pairs[spec["num_test"] : need],
    }
    for split, split_pairs in splits.items():
        rows = [make_arithmetic_row(a, b, split, i) for i, (a, b) in enumerate(split_pairs)]
        pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{split}.parquet")


def chainsum_terms(rng: random.Random, spec: dict[str, Any] = CHAINSUM_SPEC) -> list[int]:
    """Draw one chain-sum problem: ``k`` terms in 1..9, ``k`` from the spec's truncated Zipf law
    (``P(k)`` proportional to ``(k - min_terms + 1) ** -term_exponent`` on ``min_terms..max_terms``).

    Raises:
        ValueError: a spec with ``min_terms < 2``, ``max_terms < min_terms`` or ``term_exponent < 0``.
    """
    lo, hi, exponent = spec["min_terms"], spec["max_terms"], spec["term_exponent"]
    if lo < 2 or hi < lo or exponent < 0:
        raise ValueError(f"chainsum spec needs 2 <= min_terms <= max_terms and term_exponent >= 0, got {spec}")
    k = rng.choices(range(lo, hi + 1), weights=[(k - lo + 1) ** -exponent for k in range(lo, hi + 1)])[0]
    return [rng.randint(1, 9) for _ in range(k)]


def _chainsum_prompt(terms: list[int]) -> str:
    return "+".join(map(str, terms)) + "="


def make_chainsum_row(terms: list[int], split: str, index: int) -> dict[str, Any]:
    """One verl-layout row for the chain sum of ``terms`` (two or more single-digit numbers).

    The worked answer is the running sum after each added term, separated by single spaces; it
    is both ``extra_info.answer`` (the supervised warm start's target) and
    ``reward_model.ground_truth`` (the chainsum reward wants the whole chain). Example:
    ``make_chainsum_row([3, 8, 5, 1], "train", 0)`` gives ``prompt`` =
    ``[{"role": "user", "content": "3+8+5+1="}]``, ``reward_model.ground_truth`` = ``"11 16 17"``,
    ``extra_info.answer`` = ``"11 16 17"`` and ``extra_info.total`` = ``17``.

    Raises:
        ValueError: fewer than two terms, or a term outside 1..9.
    """
    if len(terms) < 2 or any(not 1 <= t <= 9 for t in terms):
        raise ValueError(f"a chain sum needs two or more terms in 1..9, got {terms}")
    sums = list(itertools.accumulate(terms))[1:]
    answer = " ".join(map(str, sums))
    return {
        "prompt": [{"role": "user", "content": _chainsum_prompt(terms)}],
        "data_source": CHAINSUM_DATA_SOURCE,
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "total": sums[-1]},
    }


def chainsum_held_out(prompt: str, spec: dict[str, Any] = CHAINSUM_SPEC) -> bool:
    """Whether the problem ``prompt`` (e.g. ``"3+8+5+1="``; also a skip count's, ``"53-5>30"``, with
    ``SKIPCOUNT_SPEC``) belongs to the test split: a seeded
    hash of the text, below ``test_fraction``. Deterministic across processes and Python versions
    (sha256, not ``hash``), so the splits never share a problem."""
    digest = hashlib.sha256(f"{spec['seed']}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < spec["test_fraction"] * 2**64


def _build_chainsum(out_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = CHAINSUM_SPEC
    rng = random.Random(spec["seed"])
    want = {"train": spec["num_train"], "test": spec["num_test"]}
    splits: dict[str, list[list[int]]] = {"train": [], "test": []}
    # Draw from the one law and route each problem by its hash: both splits follow the same
    # length law, and a problem (repeats included) lands in one split only.
    while any(len(splits[name]) < n for name, n in want.items()):
        terms = chainsum_terms(rng, spec)
        split = "test" if chainsum_held_out(_chainsum_prompt(terms), spec) else "train"
        if len(splits[split]) < want[split]:
            splits[split].append(terms)
    for split, problems in splits.items():
        rows = [make_chainsum_row(terms, split, i) for i, terms in enumerate(problems)]
        pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{split}.parquet")


def skipcount_problem(rng: random.Random, spec: dict[str, Any] = SKIPCOUNT_SPEC) -> tuple[int, int, int]:
    """Draw one skip-counting problem ``(start, step, floor)`` from the spec's law: the count of
    numbers ``c`` from ``P(c)`` proportional to ``c ** -count_exponent`` on ``1..max_count``, the
    step ``k`` uniform on ``1..max_step``, the floor ``f`` uniform on ``0..max_floor``, the start
    ``f + c * k + r`` with ``r`` uniform on ``0..k-1``.

    Raises:
        ValueError: a spec with ``max_count < 1``, ``max_step`` outside 1..9, ``max_floor < 0`` or
            ``count_exponent < 0``.
    """
    hi, exponent, max_step, max_floor = spec["max_count"], spec["count_exponent"], spec["max_step"], spec["max_floor"]
    if hi < 1 or not 1 <= max_step <= 9 or max_floor < 0 or exponent < 0:
        raise ValueError("skipcount spec needs max_count >= 1, 1 <= max_step <= 9, max_floor >= 0 and "
                         f"count_exponent >= 0, got {spec}")
    count = rng.choices(range(1, hi + 1), weights=[c ** -exponent for c in range(1, hi + 1)])[0]
    step = rng.randint(1, max_step)
    floor = rng.randint(0, max_floor)
    return floor + count * step + rng.randint(0, step - 1), step, floor


def _skipcount_prompt(start: int, step: int, floor: int) -> str:
    return f"{start}-{step}>{floor}"


def make_skipcount_row(start: int, step: int, floor: int, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row: count down from ``start`` by ``step`` while the numbers stay >= ``floor``.

    The prompt reads ``"<start>-<step>><floor>"``; the worked answer is every number after the
    start down to the last that is not below the floor, separated by single spaces. It is both
    ``extra_info.answer`` (the warm start's target) and ``reward_model.ground_truth`` (scored by
    the chain reward, ``async_rl.rewards.chainsum``). Example: ``make_skipcount_row(53, 5, 30,
    "train", 0)`` gives ``prompt`` = ``[{"role": "user", "content": "53-5>30"}]``,
    ``reward_model.ground_truth`` = ``"48 43 38 33"`` and ``extra_info.count`` = ``4``.

    Raises:
        ValueError: ``step`` outside 1..9, a negative ``floor``, or ``start < floor + step`` (no
            number to write).
    """
    if not 1 <= step <= 9 or floor < 0 or start < floor + step:
        raise ValueError("skip counting needs a step in 1..9, a floor >= 0 and a start >= floor + step, "
                         f"got start={start}, step={step}, floor={floor}")
    numbers = list(range(start - step, floor - 1, -step))
    answer = " ".join(map(str, numbers))
    return {
        "prompt": [{"role": "user", "content": _skipcount_prompt(start, step, floor)}],
        "data_source": SKIPCOUNT_DATA_SOURCE,
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "count": len(numbers)},
    }


def _build_skipcount(out_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = SKIPCOUNT_SPEC
    rng = random.Random(spec["seed"])
    want = {"train": spec["num_train"], "test": spec["num_test"]}
    splits: dict[str, list[tuple[int, int, int]]] = {"train": [], "test": []}
    # As _build_chainsum: one law, each problem routed by its hash, so the splits share none.
    while any(len(splits[name]) < n for name, n in want.items()):
        problem = skipcount_problem(rng, spec)
        split = "test" if chainsum_held_out(_skipcount_prompt(*problem), spec) else "train"
        if len(splits[split]) < want[split]:
            splits[split].append(problem)
    for split, problems in splits.items():
        rows = [make_skipcount_row(*problem, split, i) for i, problem in enumerate(problems)]
        pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{split}.parquet")


def calc_problem(rng: random.Random, spec: dict[str, Any] = CALC_SPEC) -> tuple[str, int]:
    """One two-step problem ``a*b+c`` (or ``a*b-c`` when ``spec["ops"]`` has ``-``) and its
    value: too hard for the tiny model to compute itself, easy with the calculator."""
    a = rng.randint(spec["min_operand"], spec["max_operand"])
    b = rng.randint(spec["min_operand"], spec["max_operand"])
    c = rng.randint(1, spec["max_addend"])
    op = rng.choice(spec["ops"])
    return f"{a}*{b}{op}{c}", a * b + c if op == "+" else a * b - c


def make_calc_row(expression: str, value: int, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row of the calculator task, with a tool-use demonstration.

    ``prompt`` is ``[{"role": "user", "content": "23*17+45="}]``; ``extra_info.answer`` is the
    value and ``extra_info.demonstration`` the conversation that solves it with the calculator
    (assistant tool call, tool response, assistant answer), used by the supervised warm start.
    """
    answer = str(value)
    return {
        "prompt": [{"role": "user", "content": f"{expression}="}],
        "data_source": CALC_DATA_SOURCE,
        "ability": "tool-use",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "demonstration": [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
            {"role": "tool", "name": "calculator", "content": answer},
            {"role": "assistant", "content": answer},
        ]},
    }


def _build_calc(out_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = CALC_SPEC
    rng = random.Random(spec["seed"])
    problems: dict[str, int] = {}
    while len(problems) < spec["num_train"] + spec["num_test"]:
        expression, value = calc_problem(rng, spec)
        problems.setdefault(expression, value)
    items = list(problems.items())
    splits = {"test": items[: spec["num_test"]], "train": items[spec["num_test"] :]}
    for split, split_items in splits.items():
        rows = [make_calc_row(e, v, split, i) for i, (e, v) in enumerate(split_items)]
        # The demonstration's heterogeneous messages are stored as JSON text in parquet.
        for row in rows:
            row["extra_info"]["demonstration"] = json.dumps(row["extra_info"]["demonstration"])
        pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{split}.parquet")


_BUILDERS = {
    "tiny-qwen2": (TINY_QWEN2_SPEC, build_qwen2),
    "tiny-qwen2-tools": (TINY_QWEN2_TOOLS_SPEC, lambda out: build_qwen2(out, TINY_QWEN2_TOOLS_SPEC)),
    "tiny-qwen2-reward": (TINY_QWEN2_REWARD_SPEC, _build_tiny_qwen2_reward),
    "small-qwen2": (SMALL_QWEN2_SPEC, lambda out: build_qwen2(out, SMALL_QWEN2_SPEC)),
    "tiny-qwen2-vl": (TINY_QWEN2_VL_SPEC, lambda out: build_tiny_qwen2_vl(out, build_tokenizer)),
    "arithmetic": (ARITHMETIC_SPEC, _build_arithmetic),
    "chainsum": (CHAINSUM_SPEC, _build_chainsum),
    "skipcount": (SKIPCOUNT_SPEC, _build_skipcount),
    "calc": (CALC_SPEC, _build_calc),
    "shapes": (SHAPES_SPEC, build_shapes),
    # builtin:tiny-llama, tiny-qwen3, tiny-mistral, tiny-gemma2, tiny-phi3, tiny-olmo2.
    **{name: (spec, lambda out, spec=spec: build_arch(out, spec, build_tokenizer))
       for name, spec in ARCH_SPECS.items()},
}


def resolve(uri: str) -> str:
    """Map a ``builtin:`` URI to a local path, building the artefact on first use.

    ``builtin:tiny-qwen2`` -> model directory; ``builtin:arithmetic/train`` (or ``/test``,
    likewise ``builtin:chainsum/...``, ``builtin:skipcount/...`` and ``builtin:calc/...``) -> parquet file. Any other string
    is returned unchanged, so callers can pass user paths through.

    Raises:
        ValueError: for an unknown built-in name or split, listing the valid ones.
    """
    if not uri.startswith(BUILTIN_PREFIX):
        return uri
    name, _, sub = uri[len(BUILTIN_PREFIX) :].partition("/")
    if name not in _BUILDERS:
        valid = ", ".join(f"{BUILTIN_PREFIX}{n}" for n in _BUILDERS)
        raise ValueError(f"unknown built-in artefact {uri!r}; valid: {valid}")
    spec, build = _BUILDERS[name]
    root = _build_cached(name, spec, build)
    if not sub:
        return str(root)
    path = root / f"{sub}.parquet"
    if not path.exists():
        valid = ", ".join(f"{BUILTIN_PREFIX}{name}/{p.stem}" for p in sorted(root.glob("*.parquet")))
        raise ValueError(f"unknown split in {uri!r}; valid: {valid or '(none: this artefact has no splits)'}")
    return str(path)


if __name__ == "__main__":
    for uri in ("builtin:tiny-qwen2", "builtin:arithmetic/train", "builtin:arithmetic/test"):
        print(uri, "->", resolve(uri))
