"""What the tests of the built-in worked-answer tasks (chain sums, skip counting) share."""

from __future__ import annotations

from async_rl.data.builtin import TINY_QWEN2_SPEC


def assert_row_fits(tokenizer, row: dict, max_prompt: int, max_response: int) -> None:
    """Assert that ``row`` (a verl-layout row with ``extra_info.answer``) fits a job's budgets:
    its prompt with the chat template in ``max_prompt`` tokens, its answer plus EOS in
    ``max_response``, and both together in the tiny model's positions."""
    prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    prompt_len = len(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    response_len = len(tokenizer(row["extra_info"]["answer"], add_special_tokens=False)["input_ids"]) + 1
    assert prompt_len <= max_prompt and response_len <= max_response, (prompt_len, response_len)
    assert max_prompt + max_response <= TINY_QWEN2_SPEC["max_position_embeddings"]
