"""The guessing game as a verifiers taskset (``verifiers.v1``: tasks, a reward, a multi-turn ``Env``).

The game of ``examples/openenv_guess`` in verifiers' own classes: the task states a range, the
model answers with one number, and the environment answers a wrong guess with the range the
answers so far leave ("4 is wrong: it is between 5 and 8."), for at most ``turns`` guesses; the
reward is 1 for a game won. Each task also carries a demonstration for async-rl's supervised warm
start (``demonstration``: a player who reads every answer but halves the range only part of the
time, guessing its low end otherwise), which the run's rows take as ``extra_info.demonstration``.

It runs in the verifiers venv (``envs/verifiers/build.sh``), loaded by async-rl's verifiers worker
as verifiers' own tools load it (``load_environment`` of the taskset id ``guess_taskset``, with
``examples/verifiers_guess`` on the path); it imports nothing of async-rl.
"""

import random
import re

import verifiers.v1 as vf


def instruction(low: int, high: int) -> str:
    """The game's first message."""
    return (f"I am thinking of a number between {low} and {high}. Guess it: answer with one number. "
            "I will tell you where it is.")


def narrow(low: int, high: int, guess: int, secret: int) -> tuple[int, int]:
    """The range still holding ``secret`` once the wrong ``guess`` is answered."""
    return (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))


def answer(guess: int, low: int, high: int) -> str:
    """The answer to a wrong ``guess``, with the range ``[low, high]`` that holds the secret."""
    return f"{guess} is wrong: it is between {low} and {high}."


def demonstration(secret: int, turns: int, low: int, high: int, slip: float, rng: random.Random) -> list[dict]:
    """The messages after the instruction of a game played by halving the range, each guess with
    probability ``slip`` the range's low end instead, up to the right guess or ``turns`` guesses."""
    messages = []
    while len(messages) < 2 * turns - 1:
        guess = low if rng.random() < slip else (low + high) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return messages
        low, high = narrow(low, high, guess, secret)
        messages.append({"role": "user", "content": answer(guess, low, high)})
    return messages[:-1]  # a lost game's last answer: nothing follows it to train on


class GuessData(vf.TaskData):
    """One game: its secret, its answer (the secret as text) and a demonstration."""

    secret: int
    answer: str
    low: int
    high: int
    turns: int
    demonstration: list[dict]


class GuessTask(vf.Task[GuessData]):
    """Reward 1 for a game won: the last reply's first number is the secret."""

    @vf.reward(weight=1.0)
    async def won(self, trace: vf.Trace) -> float:
        found = re.search(r"-?\d+", trace.last_reply or "")
        return float(found is not None and int(found.group()) == self.data.secret)

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessConfig(vf.TasksetConfig):
    """The split (``train``: ``size`` games, else ``val_size``), the range, the guesses allowed
    and the demonstrations' slip."""

    split: str = "train"
    size: int = 512
    val_size: int = 256
    low: int = 1
    high: int = 8
    turns: int = 3
    slip: float = 0.5


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    """The games of a split: secrets in turn through the range; a task's demonstration is fixed by
    its split and index."""

    def load(self) -> list[GuessTask]:
        c = self.config
        count = c.size if c.split == "train" else c.val_size
        tasks = []
        for k in range(count):
            secret = c.low + k % (c.high - c.low + 1)
            rng = random.Random(f"{c.split}:{k}")
            data = GuessData(idx=k, prompt=instruction(c.low, c.high), secret=secret, answer=str(secret), low=c.low,
                             high=c.high, turns=c.turns,
                             demonstration=demonstration(secret, c.turns, c.low, c.high, c.slip, rng))
            tasks.append(GuessTask(data, c.task))
        return tasks


class GuessEnv(vf.SingleAgentEnv):
    """The game's loop: the model answers the instruction, then each answer, ``turns`` guesses at most."""

    async def run(self, task, agents):
        data = task.data
        low, high = data.low, data.high
        async with agents.agent.interaction(task) as it:
            segment = await it.turn()
            for _ in range(data.turns - 1):
                if segment.terminated:
                    break
                found = re.search(r"-?\d+", segment.last_reply or "")
                if found is None:
                    reply = f"Answer with one number between {data.low} and {data.high}."
                else:
                    guess = int(found.group())
                    if guess == data.secret:
                        break
                    low, high = narrow(low, high, guess, data.secret)
                    reply = answer(guess, low, high)
                segment = await it.turn(reply)


__all__ = ["GuessTaskset", "GuessEnv"]
