"""Megatron sharded checkpoints (``async_rl.learners.megatron.checkpoint``): exact resume at TP=2 and
resharding TP 2 <-> 1 and PP 2 <-> 1, AdamW moments included, on 2 gloo ranks plus 1 rank.

One chain of layouts runs in 2 spawned processes (megatron's import costs ~7 s a process, so the
layouts are switched with ``destroy_model_parallel`` instead of new processes) and one more in a
single process; each rank-0 result is a number or an error record that the tests below assert on.
Full tensors are rebuilt from TP shards by each parameter's ``partition_dim`` (``linear_fc1`` of a
gated MLP holds ``[gate_r; up_r]`` per rank, so the full one is ``[gate_0; gate_1; up_0; up_1]``)
and from PP stages by the global layer number.
"""

from __future__ import annotations

import os
import re
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from async_rl.learners.launch import exit_rank_process

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

pytestmark = pytest.mark.slow

VOCAB, SEQ, BATCH, LAYERS = 96, 12, 2, 2


# ---------------------------------------------------------------- worker helpers (spawned processes)
def _layout(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)


class ValueHead(torch.nn.Module):
    """A critic's scalar head in place of ``output_layer`` (replicated on TP ranks)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1, hidden) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden @ self.weight.T + self.bias, None


def _model(seed: int, hidden: int = 64, share: bool = True, value_head: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=hidden, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * hidden,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=True, layernorm_epsilon=1e-6,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size())
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope", share_embeddings_and_output_weights=share,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if value_head:
        torch.manual_seed(seed + 1000)  # the same head on every TP rank
        model.output_layer = ValueHead(hidden)
    return model


def _adamw(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).expand(BATCH, 1, SEQ, SEQ)  # True = masked
    return ids[:, :-1], ids[:, 1:], pos, mask


def _train_step(model, opt, sched) -> None:
    ids, labels, pos, mask = _batch()
    model(ids, pos, mask, labels=labels).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _sin_step(model, opt) -> None:
    """An AdamW step on gradients ``sin(3 p)``: elementwise in the parameter values, so the moments
    are the same function of the global weights at any layout (no forward needed, e.g. at PP=2)."""
    for p in model.parameters():
        p.grad = torch.sin(3 * p.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)


def _logits(model) -> torch.Tensor:
    """Full-vocabulary logits ``[B, S, V]`` of the fixed batch (TP shards gathered)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ids, _, pos, mask = _batch()
    with torch.no_grad():
        local = model(ids, pos, mask)
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _merge(parts: list[torch.Tensor], split) -> torch.Tensor:
    if split is None:
        return parts[0]
    dim, glu = split
    if glu:  # each rank's fc1 is [gate_r; up_r]
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def _global_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """``{global name: {"param", "exp_avg", "exp_avg_sq"}}`` of the whole model, on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    offset = ps.get_pipeline_model_parallel_rank() * LAYERS // ps.get_pipeline_model_parallel_world_size()
    local = {}
    for name, p in model.named_parameters():
        name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name)
        split = (p.partition_dim, name.endswith("linear_fc1.weight")) if getattr(p, "tensor_model_parallel", False) \
            else None
        st = opt.state.get(p, {})
        local[name] = (split, {"param": p.detach().clone(), **{k: st[k].clone() for k in ("exp_avg", "exp_avg_sq")}})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank(), local))
    shards: dict[str, list] = {}
    for _, _, loc in sorted((g for g in gathered if g[0] == 0), key=lambda g: g[1]):
        for name, entry in loc.items():
            shards.setdefault(name, []).append(entry)
    return {name: {k: _merge([e[1][k] for e in entries], entries[0][0]) for k in entries[0][1]}
            for name, entries in shards.items()}


def _max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over every tensor of two ``_global_state`` results (inf if the
    names or shapes differ)."""
    if set(a) != set(b):
        return float("inf")
    worst = 0.0
    for name, tensors in a.items():
        for k, t in tensors.items():
            if t.shape != b[name][k].shape:
                return float("inf")
            worst = max(worst, float((t - b[name][k]).abs().max()))
    return worst


def _reduce_max(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _error(fn) -> dict:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - recorded and asserted on by the tests
        return {"type": type(e).__name__, "msg": str(e), "chained": e.__cause__ is not None}
    return {"type": None}


# ---------------------------------------------------------------- the two chains of layouts
def _exact_resume(work: str, res: dict) -> None:
    """TP=2: 2 steps, save, 1 step; a fresh model + optimizer loads and takes the same step."""
    from async_rl.learners.megatron.checkpoint import load_sharded, save_sharded

    _layout(2, 1)
    model = _model(seed=1)
    opt, sched = _adamw(model)
    for _ in range(2):
        _train_step(model, opt, sched)
    save_sharded(f"{work}/tp2", {"policy": model}, {"policy": opt})
    sched_state = sched.state_dict()  # the learner keeps the scheduler with its trainer state
    res["ref_tp2"] = _global_state(model, opt)
    res["ref_tp2_logits"] = _logits(model)
    _train_step(model, opt, sched)
    after = [p.detach().clone() for p in model.parameters()]

    fresh = _model(seed=2)
    fresh_opt, fresh_sched = _adamw(fresh)
    load_sharded(f"{work}/tp2", {"policy": fresh}, {"policy": fresh_opt})
    fresh_sched.load_state_dict(sched_state)
    res["resume_loaded_step"] = float(next(iter(fresh_opt.state.values()))["step"])
    res["resume_loaded_lr"] = fresh_opt.param_groups[0]["lr"]
    _train_step(fresh, fresh_opt, fresh_sched)
    diff = max(float((p.detach() - q).abs().max()) for p, q in zip(fresh.parameters(), after))
    res["resume_max_diff"] = _reduce_max(diff)
    res["resume_lr_equal"] = fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _errors_and_value_head(work: str, res: dict) -> None:
    """TP=2: missing path, other hidden size, missing role; a critic with a value head round-trips."""
    from async_rl.learners.megatron.checkpoint import load_sharded, save_sharded

    os.makedirs(f"{work}/empty", exist_ok=True)
    small = _model(seed=3, hidden=32)
    small_opt, _ = _adamw(small)
    res["err_missing"] = _error(lambda: load_sharded(f"{work}/nothing", {"policy": small}, {}))
    res["err_empty"] = _error(lambda: load_sharded(f"{work}/empty", {"policy": small}, {}))
    res["err_hidden"] = _error(lambda: load_sharded(f"{work}/tp2", {"policy": small}, {"policy": small_opt}))
    res["err_role"] = _error(lambda: load_sharded(f"{work}/tp2", {"critic": small}, {}))

    critic = _model(seed=4, share=False, value_head=True)
    critic_opt, _ = _adamw(critic)
    _sin_step(critic, critic_opt)
    save_sharded(f"{work}/critic_tp2", {"critic": critic}, {"critic": critic_opt})
    res["ref_critic"] = _global_state(critic, critic_opt)
    res["ref_critic_values"] = _logits(critic)[..., :1]  # the head is replicated: rank 0's copy
    other = _model(seed=5, share=False, value_head=True)
    other_opt, _ = _adamw(other)
    load_sharded(f"{work}/critic_tp2", {"critic": other}, {"critic": other_opt})
    res["critic_tp2_diff"] = _max_diff(_global_state(other, other_opt), res["ref_critic"])
    tied = _model(seed=14)  # the policy architecture: tied output layer where the critic has its head
    res["err_head_into_tied"] = _error(lambda: load_sharded(f"{work}/critic_tp2", {"critic": tied}, {}))

    # Two roles, an optimizer that never stepped; load one role into an optimizer that has state.
    unstepped = torch.optim.AdamW(critic.parameters(), lr=3e-4)
    save_sharded(f"{work}/two_roles", {"critic": critic, "reference": _model(seed=15)}, {"critic": unstepped})
    again = _model(seed=16, share=False, value_head=True)
    again_opt, _ = _adamw(again)
    _sin_step(again, again_opt)
    load_sharded(f"{work}/two_roles", {"critic": again}, {"critic": again_opt})
    res["unstepped_state_size"] = len(again_opt.state)
    res["unstepped_lr"] = again_opt.param_groups[0]["lr"]
    diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(again.parameters(), critic.parameters()))
    res["two_roles_critic_diff"] = _reduce_max(diff)


def _tp1_and_back(work: str, res: dict) -> None:
    """TP=2 -> TP=1 (DP=2); a step at TP=1, save; TP=1 -> TP=2."""
    from async_rl.learners.megatron.checkpoint import load_sharded, save_sharded

    _layout(1, 1)
    model = _model(seed=6)
    opt, _ = _adamw(model)
    load_sharded(f"{work}/tp2", {"policy": model}, {"policy": opt})
    res["tp2_to_tp1_state_diff"] = _max_diff(_global_state(model, opt), res["ref_tp2"])
    res["tp2_to_tp1_logits_diff"] = float((_logits(model) - res["ref_tp2_logits"]).abs().max())
    critic = _model(seed=7, share=False, value_head=True)
    critic_opt, _ = _adamw(critic)
    load_sharded(f"{work}/critic_tp2", {"critic": critic}, {"critic": critic_opt})
    res["critic_tp2_to_tp1_diff"] = _max_diff(_global_state(critic, critic_opt), res["ref_critic"])
    res["critic_tp1_values_diff"] = float((_logits(critic) - res["ref_critic_values"]).abs().max())

    _sin_step(model, opt)
    save_sharded(f"{work}/tp1", {"policy": model}, {"policy": opt})
    ref_tp1, ref_logits = _global_state(model, opt), _logits(model)
    _layout(2, 1)
    back = _model(seed=8)
    back_opt, _ = _adamw(back)
    load_sharded(f"{work}/tp1", {"policy": back}, {"policy": back_opt})
    res["tp1_to_tp2_state_diff"] = _max_diff(_global_state(back, back_opt), ref_tp1)
    res["tp1_to_tp2_logits_diff"] = float((_logits(back) - ref_logits).abs().max())


def _pipeline(work: str, res: dict) -> None:
    """PP=2 -> (TP=2, PP=1) -> PP=2, untied output layer (the tied case at PP=2 is tested through
    the learner, tests/test_megatron_learner.py)."""
    from async_rl.learners.megatron.checkpoint import load_sharded, save_sharded

    _layout(1, 2)
    staged = _model(seed=9, share=False)
    staged_opt, _ = _adamw(staged)
    _sin_step(staged, staged_opt)
    save_sharded(f"{work}/pp2", {"policy": staged}, {"policy": staged_opt})
    res["ref_pp2"] = _global_state(staged, staged_opt)

    _layout(2, 1)
    flat = _model(seed=10, share=False)
    flat_opt, _ = _adamw(flat)
    load_sharded(f"{work}/pp2", {"policy": flat}, {"policy": flat_opt})
    res["pp2_to_tp2_state_diff"] = _max_diff(_global_state(flat, flat_opt), res["ref_pp2"])
    _sin_step(flat, flat_opt)
    save_sharded(f"{work}/tp2_untied", {"policy": flat}, {"policy": flat_opt})
    ref = _global_state(flat, flat_opt)

    _layout(1, 2)
    again = _model(seed=11, share=False)
    again_opt, _ = _adamw(again)
    load_sharded(f"{work}/tp2_untied", {"policy": again}, {"policy": again_opt})
    res["tp2_to_pp2_state_diff"] = _max_diff(_global_state(again, again_opt), ref)


def _single(work: str, res: dict) -> None:
    """One process, TP=1: the TP=2 and PP=2 checkpoints load whole."""
    from async_rl.learners.megatron.checkpoint import load_sharded

    refs = torch.load(f"{work}/refs.pt", weights_only=False)
    _layout(1, 1)
    model = _model(seed=12)
    opt, _ = _adamw(model)
    load_sharded(f"{work}/tp2", {"policy": model}, {"policy": opt})
    res["single_tp2_state_diff"] = _max_diff(_global_state(model, opt), refs["ref_tp2"])
    res["single_tp2_logits_diff"] = float((_logits(model) - refs["ref_tp2_logits"]).abs().max())
    untied = _model(seed=13, share=False)
    untied_opt, _ = _adamw(untied)
    load_sharded(f"{work}/pp2", {"policy": untied}, {"policy": untied_opt})
    res["single_pp2_state_diff"] = _max_diff(_global_state(untied, untied_opt), refs["ref_pp2"])


CHAINS = {"two": (_exact_resume, _errors_and_value_head, _tp1_and_back, _pipeline), "one": (_single,)}


def _worker(rank: int, world: int, init_file: str, work: str, chain: str) -> None:
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    from async_rl.learners.megatron.cpu import apply_cpu_adjustments

    apply_cpu_adjustments()  # RoPE and megatron's memory buffer ask torch.cuda.current_device()
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        res: dict = {"timings": {}}
        for part in CHAINS[chain]:
            start = time.perf_counter()
            part(work, res)
            res["timings"][part.__name__] = time.perf_counter() - start
        # What still runs after the chain's saves: megatron's writer would have left a
        # multiprocessing manager (a child whose socket directory outlives a killed rank).
        res[f"children_after_{chain}"] = [p.name for p in mp.active_children()]
        if rank == 0:
            torch.save(res, f"{work}/{'refs' if chain == 'two' else 'single'}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{work}/error-{chain}-{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        raise
    exit_rank_process(0)


def _spawn(world: int, work, chain: str, timeout_s: float = 300) -> dict:
    import time

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, str(work / f"init-{chain}"), str(work), chain))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break  # one rank failed: the others may wait in a collective forever
        time.sleep(0.1)
    for p in procs:
        if p.exitcode is None:
            p.terminate()
        p.join()
    errors = [f.read_text() for f in sorted(work.glob(f"error-{chain}-*.txt"))]
    assert all(p.exitcode == 0 for p in procs), "\n".join(errors) or f"exit codes {[p.exitcode for p in procs]}"
    return torch.load(work / ("refs.pt" if chain == "two" else "single.pt"), weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("megatron_ckpt")
    two = _spawn(2, work, "two")
    one = _spawn(1, work, "one")
    return {**two, **one}


# ---------------------------------------------------------------- the checks
def test_resume_at_tp2_is_exact(runs):
    assert runs["resume_loaded_step"] == 2.0
    assert runs["resume_loaded_lr"] == pytest.approx(1e-2 / 3)  # LambdaLR after 2 steps
    assert runs["resume_max_diff"] == 0.0
    assert runs["resume_lr_equal"]


@pytest.mark.parametrize("key", ["tp2_to_tp1_state_diff", "tp1_to_tp2_state_diff", "single_tp2_state_diff",
                                 "pp2_to_tp2_state_diff", "tp2_to_pp2_state_diff", "single_pp2_state_diff"])
def test_resharded_weights_and_adam_moments_equal_the_saved_ones(runs, key):
    # Loading copies the saved values: the reassembled global tensors match exactly.
    assert runs[key] == 0.0


@pytest.mark.parametrize("key", ["tp2_to_tp1_logits_diff", "tp1_to_tp2_logits_diff", "single_tp2_logits_diff"])
def test_resharded_model_computes_the_same_logits(runs, key):
    assert runs[key] < 1e-5


def test_critic_with_value_head_round_trips_and_reshards(runs):
    assert runs["critic_tp2_diff"] == 0.0
    assert runs["critic_tp2_to_tp1_diff"] == 0.0
    assert runs["critic_tp1_values_diff"] < 1e-5


def test_one_role_of_two_loads_and_an_unstepped_optimizer_stays_empty(runs):
    assert runs["two_roles_critic_diff"] == 0.0
    assert runs["unstepped_state_size"] == 0
    assert runs["unstepped_lr"] == 3e-4


def test_saves_leave_no_process_running(runs):
    # Every save's writer processes are joined within it, and their results come back without a
    # multiprocessing manager (in_process_write_results).
    assert runs["children_after_two"] == []


def test_missing_checkpoint_raises_file_not_found(runs):
    for key in ("err_missing", "err_empty"):
        err = runs[key]
        assert err["type"] == "FileNotFoundError", err
        assert "\n" not in err["msg"]


@pytest.mark.parametrize("key", ["err_hidden", "err_role", "err_head_into_tied"])
def test_checkpoint_that_does_not_fit_raises_value_error(runs, key):
    err = runs[key]
    assert err["type"] == "ValueError", err
    assert "\n" not in err["msg"]
    if key == "err_hidden":
        assert err["chained"]
