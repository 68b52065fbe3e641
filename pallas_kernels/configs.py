"""Launch parameters of the Pallas kernels, keyed by CUDA compute capability.

Only the Hopper entry was measured: on an H200 (``experiments/bench_kernels.py sweep``, Qwen3-8B
heads, context 16k, batch 1 and 16, 16 and 256 tree nodes) 128-row blocks with 8 warps were
1.2-1.6x faster than 64-row blocks with 4 warps at 256 nodes; at 16 nodes (64 packed rows) the
block shrinks to 64 rows and 4 warps (see ``launch_warps``), the best measured there. Deeper
pipelines (4 stages) and 128-key blocks did not help. Splitting the prefix until there are at
least 512 programs (about 4 per SM) rather than 264 reached 80-84% of the HBM bandwidth at batch
16, 16 nodes, 32k-64k (67-70% with 264) and did not lose elsewhere beyond the noise; chunks of
at least 128 prefix slots rather than 512 (more splits at short contexts) made batch 1 with a 1k
context 1.1-1.6x faster than the XLA path instead of 0.9-1.7x. Each request's prefix is cut by its
length (``split_by_length``), into at most 8 splits (``max_splits``): the merge reads every split's
partial output (then float32), and at batch 1 with a 1k context the AR round took 4.82 ms with 8 splits
against 4.99 with 27, the DDTree round of 64 nodes 7.71 against 8.25 (interleaved in one
process); a lower ``min_programs`` (64) gave those 8 splits at batch 1 too, but a single one at batch
8, where the kernel alone was up to 1.65x slower at an 8k context. ``whole_waves`` keeps 65 tree
nodes at batch 1 (three row blocks) in one wave of programs: 5 splits instead of 8 on 132 SMs, the
B = 64 round 2.0% faster on an H100 and no other measured shape changed. The Blackwell
entries are chosen by reasoning from the Hopper one and are marked unmeasured:

- ``(10, 0)`` (B200-class, sm_100): about 1.7x the HBM bandwidth of an H200 and the same
  228 KB of shared memory per SM, 148 SMs: the Hopper tiles, about 4 programs per SM;
- ``(12, 0)`` (RTX PRO 6000 / consumer Blackwell, sm_120): no wgmma/tcgen05, about 100 KB of
  shared memory per SM, 188 SMs and a third of the H200's bandwidth: 64-row blocks, 32-key
  blocks and two stages so that the double-buffered K/V tiles fit, about 4 programs per SM.

Ampere/Ada (``(8, x)``) get conservative defaults that also serve unknown GPUs.

``MOSAIC_TREE_ATTENTION_CONFIGS`` holds the Mosaic GPU kernel's (``tree_attention_mgpu``,
Hopper only): 64-row, 64-key blocks (one warpgroup, one wgmma tile), ``num_stages`` key/value
buffers, the Triton entry's split-K policy. Checked for equality and timed on an H200, not tuned.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def check_fields(config, *, powers_of_two=(), positive=(), non_negative=(), warps=()) -> None:
    """``ValueError`` naming the config and field unless each field of ``powers_of_two`` is a power of
    two >= 16, of ``positive`` an int >= 1, of ``non_negative`` an int >= 0, and of ``warps`` a
    Triton warp count (a power of two <= 32)."""
    rules = [(powers_of_two, lambda v: v >= 16 and v & (v - 1) == 0, "a power of two >= 16"),
             (positive, lambda v: v >= 1, "an int >= 1"), (non_negative, lambda v: v >= 0, "an int >= 0"),
             (warps, lambda v: v in (1, 2, 4, 8, 16, 32), "a power of two <= 32")]
    for names, ok, rule in rules:
        for name in names:
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
                raise ValueError(f"{type(config).__name__}.{name} must be {rule}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TreeAttentionConfig:
    """Tiling of the tree-attention kernel.

    ``block_m``: packed query rows (tree nodes x query heads of one KV group) per program; fewer
    when there are fewer rows. ``block_k``: keys per inner step. ``num_warps``: Triton warps for
    a full ``block_m`` block (scaled down with the block, see ``launch_warps``). ``num_stages``:
    Triton software-pipelining depth.
    ``min_programs``: the prefix is split (split-K) until the grid has at least this many
    programs. ``min_chunk``: no split covers fewer than this many prefix slots.
    ``split_by_length``: cut each request's prefix ``[0, length)`` into the splits, in chunks of
    ``ceil(length / splits)`` slots rounded up to whole key blocks, rather than the cache's capacity
    into fixed chunks (of which a short prefix fills only the first few); the number of splits, and so
    the merge, is the same either way.
    ``max_splits``: no more splits than this (``None``: no bound). The merge reads every split's
    partial output, empty or not, so at a short context many splits cost more in the merge
    than they save in the kernel.
    ``whole_waves``: where the GPU's multiprocessor count is known, lower the split count to the one
    that needs the fewest waves of programs per unit of prefix (see `split_k.split_count`): the tiles
    of a full row block take most of a multiprocessor's shared memory, one program each, so 192
    programs on 132 multiprocessors run in two waves, the second less than half full.
    ``smem_bytes``: shared memory a program may use; fewer stages are launched where the query
    block and ``num_stages`` K/V blocks would not fit (float32 operands at 128-row blocks).
    ``measured``: whether the entry was tuned on that hardware.
    """

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    min_programs: int = 256
    min_chunk: int = 512
    smem_bytes: int = 99 * 1024
    split_by_length: bool = False
    max_splits: int | None = None
    whole_waves: bool = False
    measured: bool = False

    def __post_init__(self):
        check_fields(self, powers_of_two=("block_m", "block_k"))
        if self.max_splits is not None:
            check_fields(self, positive=("max_splits",))

    def launch_warps(self, block_m: int) -> int:
        """Warps for a block of ``block_m <= self.block_m`` rows: proportional, at least 4."""
        return max(4, self.num_warps * block_m // self.block_m)

    def launch_stages(self, block_m: int, head_dim: int, itemsize: int) -> int:
        """Pipeline stages that fit ``smem_bytes``: the query block plus one K and one V block
        per stage (at least one stage)."""
        def smem(stages):
            return (block_m + 2 * stages * self.block_k) * head_dim * itemsize
        stages = self.num_stages
        while stages > 1 and smem(stages) > self.smem_bytes:
            stages -= 1
        return stages


TREE_ATTENTION_CONFIGS: dict[tuple[int, int], TreeAttentionConfig] = {
    (8, 0): TreeAttentionConfig(),
    (9, 0): TreeAttentionConfig(block_m=128, block_k=64, num_warps=8, num_stages=3,
                                min_programs=512, min_chunk=128, smem_bytes=200 * 1024,
                                split_by_length=True, max_splits=8, whole_waves=True,
                                measured=True),
    (10, 0): TreeAttentionConfig(block_m=128, block_k=64, num_warps=8, num_stages=3,
                                 min_programs=592, min_chunk=128, smem_bytes=200 * 1024),
    (12, 0): TreeAttentionConfig(block_m=64, block_k=32, num_warps=4, num_stages=2,
                                 min_programs=752, min_chunk=128),
}

MOSAIC_TREE_ATTENTION_CONFIGS: dict[tuple[int, int], TreeAttentionConfig] = {
    (9, 0): TreeAttentionConfig(block_m=64, block_k=64, num_warps=4, num_stages=2,
                                min_programs=264, min_chunk=512),
}


def tree_attention_config(capability: tuple[int, int] | None = None) -> TreeAttentionConfig:
    """The table entry for ``capability`` (default: the first local device's).

    An exact match wins, then the entry of the same major version with the highest minor
    version not above it, then the Ampere default.
    """
    return _lookup(TREE_ATTENTION_CONFIGS, device_capability() if capability is None else capability)


def _lookup(table: dict, capability: tuple[int, int]):
    """``table[capability]``, else the entry of the same major version with the highest minor version
    not above it, else the Ampere entry ``(8, 0)``."""
    if capability in table:
        return table[capability]
    same_major = [c for c in table if c[0] == capability[0] and c <= capability]
    return table[max(same_major)] if same_major else table[(8, 0)]


def device_capability() -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of the first local device; ``(0, 0)`` off CUDA."""
    device = jax.local_devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return (0, 0)
    major, minor = str(capability).split(".")
    return int(major), int(minor)


def mosaic_interpret_params():
    """The Mosaic GPU interpreter's parameters (``interpret=`` of ``plgpu.kernel``: run on the CPU)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:  # JAX 0.10 keeps the Mosaic GPU interpreter private
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


DEFAULT_MULTIPROCESSORS = 132  # an H100 / H200: what launch policies assume where the device does not say


def is_pow2(n) -> bool:
    """Whether ``n`` is an int power of two (1 included)."""
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def device_multiprocessors() -> int | None:
    """Streaming multiprocessors of the first local device; ``None`` off CUDA or where JAX does not say."""
    device = jax.local_devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return count if isinstance(count, int) and count >= 1 else None


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling of one product. ``block_m`` rows of ``x`` (a power of two >= 16), ``block_n``
    columns and ``block_k`` rows of ``w`` per tile, ``splits`` K chunks (split-K), Triton
    ``num_warps`` and pipelining depth ``num_stages``."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_fields(self, powers_of_two=("block_m", "block_n", "block_k"), positive=("splits", "num_stages"),
                     warps=("num_warps",))


@dataclasses.dataclass(frozen=True)
class MatmulPolicy:
    """How the skinny matmul is tiled on one GPU generation (see `matmul_config`).

    ``block_n``/``block_k``: weight tile for small row blocks; larger row blocks take ``block_k``
    down so that ``num_stages`` tiles of ``x`` and ``w`` fit ``smem_bytes``. ``min_programs``: K is
    split until the grid has at least this many programs. ``measured``: whether the entry was tuned
    on that hardware.
    """

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_programs: int = 256
    smem_bytes: int = 99 * 1024
    measured: bool = False


# (9, 0): the fastest of a 32-config sweep at Qwen3-8B's projections, M = 1 and 16, on an H200
# (experiments/bench_matmul.py --sweep; BENCHMARKS.md). The Blackwell entries scale its program
# target by the SM count and, for sm_120, keep tiles that fit its ~100 KB of shared memory.
MATMUL_POLICIES: dict[tuple[int, int], MatmulPolicy] = {
    (8, 0): MatmulPolicy(),
    (9, 0): MatmulPolicy(block_n=128, block_k=128, num_warps=4, num_stages=3, min_programs=528,
                         smem_bytes=200 * 1024, measured=True),
    (10, 0): MatmulPolicy(block_n=128, block_k=128, num_warps=4, num_stages=3, min_programs=592,
                          smem_bytes=200 * 1024),
    (12, 0): MatmulPolicy(block_n=64, block_k=128, num_warps=4, num_stages=3, min_programs=752),
}


def matmul_policy(capability: tuple[int, int]) -> MatmulPolicy:
    """The `MATMUL_POLICIES` entry for ``capability`` (same rule as `tree_attention_config`)."""
    return _lookup(MATMUL_POLICIES, capability)


def matmul_config(policy: MatmulPolicy, m: int, k: int, n: int, gated: bool = False) -> MatmulConfig:
    """The tiling of an ``[m, k] @ [k, n]`` product under ``policy`` (`matmul_policy` of the GPU):
    row blocks of the next power of two of ``m`` (16 to 128), the policy's weight tile, and enough K
    splits for its ``min_programs`` (a ``gated`` product's programs each cover a gate and an up
    block, so it has half as many column blocks)."""
    block_m = min(128, max(16, 1 << max(m - 1, 0).bit_length()))
    block_k = policy.block_k
    while block_k > 32 and policy.num_stages * (block_m + policy.block_n) * block_k * 2 > policy.smem_bytes:
        block_k //= 2
    programs = -(-m // block_m) * -(-(n // 2 if gated else n) // policy.block_n)
    tiles = -(-k // block_k)
    splits = max(1, min(-(-policy.min_programs // programs), tiles // 2))
    return MatmulConfig(block_m=block_m, block_n=policy.block_n, block_k=block_k, splits=splits,
                        num_warps=policy.num_warps if block_m <= 64 else 2 * policy.num_warps,
                        num_stages=policy.num_stages)
