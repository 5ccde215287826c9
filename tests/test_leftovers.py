"""A SIGKILLed weight sender's slot files are removed by the next start's sweep; a live owner's
files and a dead owner's young ones (another pid namespace may own them) are kept. A Ray actor of
ours that its launcher kills runs its exit handlers first, and leaves nothing in its temp dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_rl.utils.leftovers import MIN_AGE_S, SLOT_NAME, slot_dirs, sweep_weight_slots

SENDER = """
from async_rl.weight_sync.config import WeightSyncConfig
from async_rl.weight_sync.wire import WeightSender
sender = WeightSender(WeightSyncConfig(transport="shm", bucket_size_mb=1.0), num_receivers=1)
print("\\n".join(p for p, _ in sender.init_info()["slots"]), flush=True)
import time
time.sleep(600)
"""


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_the_start_sweep_removes_a_killed_senders_slots_and_keeps_a_live_owners(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SENDER], stdout=subprocess.PIPE, text=True)
    try:
        slots = [Path(proc.stdout.readline().strip()) for _ in range(2)]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert all(p.exists() and SLOT_NAME.fullmatch(p.name) for p in slots), slots  # what a SIGKILL leaves
    assert {str(p.parent) for p in slots} == set(slot_dirs())
    directory = slots[0].parent
    live = directory / f"async-rl-{os.getpid()}-0123abcd-1048576-slot0"  # this test process: alive
    young = directory / f"async-rl-{proc.pid}-89abcdef-1048576-slot0"  # dead owner, but just made
    live.write_bytes(b""), young.write_bytes(b"")
    try:
        for p in (*slots, live):
            _age(p, MIN_AGE_S + 60)
        removed = sweep_weight_slots()
        assert sorted(str(p) for p in slots) == [p for p in removed if p in {str(s) for s in slots}]
        assert not any(p.exists() for p in slots)
        assert live.exists() and young.exists()
        assert str(live) not in removed and str(young) not in removed
    finally:
        for p in (*slots, live, young):
            p.unlink(missing_ok=True)


def test_the_trainer_sweeps_at_start(monkeypatch):
    """The sweep is wired into the run's start, before anything loads."""
    from async_rl import trainer

    class Swept(Exception):
        pass

    def sweep():
        raise Swept

    monkeypatch.setattr(trainer, "sweep_at_start", sweep)
    try:
        trainer._train(None)
    except Swept:
        return
    raise AssertionError("trainer._train did not sweep before it started")


RUN = """
import sys, threading, time
from pathlib import Path
from async_rl.rewards.workers import RewardWorkers
from async_rl.weight_sync.config import WeightSyncConfig
from async_rl.weight_sync.wire import WeightSender
pool = RewardWorkers(None, 2, 30.0)
scored = threading.Event()
pool.submit(("gsm8k", "The answer is 4", "4", {}), lambda outcome: scored.set())
assert scored.wait(120)
sender = WeightSender(WeightSyncConfig(transport="shm", bucket_size_mb=1.0), num_receivers=1)
if sys.argv[2] == "wandb":
    from async_rl.runtime.metrics import WandbConfig, _init_wandb
    _init_wandb(WandbConfig(mode="offline"), Path(sys.argv[1]), {})
print("ready", flush=True)
time.sleep(600)
"""


def test_what_a_sigkilled_vllm_free_run_leaves_the_next_start_sweeps(tmp_path):
    """A run's process (reward workers, an shm weight sender, a W&B offline run) SIGKILLed with its
    process group leaves files in ``/dev/shm`` and the temp dir; once they are old enough, the
    start's sweep (``sweep_at_start``, in a new process, as a next run) removes every one."""
    try:
        import wandb  # noqa: F401
        with_wandb = "wandb"
    except ImportError:
        with_wandb = "none"
    temp, run_dir = tmp_path / "t", tmp_path / "run"
    temp.mkdir(), run_dir.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "WANDB_SILENT": "true"}
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(run_dir), with_wandb], stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def left() -> list[Path]:
        shm = [Path(d, f) for d in slot_dirs() for f in os.listdir(d) if f.startswith(f"async-rl-{proc.pid}-")]
        return sorted(shm + list(temp.iterdir()))

    def service_files() -> list[Path]:  # W&B's service (its own session): port file, sockets
        return [p for p in left() if p.name.startswith(("wandb", "tmp"))]

    deadline = time.time() + 60  # the service notices its parent's death and removes its files
    while service_files() and time.time() < deadline:
        time.sleep(0.5)
    leftovers = left()
    print("the killed run left:", *leftovers, sep="\n  ")
    assert leftovers, "the killed run left nothing: this test no longer tests the sweep"
    for p in leftovers:
        _age(p, MIN_AGE_S + 60)
    out = subprocess.run([sys.executable, "-c", "from async_rl.utils.leftovers import sweep_at_start; sweep_at_start()"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert left() == [], f"the start's sweep kept: {left()} (it removed what it logged: {out.stderr})"


def test_the_start_sweep_removes_only_vllm_queue_buffers_no_process_holds():
    """vLLM's queue buffers (``psm_<8 hex>``, ``(chunk + 1 + readers) * 10`` bytes) of a killed
    engine are removed; one a live process maps or holds open, a young one, and a ``psm_`` file of
    another size (someone else's ``SharedMemory``) are kept."""
    import mmap
    import secrets

    from async_rl.utils.leftovers import is_vllm_queue_size, sweep_vllm_queues

    if not os.path.isdir("/dev/shm"):
        return
    size = 10 * ((16 << 20) + 2)  # a 16 MiB chunk, one reader
    assert is_vllm_queue_size(size) and not is_vllm_queue_size(size + 3) and not is_vllm_queue_size(32)
    paths = {k: Path("/dev/shm", f"psm_{secrets.token_hex(4)}") for k in ("orphan", "mapped", "open", "young", "other")}
    for k, p in paths.items():
        with open(p, "wb") as f:
            f.truncate(size + 3 if k == "other" else size)  # sparse: no memory used
        if k != "young":
            _age(p, MIN_AGE_S + 60)
    held = open(paths["open"], "rb")
    with open(paths["mapped"], "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)
    try:
        removed = sweep_vllm_queues()
        assert str(paths["orphan"]) in removed and not paths["orphan"].exists()
        assert all(paths[k].exists() and str(paths[k]) not in removed for k in ("mapped", "open", "young", "other"))
    finally:
        mapping.close(), held.close()
        for p in paths.values():
            p.unlink(missing_ok=True)


ACTOR = """
import json, os, sys, tempfile, time
import ray
from async_rl.utils.leftovers import pid_alive, run_exit_handlers

class Actor:
    def make(self):
        # What libraries make in an actor and remove only at exit: W&B's temp dirs (made at import:
        # megatron-core imports wandb), the resource sharer's listener in a pymp-* directory (torch
        # hands a CPU tensor's file descriptor to another process through it: SGLang's weight loads).
        from multiprocessing import resource_sharer

        self.media = tempfile.TemporaryDirectory("wandb-media")
        self.shared = resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))
        return sorted(os.listdir(tempfile.gettempdir()))

    def end(self, handlers):
        return run_exit_handlers() if handlers else None

    def pid(self):
        return os.getpid()

ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
out = {}
for mode, temp in (("handlers", sys.argv[1]), ("kill", sys.argv[2])):
    actor = ray.remote(Actor).options(runtime_env={"env_vars": {"TMPDIR": temp}}).remote()
    made = ray.get(actor.make.remote())
    ran = ray.get(actor.end.remote(mode == "handlers"))
    pid = ray.get(actor.pid.remote())  # still an actor that answers
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    out[mode] = {"made": made, "ran": ran, "left": sorted(os.listdir(temp))}
ray.shutdown()
print(json.dumps(out))
"""


def test_a_ray_actor_killed_after_running_its_exit_handlers_leaves_nothing_in_its_temp_dir():
    """``run_exit_handlers`` in a Ray actor removes what its libraries remove at exit; the actor
    still answers afterwards, and ``ray.kill`` (no exit handler) then leaves nothing. Killed
    without it, the same actor leaves all of it."""
    import json
    import shutil
    import tempfile

    # Beside Ray's session folders, not in tmp_path: the resource sharer's socket path under each
    # must fit 107 bytes, as Ray's (longer) socket paths in the temp dir do.
    dirs = [tempfile.mkdtemp(prefix="arl-") for _ in range(2)]  # the two actors' temp dirs
    try:
        proc = subprocess.run([sys.executable, "-c", ACTOR, *dirs], capture_output=True, text=True, timeout=300)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    made = out["kill"]["made"]
    assert any(n.startswith("pymp-") for n in made) and any(n.endswith("wandb-media") for n in made), made
    assert out["kill"]["left"] == made, "killed without its exit handlers, the actor left less: the test tests nothing"
    assert out["handlers"]["ran"] is True
    assert out["handlers"]["left"] == [], out["handlers"]


def test_run_exit_handlers_does_nothing_outside_a_ray_actor():
    # This test process still has its own exit to make.
    from async_rl.utils.leftovers import run_exit_handlers

    assert run_exit_handlers() is False


def test_learner_ranks_and_generator_actors_run_their_exit_handlers_before_they_are_killed(monkeypatch):
    """The follower rank's ``run`` (here failing at its start) and a generator actor's ``close``
    (its last call before ``GeneratorPool.close`` kills it) run the process's exit handlers."""
    import async_rl.runtime.cluster
    import async_rl.utils.leftovers
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.launch import LearnerRank
    from async_rl.loops.actors import GeneratorWorker

    calls = []
    monkeypatch.setattr(async_rl.utils.leftovers, "run_exit_handlers", lambda: calls.append("handlers") or True)

    def cannot_pin(*args):
        raise RuntimeError("no such core")

    monkeypatch.setattr(async_rl.runtime.cluster, "pin_process", cannot_pin)
    rank = LearnerRank(1, 2, ("127.0.0.1", 1), (LearnerConfig(), None, "", 1.0, 1))
    with pytest.raises(RuntimeError, match="no such core"):
        rank.run()
    assert calls == ["handlers"]

    class Closing:
        def close(self):
            calls.append("closed")

    worker = GeneratorWorker.__new__(GeneratorWorker)  # no engine to start: close only
    worker.scorer, worker.engine = Closing(), Closing()
    worker.close()
    assert calls == ["handlers", "closed", "closed", "handlers"]
