"""Stand-in for SGLang's CUDA kernel package ``sgl_kernel`` (``sglang-kernel``) in the CPU test venv.

``sglang-kernel`` ships CUDA-only wheels; SGLang's CPU kernels are built from a source checkout
for Intel AMX. SGLang imports a few names from it at module load even on the dense fp32 path
that runs here (``attention_backend=torch_native``), where none of them is called
(checked on the tiny Qwen2: greedy output matched HF token for token). This module provides exactly those names, and each raises
``NotImplementedError`` naming itself if it is ever called, so no test can pass through it.
Installed by ``envs/sglang-cpu/build.sh``; never installed beside a real ``sglang-kernel``.
"""

__version__ = "0.0.0+async-rl-cpu-stand-in"
STAND_IN = True

_NAMES = (
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
)


def _stand_in(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is async-rl's CPU stand-in for the CUDA-only "
            f"sglang-kernel package (envs/sglang-cpu): this SGLang code path needs the real kernel")

    call.__name__ = call.__qualname__ = name
    return call


for _name in _NAMES:
    globals()[_name] = _stand_in(_name)
