"""A multi-turn verifiers taskset for the tests, written with the library's own classes
(``verifiers.v1``): guess a number in 1..4 in at most three replies, told "higher" or "lower"
after a wrong one. Imported by the verifiers worker, in the verifiers venv
(``tests/test_endpoint.py``)."""

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    """One game: the secret (and the answer the run's rows carry)."""

    secret: int
    answer: str


class GuessTask(vf.Task[GuessData]):
    """Reward 1 when the last reply is the secret."""

    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.secret))

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessConfig(vf.TasksetConfig):
    """``split`` picks the secrets' order; ``size`` the number of games."""

    split: str = "train"
    size: int = 4


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        shift = 0 if self.config.split == "train" else 2
        return [GuessTask(GuessData(idx=i, prompt="Guess my number (1-4). Reply with the number only.",
                                    secret=1 + (i + shift) % 4, answer=str(1 + (i + shift) % 4)), self.config.task)
                for i in range(self.config.size)]


class GuessEnv(vf.SingleAgentEnv):
    """The game's loop: the model answers the prompt, then each hint, three replies at most."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as it:
            segment = await it.turn()
            for _ in range(2):
                if segment.terminated:
                    break
                guess = segment.last_reply.strip()
                if guess == str(task.data.secret):
                    break
                segment = await it.turn("higher" if guess.isdigit() and int(guess) < task.data.secret else "lower")


__all__ = ["GuessTaskset", "GuessEnv"]
