"""Throughput of the trajectory transport against raw ZeroMQ, measured side by side in one run.

What it measures: one sender process pushes messages to one receiving process over loopback
TCP (PUSH/PULL, high-water mark 64 on both ends); rates are seen by the receiver. Two pairs of
rows, each pair moving the same bytes in the same number of messages:

* per trajectory (one trajectory a message):

  * ``ours``: ``ZmqTrajectorySender.send(traj)`` (encode to one schema-8 frame + send) →
    ``ZmqTrajectoryReceiver.recv`` (recv + decode and validate back to a ``Trajectory``). The
    trajectory is realistic for math RL: 100 prompt tokens, 1000 response tokens, float64
    behavior log-probs, no teacher log-probs (a run without on-policy distillation; a teacher
    adds 8 bytes a response token), a ~4,000-character response text (25.5 KB on the wire). It
    is built once from Python lists, as ``async_rl.step.rollout`` builds it; that conversion to
    arrays is paid once per trajectory in the generator and reported on its own line.
  * ``raw``: pre-built bytes of the same size per message, no codec: the ceiling.

* per group (``--group-size`` trajectories a message, 8 by default as in
  ``configs/default.yaml``): what the pipeline sends. A generator sends each finished group as
  one ``TrajectoryGroup`` (its kept trajectories, closing the group), which the receiver hands
  on as the trajectories and a ``GroupClosed``; ``raw`` moves pre-built messages of that
  message's size.

Both ends of ``raw`` use the calls ours uses (``send_multipart(copy=False)``, ``recv(copy=False)``):
the cheapest ZeroMQ offers, so ``raw`` never reads a payload, and its sender resends one
pre-built buffer. ``raw, read once`` (per group) also reads each received payload once (one
uint64 max over it): the floor for any receiver that checks what it got.
The ``raw 6 frames`` row (the per-trajectory bytes split into a 4 KB head and 5 array-sized
frames) shows what a frame-per-array format would pay in ZeroMQ alone (why the wire format is
one frame).

Rates are trajectories per second and MB/s (10^6 bytes of wire payload) over ``--num``
trajectories after ``--warmup`` untimed ones; each row is the median of ``--repeats``
interleaved runs. The receiver's and the sender's CPU time per trajectory (each process, its
ZeroMQ I/O thread included) are printed beside each rate: on a machine shared with other work the rates swing with
the scheduler, the CPU cost much less. Single-process encode-only and decode-only costs
attribute the codec's share. The last line is the per-group ratio (what the pipeline uses)
against the target 0.80.
Run: ``python bench/bench_transport.py`` (about 20-40 s on 2 cores).
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
    GroupClosed, TrajectoryGroup, ZmqSenderFactory, ZmqTrajectoryReceiver, decode_messages, encode_message,
)

HWM = 64


def realistic_trajectory(seed: int = 0, group_id: int = 1234, index: int = 5) -> Trajectory:
    """A math-RL trajectory: 100 prompt and 1000 response tokens, a ~4,000-character response."""
    rng = np.random.default_rng(seed)
    return Trajectory(
        trajectory_id=f"{group_id}/{index}", group_id=group_id, prompt_uid="gsm8k-train-1234",
        prompt_ids=rng.integers(0, 151_000, 100).tolist(),
        response_ids=rng.integers(0, 151_000, 1000).tolist(),
        behavior_logprobs=(-rng.exponential(0.5, 1000)).tolist(),
        loss_mask=[1] * 1000, finish_reason="stop", policy_version=[7] * 1000, reward=1.0,
        reward_extras={"acc": 1.0, "format": 1.0}, response_text="Let us compute step by step. " * 138)


def realistic_group(group_size: int) -> TrajectoryGroup:
    return TrajectoryGroup(1234, [realistic_trajectory(seed=i, index=i) for i in range(group_size)])


def _sender(addresses: dict[str, str], sizes: dict[str, list[int]], counts: dict[str, int], group_size: int,
            repeats: int, cpu_out) -> None:
    """Send every row's messages ``repeats`` times, in row order; put each run's sender CPU s on ``cpu_out``."""
    traj, group = realistic_trajectory(), realistic_group(group_size)
    ctx = zmq.Context.instance()
    ours = {name: ZmqSenderFactory(addresses[name], hwm=HWM)() for name in ("ours_traj", "ours_group")}
    raw = {}
    for name in ("raw_traj", "raw6_traj", "raw_group", "raw_group_read"):
        raw[name] = ctx.socket(zmq.PUSH)
        raw[name].setsockopt(zmq.SNDHWM, HWM)
        raw[name].connect(addresses[name])
    payloads = {name: [np.random.default_rng(i).bytes(n) for i, n in enumerate(sizes[name])] for name in raw}
    for _ in range(repeats):
        for name in addresses:
            c0 = time.process_time()
            if name == "ours_traj":
                for _ in range(counts[name]):
                    ours[name].send(traj)
            elif name == "ours_group":
                for _ in range(counts[name]):
                    ours[name].send(group)
            else:
                for _ in range(counts[name]):
                    raw[name].send_multipart(payloads[name], copy=False)
            cpu_out.put((name, time.process_time() - c0))
    for sock in (*ours.values(), *raw.values()):
        sock.close()


def _timed(recv_one, warmup: int, num: int) -> tuple[float, float]:
    """(wall s, receiving-process CPU s) of ``num`` receives after ``warmup`` untimed ones."""
    for _ in range(warmup):
        recv_one()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(num):
        recv_one()
    return time.perf_counter() - t0, time.process_time() - c0


def _codec_us(msg, num: int) -> tuple[float, float]:
    """Microseconds of one ``encode_message`` and one ``decode_messages`` of ``msg`` (best of 3)."""
    frames = encode_message(msg)
    enc = dec = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(num):
            encode_message(msg)
        enc = min(enc, (time.process_time() - t0) / num * 1e6)
        t0 = time.process_time()
        for _ in range(num):
            decode_messages(frames)
        dec = min(dec, (time.process_time() - t0) / num * 1e6)
    return enc, dec


def _build_us(traj: Trajectory, num: int) -> float:
    """Microseconds of building the ``Trajectory`` from Python lists (the generator, once per trajectory)."""
    as_lists = {name: getattr(traj, name).tolist() for name in PER_TOKEN_DTYPES}
    t0 = time.process_time()
    for _ in range(num):
        dataclasses.replace(traj, **as_lists)
    return (time.process_time() - t0) / num * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=8_000, help="timed trajectories per run")
    parser.add_argument("--warmup", type=int, default=400, help="untimed trajectories before each run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per row (median)")
    parser.add_argument("--group-size", type=int, default=8, help="trajectories per group message")
    args = parser.parse_args()
    g = args.group_size

    traj, group = realistic_trajectory(), realistic_group(g)
    traj_bytes = len(encode_message(traj)[0])
    group_bytes = len(encode_message(group)[0])
    # The 6-frame reference row: the five per-token arrays as frames (no teacher log-probs), the
    # rest in a head frame.
    array_bytes = [100 * 4, 1000 * 4, 1000 * 8, 1000 * 1, 1000 * 8]
    sizes = {"raw_traj": [traj_bytes], "raw6_traj": [traj_bytes - sum(array_bytes), *array_bytes],
             "raw_group": [group_bytes], "raw_group_read": [group_bytes]}
    enc_traj, dec_traj = _codec_us(traj, 2000)
    enc_group, dec_group = _codec_us(group, 2000 // g)
    build = _build_us(traj, 1000)

    names = ("ours_traj", "raw_traj", "raw6_traj", "ours_group", "raw_group", "raw_group_read")
    per_msg = {name: 1 if name.endswith("traj") else g for name in names}  # trajectories per message
    socks, addresses = {}, {}
    ctx = zmq.Context.instance()
    for name in names:
        if name.startswith("ours"):
            socks[name] = ZmqTrajectoryReceiver(hwm=HWM)
            addresses[name] = socks[name].address
        else:
            socks[name] = ctx.socket(zmq.PULL)
            socks[name].setsockopt(zmq.RCVHWM, HWM)
            addresses[name] = f"tcp://127.0.0.1:{socks[name].bind_to_random_port('tcp://127.0.0.1')}"
    num_msgs = {name: args.num // per_msg[name] for name in names}
    warm_msgs = {name: max(1, args.warmup // per_msg[name]) for name in names}
    counts = {name: num_msgs[name] + warm_msgs[name] for name in names}
    spawn = mp.get_context("spawn")
    cpu_queue = spawn.Queue()
    proc = spawn.Process(target=_sender, args=(addresses, sizes, counts, g, args.repeats, cpu_queue))
    proc.start()

    def receiver(name):
        sock = socks[name]
        if name == "ours_traj":
            def recv_one():
                assert isinstance(sock.recv(timeout_s=60.0), Trajectory), "sender stalled"
        elif name == "ours_group":
            def recv_one():  # the group's trajectories, then its GroupClosed
                for _ in range(g):
                    assert isinstance(sock.recv(timeout_s=60.0), Trajectory), "sender stalled"
                assert isinstance(sock.recv(timeout_s=60.0), GroupClosed)
        elif name == "raw6_traj":
            def recv_one():
                sock.recv_multipart(copy=False)
        elif name == "raw_group_read":
            def recv_one():  # every payload byte read once, as any consumer that checks it must
                frame = sock.recv(copy=False)
                np.maximum.reduce(np.frombuffer(frame, np.uint64, len(frame) // 8))
        else:
            def recv_one():  # one frame, as ours reads it
                sock.recv(copy=False)
        return recv_one

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:  # the order the sender sends them
            times[name].append(_timed(receiver(name), warm_msgs[name], num_msgs[name]))
    send_cpu: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats * len(names)):
        name, cpu = cpu_queue.get(timeout=60)
        send_cpu[name].append(cpu)
    proc.join(timeout=60)
    for name in names:
        socks[name].close() if name.startswith("ours") else socks[name].close(linger=0)

    labels = {"ours_traj": "ours, 1 trajectory a message", "raw_traj": "raw, same bytes (1 frame)",
              "raw6_traj": "raw, same bytes as 6 frames", "ours_group": f"ours, a group ({g}) a message",
              "raw_group": "raw, same bytes (1 frame)", "raw_group_read": "raw, same bytes, read once"}
    print(f"trajectory: 100 prompt + 1000 response tokens, {traj_bytes} bytes on the wire; group of {g}: "
          f"{group_bytes} bytes; {args.num} timed trajectories x {args.repeats} runs, loopback TCP, hwm {HWM}")
    print(f"{'transport':34s} {'traj/s':>10s} {'MB/s':>8s} {'recv CPU us/traj':>16s} {'send CPU':>8s}   "
          "(median; all runs traj/s)")
    rates, cpu_us = {}, {}
    for name in names:
        ts, n_traj = times[name], num_msgs[name] * per_msg[name]
        rates[name] = n_traj / statistics.median(wall for wall, _ in ts)
        cpu_us[name] = statistics.median(cpu for _, cpu in ts) / n_traj * 1e6
        runs = ", ".join(f"{n_traj / wall:,.0f}" for wall, _ in ts)
        # The sender's runs include its warm-up messages.
        sent_us = statistics.median(send_cpu[name]) / (counts[name] * per_msg[name]) * 1e6
        size = traj_bytes if name.endswith("traj") else group_bytes / g
        print(f"{labels[name]:34s} {rates[name]:10,.0f} {rates[name] * size / 1e6:8.1f} {cpu_us[name]:16.1f} "
              f"{sent_us:8.1f}   ({runs})")
    for kind, ours, raw in (("1 trajectory a message", "ours_traj", "raw_traj"),
                            (f"a group of {g} a message", "ours_group", "raw_group")):
        print(f"ratio ours / raw, {kind}: {rates[ours] / rates[raw]:.2f}   (receiver CPU raw / ours: "
              f"{cpu_us[raw] / cpu_us[ours]:.2f})")
    print(f"ratio ours / raw reading each payload once, a group of {g} a message: "
          f"{rates['ours_group'] / rates['raw_group_read']:.2f}   (receiver CPU raw / ours: "
          f"{cpu_us['raw_group_read'] / cpu_us['ours_group']:.2f})")
    print(f"ratio raw 1 frame / raw 6 frames: {rates['raw_traj'] / rates['raw6_traj']:.2f}")
    print(f"codec alone, one process: 1 trajectory encode {enc_traj:.1f} us, decode {dec_traj:.1f} us; "
          f"a group of {g} encode {enc_group / g:.1f} us, decode {dec_group / g:.1f} us per trajectory; "
          f"generator side, once per trajectory: Trajectory from Python lists {build:.0f} us")
    print(f"wire: ours/raw = {rates['ours_group'] / rates['raw_group']:.2f}x per group message, what the pipeline "
          f"sends (target >= 0.80; {rates['ours_traj'] / rates['raw_traj']:.2f}x one trajectory a message), "
          f"same bytes and messages")


if __name__ == "__main__":
    main()
