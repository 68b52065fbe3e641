"""Generation: AR, DFlash chain and DDTree decoding rounds, greedy and sampled, batched.

Every method runs the same round (docs/design.md, "One round as data"), a pure function of the
donated decode state (`_round`); `generate` runs rounds in chunks inside one device loop
(`decode_rounds`), reading the state back once per chunk:

1. drafter forward on ``[root, MASK x L]`` plus the last round's accepted target features,
2. ``build_tree`` (DDTree: budget B, optional top-k cap; chain: ``topk_cap = 1``, budget L), then the
   budget policy's choice of the nodes to verify (`ddtree_jax.budget`; ``"fixed"`` keeps them all),
3. target forward over the tree with the ancestor mask (``"batch"``: over the kept nodes packed),
4. ``verify_from_coins`` (the same walk for greedy and sampled requests),
5. commit of the root and the accepted path in the target cache; their target features become the
   drafter's next context; the bonus token becomes the next root.

AR decoding is the degenerate tree: only the root (``N = 1``), no drafter, the final draw of the
walk is the sampled token. The root of a round is the last token whose K/V is not yet in the
target cache: after prefill, the last prompt token.

Each request carries its own length, sampling parameters and coin stream
(``fold_in(fold_in(key, request_id), round)``), so its tokens do not depend on the rest of the
batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ddtree_jax import budget as policies
from ddtree_jax import checks, costs, kernels, sharding
from ddtree_jax.models.cache import KVCache, commit, init_cache
from ddtree_jax.models.dflash import Drafter, append_context, check_pair, drafter_forward
from ddtree_jax.models.qwen3 import Target, target_forward, target_forward_packed
from ddtree_jax.sampling import batch_probs, coins_from_keys, request_keys
from ddtree_jax.tree import MAX_BUDGET, DraftTree, tree_attention_mask, tree_positions, with_token_ids
from ddtree_jax.verify import expected_acceptance

METHODS = ("ar", "chain", "ddtree")
# The named scopes of a round's steps, in order (`_round`): a device profile sums its ops by them
# (`ddtree_jax.experiments.profiling.scope_parts`).
ROUND_PARTS = ("draft", "build", "encode", "verify", "sample", "commit", "stats")


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    """Static description of a round (changing it recompiles)."""

    method: str
    budget: int
    topk_cap: int | None
    depth: int  # L, the drafter's block size - 1 (0 for AR)
    tap_layers: tuple[int, ...]
    attention_impl: str = "xla"  # one of kernels.IMPLS
    sampler_impl: str = "xla"  # one of kernels.IMPLS
    matmul_impl: str = "xla"  # one of kernels.IMPLS
    build_impl: str = "xla"  # one of kernels.IMPLS
    budget_policy: str = "fixed"  # one of budget.POLICIES
    cost_ms: tuple[float, ...] | None = None  # "adaptive": modelled round ms with 0 .. budget drafts

    def __post_init__(self):
        if self.budget_policy != "adaptive":
            return
        cost_ms = self.cost_ms
        if cost_ms is None or len(cost_ms) != self.budget + 1 or not all(np.isfinite(c) and c > 0 for c in cost_ms):
            raise ValueError(f"cost_ms must be {self.budget + 1} finite times > 0 (0 .. budget drafts), got {cost_ms}")

    @property
    def tree_budget(self) -> int:
        """Drafts each request's tree is built with (``"batch"``: room for more than ``budget``)."""
        return self.budget * (policies.BATCH_SPREAD if self.budget_policy == "batch" else 1)

    @property
    def num_nodes(self) -> int:
        """Tree slots per request (``N``)."""
        return 1 if self.method == "ar" else self.tree_budget + 1


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["target_cache", "drafter_cache", "root", "ctx_feats", "ctx_count", "tokens",
                 "num_generated", "done", "round"],
    meta_fields=[],
)
@dataclasses.dataclass
class DecodeState:
    """Everything a round reads and writes (donated to the round).

    ``root [B]``: the next round's root token. ``ctx_feats [B, L + 1, F]`` / ``ctx_count [B]``: target
    features of the tokens committed by the last round, not yet in the drafter cache.
    ``tokens [B, max_new + L + 1]``: generated ids so far (``-1`` after ``num_generated``).
    """

    target_cache: KVCache
    drafter_cache: KVCache | None
    root: jax.Array
    ctx_feats: jax.Array
    ctx_count: jax.Array
    tokens: jax.Array
    num_generated: jax.Array
    done: jax.Array
    round: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request target sampling parameters, ``[batch]`` each (``temperature = 0`` is greedy)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


jax.tree_util.register_dataclass(SamplingParams, data_fields=["temperature", "top_k", "top_p"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """Per-round statistics, host arrays ``[B]``: ``accepted`` drafts accepted (``-1`` for a request
    already finished), ``emitted`` tokens the round added to the request's output (after the cut at a
    stop token or ``max_new_tokens``; 0 once finished), ``tree_size`` real nodes incl. the root,
    ``expected`` exact expected accepted drafts; ``seconds`` the round's wall time (rounds run in
    chunks on the device: a chunk's time is shared equally by its rounds)."""

    accepted: np.ndarray
    emitted: np.ndarray
    tree_size: np.ndarray
    expected: np.ndarray
    seconds: float


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """``tokens [B, max_new_tokens]`` generated ids (``-1`` padded), ``lengths [B]``, per-round stats.

    Statistics, each over the rounds in which a request was live ("request-rounds"):

    - ``tau``: tokens returned per request-round, ``lengths.sum() / request-rounds``: what a user gets
      per round, consistent with the returned tokens;
    - ``acceptance_length``: mean of (accepted drafts + 1) per request-round, before any cut at a stop
      token or ``max_new_tokens`` (the DDTree paper's acceptance length, for research);
    - ``mean_expected``: mean exact expected accepted drafts per request-round (bonus excluded);
    - ``mean_tree_size``: mean tree nodes a request-round verified, root included.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    rounds: list[RoundStats]
    seconds: float

    def _live(self) -> np.ndarray:
        return np.concatenate([r.accepted >= 0 for r in self.rounds]) if self.rounds else np.zeros(0, bool)

    @property
    def request_rounds(self) -> int:
        """Rounds summed over requests, each counted while it was live."""
        return int(self._live().sum())

    @property
    def tau(self) -> float:
        """Tokens returned per request-round."""
        return float(self.lengths.sum() / self.request_rounds) if self.request_rounds else float("nan")

    @property
    def acceptance_length(self) -> float:
        """Mean accepted drafts + 1 per request-round, unaffected by stop tokens and ``max_new_tokens``."""
        accepted = np.concatenate([r.accepted for r in self.rounds])[self._live()] if self.rounds else []
        return float(np.mean(accepted + 1)) if len(accepted) else float("nan")

    @property
    def mean_expected(self) -> float:
        """Mean exact expected accepted drafts per request-round (bonus excluded)."""
        values = np.concatenate([r.expected for r in self.rounds])[self._live()] if self.rounds else []
        return float(np.mean(values)) if len(values) else float("nan")

    @property
    def mean_tree_size(self) -> float:
        """Mean verified tree nodes (root included) per request-round."""
        values = np.concatenate([r.tree_size for r in self.rounds])[self._live()] if self.rounds else []
        return float(np.mean(values)) if len(values) else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return float(self.lengths.sum() / self.seconds) if self.seconds > 0 else float("nan")

    def summary(self) -> dict:
        """Machine-readable statistics (used by the CLI's ``--json``); see the class docstring."""
        return {
            "tau": self.tau,
            "acceptance_length": self.acceptance_length,
            "expected_accepted": self.mean_expected,
            "mean_tree_size": self.mean_tree_size,
            "rounds": len(self.rounds),
            "request_rounds": self.request_rounds,
            "tokens": int(self.lengths.sum()),
            "tokens_per_s": self.tokens_per_s,
            "seconds": self.seconds,
        }


def _trivial_tree(root_B) -> DraftTree:
    """The AR "tree": the root alone."""
    batch = root_B.shape[0]
    zeros = jnp.zeros((batch, 1), jnp.int32)
    return DraftTree(root_B[:, None], zeros - 1, zeros, zeros.astype(jnp.float32),
                     jnp.ones((batch,), jnp.int32), max_depth=0)


def _draft_tree(target, drafter, state, spec: RoundSpec, draft_temperature, mesh):
    """Steps 1–2: drafter forward (appending last round's context) and tree construction."""
    lengths = state.target_cache.lengths
    c = state.ctx_feats.shape[1]
    ctx_positions = (lengths - state.ctx_count)[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    with jax.named_scope("draft"):
        draft_logits, drafter_cache = drafter_forward(
            drafter, target, state.drafter_cache, state.ctx_feats, ctx_positions, state.ctx_count,
            state.root, lengths, attention_impl=spec.attention_impl, matmul_impl=spec.matmul_impl, mesh=mesh)
        draft_logits = sharding.gather_vocab(draft_logits, mesh)
    with jax.named_scope("build"):
        tree = kernels.tree_build_fn(spec.build_impl, mesh)(draft_logits, state.root, draft_temperature,
                                                            budget=spec.tree_budget, topk_cap=spec.topk_cap)
        if drafter.params.draft_ids is not None:
            tree = with_token_ids(tree, drafter.params.draft_ids)
        if spec.budget_policy == "adaptive":
            tree = policies.keep_prefix(tree, policies.adaptive_keep(tree.logw, tree.num_nodes,
                                                                     jnp.asarray(spec.cost_ms)))
        elif spec.budget_policy == "batch":
            tree = policies.keep_prefix(tree, policies.batch_keep(tree.logw, tree.num_nodes, ~state.done,
                                                                  spec.budget))
    return tree, drafter_cache


def _verify_forward(target, tree: DraftTree, cache: KVCache, spec: RoundSpec, mesh):
    """Step 3: the target over every request's tree, after the tree's positions and mask (traced in the
    ``encode`` scope); ``"batch"`` packs the kept nodes into ``B x (budget + 1)`` rows for the forward
    and unpacks its logits and taps to the tree layout."""
    with jax.named_scope("encode"):
        positions, mask = tree_positions(tree, cache.lengths), tree_attention_mask(tree)
    kw = dict(tap_layers=spec.tap_layers, attention_impl=spec.attention_impl, matmul_impl=spec.matmul_impl, mesh=mesh)
    if spec.budget_policy != "batch":
        return target_forward(target, tree.tokens, positions, mask, cache, **kw)
    batch, slots = tree.tokens.shape
    row_M, slot_M, packed_BN = policies.packing(tree.num_nodes, slots, batch * (spec.budget + 1))
    pack = lambda x_BN: x_BN[jnp.minimum(row_M, batch - 1), slot_M][None]  # noqa: E731
    logits, taps, cache = target_forward_packed(target, pack(tree.tokens), pack(positions), row_M, slot_M, mask,
                                                cache, **kw)
    unpack = lambda x_1MX: x_1MX[0, jnp.maximum(packed_BN, 0)]  # noqa: E731  (nodes not kept: never read)
    return unpack(logits), unpack(taps), cache


def _append_tokens(state, emitted_BD, count_B, stop_tokens, max_new_tokens):
    """Write this round's emitted tokens after each live request's output, truncating at a stop token
    and at ``max_new_tokens``."""
    depth = emitted_BD.shape[1]
    pos = jnp.arange(depth)[None, :]
    valid = (pos < count_B[:, None]) & ~state.done[:, None]
    is_stop = jnp.isin(emitted_BD, stop_tokens) & valid
    first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), depth)
    room = max_new_tokens - state.num_generated
    count = jnp.where(state.done, 0, jnp.minimum(jnp.minimum(count_B, first_stop + 1), room))
    keep = pos < count[:, None]
    rows = jnp.arange(emitted_BD.shape[0])[:, None]
    slots = jnp.where(keep, state.num_generated[:, None] + pos, state.tokens.shape[1])
    tokens = state.tokens.at[rows, slots].set(emitted_BD, mode="drop")
    num_generated = state.num_generated + count
    done = state.done | (first_stop < count_B) | (num_generated >= max_new_tokens)
    return tokens, num_generated, done


def _round(target: Target, drafter: Drafter | None, state: DecodeState, sampling: SamplingParams, key,
           request_ids, draft_temperature, stop_tokens, *, spec: RoundSpec, max_new_tokens: int,
           with_expected: bool = True, mesh: Mesh | None = None):
    """One round for every request (see the module docstring). Returns the new state and
    ``(accepted [B], emitted [B], tree_size [B], expected [B])`` (see `RoundStats`). With a ``mesh``,
    the state keeps the layout of `sharding.state_shardings` (see `ddtree_jax.sharding`). Its steps run
    in the named scopes of `ROUND_PARTS`."""
    live = ~state.done
    if spec.method == "ar":
        tree, drafter_cache = _trivial_tree(state.root), state.drafter_cache
    else:
        tree, drafter_cache = _draft_tree(target, drafter, state, spec, draft_temperature, mesh)
    with jax.named_scope("verify"):
        logits, taps, target_cache = _verify_forward(target, tree, state.target_cache, spec, mesh)
        logits = sharding.gather_vocab(logits, mesh)
    with jax.named_scope("sample"):
        keys = request_keys(key, request_ids, state.round)
        coins, final_coins = coins_from_keys(keys, spec.num_nodes)
        res = kernels.sampler_fn(spec.sampler_impl, mesh)(tree, logits, coins, final_coins, sampling.temperature,
                                                          sampling.top_k, sampling.top_p)
    with jax.named_scope("commit"):
        num_keep = jnp.where(live, res.num_accepted + 1, 0)
        target_cache = commit(target_cache, res.accept_index, num_keep)
        if spec.method != "ar":
            rows = jnp.arange(taps.shape[0])[:, None]
            ctx_feats = taps[rows, jnp.maximum(res.accept_index, 0)]
        else:
            ctx_feats = state.ctx_feats
        tokens, num_generated, done = _append_tokens(state, res.emitted, res.num_accepted + 1, stop_tokens,
                                                     max_new_tokens)
    with jax.named_scope("stats"):
        if with_expected:
            probs = batch_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            expected = expected_acceptance(tree, probs)
        else:
            expected = jnp.zeros(live.shape, jnp.float32)
    new_state = DecodeState(target_cache, drafter_cache, jnp.where(live, res.bonus, state.root), ctx_feats,
                            num_keep, tokens, num_generated, done, state.round + 1)
    stats = (jnp.where(live, res.num_accepted, -1), num_generated - state.num_generated, tree.num_nodes, expected)
    return sharding.constrain_state(new_state, mesh), stats


_ROUND_STATICS = ("spec", "max_new_tokens", "with_expected", "mesh")


@functools.partial(jax.jit, static_argnames=_ROUND_STATICS, donate_argnums=(2,))
def decode_round(*args, **kwargs):
    """One jitted round (`_round`, same arguments) with the state donated: what benchmarks time."""
    return _round(*args, **kwargs)


@functools.partial(jax.jit, static_argnames=(*_ROUND_STATICS, "chunk"), donate_argnums=(2,))
def decode_rounds(target: Target, drafter: Drafter | None, state: DecodeState, sampling: SamplingParams, key,
                  request_ids, draft_temperature, stop_tokens, limit, *, spec: RoundSpec, max_new_tokens: int,
                  with_expected: bool = True, mesh: Mesh | None = None, chunk: int):
    """Up to ``limit <= chunk`` rounds (``limit`` traced) in one device loop, ending early once every
    request is done: no host round trip between rounds. Returns the state, the rounds' statistics
    (each ``[chunk, B]``, in the order of `_round`'s; rows past the rounds run hold ``-1`` / 0) and
    the number of rounds run."""
    batch = state.root.shape[0]
    empty = (jnp.full((chunk, batch), -1, jnp.int32), jnp.zeros((chunk, batch), jnp.int32),
             jnp.zeros((chunk, batch), jnp.int32), jnp.zeros((chunk, batch), jnp.float32))

    def body(carry):
        i, state, stats = carry
        state, round_stats = _round(target, drafter, state, sampling, key, request_ids, draft_temperature,
                                    stop_tokens, spec=spec, max_new_tokens=max_new_tokens,
                                    with_expected=with_expected, mesh=mesh)
        return i + 1, state, tuple(s.at[i].set(r) for s, r in zip(stats, round_stats))

    count, state, stats = jax.lax.while_loop(lambda c: (c[0] < jnp.minimum(limit, chunk)) & ~jnp.all(c[1].done),
                                             body, (jnp.int32(0), state, empty))
    return state, stats, count


@functools.partial(jax.jit, static_argnames=("spec", "max_len", "max_new_tokens", "mesh"))
def prefill(target: Target, drafter: Drafter | None, prompt_BT, prompt_len_B, *, spec: RoundSpec, max_len: int,
            max_new_tokens: int, mesh: Mesh | None = None) -> DecodeState:
    """Commit all prompt tokens but the last (the first round's root) and seed the drafter context."""
    batch, length = prompt_BT.shape
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim, target.dtype)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
    _, taps, cache = target_forward(target, prompt_BT, positions, causal, cache, tap_layers=spec.tap_layers,
                                    attention_impl=spec.attention_impl, matmul_impl=spec.matmul_impl, mesh=mesh)
    committed = prompt_len_B - 1
    cache = commit(cache, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)), committed)
    root = prompt_BT[jnp.arange(batch), committed]
    drafter_cache = None
    if drafter is not None:
        dc = drafter.config
        # a round writes up to block_size context rows, then its block after them (`drafter_forward`)
        drafter_cache = init_cache(dc.num_hidden_layers, batch, dc.num_key_value_heads, max_len + dc.block_size,
                                   dc.head_dim, drafter.dtype)
        drafter_cache = append_context(drafter, drafter_cache, taps, positions, committed,
                                       kernels.matmul_fn(spec.matmul_impl, mesh),
                                       kernels.kv_write_fn(spec.attention_impl, mesh))
    feats = taps.shape[-1]
    state = DecodeState(
        target_cache=cache,
        drafter_cache=drafter_cache,
        root=root.astype(jnp.int32),
        ctx_feats=jnp.zeros((batch, spec.depth + 1, feats), taps.dtype),
        ctx_count=jnp.zeros((batch,), jnp.int32),
        tokens=jnp.full((batch, max_new_tokens + spec.depth + 1), -1, jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        round=jnp.zeros((), jnp.int32),
    )
    return sharding.constrain_state(state, mesh)


def _pad_prompts(prompt_ids, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad a batch of prompts; validate that each is a non-empty list of ids < vocab."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        if prompt_ids.ndim != 2:
            raise ValueError(f"prompt_ids must be [batch, T] or a list of sequences, got shape {prompt_ids.shape}")
        prompt_ids = [list(row) for row in np.asarray(prompt_ids)]
    if not isinstance(prompt_ids, Sequence) or not prompt_ids:
        raise ValueError("prompt_ids must be a non-empty batch of token id sequences")
    rows = []
    for i, row in enumerate(prompt_ids):
        arr = np.asarray(row)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"prompt_ids[{i}] must be a non-empty sequence of token ids, got {row!r}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt_ids[{i}] must hold integer token ids, got dtype {arr.dtype}")
        checks.token_range(f"prompt_ids[{i}]", arr, vocab)
        rows.append(arr.astype(np.int32))
    lengths = np.array([len(r) for r in rows], np.int32)
    padded = np.zeros((len(rows), lengths.max()), np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return padded, lengths


def _resolve_impls(attention_impl: str, sampler_impl: str, matmul_impl: str, build_impl: str) -> tuple[str, ...]:
    """Validate the kernel switches (see `ddtree_jax.kernels`)."""
    kernels.check_impl("attention_impl", attention_impl)
    kernels.check_impl("matmul_impl", matmul_impl)
    kernels.check_impl("sampler_impl", sampler_impl)
    kernels.check_impl("build_impl", build_impl)
    return attention_impl, sampler_impl, matmul_impl, build_impl


def make_spec(target: Target, drafter: Drafter | None, method: str, budget: int, topk_cap: int | None,
              attention_impl: str = "xla", sampler_impl: str = "xla", matmul_impl: str = "xla",
              budget_policy: str = "fixed", build_impl: str = "xla") -> RoundSpec:
    """Validate the method, tree settings, kernel switches and budget policy against the models; return
    the round's static spec (``"adaptive"``: with the flat cost, which keeps every node; `generate`
    puts the cost table's ``budget + 1`` round times in ``cost_ms``)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    impls = _resolve_impls(attention_impl, sampler_impl, matmul_impl, build_impl)
    policies.check_policy(budget_policy)
    if budget_policy != "fixed" and method != "ddtree":
        raise ValueError(f"budget_policy={budget_policy!r} needs method 'ddtree', got method {method!r}")
    if method == "ar":
        return RoundSpec("ar", 1, None, 0, (), *impls)
    if drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")
    check_pair(drafter, target)
    dc = drafter.config
    depth = dc.block_size - 1
    budget = checks.positive_int("budget", budget, maximum=max_budget(budget_policy))
    if method == "chain":
        budget, topk_cap = depth, 1
    elif topk_cap is not None:
        topk_cap = checks.positive_int("topk_cap", topk_cap)
    cost_ms = (1.0,) * (budget + 1) if budget_policy == "adaptive" else None
    return RoundSpec(method, budget, topk_cap, depth, tuple(dc.target_layer_ids), *impls, budget_policy, cost_ms)


def max_budget(budget_policy: str = "fixed") -> int:
    """The largest DDTree ``budget`` under ``budget_policy``: the tree build's limit, shared under
    ``"batch"`` by up to `budget.BATCH_SPREAD` x ``budget`` drafts a request."""
    return MAX_BUDGET // (policies.BATCH_SPREAD if budget_policy == "batch" else 1)


def generate(
    target: Target,
    drafter: Drafter | None,
    prompt_ids,
    *,
    method: str = "ddtree",
    budget: int = 16,
    topk_cap: int | None = 4,
    draft_temperature: float = 1.0,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    max_new_tokens: int = 64,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] = (),
    request_ids=None,
    max_len: int | None = None,
    with_expected: bool = True,
    attention_impl: str = "auto",
    sampler_impl: str = "auto",
    matmul_impl: str = "auto",
    build_impl: str = "auto",
    on_round: Callable[[np.ndarray, np.ndarray, RoundStats], None] | None = None,
    mesh: Mesh | None = None,
    chunk_rounds: int = 16,
    budget_policy: str = "fixed",
    cost_table: costs.CostTable | str | None = None,
    on_compile: Callable[[], None] | None = None,
) -> GenerateResult:
    """Generate up to ``max_new_tokens`` per request with AR, DFlash chain or DDTree decoding.

    Args:
      target, drafter: the models (``drafter`` may be ``None`` for ``method="ar"``).
      prompt_ids: a batch of non-empty token id sequences (ragged lists or ``[batch, T]``).
      method: ``"ar"`` | ``"chain"`` (the drafter's argmax per slot: DDTree with ``topk_cap = 1``) |
        ``"ddtree"``.
      budget, topk_cap, draft_temperature: DDTree settings (ignored by AR; chain uses budget L, cap 1).
      temperature, top_k, top_p: scalars or ``[batch]``; ``temperature = 0`` is greedy.
      key: ``jax.random`` key (default ``key(0)``); request b draws from
        ``fold_in(fold_in(key, request_ids[b]), round)``.
      stop_tokens: token ids (a sequence, possibly empty); generation of a request ends after it emits one
        of these.
      request_ids: int ``[batch]`` in ``[0, 2**31)``, default ``arange(batch)``.
      max_len: KV cache slots per request (default: just enough; at most the target's
        ``max_position_embeddings`` + the tree's nodes + 1, the most a request can use).
      with_expected: compute the exact expected acceptance per round (costs a full target law per node).
      attention_impl: ``"auto" | "xla" | "pallas" | "interpret"``: the Pallas tree-attention kernel on a
        supported GPU (auto; per device inside ``shard_map`` with a ``mesh``), the XLA path, or the kernel
        run by the Pallas interpreter (slow, for tests).
      sampler_impl: ``"auto" | "xla" | "pallas"``: the fused Pallas tree sampler on a supported GPU
        without a mesh (auto), the jnp sampler (elsewhere, or ``"xla"``), see `ddtree_jax.kernels`.
      matmul_impl: the projections (``"auto" | "xla" | "pallas" | "interpret"``): XLA's GEMMs (auto,
        measured the fastest; products of few rows padded on the GPUs listed in `kernels.XLA_MIN_ROWS`),
        or the Pallas skinny matmul; see `ddtree_jax.kernels`.
      build_impl: the tree build's beam and global order (``"auto" | "xla" | "pallas" | "interpret"``):
        the Pallas tree-build kernel for the budgets it is measured faster at on a supported GPU without
        a mesh (auto), XLA elsewhere; see `ddtree_jax.kernels`. Trees do not depend on it.
      on_round: called for each round with ``(tokens [B, *], num_generated [B], stats)`` (host arrays:
        the tokens generated up to that round, ``-1`` after them), e.g. to stream text. After the first
        round, rounds run ``chunk_rounds`` at a time in one device loop, so the calls of a chunk come
        together after it.
      mesh: a ``("dp", "tp")`` device mesh (`sharding.make_mesh`): the target runs tensor-parallel over
        ``"tp"``, requests are split over ``"dp"`` (see `ddtree_jax.sharding`); tokens do not depend on it.
      chunk_rounds: rounds per device loop (`decode_rounds`); the host reads the state once per chunk.
        Tokens do not depend on it.
      budget_policy: which nodes of each tree a round verifies (`ddtree_jax.budget`; DDTree only):
        ``"fixed"`` all ``budget`` of them; ``"adaptive"`` per request and round the prefix of its tree
        with the most expected tokens per modelled unit of round time (``budget`` is the most); ``"batch"``
        ``budget`` per live request in total, to the most probable prefixes over the whole batch (a
        request may take up to ``budget.BATCH_SPREAD x budget``; the verify forward keeps its
        ``batch x (budget + 1)`` rows; not with a mesh whose ``"dp"`` axis is larger than 1).
      cost_table: the ``"adaptive"`` cost model (`ddtree_jax.costs`): a `costs.CostTable`, a JSON path or
        the name of a shipped table; default the local device's (none: flat, which keeps every node).
        Its curve for the batch size and the final context (longest prompt + ``max_new_tokens``). Checked
        whenever given; the other policies do not use it.
      on_compile: called once every argument has been checked, before the prefill and the rounds compile
        (e.g. to say that they do); a bad argument raises ``ValueError`` before it.

    Returns:
      ``GenerateResult`` (tokens ``[batch, max_new_tokens]``, ``-1`` padded; lengths; statistics).
    """
    checks.prompt_batch("prompt_ids", prompt_ids)
    checks.random_key("key", key)
    checks.callback("on_round", on_round)
    checks.callback("on_compile", on_compile)
    with_expected = checks.boolean("with_expected", with_expected)
    spec = make_spec(target, drafter, method, budget, topk_cap, attention_impl, sampler_impl, matmul_impl,
                     budget_policy, build_impl)
    max_new_tokens = checks.positive_int("max_new_tokens", max_new_tokens)
    chunk_rounds = checks.positive_int("chunk_rounds", chunk_rounds, maximum=4096)
    checks.draft_temperature(draft_temperature)
    prompt_BT, prompt_len_B = _pad_prompts(prompt_ids, target.config.vocab_size)
    batch = prompt_BT.shape[0]
    table = costs.resolve(cost_table) if cost_table is not None or spec.budget_policy == "adaptive" else None
    if spec.budget_policy == "adaptive":
        cost_ms = table.round_costs(batch, prompt_BT.shape[1] + max_new_tokens, spec.budget)
        spec = dataclasses.replace(spec, cost_ms=cost_ms)
    t, k, p = checks.sampling_params(temperature, top_k, top_p, batch)
    if request_ids is None:
        request_ids = jnp.arange(batch, dtype=jnp.int32)
    else:  # request_ids[b] picks request b's random stream: non-negative int32s
        request_ids = jnp.asarray(checks.int_ids("request_ids", request_ids, low=0, high=2**31), jnp.int32)
    checks.same_leading("request_ids", request_ids, (batch,))
    stop = checks.int_ids("stop_tokens", stop_tokens, low=0, high=target.config.vocab_size)
    stop = np.asarray(stop if stop.size else [-2], np.int32)
    needed = int(prompt_BT.shape[1]) + max_new_tokens + spec.depth + spec.num_nodes + 1
    if max_len is None:
        max_len = needed
    elif checks.positive_int("max_len", max_len) < needed:
        raise ValueError(f"max_len={max_len} is too small: prompts of up to {prompt_BT.shape[1]} tokens plus "
                         f"max_new_tokens={max_new_tokens} and a tree of {spec.num_nodes} nodes need {needed} slots")
    elif max_len > (most := target.config.max_position_embeddings + spec.num_nodes + 1):
        raise ValueError(f"max_len={max_len} exceeds the {most} slots a request can use (the target's "
                         f"max_position_embeddings={target.config.max_position_embeddings} and a tree of "
                         f"{spec.num_nodes} nodes): a larger cache is never written")
    last_position = int(prompt_BT.shape[1]) + max_new_tokens + spec.depth
    if last_position > target.config.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_BT.shape[1]} + max_new_tokens {max_new_tokens} (+ {spec.depth} "
                         f"draft positions) exceeds the target's max_position_embeddings="
                         f"{target.config.max_position_embeddings}")
    key = jax.random.key(0) if key is None else key
    drafter = None if spec.method == "ar" else drafter
    prompt_BT, prompt_len_B = jnp.asarray(prompt_BT), jnp.asarray(prompt_len_B)
    if mesh is not None:
        sharding.check_mesh(mesh, target.config, batch)
        if spec.budget_policy == "batch" and mesh.shape["dp"] > 1:
            raise ValueError(f"budget_policy='batch' packs the whole batch's nodes into one block of rows and "
                             f"does not run with the requests split over dp={mesh.shape['dp']} devices")
        target = sharding.shard_target(target, mesh)
        drafter = None if drafter is None else sharding.shard_drafter(drafter, mesh)
        prompt_BT, prompt_len_B, t, k, p, request_ids = sharding.shard_batch(
            (prompt_BT, prompt_len_B, t, k, p, request_ids), mesh)
    if on_compile is not None:
        on_compile()
    state = prefill(target, drafter, prompt_BT, prompt_len_B, spec=spec, max_len=max_len,
                    max_new_tokens=max_new_tokens, mesh=mesh)
    args = (SamplingParams(t, k, p), key, request_ids, jnp.float32(draft_temperature), jnp.asarray(stop))
    rounds_fn = decode_rounds.lower(target, drafter, state, *args, jnp.int32(1), spec=spec,
                                    max_new_tokens=max_new_tokens, with_expected=with_expected, mesh=mesh,
                                    chunk=chunk_rounds).compile()
    jax.block_until_ready(state)  # the prefill is not part of the rounds' time
    rounds, start = [], time.perf_counter()
    while True:
        tick = time.perf_counter()
        # The first loop runs one round, so that the first tokens stream without waiting for a chunk.
        state, stats, count = rounds_fn(target, drafter, state, *args, jnp.int32(chunk_rounds if rounds else 1))
        count, done = int(count), np.asarray(state.done)
        accepted, emitted, tree_size, expected = (np.asarray(x)[:count] for x in stats)
        seconds = (time.perf_counter() - tick) / max(count, 1)
        tokens = np.asarray(state.tokens) if on_round is not None else None
        generated = np.asarray(state.num_generated) - emitted[::-1].cumsum(0)[::-1] + emitted
        for r in range(count):
            rounds.append(RoundStats(accepted[r], emitted[r], tree_size[r], expected[r], seconds))
            if on_round is not None:
                so_far = np.where(np.arange(tokens.shape[1])[None, :] < generated[r][:, None], tokens, -1)
                on_round(so_far, generated[r], rounds[-1])
        if done.all():
            break
    seconds = time.perf_counter() - start
    lengths = np.asarray(state.num_generated)
    tokens = np.asarray(state.tokens)[:, :max_new_tokens]
    tokens = np.where(np.arange(max_new_tokens)[None, :] < lengths[:, None], tokens, -1)
    return GenerateResult(tokens=tokens, lengths=lengths, rounds=rounds, seconds=seconds)
