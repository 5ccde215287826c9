"""The verifiers worker: runs episodes of a ``verifiers`` environment against the policy endpoint.

Run by ``async_rl.endpoint.verifiers`` with the Python of the venv that holds ``verifiers``
(``envs/verifiers/build.sh`` builds ``.venv-verifiers``; verifiers 0.4.0 needs ``openai<3``,
which the main venv's vLLM does not allow), as ``python verifiers_worker.py``. It imports nothing
of async-rl: only the standard library and ``verifiers.v1``.

Protocol: one JSON object per line on stdin, one answer per line on stdout (logs go to stderr).

- ``{"op": "load", "taskset": ID, "args": {...}, "harness_args": {...}}``: load the environment
  as its users do (``verifiers.v1.load_environment`` of ``resolve_env_config``: the taskset module
  ``ID`` with its config fields ``args``); answers ``{"ok": true}`` or ``{"error": ...}``.
- ``{"op": "rows", "split": S}``: the taskset's rows (``split`` is set in the taskset's config
  when its config has that field): ``{"rows": [{"index", "prompt", "answer", "info"}]}``.
- ``{"op": "run", "id": K, "split": S, "index": I, "base_url": URL, "api_key": KEY, "model": M}``:
  one episode of row ``I`` against the OpenAI-compatible server at ``URL``, scored by the
  taskset's own rewards: ``{"id": K, "ok", "reward", "rewards": {name: score}, "metrics", "errors"}``.
  Runs concurrently with other ``run`` requests.

The agent is an in-process chat harness (``async_rl_chat``, defined here): each model segment is
one chat-completions call through verifiers' interception server, so every model call of the
episode goes to the policy endpoint, and nothing is installed or downloaded at rollout time
(verifiers' own ``null`` harness runs ``uv sync`` on a script per segment). Tools offered by the
taskset are passed to the model; their calls are answered by the taskset's toolsets through the
interception server.
"""

import asyncio
import json
import os
import sys
import traceback
import types

# Run as a script, this file's folder leads sys.path, and async-rl's own ``verifiers.py`` beside it
# would shadow the library.
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]

HARNESS_MODULE = "async_rl_chat"
KEY_VAR = "ASYNC_RL_POLICY_KEY"


def _harness_module():
    """The in-process chat harness, as a module verifiers can resolve by id."""
    from openai import AsyncOpenAI

    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import message_to_wire

    class AsyncRLChatConfig(vf.HarnessConfig):
        pass

    http: list = []  # one HTTP client for every episode: a TLS context costs about 25 ms to build

    class AsyncRLChat(vf.Harness[AsyncRLChatConfig]):
        """One non-streaming chat call per model segment, in this process."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
            import httpx

            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            messages += ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                         else [message_to_wire(m) for m in (prompt or [])])
            if not http:
                # No read limit (a turn waits for the engine's batch); a generous connect limit,
                # since hundreds of episodes open their connections at once on a busy loop.
                http.append(httpx.AsyncClient(timeout=httpx.Timeout(None, connect=120.0),
                                              limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)))
            # Two retries: a kept-alive connection the interception server closed as it was reused
            # fails the call before it reaches the endpoint (seen under load as "Connection error").
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=2, http_client=http[0])
            await client.chat.completions.create(model=ctx.model, messages=messages)
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    module = types.ModuleType(HARNESS_MODULE)
    module.AsyncRLChat, module.AsyncRLChatConfig = AsyncRLChat, AsyncRLChatConfig
    module.__all__ = ["AsyncRLChat", "AsyncRLChatConfig"]
    return module


class Worker:
    """The environments of one taskset (one per split) and the episodes running on them."""

    def __init__(self) -> None:
        self.taskset = None
        self.args: dict = {}
        self.envs: dict = {}
        self.out_lock = asyncio.Lock()

    def env(self, split: str):
        import verifiers.v1 as vf

        if split not in self.envs:
            args = dict(self.args)
            config = vf.resolve_env_config({"taskset": {"id": self.taskset}, "agent": {"harness": {"id": HARNESS_MODULE},
                                                                                     "runtime": {"type": "subprocess"}}})
            fields = type(config.taskset).model_fields
            if "split" in fields:
                args["split"] = split
            config = vf.resolve_env_config({"taskset": {"id": self.taskset, **args},
                                            "agent": {"harness": {"id": HARNESS_MODULE},
                                                      "runtime": {"type": "subprocess"}}})
            self.envs[split] = vf.load_environment(config)
        return self.envs[split]

    async def answer(self, reply: dict) -> None:
        async with self.out_lock:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()

    def rows(self, split: str) -> list[dict]:
        import verifiers.v1 as vf

        base = set(vf.TaskData.model_fields) - {"prompt", "answer"}  # the library's own fields (timeouts, ...)
        out = []
        for index, task in enumerate(self.env(split).taskset):
            data = {k: v for k, v in task.data.model_dump(mode="json").items() if k not in base}
            prompt = data.pop("prompt", None)
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            answer = data.pop("answer", None)
            out.append({"index": index, "prompt": prompt or [], "answer": None if answer is None else str(answer),
                        "info": data})
        return out

    async def run(self, request: dict) -> dict:
        import verifiers.v1 as vf

        env = self.env(request.get("split", "train"))
        task = list(env.taskset)[int(request["index"])]
        os.environ[KEY_VAR] = request["api_key"]  # verifiers reads the key from a variable
        ctx = vf.ModelContext(model=request.get("model", "policy"), sampling=vf.Sampling(),
                              client=vf.EvalClientConfig(base_url=request["base_url"], api_key_var=KEY_VAR))
        episode = await env.run_episode(task, ctx)
        trace = episode.traces[0] if episode.traces else None
        errors = [str(e) for e in (getattr(episode, "errors", None) or [])]
        if trace is not None:
            errors += [str(e) for e in (getattr(trace, "errors", None) or [])]
        return {"ok": bool(episode.ok) and trace is not None, "reward": float(trace.reward) if trace else None,
                "rewards": {k: float(r.score) for k, r in (trace.rewards.items() if trace else []) if r},
                "metrics": {k: float(v) for k, v in ((trace.metrics or {}).items() if trace else [])
                            if isinstance(v, (int, float))},
                "errors": errors}

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        serving = None
        running: set = set()
        while line := await reader.readline():
            request = json.loads(line)
            op = request.get("op")
            if op == "load":
                try:
                    self.taskset, self.args = request["taskset"], dict(request.get("args") or {})
                    self.env("train")
                    await self.answer({"ok": True})
                except BaseException as e:  # noqa: BLE001 - reported to the caller, one line
                    await self.answer({"error": f"{type(e).__name__}: {e}"})
            elif op == "rows":
                try:
                    await self.answer({"rows": self.rows(request.get("split", "train"))})
                except BaseException as e:  # noqa: BLE001
                    await self.answer({"error": f"{type(e).__name__}: {e}"})
            elif op == "run":
                if serving is None:
                    serving = {}
                split = request.get("split", "train")
                if split not in serving:
                    serving[split] = self.env(split).serving()
                    await serving[split].__aenter__()
                task = asyncio.ensure_future(self._run(request))
                running.add(task)
                task.add_done_callback(running.discard)
        for ctx in (serving or {}).values():
            await ctx.__aexit__(None, None, None)

    async def _run(self, request: dict) -> None:
        try:
            reply = await self.run(request)
        except BaseException as e:  # noqa: BLE001 - one episode's fault, reported with its id
            reply = {"ok": False, "errors": [f"{type(e).__name__}: {e}"],
                     "traceback": traceback.format_exc(limit=5)}
        await self.answer({"id": request["id"], **reply})


def main() -> None:
    """Serve the protocol on stdin/stdout until stdin closes."""
    for path in os.environ.get("ASYNC_RL_VERIFIERS_PATH", "").split(os.pathsep):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    sys.modules[HARNESS_MODULE] = _harness_module()
    asyncio.run(Worker().serve())


if __name__ == "__main__":
    main()
