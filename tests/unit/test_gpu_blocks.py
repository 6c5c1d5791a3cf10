"""The GPU decode blocks' choices that need no GPU (runtime/gpu_blocks.py, kernels/cuda_*.py): where the blocks and
the one-kernel attention apply, launch shapes and key splits. The kernels themselves are tested in tests/gpu."""

import torch

from refs import build
from shardlm.kernels import cuda_attention_split, cuda_gemv
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.runtime import gpu_blocks
from shardlm.runtime.kvcache import KVCache
from shardlm.runtime.projections import join_projections
from shardlm.settings import Settings


def test_launch_shapes_are_the_measured_ones_and_fit_any_weight():
    for (n, k), shape in cuda_gemv.CONFIGS.items():
        assert cuda_gemv.config(n, k) == shape
    for n, k in [(1, 1), (160, 96), (333, 200), (4096, 4096), (11008, 4096), (4096, 14336), (151936, 3584)]:
        block_n, block_k, warps = cuda_gemv.config(n, k)
        assert block_n in (2, 8) and warps in (4, 8)
        assert block_k & (block_k - 1) == 0 and block_k <= 1024 and (block_k >= k or block_k == 1024)


def test_key_splits_cover_every_key_once():
    for kv_heads in (1, 2, 3, 8, 40):
        for length in (1, 63, 64, 65, 256, 1000, 4096, 8192):
            splits, per_split = cuda_attention_split.splits_for(kv_heads, length)
            assert per_split % cuda_attention_split.BLOCK_L == 0
            assert (splits - 1) * per_split < length <= splits * per_split, (kv_heads, length)
            assert kv_heads * splits <= max(cuda_attention_split.PROGRAMS, kv_heads)


def test_blocks_apply_only_to_joined_gpu_layers(tmp_path):
    """A CPU rank takes none (the kernels are CUDA's), nor a layer whose projections are not joined."""
    folder = write_random_checkpoint(PRESETS["debug"], tmp_path / "m", seed=3)
    rank = build(folder, settings=Settings(kernels="torch", fused=False))
    layer = rank.module.model.layers["0"]
    assert not gpu_blocks.eligible(layer)  # not joined
    join_projections(rank.module)
    assert not gpu_blocks.eligible(layer)  # joined, but on the CPU
    assert gpu_blocks.install_gemv_blocks(rank.module) == 0 and layer.decode_step is None
    assert getattr(rank.module, "greedy_pick", None) is None  # the argmax kernel comes only with the blocks


def test_one_kernel_attention_needs_a_captured_steps_cache(tmp_path):
    """Only a captured step's cache (its slot a device tensor) in float32 or bfloat16, one row, regular groups, at
    most MAX_KEYS slots and a mask row over all of them; anything else keeps the module path's attention."""
    folder = write_random_checkpoint(PRESETS["debug"], tmp_path / "m", seed=4)
    rank = build(folder, settings=Settings(kernels="torch", fused=False))
    args, attn = rank.module.args, rank.module.model.layers["0"].self_attn
    cache = KVCache(list(range(args.n_layers)), 1, args.n_kv_heads, 64, args.head_dim, torch.float32, "cpu")
    mask, cos = torch.ones(1, 1, 1, 64, dtype=torch.bool), torch.ones(1, 1, 1, args.head_dim)
    assert not gpu_blocks.one_kernel_attention(attn, cache, mask, cos)  # not a captured step
    with cache.static(torch.zeros(1, dtype=torch.long)):
        assert gpu_blocks.one_kernel_attention(attn, cache, mask, cos)
        assert not gpu_blocks.one_kernel_attention(attn, cache, mask[..., :32], cos)
        assert not gpu_blocks.one_kernel_attention(attn, None, mask, cos)
        attn.set_kv_map([min(h // 2, args.n_kv_heads - 1) for h in range(args.n_heads)])  # uneven groups
        assert not gpu_blocks.one_kernel_attention(attn, cache, mask, cos)
    wide = KVCache(list(range(args.n_layers)), 2, args.n_kv_heads, 64, args.head_dim, torch.float32, "cpu")
    with wide.static(torch.zeros(1, dtype=torch.long)):
        attn.set_kv_map([h // (args.n_heads // args.n_kv_heads) for h in range(args.n_heads)])
        assert not gpu_blocks.one_kernel_attention(attn, wide, mask, cos)  # two rows
    for dtype, takes in ((torch.bfloat16, True), (torch.float16, False)):  # float16's rotary has not run on a GPU
        typed = KVCache(list(range(args.n_layers)), 1, args.n_kv_heads, 64, args.head_dim, dtype, "cpu")
        with typed.static(torch.zeros(1, dtype=torch.long)):
            assert gpu_blocks.one_kernel_attention(attn, typed, mask, cos) == takes, dtype
