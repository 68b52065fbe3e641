"""Which implementation runs each hot spot of a round: the one place that chooses.

Every switch (``attention_impl``, ``matmul_impl``, ``sampler_impl``, ``build_impl``) takes the same vocabulary,
`IMPLS`:

- ``"xla"``: the plain-jnp reference beside each kernel in ``pallas_kernels/``, compiled by XLA.
  It runs on every backend and is what the kernels are checked against.
- ``"pallas"``: the Pallas kernel (Triton lowering); needs a CUDA GPU.
- ``"interpret"``: the same kernel run by the Pallas interpreter, on any backend (slow; tests).
- ``"auto"``: the fastest measured choice for the device, by this table (docs/design.md gives
  the measurements behind it):

  ============  =======================================================  =========
  hot spot      CUDA GPU of compute capability >= 8.0                     elsewhere
  ============  =======================================================  =========
  attention     pallas when ``head_dim`` is a power of two >= 16 and       xla
                q/k/v share a float dtype (`tree_attention.kernel_supports`)
  q/k norm +    pallas, one kernel (`qk_norm_rope_write`) when head counts  xla
  RoPE + K/V    and ``head_dim / 2`` are powers of two, without a mesh:
  cache write   the AR round 5.36 -> 5.04 ms on an H200
                (BENCHMARKS.md); on sm_90 it sums the q/k/v product's
                split-K partials itself (`QKV_PARTIALS`). Where the norms
                run alone (the packed rows of ``budget_policy="batch"``),
                xla: the one-launch `qk_norm_rope` measured no faster than
                XLA's fusions; the write alone (that path, the drafter's
                prefill) is the `kv_write` kernel where its heads are
                powers of two
  matmul        xla: XLA's GEMMs (library kernels at 16 rows on an         xla
                H100) streamed the decode step's weights faster than
                the skinny-matmul kernel at every
                Qwen3-8B projection but one on an H200 (BENCHMARKS.md);
                on sm_90 without a mesh, products of fewer than 16 rows
                are zero-padded to 16 (`XLA_MIN_ROWS`: the decode step
                6.91 -> 6.44 ms on an H200), and products of 17 rows or
                more with a residual and the next RMSNorm are a split-K
                finished by the `residual_norm` kernel
                (`RESIDUAL_NORM_MIN_ROWS`: the DDTree rounds' device time
                1.4-2.1% less on an H100); the q/k/v product is a split-K
                whose partials go to the norm + RoPE + write kernel
                (`partials_product`, `QKV_PARTIALS`); both split-Ks up
                to 8 x 65 rows (`SPLIT_K_MAX_ROWS`): a prefill's
                products are plain GEMMs (the 8k prefill 4.5% faster)
  sampler       pallas without a mesh; xla under a mesh (XLA partitions    xla
                the jnp walk; the kernel is not wrapped in ``shard_map``)
  ============  =======================================================  =========

The tree build (``build_impl``): its beam and global order are Pallas kernels on a supported GPU
without a mesh, XLA's ops elsewhere (``ddtree_jax.tree``). Up to budget 32 (`ONE_PROGRAM_BUILD_MAX_BUDGET`;
16 is the CLI's default) the one-program kernel (`pallas_kernels.tree_build`, each budget built at the
next power of two); from 33 to 1,024 (uncapped) the wide build (`pallas_kernels.tree_build_wide`, a launch
a depth over many programs a request). On an H100 at batch 1 and K = 4 the beam and order took 0.037 /
0.053 ms by the one-program kernel at B = 16 / 32 (XLA's 0.109 / 0.117), and 0.068 / 0.076 ms by the wide
build at B = 64 / 128 (the one-program kernel 0.095 at 64; XLA's 0.129 / 0.128); uncapped at B = 512,
0.205–0.213 ms against XLA's 0.87–0.92 (BENCHMARKS.md). ``pallas`` runs them so; ``auto`` does for one
request, and for batches of several up to budget 128 (`WIDE_BUILD_MAX_BATCHED_BUDGET`; at batch 8 the
wide build's 0.072 / 0.081 ms at B = 64 / 128 against XLA's 0.164 / 0.204), XLA's ops beyond.

With a ``("dp", "tp")`` mesh, the attention kernel runs per device inside ``shard_map``
(`shard_attention`); the XLA paths are partitioned by XLA itself. Kernel configs come from the
tables of ``pallas_kernels/configs.py``, keyed by the device's compute capability.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddtree_jax import tree as tree_lib
from ddtree_jax.sharding import cache_spec, tp_size
from ddtree_jax.verify import result_from_path, verify_from_coins
from pallas_kernels import configs
from pallas_kernels.kv_write import kernel_supports as kv_write_supports
from pallas_kernels.kv_write import kv_write
from pallas_kernels.kv_write_reference import kv_write_reference
from pallas_kernels.matmul import matmul
from pallas_kernels.matmul_reference import matmul_reference, rms_norm, split_partials
from pallas_kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_write
from pallas_kernels.qk_norm_rope import kernel_supports as qk_norm_rope_supports
from pallas_kernels.qk_norm_rope_reference import check_queries, qk_norm_rope_reference, summed_partials
from pallas_kernels.residual_norm import kernel_supports as residual_norm_supports
from pallas_kernels.residual_norm import residual_norm
from pallas_kernels.tree_attention import kernel_supports, tree_attention
from pallas_kernels.tree_attention_reference import tree_attention_reference
from pallas_kernels.tree_build import kernel_supports as tree_build_supports
from pallas_kernels.tree_build import tree_nodes
from pallas_kernels.tree_build_wide import kernel_supports as wide_build_supports
from pallas_kernels.tree_build_wide import tree_nodes_wide
from pallas_kernels.tree_sampling import SamplerConfig, tree_sample

IMPLS = ("auto", "xla", "pallas", "interpret")
MIN_CAPABILITY = (8, 0)


def check_impl(name: str, impl) -> str:
    """``impl`` if it is one of `IMPLS`, else a ``ValueError`` naming the switch ``name``."""
    if impl not in IMPLS:
        raise ValueError(f"{name} must be one of {IMPLS}, got {impl!r}")
    return impl


def pallas_gpu() -> bool:
    """Whether the default backend is a CUDA GPU the Pallas kernels support (compute capability
    >= 8.0)."""
    return jax.default_backend() == "gpu" and configs.device_capability() >= MIN_CAPABILITY


def _kernel_capability(impl: str) -> tuple[int, int]:
    """The config key of a kernel call: the local GPU's capability, or the Ampere entry when the
    kernel is interpreted."""
    return MIN_CAPABILITY if impl == "interpret" else configs.device_capability()


def attention_fn(impl: str, mesh: Mesh | None = None, *, split_heads: bool = True):
    """The attention of ``impl`` (see the module docstring), with the signature of
    ``tree_attention_reference`` (``layer`` included: the kernel reads a layer of the stacked
    cache in place).

    With a ``mesh``, the kernel runs per device inside ``shard_map`` (`shard_attention`; batch over
    ``"dp"`` and, with ``split_heads``, query heads and their KV heads over ``"tp"``); the XLA path
    ignores the mesh.
    """
    impl = check_impl("attention_impl", impl)
    if impl == "xla" or (impl == "auto" and not pallas_gpu()):
        return tree_attention_reference
    config = configs.tree_attention_config(_kernel_capability(impl))
    kernel = functools.partial(tree_attention, config=config, interpret=impl == "interpret")
    if impl == "auto":
        kernel = _where_supported(kernel)
    return kernel if mesh is None else shard_attention(kernel, mesh, split_heads=split_heads)


def _where_supported(kernel):
    """``kernel`` for operands it supports (`kernel_supports`, decided when traced), else the
    reference."""
    def attend(q_BNHD, k, v, lengths_B, mask_BNM, *, scale, layer=None):
        fn = kernel if kernel_supports(q_BNHD, k) else tree_attention_reference
        return fn(q_BNHD, k, v, lengths_B, mask_BNM, scale=scale, layer=layer)
    return attend


def qk_norm_rope_fn(impl: str, mesh: Mesh | None = None):
    """The q/k/v split, q/k RMSNorm and RoPE of ``impl`` (the models pass their ``attention_impl``),
    with the signature of ``qk_norm_rope_reference``. ``"auto"`` is the reference everywhere
    (measured); with ``"pallas"`` or ``"interpret"`` the kernel runs where it applies
    (`qk_norm_rope.kernel_supports`, decided when traced) and without a mesh; elsewhere, and under a
    mesh (where XLA partitions the jnp step over the heads), the reference."""
    impl = check_impl("attention_impl", impl)
    if impl in ("xla", "auto") or mesh is not None:
        return qk_norm_rope_reference
    kernel = functools.partial(qk_norm_rope, interpret=impl == "interpret")

    def split_norm_rotate(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, *, heads, kv_heads, eps):
        fn = kernel if qk_norm_rope_supports(qkv_BNC, heads, kv_heads) else qk_norm_rope_reference
        return fn(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, heads=heads, kv_heads=kv_heads, eps=eps)

    return split_norm_rotate


def _reference_only(impl: str, mesh: Mesh | None) -> bool:
    """Whether a kernel that is not partitioned gives way to its reference: for ``"xla"``, under a mesh
    (XLA partitions the reference), and for ``"auto"`` off a supported GPU."""
    return impl == "xla" or mesh is not None or (impl == "auto" and not pallas_gpu())


def kv_write_fn(impl: str, mesh: Mesh | None = None):
    """The write of a forward's new K/V into the stacked caches for ``impl`` (the models pass their
    ``attention_impl``), with the signature of ``kv_write_reference``. The kernel (`kv_write`, the
    caches updated in place) runs where it applies (`kv_write.kernel_supports`, decided when traced)
    for ``"pallas"``, ``"interpret"`` and, on a supported GPU, ``"auto"``; under a mesh (where XLA
    partitions the scatter over the cache's shards) and for ``"xla"``, the reference."""
    impl = check_impl("attention_impl", impl)
    if _reference_only(impl, mesh):
        return kv_write_reference
    kernel = functools.partial(kv_write, interpret=impl == "interpret")

    def write(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, *, layer):
        fn = kernel if kv_write_supports(k_LBKSD) else kv_write_reference
        return fn(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, layer=layer)

    return write


def qk_norm_rope_write_fn(impl: str, mesh: Mesh | None = None):
    """A layer's q/k norms and RoPE with the write of its new K/V into the stacked caches, for ``impl``
    (the models pass their ``attention_impl``), with the signature of ``qk_norm_rope_write_reference``.
    One kernel (`qk_norm_rope_write`) where it applies (`qk_norm_rope.kernel_supports`, decided when
    traced: the caches' heads are the projection's, so `kv_write.kernel_supports` holds too) for
    ``"pallas"``, ``"interpret"`` and, on a supported GPU, ``"auto"``; elsewhere `qk_norm_rope_fn`
    then `kv_write_fn` of the same ``impl``."""
    impl = check_impl("attention_impl", impl)
    split, write = qk_norm_rope_fn(impl, mesh), kv_write_fn(impl, mesh)

    def separately(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, k_LBKSD, v_LBKSD, lengths_B, *, layer, queries=None,
                   partials_SRC=None, **kwargs):
        num = qkv_BNC.shape[1]
        queries = check_queries(queries, num)
        if partials_SRC is not None:
            qkv_BNC = summed_partials(partials_SRC, qkv_BNC.shape, qkv_BNC.dtype)
        q_BNHD, k_BNKD, v_BNKD = split(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, **kwargs)
        return (q_BNHD[:, num - queries:], *write(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, layer=layer))

    if _reference_only(impl, mesh):
        return separately
    kernel = functools.partial(qk_norm_rope_write, interpret=impl == "interpret")

    def fused(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, k_LBKSD, v_LBKSD, lengths_B, *, layer, heads, kv_heads,
              eps, queries=None, partials_SRC=None):
        fn = kernel if qk_norm_rope_supports(qkv_BNC, heads, kv_heads) else separately
        return fn(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, k_LBKSD, v_LBKSD, lengths_B, layer=layer,
                  heads=heads, kv_heads=kv_heads, eps=eps, queries=queries, partials_SRC=partials_SRC)

    return fused


# Fewer rows than this go to XLA's GEMM zero-padded to this many, by CUDA compute capability (``auto``
# without a mesh; off CUDA the capability is (0, 0)). Measured on an H200 in one process
# (experiments/bench_models.py --matmul-impls xla,auto): the batch-1 decode forward, whose products
# have one row, took 5.35 ms of device time as it is and 4.98 ms padded to 16 rows (BENCHMARKS.md).
XLA_MIN_ROWS = {(9, 0): 16}
# From this many rows, a product with a residual whose result the next product normalises (the attention
# output and down projections) runs as a split-K of `RESIDUAL_NORM_SPLITS` K chunks whose partials the
# `residual_norm` kernel sums, adds to the residual and normalises in one launch (``auto`` without a mesh).
# On an H200 the kernel took 3.5 us against XLA's two fusions' 5.2 at 64 rows, and 2.8 against 3.0 at 16;
# inside the rounds on an H100 the DDTree rounds at B = 16 / 63 / 64 (17 to 65 rows) took 1.4-2.1% less
# device time (BENCHMARKS.md). Fewer rows come padded (`XLA_MIN_ROWS`), and padding the normalised rows
# again for the next product would cost a launch.
RESIDUAL_NORM_MIN_ROWS = {(9, 0): 17}
# On these devices (``auto`` without a mesh) the q/k/v product hands its split-K partials to the q/k norm +
# RoPE + K/V-write kernel, which sums them (`partials_product`), in place of XLA's sum, a launch a layer.
# On an H100 the AR and DDTree B = 63 rounds took 0.6% and 1.0% less device time than with XLA's sum
# (BENCHMARKS.md).
QKV_PARTIALS = {(9, 0)}
# The chunks of a split-K written out (`split_k_chunks`): the fewest, a power of two from
# `SPLIT_K_MIN_CHUNKS`, of at most this many K columns. With chunks of 3,072 (the down product in 4) XLA
# split each chunk again and summed the halves in a fusion of its own before the `residual_norm` kernel
# (3.6-5.9 us a layer at 64 / 65 rows on an H100); in 8 chunks the DDTree rounds at B = 63 / 64 took 1.7% /
# 2.4% less device time (BENCHMARKS.md). XLA's own split of the q/k/v product is 4 chunks at 16 and 64 rows.
SPLIT_K_MAX_CHUNK = 1536
SPLIT_K_MIN_CHUNKS = 4
# Products of more rows than this (a prefill's) stay XLA's GEMM, without the split-K above: its float32
# partials, chunks x M x N of them written and read again, outweigh the weights from about 512 rows (the
# attention output's 4 chunks), and XLA's GEMM has rows enough to fill the GPU. In one process on an H100 the
# prefill of an 8k prompt took 403 ms against 422 with the split-K, and of a 1k prompt 31.7 against 35.9
# (BENCHMARKS.md, 2026-12-07). The split-K was measured up to 8 requests of 65 rows.
SPLIT_K_MAX_ROWS = 8 * 65


def matmul_fn(impl: str, mesh: Mesh | None = None):
    """The projection of ``impl`` (see the module docstring), with the signature of ``matmul_reference``:
    ``fn(x_MK, w_KN, *, norm_K=None, eps=1e-6, gated=False, out_dtype=None, columns=None, residual_MN=None,
    then_norm_N=None, with_partials=False)``; with ``then_norm_N`` (the next product's RMSNorm weight) it
    returns ``(result, normed)``, ``normed`` being ``rms_norm(result, then_norm_N, eps)`` where the
    implementation computes it with the product and ``None`` where it leaves it to the next product's
    prologue; with ``with_partials``, ``(result, partials)``, the float32 split-K partials where the
    implementation hands them over and ``None`` elsewhere.

    ``auto`` is XLA everywhere (measured): its products of few rows padded (`XLA_MIN_ROWS`) on a GPU
    listed there and without a mesh, its products of many rows with a residual and ``then_norm_N``
    finished by the `residual_norm` kernel (`residual_norm_product`, `RESIDUAL_NORM_MIN_ROWS`), and its
    products asked ``with_partials`` written as a split-K (`partials_product`, `QKV_PARTIALS`), both up
    to `SPLIT_K_MAX_ROWS` rows;
    ``"pallas"`` is the skinny-matmul kernel, tiled by the device's `configs.matmul_policy`; it is not
    partitioned, so under a ``mesh`` only the XLA path runs."""
    impl = check_impl("matmul_impl", impl)
    if impl in ("xla", "auto"):
        capability = configs.device_capability()
        local = impl == "auto" and mesh is None
        min_rows = XLA_MIN_ROWS.get(capability) if local else None
        product = matmul_reference if min_rows is None else rows_padded(matmul_reference, min_rows)
        if not (local and pallas_gpu()):
            return product
        plain = product
        if capability in RESIDUAL_NORM_MIN_ROWS:
            product = residual_norm_product(product, RESIDUAL_NORM_MIN_ROWS[capability], split_k_chunks)
        if capability in QKV_PARTIALS:
            product = partials_product(product, min_rows or 1, split_k_chunks)
        return up_to_rows(product, plain, SPLIT_K_MAX_ROWS)
    if mesh is not None:
        raise ValueError(f"matmul_impl={impl!r} does not run under a mesh (the kernel is not partitioned); "
                         f"use 'auto' or 'xla'")
    policy = configs.matmul_policy(_kernel_capability(impl))

    def product(x_MK, w_KN, *, columns=None, gated=False, then_norm_N=None, with_partials=False, **kwargs):
        m, k = x_MK.shape
        n = w_KN.shape[1] if columns is None else columns[1] - columns[0]
        y_MN = matmul(x_MK, w_KN, columns=columns, gated=gated, config=configs.matmul_config(policy, m, k, n, gated),
                      interpret=impl == "interpret", **kwargs)
        return (y_MN, None) if then_norm_N is not None or with_partials else y_MN

    return product


def up_to_rows(product, plain, max_rows: int):
    """``product`` for an ``x`` of at most ``max_rows`` rows and ``plain`` for more (both with the signature of
    ``matmul_reference``), chosen when traced."""
    def bounded(x_MK, w_KN, **kwargs):
        return (product if x_MK.shape[0] <= max_rows else plain)(x_MK, w_KN, **kwargs)

    return bounded


def rows_padded(product, min_rows: int):
    """``product`` (the signature of ``matmul_reference``) run on ``x`` zero-padded to ``min_rows``
    rows when it has fewer, the result (each array of it, with ``then_norm_N``) cut back to ``x``'s rows.
    Rows of a product are independent, so only the GEMM that XLA picks for the shape changes."""
    def padded(x_MK, w_KN, *, residual_MN=None, **kwargs):
        m = x_MK.shape[0]
        if m >= min_rows:
            return product(x_MK, w_KN, residual_MN=residual_MN, **kwargs)
        residual = None if residual_MN is None else _pad_rows(residual_MN, min_rows)
        out = product(_pad_rows(x_MK, min_rows), w_KN, residual_MN=residual, **kwargs)
        return tuple(None if y is None else y[:m] for y in out) if isinstance(out, tuple) else out[:m]

    return padded


def _pad_rows(x_MK, min_rows: int):
    """``x`` with zero rows appended up to ``min_rows`` rows (as it is when it has as many)."""
    return jnp.pad(x_MK, ((0, max(min_rows - x_MK.shape[0], 0)), (0, 0)))


def _no_options(kwargs) -> bool:
    """Whether a product's remaining keywords ask for nothing (each ``None`` or ``False``)."""
    return all(v is None or v is False for v in kwargs.values())


def split_k_chunks(k: int) -> int:
    """The K chunks of a split-K written out for a kernel to sum (`residual_norm_product`,
    `partials_product`): the fewest, a power of two from `SPLIT_K_MIN_CHUNKS`, of at most
    `SPLIT_K_MAX_CHUNK` columns (4 for K = 4096, 8 for 12,288)."""
    splits = SPLIT_K_MIN_CHUNKS
    while k > splits * SPLIT_K_MAX_CHUNK:
        splits *= 2
    return splits


def residual_norm_product(product, min_rows: int, splits: Callable[[int], int], interpret: bool = False):
    """``product`` (the signature of ``matmul_reference``), except that a plain product of at least
    ``min_rows`` rows with a residual and ``then_norm_N`` runs as `split_partials` of ``splits(K)`` K chunks
    finished by the `residual_norm` kernel (``interpret``: in the Pallas interpreter): ``(residual +
    product, its RMSNorm)``, where the kernel applies (`residual_norm.kernel_supports`, the chunks dividing
    K, one dtype; decided when traced)."""
    def fused(x_MK, w_KN, *, residual_MN=None, then_norm_N=None, eps=1e-6, **kwargs):
        m, k = x_MK.shape
        chunks = splits(k)
        plain = _no_options(kwargs)  # no prologue, SwiGLU, columns, out dtype
        applies = (plain and residual_MN is not None and then_norm_N is not None and m >= min_rows
                   and k % chunks == 0 and x_MK.dtype == residual_MN.dtype == then_norm_N.dtype
                   and residual_norm_supports(jax.ShapeDtypeStruct((chunks, m, w_KN.shape[1]), jnp.float32)))
        if not applies:
            return product(x_MK, w_KN, residual_MN=residual_MN, then_norm_N=then_norm_N, eps=eps, **kwargs)
        return residual_norm(split_partials(x_MK, w_KN, chunks), residual_MN, then_norm_N, eps=eps,
                             interpret=interpret)

    return fused


def partials_product(product, min_rows: int, splits: Callable[[int], int]):
    """``product`` (the signature of ``matmul_reference``), except that a product asked ``with_partials``,
    with no keyword but ``norm_K`` and ``eps``, runs as `split_partials` of ``splits(K)`` chunks on ``x``
    (normalised by ``norm_K``) zero-padded to ``min_rows`` rows when it has fewer (as `rows_padded` does, so
    that XLA's GEMM is the one it picks for them): ``(result, partials [S, max(M, min_rows), N])``, the
    result their `summed_partials`. A consumer that takes the partials (`qk_norm_rope_write_fn`) sums them
    in its own launch, and XLA drops the sum; any other reads the result."""
    def split(x_MK, w_KN, *, with_partials=False, norm_K=None, eps=1e-6, **kwargs):
        m, k = x_MK.shape
        chunks = splits(k)
        plain = _no_options(kwargs)  # no SwiGLU, columns, residual, out dtype
        if not (with_partials and plain and k % chunks == 0):
            return product(x_MK, w_KN, with_partials=with_partials, norm_K=norm_K, eps=eps, **kwargs)
        # Padded, then normalised (zero rows stay zero), as `rows_padded` runs the prologue: normalised
        # first, XLA ran the norm as two fusions, a reduction and the scaling with the pad.
        x_RK = _pad_rows(x_MK, min_rows)
        x_RK = x_RK if norm_K is None else rms_norm(x_RK, norm_K, eps)
        partials_SRN = split_partials(x_RK, w_KN, chunks)
        return summed_partials(partials_SRN, (1, m, w_KN.shape[1]), x_MK.dtype)[0], partials_SRN

    return split


def sampler_fn(impl: str, mesh: Mesh | None = None, config: SamplerConfig | None = None):
    """Step 5 of a round for ``impl`` (see the module docstring): ``fn(tree, logits_BNV, coins_BN,
    final_coins_B, temperature_B, top_k_B, top_p_B) -> VerifyResult``, the same result for every
    implementation. Under a ``mesh``, ``auto`` is the jnp walk (XLA partitions it; the kernel is not
    wrapped in ``shard_map``). ``config``: the fused kernel's launch (default `SamplerConfig()`, the
    measured one)."""
    impl = check_impl("sampler_impl", impl)
    if impl == "xla" or (impl == "auto" and (mesh is not None or not pallas_gpu())):
        return verify_from_coins

    def fused(tree, logits, coins, final_coins, temperature, top_k, top_p):
        path = tree_sample(tree.tokens, tree.parents, logits, coins, final_coins, temperature, top_k, top_p,
                           max_depth=tree.max_depth, config=config or SamplerConfig(), interpret=impl == "interpret")
        return result_from_path(*path, tree.tokens.shape[1])

    return fused


# The one-program tree-build kernel builds budgets up to this where the wide build may run; larger ones the
# wide build. On an H100 at batch 1 and K = 4 their beam and order took 0.037 / 0.053 / 0.095 ms and
# 0.059 / 0.065 / 0.068 ms at B = 16 / 32 / 64 (XLA's 0.109 / 0.117 / 0.129; BENCHMARKS.md).
ONE_PROGRAM_BUILD_MAX_BUDGET = 32
# Under ``auto`` a batch of several requests takes the wide build up to this budget, XLA's ops beyond: at
# batch 8 and K = 4 on an H100 the wide build's beam and order took 0.072 / 0.081 ms at B = 64 / 128, the
# one-program kernel's 0.100 at 64 and XLA's 0.164 / 0.204; larger budgets at batch 8 are not timed.
WIDE_BUILD_MAX_BATCHED_BUDGET = 128


def tree_build_fn(impl: str, mesh: Mesh | None = None):
    """Step 2 of a round for ``impl`` (see the module docstring): ``fn(draft_logits_BLV, root_B,
    draft_temperature, *, budget, topk_cap) -> DraftTree``, the tree of `tree.build_tree_unchecked`
    for every implementation. The kernel (`pallas_kernels.tree_build`, one program per request, the
    launch of `tree_build.tree_build_config`) does the beam and the global order up to budget
    `ONE_PROGRAM_BUILD_MAX_BUDGET`, and the wide build (`pallas_kernels.tree_build_wide`) those of larger
    budgets it takes (`tree_build_wide.kernel_supports`); under ``auto`` a batch of several requests
    takes the wide build up to `WIDE_BUILD_MAX_BATCHED_BUDGET` and XLA's ops beyond (shapes decided when
    traced). The vocabulary top-k before them is XLA's. Under a mesh the
    XLA path runs (the kernels are not wrapped in ``shard_map``)."""
    impl = check_impl("build_impl", impl)
    if _reference_only(impl, mesh):
        return tree_lib.build_tree_unchecked

    def build(draft_logits_BLV, root_B, draft_temperature, *, budget, topk_cap):
        depth, vocab = draft_logits_BLV.shape[1:]
        k = tree_lib.top_k_width(budget, topk_cap, vocab)
        batched_auto = impl == "auto" and draft_logits_BLV.shape[0] > 1
        wide = wide_build_supports(budget, k, depth) and not (batched_auto and budget > WIDE_BUILD_MAX_BATCHED_BUDGET)
        if tree_build_supports(budget, k, depth) and budget <= ONE_PROGRAM_BUILD_MAX_BUDGET:
            nodes_fn = tree_nodes
        elif wide:
            nodes_fn = tree_nodes_wide
        else:
            return tree_lib.build_tree_unchecked(draft_logits_BLV, root_B, draft_temperature, budget=budget,
                                                 topk_cap=topk_cap)
        lp_BLK, tok_BLK = tree_lib.draft_top_k(draft_logits_BLV, draft_temperature, k)
        nodes = nodes_fn(lp_BLK, tok_BLK, budget=budget, interpret=impl == "interpret")
        return tree_lib.tree_from_nodes(root_B, *nodes, max_depth=depth)

    return build


def shard_attention(attend_fn, mesh: Mesh, *, split_heads: bool):
    """``attend_fn`` (the signature of ``tree_attention_reference``, e.g. a Pallas kernel) run per
    device inside ``shard_map`` over ``mesh``, for use inside jit.

    Every operand is split over ``"dp"`` along its batch axis. With ``split_heads`` (the target),
    device j of ``"tp"`` takes the query heads ``[j H/tp, (j + 1) H/tp)`` (the row block of ``wo``
    it holds) and the KV heads they read: its own block of a cache split over KV heads by
    `sharding.cache_spec` (block j of H/tp query heads reads exactly KV block j of K/tp heads, the
    GQA group being H/K), else `_local_kv_heads` of the replicated cache. Without ``split_heads``
    (the replicated drafter and its cache), heads stay whole and every ``"tp"`` device computes the
    same output. Returns ``[B, N, H, D]`` laid out like ``q``'s in_spec.
    """
    tp = tp_size(mesh) if split_heads else 1
    q_spec = P("dp", None, "tp" if split_heads else None, None)

    def attend(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale, layer=None):
        num_heads, num_kv = q_BNHD.shape[2], k_BKSD.shape[-3]
        kv_spec = cache_spec(num_kv, tp, over_heads=split_heads)
        kv_spec = kv_spec if layer is not None else P(*kv_spec[1:])

        def body(q_BNHD, k, v, lengths_B, mask_BNM):
            if kv_spec[-3] is None and tp > 1:  # heads split, cache replicated: cut this device's heads
                k, v = (k, v) if layer is None else (k[layer], v[layer])
                return _local_kv_heads(functools.partial(attend_fn, scale=scale), q_BNHD, k, v, lengths_B,
                                       mask_BNM, group=num_heads // num_kv)
            return attend_fn(q_BNHD, k, v, lengths_B, mask_BNM, scale=scale, layer=layer)
        # check_vma off: a pallas_call does not declare how its outputs vary over mesh axes.
        sharded = jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P("dp"), P("dp", None, None)),
                                out_specs=q_spec, check_vma=False)
        return sharded(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM)

    return attend


def _local_kv_heads(attend_fn, q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, group):
    """Inside `shard_attention`, cache replicated over ``"tp"`` (``tp`` does not divide the KV
    heads): attend with this device's ``h = H/tp`` query heads ``[j h, (j + 1) h)`` over only the KV
    heads they read, cut from the whole cache (global query head ``q`` reads KV head ``q // group``).
    When ``h`` divides ``group`` all of them read KV head ``j h // group``: one head is cut and GQA
    packing is kept. Otherwise the KV head of each query head is gathered (group 1 per device).
    """
    local = q_BNHD.shape[2]
    num_kv = 1 if group % local == 0 else local
    first = jax.lax.axis_index("tp") * local
    kv_K = (first + jnp.arange(num_kv) * (local // num_kv)) // group
    return attend_fn(q_BNHD, jnp.take(k_BKSD, kv_K, axis=1), jnp.take(v_BKSD, kv_K, axis=1),
                     lengths_B, mask_BNM)
