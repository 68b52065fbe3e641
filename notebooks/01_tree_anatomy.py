# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 01 · Anatomy of a DDTree round
#
# One round on a real held-out prompt with the embedded stdlib pair: the drafter's per-depth
# marginals, the DDTree built from them, its first-child / next-sibling (FCNS) arrays, the tree
# attention mask, the target's logits at every node in one masked forward pass, and the verified path.
#
# Runs top to bottom with `python notebooks/01_tree_anatomy.py` (figures go to
# `$DDTREE_NOTEBOOK_OUT`, default `notebooks/figures/`); `DDTREE_NOTEBOOK_SMALL=1` shrinks the tree.

# %%
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] if "__file__" in globals() else Path.cwd().resolve().parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import ddtree_jax as dd  # noqa: E402
from ddtree_jax.assets import DRAFTER_DIR, TARGET_DIR  # noqa: E402
from ddtree_jax.experiments import corpus  # noqa: E402
from ddtree_jax.models import target_forward_nocache  # noqa: E402
from ddtree_jax.tokenizer import Tokenizer  # noqa: E402

SMALL = os.environ.get("DDTREE_NOTEBOOK_SMALL") == "1"
OUT = Path(os.environ.get("DDTREE_NOTEBOOK_OUT", ROOT / "notebooks" / "figures"))
OUT.mkdir(parents=True, exist_ok=True)
BUDGET = 10 if SMALL else 24

target, drafter = dd.load_target(TARGET_DIR, jnp.float32), dd.load_drafter(DRAFTER_DIR, jnp.float32)
tok = Tokenizer.from_file(TARGET_DIR / "tokenizer.json")
prompt = corpus.heldout_prompts(tok, 1, 48, seed=3)[0]
print(tok.decode(prompt))


def show(token_id) -> str:
    """A token's text, escaped so that whitespace is visible."""
    return repr(tok.decode([int(token_id)]))[1:-1]


# %% [markdown]
# ## The drafter's marginals
#
# The DFlash drafter sees the prompt (through the target's hidden features) and a block
# `[root, MASK x 15]`, where the root is the last prompt token. In one forward pass it returns
# `L = 15` rows of logits: row `d` is its distribution of the token `d + 1` positions after the root,
# *independent* of the tokens drafted before it (a factorised distribution).

# %%
draft_logits_1LV = dd.drafter_logits(drafter, target, jnp.asarray(prompt)[None])
marginals_LV = np.asarray(jax.nn.softmax(draft_logits_1LV[0], axis=-1))
TOP = 6
order_LK = np.argsort(-marginals_LV, axis=-1)[:, :TOP]
probs_LK = np.take_along_axis(marginals_LV, order_LK, axis=-1)
for d in range(5):
    print(f"depth {d + 1}: " + "  ".join(f"{show(t)!r}:{p:.2f}" for t, p in zip(order_LK[d], probs_LK[d])))

fig, ax = plt.subplots(figsize=(9, 6))
ax.imshow(probs_LK, cmap="Blues", vmin=0, vmax=1, aspect="auto")
for d in range(probs_LK.shape[0]):
    for r in range(TOP):
        ax.text(r, d, f"{show(order_LK[d, r])[:10]}\n{probs_LK[d, r]:.2f}", ha="center", va="center", fontsize=6.5)
ax.set(xlabel="rank", ylabel="depth", yticks=range(probs_LK.shape[0]), yticklabels=range(1, probs_LK.shape[0] + 1),
       title="drafter marginals: top tokens per depth")
fig.tight_layout()
fig.savefig(OUT / "01_marginals.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## The tree
#
# `build_tree` keeps the `B` most probable prefixes under that factorised distribution (DDTree's
# best-first search). Nodes come in pop order: non-increasing cumulative log-probability `logw`,
# so a parent always precedes its children and siblings are ordered by draft probability.

# %%
tree = dd.build_tree(draft_logits_1LV, jnp.asarray(prompt[-1:]), budget=BUDGET)
tokens_N, parents_N = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
depths_N, logw_N = np.asarray(tree.depths[0]), np.asarray(tree.logw[0])
print(" node  parent depth  draft prob  token")
for k in range(len(tokens_N)):
    print(f"{k:5d} {parents_N[k]:7d} {depths_N[k]:5d} {np.exp(logw_N[k]):11.4f}  {show(tokens_N[k])!r}")
assert np.all(parents_N[1:] < np.arange(1, len(tokens_N))), "parents precede children"
assert np.all(np.diff(logw_N) <= 1e-6), "pop order: non-increasing logw"


# %%
def tree_layout(parents_N) -> np.ndarray:
    """y coordinate of every node: leaves in depth-first order, a parent centred on its children."""
    children = {k: [] for k in range(len(parents_N))}
    for k, p in enumerate(parents_N[1:], start=1):
        children[int(p)].append(k)
    y, next_leaf = np.zeros(len(parents_N)), [0.0]

    def place(k):
        if not children[k]:
            y[k], next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        else:
            for c in children[k]:
                place(c)
            y[k] = np.mean([y[c] for c in children[k]])

    place(0)
    return y


y_N = tree_layout(parents_N)
fig, ax = plt.subplots(figsize=(10, 0.32 * y_N.max() + 2))
for k in range(1, len(tokens_N)):
    p = parents_N[k]
    ax.plot([depths_N[p], depths_N[k]], [y_N[p], y_N[k]], color="gray", linewidth=0.8, zorder=1)
sc = ax.scatter(depths_N, y_N, c=logw_N, cmap="viridis", s=60, zorder=2)
for k in range(len(tokens_N)):
    ax.annotate(f"{k}: {show(tokens_N[k])[:14]}", (depths_N[k], y_N[k]), xytext=(6, 3),
                textcoords="offset points", fontsize=7)
ax.invert_yaxis()
ax.set(xlabel="depth", xticks=range(depths_N.max() + 1), yticks=[],
       title=f"DDTree, budget {BUDGET} (node: pop index and token)")
fig.colorbar(sc, ax=ax, label="logw: draft log-probability of the path")
fig.tight_layout()
fig.savefig(OUT / "01_tree.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## FCNS arrays and the attention mask
#
# The verifier walks the tree through two arrays: `next_token[k]` (first child of `k`) and
# `next_sibling[k]` (`-1` = none), as in SGLang/EAGLE. The mask lets node `i` see node `j` iff `j`
# is `i` or one of its ancestors; positions are `prefix length + depth`.

# %%
retrieve = dd.compile_retrieve(tree)
next_token_N, next_sibling_N = np.asarray(retrieve.next_token[0]), np.asarray(retrieve.next_sibling[0])
print("next_token  ", next_token_N.tolist())
print("next_sibling", next_sibling_N.tolist())
print("index       ", np.asarray(retrieve.index[0]).tolist())
for k in range(len(tokens_N)):  # the FCNS arrays describe exactly the parent array
    child = next_token_N[k]
    while child != -1:
        assert parents_N[child] == k
        child = next_sibling_N[child]

mask_NN = np.asarray(dd.tree_attention_mask(tree)[0])
ancestors = [{k} for k in range(len(tokens_N))]
for k in range(1, len(tokens_N)):
    ancestors[k] |= ancestors[parents_N[k]]
assert all(mask_NN[i, j] == (j in ancestors[i]) for i in range(len(tokens_N)) for j in range(len(tokens_N)))

fig, ax = plt.subplots(figsize=(5, 5))
ax.imshow(mask_NN, cmap="Greys")
ax.set(xlabel="key node j", ylabel="query node i", title="tree attention mask (i sees j)")
fig.tight_layout()
fig.savefig(OUT / "01_mask.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## Verification: the whole tree in one target pass
#
# The target reads the prompt (causal) followed by the tree tokens (node 0 is the last prompt token)
# with the tree mask, at positions `prefix + depth`. The logits of node `k` equal those of an
# ordinary causal pass over the prompt followed by `k`'s path; we check that for every node.

# %%
prefix = len(prompt) - 1
n = len(tokens_N)
tokens_1S = jnp.asarray(np.concatenate([prompt[:-1], tokens_N]))[None]
positions_1S = jnp.asarray(dd.tree_positions(tree, jnp.asarray([prefix])))
positions_1S = jnp.concatenate([jnp.arange(prefix, dtype=jnp.int32)[None], positions_1S], axis=1)
mask_SS = np.zeros((prefix + n, prefix + n), bool)
mask_SS[:prefix, :prefix] = np.tril(np.ones((prefix, prefix), bool))
mask_SS[prefix:, :prefix] = True
mask_SS[prefix:, prefix:] = mask_NN
logits_1SV, _ = target_forward_nocache(target, tokens_1S, positions_1S, jnp.asarray(mask_SS)[None])
node_logits_1NV = logits_1SV[:, prefix:]


def path_of(k) -> list[int]:
    path = []
    while k > 0:
        path.append(int(tokens_N[k]))
        k = parents_N[k]
    return path[::-1]


paths = [path_of(k) for k in range(n)]
width = len(prompt) + max(map(len, paths))
seqs_NS = np.zeros((n, width), prompt.dtype)  # right padding: causal logits before it are unaffected
for k, path in enumerate(paths):
    seqs_NS[k, : len(prompt) + len(path)] = np.concatenate([prompt, np.asarray(path, prompt.dtype)])
last_N = np.array([len(prompt) + len(path) - 1 for path in paths])
separate_NV = np.asarray(dd.target_logits(target, jnp.asarray(seqs_NS)))[np.arange(n), last_N]
np.testing.assert_allclose(separate_NV, node_logits_1NV[0], atol=2e-3)
print(f"tree pass = {n} separate causal passes (max |diff| within 2e-3)")

greedy = dd.verify(tree, node_logits_1NV, key=jax.random.key(0), temperature=0.0)
path = [int(i) for i in np.asarray(greedy.accept_index[0]) if i >= 0]
emitted = [int(t) for t in np.asarray(greedy.emitted[0]) if t >= 0]
print(f"greedy: accepted path {path} -> {int(greedy.num_accepted[0])} drafts + bonus; emitted "
      f"{tok.decode(emitted)!r}")
probs_1NV = dd.target_probs(node_logits_1NV, 1.0)
print(f"T = 1: exact expected accepted drafts of this tree = {float(dd.expected_acceptance(tree, probs_1NV)[0]):.3f}")
sampled = dd.verify(tree, node_logits_1NV, key=jax.random.key(1), temperature=1.0)
print(f"T = 1 sample: {int(sampled.num_accepted[0])} drafts accepted, emitted "
      f"{tok.decode([int(t) for t in np.asarray(sampled.emitted[0]) if t >= 0])!r}")
