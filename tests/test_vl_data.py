"""Image prompts in the verl layout: the built-in shapes task through ``PromptDataset`` with the tiny
Qwen2-VL, bad images as counted rejections (parquet and jsonl, both ``on_bad_row`` modes, a
seeded fuzz over corrupted PNG bytes), the text-only model's refusal and the new config keys."""

from __future__ import annotations

import io
import json
import logging
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from async_rl.data.builtin import SHAPES_DATA_SOURCE, resolve
from async_rl.data.dataset import REJECT_REASONS, DataConfig, PromptDataset, content_parts, image_processing_for, \
    read_rows
from async_rl.data.images import BAD_IMAGE_REASONS
from async_rl.data.shapes import blind_accuracy, draw_scene, render_png
from async_rl.rewards import default_reward_for

IMAGE_TOKEN = 264


@pytest.fixture(scope="module")
def vl_model():
    return resolve("builtin:tiny-qwen2-vl")


@pytest.fixture(scope="module")
def vl_tokenizer(vl_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_model)


@pytest.fixture(scope="module")
def vl_images(vl_model):
    return image_processing_for(vl_model, DataConfig())


def _png(seed: int = 0) -> bytes:
    return render_png(draw_scene(random.Random(seed)))


def _row(content="<image>How many shapes?", images=None, gt="3"):
    row = {"prompt": [{"role": "user", "content": content}], "data_source": SHAPES_DATA_SOURCE,
           "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"answer": gt}}
    if images is not None:
        row["images"] = images
    return row


# ----------------------------------------------------------------------------------- the built-in task
def test_shapes_task_layout_splits_and_blind_guess():
    train, test = read_rows(resolve("builtin:shapes/train")), read_rows(resolve("builtin:shapes/test"))
    assert 1900 <= len(train) <= 2100 and 180 <= len(test) <= 220
    row = train[0]
    assert row["data_source"] == SHAPES_DATA_SOURCE
    assert row["prompt"][0]["content"].count("<image>") == 1 and len(row["images"]) == 1
    assert row["extra_info"]["answer"] == row["reward_model"]["ground_truth"]
    from PIL import Image

    sides = {Image.open(io.BytesIO(r["images"][0]["bytes"])).size for r in train[:200]}
    assert sides <= {(56, 56), (84, 84)} and len(sides) == 2
    # Held out: no (picture, question) pair of the test split is trained on.
    pairs = {(r["images"][0]["bytes"], r["prompt"][0]["content"]) for r in train}
    assert not any((r["images"][0]["bytes"], r["prompt"][0]["content"]) in pairs for r in test)
    # Every kind of question, each answer equally often; a guess blind to the picture is far from 100%.
    kinds = Counter(r["extra_info"]["question_type"] for r in train)
    assert set(kinds) == {"count", "colour", "shape"} and max(kinds.values()) - min(kinds.values()) <= 1
    counts = Counter(r["reward_model"]["ground_truth"] for r in train if r["extra_info"]["question_type"] == "count")
    assert set(counts) == {"1", "2", "3", "4"} and max(counts.values()) - min(counts.values()) <= 1
    assert blind_accuracy(test, fit_rows=train) < 0.35 and blind_accuracy(train) < 0.35
    # The reward is found by data_source, and is an exact word match.
    reward = default_reward_for(SHAPES_DATA_SOURCE)
    assert reward(SHAPES_DATA_SOURCE, " Red<|im_end|>", "red", None)["score"] == 1.0
    assert reward(SHAPES_DATA_SOURCE, "red.", "red", None)["score"] == 0.0


def test_shapes_rows_are_deterministic(tmp_path):
    from async_rl.data.shapes import build_shapes

    build_shapes(tmp_path)
    again = read_rows(tmp_path / "test.parquet")
    assert again == read_rows(resolve("builtin:shapes/test"))


def test_shapes_load_with_images_processed_once_and_tokens_expanded(vl_tokenizer, vl_images):
    files = [resolve("builtin:shapes/test")]
    ds = PromptDataset(files, vl_tokenizer, 64, images=vl_images, reference_fields=("extra_info.answer",))
    assert len(ds) == len(read_rows(files[0])) and not ds.rejected
    for p in ds.prompts[:20]:
        inputs = p.images
        assert inputs is not None and len(inputs.images) == 1
        n = inputs.tokens_per_image[0]
        assert 4 <= n <= 9  # 56x56 -> 2x2 merged patches, 84x84 -> 3x3
        assert p.prompt_ids.count(IMAGE_TOKEN) == n
        assert inputs.pixel_values.dtype == np.float32 and inputs.pixel_values.shape == (4 * n, 1176)
        assert inputs.image_grid_thw.dtype == np.int64 and inputs.image_grid_thw.tolist()[0][0] == 1
        assert p.messages[0]["content"][0] == {"type": "image"}  # <image> became an image part
        assert p.reference == p.ground_truth
    # The token count includes the image tokens: a limit between the text and the whole rejects it.
    longest = max(ds.prompts, key=lambda p: len(p.prompt_ids))
    text_only = len(longest.prompt_ids) - longest.prompt_ids.count(IMAGE_TOKEN) + 1
    tight = PromptDataset(files, vl_tokenizer, len(longest.prompt_ids) - 1, images=vl_images)
    assert tight.rejected.get("too_long", 0) >= 1 and len(tight) < len(ds)
    assert text_only < len(longest.prompt_ids) - 1


def test_pixel_bounds_change_the_image_tokens(vl_model, vl_tokenizer):
    small = image_processing_for(vl_model, DataConfig(image_max_pixels=28 * 28))
    ds = PromptDataset([resolve("builtin:shapes/test")], vl_tokenizer, 64, images=small, limit=10)
    assert all(p.images.tokens_per_image == [1] for p in ds.prompts)


def test_content_parts_and_list_content(tmp_path, vl_tokenizer, vl_images):
    assert content_parts("a<image>b<image>") == [{"type": "text", "text": "a"}, {"type": "image"},
                                                {"type": "text", "text": "b"}, {"type": "image"}]
    assert content_parts("no image") == "no image"
    parts = [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": "count"}]
    png = _png()
    rows = [_row(parts, [png]), _row("<image><image>two", [png, _png(1)]), _row("plain text", [])]
    f = tmp_path / "parts.jsonl"
    (tmp_path / "a.png").write_bytes(png)
    (tmp_path / "b.png").write_bytes(_png(1))
    rows[0]["images"], rows[1]["images"] = ["a.png"], ["a.png", "b.png"]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    ds = PromptDataset([str(f)], vl_tokenizer, 128, images=vl_images)
    assert [len(p.images.images) if p.images else 0 for p in ds.prompts] == [1, 2, 0]
    assert ds.prompts[1].prompt_ids.count(IMAGE_TOKEN) == sum(ds.prompts[1].images.tokens_per_image)
    assert ds.prompts[2].images is None and IMAGE_TOKEN not in ds.prompts[2].prompt_ids


# ----------------------------------------------------------------------------------- bad images
def _tiff(mode: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (40, 40), 7).save(buf, format="TIFF")
    return buf.getvalue()


def _bad_cases(png: bytes) -> list[tuple[str, dict]]:
    """``(expected reason, row)`` for each kind of bad image; paths relative to the data file."""
    return [
        ("image_not_decodable", _row(images=[png[:8] + b"\x00" * 40 + png[48:]])),
        ("image_not_decodable", _row(images=[png[: len(png) // 2]])),
        ("image_not_decodable", _row(images=[random.Random(5).randbytes(300)])),
        ("image_missing_path", _row(images=["no/such.png"])),
        ("image_not_decodable", _row(images=["notes.txt"])),
        ("image_bad_type", _row(images=[7])),
        ("image_bad_type", _row(images=[None])),
        ("image_bad_type", _row(images=[["x.png"]])),
        ("image_bad_mode", _row(images=["int32.tiff"])),
        ("image_bad_mode", _row(images=["float.tiff"])),
        ("image_count_mismatch", _row("How many shapes?", images=["good.png"])),
        ("image_count_mismatch", _row("<image><image>How many shapes?", images=["good.png"])),
    ]


def _write(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("mode", ["error", "skip"])
def test_bad_images_are_counted_rejections(tmp_path, vl_tokenizer, vl_images, suffix, mode, caplog):
    png = _png()
    (tmp_path / "good.png").write_bytes(png)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "int32.tiff").write_bytes(_tiff("I"))
    (tmp_path / "float.tiff").write_bytes(_tiff("F"))
    cases = _bad_cases(png)
    rows = []
    for _, bad in cases:
        rows += [_row(images=["good.png"]), bad]
    rows.append(_row(images=["good.png"]))
    if suffix == ".jsonl":
        # JSON holds no bytes: the byte cases are written as files next to the data file.
        for k, row in enumerate(rows):
            if isinstance(row["images"][0], bytes):
                (tmp_path / f"bytes{k}.bin").write_bytes(row["images"][0])
                row["images"] = [f"bytes{k}.bin"]
    files = [tmp_path / f"data{suffix}"]
    if suffix == ".parquet":
        # A parquet column holds one type: every image as a {"bytes", "path"} struct (Hugging
        # Face's Image feature); the wrong types in files of their own, as list<int64> (an int
        # and a null) and list<list<string>>.
        wrong = [r for r in rows if not isinstance(r["images"][0], (bytes, str))]
        rows = [{**r, "images": [{"bytes": v, "path": None} if isinstance(v, bytes) else {"bytes": None, "path": v}
                                 for v in r["images"]]} for r in rows if r not in wrong]
        files += [tmp_path / "ints.parquet", tmp_path / "nested.parquet"]
        _write(files[1], [r for r in wrong if not isinstance(r["images"][0], list)])
        _write(files[2], [r for r in wrong if isinstance(r["images"][0], list)])
        assert pa.types.is_integer(pq.read_schema(files[1]).field("images").type.value_type)
    _write(files[0], rows)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset([str(f) for f in files], vl_tokenizer, 128, images=vl_images, on_bad_row=mode)
    want = Counter(reason for reason, _ in cases)
    assert ds.rejected == dict(want)
    assert len(ds) == len(rows) - (sum(want.values()) if suffix == ".jsonl" else len(cases) - 3)
    assert all(p.images is not None for p in ds.prompts)
    summary = ds.summary()
    assert summary["data/rejected_rows"] == sum(want.values())
    for reason, n in want.items():
        assert reason in REJECT_REASONS and summary[f"data/rejected_rows_{reason}"] == n
    assert "image_count_mismatch" in caplog.text


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_images_not_a_list_follows_on_bad_row(tmp_path, vl_tokenizer, vl_images, mode):
    f = tmp_path / "d.jsonl"
    _write(f, [_row("plain", images=[]), _row(images="good.png"), _row("x", images=[])])
    if mode == "error":
        with pytest.raises(ValueError, match=r"d.jsonl: row 1 \(0-based\): 'images' must be a list"):
            PromptDataset([str(f)], vl_tokenizer, 64, images=vl_images, on_bad_row=mode)
    else:
        ds = PromptDataset([str(f)], vl_tokenizer, 64, images=vl_images, on_bad_row=mode)
        assert ds.rejected == {"bad_images": 1} and len(ds) == 2


def test_corrupted_png_fuzz_loads_or_is_a_counted_rejection(tmp_path, vl_tokenizer, vl_images):
    rng = random.Random(1234)
    png = _png(3)
    rows = []
    for _ in range(150):
        b = bytearray(png)
        how = rng.choice(["flip", "truncate", "splice", "chunk"])
        if how == "flip":
            for _ in range(rng.randint(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif how == "truncate":
            b = b[: rng.randrange(len(b))]
        elif how == "splice":
            at = rng.randrange(len(b))
            b[at: at + rng.randint(1, 16)] = rng.randbytes(rng.randint(0, 16))
        else:  # the IHDR size or the first chunk's length: headers claiming absurd sizes
            at = rng.choice([8, 16, 20])
            b[at: at + 4] = rng.randbytes(4)
        rows.append(_row(images=[{"bytes": bytes(b), "path": None}]))
    f = tmp_path / "fuzz.parquet"
    _write(f, rows)
    for mode in ("error", "skip"):
        ds = PromptDataset([str(f)], vl_tokenizer, 128, images=vl_images, on_bad_row=mode)
        assert len(ds) + sum(ds.rejected.values()) == len(rows)  # nothing dropped silently
        assert set(ds.rejected) <= set(BAD_IMAGE_REASONS) and ds.rejected
        assert all(p.prompt_ids.count(IMAGE_TOKEN) == sum(p.images.tokens_per_image) for p in ds.prompts)


def test_decompression_bomb_header_is_not_decodable():
    import struct
    import zlib

    from async_rl.data.images import BadImageError, decode_image

    png = bytearray(_png())
    ihdr = bytearray(png[16:29])
    ihdr[0:8] = struct.pack(">II", 30000, 30000)
    png[16:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(ihdr)))
    with pytest.raises(BadImageError) as e:
        decode_image(bytes(png))
    assert e.value.reason == "image_not_decodable"


# ----------------------------------------------------------------------------------- models, config
def test_text_model_refuses_images_in_one_line(tmp_path, tiny_tokenizer):
    assert image_processing_for(resolve("builtin:tiny-qwen2")) is None
    f = tmp_path / "vl.parquet"
    _write(f, [_row("plain", images=[]), _row(images=[{"bytes": _png(), "path": None}])])
    for mode in ("error", "skip"):
        with pytest.raises(ValueError) as e:
            PromptDataset([str(f)], tiny_tokenizer, 64, on_bad_row=mode)
        msg = str(e.value)
        assert "\n" not in msg and str(f) in msg and "text-only" in msg and "tiny-qwen2" in msg


def test_image_pixel_keys_are_validated():
    assert DataConfig(image_min_pixels=784, image_max_pixels=784).image_max_pixels == 784
    for bad in ({"image_min_pixels": 0}, {"image_max_pixels": -5}, {"image_min_pixels": 1.5},
                {"image_min_pixels": True}, {"image_min_pixels": 2000, "image_max_pixels": 1000}):
        with pytest.raises(ValueError, match="data.image_m"):
            DataConfig(**bad)


def test_marker_in_a_row_without_images_column(tmp_path, vl_tokenizer, vl_images):
    """A row with an (empty) images value converts its markers, so a marker without an image is a
    mismatch; a row with no images value at all keeps ``<image>`` as text."""
    f = tmp_path / "m.jsonl"
    _write(f, [_row("<image>count", images=[]), _row("<image>count")])
    ds = PromptDataset([str(f)], vl_tokenizer, 64, images=vl_images)
    assert ds.rejected == {"image_count_mismatch": 1} and len(ds) == 1
    assert ds.prompts[0].messages[0]["content"] == "<image>count" and ds.prompts[0].images is None
