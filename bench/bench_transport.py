"""Throughput of the trajectory transport against raw ZeroMQ, measured side by side in one run.

What it measures: one sender process pushes messages to one receiving process over loopback
TCP (PUSH/PULL, high-water mark 64 on both ends); rates are seen by the receiver.

* ``ours``: ``ZmqTrajectorySender.send`` (encode to one msgpack frame + send) →
  ``ZmqTrajectoryReceiver.recv`` (recv + decode and validate back to a ``Trajectory``). The
  trajectory is realistic for math RL: 100 prompt tokens, 1000 response tokens, float64
  behavior log-probs, a ~4,000-character response text (25.7 KB on the wire). It is built once
  from Python lists, as ``async_rl.rollout`` builds it; that conversion to arrays is paid once
  per trajectory in the generator and reported on its own line.
* ``raw 1 frame``: pre-built bytes of the same size per message (the wire payload size of our
  encoding), no codec: the ceiling. The final line is ours / this row, against the target 0.80.
* ``raw 6 frames``: the same bytes split into a 4 KB head and 5 array-sized frames, no codec:
  what a frame-per-array format would pay in ZeroMQ alone (why the wire format is one frame).

Rates are messages (trajectories) per second and MB/s (10^6 bytes of wire payload) over
``--num`` messages after ``--warmup`` untimed ones; each row is the median of ``--repeats``
interleaved runs. The receiver's CPU time per message (its process, ZeroMQ's I/O thread
included) is printed beside each rate: on a machine shared with other work the rates swing with
the scheduler, the CPU cost much less. Single-process encode-only and decode-only rates
attribute the codec's cost.
Run: ``python bench/bench_transport.py`` (about 10-20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import statistics
import time

import numpy as np
import zmq

from async_rl.buffers.trajectory import PER_TOKEN_DTYPES, Trajectory
from async_rl.buffers.transport import (
    ZmqSenderFactory, ZmqTrajectoryReceiver, decode_trajectory, encode_trajectory,
)

HWM = 64


def realistic_trajectory(seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed)
    return Trajectory(
        trajectory_id="1234/5", group_id=1234, prompt_uid="gsm8k-train-1234",
        prompt_ids=rng.integers(0, 151_000, 100).tolist(),
        response_ids=rng.integers(0, 151_000, 1000).tolist(),
        behavior_logprobs=(-rng.exponential(0.5, 1000)).tolist(),
        loss_mask=[1] * 1000, finish_reason="stop", policy_version=[7] * 1000, reward=1.0,
        reward_extras={"acc": 1.0, "format": 1.0}, response_text="Let us compute step by step. " * 138)


def _sender(ours_address: str, raw1_address: str, raw6_address: str, msg_bytes: int,
            array_bytes: list[int], total: int, repeats: int) -> None:
    traj = realistic_trajectory()
    ours = ZmqSenderFactory(ours_address, hwm=HWM)()
    ctx = zmq.Context.instance()
    raw1, raw6 = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    for sock, addr in ((raw1, raw1_address), (raw6, raw6_address)):
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.connect(addr)
    one = [np.random.default_rng(1).bytes(msg_bytes)]
    six = [np.random.default_rng(2).bytes(n) for n in [msg_bytes - sum(array_bytes), *array_bytes]]
    for _ in range(repeats):
        for _ in range(total):
            ours.send(traj)
        for _ in range(total):
            raw1.send_multipart(one, copy=False)
        for _ in range(total):
            raw6.send_multipart(six, copy=False)
    ours.close()
    raw1.close()
    raw6.close()


def _timed(recv_one, warmup: int, num: int) -> tuple[float, float]:
    """(wall s, receiving-process CPU s) of ``num`` receives after ``warmup`` untimed ones."""
    for _ in range(warmup):
        recv_one()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(num):
        recv_one()
    return time.perf_counter() - t0, time.process_time() - c0


def _codec_rates(traj: Trajectory, num: int) -> tuple[float, float, float]:
    """Trajectories/s of encode, decode and building the ``Trajectory`` from Python lists."""
    t0 = time.perf_counter()
    for _ in range(num):
        frames = encode_trajectory(traj)
    enc = num / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(num):
        decode_trajectory(frames)
    dec = num / (time.perf_counter() - t0)
    as_lists = {name: getattr(traj, name).tolist() for name in PER_TOKEN_DTYPES}
    t0 = time.perf_counter()
    for _ in range(num):
        dataclasses.replace(traj, **as_lists)
    return enc, dec, num / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=10_000, help="timed messages per run")
    parser.add_argument("--warmup", type=int, default=500, help="untimed messages before each run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per row (median)")
    args = parser.parse_args()

    traj = realistic_trajectory()
    msg_bytes = sum(len(f) for f in encode_trajectory(traj))
    # The 6-frame reference row: the five per-token arrays as frames, the rest in a head frame.
    array_bytes = [100 * 4, 1000 * 4, 1000 * 8, 1000 * 1, 1000 * 8]
    enc_rate, dec_rate, build_rate = _codec_rates(traj, 2000)

    ours = ZmqTrajectoryReceiver(hwm=HWM)
    ctx = zmq.Context.instance()
    raw1, raw6 = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    raw_addresses = []
    for sock in (raw1, raw6):
        sock.setsockopt(zmq.RCVHWM, HWM)
        raw_addresses.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    total = args.warmup + args.num
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(ours.address, *raw_addresses, msg_bytes, array_bytes, total, args.repeats))
    proc.start()

    def recv_ours():
        assert ours.recv(timeout_s=60.0) is not None, "sender stalled"

    times: dict[str, list[tuple[float, float]]] = {"ours (encode+send+recv+decode)": [], "raw 1 frame, same bytes": [],
                                                   "raw 6 frames, same sizes": []}
    for _ in range(args.repeats):
        times["ours (encode+send+recv+decode)"].append(_timed(recv_ours, args.warmup, args.num))
        times["raw 1 frame, same bytes"].append(_timed(lambda: raw1.recv_multipart(copy=True), args.warmup, args.num))
        times["raw 6 frames, same sizes"].append(_timed(lambda: raw6.recv_multipart(copy=True), args.warmup, args.num))
    proc.join(timeout=60)
    ours.close()
    raw1.close(linger=0)
    raw6.close(linger=0)

    print(f"message: 100 prompt + 1000 response tokens, {msg_bytes} bytes on the wire; "
          f"{args.num} timed messages x {args.repeats} runs, loopback TCP, hwm {HWM}")
    print(f"{'transport':34s} {'traj/s':>10s} {'MB/s':>8s} {'recv CPU us':>11s}   (median; all runs traj/s)")
    rates, cpu_us = {}, {}
    for name, ts in times.items():
        rates[name] = args.num / statistics.median(wall for wall, _ in ts)
        cpu_us[name] = statistics.median(cpu for _, cpu in ts) / args.num * 1e6
        runs = ", ".join(f"{args.num / wall:,.0f}" for wall, _ in ts)
        print(f"{name:34s} {rates[name]:10,.0f} {rates[name] * msg_bytes / 1e6:8.1f} {cpu_us[name]:11.1f}   ({runs})")
    row_ours, row_raw1, row_raw6 = rates.keys()
    print(f"ratio ours / raw 1 frame:  {rates[row_ours] / rates[row_raw1]:.2f}   (receiver CPU raw / ours: "
          f"{cpu_us[row_raw1] / cpu_us[row_ours]:.2f})")
    print(f"ratio ours / raw 6 frames: {rates[row_ours] / rates[row_raw6]:.2f}")
    print(f"codec alone, one process: encode {enc_rate:,.0f} traj/s ({1e6 / enc_rate:.0f} us), "
          f"decode {dec_rate:,.0f} traj/s ({1e6 / dec_rate:.0f} us); generator side, once per trajectory: "
          f"Trajectory from Python lists {1e6 / build_rate:.0f} us")
    print(f"wire: ours/raw = {rates[row_ours] / rates[row_raw1]:.2f}x (target >= 0.80), same {msg_bytes} bytes per message")


if __name__ == "__main__":
    main()
