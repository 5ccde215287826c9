"""Prompt datasets in the verl row layout, read from parquet or jsonl.

A row is a mapping with

- ``prompt`` (required): a list of chat messages ``[{"role": "user", "content": "..."}]``,
  rendered with the tokenizer's chat template (``add_generation_prompt=True``);
- ``data_source`` (string, picks the default reward function; ``"unknown"`` when absent);
- ``reward_model``: ``{"style": "rule", "ground_truth": "..."}`` (ground truth for the reward);
- ``extra_info``: free-form mapping passed to the reward function;
- ``images`` (vision-language models only): a list of images, each encoded bytes, a ``{"bytes",
  "path"}`` mapping (Hugging Face ``datasets``' ``Image`` feature in parquet) or a path relative
  to the data file's directory (``async_rl.data.images.decode_image``).

Images, as verl's users write them: each ``<image>`` in a message's string ``content`` marks
where the next image of the row goes; in a row that has an ``images`` value (even an empty
list; a row without one keeps ``<image>`` as text) such content becomes a list of parts
(``{"type": "text", "text": ...}``, ``{"type": "image"}``) in order, the form the chat template
renders (content already given as parts is taken as it is). The images are decoded, resized
within ``data.image_min_pixels``/``image_max_pixels`` and processed once, when the file is read
(``Prompt.images``), and each image's placeholder token is repeated once per merged patch in
``Prompt.prompt_ids``, so ``data.max_prompt_tokens`` counts image tokens. A row whose images
cannot be used (``BAD_IMAGE_REASONS``: undecodable, missing file, wrong type or pixel mode, too
small, a number of images other than its number of placeholders) is rejected, logged and
counted in both ``on_bad_row`` modes, like an over-long one; an ``images`` value that is not a
list is a malformed row (``bad_images``). Images given to a text-only model (no
``ImageProcessing``) stop the read with a ``ValueError`` naming the file and the model.

Rows are validated when the file is read. With ``data.on_bad_row=error`` (the default) a
malformed row raises ``ValueError`` naming the file and the 0-based row index (a jsonl line that
is not JSON is named by its 1-based line number); with ``skip`` it is logged and counted by
reason (``PromptDataset.rejected``, one of ``BAD_ROW_REASONS``) and the file is read on. A prompt
whose rendered length exceeds ``data.max_prompt_tokens`` is never truncated: it is rejected,
logged and counted (reason ``too_long``; ``PromptDataset.num_rejected_too_long``), in both modes.
A file set with no usable row left is an error either way.

A dataset asked for a reference response (``reference_fields``: the supervised warm start's
``trainer.warm_start.response_field``) takes it from each row by dotted path when the file is
read (``field_value``: ``reward_model.ground_truth``, ``extra_info.answer``, a top-level key), so
a row without it stops the run before anything trains, naming the file, row and field.

Iteration is deterministic: the order is a seeded permutation per epoch, and
``state_dict()``/``load_state_dict()`` capture the position so a resumed run continues with the
same prompts.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from async_rl.utils.vision import image_token_id, is_vision_language
from async_rl.data.images import BAD_IMAGE_REASONS, BadImageError, ImageInputs, ImageProcessing, decode_image, \
    expand_image_tokens

logger = logging.getLogger(__name__)

ON_BAD_ROW_MODES = ("error", "skip")
"""``data.on_bad_row``: stop at the first malformed row, or skip it (logged, counted by reason)."""

BAD_ROW_REASONS = ("not_json", "not_an_object", "missing_prompt", "bad_prompt", "bad_messages",
                   "bad_data_source", "bad_reward_model", "bad_extra_info", "bad_images", "no_reference",
                   "template_error")
"""Why a row was rejected as malformed (``BadRowError.reason``), in the order the checks run:
a jsonl line that is not JSON (or not UTF-8) or not an object; ``prompt`` missing, not a non-empty list, or
holding a message that is not ``{"role": str, "content": str | list of parts}``; ``data_source`` not a string;
``reward_model`` or ``extra_info`` not a mapping; ``images`` present but not a list; none of the
reference fields the run asks for; the tokenizer's chat template refused the messages."""

ALWAYS_COUNTED_REASONS = ("too_long", *BAD_IMAGE_REASONS)
"""Reasons a row is rejected and counted in both ``on_bad_row`` modes, never raised: the row is
well formed, only its length or its images are unusable (a scraped image set has a few bad
images; one must not stop the run)."""

REJECT_REASONS = (*BAD_ROW_REASONS, *ALWAYS_COUNTED_REASONS)
"""Every reason a row can leave the dataset: ``BAD_ROW_REASONS``, an over-long prompt and the
image reasons (``async_rl.data.images.BAD_IMAGE_REASONS``)."""

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a message's string content (verl's convention)."""

_NUM_FULL_LOGS = 5
"""Skipped rows logged one line each per dataset; later ones only in the closing count."""


class BadRowError(ValueError):
    """A dataset row that does not fit the verl layout; ``str()`` names the file and row.

    Attributes:
        reason: one of ``REJECT_REASONS`` (``too_long`` is rejected in both modes, never raised
            out of ``PromptDataset``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class DataConfig:
    """Where prompts come from and how they are rendered and filtered."""

    train_files: list[str] = field(default_factory=lambda: ["???"])
    """Parquet or jsonl files (or ``builtin:NAME/SPLIT``) in the verl row layout."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files for periodic evaluation; empty disables evaluation."""
    max_prompt_tokens: int = 512
    """Longest rendered prompt accepted, in tokens (>= 1). Longer prompts are rejected and counted."""
    on_bad_row: str = "error"
    """A malformed row (not JSON, no ``prompt``, bad messages, ...): ``error`` stops the run naming
    the file and row; ``skip`` leaves it out, logged and counted by reason (``data/rejected_rows_*``
    in the summary). Either way a file set with no usable row is an error."""
    shuffle: bool = True
    """Shuffle the train prompts each epoch with ``trainer.seed``."""
    val_max_prompts: int = 0
    """Evaluate on at most this many held-out prompts (the first ones); 0 = all."""
    image_min_pixels: int | None = None
    """Vision-language models: the smallest area (pixels) an image is resized to, keeping its aspect
    ratio; ``None`` = the model's image processor's own (``preprocessor_config.json``). More
    pixels, more image tokens per prompt."""
    image_max_pixels: int | None = None
    """Vision-language models: the largest area (pixels) an image is resized to; ``None`` = the
    image processor's own. Bounds each image's tokens (one per merged patch, 28x28 pixels for
    Qwen2-VL) within ``max_prompt_tokens``."""

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.val_max_prompts < 0:
            raise ValueError(f"data.val_max_prompts must be >= 0, got {self.val_max_prompts}")
        if not self.train_files:
            raise ValueError("data.train_files must name at least one file")
        if self.on_bad_row not in ON_BAD_ROW_MODES:
            raise ValueError(f"data.on_bad_row must be one of {ON_BAD_ROW_MODES}, got {self.on_bad_row!r}")
        for key in ("image_min_pixels", "image_max_pixels"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"data.{key} must be a positive integer (pixels) or null, got {value!r}")
        if (self.image_min_pixels is not None and self.image_max_pixels is not None
                and self.image_min_pixels > self.image_max_pixels):
            raise ValueError(f"data.image_min_pixels ({self.image_min_pixels}) exceeds data.image_max_pixels "
                             f"({self.image_max_pixels})")


@dataclass
class Prompt:
    """One validated, tokenised prompt.

    Attributes:
        prompt_ids: rendered prompt token ids (chat template with generation prompt), length <=
            ``data.max_prompt_tokens``.
        messages: the chat messages of the row.
        data_source: the row's ``data_source``.
        ground_truth: ``reward_model.ground_truth`` as a string (``None`` when absent).
        extra_info: the row's ``extra_info`` mapping (empty when absent).
        uid: stable identity ``"<file stem>:<row index>"``, used in logs and exactly-once checks.
        reference: the row's reference response (text, or a list of messages for a tool-use
            demonstration), read from the first of the dataset's ``reference_fields`` the row has;
            ``None`` when the dataset was read without any.
        reference_field: the dotted path ``reference`` came from, or ``None``.
        images: the row's images, decoded, resized and processed once (``ImageInputs``: resized
            PIL images, ``pixel_values`` float32 ``[patches, 1176]``, ``image_grid_thw`` int64
            ``[images, 3]``), in placeholder order; ``None`` for a text-only row. ``messages``
            then holds the content as parts (each ``<image>`` an ``{"type": "image"}`` part) and
            ``prompt_ids`` one placeholder token per merged patch.
    """

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: str | None
    extra_info: dict[str, Any]
    uid: str
    reference: Any = None
    reference_field: str | None = None
    images: ImageInputs | None = None


def image_processing_for(model_path: str, data_cfg: DataConfig | None = None) -> ImageProcessing | None:
    """The ``ImageProcessing`` a dataset needs for the model at ``model_path``, or ``None`` for a
    text-only model.

    A model is vision-language when its config (``AutoConfig``) has a ``vision_config``; its image
    placeholder is ``config.image_token_id`` (``image_token_index`` in LLaVA-style configs). The
    pixel bounds are ``data.image_min_pixels``/``image_max_pixels`` (``None``: the processor's).
    One function for every place that builds a ``PromptDataset``, so training, evaluation and the
    commands render images alike.

    Raises:
        ValueError: a vision config without an image token id, or a model directory without an
            image processor (``ImageProcessing``).
        OSError: ``model_path`` has no readable config.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    if not is_vision_language(config):
        return None
    token = image_token_id(config)
    if token is None:
        raise ValueError(f"{model_path}: the config has a vision_config but no image_token_id: cannot place images")
    return ImageProcessing(model_path, int(token),
                           min_pixels=data_cfg.image_min_pixels if data_cfg is not None else None,
                           max_pixels=data_cfg.image_max_pixels if data_cfg is not None else None)


def content_parts(content: Any) -> Any:
    """A message's ``content`` with each ``<image>`` turned into an image part: ``"<image>How many?"``
    -> ``[{"type": "image"}, {"type": "text", "text": "How many?"}]``; content without a
    placeholder (or already a list of parts) is returned as it is. Empty text between
    placeholders is dropped (it renders to nothing)."""
    if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
        return content
    parts: list[dict[str, str]] = []
    for k, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _valid_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    if part.get("type") == "image":
        return True
    return part.get("type") == "text" and isinstance(part.get("text"), str)


def field_value(row: dict[str, Any], dotted: str) -> Any:
    """The value at the dotted path ``dotted`` of a row, or ``None`` where the row has none.

    Each dot goes one mapping deeper: ``"reward_model.ground_truth"`` is
    ``row["reward_model"]["ground_truth"]``, ``"answer"`` is ``row["answer"]``. A part that is
    missing, or a value on the way that is not a mapping, gives ``None`` (as does a stored ``None``).

    Example::

        field_value({"reward_model": {"ground_truth": "82"}}, "reward_model.ground_truth")  # "82"
        field_value({"extra_info": {}}, "extra_info.answer")                                 # None
    """
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read all rows of a ``.parquet`` or ``.jsonl``/``.json`` file as dicts.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: for an unsupported extension or a jsonl line that is not a JSON object
            (the message names the file and the line).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix in (".jsonl", ".json"):
        return [row for _, row in read_jsonl(path)]
    raise ValueError(f"{path}: unsupported dataset format {suffix!r}; use .parquet or .jsonl")


def read_rows_or_errors(path: str | Path) -> list[dict[str, Any] | BadRowError]:
    """Every row of a dataset file in order, a jsonl line that is not a JSON object standing as
    its ``BadRowError`` (``not_json``, ``not_an_object``) instead of stopping the read.

    Raises:
        FileNotFoundError, ValueError: as ``read_rows`` for the file itself.
    """
    if Path(path).suffix.lower() in (".jsonl", ".json"):
        return [row for _, row in _jsonl_lines(path)]
    return list(read_rows(path))


def read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a JSON-lines file (1-based numbers,
    for messages that point into the file).

    Raises:
        BadRowError (a ``ValueError``): a line that is not valid JSON, or not a JSON object (names
            the file and line).
    """
    rows = []
    for lineno, row in _jsonl_lines(path):
        if isinstance(row, BadRowError):
            raise row
        rows.append((lineno, row))
    return rows


def _jsonl_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | BadRowError]]:
    # Bytes, decoded line by line: a line that is not UTF-8 is one bad row, not a failed read.
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # Recursion: absurd nesting
                yield lineno, BadRowError("not_json", f"{path}: line {lineno}: not valid JSON ({type(e).__name__}: "
                                                      f"{str(e)[:200]})")
                continue
            if not isinstance(row, dict):
                yield lineno, BadRowError("not_an_object", f"{path}: line {lineno}: expected a JSON object, "
                                                           f"got {type(row).__name__}")
                continue
            yield lineno, row


def validate_row(row: dict[str, Any], where: str) -> None:
    """Check one row against the verl layout.

    Args:
        row: the row mapping.
        where: ``"<file>: row <i>"``, prefixed to every error message.

    Raises:
        BadRowError (a ``ValueError``; ``reason`` in parentheses): ``prompt`` missing
            (``missing_prompt``), not a non-empty list (``bad_prompt``) or holding a message
            that is not a ``{"role", "content"}`` string mapping (``bad_messages``);
            ``data_source`` present but not a string (``bad_data_source``); ``reward_model``
            present but not a mapping (``bad_reward_model``); ``extra_info`` not a mapping
            (``bad_extra_info``); ``images`` present but not a list (``bad_images``).
    """
    if "prompt" not in row or row["prompt"] is None:
        raise BadRowError("missing_prompt",
                          f"{where}: missing required field 'prompt' (fields present: {sorted(map(str, row))!r:.300})")
    prompt = row["prompt"]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise BadRowError("bad_prompt",
                          f"{where}: 'prompt' must be a non-empty list of chat messages, got {type(prompt).__name__}")
    for j, msg in enumerate(prompt):
        content = msg.get("content") if isinstance(msg, dict) else None
        if (not isinstance(msg, dict) or not isinstance(msg.get("role"), str)
                or not (isinstance(content, str)
                        or (isinstance(content, (list, tuple)) and content and all(map(_valid_part, content))))):
            raise BadRowError("bad_messages", f"{where}: prompt message {j} must be a mapping with string 'role' and "
                                              f"'content' (a string, or a list of text/image parts), got {msg!r:.200}")
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise BadRowError("bad_data_source", f"{where}: 'data_source' must be a string, got {type(source).__name__}")
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        raise BadRowError("bad_reward_model",
                          f"{where}: 'reward_model' must be a mapping with 'ground_truth', got {type(rm).__name__}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise BadRowError("bad_extra_info", f"{where}: 'extra_info' must be a mapping, got {type(extra).__name__}")
    images = row.get("images")
    if images is not None and not isinstance(images, (list, tuple)):
        raise BadRowError("bad_images", f"{where}: 'images' must be a list of images, got {type(images).__name__}")


def _reference(row: dict[str, Any], fields: Sequence[str], where: str, hint: str) -> tuple[Any, str | None]:
    """``(value, field)`` of the first of ``fields`` the row has; ``(None, None)`` for no fields."""
    for dotted in fields:
        value = field_value(row, dotted)
        if value is not None:
            return value, dotted
    if not fields:
        return None, None
    names = " or ".join(repr(f) for f in fields)
    raise BadRowError("no_reference", f"{where}: no {names} field{' (' + hint + ')' if hint else ''}")


def render_prompt(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template with the generation prompt."""
    out = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
    # transformers >= 5 returns a BatchEncoding here; older versions a plain list.
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _with_images(ids: list[int], raw: list[Any], base_dir: Path,
                 images: ImageProcessing) -> tuple[list[int], ImageInputs | None]:
    """``(prompt ids with each placeholder expanded, processed images)`` of a rendered row;
    ``(ids, None)`` for a row with neither images nor placeholders.

    The placeholders are counted before any image is decoded (a mismatch costs no decoding), and
    in the rendered ids, so a placeholder token written literally in a text part counts too.

    Raises:
        BadImageError: any of ``BAD_IMAGE_REASONS``.
    """
    placeholders = sum(1 for t in ids if t == images.image_token_id)
    if placeholders != len(raw):
        raise BadImageError("image_count_mismatch", f"the prompt has {placeholders} image placeholder(s) "
                                                    f"for {len(raw)} image(s)")
    if not raw:
        return ids, None
    inputs = images.process([decode_image(value, base_dir) for value in raw])
    return expand_image_tokens(ids, inputs, images.image_token_id), inputs


class PromptDataset:
    """Validated, tokenised prompts from one or more files, iterated in seeded epochs.

    Args:
        files: dataset paths (already resolved; see ``async_rl.data.builtin.resolve``).
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_prompt_tokens: longest accepted rendered prompt, in tokens.
        seed: seed of the per-epoch permutation.
        shuffle: permute each epoch (else file order).
        limit: keep at most this many accepted prompts (0 = all).
        tools: tool schemas rendered into each prompt by the chat template (multi-turn tool
            use); their tokens count towards ``max_prompt_tokens``.
        reference_fields: dotted paths (``field_value``) of each row's reference response, tried
            in order; the first one the row has becomes ``Prompt.reference``. Empty: none read.
        reference_hint: what the reference is for and which config key names its field,
            appended to the error of a row that has none of ``reference_fields``.
        on_bad_row: ``"error"`` (raise at the first malformed row) or ``"skip"`` (log it, count it
            in ``rejected`` under its ``BadRowError.reason`` and read on); ``data.on_bad_row``.
        images: the model's image processing (``image_processing_for``) for rows with
            ``images``; ``None`` for a text-only model, which refuses such rows.

    Attributes:
        reference_sources: ``{dotted path: accepted rows whose reference came from it}``.
        rejected: ``{reason: rows}`` for every row left out, reasons from ``REJECT_REASONS``
            (``too_long`` and the image reasons included); only reasons that occurred.
        num_rejected_too_long: ``rejected.get("too_long", 0)``.

    Raises:
        ValueError: an unknown ``on_bad_row``; with ``on_bad_row="error"`` a malformed row
            (``BadRowError``, naming the file and row, or the row without any of
            ``reference_fields`` and the fields); no prompt left after filtering (the message
            counts the rows rejected by reason); a row with images and ``images=None`` (one line
            naming the file and the model), in both modes.
    """

    def __init__(self, files: list[str], tokenizer, max_prompt_tokens: int, seed: int = 0,
                 shuffle: bool = True, limit: int = 0, tools: list[dict] | None = None,
                 reference_fields: Sequence[str] = (), reference_hint: str = "",
                 on_bad_row: str = "error", images: ImageProcessing | None = None) -> None:
        if on_bad_row not in ON_BAD_ROW_MODES:
            raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW_MODES}, got {on_bad_row!r}")
        self.prompts: list[Prompt] = []
        self._sources: dict[str, str] | None = None
        self._distinct_sources: list[str] | None = None
        self.rejected: dict[str, int] = {}
        self.reference_sources: dict[str, int] = {}
        for file in files:
            for i, row in enumerate(read_rows_or_errors(file) if on_bad_row == "skip" else read_rows(file)):
                where = f"{file}: row {i} (0-based)"
                try:
                    prompt = self._prompt(row, file, i, where, tokenizer, tools, max_prompt_tokens,
                                          reference_fields, reference_hint, images)
                except BadRowError as e:
                    if on_bad_row == "error" and e.reason not in ALWAYS_COUNTED_REASONS:
                        raise
                    self._reject(e.reason, "%s", e)
                    continue
                if prompt.reference_field is not None:
                    self.reference_sources[prompt.reference_field] = (
                        self.reference_sources.get(prompt.reference_field, 0) + 1)
                self.prompts.append(prompt)
                if limit and len(self.prompts) >= limit:
                    break
            if limit and len(self.prompts) >= limit:
                break
        if not self.prompts:
            raise ValueError(f"no usable prompt in {files} (rows rejected: {self.describe_rejected() or 'none'})")
        if self.rejected:
            logger.warning("%s: rows rejected: %s", files, self.describe_rejected())
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    @staticmethod
    def _prompt(row: dict[str, Any] | BadRowError, file: str, i: int, where: str, tokenizer,
                tools: list[dict] | None, max_prompt_tokens: int, reference_fields: Sequence[str],
                reference_hint: str, images: ImageProcessing | None = None) -> Prompt:
        """The ``Prompt`` of one row.

        Raises:
            BadRowError: the row is malformed (``row`` itself when the reader could not parse it),
                its images are unusable (an image reason, checked after the template), or its
                prompt is too long (reason ``too_long``, image tokens counted, checked before the
                reference).
            ValueError: the row has images and ``images`` is ``None`` (a text-only model).
        """
        if isinstance(row, BadRowError):
            raise row
        validate_row(row, where)
        raw_images = list(row.get("images") or [])
        messages = list(row["prompt"])
        if raw_images:
            if images is None:
                raise ValueError(f"{file}: rows with images (row {i} holds {len(raw_images)}), but the model "
                                 f"{getattr(tokenizer, 'name_or_path', '') or '(unnamed)'!r} is text-only (its config "
                                 f"has no vision_config); use a vision-language model or a dataset without images")
        if images is not None and row.get("images") is not None:
            # As verl: a row with an images column has its <image> markers converted, so one with
            # an empty list and a marker is a counted mismatch, not the literal text "<image>".
            messages = [{**m, "content": content_parts(m["content"])} for m in messages]
        try:
            ids = render_prompt(tokenizer, messages, tools)
        except Exception as e:  # jinja's TemplateError and friends: a template may refuse any role or order
            raise BadRowError("template_error", f"{where}: the chat template refused the prompt messages "
                                                f"({type(e).__name__}: {str(e)[:200]})") from e
        inputs = None
        if images is not None:
            try:
                ids, inputs = _with_images(ids, raw_images, Path(file).parent, images)
            except BadImageError as e:
                raise BadRowError(e.reason, f"{where}: {e.reason}: {e}; rejected") from e
        if len(ids) > max_prompt_tokens:
            raise BadRowError("too_long", f"{where}: prompt of {len(ids)} tokens exceeds "
                                          f"data.max_prompt_tokens={max_prompt_tokens}; rejected")
        rm = row.get("reward_model") or {}
        gt = rm.get("ground_truth")
        reference, reference_field = _reference(row, reference_fields, where, reference_hint)
        return Prompt(
            prompt_ids=ids,
            messages=messages,
            data_source=row.get("data_source") or "unknown",
            ground_truth=None if gt is None else str(gt),
            extra_info=dict(row.get("extra_info") or {}),
            uid=f"{Path(file).stem}:{i}",
            reference=reference,
            reference_field=reference_field,
            images=inputs,
        )

    def _reject(self, reason: str, fmt: str, *args: Any) -> None:
        """Count one rejected row under ``reason``; log the first ``_NUM_FULL_LOGS`` of each."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if self.rejected[reason] <= _NUM_FULL_LOGS:
            logger.warning(fmt, *args)

    @property
    def num_rejected_too_long(self) -> int:
        """Rows whose rendered prompt exceeded ``max_prompt_tokens``."""
        return self.rejected.get("too_long", 0)

    def summary(self) -> dict[str, int]:
        """The run summary's entries: ``data/rejected_prompts_too_long`` always,
        ``data/rejected_rows`` (malformed rows skipped, all reasons but ``too_long``) always, and
        ``data/rejected_rows_<reason>`` for each reason that occurred (reduction: sum over files)."""
        bad = {r: n for r, n in self.rejected.items() if r != "too_long"}
        return {"data/rejected_prompts_too_long": self.num_rejected_too_long, "data/rejected_rows": sum(bad.values()),
                **{f"data/rejected_rows_{r}": n for r, n in sorted(bad.items())}}

    def describe_rejected(self) -> str:
        """``"not_json 2, too_long 1"``: the rejected rows by reason, or ``""`` for none."""
        return ", ".join(f"{reason} {n}" for reason, n in sorted(self.rejected.items()))

    def __len__(self) -> int:
        return len(self.prompts)

    def source_of(self, uid: str) -> str:
        """The ``data_source`` of the prompt ``uid`` (``Prompt.uid``).

        Raises:
            KeyError: no prompt of this dataset has that uid.
        """
        return self._source_map()[uid]

    @property
    def sources(self) -> list[str]:
        """The distinct ``data_source`` values of the prompts, sorted."""
        if self._distinct_sources is None or len(self._source_map()) != len(self.prompts):
            self._distinct_sources = sorted(set(self._source_map().values()))
        return self._distinct_sources

    def _source_map(self) -> dict[str, str]:
        if self._sources is None or len(self._sources) != len(self.prompts):
            self._sources = {p.uid: p.data_source for p in self.prompts}
        return self._sources

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts, crossing into the next epoch (re-permuted) when one runs out."""
        out = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        return out

    def __iter__(self) -> Iterator[Prompt]:
        """Iterate once over all prompts in file order (used for evaluation)."""
        return iter(self.prompts)

    def state_dict(self) -> dict[str, int]:
        """Position in the stream: ``{"epoch", "position"}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by ``state_dict``."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
