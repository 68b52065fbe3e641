"""The oracle's array containers (NumPy arrays, ``-1`` = none)."""

from typing import NamedTuple

import numpy as np


class Tree(NamedTuple):
    """A batch of draft trees; every array has ``N = budget + 1`` slots per request."""

    tokens: np.ndarray  # int32 [batch, N]
    parents: np.ndarray  # int32 [batch, N], -1 for the root and padding
    depths: np.ndarray  # int32 [batch, N], 0 for the root and padding
    logw: np.ndarray  # float32 [batch, N], cumulative draft log-probability, -inf for padding
    num_nodes: np.ndarray  # int32 [batch], real nodes including the root


class Retrieve(NamedTuple):
    """First-child / next-sibling encoding of a tree batch, int32 ``[batch, N]``, -1 = none."""

    index: np.ndarray
    next_token: np.ndarray
    next_sibling: np.ndarray


class VerifyResult(NamedTuple):
    """Outcome of one verification step (local node ids, ``-1`` padded)."""

    accept_index: np.ndarray  # int32 [batch, max_depth + 1], root first
    num_accepted: np.ndarray  # int32 [batch], drafts accepted (root excluded)
    predicts: np.ndarray  # int32 [batch, N], token emitted after each accepted-path node
    emitted: np.ndarray  # int32 [batch, max_depth + 1], accepted drafts then the final token
    bonus: np.ndarray  # int32 [batch], the final token
