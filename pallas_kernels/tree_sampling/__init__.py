"""Fused tree verification from target logits: the walk of ``reference.tree_sample_reference``
(target-only tree rejection sampling, thresholds 1), where the processed target row
(``z = logits * (1 / T)``, then top-k, then top-p) is never materialised and never sorted.

``tree_sample`` launches, in order (each module's docstring says when each of its paths runs):

1. ``stats``: the statistics pass, a program per node row and ``stats_blocks`` vocabulary blocks
   (one read of the logits): per block ``max z``, its first argmax and ``sum exp(z - block max)``,
   and the max of every 64-entry sub-block. Always.
2. ``rows``: a program per node row: its max, first argmax and mass; with at most
   ``parallel_rows`` node rows, also the candidates and kept-set boundary of a truncated row from
   its sub-block maxima alone (``candidates``, ``boundary``). Always.
3. ``fallback``: the floor passes over the whole GPU for the truncated rows step 2 left without
   candidates. Only with at most ``parallel_rows`` node rows and only when there are such rows.
4. ``walk``: a program per request walks its tree and makes the final draw (``draw``); with more
   than ``parallel_rows`` node rows it finds the candidates of the rows it visits itself. Always.

Every kernel takes its refs grouped in named tuples (``common``: ``Request``, ``BlockStats``,
``RowStats``, ``Slots``, ``Cut``; ``walk``: ``Tree``, ``Scratch``); buffers updated in place are
aliased by group (``common.aliases``).
"""

from pallas_kernels.tree_sampling.entry import SamplerConfig, tree_sample
from pallas_kernels.tree_sampling.reference import inverse_temperature, row_probs, tree_sample_reference

__all__ = ["SamplerConfig", "inverse_temperature", "row_probs", "tree_sample", "tree_sample_reference"]
