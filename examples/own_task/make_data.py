"""Write this example's data: made-up words to spell in capitals, in the verl row layout.

    python examples/own_task/make_data.py        # writes train.jsonl (40 rows) and test.jsonl (20 rows)

Each row is one JSON object per line::

    {"data_source": "own_task/uppercase",
     "prompt": [{"role": "user", "content": "Uppercase: gga"}],
     "ability": "spelling",
     "reward_model": {"style": "rule", "ground_truth": "GGA"},
     "extra_info": {"split": "train", "index": 0, "word": "gga"}}

``reward_model.ground_truth`` is both what ``reward.py`` compares the answer with and, as the rows
have no ``extra_info.answer``, the reference response of the supervised warm start
(``trainer.warm_start.response_field`` unset). The words are three letters from ``a`` to ``j``
(a small alphabet, so 40 rows show the tiny model every letter at every place several times and it
can learn the rule, not only the 40 answers), drawn with a fixed seed, so the files are the same
on every machine; the test words never occur in the train split.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA_SOURCE = "own_task/uppercase"
NUM_TRAIN, NUM_TEST = 40, 20
SEED = 0
LETTERS = "abcdefghij"


def make_row(word: str, split: str, index: int) -> dict:
    """One verl-layout row asking for ``word`` in capitals."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"Uppercase: {word}"}],
        "ability": "spelling",
        "reward_model": {"style": "rule", "ground_truth": word.upper()},
        "extra_info": {"split": split, "index": index, "word": word},
    }


def make_words(n: int, seed: int = SEED) -> list[str]:
    """``n`` distinct three-letter words over ``LETTERS``, in a fixed order for a fixed seed."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < n:
        word = "".join(rng.choice(LETTERS) for _ in range(3))
        if word not in words:
            words.append(word)
    return words


def main(out_dir: Path = Path(__file__).resolve().parent) -> None:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``out_dir``."""
    words = make_words(NUM_TRAIN + NUM_TEST)
    for split, chunk in (("train", words[:NUM_TRAIN]), ("test", words[NUM_TRAIN:])):
        with (out_dir / f"{split}.jsonl").open("w") as f:
            for i, word in enumerate(chunk):
                f.write(json.dumps(make_row(word, split, i)) + "\n")


if __name__ == "__main__":
    main()
