"""``tree_sample``: the kernels of the package launched in order, behind argument checks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.configs import check_fields
from pallas_kernels.tree_sampling.common import Request, candidate_block, draw_block, pow2_at_least
from pallas_kernels.tree_sampling.fallback import searched_rows
from pallas_kernels.tree_sampling.reference import inverse_temperature
from pallas_kernels.tree_sampling.rows import rows
from pallas_kernels.tree_sampling.stats import block_stats
from pallas_kernels.tree_sampling.walk import walk


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Launch configuration of the fused sampler.

    ``block_v``: vocabulary entries per block of the walk's passes over a row (a power of two
    >= 16; capped at the vocabulary's next power of two). ``num_warps``: Triton warps per program
    (the statistics pass uses at most 4). ``num_stages``: software-pipelining depth of the walk's
    vocabulary loops. ``capacity``: candidate slots per node row (a power of two >= 16): a truncated
    kept set that fits them is searched in registers; a larger one by passes over the row.
    ``stats_blocks``: vocabulary blocks (of 2,048 entries at most) per program of the statistics
    pass; more blocks mean fewer, longer programs. ``parallel_rows``: with at most this many node
    rows (``B * N``), the candidates of every truncated row are found before the walk, a program
    per row (and the whole GPU for the rows the sub-block maxima leave without); with more, each
    request's walk finds those of the rows it visits.
    """

    block_v: int = 32768
    num_warps: int = 8
    num_stages: int = 1
    capacity: int = 2048
    stats_blocks: int = 1
    parallel_rows: int = 1024

    def __post_init__(self):
        check_fields(self, powers_of_two=("block_v", "capacity"), positive=("num_stages", "stats_blocks"),
                     non_negative=("parallel_rows",), warps=("num_warps",))


def tree_sample(tokens_BN, parents_BN, logits_BNV, coins_BN, final_coins_B, temperature_B, top_k_B, top_p_B, *,
                max_depth: int, config: SamplerConfig = SamplerConfig(), interpret: bool = False):
    """Verify each request's tree against the target logits with the fused kernels (greedy and
    sampled requests mixed): the walk and final draw of ``tree_sample_reference``, from the same
    coins.

    Args:
      tokens_BN, parents_BN: int32 ``[B, N]`` node tokens (node 0 = the root) and parents (``-1``
        for the root and padding; children in ascending node index).
      logits_BNV: ``[B, N, V]`` float32 or bfloat16 target logits after each node.
      coins_BN: float32 ``[B, N]`` in ``(0, 1]``; node k's coin chooses among k's children.
      final_coins_B: float32 ``[B]`` in ``(0, 1]`` for the final draw.
      temperature_B, top_k_B, top_p_B: ``[B]`` sampling parameters (``temperature <= 0`` is greedy,
        ``top_k = 0`` and ``top_p >= 1`` are off).
      max_depth: at most this many drafts are accepted.
      config: launch configuration (``SamplerConfig``).
      interpret: run the kernels in the Pallas interpreter (any device) instead of Triton (CUDA).

    Returns:
      ``(accept_index_BD, emitted_BD)``, int32 ``[B, max_depth + 1]``, ``-1`` padded, as the
      reference. Probabilities are summed in another order than the reference, so they may differ
      in the last bits: paths and tokens agree except when a coin falls within that rounding of a
      boundary.
    """
    if not isinstance(config, SamplerConfig):
        raise ValueError(f"config must be a SamplerConfig, got {config!r}")
    if not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    if getattr(tokens_BN, "ndim", None) != 2:
        raise ValueError(f"tokens_BN must be [B, N], got shape {getattr(tokens_BN, 'shape', None)}")
    batch, num_nodes = tokens_BN.shape
    shapes = dict(parents_BN=(parents_BN, (batch, num_nodes)), coins_BN=(coins_BN, (batch, num_nodes)),
                  final_coins_B=(final_coins_B, (batch,)), temperature_B=(temperature_B, (batch,)),
                  top_k_B=(top_k_B, (batch,)), top_p_B=(top_p_B, (batch,)))
    for name, (x, shape) in shapes.items():
        if jnp.shape(x) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {jnp.shape(x)}")
    if getattr(logits_BNV, "ndim", None) != 3 or logits_BNV.shape[:2] != (batch, num_nodes):
        raise ValueError(f"logits_BNV must be [B={batch}, N={num_nodes}, V], got {getattr(logits_BNV, 'shape', None)}")
    return _tree_sample(jnp.asarray(tokens_BN, jnp.int32), jnp.asarray(parents_BN, jnp.int32), logits_BNV,
                        jnp.asarray(coins_BN, jnp.float32), jnp.asarray(final_coins_B, jnp.float32),
                        jnp.asarray(temperature_B, jnp.float32), jnp.asarray(top_k_B, jnp.int32),
                        jnp.asarray(top_p_B, jnp.float32), max_depth=max_depth, config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("max_depth", "config", "interpret"))
def _tree_sample(tokens_BN, parents_BN, logits_BNV, coins_BN, final_coins_B, temperature_B, top_k_B, top_p_B, *,
                 max_depth, config, interpret):
    batch, num_nodes, vocab = logits_BNV.shape
    block_v = min(config.block_v, pow2_at_least(vocab))
    draw = draw_block(block_v)
    request = Request(temperature_B, inverse_temperature(temperature_B), top_k_B, top_p_B)
    blocks = block_stats(logits_BNV, request.scale, pow2_at_least(num_nodes), draw, config.num_warps, interpret,
                         config.stats_blocks)
    prepared = batch * num_nodes <= config.parallel_rows
    block_c = candidate_block(block_v)
    stats, search_BN, slots = rows(logits_BNV, request, blocks, draw_block=draw, block_c=block_c,
                                   capacity=config.capacity, candidates=prepared, num_warps=config.num_warps,
                                   interpret=interpret)
    if prepared:
        stats, slots = lax.cond(jnp.any(search_BN != 0), lambda: searched_rows(
            logits_BNV, request, stats, search_BN, slots, block_c=block_c, capacity=config.capacity,
            num_warps=config.num_warps, interpret=interpret), lambda: (stats, slots))
    accept_BD, emitted_BD = walk(
        logits_BNV, tokens_BN, parents_BN, coins_BN, final_coins_B, request, stats, blocks,
        slots if prepared else None, max_depth=max_depth, block_v=block_v, draw_block=draw,
        capacity=config.capacity, num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret)
    return accept_BD[:, :max_depth + 1], emitted_BD[:, :max_depth + 1]
